"""headfold.graphs.rewrite: each rule fires where it should, not where it must not, and keeps the numbers."""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnxscript.rewriter import RewriteRule
from onnxscript.rewriter.testing import assert_numerically_equal
from torch import nn

from headfold.converter.modeling import load_model
from headfold.graphs.export import decoder_graphs, torch_export
from headfold.graphs.rewrite import attention_nodes, decomposed, optimize, repeat_kv
from headfold.graphs.rewrite.cleanup import cleanup, upgrade_opset
from headfold.ground.errors import CheckFailed

B, H, KV, S, D = 2, 8, 2, 5, 4
G = H // KV


def _inputs(masked: bool = True) -> dict[str, np.ndarray]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, heads, S, D, generator=gen) for heads in (H, KV, KV))
    feeds = {"q": q, "k": k, "v": v}
    if masked:
        feeds["mask"] = torch.randn(B, 1, S, S, generator=gen)
    return {name: t.numpy() for name, t in feeds.items()}


class Attend(nn.Module):
    """attend(q, k, v[, mask]) with named inputs, for export."""

    def __init__(self, attend) -> None:
        super().__init__()
        self.attend = attend

    def forward(self, q, k, v, *mask):
        return self.attend(q, k, v, *mask)


def _export(attend, feeds: dict[str, np.ndarray], opset: int = 23) -> ir.Model:
    args = tuple(torch.from_numpy(a) for a in feeds.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = torch.onnx.export(Attend(attend), args, dynamo=True, opset_version=opset, input_names=list(feeds)).model
    upgrade_opset(model)
    cleanup(model)
    return model


def _apply(rules: list[RewriteRule], model: ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """Apply `rules` in place; assert the rewritten graph computes what the original did."""
    before = ir.serde.serialize_model(model)
    counts = {rule.name: rule.apply_to_model(model) for rule in rules}
    cleanup(model)
    assert_numerically_equal(before, model, feeds, rtol=1e-5, atol=1e-6)
    return {name: n for name, n in counts.items() if n}


def _op_types(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


# --- repeat_kv collapse ------------------------------------------------------------------------


def _repeat_expand(x):  # transformers' repeat_kv
    return x[:, :, None].expand(B, KV, G, S, D).reshape(B, H, S, D)


def _repeat_tile(x):
    return x.unsqueeze(2).repeat(1, 1, G, 1, 1).reshape(B, H, S, D)


def _repeat_blocks_expand(x):  # head h reads kv head h % KV: not ONNX's contiguous grouping
    return x[:, None].expand(B, G, KV, S, D).reshape(B, H, S, D)


def _repeat_blocks_tile(x):
    return x.repeat(1, G, 1, 1)


def _sdpa(repeat):
    return lambda q, k, v, *mask: F.scaled_dot_product_attention(q, repeat(k), repeat(v), *mask)


@pytest.mark.parametrize("repeat, rule", [(_repeat_expand, "CollapseRepeatKVExpand"), (_repeat_tile, "CollapseRepeatKVTile")])
@pytest.mark.parametrize("masked", [True, False])
def test_repeat_kv_collapses_into_gqa_attention(repeat, rule: str, masked: bool) -> None:
    feeds = _inputs(masked)
    model = _export(_sdpa(repeat), feeds)
    assert _apply(repeat_kv.rules, model, feeds) == {rule: 1}
    assert _op_types(model) == ["Attention"]
    assert [node.kv_heads for node in attention_nodes(model)] == [KV]


@pytest.mark.parametrize("repeat", [_repeat_blocks_expand, _repeat_blocks_tile])
def test_repeat_kv_leaves_interleaved_heads_alone(repeat) -> None:
    feeds = _inputs()
    model = _export(_sdpa(repeat), feeds)
    assert _apply(repeat_kv.rules, model, feeds) == {}
    assert [node.kv_heads for node in attention_nodes(model)] == [H]


# --- decomposed attention fusion ---------------------------------------------------------------

SCALE = 1 / math.sqrt(D)


def _eager_mul(q, k, v, mask):  # transformers' eager attention
    return torch.softmax(q @ k.transpose(2, 3) * SCALE + mask, dim=-1) @ v


def _eager_div(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D), dim=-1) @ v


def _softmax_over_queries(q, k, v, mask):
    return torch.softmax(q @ k.transpose(2, 3) * SCALE + mask, dim=-2) @ v


def _sdpa_plain(q, k, v, *mask):
    return F.scaled_dot_product_attention(q, k, v, *mask)


def _mha(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """K/V at all heads: the decomposed graphs see already-repeated K/V."""
    return {**feeds, "k": np.repeat(feeds["k"], G, axis=1), "v": np.repeat(feeds["v"], G, axis=1)}


@pytest.mark.parametrize(
    "attend, masked, opset, rule",
    [
        (_eager_mul, True, 23, "FuseDecomposedAttentionMasked"),
        (_eager_div, False, 23, "FuseDecomposedAttention"),
        (_sdpa_plain, True, 18, "FuseDecomposedAttentionPrescaledMasked"),  # torch's SDPA decomposition
        (_sdpa_plain, False, 22, "FuseDecomposedAttentionPrescaled"),
    ],
)
def test_decomposed_attention_fuses(attend, masked: bool, opset: int, rule: str) -> None:
    feeds = _mha(_inputs(masked))
    model = _export(attend, feeds, opset)
    assert "Softmax" in _op_types(model)
    assert _apply(decomposed.rules, model, feeds) == {rule: 1}
    assert _op_types(model) == ["Attention"]


def test_decomposed_attention_needs_softmax_over_keys() -> None:
    feeds = _mha(_inputs())
    model = _export(_softmax_over_queries, feeds)
    assert _apply(decomposed.rules, model, feeds) == {}
    assert "Attention" not in _op_types(model)


def test_decomposed_attention_needs_a_constant_scale() -> None:
    feeds = {**_mha(_inputs()), "scale": np.array(0.3, dtype=np.float32)}
    model = _export(lambda q, k, v, mask, s: torch.softmax(q @ k.transpose(2, 3) * s + mask, -1) @ v, feeds)
    assert _apply(decomposed.rules, model, feeds) == {}


# --- the pipeline on a real transformers graph -------------------------------------------------


@pytest.fixture(scope="module")
def eager_llama_gqa(tiny_checkpoint, tmp_path_factory):
    """A kv-2 tiny llama prefill exported with eager attention: decomposed, with repeat_kv."""
    from headfold import convert

    folder = convert(tiny_checkpoint("llama"), tmp_path_factory.mktemp("llama") / "kv2", KV, method="mean", progress=False)
    model = load_model(folder)
    model.set_attn_implementation("eager")
    return lambda: torch_export(decoder_graphs(model, 2, "split")[0], 23)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _llama_feeds() -> dict[str, np.ndarray]:
    mask = np.ones((3, 6), dtype=np.int64)
    mask[-1, :2] = 0
    return {"input_ids": np.arange(18, dtype=np.int64).reshape(3, 6) + 3, "attention_mask": mask}


def test_pipeline_fuses_eager_transformers_attention(eager_llama_gqa) -> None:
    model = eager_llama_gqa()
    before = ir.serde.serialize_model(model)
    report = optimize(model, kv_heads=KV, layers=2)
    assert {k: v for k, v in report.fusions.items() if v} == {
        "FuseDecomposedAttentionMasked": 2,
        "CollapseRepeatKVExpand": 2,
    }
    assert [(n.layer, n.kv_heads) for n in report.attention] == [(0, KV), (1, KV)]
    assert "Softmax" not in _op_types(model)
    feeds = _llama_feeds()
    expected, got = _run(before, feeds), _run(ir.serde.serialize_model(model), feeds)
    # Only real tokens: fully masked (padded) query rows are implementation-defined.
    valid = feeds["attention_mask"].astype(bool)
    np.testing.assert_allclose(got[0][valid], expected[0][valid], rtol=1e-5, atol=1e-5)
    for e, g in zip(expected[1:], got[1:], strict=True):  # present K/V (B, kv, S, D)
        np.testing.assert_allclose(g.transpose(0, 2, 1, 3)[valid], e.transpose(0, 2, 1, 3)[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kv_heads, layers, message",
    [
        (KV, 3, r"no fused Attention in layer\(s\) 2"),
        (1, 2, r"K/V heads ≠ 1 in layer\(s\) 0 \(2\), 1 \(2\)"),
    ],
)
def test_pipeline_check_names_the_layers(eager_llama_gqa, kv_heads: int, layers: int, message: str) -> None:
    with pytest.raises(CheckFailed, match=message):
        optimize(eager_llama_gqa(), kv_heads=kv_heads, layers=layers, graph="prefill.onnx")
