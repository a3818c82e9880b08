"""Canonical per-layer attention weights, and the codecs to and from a family's tensors.

Canonical form puts heads first: Q/K/V weights are [heads, head_dim, hidden], their biases
[heads, head_dim], the O weight is [heads, head_dim, hidden] (its input side split into
heads), per-head norm scales after W_Q / W_K (StableLM) [heads, head_dim]. Pooling methods only
ever see this form, so a fused or transposed layout is written once, here, and never again in a
method. The codec takes torch tensors (the data-aware maths)
or numpy arrays (mean/first over raw bytes, converter/rawpool.py) alike: it only reshapes,
slices, swaps the two axes of a 2-D tensor and concatenates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from headfold.converter.spec import ArchitectureSpec, FusedQKV, Role
from headfold.ground.lazy import lazy_import

if TYPE_CHECKING:
    import torch
else:  # torch loads where tensors are made: a mean/first conversion runs without it
    torch = lazy_import("torch")

Array = TypeVar("Array", "torch.Tensor", np.ndarray)  # what the codec reshapes: torch tensors or numpy arrays alike


@dataclass(frozen=True)
class HeadShape:
    heads: int  # query heads, H
    kv_heads: int  # N
    head_dim: int  # d

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


@dataclass(frozen=True)
class AttentionWeights:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # one norm scale per query head
    k_norm: torch.Tensor | None = None  # one per kv head: pooled and permuted with K

    @property
    def kv_heads(self) -> int:
        return self.k.shape[0]

    def with_kv(self, k: torch.Tensor, v: torch.Tensor, k_bias: torch.Tensor | None, v_bias: torch.Tensor | None) -> AttentionWeights:
        return replace(self, k=k, v=v, k_bias=k_bias, v_bias=v_bias)

    def map_kv(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> AttentionWeights:
        """`fn` applied to every per-kv-head tensor (K, V, their biases and norms) that exists."""

        def present(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return replace(self, k=fn(self.k), v=fn(self.v), k_bias=present(self.k_bias), v_bias=present(self.v_bias), k_norm=present(self.k_norm))


def _stack(parts: list):
    """torch.stack or np.stack, whichever the parts are."""
    if isinstance(parts[0], np.ndarray):
        return np.stack(parts)

    return torch.stack(parts)


def _concatenate(parts: list, axis: int = 0):
    """torch.cat or np.concatenate, whichever the parts are (torch is loaded when they are tensors)."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=axis)

    return torch.cat(parts, dim=axis)


def split_heads(t: Array, axis: int, heads: int) -> Array:
    """[.., heads·d (at axis), ..] → [heads, d, rest]; weights are 2-D, so moving the head
    axis first is one axis swap."""
    t = t.swapaxes(axis, 0)
    return t.reshape(heads, -1, *t.shape[1:])


def merge_heads(t: Array, axis: int) -> Array:
    """Inverse of split_heads."""
    return t.reshape(-1, *t.shape[2:]).swapaxes(0, axis)


def split_fused(t: Array, fused: FusedQKV, axis: int, shape: HeadShape) -> list[Array]:
    """A fused Q/K/V tensor (weight or bias) → canonical [q, k, v]."""
    h, n, d = shape.heads, shape.kv_heads, shape.head_dim
    t = t.swapaxes(axis, 0)
    if fused.layout == "blocks":
        blocks = (t[: h * d], t[h * d : (h + n) * d], t[(h + n) * d :])
        return [x.reshape(-1, d, *t.shape[1:]) for x in blocks]
    grouped = t.reshape(n, shape.group + 2, d, *t.shape[1:])
    return [grouped[:, :-2].reshape(h, d, *t.shape[1:]), grouped[:, -2], grouped[:, -1]]


def merge_fused(q: Array, k: Array, v: Array, fused: FusedQKV, axis: int) -> Array:
    if fused.layout == "blocks":
        flat = _concatenate([q, k, v]).reshape(-1, *q.shape[2:])
    else:
        n = k.shape[0]
        grouped = _concatenate([q.reshape(n, -1, *q.shape[1:]), k[:, None], v[:, None]], axis=1)
        flat = grouped.reshape(-1, *q.shape[2:])
    return flat.swapaxes(0, axis)


