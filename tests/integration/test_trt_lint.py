"""headfold.graphs.trt_lint: each rule on hand-built graphs (fires / stays quiet), and the real
exported tiny-Llama graphs against TensorRT 10.13 / 10.14 / 10.15 / 11.0."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from headfold import convert
from headfold.graphs.export import export
from headfold.graphs.trt_lint import format_table, lint, lint_export, rule_set
from headfold.ground.errors import BadInput

Q_SHAPE, KV_SHAPE = [1, 8, 5, 16], [1, 2, 5, 16]


def _model(nodes: list[onnx.NodeProto], inputs: dict[str, tuple[int, list[int]]], opset: int = 23, extra_opsets=()) -> ir.Model:
    """A graph of `nodes` with typed inputs {name: (dtype, shape)}; every node output is a graph output."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, dtype, shape) for name, (dtype, shape) in inputs.items()],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for n in nodes for o in n.output if o],
    )
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, 1) for d in extra_opsets)]
    return ir.from_proto(helper.make_model(graph, opset_imports=opsets))


def _attention(inputs=("q", "k", "v", "mask"), outputs=("y",), mask_shape=(1, 1, 5, 5), q_shape=Q_SHAPE, **attrs) -> ir.Model:
    node = helper.make_node("Attention", list(inputs), list(outputs), name="attn", **attrs)
    types = {"q": (TensorProto.FLOAT, q_shape), "k": (TensorProto.FLOAT, KV_SHAPE), "v": (TensorProto.FLOAT, KV_SHAPE)}
    types |= {"mask": (TensorProto.BOOL, list(mask_shape)), "past_key": (TensorProto.FLOAT, KV_SHAPE), "nonpad": (TensorProto.INT64, [1])}
    return _model([node], {name: types[name] for name in inputs if name})


def _rules(report) -> set[tuple[str, str]]:
    return {(f.rule, f.severity) for f in report.findings}


def test_clean_gqa_attention_parses_from_10_14() -> None:
    report = lint(_attention(), "10.14")
    assert report.findings == [] and report.parsable and report.rules == "10.14"


def test_attention_before_10_14_is_unsupported() -> None:
    report = lint(_attention(), "10.13")
    assert _rules(report) == {("op-unsupported", "error")}
    assert "parsed from TensorRT 10.14 on" in report.errors[0].message and report.errors[0].node == "attn"
    assert (report.errors[0].op, report.errors[0].since) == ("Attention", "10.14")  # typed, not parsed back from the text


def test_findings_name_their_op_and_the_release_that_parses_it() -> None:
    """since is None where no release parses the op; custom-domain ops are named domain.op; a saved report loads back equal."""
    from headfold.graphs.trt_lint import LintReport

    nodes = [helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attn"), helper.make_node("Foo", ["q"], ["f"], name="foo", domain="my.ops")]
    report = lint(
        _model(nodes, {"q": (TensorProto.FLOAT, Q_SHAPE), "k": (TensorProto.FLOAT, KV_SHAPE), "v": (TensorProto.FLOAT, KV_SHAPE)}, extra_opsets=("my.ops",)),
        "11.0",
    )
    assert [(f.node, f.rule, f.op, f.since) for f in report.findings] == [("foo", "custom-domain", "my.ops.Foo", None)]
    assert LintReport.from_dict(report.to_dict()) == report


@pytest.mark.parametrize(
    "model, rule",
    [
        pytest.param(_attention(outputs=("y", "present_key")), "attention-outputs", id="present-output"),
        pytest.param(_attention(outputs=("y", "", "")), "attention-outputs", id="declared-empty-outputs"),
        pytest.param(_attention(inputs=("q", "k", "v", "", "past_key")), "attention-past", id="past-key"),
        pytest.param(_attention(inputs=("q", "k", "v", "", "", "", "nonpad")), "attention-inputs", id="nonpad-kv-seqlen"),
        pytest.param(_attention(mask_shape=(1, 1, 1, 5, 5)), "attention-mask-rank", id="mask-rank-5"),
        pytest.param(_attention(is_causal=1), "attention-causal-mask", id="causal-with-mask"),
        pytest.param(_attention(softcap=30.0), "attention-attributes", id="softcap"),
        pytest.param(_attention(softmax_precision=1), "attention-attributes", id="softmax-precision"),
        pytest.param(_attention(qk_matmul_output_mode=1), "attention-attributes", id="qk-output-mode"),
        pytest.param(_attention(q_shape=[1, 5, 128], q_num_heads=8, kv_num_heads=2), "attention-rank", id="3d-q-4d-kv"),
    ],
)
def test_attention_rule_fires(model: ir.Model, rule: str) -> None:
    report = lint(model, "10.15")
    assert _rules(report) == {(rule, "error")} and not report.parsable


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(_attention(mask_shape=(5, 5)), id="mask-rank-2"),
        pytest.param(_attention(inputs=("q", "k", "v"), is_causal=1), id="causal-without-mask"),
        pytest.param(_attention(inputs=("q", "k", "v", "")), id="empty-optional-mask"),
        pytest.param(_attention(softcap=0.0, qk_matmul_output_mode=0), id="default-attributes"),
    ],
)
def test_attention_rule_stays_quiet(model: ir.Model) -> None:
    assert lint(model, "10.15").findings == []


