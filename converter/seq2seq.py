"""Encoder-decoders (T5, BART, Whisper): which attention kinds a conversion pools, and what their
caches hold. Torch-free: convert, inspect and the CLI read it before any model is built.

A decoder step caches the decoder self-attention's K/V of every target token and, once per
request, the cross-attention's K/V of every source token (Whisper: every audio frame). The encoder
self-attention caches nothing, so pooling it saves no memory: it is pooled only on request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from headfold.converter.layout import HeadShape
from headfold.converter.spec import DECODER_CROSS, DECODER_SELF, ENCODER_SELF, ArchitectureSpec
from headfold.ground.errors import BadInput

if TYPE_CHECKING:
    from headfold.converter.checkpoint import SourceCheckpoint

# --pool choices → the attention kinds they pool (named --pool: --attention is the export's attention op)
POOL_CHOICES: dict[str, tuple[str, ...]] = {
    "self": (DECODER_SELF,),
    "cross": (DECODER_CROSS,),
    "decoder": (DECODER_SELF, DECODER_CROSS),
    "encoder": (ENCODER_SELF,),
    "all": (ENCODER_SELF, DECODER_SELF, DECODER_CROSS),
}
DEFAULT_POOL = "decoder"
KIND_NAMES = {ENCODER_SELF: "encoder self-attention", DECODER_SELF: "decoder self-attention", DECODER_CROSS: "decoder cross-attention"}


class SynthesizedAudio:
    """What an audio encoder-decoder (Whisper) calibrates on instead of text: seeded Gaussian features at the
    scale of its normalised log-mel input, the decoder reading its own greedy transcript. str(): as the
    manifest records it."""

    def __str__(self) -> str:
        return "synthesized log-mel features"


SYNTHESIZED_AUDIO = SynthesizedAudio()


def pooled_kinds(spec: ArchitectureSpec, pool: str | None) -> tuple[str, ...] | None:
    """The attention kinds `pool` names for an encoder-decoder (None: the default); None for a family
    with one kind of attention, which BadInput refuses `pool` for."""
    if not spec.encoder_decoder:
        if pool is not None:
            raise BadInput(
                f"--pool chooses among an encoder-decoder's attentions; {spec.family} is {'an encoder' if spec.kind == 'encoder' else 'a decoder'} "
                "with self-attention only: drop --pool"
            )
        return None
    if (pool or DEFAULT_POOL) not in POOL_CHOICES:
        raise BadInput(f"--pool {pool!r} is not one of {', '.join(POOL_CHOICES)}")
    return POOL_CHOICES[pool or DEFAULT_POOL]


def cache_bytes(ckpt: SourceCheckpoint, targets: Sequence[HeadShape]) -> dict[str, dict[str, int]]:
    """{"self"/"cross": {"before", "after"}}: the decoder's cache bytes per token as the checkpoint is and
    with the attention blocks at `targets`, in the checkpoint's precision (the cache's as it loads)."""
    element = int(ckpt.facts.precision.itemsize)
    before, after = (ckpt.facts.cache_bytes_per_token(element, shapes) for shapes in (ckpt.layer_shapes, targets))
    return {cache: {"before": before[cache], "after": after[cache]} for cache in before}
