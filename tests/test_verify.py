"""headfold verify on tiny models: check selection, exact numbers, gates, reports, exit codes."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch
from polygraphy.exception import PolygraphyException

from headfold import convert
from headfold.cli import main
from headfold.graphs.export import export
from headfold.ground.errors import BadInput
from headfold.verification import InputSpec, verify
from headfold.verification.artifacts import check_kind, resolve
from headfold.verification.budget import fidelity_budget, load_budget_file, loss_budget, parse_fraction
from headfold.verification.checks import run_check
from headfold.verification.inputs import cut_rows, make_inputs, pad_batch
from headfold.verification.metrics import FidelityMeter, LossMeter, compare
from headfold.verification.runners import OnnxRuntimeRunner, Runner, TorchRunner

SPEC = InputSpec(window=32, max_rows=12, batch_size=4)  # tiny models have 64 positions
SMALL = ["--window", "32", "--max-rows", "12", "--batch-size", "4"]
LOSS_METRICS = {"reference_ppl", "candidate_ppl", "ppl_increase", "kl", "top1", "tokens"}
FIDELITY_METRICS = {"max_abs_err", "mean_abs_err", "max_rel_err", "rel_l2_err", "cosine", "min_cosine", "mismatched", "mismatched_fraction", "elements", "top1"}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """A byte-vocabulary tiny llama, its identity and 2-kv-head conversions, and the latter's ONNX export."""
    root = tmp_path_factory.mktemp("verify")
    src = tiny_checkpoint("llama", vocab_size=256)
    paths = {"src": src, "kv8": convert(src, root / "kv8", 8, progress=False), "kv2": convert(src, root / "kv2", 2, progress=False)}
    export(paths["kv2"], root / "kv2-onnx", progress=False, graphs="split")
    paths["onnx"] = root / "kv2-onnx"
    paths["other"] = tiny_checkpoint("llama", vocab_size=256, intermediate_size=64, seed=1)
    return paths


# --- pieces ----------------------------------------------------------------------------------


def test_fractions_and_budget_precedence(tmp_path: Path) -> None:
    assert parse_fraction("5%", "x") == pytest.approx(0.05) and parse_fraction(0.2, "x") == 0.2
    file = tmp_path / "budget.toml"
    file.write_text('[loss]\nmax_ppl_increase = "10%"\nmax_kl = 0.2\n[fidelity]\natol = 1e-3\n[fidelity.fp16]\natol = 0.05\n')
    data = load_budget_file(file)
    loss = loss_budget("fp32", data, max_kl=0.1)
    assert (loss.max_ppl_increase, loss.max_kl, loss.min_top1) == (pytest.approx(0.1), 0.1, 0.9)
    assert fidelity_budget("fp32", data).atol == 1e-3 and fidelity_budget("fp16", data).atol == 0.05
    assert fidelity_budget("fp16").rtol == 1e-2 and fidelity_budget("fp32").rtol == 1e-3
    yaml_file = tmp_path / "budget.yaml"
    yaml_file.write_text("loss:\n  max_kl: 0.3\n")
    assert loss_budget("fp32", load_budget_file(yaml_file)).max_kl == 0.3


@pytest.mark.parametrize(
    "content, suffix",
    [("[loss]\nmax_lk = 1\n", ".toml"), ("[loss\n", ".toml"), ("loss: [1, 2]\n", ".yaml"), ("[speed]\nx = 1\n", ".toml"), ("a", ".ini"), ('[loss]\nmax_kl = "-1"\n', ".toml")],
)
def test_bad_budget_files(tmp_path: Path, content: str, suffix: str) -> None:
    file = tmp_path / f"budget{suffix}"
    file.write_text(content)
    with pytest.raises(BadInput):
        loss_budget("fp32", load_budget_file(file))


