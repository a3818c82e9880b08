"""The README's Python API section runs as written (on the embedded model, outputs in a temporary folder)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from headfold.demo import default_model_path

ROOT = Path(__file__).resolve().parents[2]


def readme_block(section: str) -> str:
    """The first ```python block under the README heading `section`."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S).group(1)


@pytest.mark.slow
def test_python_api_section_runs(tmp_path: Path) -> None:
    code = readme_block("Python API")
    assert '"headfold/data/default_model"' in code  # the path as a reader in the repository types it
    code = code.replace('"headfold/data/default_model"', repr(str(default_model_path())))
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # beside the other test worker on 2 cores: no oversubscription
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=one_thread, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "conversion-loss" in done.stdout
    summary = json.loads((tmp_path / "out" / "onnx" / "export.json").read_text())
    assert summary["graphs"]["model.onnx"]["attention_nodes"] == 4  # one fused node per layer
    assert json.loads((tmp_path / "out" / "gqa-distilled" / "headfold.json").read_text())["distillation"]["steps"] > 0
