"""Pooling methods: how the K/V heads of each contiguous group become one.

A method maps a layer's canonical attention weights to ones with ``kv_heads`` K/V heads.
Source kv head j joins target group j // (source_kv // kv_heads): contiguous groups, as
the ONNX Attention op, TensorRT and torch's repeat_interleave expect.
"""

from __future__ import annotations

from typing import Callable

import torch

from headfold.converter.layout import AttentionWeights
from headfold.errors import BadInput

Method = Callable[[AttentionWeights, int], AttentionWeights]


def _grouped(t: torch.Tensor | None, kv_heads: int) -> torch.Tensor | None:
    """[source_kv, ...] → [kv_heads, group, ...]."""
    return None if t is None else t.reshape(kv_heads, -1, *t.shape[1:])


def _pool_kv(attn: AttentionWeights, kv_heads: int, pool: Callable[[torch.Tensor], torch.Tensor]) -> AttentionWeights:
    k, v, kb, vb = (_grouped(t, kv_heads) for t in (attn.k, attn.v, attn.k_bias, attn.v_bias))
    return attn.with_kv(pool(k), pool(v), kb if kb is None else pool(kb), vb if vb is None else pool(vb))


def mean(attn: AttentionWeights, kv_heads: int) -> AttentionWeights:
    """Ainslie et al. (2023): average the K and V projection heads (and biases) of a group."""
    return _pool_kv(attn, kv_heads, lambda g: g.mean(dim=1))


def first(attn: AttentionWeights, kv_heads: int) -> AttentionWeights:
    """The paper's ablation: keep the first head of each group."""
    return _pool_kv(attn, kv_heads, lambda g: g[:, 0])


METHODS: dict[str, Method] = {"mean": mean, "first": first}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise BadInput(f"unknown method {name!r}; choose one of: {', '.join(METHODS)}") from None
