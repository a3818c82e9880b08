"""`--optimize ort`: ONNX Runtime's fused kernels, through onnxscript's ort_fusions rules and ours, counted.

onnxscript's ORT fusions match the *decomposed* RMS norm (Pow/ReduceMean/Sqrt); torch writes the
opset-23 `RMSNormalization` op, so one rule here first renames it to ORT's
`SimplifiedLayerNormalization` (the same function: x / sqrt(mean(x²) + ε) · scale, computed in
the stash type), which lets onnxscript's skip rule fuse each residual Add into it
(`SkipSimplifiedLayerNormalization`, com.microsoft); norms without a residual Add go back to
`RMSNormalization` (ORT registers SimplifiedLayerNormalization in the ONNX domain, which onnx's
checker does not know). Transpose + MatMul pairs become `FusedMatMul`.

On `--attention ort-gqa` graphs each GroupQueryAttention then takes what ORT's own model builder
gives it: rotary inside (do_rotary with cos/sin tables, RotaryIntoGroupQueryAttention), Q/K/V from
one packed MatMul (PackedQKV), and the head split/merge transposes around it dropped (their round
trip is the identity). The per-layer copies of shared constants are merged. The result runs in
ONNX Runtime only (the contrib ops are its own).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
import onnxruntime as ort
from onnxscript.rewriter import MatchResult, pattern
from onnxscript.rewriter.ort_fusions import fused_matmul_rule_sets
from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

from headfold.graphs.rewrite.ort_gqa import DOMAIN
from headfold.graphs.rewrite.values import constant, dims, float_attr, int_attr, is_lazy, same_dims
from headfold.graphs.weights import joined

__all__ = ["fuse_for_ort", "ROTARY_POSITIONS_INPUT_DIMS"]


class RenameRMSNormalization(pattern.RewriteRuleClassBase):
    """RMSNormalization over the last axis ⇄ ORT's SimplifiedLayerNormalization (same attributes)."""

    def __init__(self, source: str, target: str) -> None:
        super().__init__(f"{source}To{target}")
        self.source, self.target = source, target

    def pattern(self, op, x, scale):
        return getattr(op, self.source)(x, scale, _allow_other_attributes=True, _outputs=["normalized"])

    def check(self, context, x, scale, normalized, **_) -> MatchResult:
        result = MatchResult()
        node = normalized.producer()
        rank = x.shape.rank() if x.shape is not None else None
        if int_attr(node, "axis", -1) not in (-1, (rank or 0) - 1):
            return result.fail("normalizes other axes than the last; ORT's op takes the last axes from `axis` on too, keep it")
        return result

    def rewrite(self, op, x, scale, normalized, **_):
        node = normalized.producer()
        return getattr(op, self.target)(x, scale, axis=-1, epsilon=float_attr(node, "epsilon", 1e-5), stash_type=int_attr(node, "stash_type", 1))


# --- GroupQueryAttention as ORT's model builder writes it -------------------------------------

_HEADS_PERM = [0, 2, 1, 3]  # BSNH ⇄ BNSH, its own inverse
_GQA_OUTPUTS = ["output", "present_key", "present_value"]


def _split_heads(op, projection, name: str):
    """(B, S, N·d) → (B, N, S, d): the exporter's view + transpose of a projection."""
    return op.Transpose(op.Reshape(projection, pattern.ANY_VALUE, _outputs=[name]), perm=_HEADS_PERM)


def _merge_heads(op, heads, name: str):
    """(B, N, S, d) → (B, S, N·d): ort_gqa's layout change in front of GroupQueryAttention."""
    return op.Reshape(op.Transpose(heads, perm=_HEADS_PERM), pattern.ANY_VALUE, _outputs=[name])


def _round_trip(projection: ir.Value, split: ir.Value, merged: ir.Value) -> bool:
    """split (B, S, N, d) of the (B, S, N·d) projection, merged back to the same (B, S, N·d)."""
    p, s, m = dims(projection, 3), dims(split, 4), dims(merged, 3)
    return p is not None and s is not None and m is not None and same_dims(p, m) and same_dims(p[:2], s[:2]) and p[2] == s[2] * s[3]


# Symbolic dims of the exported graph's inputs when the rotary tables are evaluated for positions
# 0..L-1: one row, a prompt of L tokens (input_ids, attention_mask, position_ids), an empty past.
ROTARY_POSITIONS_INPUT_DIMS = {"batch": 1, "sequence": None, "total_sequence": None, "past_sequence": 0}


