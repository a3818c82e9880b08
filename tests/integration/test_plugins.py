"""headfold.plugins: the GQA decode-attention op (reference vs ORT's Attention, emitter rules on real
decode graphs, per-version plans, TensorRT registration) and a GPU check of the TensorRT plugin."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnxscript.rewriter import pattern
from support.tiny_models import HEADS

from headfold.graphs.trt_lint import lint
from headfold.ground.errors import BadInput
from headfold.plugins import emit, plan_plugins, reference_ops, register_tensorrt
from headfold.plugins.gqa_decode_attention import (
    DOMAIN,
    NAME,
    OP_TYPE,
    attention_reference,
)

ORT_ATOL = 1e-5  # one node, fp32
GRAPH_ATOL = 1e-4  # a whole decode graph
VERSIONS = ("10.13", "10.14", "10.15", "11.0")
_PRESENT = ["present_key", "present_value"]


# ---- one-node models ------------------------------------------------------------------------------


def _one_node_model(node: onnx.NodeProto, feeds: dict[str, np.ndarray], outputs: list[str]) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape)) for name, array in feeds.items()]
    float_outputs = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in outputs]
    graph = helper.make_graph([node], "one_node", inputs, float_outputs)
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _attention_feeds(heads: int, kv_heads: int, batch: int, past: int, new: int, mask: str | None, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    size = 8
    feeds = {"Q": normal(batch, heads, new, size), "K": normal(batch, kv_heads, new, size), "V": normal(batch, kv_heads, new, size)}
    total = past + new
    if mask == "bool":  # key padding: row b misses its first b keys
        feeds["mask"] = np.arange(total)[None, None, None, :] >= np.arange(batch)[:, None, None, None]
        feeds["mask"] = np.broadcast_to(feeds["mask"], (batch, 1, new, total)).copy()
    elif mask == "float":
        feeds["mask"] = normal(batch, 1, new, total)
    feeds |= {"past_key": normal(batch, kv_heads, past, size), "past_value": normal(batch, kv_heads, past, size)}
    return feeds


def _run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _max_errors(ours: list[np.ndarray], expected: list[np.ndarray]) -> list[float]:
    return [float(np.abs(np.asarray(a, dtype=np.float64) - b).max()) if b.size else 0.0 for a, b in zip(ours, expected, strict=True)]


# (q heads, kv heads, batch, past, new tokens, mask, is_causal)
REFERENCE_CASES = [
    pytest.param(8, 8, 2, 5, 1, "bool", 0, id="mha-bool"),
    pytest.param(8, 2, 3, 7, 1, "bool", 0, id="gqa4-bool"),
    pytest.param(6, 3, 2, 4, 2, "float", 0, id="gqa2-float"),
    pytest.param(8, 1, 2, 6, 1, "float", 0, id="mqa-float"),
    pytest.param(4, 2, 2, 0, 3, "bool", 0, id="gqa2-no-past"),
    pytest.param(4, 2, 2, 0, 3, None, 1, id="causal-no-past"),
    pytest.param(4, 1, 2, 5, 3, None, 1, id="mqa-causal-past"),
    pytest.param(4, 2, 3, 4, 2, "bool", 1, id="causal-and-mask-past"),
]


@pytest.mark.parametrize(("heads", "kv_heads", "batch", "past", "new", "mask", "causal"), REFERENCE_CASES)
def test_reference_matches_ort_attention(heads, kv_heads, batch, past, new, mask, causal) -> None:
    feeds = _attention_feeds(heads, kv_heads, batch, past, new, mask)
    inputs = ["Q", "K", "V", "mask" if mask else "", "past_key", "past_value"]
    node = helper.make_node("Attention", inputs, ["Y", *_PRESENT], is_causal=causal)
    expected = _run_ort(_one_node_model(node, feeds, ["Y", *_PRESENT]), feeds)

    tensors = {name: torch.from_numpy(array) for name, array in feeds.items()}
    ours = attention_reference(
        tensors["Q"], tensors["K"], tensors["V"], tensors.get("mask"), tensors["past_key"], tensors["past_value"], is_causal=bool(causal)
    )
    errors = _max_errors([t.numpy() for t in ours], expected)
    assert max(errors) <= ORT_ATOL, f"reference vs ORT Attention: max abs errors (Y, present K, V) {errors}"


@pytest.mark.parametrize(("heads", "kv_heads", "batch", "past", "new", "mask", "causal"), [c for c in REFERENCE_CASES if c.values[5]])
def test_plugin_node_on_reference_evaluator_matches_ort(heads, kv_heads, batch, past, new, mask, causal) -> None:
    feeds = _attention_feeds(heads, kv_heads, batch, past, new, mask, seed=1)
    inputs = ["Q", "K", "V", "mask", "past_key", "past_value"]
    attention = helper.make_node("Attention", inputs, ["Y", *_PRESENT], is_causal=causal, scale=0.3)
    plugin = helper.make_node(
        OP_TYPE, inputs, ["Y", *_PRESENT], domain=DOMAIN,
        q_num_heads=heads, kv_num_heads=kv_heads, scale=0.3, is_causal=causal, softcap=0.0, plugin_namespace=DOMAIN,
    )  # fmt: skip
    expected = _run_ort(_one_node_model(attention, feeds, ["Y", *_PRESENT]), feeds)
    ours = ReferenceEvaluator(_one_node_model(plugin, feeds, ["Y", *_PRESENT]), new_ops=reference_ops()).run(None, feeds)
    assert max(_max_errors(ours, expected)) <= ORT_ATOL


def test_reference_rejects_heads_that_do_not_group() -> None:
    query, key = torch.zeros(1, 6, 1, 4), torch.zeros(1, 4, 1, 4)
    with pytest.raises(ValueError, match="cannot be grouped"):
        attention_reference(query, key, key, None, key[:, :, :0], key[:, :, :0])


# ---- plans on hand-built graphs ----------------------------------------------------------------------

KV = [1, 2, 4, 8]
Q = [1, 8, 1, 8]


def _typed(name: str, shape: list, dtype: int = onnx.TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _graph_model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[str]) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, [_typed(name, None) for name in outputs])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


def _small_graph(kind: str) -> ir.Model:
    """prefill / encoder: Attention without a cache; decode-concat: the cache concatenated outside
    the node (headfold's export); decode-past: the cache as Attention inputs."""
    mask = _typed("mask", [1, 1, 1, 6], onnx.TensorProto.BOOL)
    qkv = [_typed("q", Q), _typed("k", KV), _typed("v", KV)]
    past = [_typed("past_key", [1, 2, 5, 8]), _typed("past_value", [1, 2, 5, 8])]
    if kind in ("prefill", "encoder"):
        node = helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=int(kind == "prefill"))
        return _graph_model([node], qkv, ["y"])
    if kind == "decode-past":
        node = helper.make_node("Attention", ["q", "k", "v", "mask", "past_key", "past_value"], ["y", *_PRESENT])
        return _graph_model([node], [*qkv, mask, *past], ["y", *_PRESENT])
    concat = [helper.make_node("Concat", [f"past_{x}", x[0]], [f"present_{x}"], axis=-2) for x in ("key", "value")]
    node = helper.make_node("Attention", ["q", *_PRESENT, "mask"], ["y"])
    return _graph_model([*concat, node], [*qkv, mask, *past], ["y", *_PRESENT])


