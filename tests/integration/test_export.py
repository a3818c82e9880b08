"""headfold.graphs.export: ORT vs torch numbers, KV-cache greedy decoding, one GQA Attention per layer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers
from support.ort_decoding import ort_greedy, session
from support.tiny_models import ENCODERS, HEADS, sample_batch

from headfold import convert
from headfold.converter.modeling import load_model
from headfold.graphs import rewrite
from headfold.graphs.export import export, positions_from_mask
from headfold.ground.errors import BadInput, CheckFailed

ATOL = 1e-4
NEW_TOKENS = 16
SEQUENCES = (5, 11)

# (family, kv-heads): every family once as GQA/MQA, kv ∈ {h/2, h/4, 1} across them, and as MHA
# (no repeat_kv to fuse) where its attention differs: mistral and qwen2 run Llama's attention code
# and roberta BERT's, so their MHA graphs would repeat llama's and bert's. Other modules share these
# exports through the session fixture tiny_export (conftest.py): keep kv 2 where a family has one.
FAST = [("llama", 2), ("gpt2", 1), ("bert", 4)]
SLOW = [
    ("llama", HEADS),
    ("gpt2", HEADS),
    ("bert", HEADS),
    ("mistral", 4),
    ("qwen2", 1),
    ("qwen3", 2),
    ("qwen3", HEADS),
    ("phi3", 2),
    ("phi3", HEADS),
    ("gpt_neox", 2),
    ("gpt_neox", HEADS),
    ("opt", 2),
    ("opt", HEADS),
    ("roberta", 1),
]
CASES = [pytest.param(*case, id=f"{case[0]}-kv{case[1]}") for case in FAST] + [
    pytest.param(*case, id=f"{case[0]}-kv{case[1]}", marks=pytest.mark.slow) for case in SLOW
]
DECODER_CASES = [case for case in CASES if case.values[0] not in ENCODERS]


@pytest.fixture(scope="session")
def exported(tiny_export):
    """exported(family, kv) → (checkpoint folder, ONNX folder): the shared split export (merged: test_export_merged.py)."""
    return lambda family, kv: tiny_export(family, None if kv == HEADS else kv)


def _batch(config: transformers.PretrainedConfig, batch: int, seq: int) -> dict[str, torch.Tensor]:
    inputs = sample_batch(config, batch, seq, seed=seq)
    if getattr(config, "type_vocab_size", 0) > 1:
        inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    return inputs


def _torch_outputs(model: transformers.PreTrainedModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        if model.can_generate():
            return model(**inputs, position_ids=positions_from_mask(inputs["attention_mask"])).logits
        return model(**inputs).last_hidden_state


def _max_error(ours: np.ndarray, reference: torch.Tensor, mask: torch.Tensor) -> float:
    """Max abs difference over real (unpadded) positions."""
    valid = mask.bool().numpy()
    return float(np.abs(ours[valid] - reference.numpy()[valid]).max())


@pytest.mark.parametrize("family, kv", CASES)
def test_ort_matches_torch(exported, family: str, kv: int) -> None:
    checkpoint, onnx_dir = exported(family, kv)
    model = load_model(checkpoint)
    graph = "model.onnx" if family in ENCODERS else "prefill.onnx"
    runner = session(onnx_dir / graph)
    for batch in (1, 3):
        for seq in SEQUENCES:
            inputs = _batch(model.config, batch, seq)
            ours = runner.run(None, {k: v.numpy() for k, v in inputs.items()})
            error = _max_error(ours[0], _torch_outputs(model, inputs), inputs["attention_mask"])
            assert error <= ATOL, f"{graph} batch {batch} seq {seq}: max abs error {error:.2e}"
            for present in ours[1:]:  # decoders: K/V cache leaves the graph at kv-heads
                assert present.shape[:3] == (batch, kv, seq)


@pytest.mark.parametrize("family, kv", CASES)
def test_one_gqa_attention_per_layer(exported, family: str, kv: int) -> None:
    checkpoint, onnx_dir = exported(family, kv)
    summary = json.loads((onnx_dir / "export.json").read_text())
    assert summary["kv_heads"] == kv and summary["opset"] == 23
    for name, info in summary["graphs"].items():
        model = onnx.load(onnx_dir / name, load_external_data=False)
        attention = [n for n in model.graph.node if n.op_type == "Attention"]
        assert len(attention) == summary["layers"] == info["attention_nodes"]
        assert info["attention_kv_heads"] == [kv] * summary["layers"]
        assert sum(info["fusions"].values()) == (summary["layers"] if kv != HEADS else 0)
        assert all(o.type.tensor_type.HasField("shape") for o in model.graph.output)
        assert (onnx_dir / f"{name}.data").is_file()
        onnx.checker.check_model(str(onnx_dir / name))


@pytest.mark.parametrize("family, kv", DECODER_CASES)
def test_decode_greedy_matches_torch_generate(exported, family: str, kv: int) -> None:
    checkpoint, onnx_dir = exported(family, kv)
    model = load_model(checkpoint)
    inputs = sample_batch(model.config, 3, 6, seed=1)  # last row left-padded
    model.generation_config.eos_token_id = None  # plain argmax for all 16 steps, like the ORT loop
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    expected = expected[:, inputs["input_ids"].shape[1] :]
    tokens, present = ort_greedy(onnx_dir, inputs["input_ids"].numpy(), inputs["attention_mask"].numpy(), model.config.num_hidden_layers, NEW_TOKENS)
    np.testing.assert_array_equal(tokens, expected.numpy())
    assert all(t.shape[:3] == (3, kv, 6 + NEW_TOKENS - 1) for t in present)


@pytest.mark.parametrize("opset", [18, 22, 26, 27])
def test_unsupported_opsets_are_refused(tmp_path: Path, opset: int) -> None:
    with pytest.raises(BadInput, match=f"opset {opset} is not supported"):
        export(tmp_path / "missing", tmp_path / "out", opset=opset)
    assert not (tmp_path / "out").exists()


def test_missing_fusion_fails_and_writes_nothing(tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    """Without the repeat_kv rule a GQA graph keeps MHA-shaped K/V: exit-1 error, no output."""
    checkpoint = convert(tiny_checkpoint("bert"), tmp_path / "kv2", 2, method="mean", progress=False)
    monkeypatch.setattr(rewrite, "RULES", ())
    with pytest.raises(CheckFailed, match=r"model.onnx: K/V heads ≠ 2 in layer\(s\) 0 \(8\), 1 \(8\)"):
        export(checkpoint, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_fp16_typed_weights_fp32_normalisation(tiny_checkpoint, tmp_path: Path) -> None:
    """fp16: half weights, norms computed in fp32 (stash_type=1); ORT within 1e-2 of fp32 torch."""
    checkpoint = convert(tiny_checkpoint("bert"), tmp_path / "kv2", 2, method="mean", progress=False)
    export(checkpoint, tmp_path / "onnx", dtype="fp16", progress=False)
    graph = onnx.load(tmp_path / "onnx" / "model.onnx", load_external_data=False).graph
    floats = {t.data_type for t in graph.initializer} - {onnx.TensorProto.INT64, onnx.TensorProto.BOOL}
    assert floats == {onnx.TensorProto.FLOAT16}
    norms = [n for n in graph.node if n.op_type == "LayerNormalization"]
    assert norms and all(onnx.helper.get_attribute_value(a) == 1 for n in norms for a in n.attribute if a.name == "stash_type")
    model = load_model(checkpoint)
    inputs = _batch(model.config, 3, 9)
    ours = session(tmp_path / "onnx" / "model.onnx").run(None, {k: v.numpy() for k, v in inputs.items()})[0]
    assert ours.dtype == np.float16
    error = _max_error(ours.astype(np.float32), _torch_outputs(model, inputs), inputs["attention_mask"])
    assert error <= 1e-2, f"fp16 max abs error {error:.2e}"