class RotaryTables:
    """(cos, sin) values of the graph → (cos_cache, sin_cache) initializers of shape (L, d/2).

    The graph's own cos/sin subgraph, run in ONNX Runtime on a one-row prompt of all L positions
    (attention_mask of ones, position_ids 0..L-1, empty past), so whatever it computes (rope
    scaling, attention factors) is kept. One pair of initializers per distinct (cos, sin).
    """

    def __init__(self, model: ir.Model, positions: int) -> None:
        self.model, self.positions = model, positions
        self.cache: dict[tuple[ir.Value, ir.Value], tuple[ir.Value, ir.Value] | None] = {}

    def __call__(self, cos: ir.Value, sin: ir.Value) -> tuple[ir.Value, ir.Value] | None:
        if (cos, sin) not in self.cache:
            self.cache[cos, sin] = self._tables(cos, sin)
        return self.cache[cos, sin]

    def _tables(self, cos: ir.Value, sin: ir.Value) -> tuple[ir.Value, ir.Value] | None:
        try:
            values = _evaluate(self.model, [cos, sin], self._feeds)
        except (ValueError, ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidArgument):
            return None
        if any(v.ndim != 3 or v.shape[:2] != (1, self.positions) for v in values):
            return None
        tables = []
        for value, name in zip(values, ("cos_cache", "sin_cache"), strict=True):
            tensor = ir.Tensor(np.ascontiguousarray(value[0]))
            initializer = ir.Value(name=f"{name}_{len(self.cache)}", shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
            self.model.graph.register_initializer(initializer)
            tables.append(initializer)
        return tables[0], tables[1]

    def _feeds(self, value: ir.Value) -> np.ndarray:
        """The example value of one graph input for the all-positions prompt."""
        shape = []
        for dim in value.shape or ():
            if isinstance(dim, int):
                size: int | None = dim
            else:
                size = -1 if dim.value is None else ROTARY_POSITIONS_INPUT_DIMS.get(dim.value, -1)
            if size == -1:
                raise ValueError(f"{value.name} has an unknown dim {dim}")
            shape.append(self.positions if size is None else size)
        if value.dtype is None:
            raise ValueError(f"{value.name} has no dtype")
        dtype = value.dtype.numpy()
        if value.name == "position_ids":
            return np.arange(self.positions, dtype=dtype).reshape(shape)
        return (np.ones if value.name == "attention_mask" else np.zeros)(shape, dtype=dtype)


def _evaluate(model: ir.Model, outputs: list[ir.Value], feed: Callable[[ir.Value], np.ndarray]) -> list[np.ndarray]:
    """Run the nodes `outputs` depend on (only those) in ONNX Runtime; `feed` gives the graph inputs."""
    nodes: list[ir.Node] = []
    inputs: list[ir.Value] = []
    initializers: list[ir.TensorProtocol] = []
    seen: set[ir.Value] = set()
    stack = list(outputs)
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        producer = value.producer()
        if value.is_graph_input():
            inputs.append(value)
        elif value.const_value is not None and producer is None:
            initializers.append(value.const_value)
        elif producer is not None and producer not in nodes:
            nodes.append(producer)
            stack.extend(v for v in producer.inputs if v is not None)
    order = {node: i for i, node in enumerate(model.graph)}
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in sorted(nodes, key=order.__getitem__)],
        "rotary_tables",
        [_value_info(v) for v in inputs],
        [_value_info(v) for v in outputs],
        [ir.serde.serialize_tensor(tensor) for tensor in initializers],
    )
    opsets = [onnx.helper.make_opsetid(domain, version) for domain, version in model.opset_imports.items()]
    session = ort.InferenceSession(onnx.helper.make_model(graph, opset_imports=opsets).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run([v.name for v in outputs], {v.name: feed(v) for v in inputs})


def _value_info(value: ir.Value) -> onnx.ValueInfoProto:
    """A graph input or output of the evaluated subgraph: its name and dtype, any shape."""
    if value.name is None or value.dtype is None:
        raise ValueError(f"{value} has no name or no dtype")
    return onnx.helper.make_tensor_value_info(value.name, int(value.dtype), None)


def _like(output: ir.Value, outputs: tuple[ir.Value, ...]) -> tuple[ir.Value, ...]:
    """The new node's attention output keeps the (B, S, N·d) shape recorded for the old one."""
    outputs[0].shape = output.shape
    if output.dtype is not None:
        outputs[0].dtype = output.dtype
    return outputs


class RotaryIntoGroupQueryAttention(pattern.RewriteRuleClassBase):
    """GQA(merge(Rotary(split(q))), merge(Rotary(split(k))), merge(split(v)), past…) → GQA(q, k, v, past…,
    cos_cache, sin_cache, do_rotary=1).

    ORT rotates row b's new token s at position seqlens_k[b] + 1 − S + s (s at the first prompt):
    the graph's mask-derived position wherever ort-gqa is exact (unpadded or right-padded rows).
    A graph with a position_ids input passes it on (GQA's position_ids input).
    GQA rotates the whole head, and (ORT 1.32, CPU) only heads of a multiple of 16, so partial
    rotary and smaller heads keep their RotaryEmbedding nodes.
    """

    def __init__(self, tables: RotaryTables, positions: ir.Value | None) -> None:
        super().__init__("RotaryIntoGroupQueryAttention")
        self.tables = tables
        self.positions = positions  # the graph's position_ids input, when it has one: GQA reads it

    def pattern(self, op, q, k, v, past_key, past_value, seqlens_k, total, cos, sin):
        def rotated(x, name):
            split = _split_heads(op, x, f"{name}_split")
            return _merge_heads(op, op.RotaryEmbedding(split, cos, sin, _outputs=[f"{name}_rotary"]), f"{name}_merged")

        value = _merge_heads(op, _split_heads(op, v, "v_split"), "v_merged")
        return op.GroupQueryAttention(rotated(q, "q"), rotated(k, "k"), value, past_key, past_value, seqlens_k, total, _domain=DOMAIN, _outputs=_GQA_OUTPUTS)

    def check(self, context, q, k, v, cos, sin, output, **bound) -> MatchResult:
        result = MatchResult()
        if int_attr(output.producer(), "do_rotary"):
            return result.fail("the node rotates already")
        rotaries = [bound[f"{x}_rotary"].producer() for x in "qk"]
        head_size, width = (dims(bound["q_rotary"], 4) or (None,) * 4)[3], dims(cos, 3)
        if len({(int_attr(n, "interleaved"), int_attr(n, "rotary_embedding_dim")) for n in rotaries}) != 1:
            return result.fail("Q and K are rotated differently")
        if width is None or width[2] * 2 != head_size or int_attr(rotaries[0], "rotary_embedding_dim") not in (0, head_size):
            return result.fail("partial rotary: GQA rotates the whole head", cos)
        if head_size % 16:
            return result.fail(f"head size {head_size}: ORT's GQA rotates only heads of a multiple of 16")
        for x, projection in zip("qkv", (q, k, v), strict=True):
            if not _round_trip(projection, bound[f"{x}_split"], bound[f"{x}_merged"]):
                return result.fail("the heads are not split from and merged back into one (B, S, N·d) value", projection)
        if self.tables(cos, sin) is None:
            return result.fail("the cos/sin subgraph could not be evaluated for every position", cos)
        return result

    def rewrite(self, op, q, k, v, past_key, past_value, seqlens_k, total, cos, sin, output, q_rotary, **_):
        attributes = {name: attr.value for name, attr in output.producer().attributes.items()}
        attributes |= {"do_rotary": 1, "rotary_interleaved": int_attr(q_rotary.producer(), "interleaved")}
        cos_cache, sin_cache = self.tables(cos, sin)
        inputs = [q, k, v, past_key, past_value, seqlens_k, total, cos_cache, sin_cache, *[self.positions] * (self.positions is not None)]
        return _like(output, op.GroupQueryAttention(*inputs, _domain=DOMAIN, _outputs=3, **attributes))


def _constant_tensor(value: ir.Value) -> ir.TensorProtocol | None:
    """A constant's tensor, its contents unread (a streamed weight stays on disk)."""
    return ir.convenience.get_const_tensor(value) if not is_lazy(value) else value.const_value


def _constant_shape(value: ir.Value) -> tuple[int, ...] | None:
    """A constant's shape, read without its contents."""
    tensor = _constant_tensor(value)
    return None if tensor is None else tuple(tensor.shape.numpy())  # a tensor's shape is static


def _concatenated(values: list[ir.Value], axis: int) -> ir.TensorProtocol:
    """The constants joined along `axis`; lazily (read when saved) if any of them is lazy."""
    join = lambda: ir.tensor(np.concatenate([constant(v) for v in values], axis=axis))  # noqa: E731
    if not any(is_lazy(v) for v in values):
        return join()
    tensors = [tensor for v in values if (tensor := _constant_tensor(v)) is not None]
    assert len(tensors) == len(values)  # PackedQKV.check found each one's shape
    if (streamed := joined(tensors, axis)) is not None:
        return streamed  # read part after part when saved, like each of them alone
    shapes = [t.shape.numpy() for t in tensors]
    shape = [*shapes[0]]
    shape[axis] = sum(s[axis] for s in shapes)
    return ir.LazyTensor(join, dtype=tensors[0].dtype, shape=ir.Shape(shape))


class PackedQKV(pattern.RewriteRuleClassBase):
    """GQA(x·Wq [+ bq], x·Wk [+ bk], x·Wv [+ bv], …) → GQA(x·[Wq|Wk|Wv] [+ [bq|bk|bv]], ∅, ∅, …):
    one MatMul instead of three, GQA's packed-QKV form (query (B, S, (N + 2·kv)·d))."""

    def __init__(self, bias: bool) -> None:
        super().__init__("PackedQKV" + ("WithBias" if bias else ""))
        self.bias = bias

    def pattern(self, op, x, wq, wk, wv, bq, bk, bv, past_key, past_value, seqlens_k, total):
        projections = [op.MatMul(x, w) for w in (wq, wk, wv)]
        if self.bias:
            projections = [op.Add(p, b) for p, b in zip(projections, (bq, bk, bv), strict=True)]
        return op.GroupQueryAttention(*projections, past_key, past_value, seqlens_k, total, _allow_other_inputs=True, _domain=DOMAIN, _outputs=_GQA_OUTPUTS)

    def check(self, context, x, wq, wk, wv, output, **bound) -> MatchResult:
        result = MatchResult()
        weights = [shape for w in (wq, wk, wv) if (shape := _constant_shape(w)) is not None and len(shape) == 2]
        if len(weights) != 3 or len({w[0] for w in weights}) != 1:
            return result.fail("the projections are not constant 2D weights over one input")
        if self.bias:
            biases = [_constant_shape(bound[b]) for b in ("bq", "bk", "bv")]
            if any(b is None or b != (w[1],) for b, w in zip(biases, weights, strict=True)):
                return result.fail("the biases are not constant vectors of the projections' widths")
        return result

    def rewrite(self, op, x, wq, wk, wv, past_key, past_value, seqlens_k, total, output, **bound):
        gqa = output.producer()
        packed = op.MatMul(x, op.initializer(_concatenated([wq, wk, wv], axis=1), name=f"{wq.name}_qkv"))
        if self.bias:
            bias = _concatenated([bound[b] for b in ("bq", "bk", "bv")], axis=0)
            packed = op.Add(packed, op.initializer(bias, name=f"{bound['bq'].name}_qkv"))
        attributes = {name: attr.value for name, attr in gqa.attributes.items()}
        return _like(output, op.GroupQueryAttention(packed, None, None, *gqa.inputs[3:], _domain=DOMAIN, _outputs=3, **attributes))


class DropHeadsRoundTrip(pattern.RewriteRuleClassBase):
    """merge(transpose⁻¹(transpose(split(x)))) → x for GQA's (B, S, N·d) output going into o_proj."""

    def __init__(self) -> None:
        super().__init__("DropHeadsRoundTrip")

    def pattern(self, op, x):
        heads = op.Transpose(_split_heads(op, x, "split"), perm=_HEADS_PERM)
        return op.Reshape(heads, pattern.ANY_VALUE, _outputs=["merged"])

    def check(self, context, x, merged, **_) -> MatchResult:
        # Reshape, identity transposes, Reshape: one reshape to merged's shape, the identity if it is x's.
        result = MatchResult()
        p, m = dims(x, 3), dims(merged, 3)
        if p is None or m is None or not same_dims(p, m):
            return result.fail("the merge does not give back x's (B, S, N·d) shape", merged)
        return result

    def rewrite(self, op, x, **_):
        return op.Identity(x)


def _gqa_rules(model: ir.Model, positions: int | None) -> list:
    position_ids = next((v for v in model.graph.inputs if v.name == "position_ids"), None)
    rules = [RotaryIntoGroupQueryAttention.rule(RotaryTables(model, positions), position_ids)] if positions else []
    return [*rules, PackedQKV.rule(bias=False), PackedQKV.rule(bias=True), DropHeadsRoundTrip.rule()]


def fuse_for_ort(model: ir.Model, *, positions: int | None = None) -> dict[str, int]:
    """Apply the ORT fusions in place; rule name → times applied.

    `positions` (the context length) sizes GroupQueryAttention's rotary tables; without it rotary
    stays outside the node.
    """
    RenameRMSNormalization.rule("RMSNormalization", "SimplifiedLayerNormalization").apply_to_model(model)
    counts = {"SkipSimplifiedLayerNormalization": fuse_skip_rms_normalization(model)}
    RenameRMSNormalization.rule("SimplifiedLayerNormalization", "RMSNormalization").apply_to_model(model)
    counts["FusedMatMul"] = fused_matmul_rule_sets.fused_matmul_rule_sets().apply_to_model(model)  # a RewriteRuleSet already
    if any(node.op_type == "GroupQueryAttention" and node.domain == DOMAIN for node in model.graph):
        counts |= {rule.name: rule.apply_to_model(model) for rule in _gqa_rules(model, positions)}
    before = len(model.graph)
    common.IdentityEliminationPass()(model)
    common.CommonSubexpressionEliminationPass()(model)
    common.RemoveUnusedNodesPass()(model)
    counts["merged_duplicate_nodes"] = before - len(model.graph)
    return counts