# The parser rejects past_key/past_value on Attention in every release (no TRT 11 native emitter:
# see plugins/gqa_decode_attention/__init__.py); 10.13 has no Attention importer at all.
PLANS = {
    "prefill": {v: [] for v in VERSIONS},
    "encoder": {v: [] for v in VERSIONS},
    "decode-concat": {"10.13": [NAME], "10.14": [], "10.15": [], "11.0": []},
    "decode-past": {v: [NAME] for v in VERSIONS},
}


@pytest.mark.parametrize("kind", PLANS)
def test_plan_plugins_per_version(kind: str) -> None:
    for version, expected in PLANS[kind].items():
        model = _small_graph(kind)
        assert plan_plugins(model, version) == expected, f"{kind} for TensorRT {version}"
        assert emit(model, version)[1] == expected
        plugin_nodes = [n for n in model.graph if (n.domain, n.op_type) == (DOMAIN, OP_TYPE)]
        assert len(plugin_nodes) == len(expected)


def test_plan_plugins_reads_paths_and_rejects_bad_versions(tmp_path: Path) -> None:
    path = tmp_path / "decode.onnx"
    ir.save(_small_graph("decode-past"), path)
    assert plan_plugins(path, "10.15.1") == [NAME]
    with pytest.raises(BadInput, match="no ONNX file"):
        plan_plugins(tmp_path / "missing.onnx", "10.15")
    with pytest.raises(BadInput, match="MAJOR.MINOR"):
        plan_plugins(path, "ten")


