"""Rules: replace opset-23 ops an older TensorRT parser lacks by their ONNX function body.

`RMSNormalization` and `RotaryEmbedding` are parsed by TensorRT from 10.15 on; 10.13/10.14 parse
`Attention` but not them. The ONNX schema defines both as context-dependent functions: onnx builds
the body for a node's attributes and input types (stash_type, X's dtype and rank, whether
position_ids is given), so inlining that body keeps the standard's own semantics instead of a
hand-written copy. The bodies use only primitive ops (Mul, ReduceMean, Sqrt, Div, Gather, Slice,
Split, Concat, Transpose, Reshape, Cast, ...); constant folding afterwards turns their shape
arithmetic (ReduceMean axes, split lengths) into the constants TensorRT's importers need.

Selection is data: DECOMPOSITIONS maps op → rule, and `rules_for(version)` picks the rules for
the ops that version's parser lacks (graphs/trt_lint.rule_set).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import onnx
import onnx.defs
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule, pattern

from headfold.graphs.rewrite.cleanup import cleanup
from headfold.graphs.trt_lint import rule_set

__all__ = ["DECOMPOSITIONS", "FUNCTION_OPSET", "decompose", "function_body", "rules_for"]

# Folding an inlined body takes a few rounds: each one gives shapes that let the next fold more.
_MAX_CLEANUPS = 5

# The opset both functions are defined at (RMSNormalization-23, RotaryEmbedding-23, unchanged in
# 24/25). The body's ops changed in 24/25 only by accepting more types, so it is valid there too.
FUNCTION_OPSET = 23


class _FunctionSchema(Protocol):
    """The context-dependent-function members of onnx's OpSchema, which its stubs leave out (onnx reads them with type: ignore)."""

    @property
    def has_context_dependent_function(self) -> bool: ...

    def get_context_dependent_function_with_opset_version(self, opset: int, node: bytes, input_types: Sequence[bytes], /) -> bytes: ...


def function_body(node: ir.Node) -> ir.Function | None:
    """The ONNX function body of `node` built for its attributes and input types, else None
    (no such function, or an input's type or rank is unknown)."""
    # cast: the C++ OpSchema has both members (onnx's stubs omit them), see _FunctionSchema
    schema = cast(_FunctionSchema, onnx.defs.get_schema(node.op_type, FUNCTION_OPSET, node.domain))
    present = [value for value in node.inputs if value is not None]
    if not schema.has_context_dependent_function or any(_unknown_type(v) for v in present):
        return None
    proto = onnx.FunctionProto()
    proto.ParseFromString(
        schema.get_context_dependent_function_with_opset_version(
            FUNCTION_OPSET,
            ir.serde.serialize_node(node).SerializeToString(),
            [ir.serde.serialize_value(v).type.SerializeToString() for v in present],
        )
    )
    return ir.serde.deserialize_function(proto) if proto.node else None


def _unknown_type(value: ir.Value) -> bool:
    """The body depends on dtype (casts back) and rank (3D vs 4D X)."""
    return value.dtype is None or value.shape is None


def _refers_to_attributes(body: ir.Function) -> bool:
    """True when a body node still reads an attribute of the call (a reference, not a value)."""
    return any(attr.is_ref() for node in body for attr in node.attributes.values())


class InlineFunctionBody(pattern.RewriteRuleClassBase):
    """Matches every standard `op_type` node and replaces it with its function body."""

    def __init__(self, op_type: str) -> None:
        super().__init__(f"Decompose{op_type}")
        self.op_type = op_type

    def pattern(self, op, x):
        # The other (optional) inputs are read from the node itself: one pattern for any arity.
        return getattr(op, self.op_type)(x, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["output"])

    def check(self, context, output, **_) -> MatchResult:
        result = MatchResult()
        body = function_body(output.producer())
        if body is None:
            return result.fail(f"{self.op_type}: no function body (input types or ranks unknown)")
        if _refers_to_attributes(body):
            return result.fail(f"{self.op_type}: the function body refers to call attributes")
        return result

    def rewrite(self, op, output, **_):
        node = output.producer()
        body = function_body(node)
        # not strict: a call may leave out trailing optional inputs
        values: dict[ir.Value, ir.Value | None] = dict(zip(body.inputs, node.inputs, strict=False))
        for inner in body:
            results = getattr(op, inner.op_type)(
                *(values.get(v) for v in inner.inputs),  # an absent optional input stays None
                _outputs=len(inner.outputs),
                **inner.attributes,
            )
            values |= zip(inner.outputs, results if len(inner.outputs) > 1 else [results], strict=True)
        return values[body.outputs[0]]


# op → the rule that removes it; rules_for picks by what the target parser lacks.
DECOMPOSITIONS: dict[str, RewriteRule] = {op: InlineFunctionBody.rule(op) for op in ("RMSNormalization", "RotaryEmbedding")}


def rules_for(trt_version: str) -> dict[str, RewriteRule]:
    """The decompositions TensorRT `trt_version`'s parser needs: those of the ops it has no importer for."""
    parsed = rule_set(trt_version).ops
    return {op: rule for op, rule in DECOMPOSITIONS.items() if op not in parsed}


def decompose(model: ir.Model, trt_version: str) -> dict[str, int]:
    """Decompose in place every op TensorRT `trt_version` cannot parse and has a rule here;
    return op → nodes decomposed (only the ops that version needs)."""
    counts = {op: rule.apply_to_model(model) for op, rule in rules_for(trt_version).items()}
    if any(counts.values()):
        _cleanup_until_stable(model)
    return counts


def _cleanup_until_stable(model: ir.Model) -> None:
    """Fold until the node count stops changing: TensorRT needs the axes and split lengths constant."""
    for _ in range(_MAX_CLEANUPS):
        before = model.graph.num_nodes()
        cleanup(model)
        if model.graph.num_nodes() == before:
            return
