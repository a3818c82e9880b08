"""TensorRT engines of the embedded default model on a real GPU (skipped without TensorRT or CUDA).

Prefill and decode engines are built with `headfold build`'s code in fp32 and fp16 (fp16 from a
`headfold export --dtype fp16` graph, the one precision path TensorRT 10 and 11 share), run with
headfold's TensorRT runner, and compared with torch on the held-out text:
fp32 max abs ≤ 1e-3; fp16 cosine ≥ 0.999 and top-1 agreement ≥ 99 %. Where the plugin emitter
has a plugin for the installed TensorRT, the plugin decode engine must equal the native one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from headfold.engines.env import engine_support

WHY_NOT = engine_support()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY_NOT is not None, reason=f"needs TensorRT and an NVIDIA GPU: {WHY_NOT}")]

FP32_ATOL, FP16_COSINE, FP16_TOP1 = 1e-3, 0.999, 0.99
ROWS, WINDOW = 16, 128


@pytest.fixture(scope="module")
def default_model() -> Path:
    from headfold.demo import default_model_path

    path = default_model_path()
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"embedded default model missing at {path}")
    return path


@pytest.fixture(scope="module")
def engines(default_model: Path, tmp_path_factory) -> dict[str, Path]:
    """{precision: build folder with prefill.engine and decode.engine}."""
    from headfold.engines.build import build
    from headfold.engines.env import Target
    from headfold.engines.plan import make_plan
    from headfold.graphs.export import export

    folders = {}
    for precision in ("fp32", "fp16"):
        root = tmp_path_factory.mktemp(f"engines-{precision}")
        export(default_model, root / "onnx", dtype=precision, progress=False, graphs="split")  # TensorRT builds the split pair
        plan = make_plan(root / "onnx", root / "engines", Target.installed(), batch="1:8:8", seq="1:128:256", past="0:128:256")
        build(plan)
        folders[precision] = root / "engines"
    return folders


@pytest.fixture(scope="module")
def feeds(default_model: Path) -> list[dict[str, np.ndarray]]:
    from headfold.verification.inputs import InputSpec, make_inputs

    return make_inputs(default_model, InputSpec(window=WINDOW, max_rows=ROWS)).feeds


def _torch_logits(default_model: Path, feeds: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    from headfold.verification.runners import TorchRunner

    with TorchRunner(default_model) as runner:
        return [runner.infer(feed)["logits"] for feed in feeds]


def _engine_logits(engine: Path, feeds: list[dict[str, np.ndarray]]) -> list[np.ndarray]:
    from headfold.verification.tensorrt_runner import TensorRTRunner

    with TensorRTRunner(engine, timed_runs=3) as runner:
        logits = [runner.infer(feed)["logits"].astype(np.float32) for feed in feeds]
        assert runner.describe()["latency_ms"] > 0
    return logits


def _valid(logits: list[np.ndarray], feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    return np.concatenate([out[feed["attention_mask"].astype(bool)] for out, feed in zip(logits, feeds, strict=True)])


def _compare(reference: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
    cosine = (reference * candidate).sum(-1) / (np.linalg.norm(reference, axis=-1) * np.linalg.norm(candidate, axis=-1))
    return {
        "max_abs": float(np.abs(reference - candidate).max()),
        "cosine": float(cosine.min()),
        "top1": float((reference.argmax(-1) == candidate.argmax(-1)).mean()),
    }


def test_prefill_fp32_matches_torch(engines, default_model, feeds) -> None:
    metrics = _compare(_valid(_torch_logits(default_model, feeds), feeds), _valid(_engine_logits(engines["fp32"] / "prefill.engine", feeds), feeds))
    assert metrics["max_abs"] <= FP32_ATOL, metrics


def test_prefill_fp16_matches_torch(engines, default_model, feeds) -> None:
    metrics = _compare(_valid(_torch_logits(default_model, feeds), feeds), _valid(_engine_logits(engines["fp16"] / "prefill.engine", feeds), feeds))
    assert metrics["cosine"] >= FP16_COSINE and metrics["top1"] >= FP16_TOP1, metrics


def _decode_step(folder: Path, ids: np.ndarray, decode_engine: Path | None = None) -> np.ndarray:
    """Prefill ids[:, :-1] in the prefill engine, then the last token through the decode engine: its logits."""
    from headfold.verification.tensorrt_runner import TensorRTRunner

    batch, length = ids.shape
    prompt = {"input_ids": ids[:, :-1], "attention_mask": np.ones((batch, length - 1), np.int64)}
    with TensorRTRunner(folder / "prefill.engine", timed_runs=0) as prefill:
        present = prefill.infer(prompt)
    past = {name.replace("present", "past_key_values"): value for name, value in present.items() if name.startswith("present")}
    step = {"input_ids": ids[:, -1:], "attention_mask": np.ones((batch, length), np.int64), **past}
    with TensorRTRunner(decode_engine or folder / "decode.engine", timed_runs=0) as decode:
        return decode.infer(step)["logits"][:, -1].astype(np.float32)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_decode_step_matches_torch(engines, default_model, feeds, precision: str) -> None:
    ids = feeds[0]["input_ids"][:, :64]  # rows are at least WINDOW // 2 long: no padding in the first 64
    expected = _torch_logits(default_model, [{"input_ids": ids, "attention_mask": np.ones_like(ids)}])[0][:, -1]
    metrics = _compare(expected, _decode_step(engines[precision], ids))
    if precision == "fp32":
        assert metrics["max_abs"] <= FP32_ATOL, metrics
    else:
        assert metrics["cosine"] >= FP16_COSINE and metrics["top1"] >= FP16_TOP1, metrics


def test_plugin_decode_engine_equals_native(engines, feeds, tmp_path: Path) -> None:
    """The decode graph with every Attention rewritten to the headfold plugin (what a parser without an
    Attention importer gets: the emitter for 10.13), built here with the plugin, against the native engine."""
    import onnx_ir as ir

    from headfold import plugins
    from headfold.engines.build import build
    from headfold.engines.env import Target
    from headfold.engines.plan import make_plan
    from headfold.engines.sidecar import load_sidecar, source_onnx

    native = engines["fp32"] / "decode.engine"
    model = ir.load(source_onnx(native, load_sidecar(native)))
    ir.external_data.load_to_model(model)
    model, names = plugins.emit(model, "10.13")
    assert names == ["headfold::GQADecodeAttention"]
    graph = tmp_path / "decode.onnx"
    ir.save(model, graph, external_data="decode.onnx.data")
    plan = make_plan(graph, tmp_path / "plugin.engine", Target.installed(), batch="1:8:8", past="0:128:256")
    assert plan.plugins == names  # the plugin nodes are in the graph: the build registers them
    build(plan)
    ids = feeds[0]["input_ids"][:, :64]
    expected = _decode_step(engines["fp32"], ids)
    np.testing.assert_allclose(_decode_step(engines["fp32"], ids, tmp_path / "plugin.engine"), expected, atol=1e-4, rtol=1e-4)
