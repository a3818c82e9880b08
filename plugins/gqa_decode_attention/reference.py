"""Reference implementation (torch, any device) and its onnx.reference wrapper.

Semantics are ONNX Attention-23's for 4D inputs with a KV cache:
- present = concat(past, new) along the sequence axis;
- GQA with contiguous grouping: query head h reads kv head h // (q_heads / kv_heads);
- scores = Q·Kᵀ·scale (scale defaults to 1/sqrt(head_size)), softcap before masking;
- a bool mask keeps True positions, a float mask is added; a mask shorter than the total length is
  padded with "masked"; is_causal is bottom-right aligned: query i sees keys j ≤ i + past length;
- a fully masked row gives zeros (the spec's rule, instead of softmax's NaN).
fp16/bf16 inputs are computed in fp32 and cast back, like the fused kernels do.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx.reference.op_run import OpRun

DOMAIN = "headfold"
OP_TYPE = "GQADecodeAttention"
NAME = f"{DOMAIN}::{OP_TYPE}"  # TensorRT plugin id: namespace = ONNX domain, name = op_type

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(Y, present_key, present_value) for 4D (B, heads, S, head_size) inputs; past may have length 0."""
    present_key, present_value = torch.cat((past_key, key), dim=2), torch.cat((past_value, value), dim=2)
    group = kv_group(query.shape[1], present_key.shape[1])
    compute = torch.float32 if query.dtype in _LOW_PRECISION else query.dtype
    keys = present_key.to(compute).repeat_interleave(group, dim=1)
    values = present_value.to(compute).repeat_interleave(group, dim=1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query.to(compute), keys.transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    bias = attention_bias(attn_mask, scores.shape[-2], scores.shape[-1], past_key.shape[2], is_causal, compute)
    probabilities = torch.softmax(scores + bias, dim=-1)
    fully_masked = torch.isneginf(bias.amax(dim=-1, keepdim=True))
    probabilities = torch.where(fully_masked, torch.zeros((), dtype=compute, device=bias.device), probabilities)
    return torch.matmul(probabilities, values).to(query.dtype), present_key, present_value


def kv_group(q_heads: int, kv_heads: int) -> int:
    """Query heads per kv head; ValueError unless kv_heads divides q_heads."""
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads cannot be grouped over {kv_heads} kv heads")
    return q_heads // kv_heads


def attention_bias(attn_mask: torch.Tensor | None, queries: int, keys: int, past: int, is_causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """The additive bias (0 or -inf, or the float mask) broadcastable to (B, heads, queries, keys)."""
    device = attn_mask.device if attn_mask is not None else None
    bias = torch.zeros(queries, keys, dtype=dtype, device=device)
    if attn_mask is not None:
        additive = _blocked(~attn_mask, dtype) if attn_mask.dtype == torch.bool else attn_mask.to(dtype)
        missing = keys - additive.shape[-1]  # a shorter mask leaves the last keys masked (spec)
        bias = bias + torch.nn.functional.pad(additive, (0, missing), value=float("-inf"))
    if is_causal:
        query_index = torch.arange(queries, device=device)[:, None]
        key_index = torch.arange(keys, device=device)[None, :]
        bias = bias + _blocked(key_index > query_index + past, dtype)
    return bias


def _blocked(blocked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill(blocked, float("-inf"))


class GQADecodeAttention(OpRun):
    """onnx.reference kernel for the plugin node: ReferenceEvaluator(model, new_ops=[GQADecodeAttention])."""

    op_domain = DOMAIN

    def _run(
        self,
        query,
        key,
        value,
        attn_mask,
        past_key,
        past_value,
        q_num_heads=None,
        kv_num_heads=None,
        scale=None,
        is_causal=0,
        softcap=0.0,
        plugin_namespace=None,  # read by TensorRT's parser only
    ):
        if (query.shape[1], key.shape[1]) != (q_num_heads, kv_num_heads):
            raise ValueError(f"{OP_TYPE}: Q/K heads {query.shape[1]}/{key.shape[1]} ≠ attributes {q_num_heads}/{kv_num_heads}")
        tensors = [None if x is None else torch.from_numpy(np.ascontiguousarray(x)) for x in (query, key, value, attn_mask, past_key, past_value)]
        outputs = attention_reference(*tensors, scale=scale, is_causal=bool(is_causal), softcap=softcap or 0.0)
        return tuple(t.numpy() for t in outputs)
