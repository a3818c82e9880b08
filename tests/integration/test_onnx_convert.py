"""headfold.graphs.onnx_convert: MHA ONNX → GQA ONNX equals the converted checkpoint's torch model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from support.tiny_models import HEADS, sample_batch

from headfold import convert
from headfold.converter.modeling import load_model
from headfold.graphs.export import positions_from_mask
from headfold.graphs.onnx_convert import convert_onnx
from headfold.ground.errors import BadInput

ATOL = 1e-4
STEPS = 6
CASES = [
    ("llama", HEADS // 2, "mean"),
    ("llama", 1, "first"),
    pytest.param("gpt2", HEADS // 2, "mean", marks=pytest.mark.slow),  # fused Q/K/V: Gemm + Split
    pytest.param("gpt2", 1, "mean", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def mha_onnx(tiny_export):
    """mha_onnx(family) → (checkpoint, folder with prefill.onnx / decode.onnx at kv = heads), shared."""
    return lambda family: tiny_export(family)


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _ort_generate(folder: Path, inputs: dict[str, torch.Tensor], layers: int) -> tuple[np.ndarray, np.ndarray, list]:
    """Prefill logits, STEPS greedy tokens through decode.onnx, and the last present K/V."""
    mask = inputs["attention_mask"].numpy()
    logits, *present = _session(folder / "prefill.onnx").run(None, {k: v.numpy() for k, v in inputs.items()})
    prefill, tokens = logits, [logits[:, -1].argmax(-1)]
    decode = _session(folder / "decode.onnx")
    names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    for _ in range(STEPS - 1):
        mask = np.concatenate([mask, np.ones_like(mask[:, :1])], axis=1)
        logits, *present = decode.run(None, {"input_ids": tokens[-1][:, None], "attention_mask": mask, **dict(zip(names, present, strict=True))})
        tokens.append(logits[:, -1].argmax(-1))
    return prefill, np.stack(tokens, axis=1), present


@torch.no_grad()
def _torch_greedy(model, inputs: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Prefill logits and STEPS greedy tokens, recomputing the whole sequence (eos not suppressed,
    unlike generate(min_new_tokens=...))."""
    ids, mask, logits = inputs["input_ids"], inputs["attention_mask"], []
    for _ in range(STEPS):
        logits.append(model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits)
        token = logits[-1][:, -1:].argmax(-1)
        ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    return logits[0].numpy(), ids[:, -STEPS:].numpy()


@pytest.mark.parametrize("family, kv, method", CASES)
def test_onnx_convert_matches_converted_torch(mha_onnx, tmp_path: Path, family: str, kv: int, method: str) -> None:
    checkpoint, source = mha_onnx(family)
    for name in ("prefill.onnx", "decode.onnx"):
        summary = convert_onnx(source / name, tmp_path / "onnx" / name, kv, method)
        assert summary["attention_nodes"] == 2 and summary["source_kv_heads"] == [HEADS]
    model = load_model(convert(checkpoint, tmp_path / "checkpoint", kv, method, progress=False))
    inputs = sample_batch(model.config, 3, 7, seed=2)  # last row left-padded
    prefill, tokens, present = _ort_generate(tmp_path / "onnx", inputs, model.config.num_hidden_layers)
    expected, expected_tokens = _torch_greedy(model, inputs)
    valid = inputs["attention_mask"].bool().numpy()
    error = np.abs(prefill[valid] - expected[valid]).max()
    assert error <= ATOL, f"prefill max abs error {error:.2e}"
    np.testing.assert_array_equal(tokens, expected_tokens)
    assert all(t.shape[:3] == (3, kv, 7 + STEPS - 1) for t in present)


def _float_initializers(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(path)
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}


def test_identity_is_lossless(mha_onnx, tmp_path: Path) -> None:
    """kv = heads: every weight is bitwise the source's (pooled copies carry a '.gqa' suffix)."""
    _, source = mha_onnx("llama")
    convert_onnx(source / "decode.onnx", tmp_path / "decode.onnx", HEADS)
    before, after = _float_initializers(source / "decode.onnx"), _float_initializers(tmp_path / "decode.onnx")
    assert sum(name.endswith(".gqa") for name in after) == 4  # K and V of 2 layers
    for name, array in after.items():
        np.testing.assert_array_equal(array, before[name.removesuffix(".gqa")], strict=True)


def _no_attention_model(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    onnx.save(helper.make_model(graph), path)
    return path


def test_bad_inputs_write_nothing(mha_onnx, tmp_path: Path) -> None:
    _, source = mha_onnx("llama")
    out = tmp_path / "out.onnx"
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"not a protobuf at all")
    cases = [
        (tmp_path / "missing.onnx", 2, "is not an .onnx file"),
        (corrupt, 2, "is not a valid ONNX model"),
        (_no_attention_model(tmp_path / "relu.onnx"), 2, "no standard ONNX Attention node"),
        (source / "prefill.onnx", 3, "--kv-heads 3 is impossible for a model with 8 attention heads"),
    ]
    for src, kv, message in cases:
        with pytest.raises(BadInput, match=message):
            convert_onnx(src, out, kv)
        assert not list(tmp_path.glob("*out.onnx*"))  # no graph, data or staging folder
    out.write_text("keep me")
    with pytest.raises(BadInput, match="already exists"):
        convert_onnx(source / "prefill.onnx", out, 2)
    assert out.read_text() == "keep me"
    with pytest.raises(BadInput, match="ONNX convert supports mean and first"):
        convert_onnx(source / "prefill.onnx", tmp_path / "other.onnx", 2, "grouped")
