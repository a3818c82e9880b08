"""headfold verify on tiny models: check selection, exact numbers, gates, reports, exit codes."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch
from polygraphy.datatype import DataType
from polygraphy.exception import PolygraphyException

from headfold import convert
from headfold.cli import main
from headfold.graphs.export import export
from headfold.ground.errors import BadInput
from headfold.ground.units import parse_fraction
from headfold.verification import InputSpec, verify
from headfold.verification.artifacts import check_kind, resolve
from headfold.verification.budget import fidelity_budget, load_budget_file, loss_budget
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
    paths = {
        "src": src,
        "kv8": convert(src, root / "kv8", 8, method="mean", progress=False),
        "kv2": convert(src, root / "kv2", 2, method="mean", progress=False),
    }
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
    [
        ("[loss]\nmax_lk = 1\n", ".toml"),
        ("[loss\n", ".toml"),
        ("loss: [1, 2]\n", ".yaml"),
        ("[speed]\nx = 1\n", ".toml"),
        ("a", ".ini"),
        ('[loss]\nmax_kl = "-1"\n', ".toml"),
    ],
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


def test_runners_declare_the_feed_they_take(tiny, tiny_checkpoint) -> None:
    """Polygraphy's input metadata of each runner names exactly the feed make_inputs builds."""
    for checkpoint, graph in ((tiny["kv2"], tiny["onnx"] / "prefill.onnx"), (tiny_checkpoint("bert", vocab_size=256), None)):
        feed = make_inputs(checkpoint, SPEC, allow_random=True).feeds[0]
        runners = [TorchRunner(checkpoint)] + ([OnnxRuntimeRunner(graph)] if graph else [])
        for runner in runners:
            with runner:
                meta = runner.get_input_metadata(use_numpy_dtypes=False)
                assert set(meta) == set(feed) and all(meta[n].dtype == DataType.INT64 for n in meta), runner.name
                runner.infer(feed)
                assert runner.last_inference_time() > 0


def test_polygraphy_comparator_runs_headfolds_runners(tiny) -> None:
    """Polygraphy's Comparator takes headfold's runners as they are (its own atol/rtol rule on the logits).

    Fed unpadded rows: Comparator compares every position, and backends differ where the mask is 0."""
    from polygraphy.comparator import Comparator, SimpleCompareFunc

    feeds = [{"input_ids": f["input_ids"][:, :16], "attention_mask": f["attention_mask"][:, :16]} for f in make_inputs(tiny["kv2"], SPEC).feeds[:2]]
    assert all(f["attention_mask"].all() for f in feeds)  # rows are at least window / 2 = 16 tokens long
    runners = [TorchRunner(tiny["kv2"]), OnnxRuntimeRunner(tiny["onnx"] / "prefill.onnx")]
    results = Comparator.run(runners, data_loader=feeds)
    accuracy = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=1e-4, rtol=1e-3, check_error_stat="max"))
    assert bool(accuracy) and len(results[runners[1].name]) == 2


def test_a_feed_the_graph_does_not_take_is_one_line_of_bad_input(tiny, capsys) -> None:
    feed = make_inputs(tiny["kv2"], SPEC).feeds[0]
    with OnnxRuntimeRunner(tiny["onnx"] / "prefill.onnx") as runner:
        with pytest.raises(BadInput, match=r"^prefill.onnx does not take headfold's feed \(Input tensor: input_ids \| Received unexpected dtype"):
            runner.infer({**feed, "input_ids": feed["input_ids"].astype(np.int32)})
        with pytest.raises(BadInput, match=r"Extra inputs in input data: \{'position_ids'\}"):
            runner.infer({**feed, "position_ids": feed["input_ids"]})
    assert capsys.readouterr() == ("", "")  # Polygraphy's own log of the refusal stays silent


# --- the TensorRT runner where TensorRT is absent ---------------------------------------------------
# TrtRunner's own work (deserialize, bind, execute) needs TensorRT and a GPU: tests/integration/test_gpu_engines.py.
# Here: what the subclass adds, with Polygraphy's parent calls replaced by recorders. Not run on TensorRT.


class _Engine:
    """The two engine queries profile choice makes: per profile, input → (min, opt, max)."""

    def __init__(self, profiles: list[dict[str, tuple]]) -> None:
        self.table, self.num_optimization_profiles = profiles, len(profiles)

    def get_tensor_profile_shape(self, name: str, profile: int) -> tuple:
        return self.table[profile][name]


