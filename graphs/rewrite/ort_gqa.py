"""Rule (`--attention ort-gqa`): standard `Attention` → ONNX Runtime's `com.microsoft.GroupQueryAttention`.

ORT's CUDA decoding kernels (flash / memory-efficient attention, fp16 and bf16 only) exist for the
contrib op, not for the standard one. The contrib op differs in what it accepts:
- Q/K/V are 3D (B, S, heads·d); past/present K/V stay BNSH, so the KV-cache Concat that feeds the
  standard node moves into the GQA node (past_key → present_key);
- there is no mask: attention is causal and each row's keys are positions 0..seqlens_k[b], with
  seqlens_k = (number of real tokens) − 1 and total_sequence_length = the mask's length.

So the rewrite takes the row lengths from the graph's 2D `attention_mask` and is exact only when
that mask is causal ∧ key padding with the real tokens of each row first: **unpadded or
right-padded batches**, which is what onnxruntime-genai feeds (its prompts right-padded, then a
one appended to the mask per step). A left-padded row would attend to its pads: ORT keeps each
row's cache compact, writing a new token's K/V at the row's own length, so a pad before a row's
real tokens takes a cache slot a later token's position reads. The caller keeps appending ones to
`attention_mask` exactly as for the standard graphs.

A layer's sliding window, which the standard node has in its mask, becomes the GQA node's
local_window_size (the rule asks the caller for it by node): ORT then attends to the row's last
local_window_size tokens, the new one included, the count transformers' `sliding_window` gives.

In the merged graph every layer's node takes past K/V and writes present K/V in every phase (an
empty past at the prompt), so onnxruntime-genai can hand it one max-length buffer as both
(`past_present_share_buffer`). ORT itself refuses, at run time, several new tokens after a
non-empty past when the batch has more than one row; one row (chat turns) and the prompt work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, pattern

from headfold.graphs.rewrite.values import dims, float_attr, gqa_problem, int_attr, same_dim

DOMAIN = "com.microsoft"
OP_TYPE = "GroupQueryAttention"
MASK_INPUT = "attention_mask"
_BNSH_TO_BSNH = [0, 2, 1, 3]


class AttentionToGroupQueryAttention(pattern.RewriteRuleClassBase):
    """Masked 4D Attention (K/V at kv-heads), with or without the past-K/V Concat, → GQA."""

    def __init__(self, attention_mask: ir.Value, window_of: Callable[[ir.Node], int | None], *, past: bool) -> None:
        super().__init__("AttentionToGroupQueryAttention" + ("WithPast" if past else ""))
        self.attention_mask = attention_mask
        self.window_of = window_of
        self.past = past

    def pattern(self, op, query, key, value, mask):
        if self.past:
            key = op.Concat(pattern.Var("past_key"), key, axis=pattern.AttrVar("key_axis"), _outputs=["present_key"])
            value = op.Concat(pattern.Var("past_value"), value, axis=pattern.AttrVar("value_axis"), _outputs=["present_value"])
        attention = op.Attention(query, key, value, mask, _outputs=["attention"])
        return (attention, key, value) if self.past else attention

    def check(self, context, query, key, value, mask, attention, **bindings) -> MatchResult:
        result = MatchResult()
        node = attention.producer()
        if problem := gqa_problem(query, key, value):
            return result.fail(problem)
        if int_attr(node, "is_causal") or int_attr(node, "qk_matmul_output_mode"):
            return result.fail("the node is already causal or exposes Q·Kᵀ; GQA takes causality from seqlens_k only")
        if mask.dtype != ir.DataType.BOOL or not self._mask_of_input(mask):
            return result.fail(f"the mask is not a bool (B, 1, S, T) mask over the graph's {MASK_INPUT}", mask)
        if self.past:
            return self._check_past(result, bindings)
        return result

    def _mask_of_input(self, mask: ir.Value) -> bool:
        """The mask spans the rows and the total length of `attention_mask`, so its row lengths apply."""
        m, rows = dims(mask, 4), dims(self.attention_mask, 2)
        return m is not None and rows is not None and same_dim(m[0], rows[0]) and same_dim(m[3], rows[1])

    @staticmethod
    def _check_past(result: MatchResult, bindings: dict) -> MatchResult:
        if {bindings["key_axis"].as_int(), bindings["value_axis"].as_int()} - {2, -2}:
            return result.fail("the past is not concatenated along the sequence axis")
        return result

    def rewrite(self, op, query, key, value, mask, attention, past_key=None, past_value=None, **_):
        node = attention.producer()
        heads, kv_heads, head_size = dims(query, 4)[1], dims(key, 4)[1], dims(query, 4)[3]
        # Row lengths and the buffer length, as the contrib op wants them (int32).
        real_tokens = op.ReduceSum(self.attention_mask, op.Constant(value_ints=[1]), keepdims=0)
        seqlens_k = op.Cast(op.Sub(real_tokens, op.Constant(value_int=1)), to=ir.DataType.INT32)
        total = op.Cast(op.Squeeze(op.Shape(self.attention_mask, start=1, end=2)), to=ir.DataType.INT32)
        inputs = [_to_bsh(op, query), _to_bsh(op, key), _to_bsh(op, value), past_key, past_value, seqlens_k, total]
        output, present_key, present_value = op.GroupQueryAttention(
            *inputs,
            _domain=DOMAIN,
            _outputs=3,
            num_heads=heads,
            kv_num_heads=kv_heads,
            scale=float_attr(node, "scale") or head_size**-0.5,
            softcap=float_attr(node, "softcap"),
            **({"local_window_size": window} if (window := self.window_of(node)) is not None else {}),
        )
        batch, sequence = dims(query, 4)[0], dims(query, 4)[2]
        output.shape, output.dtype = ir.Shape([batch, sequence, heads * head_size]), query.dtype  # for later rules
        output = op.Transpose(op.Reshape(output, op.Constant(value_ints=[0, 0, heads, head_size])), perm=_BNSH_TO_BSNH)
        return (output, present_key, present_value) if self.past else output


def _to_bsh(op, x: ir.Value) -> ir.Value:
    """(B, N, S, d) → (B, S, N·d); ORT's transpose optimizer can cancel this against the exporter's
    BSNH → BNSH Transpose where no op (RotaryEmbedding) sits between them."""
    return op.Reshape(op.Transpose(x, perm=_BNSH_TO_BSNH), op.Constant(value_ints=[0, 0, -1]))


def rules(model: ir.Model, window_of: Callable[[ir.Node], int | None] = lambda node: None) -> list:
    """The rules bound to `model`'s attention_mask input; none when the graph has no such input.
    `window_of` gives an Attention node's sliding window (its layer's), its GQA's local_window_size."""
    mask = next((v for v in model.graph.inputs if v.name == MASK_INPUT), None)
    if mask is None:
        return []
    return [AttentionToGroupQueryAttention.rule(mask, window_of, past=past) for past in (True, False)]


def inexpressible(facts: Any) -> str | None:
    """Why GroupQueryAttention cannot compute this checkpoint's attention as torch does (None: it can).

    `facts` is the checkpoint's CheckpointFacts. The op is causal self-attention over a compact
    per-row cache, with rotary, softcap, scale and sliding windows as attributes; what it lacks is
    an additive position bias (ALiBi would have to be given in the cache's compact coordinates).
    """
    if facts.kind != "decoder":
        return "GroupQueryAttention is causal self-attention with a cache: decoders only"
    if facts.spec is not None and facts.spec.alibi:
        return f"{facts.config.get('model_type')} adds ALiBi position biases to the attention scores, which GroupQueryAttention does not compute"
    return None
