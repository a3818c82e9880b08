"""mean and first straight from the safetensors bytes: numpy, no torch.

Only K and V (and their biases) change under mean/first, and only those are read: each tensor
is read once into a numpy array of its storage type, its heads viewed [kv groups, G, ...]
through the layout codec, pooled, and handed to the writer as an array. Every other tensor
(Q, O, MLP, embeddings) is copied by the writer as a byte range, never decoded.

The bytes equal those of the torch path (methods._pool, then a cast to the source dtype):
torch's fp32 mean over the group axis adds the G heads in order and divides by G, and both
casts back round to nearest even. numpy has no bfloat16: BF16 is read as uint16, widened to
fp32 by a 16-bit shift (exact) and narrowed with torch's rounding, bit for bit.
"""

from __future__ import annotations

import numpy as np

from headfold.converter.checkpoint import FileRange, SourceCheckpoint
from headfold.converter.layout import HeadShape, merge_fused, merge_heads, split_fused, split_heads
from headfold.ground.precision import SAFETENSORS_DTYPES

STORAGE = {code: np.dtype(stored.numpy) for code, stored in SAFETENSORS_DTYPES.items() if stored.numpy}  # what numpy holds each float as
BF16_NAN = 0xFFFF  # what torch's vectorised fp32 → bf16 cast writes for a NaN


def readable(ckpt: SourceCheckpoint) -> bool:
    """Whether every attention tensor is a safetensors byte range of a dtype numpy can hold."""
    return all(ckpt.byte_range(name) is not None and ckpt.tensors[name].code in STORAGE for layer in ckpt.attention.layers for name in layer.values())


def read_array(source: FileRange, code: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's bytes, read once with a positioned read, as its storage type."""
    array = np.empty(shape, dtype=STORAGE[code])
    with open(source.path, "rb", buffering=0) as f:
        f.seek(source.offset)
        if f.readinto(array.reshape(-1).data.cast("B")) != source.nbytes:
            raise EOFError(f"{source.path} ended inside a tensor at byte {source.offset}")
    return array


def widen(array: np.ndarray, code: str) -> np.ndarray:
    """Storage → fp32 (exact)."""
    if code == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def narrow(values: np.ndarray, code: str) -> np.ndarray:
    """fp32 → storage, rounding to nearest even like torch's cast."""
    if code != "BF16":
        return values.astype(STORAGE[code])
    bits = values.view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(BF16_NAN), rounded)


def pool_heads(heads: np.ndarray, kv_heads: int, how: str, code: str) -> np.ndarray:
    """[n, d, ...] → [kv_heads, d, ...]: the mean of each contiguous group (adding its heads in
    order in fp32, then dividing), or its first head."""
    grouped = heads.reshape(kv_heads, -1, *heads.shape[1:])
    if how == "first":
        return grouped[:, 0]
    total = widen(grouped[:, 0], code)
    for i in range(1, grouped.shape[1]):
        total += widen(grouped[:, i], code)
    total /= np.float32(grouped.shape[1])
    return narrow(total, code)


def convert_layer(ckpt: SourceCheckpoint, index: int, target: HeadShape, how: str) -> dict[str, np.ndarray]:
    """One layer's K/V tensors (or its fused QKV tensors) and per-head K norms pooled to `target`, by tensor name."""
    spec, shape, layer = ckpt.spec, ckpt.layer_shapes[index], ckpt.attention.layers[index]

    def read(suffix: str) -> tuple[np.ndarray, str]:
        info = ckpt.tensors[layer[suffix]]
        code, source = info.code, ckpt.byte_range(info.name)
        assert source is not None  # the caller checked readable(ckpt): every attention tensor is a byte range
        return read_array(source, code, info.shape), code

    out: dict[str, np.ndarray] = {}
    if (norms := spec.head_norm_suffixes("k", shape.kv_heads)) and norms[0] in layer:  # one per kv head: pooled alike
        stacked = np.stack([read(n)[0] for n in norms])
        pooled = pool_heads(stacked, target.kv_heads, how, ckpt.tensors[layer[norms[0]]].code)
        kept = norms[: target.kv_heads]  # the pooled heads take the names of the first ones
        out |= {layer[n]: norm for n, norm in zip(kept, pooled, strict=True)}
    if f := spec.fused_qkv:
        for suffix, axis in ((f.weight, f.head_axis), (f.bias, 0)):
            if suffix in layer:
                array, code = read(suffix)
                q, k, v = split_fused(array, f, axis, shape)
                out[layer[suffix]] = merge_fused(q, pool_heads(k, target.kv_heads, how, code), pool_heads(v, target.kv_heads, how, code), f, axis)
        return out
    for p in (spec.projections["k"], spec.projections["v"]):
        for suffix, axis in ((p.weight, p.head_axis), (p.bias, 0)):
            if suffix in layer:
                array, code = read(suffix)
                heads = split_heads(array, axis, shape.kv_heads)
                out[layer[suffix]] = merge_heads(pool_heads(heads, target.kv_heads, how, code), axis)
    return out
