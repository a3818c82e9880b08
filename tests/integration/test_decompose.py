"""graphs/rewrite/decompose: RMSNormalization / RotaryEmbedding become primitives TensorRT 10.14 parses.

One-node models check the inlined function bodies against ONNX Runtime's own kernels; exported
tiny decoders check that `export(..., trt_version="10.14")` is parsable and computes what the
plain export does.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx_ir as ir
import onnxruntime as ort
import pytest
from support.tiny_models import sample_batch, tiny_config

from headfold.cli import main
from headfold.engines.env import Target
from headfold.engines.plan import refusal
from headfold.graphs.export import export
from headfold.graphs.rewrite import attention_nodes
from headfold.graphs.rewrite.decompose import DECOMPOSITIONS, decompose, rules_for
from headfold.graphs.trt_lint import lint, lint_export, rule_set

DECOMPOSED_OPS = ("RMSNormalization", "RotaryEmbedding")
FP32_TOLERANCE = 1e-5
FP16_TOLERANCE = 1e-3  # fp16 output rounding (ulp at 1.0 is ~1e-3)
B, S, HEADS, HEAD_SIZE, MAX_POSITIONS = 2, 5, 3, 8, 16


# ---- selection ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "expected"), [("10.13", DECOMPOSED_OPS), ("10.14", DECOMPOSED_OPS), ("10.14.1", DECOMPOSED_OPS), ("10.15", ()), ("11.0", ())]
)
def test_rules_for_picks_the_ops_the_parser_lacks(version: str, expected: tuple[str, ...]) -> None:
    assert tuple(rules_for(version)) == expected
    assert all(op not in rule_set(version).ops for op in rules_for(version))


# ---- one-node models ---------------------------------------------------------------------------


def _one_node(node: onnx.NodeProto, inputs: dict[str, np.ndarray], symbolic: dict[str, list]) -> onnx.ModelProto:
    """A model of `node` whose inputs take the arrays' dtypes and the given (partly symbolic) shapes."""
    infos = [oh.make_tensor_value_info(name, oh.np_dtype_to_tensor_dtype(array.dtype), symbolic.get(name, list(array.shape))) for name, array in inputs.items()]
    output_type = oh.np_dtype_to_tensor_dtype(next(iter(inputs.values())).dtype)
    graph = oh.make_graph([node], "one_node", infos, [oh.make_tensor_value_info("Y", output_type, None)])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 23)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _decomposed_error(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[float, Counter]:
    """Max |decomposed − ORT on the original| and the decomposed graph's op counts."""
    expected = _run(proto, feeds)
    model = ir.serde.deserialize_model(proto)
    counts = decompose(model, "10.14")
    assert sum(counts.values()) == 1
    rewritten = ir.serde.serialize_model(model)
    ops = Counter(node.op_type for node in rewritten.graph.node)
    assert not set(ops) & set(DECOMPOSED_OPS)
    assert set(ops) <= set(rule_set("10.14").ops)
    actual = _run(rewritten, feeds)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    return float(np.abs(actual.astype(np.float64) - expected).max()), ops


RMS_CASES = [  # (shape, axis, epsilon, dtype)
    ((B, S, 16), -1, 1e-6, np.float32),
    ((B, S, 16), 1, 1e-5, np.float32),  # normalise over the last two axes
    ((B, HEADS, S, HEAD_SIZE), -1, 1e-2, np.float32),  # per-head q/k norm
    ((B, HEADS, S, HEAD_SIZE), -2, 0.5, np.float32),
    ((B, S, 16), -1, 1e-6, np.float16),  # stash_type=1: computed in fp32, cast back
]


@pytest.mark.parametrize(("shape", "axis", "epsilon", "dtype"), RMS_CASES)
def test_rms_normalization_matches_ort(shape: tuple[int, ...], axis: int, epsilon: float, dtype: type) -> None:
    rng = np.random.default_rng(0)
    feeds = {
        "X": (rng.standard_normal(shape) * 3).astype(dtype),
        "scale": (1 + 0.1 * rng.standard_normal(shape[axis:])).astype(dtype),
    }
    node = oh.make_node("RMSNormalization", ["X", "scale"], ["Y"], axis=axis, epsilon=epsilon, stash_type=1)
    symbolic = {"X": ["batch", "sequence", *shape[2:]]}
    error, ops = _decomposed_error(_one_node(node, feeds, symbolic), feeds)
    assert error <= (FP16_TOLERANCE if dtype == np.float16 else FP32_TOLERANCE)
    assert ops["ReduceMean"] == 1 and ops["Sqrt"] == 1
    assert ops["Cast"] == (2 if dtype == np.float16 else 0)  # fp32 casts fold away


def _rotary_feeds(rank: int, rotary_dim: int, with_positions: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    shape = (B, HEADS, S, HEAD_SIZE) if rank == 4 else (B, S, HEADS * HEAD_SIZE)
    angles = rng.uniform(0, 2 * np.pi, (MAX_POSITIONS, rotary_dim // 2) if with_positions else (B, S, rotary_dim // 2))
    feeds = {"X": rng.standard_normal(shape).astype(np.float32)}
    feeds |= {"cos_cache": np.cos(angles).astype(np.float32), "sin_cache": np.sin(angles).astype(np.float32)}
    if with_positions:
        feeds["position_ids"] = rng.integers(0, MAX_POSITIONS, (B, S))
    return feeds


ROTARY_CASES = list(itertools.product((4, 3), (0, 1), (HEAD_SIZE, HEAD_SIZE // 2), (False, True)))


@pytest.mark.parametrize(("rank", "interleaved", "rotary_dim", "with_positions"), ROTARY_CASES)
def test_rotary_embedding_matches_ort(rank: int, interleaved: int, rotary_dim: int, with_positions: bool) -> None:
    feeds = _rotary_feeds(rank, rotary_dim, with_positions)
    attributes = {"interleaved": interleaved, "rotary_embedding_dim": 0 if rotary_dim == HEAD_SIZE else rotary_dim}
    if rank == 3:
        attributes["num_heads"] = HEADS
    node = oh.make_node("RotaryEmbedding", list(feeds), ["Y"], **attributes)
    sequence_axis = 2 if rank == 4 else 1
    symbolic = {"X": ["batch", *(["sequence"] if rank == 3 else [HEADS, "sequence"]), feeds["X"].shape[-1]]}
    error, ops = _decomposed_error(_one_node(node, feeds, symbolic), feeds)
    assert error <= FP32_TOLERANCE
    assert feeds["X"].shape[sequence_axis] == S
    assert ops["Gather"] == (2 if with_positions else 0)


def test_a_version_with_the_importers_changes_nothing() -> None:
    feeds = _rotary_feeds(4, HEAD_SIZE, False)
    proto = _one_node(oh.make_node("RotaryEmbedding", list(feeds), ["Y"]), feeds, {})
    model = ir.serde.deserialize_model(proto)
    assert decompose(model, "10.15") == {}
    assert [node.op_type for node in model.graph] == ["RotaryEmbedding"]


def test_unknown_rank_is_left_alone() -> None:
    feeds = _rotary_feeds(4, HEAD_SIZE, False)
    proto = _one_node(oh.make_node("RotaryEmbedding", list(feeds), ["Y"]), feeds, {})
    proto.graph.input[0].type.tensor_type.ClearField("shape")  # 3D or 4D decides the body
    model = ir.serde.deserialize_model(proto)
    assert decompose(model, "10.14") == {"RMSNormalization": 0, "RotaryEmbedding": 0}


def test_refusal_suggests_the_decomposing_export() -> None:
    feeds = {"X": np.zeros((B, S, 16), np.float32), "scale": np.ones(16, np.float32)}
    proto = _one_node(oh.make_node("RMSNormalization", ["X", "scale"], ["Y"]), feeds, {})
    target = Target("10.14.1", strongly_typed=True, precision_flags=True, detected=False)
    message = refusal("prefill.onnx", lint(ir.serde.deserialize_model(proto), "10.14"), target)
    assert "headfold export --trt-version 10.14.1 (decomposes RMSNormalization)" in message
    assert "TensorRT 10.15 or newer" in message
    assert set(DECOMPOSITIONS) == set(DECOMPOSED_OPS)


# ---- exported tiny decoders ------------------------------------------------------------------

# family → (RMSNormalization, RotaryEmbedding) per graph: 2 layers; qwen3 adds q/k norms;
# gpt_neox normalises with LayerNorm and rotates half of each head.
FAMILIES = {"llama": (5, 4), "qwen3": (9, 4), "gpt_neox": (0, 4)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def exported(request, tiny_export, tmp_path_factory) -> tuple[str, Path, Path, dict]:
    """(family, plain export (shared), export for TensorRT 10.14, its summary), once per family."""
    family = request.param
    src, plain = tiny_export(family)
    folder = tmp_path_factory.mktemp(f"decompose_{family}")
    summary = export(src, folder / "trt10.14", trt_version="10.14", progress=False, graphs="split")
    return family, plain, folder / "trt10.14", summary


@pytest.mark.slow
def test_export_for_10_14_is_parsable_and_keeps_attention(exported) -> None:
    family, plain, decomposed, summary = exported
    norms, rotaries = FAMILIES[family]
    assert not any(report.parsable for report in lint_export(plain, "10.14").values())
    for name, report in lint_export(decomposed, "10.14").items():
        assert report.parsable, (name, report.errors)
        model = ir.load(decomposed / name)
        ops = Counter(node.op_type for node in model.graph)
        assert ops["RMSNormalization"] == ops["RotaryEmbedding"] == 0
        assert [node.layer for node in attention_nodes(model)] == [0, 1]
    written = json.loads((decomposed / "export.json").read_text())
    for graph in written["graphs"].values():
        counts = {"RMSNormalization": norms, "RotaryEmbedding": rotaries}
        expected = {"version": "10.14", **{op: n for op, n in counts.items() if n}}  # ops the graph lacks: not listed
        assert graph["decomposed_for_tensorrt"] == expected
    assert written == summary
    assert all("decomposed_for_tensorrt" not in g for g in json.loads((plain / "export.json").read_text())["graphs"].values())


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _max_difference(plain: Path, decomposed: Path, graph: str, feeds: dict[str, np.ndarray]) -> float:
    expected = _session(plain / graph).run(None, feeds)
    actual = _session(decomposed / graph).run(None, feeds)
    return max(float(np.abs(a - e).max()) for a, e in zip(actual, expected, strict=True))


@pytest.mark.slow
def test_export_for_10_14_computes_the_same(exported) -> None:
    """Prefill on a left-padded batch, then one decode step on its K/V: equal to the plain export."""
    family, plain, decomposed, _ = exported
    batch = {k: v.numpy() for k, v in sample_batch(tiny_config(family)).items()}
    assert batch["attention_mask"][-1, 0] == 0  # padded
    assert _max_difference(plain, decomposed, "prefill.onnx", batch) <= FP32_TOLERANCE
    logits, *present = _session(plain / "prefill.onnx").run(None, batch)
    layers = len(present) // 2
    past = {f"past_key_values.{i}.{kind}": present[2 * i + j] for i in range(layers) for j, kind in enumerate(("key", "value"))}
    step = {
        "input_ids": logits[:, -1].argmax(-1)[:, None],
        "attention_mask": np.concatenate([batch["attention_mask"], np.ones((B, 1), np.int64)], axis=1),
        **past,
    }
    assert _max_difference(plain, decomposed, "decode.onnx", step) <= FP32_TOLERANCE


@pytest.mark.slow
def test_cli_export_for_10_14_prints_parsable(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    out = tmp_path / "onnx"
    assert main(["export", str(tiny_checkpoint("llama")), str(out), "--quiet", "--trt-version", "10.14"]) == 0
    printed = capsys.readouterr().out
    assert "decomposed for TensorRT 10.14: 5 RMSNormalization, 4 RotaryEmbedding" in printed
    assert printed.count(": 2 Attention nodes, kv-heads") == 2  # the standard op, in prefill.onnx and decode.onnx
    assert "TensorRT 10.14 (rule set 10.14)" in printed
    rows = [line.split() for line in printed.splitlines() if line.startswith(("prefill.onnx", "decode.onnx"))]
    assert rows == [["prefill.onnx", "yes", "0", "0"], ["decode.onnx", "yes", "0", "0"]]  # graph, parsable, errors, warnings


@pytest.mark.slow
@pytest.mark.parametrize(
    ("flags", "options"),
    [(["--trt-version", "10.14"], {"trt_version": "10.14"}), (["--attention", "onnx"], {"attention": "onnx"})],
    ids=["trt-version", "attention"],
)
def test_the_api_and_the_command_give_the_same_graphs_for_the_same_request(tiny_checkpoint, tmp_path: Path, flags: list[str], options: dict) -> None:
    """`headfold export SRC OUT FLAGS` and headfold.export(SRC, OUT, ExportOptions(...)): one settings object
    (ExportOptions, its defaults declared once), so the same graph files with the same nodes and the same
    export.json, the layout chosen once (graph_layout: split for a TensorRT target)."""
    import headfold

    src = tiny_checkpoint("llama")
    assert main(["export", str(src), str(tmp_path / "cli"), "--quiet", *flags]) == 0
    headfold.export(src, tmp_path / "api", headfold.ExportOptions(**options), progress=False)
    files = {side: sorted(p.name for p in (tmp_path / side).iterdir()) for side in ("cli", "api")}
    assert files["cli"] == files["api"]
    graphs = sorted(name for name in files["cli"] if name.endswith(".onnx"))
    assert graphs == (["decode.onnx", "prefill.onnx"] if "trt_version" in options else ["model.onnx"])
    for name in graphs:
        ops = [[n.op_type for n in onnx.load(tmp_path / side / name, load_external_data=False).graph.node] for side in ("cli", "api")]
        assert ops[0] == ops[1]
    untimed = lambda graph: {k: v for k, v in graph.items() if not k.endswith("_s")}  # noqa: E731 (seconds)
    summaries = [json.loads((tmp_path / side / "export.json").read_text()) for side in ("cli", "api")]
    summaries = [{**summary, "graphs": {name: untimed(graph) for name, graph in summary["graphs"].items()}} for summary in summaries]
    assert summaries[0] == summaries[1] and summaries[0]["attention"] == "onnx"