def test_emitter_leaves_unsupported_forms_alone() -> None:
    """Without a mask (the plugin's inputs are fixed) the node stays and the plan says nothing."""
    model = _small_graph("decode-past")
    node = next(iter(model.graph))
    node.replace_input_with(3, None)
    assert plan_plugins(model, "10.15") == []
    assert emit(model, "10.15")[1] == []


# ---- TensorRT registration without TensorRT ------------------------------------------------------------

needs_no_tensorrt = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")


@needs_no_tensorrt
def test_register_tensorrt_without_tensorrt_is_one_clear_error() -> None:
    with pytest.raises(BadInput) as error:
        register_tensorrt([NAME])
    message = str(error.value)
    assert "\n" not in message and NAME in message and "tensorrt.plugin" in message


def test_register_tensorrt_rejects_unknown_names_and_accepts_none() -> None:
    with pytest.raises(BadInput, match="unknown plugin"):
        register_tensorrt(["headfold::NoSuchOp"])
    register_tensorrt([])  # nothing to register: no TensorRT needed


# ---- real decode graphs ------------------------------------------------------------------------------------


class _CacheIntoAttention(pattern.RewriteRuleClassBase):
    """Test helper: Concat(past, K/V) → Attention becomes Attention(…, past_key, past_value) with
    present outputs — the decode form other exporters write, which TensorRT's parser rejects."""

    def pattern(self, op, query, key, value, mask, past_key, past_value):
        present_key = op.Concat(past_key, key, axis=-2, _outputs=["present_key"])
        present_value = op.Concat(past_value, value, axis=-2, _outputs=["present_value"])
        return op.Attention(query, present_key, present_value, mask, _outputs=["attention"]), present_key, present_value

    def rewrite(self, op, query, key, value, mask, past_key, past_value, attention, **_):
        attributes = {name: attr.value for name, attr in attention.producer().attributes.items()}
        return op.Attention(query, key, value, mask, past_key, past_value, _outputs=3, **attributes)


LAYERS = 2
DECODERS = {  # name: (tiny family, kv heads it is converted to from HEADS); the exports test_export checks
    "gqa4-of-8": ("llama", 2),
    "mqa-of-8": ("qwen2", 1),  # llama's attention with Q/K/V biases
}


@pytest.fixture(scope="module")
def decode_graphs(tiny_export) -> dict[str, Path]:
    """name → the exported decode.onnx (the session's shared exports: each costs 15-30 CPU seconds)."""
    return {name: tiny_export(family, kv)[1] / "decode.onnx" for name, (family, kv) in DECODERS.items()}


def _in_memory(path: Path) -> ir.Model:
    model = ir.load(path)
    ir.external_data.load_to_model(model)
    return model


