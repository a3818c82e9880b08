"""Emitter rules: decode `Attention` with a KV cache → the headfold::GQADecodeAttention plugin node.

Two shapes of decode attention exist in ONNX graphs:
- `Attention(Q, K, V, mask, past_key, past_value) → (Y, present_key, present_value)` (the cache is
  inside the node). TensorRT's ONNX parser rejects past_key/past_value on Attention in every release
  we have rules for, so this form always needs the plugin.
- `Concat(past, K)`, `Concat(past, V)` → `Attention(Q, present_key, present_value, mask)` (the cache
  is outside the node; headfold's own export). TensorRT parses that natively from 10.14 on, so this
  form is rewritten only for parsers without an Attention importer.
Both become one plugin node with the inputs (Q, K, V, mask, past_key, past_value) and outputs
(Y, present_key, present_value), the node's scale made explicit.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRule, pattern

from headfold.graphs.rewrite.values import dims, float_attr, gqa_problem, int_attr
from headfold.graphs.trt_lint import RuleSet
from headfold.plugins.gqa_decode_attention.reference import DOMAIN, OP_TYPE

_SEQUENCE_AXES = {2, -2}
# what tensorrt_impl offers: tensorrt.plugin's Tensor has no CUDA array interface for bf16
_TENSOR_TYPES = {ir.DataType.FLOAT, ir.DataType.FLOAT16}


class _DecodeAttentionToPlugin(pattern.RewriteRuleClassBase):
    """Shared check and rewrite; subclasses give the pattern and what the parser lacks."""

    def __init__(self, name: str, parser: RuleSet) -> None:
        super().__init__(name)
        self.parser = parser

    def check(self, context, query, key, value, mask, past_key, past_value, attention, **bindings) -> MatchResult:
        result = MatchResult()
        node = attention.producer()
        if problem := gqa_problem(query, key, value):
            return result.fail(problem)
        if dims(past_key, 4) is None or dims(past_value, 4) is None:
            return result.fail("past_key/past_value are not 4D (B, kv_heads, past, head_size)")
        if query.dtype not in _TENSOR_TYPES:
            return result.fail(f"the plugin computes in fp32 or fp16; Q is {query.dtype}")
        if mask is None or mask.dtype not in (ir.DataType.BOOL, query.dtype):
            return result.fail("the plugin takes a bool attn_mask or an additive one in Q's type; the node has none or another")
        if int_attr(node, "left_window_size", -1) != -1 or int_attr(node, "right_window_size", -1) != -1:
            return result.fail("sliding-window attention (Attention-25) is not implemented by the plugin")
        return self.check_form(result, node, bindings)

    def check_form(self, result: MatchResult, node: ir.Node, bindings: dict) -> MatchResult:
        raise NotImplementedError

    def rewrite(self, op, query, key, value, mask, past_key, past_value, attention, **_):
        node = attention.producer()
        heads, kv_heads, head_size = dims(query, 4)[1], dims(key, 4)[1], dims(query, 4)[3]
        return op.GQADecodeAttention(
            query,
            key,
            value,
            mask,
            past_key,
            past_value,
            _domain=DOMAIN,
            _outputs=3,
            q_num_heads=heads,
            kv_num_heads=kv_heads,
            scale=float_attr(node, "scale") or head_size**-0.5,
            is_causal=int_attr(node, "is_causal", 0),
            softcap=float_attr(node, "softcap"),
            plugin_namespace=DOMAIN,  # TensorRT's parser reads the namespace from this attribute
        )


class PastInputsToPlugin(_DecodeAttentionToPlugin):
    """Attention with past_key/past_value inputs and present outputs."""

    def __init__(self, parser: RuleSet) -> None:
        super().__init__(f"AttentionWithPastTo{OP_TYPE}", parser)

    def pattern(self, op, query, key, value, mask, past_key, past_value):
        return op.Attention(query, key, value, mask, past_key, past_value, _outputs=["attention", "present_key", "present_value"])

    def check_form(self, result: MatchResult, node: ir.Node, bindings: dict) -> MatchResult:
        return result  # no TensorRT parser takes past_key/past_value on Attention


class ConcatCacheToPlugin(_DecodeAttentionToPlugin):
    """Attention over Concat(past, new) K/V, for parsers without an Attention importer."""

    def __init__(self, parser: RuleSet) -> None:
        super().__init__(f"ConcatCacheAttentionTo{OP_TYPE}", parser)

    def pattern(self, op, query, key, value, mask, past_key, past_value):
        present_key = op.Concat(past_key, key, axis=pattern.AttrVar("key_axis"), _outputs=["present_key"])
        present_value = op.Concat(past_value, value, axis=pattern.AttrVar("value_axis"), _outputs=["present_value"])
        return op.Attention(query, present_key, present_value, mask, _outputs=["attention"]), present_key, present_value

    def check_form(self, result: MatchResult, node: ir.Node, bindings: dict) -> MatchResult:
        if "Attention" in self.parser.ops:
            return result.fail(f"TensorRT {self.parser.name} parses this Attention natively (the cache is outside it)")
        if {bindings["key_axis"].as_int(), bindings["value_axis"].as_int()} - _SEQUENCE_AXES:
            return result.fail("the past is not concatenated along the sequence axis")
        if int_attr(node, "is_causal", 0):  # top-left aligned here, bottom-right once the past is an input
            return result.fail("is_causal over a concatenated cache would change alignment inside the plugin")
        return result


def rules(parser: RuleSet) -> list[RewriteRule]:
    """The emitter rules for one TensorRT parser's rule set."""
    return [PastInputsToPlugin.rule(parser), ConcatCacheToPlugin.rule(parser)]
