"""The per-layer names of a decoder graph's inputs and outputs (its KV cache), spelled once.

A layer's past K/V are inputs `past_key_values.{i}.key|value`, its present K/V outputs
`present.{i}.key|value`; an encoder-decoder's caches carry their half too (`decoder`: the
self-attention's, `encoder`: the cross-attention's K/V of the source), `present.{i}.encoder.key`.
Export names the graphs' tensors with `cache_names`, onnxruntime-genai's config with
`name_template`, and whoever reads a graph back (the layer template, the runners feeding present
back as past) parses names with `CacheName.parse` instead of matching substrings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

__all__ = ["PAST", "PRESENT", "KINDS", "SELF_HALF", "CROSS_HALF", "CacheName", "cache_names", "name_template", "is_cache"]

PAST, PRESENT = "past_key_values", "present"
KINDS = ("key", "value")
SELF_HALF, CROSS_HALF = "decoder", "encoder"  # an encoder-decoder's self-attention cache, its cross-attention K/V
_NAME = re.compile(rf"({PAST}|{PRESENT})\.(\d+)(?:\.({SELF_HALF}|{CROSS_HALF}))?\.({'|'.join(KINDS)})")


@dataclass(frozen=True)
class CacheName:
    """One cache tensor of one layer: prefix (PAST or PRESENT), layer, kind (key or value), half."""

    prefix: str
    layer: int
    kind: str
    half: str | None = None  # an encoder-decoder's SELF_HALF or CROSS_HALF

    def __str__(self) -> str:
        return ".".join([self.prefix, str(self.layer), *([self.half] if self.half else []), self.kind])

    @classmethod
    def parse(cls, name: str) -> CacheName | None:
        """The cache tensor `name` spells, or None for any other name."""
        m = _NAME.fullmatch(name)
        return cls(m.group(1), int(m.group(2)), m.group(4), m.group(3)) if m else None

    def in_layer(self, layer: int) -> CacheName:
        return replace(self, layer=layer)

    def as_past(self) -> CacheName:
        """The past input a present output is fed back as."""
        return replace(self, prefix=PAST)

    def as_present(self) -> CacheName:
        """The present output a past input becomes (one buffer where they share it)."""
        return replace(self, prefix=PRESENT)


def cache_names(prefix: str, layers: int, half: str | None = None) -> list[str]:
    """Every layer's key and value names, in the graphs' order: layer 0's key, its value, layer 1's…"""
    return [str(CacheName(prefix, layer, kind, half)) for layer in range(layers) for kind in KINDS]


def name_template(prefix: str, kind: str, half: str | None = None) -> str:
    """onnxruntime-genai's name template of one cache tensor: %d for the layer."""
    return str(CacheName(prefix, 0, kind, half)).replace(".0.", ".%d.", 1)


def is_cache(name: str, prefix: str, half: str | None = None) -> bool:
    """Whether `name` is a cache tensor with `prefix` (PAST: an input, PRESENT: an output) and, if given, `half`."""
    parsed = CacheName.parse(name)
    return parsed is not None and parsed.prefix == prefix and (half is None or parsed.half == half)
