"""The one lazy-import helper: nothing loads until used, the pins are pyproject's, and a missing or
too-old module is bad input (exit 2) naming the pip command."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from headfold.ground import lazy
from headfold.ground.errors import BadInput

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [line for extra in project["optional-dependencies"].values() for line in extra]
    return {Requirement(line).name: str(Requirement(line).specifier) for line in lines}


@pytest.mark.parametrize(
    "module, distribution", [("tensorrt", "tensorrt"), ("onnxruntime_genai", "onnxruntime-genai"), ("accelerate", "accelerate"), ("yaml", "pyyaml")]
)
def test_the_pins_are_pyprojects(module: str, distribution: str) -> None:
    assert str(lazy.requirement(module).specifier) == _declared()[distribution] != ""


def test_nothing_is_imported_until_an_attribute_is_read() -> None:
    code = (
        "import sys, json\n"
        "from headfold.ground.lazy import lazy_import\n"
        "accelerate = lazy_import('accelerate')\n"
        "before = 'accelerate' in sys.modules\n"
        "version = accelerate.__version__\n"
        "print(json.dumps([before, 'accelerate' in sys.modules, version]))\n"
    )
    before, after, version = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert (before, after) == (False, True)
    assert lazy.requirement("accelerate").specifier.contains(version)  # the installed one is in range: no error


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here: its missing-module message is not reachable")
def test_a_missing_module_names_the_pip_command_with_its_range() -> None:
    trt = lazy.lazy_import("tensorrt")
    with pytest.raises(BadInput) as caught:
        _ = trt.Builder
    assert caught.value.exit_code == 2 and "\n" not in str(caught.value)
    assert str(caught.value).endswith(f"pip install 'tensorrt{_declared()['tensorrt']}'")


def test_a_too_old_module_names_the_pip_command_with_its_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lazy, "requirement", lambda module: Requirement(f"{module}>=999"))  # newer than any installed accelerate
    with pytest.raises(BadInput, match=r"^accelerate \S+ is installed, headfold needs >=999; pip install 'accelerate>=999'$"):
        lazy.load("accelerate")


def test_a_submodule_loads_through_its_package_pin() -> None:
    assert lazy.lazy_import("matplotlib.ticker").MaxNLocator.__module__ == "matplotlib.ticker"
