"""headfold run / demo on the embedded model: end to end on CPU, stage skipping, MQA gate, perplexity."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from headfold import convert, corpus
from headfold.cli import main
from headfold.demo import default_model_path
from headfold.pipeline import run
from headfold.verification import InputSpec, Thresholds, verify
from headfold.verification.inputs import cut_rows

EMBEDDED = default_model_path()
ROWS = InputSpec(max_rows=32)  # ~6k held-out bytes: enough for stable numbers, quick on 2 cores
METHOD = "aligned+grouped+refit"  # these tests are about the stages; the demo's runs the default method, local's fit included


@contextlib.contextmanager
def stage_lines() -> Iterator[list[str]]:
    """The lines headfold.pipeline logs (what `headfold run` prints) while the block runs."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("headfold.pipeline")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def unnumbered(line: str) -> str:
    """A stage's progress line without its "[2/4] " step."""
    return re.sub(r"^\[\d+/\d+\] ", "", line)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, list[str], object]:
    out = tmp_path_factory.mktemp("run") / "out"
    with stage_lines() as log:
        report = run(EMBEDDED, out, 4, method=METHOD, inputs=ROWS)
    return out, log, report


def test_perplexity_matches_an_independent_loop() -> None:
    """Our batched, padded, masked perplexity equals plain cross-entropy over each row alone."""
    spec = InputSpec(max_rows=12)
    (check,) = verify(EMBEDDED, EMBEDDED, inputs=spec, check="loss").checks
    model = transformers.AutoModelForCausalLM.from_pretrained(EMBEDDED, local_files_only=True).eval()
    ids = list(corpus.heldout_text().encode("utf-8"))
    nll, count = 0.0, 0
    with torch.no_grad():
        for row in cut_rows(ids, spec.window, spec.max_rows, spec.seed):
            tokens = torch.from_numpy(row)[None]
            logits = model(input_ids=tokens).logits[0, :-1].double()
            nll += float(F.cross_entropy(logits, tokens[0, 1:], reduction="sum"))
            count += len(row) - 1
    assert check.metrics["tokens"] == count
    assert check.metrics["reference_ppl"] == pytest.approx(np.exp(nll / count), rel=1e-5)
    assert check.metrics["kl"] == pytest.approx(0, abs=1e-9) and check.metrics["top1"] == 1.0


def test_mqa_against_a_tight_budget_exits_1_naming_the_metric(tmp_path: Path, capsys) -> None:
    mqa = convert(EMBEDDED, tmp_path / "mqa", 1, method="mean", progress=False)
    report = tmp_path / "r.json"
    code = main(
        ["verify", str(EMBEDDED), str(mqa), "--max-ppl-increase", "5%", "--max-kl", "10", "--min-top1", "0", "--max-rows", "32", "--report", str(report)]
    )
    assert code == 1
    data = json.loads(report.read_text())
    increase = data["checks"][0]["metrics"]["ppl_increase"]
    assert increase > 0.05 and not data["passed"]
    said = re.search(r"conversion-loss: ppl_increase = (\S+) > budget 0\.05", capsys.readouterr().err)
    assert said and float(said[1]) == pytest.approx(increase, rel=1e-3) and float(said[1]) > 0.05  # the digits that decide the gate


@pytest.mark.slow
def test_run_end_to_end(first_run) -> None:
    out, log, report = first_run
    assert [c.name for c in report.checks] == ["conversion-loss", "fidelity-onnx", "fidelity-onnx-decode"]
    loss, fidelity, decode = report.checks
    assert fidelity.passed and fidelity.metrics["max_abs_err"] < 1e-3 and fidelity.metrics["top1"] > 0.999
    assert decode.passed and decode.metrics["max_abs_err"] < 1e-3 and decode.candidate["runner"] == "onnxruntime:model.onnx"
    assert loss.candidate["kv_heads"] == 4 and loss.reference["kv_heads"] == 8
    assert loss.candidate["kv_cache_bytes_per_token"] * 2 == loss.reference["kv_cache_bytes_per_token"]
    assert 0 < loss.metrics["kl"] and loss.metrics["reference_ppl"] < loss.metrics["candidate_ppl"]
    for path in ("convert/headfold.json", "export/model.onnx", "export/genai_config.json", "verify/report.json", "verify/junit.xml", "verify/report.md"):
        assert (out / path).is_file(), path
    assert any(unnumbered(line).startswith("build: skipped, ") for line in log)
    assert report.stages == {"convert": "ran", "export": "ran", "build": report.stages["build"], "verify": "ran"}
    assert json.loads((out / "verify/report.json").read_text())["passed"] == report.passed


@pytest.mark.slow
def test_second_run_skips_stage_by_stage(first_run) -> None:
    out, _, first = first_run
    with stage_lines() as log:
        again = run(EMBEDDED, out, 4, method=METHOD, inputs=ROWS)
    assert [unnumbered(line).split(":")[0] for line in log if "unchanged, skipped" in line] == ["convert", "export", "verify"]
    assert again.to_dict()["checks"] == first.to_dict()["checks"]
    assert again.stages["verify"] == "skipped"

    with stage_lines() as log:
        looser = run(EMBEDDED, out, 4, method=METHOD, inputs=ROWS, thresholds=Thresholds(max_kl=5.0))  # only the budget changed
    assert [unnumbered(line).split(":")[0] for line in log if "unchanged, skipped" in line] == ["convert", "export"]
    assert looser.checks[0].budget["max_kl"] == 5.0


@pytest.mark.slow
def test_demo_passes_its_reference_budget(tmp_path: Path, capsys) -> None:
    """The README's first command: best training-free method, distilled, the shipped reference budget;
    with --keep its run folder stays, stage by stage."""
    code = main(["demo", "--keep", str(tmp_path / "demo")])
    out, err = capsys.readouterr()
    assert code == 0 and "conversion-loss: torch:default_model vs torch:distill" in out and "all checks passed" in out
    assert "fidelity-onnx: torch:distill vs onnxruntime:model.onnx" in out
    assert "PASS fidelity-onnx-decode: torch:distill vs onnxruntime:model.onnx" in out
    steps = [
        line.split("] ")[0] + "] " + unnumbered(line).split(" ")[0].rstrip(":") for line in err.splitlines() if line.startswith("[") and "done in" not in line
    ]
    assert steps == ["[1/5] convert", "[2/5] distill", "[3/5] export", "[4/5] build", "[5/5] verify"]  # stage progress (build: skipped without TensorRT)
    for kept in ("stages.json", "convert/headfold.json", "distill/distill-log.json", "export/model.onnx", "verify/report.json"):
        assert (tmp_path / "demo" / kept).is_file(), kept
