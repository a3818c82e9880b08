"""The README's commands hold as written: the Python API section runs (on the embedded model, outputs in a
temporary folder) and meets its own budgets; step 5 names every budget verify applies by default
(the onnxruntime-genai snippet runs in tests/integration/test_packaging.py, where the extra is installed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.readme import readme_block, readme_section

from headfold.demo import default_model_path
from headfold.verification.budget import fidelity_budget, loss_budget

ROOT = Path(__file__).resolve().parents[2]


def test_step_5_names_the_budgets_verify_applies_by_default() -> None:
    text = " ".join(readme_section("Your model in five commands").split())  # one line: phrases may wrap
    assert "verify my-llama out/gqa-distilled --max-ppl-increase 2%" in text
    loss, fidelity = loss_budget(), fidelity_budget("fp32")
    named = [
        f"above KL {loss.max_kl:g}",
        f"below top-1 {loss.min_top1:.0%}",
        f"above perplexity +{loss.max_ppl_increase:.0%}",
        f"below cosine {loss.min_cosine:g}",
        f"atol {fidelity.atol:g}",
        f"rtol {fidelity.rtol:g}",
        f"below top-1 {fidelity.min_top1:.1%}",
        f"below cosine {fidelity.min_cosine:g}",
    ]
    assert [phrase for phrase in named if phrase not in text] == []


@pytest.mark.slow
def test_python_api_section_runs(tmp_path: Path) -> None:
    code = readme_block("Python API")
    assert '"headfold/data/default_model"' in code  # the path as a reader in the repository types it
    code = code.replace('"headfold/data/default_model"', repr(str(default_model_path())))
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}  # beside the other test worker on 2 cores: no oversubscription
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=one_thread, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("PASS conversion-loss") and "True" not in done.stdout  # under the block's own budgets; the table alone
    assert "torchvision" not in done.stderr and "Loading weights" not in done.stderr  # the command line's output policy: no library lines
    assert any(line.startswith("distill: ") and " steps × " in line for line in done.stderr.splitlines())  # its budget line, as the command prints it
    summary = json.loads((tmp_path / "out" / "onnx" / "export.json").read_text())
    assert summary["graphs"]["model.onnx"]["attention_nodes"] == 4  # one fused node per layer
    assert json.loads((tmp_path / "out" / "gqa-distilled" / "headfold.json").read_text())["distillation"]["steps"] > 0