def _decode_feeds(path: Path, batch: int = 3, past: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    """A decode step with past length > 0 and left padding in the last row."""
    rng = np.random.default_rng(seed)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    mask = np.ones((batch, past + 1), dtype=np.int64)
    mask[-1, :2] = 0
    feeds = {"input_ids": rng.integers(3, 100, (batch, 1)), "attention_mask": mask}
    for value in session.get_inputs()[2:]:
        kv_heads, head_size = value.shape[1], value.shape[3]
        feeds[value.name] = rng.standard_normal((batch, kv_heads, past, head_size)).astype(np.float32)
    return feeds


def _attention_with_past(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx") and len(n.inputs) > 4]


def _plugin_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if (n.domain, n.op_type) == (DOMAIN, OP_TYPE)]


def _assert_plugin_graph_matches_ort(model: ir.Model, original: Path) -> None:
    feeds = _decode_feeds(original)
    expected = ort.InferenceSession(str(original), providers=["CPUExecutionProvider"]).run(None, feeds)
    ours = ReferenceEvaluator(ir.to_proto(model), new_ops=reference_ops()).run(None, feeds)
    errors = _max_errors(ours, expected)
    assert max(errors) <= GRAPH_ATOL, f"plugin graph (reference path) vs ORT on the original: {errors}"


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODERS)
def test_exported_decode_graph_needs_no_plugin_from_10_14(decode_graphs, name: str) -> None:
    """headfold's decode graphs keep the cache outside Attention: parsed natively from 10.14 on."""
    path = decode_graphs[name]
    assert {v: plan_plugins(path, v) for v in VERSIONS} == PLANS["decode-concat"]
    model = ir.load(path)
    assert emit(model, "10.15") == (model, []) and not _plugin_nodes(model)
    assert not lint(model, "10.15").errors


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODERS)
def test_emit_past_form_decode_graph_for_10_15(decode_graphs, name: str) -> None:
    model = _in_memory(decode_graphs[name])
    assert _CacheIntoAttention.rule().apply_to_model(model) == LAYERS
    assert lint(model, "10.15").errors  # the parser rejects past_key/past_value on Attention

    model, plugins = emit(model, "10.15")

    assert plugins == [NAME]
    assert len(_plugin_nodes(model)) == LAYERS and not _attention_with_past(model)
    _, kv_heads = DECODERS[name]
    assert {(n.attributes["q_num_heads"].value, n.attributes["kv_num_heads"].value) for n in _plugin_nodes(model)} == {(HEADS, kv_heads)}
    assert lint(model, "10.15", plugins=plugins).parsable
    without_rotary = {f.rule for f in lint(model, "10.14", plugins=plugins).errors}
    assert without_rotary == {"op-unsupported"}  # only RotaryEmbedding / RMSNormalization (10.15+) remain
    _assert_plugin_graph_matches_ort(model, decode_graphs[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", DECODERS)
def test_emit_concat_form_for_a_parser_without_attention(decode_graphs, name: str) -> None:
    model = _in_memory(decode_graphs[name])
    model, plugins = emit(model, "10.13")
    assert plugins == [NAME] and len(_plugin_nodes(model)) == LAYERS
    assert not [n for n in model.graph if n.op_type == "Attention"]
    assert {v: plan_plugins(model, v) for v in VERSIONS} == dict.fromkeys(VERSIONS, [NAME])  # nodes present: needed anywhere
    _assert_plugin_graph_matches_ort(model, decode_graphs[name])


# ---- GPU: the TensorRT plugin in an engine -------------------------------------------------------------


def _gpu_skip_reason() -> str | None:
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT is not installed"
    if importlib.util.find_spec("polygraphy") is None:
        return "polygraphy is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device for torch (the JIT plugin computes with torch on the GPU)"
    return None


def _profile_range(name: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(min, max) shapes around a decode feed: batch 1..2B, past 1..2P."""
    batch = shape[0]
    if name == "input_ids":
        return (1, 1), (2 * batch, 1)
    if name == "attention_mask":
        return (1, 2), (2 * batch, 2 * shape[1])
    return (1, shape[1], 1, shape[3]), (2 * batch, shape[1], 2 * shape[2], shape[3])


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=_gpu_skip_reason() or "")
def test_tensorrt_plugin_engine_matches_reference(decode_graphs, tmp_path: Path) -> None:
    from polygraphy.backend.trt import (
        CreateConfig,
        EngineFromNetwork,
        NetworkFromOnnxPath,
        Profile,
        TrtRunner,
    )

    source = decode_graphs["gqa4-of-8"]
    model = _in_memory(source)
    _CacheIntoAttention.rule().apply_to_model(model)
    model, plugins = emit(model, "10.15")
    register_tensorrt(plugins)
    path = tmp_path / "decode_plugin.onnx"
    ir.save(model, path, external_data="decode_plugin.onnx.data")

    feeds = _decode_feeds(source)
    profile = Profile()
    for name, array in feeds.items():
        low, high = _profile_range(name, array.shape)
        profile.add(name, min=low, opt=array.shape, max=high)
    engine = EngineFromNetwork(NetworkFromOnnxPath(str(path), strongly_typed=True), CreateConfig(profiles=[profile]))
    with TrtRunner(engine) as runner:
        ours = runner.infer(feeds)
    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    expected, names = session.run(None, feeds), [o.name for o in session.get_outputs()]
    errors = _max_errors([np.asarray(ours[n]) for n in names], expected)
    assert max(errors) <= 1e-3, f"TensorRT plugin engine vs ORT: {errors}"