def test_rows_cover_the_text_in_order_with_seeded_lengths() -> None:
    ids = list(range(1000))
    rows = cut_rows(ids, 64, None, seed=3)
    assert np.concatenate(rows).tolist() == ids[: sum(len(r) for r in rows)]
    assert len(ids) - sum(len(r) for r in rows) < 2  # nothing but a 1-token tail is dropped
    assert all(32 <= len(r) <= 64 for r in rows[:-1])
    assert [len(r) for r in cut_rows(ids, 64, None, seed=3)] == [len(r) for r in rows]
    subset = cut_rows(ids, 64, 5, seed=3)
    assert len(subset) == 5 and all(any(np.array_equal(s, r) for r in rows) for s in subset)
    feed = pad_batch([np.array([5, 6, 7]), np.array([8])], pad_id=0, token_type_ids=False)
    assert feed["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]] and feed["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_fidelity_meter_uses_polygraphys_rule() -> None:
    """An element fails only when it exceeds atol AND rtol; padded positions are ignored."""
    ref = np.array([[[1.0, 100.0], [0.0, 0.0]]])
    cand = np.array([[[1.2, 100.5], [9.0, 9.0]]])  # abs 0.2 / rel 0.2, abs 0.5 / rel 0.005; row 2 is padding
    meter = FidelityMeter(atol=0.1, rtol=0.01, top1=True)
    meter.add(ref, cand, {"attention_mask": np.array([[1, 0]])})
    m = meter.metrics()
    assert m["mismatched"] == 1 and m["elements"] == 2
    assert m["max_abs_err"] == pytest.approx(0.5) and m["mean_abs_err"] == pytest.approx(0.35)
    assert m["max_rel_err"] == pytest.approx(0.2) and m["top1"] == 1.0


def test_loss_meter_matches_hand_computation() -> None:
    uniform = torch.zeros(1, 4, 16)  # uniform over 16 tokens: perplexity 16, KL to itself 0
    batch = torch.tensor([[1, 2, 3, 4]])
    assert compare(uniform[:, :-1], uniform[:, :-1], batch).candidate_ppl == pytest.approx(16)
    peaked = torch.zeros(1, 4, 16)
    peaked[..., 0] = 2.0
    meter = LossMeter()
    meter.add(uniform.numpy(), peaked.numpy(), {"input_ids": batch.numpy(), "attention_mask": np.array([[1, 1, 1, 0]])})
    p = torch.full((16,), 1 / 16, dtype=torch.float64)
    q = peaked[0, 0].double().softmax(-1)
    assert meter.tokens == 2  # positions 0 and 1 predict real tokens; 2 predicts a pad
    assert meter.report().kl == pytest.approx(float((p * (p.log() - q.log())).sum()), rel=1e-9)
    assert meter.report().candidate_ppl == pytest.approx(float(1 / q[1]), rel=1e-9)


def test_runners_share_the_protocol(tiny) -> None:
    torch_runner, ort_runner = TorchRunner(tiny["kv2"]), OnnxRuntimeRunner(tiny["onnx"] / "prefill.onnx")
    assert isinstance(torch_runner, Runner) and isinstance(ort_runner, Runner)
    with pytest.raises(PolygraphyException, match="Must be activated"):  # Polygraphy's BaseRunner refuses
        torch_runner.infer({})
    feed = make_inputs(tiny["kv2"], SPEC).feeds[0]
    with torch_runner, ort_runner:
        a, b = torch_runner.infer(feed)["logits"], ort_runner.infer(feed)["logits"]
    assert a.shape == b.shape == (*feed["input_ids"].shape, 256)
    assert torch_runner.model is None and ort_runner.session is None  # released on exit


def test_polygraphy_runner_plugs_in(tiny) -> None:
    """TensorRT arrives as Polygraphy's TrtRunner; its sibling OnnxrtRunner shows the interface fits."""
    onnxrt = pytest.importorskip("polygraphy.backend.onnxrt")
    runner = onnxrt.OnnxrtRunner(onnxrt.SessionFromOnnx(str(tiny["onnx"] / "prefill.onnx")))
    assert isinstance(runner, Runner)
    result = run_check("fidelity", "fidelity", TorchRunner(tiny["kv2"]), runner, make_inputs(tiny["kv2"], SPEC), fidelity_budget("fp32"))
    assert result.passed and result.metrics["max_abs_err"] < 1e-4


# --- which check ------------------------------------------------------------------------------


def test_check_selection(tiny, tmp_path: Path) -> None:
    src, kv2, onnx = (resolve(tiny[k]) for k in ("src", "kv2", "onnx"))
    assert check_kind(src, src) == "fidelity"
    assert check_kind(kv2, onnx) == "fidelity"  # the export of the same checkpoint
    assert check_kind(src, kv2) == "loss" and check_kind(src, onnx) == "loss"
    with pytest.raises(BadInput, match="cannot tell"):
        check_kind(src, resolve(tiny["other"]))
    with pytest.raises(BadInput, match="converted from another model"):
        check_kind(resolve(tiny["other"]), kv2)
    assert check_kind(resolve(tiny["other"]), kv2, "loss") == "loss"
    (tmp_path / "m.engine").write_bytes(b"x")
    with pytest.raises(BadInput, match="no sidecar m.engine.json"):  # engines: tests/test_engines.py
        resolve(tmp_path / "m.engine")


# --- gates, reports, exit codes ------------------------------------------------------------------


def test_identity_conversion_passes_exactly(tiny, tmp_path: Path) -> None:
    files = [tmp_path / n for n in ("r.json", "r.md", "j.xml")]
    argv = ["verify", str(tiny["src"]), str(tiny["kv8"]), *SMALL, "--max-ppl-increase", "0%", "--max-kl", "0", "--min-top1", "100%"]
    assert main([*argv, "--report", str(files[0]), "--markdown", str(files[1]), "--junit", str(files[2])]) == 0
    report = json.loads(files[0].read_text())
    (check,) = report["checks"]
    assert check["kind"] == "loss" and check["passed"] and report["passed"]
    assert set(check["metrics"]) >= LOSS_METRICS
    assert check["metrics"]["kl"] == 0 and check["metrics"]["ppl_increase"] == 0 and check["metrics"]["top1"] == 1
    assert check["candidate"]["conversion"]["kv_heads"] == 8
    assert {g["metric"] for g in check["gates"]} == {"ppl_increase", "kl", "top1"}
    assert set(report["inputs"]) >= {"text_sha256", "input_ids_sha256", "tokens", "seed", "window"}
    assert {"torch", "onnxruntime", "transformers", "headfold"} <= set(report["versions"])
    assert "| kl | 0 | <= 0 | PASS |" in files[1].read_text()
    suite = ET.parse(files[2]).getroot().find("testsuite")
    assert suite.get("tests") == "1" and suite.get("failures") == "0" and suite.find("testcase/failure") is None


def test_fidelity_of_export_reports_every_metric(tiny, tmp_path: Path) -> None:
    report = verify(tiny["kv2"], tiny["onnx"], inputs=SPEC)
    check, decode = report.checks  # a decoder export: prefill, then its KV-cache path (test_verify_decode.py)
    assert check.kind == decode.kind == "fidelity" and decode.name == "fidelity-decode" and report.passed
    assert set(check.metrics) >= FIDELITY_METRICS
    assert check.metrics["max_abs_err"] < 1e-4 and check.metrics["top1"] == 1.0 and check.metrics["mismatched"] == 0
    assert check.candidate["providers"] == "CPUExecutionProvider" and check.candidate["kv_heads"] == 2


def test_tight_budget_fails_with_junit_failure(tiny, tmp_path: Path, capsys) -> None:
    junit = tmp_path / "j.xml"
    code = main(["verify", str(tiny["src"]), str(tiny["onnx"]), *SMALL, "--max-ppl-increase", "100%", "--max-kl", "0.01", "--min-top1", "0", "--junit", str(junit)])
    assert code == 1
    err = capsys.readouterr().err  # a random tiny model: KL ≈ 0.56 nats after pooling to 2 kv heads
    assert "conversion-loss: kl = 0.5" in err and "> budget 0.01" in err and "ppl_increase" not in err
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites" and root.get("failures") == "1"
    suite = root.find("testsuite")
    assert suite.get("name") and suite.get("tests") == "1" and suite.get("failures") == "1" and suite.get("errors") == "0"
    (case,) = suite.findall("testcase")
    assert case.get("classname") == "headfold.verification.loss" and case.get("name") == "conversion-loss" and float(case.get("time")) > 0
    failure = case.find("failure")
    assert failure.get("type") == "ThresholdExceeded" and failure.get("message").startswith("kl = 0.5")


@pytest.mark.parametrize(
    "args",
    [
        ["{src}", "{missing}"],
        ["{src}", "{other}"],  # unrelated models
        ["{src}", "{kv2}", "--text", "{missing}"],
        ["{src}", "{kv2}", "--text", "{binary}"],
        ["{src}", "{kv2}", "--text", "{empty}"],
        ["{src}", "{kv2}", "--budget", "{missing}"],
        ["{src}", "{kv2}", "--max-kl", "lots"],
        ["{src}", "{kv2}", "--check", "maybe"],
        ["{src}", "{kv2}", "--window", "1"],
        ["{tmp}", "{kv2}"],  # a folder that is no checkpoint
    ],
)
def test_malformed_inputs_exit_2(tiny, tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "empty.txt").write_text("  \n")
    names = {**{k: str(v) for k, v in tiny.items()}, "missing": str(tmp_path / "nope"), "binary": str(tmp_path / "binary.txt"), "empty": str(tmp_path / "empty.txt"), "tmp": str(tmp_path)}
    report = tmp_path / "r.json"
    assert main(["verify", *(a.format(**names) for a in args), "--report", str(report)]) == 2
    assert not report.exists()
