"""--attention ort-gqa: com.microsoft.GroupQueryAttention graphs compute what the standard-Attention
graphs compute (ORT CPU) for unpadded and right-padded batches, prefill and KV-cache decode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from headfold import convert
from headfold.graphs.export import export, save
from headfold.graphs.rewrite import optimize, ort_gqa
from headfold.ground.errors import BadInput

KV, LAYERS, STEPS = 2, 2, 8
ATOL = 1e-4
PADDINGS = {
    "unpadded": [[1] * 6, [1] * 6, [1] * 6],
    "right": [[1] * 6, [1] * 4 + [0] * 2, [1] * 3 + [0] * 3],
}
LEFT = [[1] * 6, [0] * 2 + [1] * 4, [0] * 3 + [1] * 3]


@pytest.fixture(scope="module")
def graphs(tiny_checkpoint, tmp_path_factory):
    """graphs(family) → {"onnx": folder, "ort-gqa": folder} for one kv-2 checkpoint.

    The ort-gqa graphs are the exported standard ones run through optimize(attention="ort-gqa"),
    the same call export makes, without paying torch's export twice.
    """
    cache: dict[str, dict[str, Path]] = {}

    def get(family: str) -> dict[str, Path]:
        if family not in cache:
            folder = tmp_path_factory.mktemp(f"{family}-gqa")
            checkpoint = convert(tiny_checkpoint(family), folder / "checkpoint", KV, method="mean", progress=False)
            export(checkpoint, folder / "onnx", progress=False, graphs="split")
            (folder / "ort-gqa").mkdir()
            for name in ("prefill.onnx", "decode.onnx"):
                model = ir.load(folder / "onnx" / name)
                optimize(model, kv_heads=KV, layers=LAYERS, graph=name, attention="ort-gqa")
                save(model, folder / "ort-gqa" / name)
            cache[family] = {"onnx": folder / "onnx", "ort-gqa": folder / "ort-gqa"}
        return cache[family]

    return get


def _sessions(folder: Path) -> dict[str, ort.InferenceSession]:
    return {g: ort.InferenceSession(str(folder / f"{g}.onnx"), providers=["CPUExecutionProvider"]) for g in ("prefill", "decode")}


def _generate(folder: Path, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prefill logits, then STEPS greedy tokens through the decode graph (mask grows by ones)."""
    sessions = _sessions(folder)
    ids = np.random.default_rng(0).integers(3, 160, mask.shape).astype(np.int64)
    prefill, *present = sessions["prefill"].run(None, {"input_ids": ids, "attention_mask": mask})
    tokens = [prefill[np.arange(len(mask)), mask.sum(1) - 1].argmax(-1)]  # each row's last real token
    names = [f"past_key_values.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")]
    for _ in range(STEPS):
        mask = np.concatenate([mask, np.ones_like(mask[:, :1])], axis=1)
        feeds = {"input_ids": tokens[-1][:, None], "attention_mask": mask, **dict(zip(names, present, strict=True))}
        logits, *present = sessions["decode"].run(None, feeds)
        tokens.append(logits[:, -1].argmax(-1))
    return prefill, np.stack(tokens, axis=1), logits


FAMILIES = ["llama", pytest.param("gpt2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("padding", PADDINGS)
def test_ort_gqa_matches_standard_attention(graphs, family: str, padding: str) -> None:
    mask = np.array(PADDINGS[padding], dtype=np.int64)
    folders = graphs(family)
    (std_prefill, std_tokens, std_logits), (prefill, tokens, logits) = (_generate(folders[k], mask) for k in ("onnx", "ort-gqa"))
    valid = mask.astype(bool)
    error = np.abs(prefill[valid] - std_prefill[valid]).max()
    assert error <= ATOL, f"prefill max abs error {error:.2e}"
    np.testing.assert_array_equal(tokens, std_tokens)
    assert np.abs(logits - std_logits).max() <= ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_one_group_query_attention_per_layer(graphs, family: str) -> None:
    for name in ("prefill.onnx", "decode.onnx"):
        model = onnx.load(graphs(family)["ort-gqa"] / name, load_external_data=False)
        fused = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
        assert len(fused) == LAYERS and all(n.domain == "com.microsoft" for n in fused)
        assert not [n for n in model.graph.node if n.op_type in ("Attention", "Softmax")]
        assert {a.name: a.i for a in fused[0].attribute if a.name.endswith("num_heads")} == {"num_heads": 8, "kv_num_heads": KV}
        past = [n for n in fused if n.input[3]]  # decode: the KV-cache Concat moved into the node
        assert len(past) == (LAYERS if name == "decode.onnx" else 0)
        assert not [n for n in model.graph.node if n.op_type == "Concat" and n.output[0].startswith("present")]


def test_left_padding_is_not_expressible(graphs) -> None:
    """GQA reads only per-row lengths (seqlens_k): a left-padded row attends to its pads. Documented restriction."""
    mask = np.array(LEFT, dtype=np.int64)
    folders = graphs("llama")
    std, gqa = (_generate(folders[k], mask)[0] for k in ("onnx", "ort-gqa"))
    assert np.abs(std[0] - gqa[0]).max() <= ATOL  # the unpadded row is fine
    assert np.abs(std[1:][mask[1:].astype(bool)] - gqa[1:][mask[1:].astype(bool)]).max() > 1e-2


def test_encoders_are_refused(tiny_checkpoint, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="ort-gqa is for decoders"):
        export(tiny_checkpoint("bert"), tmp_path / "out", attention="ort-gqa", progress=False)
    assert not (tmp_path / "out").exists()


# --- the rule must not fire -----------------------------------------------------------------


def _attention_graph(*, mask_length: str | None) -> ir.Model:
    """Q (B, 8, S, 4), K/V (B, 2, S, 4) and an `attention_mask` input of length T; the Attention
    gets a bool mask over `mask_length` keys, or none."""
    floats = lambda name, heads: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["B", heads, "S", 4])  # noqa: E731
    inputs = [floats("q", 8), floats("k", KV), floats("v", KV), helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "T"])]
    attention_inputs = ["q", "k", "v"]
    if mask_length:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, ["B", 1, "S", mask_length]))
        attention_inputs.append("mask")
    graph = helper.make_graph(
        [helper.make_node("Attention", attention_inputs, ["y"])],
        "attention",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 8, "S", 4])],
    )
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


@pytest.mark.parametrize("mask_length, fires", [("T", True), ("S_other", False), (None, False)])
def test_rule_needs_a_bool_mask_over_attention_mask(mask_length: str | None, fires: bool) -> None:
    """Without a mask spanning attention_mask's keys the row lengths don't describe the node: no fire."""
    model = _attention_graph(mask_length=mask_length)
    counts = sum(rule.apply_to_model(model) for rule in ort_gqa.rules(model))
    assert counts == int(fires)
    assert [n.op_type for n in model.graph if "Attention" in n.op_type] == ["GroupQueryAttention" if fires else "Attention"]