@pytest.mark.parametrize("op", ["RotaryEmbedding", "RMSNormalization"])
def test_llm_ops_parse_from_10_15(op: str) -> None:
    inputs = ["x", "cos", "sin"] if op == "RotaryEmbedding" else ["x", "scale"]
    node = helper.make_node(op, inputs, ["y"], name="n")
    model = _model([node], {name: (TensorProto.FLOAT, [1, 2, 4, 8]) for name in inputs})
    assert [(f.rule, f.node) for f in lint(model, "10.14").errors] == [("op-unsupported", "n")]
    assert lint(model, "10.15").findings == []


def test_unsupported_standard_op_is_an_error() -> None:
    model = _model([helper.make_node("Unique", ["x"], ["y"])], {"x": (TensorProto.FLOAT, [4])})
    report = lint(model, "11.0")
    assert _rules(report) == {("op-unsupported", "error")} and report.errors[0].node == "Unique#0"


def test_ops_inside_subgraphs_are_checked() -> None:
    branch = helper.make_graph([helper.make_node("Unique", ["x"], ["u"])], "then", [], [helper.make_tensor_value_info("u", TensorProto.FLOAT, None)])
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)
    model = _model([node], {"cond": (TensorProto.BOOL, []), "x": (TensorProto.FLOAT, [4])})
    assert [f.node for f in lint(model, "10.15").errors] == ["Unique#1", "Unique#2"]


def test_custom_domain_needs_a_plugin() -> None:
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v"], ["y"], domain="com.microsoft", num_heads=8, kv_num_heads=2)
    model = _model([node], {n: (TensorProto.FLOAT, [1, 5, 64]) for n in "qkv"}, extra_opsets=["com.microsoft"])
    report = lint(model, "11.0")
    assert _rules(report) == {("custom-domain", "error")}
    assert "com.microsoft::GroupQueryAttention" in report.errors[0].message
    assert lint(model, "11.0", plugins=["com.microsoft::GroupQueryAttention"]).findings == []


def test_tensorrt_custom_ops_parse_from_11_0() -> None:
    node = helper.make_node("TRT_Attention", ["q", "k", "v"], ["y"], domain="trt")
    model = _model([node], {n: (TensorProto.FLOAT, Q_SHAPE) for n in "qkv"}, extra_opsets=["trt"])
    assert lint(model, "11.0").findings == []
    assert "parsed from TensorRT 11.0 on" in lint(model, "10.15").errors[0].message


@pytest.mark.parametrize("opset, warned", [(23, False), (24, False), (25, True)])
def test_opset_outside_documented_range_warns(opset: int, warned: bool) -> None:
    report = lint(_with_opset(_attention(), opset), "10.15")
    assert report.parsable
    assert bool(report.warnings) == warned and all(f.rule == "opset-range" for f in report.warnings)


def _with_opset(model: ir.Model, opset: int) -> ir.Model:
    model.opset_imports[""] = opset
    return model


@pytest.mark.parametrize("dtype, warned", [(TensorProto.INT64, True), (TensorProto.FLOAT, False)])
def test_dtype_outside_documented_types_warns(dtype: int, warned: bool) -> None:
    axis = helper.make_node("Constant", [], ["axis"], value=helper.make_tensor("a", TensorProto.INT64, [], [1]))
    model = _model([axis, helper.make_node("CumSum", ["x", "axis"], ["y"], name="cumsum")], {"x": (dtype, [2, 5])})
    report = lint(model, "10.15")
    assert report.parsable and [(f.rule, f.node) for f in report.warnings] == ([("op-dtype", "cumsum")] if warned else [])


@pytest.mark.parametrize("version, rules", [("10.14.1", "10.14"), ("10.15", "10.15"), ("11.5", "11.0")])
def test_rule_set_is_newest_not_newer(version: str, rules: str) -> None:
    assert rule_set(version).name == rules


@pytest.mark.parametrize("version", ["10.12", "9.0", "ten", "10", "12.3", "99.9"])
def test_unknown_versions_are_refused(version: str) -> None:
    with pytest.raises(BadInput):
        rule_set(version)


# ---- the graphs headfold really exports ---------------------------------------------------------

EXPECTED = {"10.13": False, "10.14": False, "10.15": True, "11.0": True}


@pytest.fixture(scope="module")
def llama_export(tiny_checkpoint, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("trt-lint")
    checkpoint = convert(tiny_checkpoint("llama"), folder / "kv2", 2, method="mean", progress=False)
    export(checkpoint, folder / "onnx", progress=False, graphs="split")
    return folder / "onnx"


@pytest.mark.slow
@pytest.mark.parametrize("version", EXPECTED)
def test_exported_llama_graphs(llama_export: Path, version: str) -> None:
    """Prefill and decode share their op set: RMSNormalization and RotaryEmbedding need 10.15.

    Decode keeps the KV cache outside Attention (past K/V are concatenated before the node), so
    no version reports past inputs or extra outputs on Attention.
    """
    reports = lint_export(llama_export, version)
    assert list(reports) == ["prefill.onnx", "decode.onnx"]
    for name, report in reports.items():
        assert report.parsable == EXPECTED[version], (name, report.errors)
        assert not {f.rule for f in report.findings} & {"attention-past", "attention-outputs", "attention-causal-mask"}
        assert {f.message.split()[0] for f in report.errors} <= {"RMSNormalization", "RotaryEmbedding", "Attention"}
    table = format_table(reports)
    verdict = "yes" if EXPECTED[version] else "no "
    assert f"prefill.onnx  {verdict}" in table and f"decode.onnx   {verdict}" in table