class AttentionCodec:
    """Reads one layer's attention tensors into canonical form and writes them back."""

    def __init__(self, spec: ArchitectureSpec, shape: HeadShape) -> None:
        self.spec = spec
        self.shape = shape

    def decode(self, tensors: dict[str, torch.Tensor]) -> AttentionWeights:
        """`tensors` maps spec suffixes (e.g. "q_proj.weight") to tensors or arrays."""
        spec, shape = self.spec, self.shape
        o = spec.projections["o"]
        parts = {"o": split_heads(tensors[o.weight], o.head_axis, shape.heads)}
        role: Role
        if spec.fused_qkv:
            f = spec.fused_qkv
            parts.update(zip("qkv", split_fused(tensors[f.weight], f, f.head_axis, shape), strict=True))
            if f.bias in tensors:
                parts.update(zip(("q_bias", "k_bias", "v_bias"), split_fused(tensors[f.bias], f, 0, shape), strict=True))
        else:
            for role, heads in (("q", shape.heads), ("k", shape.kv_heads), ("v", shape.kv_heads)):
                p = spec.projections[role]
                parts[role] = split_heads(tensors[p.weight], p.head_axis, heads)
                if p.bias in tensors:
                    parts[f"{role}_bias"] = split_heads(tensors[p.bias], 0, heads)
        for role, heads in (("q", shape.heads), ("k", shape.kv_heads)):
            if (norms := spec.head_norm_suffixes(role, heads)) and norms[0] in tensors:
                parts[f"{role}_norm"] = _stack([tensors[n] for n in norms])
        return AttentionWeights(**parts)

    def encode(self, attn: AttentionWeights) -> dict[str, torch.Tensor]:
        """Canonical → tensors under their spec suffixes (only those that exist)."""
        spec = self.spec
        o = spec.projections["o"]
        out = {o.weight: merge_heads(attn.o, o.head_axis)}
        role: Role
        for role in ("q", "k"):
            if (norm := getattr(attn, f"{role}_norm")) is not None:
                out |= dict(zip(spec.head_norm_suffixes(role, len(norm)), norm, strict=True))
        if spec.fused_qkv:
            f = spec.fused_qkv
            out[f.weight] = merge_fused(attn.q, attn.k, attn.v, f, f.head_axis)
            if attn.q_bias is not None:
                assert f.bias is not None and attn.k_bias is not None and attn.v_bias is not None  # decode took all three from the fused bias
                out[f.bias] = merge_fused(attn.q_bias, attn.k_bias, attn.v_bias, f, 0)
            return out
        for role in ("q", "k", "v"):
            p = spec.projections[role]
            out[p.weight] = merge_heads(getattr(attn, role), p.head_axis)
            bias = getattr(attn, f"{role}_bias")
            if bias is not None:
                assert p.bias is not None  # decode found it under the projection's bias suffix
                out[p.bias] = merge_heads(bias, 0)
        return out


def head_axis_sizes(spec: ArchitectureSpec, shape: HeadShape) -> dict[str, tuple[int, int]]:
    """suffix → (axis, size) of the head axis of every attention tensor, for `shape`.

    Used both to validate a source against its config and to plan the output's shapes.
    """
    h, n, d = shape.heads, shape.kv_heads, shape.head_dim
    sizes: dict[str, tuple[int, int]] = {}
    fused = spec.fused_qkv
    if fused:
        sizes[fused.weight] = (fused.head_axis, (h + 2 * n) * d)
        if fused.bias:
            sizes[fused.bias] = (0, (h + 2 * n) * d)
    for role, p in spec.projections.items():
        heads = n if role in "kv" else h
        sizes[p.weight] = (p.head_axis, heads * d)
        if p.bias and role != "o":  # O's bias lives on the hidden side, not per head
            sizes[p.bias] = (0, heads * d)
    return sizes


def expected_shapes(spec: ArchitectureSpec, shape: HeadShape, hidden: int) -> dict[str, tuple[int, ...]]:
    """suffix → the full shape of every attention tensor for `shape`: weights are 2-D with the
    head axis as in head_axis_sizes and the model width on the other axis, biases 1-D."""
    weights = {p.weight for p in (*spec.projections.values(), *filter(None, [spec.fused_qkv]))}
    shapes: dict[str, tuple[int, ...]] = {}
    for suffix, (axis, size) in head_axis_sizes(spec, shape).items():
        shapes[suffix] = ((size, hidden) if axis == 0 else (hidden, size)) if suffix in weights else (size,)
    if (o_bias := spec.projections["o"].bias) is not None:
        shapes[o_bias] = (hidden,)
    for role, heads in (("q", shape.heads), ("k", shape.kv_heads)):
        shapes |= dict.fromkeys(spec.head_norm_suffixes(role, heads), (shape.head_dim,))
    return shapes