@pytest.fixture
def trt_runner(tmp_path: Path, monkeypatch):
    """A TensorRTRunner posing as active: an engine of int32 ids and a bf16 past, two profiles, profile 0 set."""
    from types import SimpleNamespace

    from polygraphy.backend.trt import TrtRunner
    from polygraphy.common import TensorMetadata

    from headfold.verification.tensorrt_runner import TensorRTRunner

    runner = TensorRTRunner(tmp_path / "decode.engine", timed_runs=0, plugins=[])
    meta = TensorMetadata().add("input_ids", DataType.INT32, (-1, -1)).add("past", DataType.BFLOAT16, (-1, 2, -1, 4))
    small, large = ((1, 1), (4, 4), (8, 64)), ((1, 1), (4, 128), (8, 512))
    past = ((1, 2, 0, 4), (4, 2, 64, 4), (8, 2, 512, 4))
    runner.engine = _Engine([{"input_ids": small, "past": past}, {"input_ids": large, "past": past}])
    runner.context = SimpleNamespace(active_optimization_profile=0)
    runner.calls = []
    monkeypatch.setattr(runner, "get_input_metadata", lambda use_numpy_dtypes=None: meta)
    monkeypatch.setattr(
        runner, "set_profile", lambda index: (runner.calls.append(("set_profile", index)), setattr(runner.context, "active_optimization_profile", index))
    )

    def parent_infer(self, feed, check_inputs=True):
        runner.calls.append(("infer", {name: (value.dtype, tuple(value.shape)) for name, value in feed.items()}))
        return {"logits": torch.full((*feed["input_ids"].shape, 3), 0.5, dtype=torch.bfloat16), "present": feed["past"]}

    monkeypatch.setattr(TrtRunner, "infer", parent_infer)
    runner.is_active = True
    yield runner
    runner.is_active = False  # nothing was activated; keeps Polygraphy's leak warning quiet


def test_tensorrt_runner_is_polygraphys_and_imports_tensorrt_on_activation_only(tmp_path: Path, monkeypatch) -> None:
    import sys

    from polygraphy.backend.trt import TrtRunner

    from headfold.engines import env
    from headfold.verification.tensorrt_runner import TensorRTRunner

    runner = TensorRTRunner(tmp_path / "prefill.engine")
    assert isinstance(runner, TrtRunner) and isinstance(runner, Runner) and runner.name == "tensorrt:prefill.engine"
    assert runner.describe() == {"runner": "tensorrt:prefill.engine"} and "tensorrt" not in sys.modules
    monkeypatch.setattr(env, "engine_support", lambda: "no NVIDIA GPU is visible")
    with pytest.raises(BadInput, match=r"^cannot run the TensorRT engine .*prefill.engine: no NVIDIA GPU is visible$"):
        runner.activate()
    assert not runner.is_active and "tensorrt" not in sys.modules


def test_tensorrt_runner_casts_the_feed_picks_the_profile_and_copies_outputs(trt_runner) -> None:
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "past": np.ones((2, 2, 5, 4), np.float32)}
    out = trt_runner.infer(feed)
    assert trt_runner.calls == [("infer", {"input_ids": (torch.int32, (2, 3)), "past": (torch.bfloat16, (2, 2, 5, 4))})]  # the mask dropped
    assert out["logits"].dtype == np.float32 and np.all(out["logits"] == 0.5) and out["present"].dtype == np.float32
    trt_runner.infer({**feed, "input_ids": np.zeros((2, 100), np.int64)})  # longer than profile 0 admits
    trt_runner.infer(feed)
    assert [c for c in trt_runner.calls if c[0] == "set_profile"] == [("set_profile", 1), ("set_profile", 0)]
    with pytest.raises(BadInput, match=r"fit none of its optimization profiles .*rebuild with larger --batch/--seq/--past"):
        trt_runner.infer({**feed, "input_ids": np.zeros((9, 3), np.int64)})
    with pytest.raises(BadInput, match="^decode.engine needs inputs past; the feed has input_ids, attention_mask$"):
        trt_runner.infer({"input_ids": ids, "attention_mask": ids})


def test_tensorrt_runner_outputs_survive_polygraphys_buffer_reuse() -> None:
    from headfold.verification.tensorrt_runner import _to_numpy

    host_buffer = torch.zeros(4)
    copy = _to_numpy(host_buffer)
    host_buffer += 1  # Polygraphy writes the next call's outputs into the same host buffer
    assert copy.tolist() == [0.0] * 4 and _to_numpy(torch.ones(2, dtype=torch.bfloat16)).dtype == np.float32


def test_tensorrt_runner_latency_summary(tmp_path: Path) -> None:
    from headfold.verification.tensorrt_runner import TensorRTRunner

    runner = TensorRTRunner(tmp_path / "m.engine", timed_runs=3)
    runner.latencies = [2.0, 1.0, 4.0]
    assert runner.describe() == {"runner": "tensorrt:m.engine", "latency_ms": 2.0, "latency_runs": 3, "latency_feeds": 3}


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
    with pytest.raises(BadInput, match="no sidecar m.engine.json"):  # engines: tests/integration/test_engines.py
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
    code = main(
        ["verify", str(tiny["src"]), str(tiny["onnx"]), *SMALL, "--max-ppl-increase", "100%", "--max-kl", "0.01", "--min-top1", "0", "--junit", str(junit)]
    )
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
    names = {
        **{k: str(v) for k, v in tiny.items()},
        "missing": str(tmp_path / "nope"),
        "binary": str(tmp_path / "binary.txt"),
        "empty": str(tmp_path / "empty.txt"),
        "tmp": str(tmp_path),
    }
    report = tmp_path / "r.json"
    assert main(["verify", *(a.format(**names) for a in args), "--report", str(report)]) == 2
    assert not report.exists()
