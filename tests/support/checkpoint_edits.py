"""Test helper: rewrite every layer's attention of a checkpoint in canonical form."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors.torch import save_file

from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.layout import AttentionCodec, AttentionWeights
from headfold.converter.methods import LayerContext


def edit_attention(src: Path, dst: Path, edit: Callable[[AttentionWeights, LayerContext], AttentionWeights]) -> Path:
    """Copy of `src` (config + single safetensors file) with `edit` applied to each layer."""
    from headfold.converter.conversion import layer_contexts

    with SourceCheckpoint(src) as ckpt:
        tensors = {name: ckpt.get(name).clone() for name in ckpt.tensors}
        codec = AttentionCodec(ckpt.spec, ckpt.shape)
        for layer, ctx in zip(ckpt.attention.layers, layer_contexts(ckpt, None, 0, 0, False), strict=True):
            attn = edit(codec.decode({s: tensors[n].float() for s, n in layer.items()}), ctx)
            for suffix, t in codec.encode(attn).items():
                tensors[layer[suffix]] = t.to(tensors[layer[suffix]].dtype).contiguous()
    dst.mkdir()
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def identical_heads(group: int) -> Callable[[AttentionWeights, LayerContext], AttentionWeights]:
    """K/V heads identical inside each contiguous group of `group` heads."""

    def edit(attn: AttentionWeights, ctx: LayerContext) -> AttentionWeights:
        return attn.map_kv(lambda t: t[::group].repeat_interleave(group, 0))

    return edit
