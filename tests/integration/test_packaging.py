"""Both installs work: the suite itself runs on the editable install; the wheel (`pip install .`
installs exactly that) has the right import names and data files, and installed with its declared
dependencies alone into a fresh environment it runs convert → export → verify; with the `genai`
extra, the README's onnxruntime-genai snippet runs on that export as written.

pip honours PIP_CONSTRAINT: `scripts/test` sets it to requirements-lock.txt, so the fresh
environment resolves within the lock; `scripts/test --latest` leaves it unset (the newest versions)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.readme import readme_block

import headfold

ROOT = Path(__file__).resolve().parents[2]


def test_suite_runs_on_the_editable_install() -> None:
    assert Path(headfold.__file__).resolve().is_relative_to(ROOT)
    for room in ("converter", "graphs", "plugins"):
        module = importlib.import_module(f"headfold.{room}")
        assert Path(module.__file__).resolve().parent == ROOT / room


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", folder, ROOT], check=True)
    (built,) = folder.glob("headfold-*.whl")
    return built


@pytest.mark.slow
def test_wheel_installs_namespaced_packages(wheel: Path, tmp_path: Path) -> None:
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


@pytest.mark.slow
def test_plain_install_runs_convert_export_verify(wheel: Path, tmp_path: Path) -> None:
    """`pip install headfold` as a new user runs it: the wheel with its declared dependencies (resolved
    by pip, no extras) into a fresh venv holding only torch's CPU build, installed first the way
    scripts/setup does; then the installed `headfold` command on the embedded model."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python, headfold_cmd = venv / "bin" / "python", venv / "bin" / "headfold"
    quick = {**os.environ, "PIP_NO_COMPILE": "1"}  # no .pyc for all of torch up front: Python compiles what it imports
    subprocess.run(["bash", ROOT / "scripts" / "install-torch", python], check=True, env=quick)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", wheel], check=True, env=quick)
    listed = subprocess.run([python, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True, check=True).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert not {n for n in names if n.startswith("nvidia-")} and "tensorrt" not in names  # the CPU build stayed; no extra
    assert {"polygraphy", "onnxruntime", "transformers"} <= names and "pytest" not in names
    subprocess.run([python, "-m", "pip", "check"], check=True, capture_output=True)

    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # beside the other test worker on 2 cores: no oversubscription

    def headfold(*args: str) -> str:
        done = subprocess.run([headfold_cmd, *args], cwd=tmp_path, env=one_thread, capture_output=True, text=True)  # cwd: not the source tree
        assert done.returncode == 0, f"headfold {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
        return done.stdout

    where = "from headfold.demo import default_model_path as p; print(p())"
    model = subprocess.run([python, "-c", where], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(model).is_relative_to(venv)  # the model shipped inside the wheel
    headfold("convert", model, "gqa", "--kv-heads", "4", "-q")
    headfold("export", "gqa", "out/onnx", "-q")
    out = headfold("verify", "gqa", "out/onnx", "--max-rows", "4", "--decode-steps", "4")
    assert "fidelity-decode" in out and "all checks passed" in out  # ONNX Runtime through Polygraphy's runner, KV cache too

    assert "onnxruntime-genai" not in names  # the deploy runtime is the extra's
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"{wheel}[genai]"], check=True, env=quick)
    snippet = readme_block("Your model in five commands")  # the deploy block, on out/onnx as the README names it
    assert snippet.startswith("import onnxruntime_genai as og") and 'og.Model("out/onnx")' in snippet
    done = subprocess.run([python, "-c", snippet], cwd=tmp_path, env=one_thread, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("def fib(n):") and len(done.stdout) > len("def fib(n):")  # the prompt, then what the model generated
