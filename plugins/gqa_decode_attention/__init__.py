"""GQA decode attention with a KV cache, as the custom op headfold::GQADecodeAttention.

For TensorRT parsers that cannot take a decode graph's `Attention` (past_key/past_value inputs are
rejected in every release; 10.13 has no Attention importer at all). Everything about the op is here:
- emitter.py: rewrite rules, standard `Attention` (+ KV cache) → the plugin node;
- reference.py: torch reference (ONNX Attention-23 semantics) and the onnx.reference kernel;
- tensorrt_impl.py: the tensorrt.plugin definition (JIT, runs the torch reference on CUDA).

Node contract: inputs (Q, K, V, attn_mask, past_key, past_value), all 4D but the mask;
outputs (Y, present_key, present_value); attributes q_num_heads, kv_num_heads, scale, is_causal,
softcap, plugin_namespace="headfold".

No TensorRT 11 native emitter (TRT_Attention / TRT_KVCacheUpdate): onnx-tensorrt's
docs/TRT_custom_ops.md documents TRT_Attention without a usable KV cache (past_key/past_value
"unsupported" in one revision, absent in the next, with shifted input indices), and
TRT_KVCacheUpdate as an in-place update of a fixed-size cache buffer (a network input with static
max length, aliased to a network output, written at per-row write_indices): a different graph
interface from concat(past, new), not a node-local rewrite.
"""

from __future__ import annotations

from headfold.plugins._spec import PluginOp
from headfold.plugins.gqa_decode_attention.emitter import rules
from headfold.plugins.gqa_decode_attention.reference import (
    DOMAIN,
    NAME,
    OP_TYPE,
    GQADecodeAttention,
    attention_reference,
)

__all__ = ["DOMAIN", "NAME", "OP_TYPE", "SPEC", "GQADecodeAttention", "attention_reference", "register_tensorrt", "rules"]


def register_tensorrt() -> None:
    from headfold.plugins.gqa_decode_attention import (
        tensorrt_impl,  # needs tensorrt and torch
    )

    tensorrt_impl.register()


SPEC = PluginOp(name=NAME, rules=rules, reference=GQADecodeAttention, register_tensorrt=register_tensorrt)
