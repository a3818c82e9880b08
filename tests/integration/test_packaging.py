"""Both installs work: the suite itself runs on the editable install; this builds the wheel
(`pip install .` installs exactly that) and checks its import names and data files."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import headfold

ROOT = Path(__file__).resolve().parents[2]


def test_suite_runs_on_the_editable_install() -> None:
    assert Path(headfold.__file__).resolve().is_relative_to(ROOT)
    for room in ("converter", "graphs", "plugins"):
        module = importlib.import_module(f"headfold.{room}")
        assert Path(module.__file__).resolve().parent == ROOT / room


@pytest.mark.slow
def test_wheel_installs_namespaced_packages(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", tmp_path, ROOT], check=True)
    (wheel,) = tmp_path.glob("headfold-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "headfold/converter/specs/llama.json" in names
    assert "headfold/graphs/export.py" in names and "headfold/plugins/__init__.py" in names
    assert not any(n.split("/")[0] in ("converter", "graphs", "plugins", "tests") for n in names)
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)

    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site, wheel], check=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import headfold, headfold.converter as c; print(headfold.__file__); print(len(c.supported_model_types()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    path, count = done.stdout.split()
    assert Path(path).is_relative_to(site) and int(count) >= 10
