"""Per-layer K/V head counts: parsing `--kv-heads`, and how a config.json carries them.

`--kv-heads` takes one count for every layer ("4") or one per layer ("8,4,4,2"). A converted
config keeps `num_key_value_heads` at the largest count, so it stays a valid config that plain
transformers loads only to refuse the smaller layers with a shape mismatch, never silently,
and lists every layer's count under KV_HEADS_PER_LAYER, which headfold's loader honours.
A list whose counts are all equal is the single count: same config, same files.

An encoder-decoder's conversion states its kv heads per attention kind under KV_HEADS_PER_ATTENTION
(kind → one count or one per layer): its families have no num_key_value_heads of their own (Whisper's
is an alias of the encoder's head count), so only headfold's loader reads the counts, and plain
transformers refuses the smaller K/V projections.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from headfold.ground.errors import BadInput
from headfold.ground.units import whole_number

__all__ = ["KV_HEADS_PER_ATTENTION", "KV_HEADS_PER_LAYER", "KvHeads", "collapse", "config_kv_heads", "expand", "kind_kv_heads", "parse_kv_heads"]

KV_HEADS_PER_LAYER = "num_key_value_heads_per_layer"
KV_HEADS_PER_ATTENTION = "num_key_value_heads_per_attention"
KvHeads = int | tuple[int, ...]


def parse_kv_heads(text: str) -> KvHeads:
    """'4' → 4; '8,4,4,2' → (8, 4, 4, 2); BadInput for anything else."""
    parts = str(text).split(",")
    counts = tuple(c for p in parts if (c := whole_number(p)) is not None and c >= 0)
    if len(counts) != len(parts):  # 0 passes: the converter names the valid counts
        raise BadInput(f"--kv-heads {text!r} is not a count; give one value (4) or one per layer (8,4,4,2)")
    return counts[0] if len(counts) == 1 else counts


def expand(kv_heads: int | Sequence[int], layers: int) -> tuple[int, ...]:
    """One count per layer; BadInput when a list does not have one entry per layer."""
    if isinstance(kv_heads, int):
        return (kv_heads,) * layers
    counts = tuple(kv_heads)
    if len(counts) != layers:
        raise BadInput(f"--kv-heads lists {len(counts)} values but the model has {layers} layers; give one per layer or a single value")
    return counts


def collapse(per_layer: Sequence[int]) -> int | list[int]:
    """How configs and manifests write counts: one int when every layer agrees, else the list."""
    return per_layer[0] if len(set(per_layer)) == 1 else list(per_layer)


def config_kv_heads(kv_heads: int, per_layer: Any, heads: int, layers: int) -> tuple[int, ...]:
    """Each layer's kv heads from a config's num_key_value_heads and optional per-layer list.

    BadInput unless the list has one positive divisor of `heads` per layer and its largest
    entry is num_key_value_heads (what keeps plain transformers refusing the smaller layers).
    """
    if per_layer is None:
        return (kv_heads,) * layers
    fix = "re-run headfold convert or fix config.json"
    valid = isinstance(per_layer, list) and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in per_layer)
    if not valid or len(per_layer) != layers:
        raise BadInput(f"config.json: {KV_HEADS_PER_LAYER} must list one positive count per layer ({layers}), found {per_layer!r}; {fix}")
    if bad := [k for k in per_layer if heads % k]:
        raise BadInput(f"config.json: {KV_HEADS_PER_LAYER} entry {bad[0]} does not divide {heads} heads; {fix}")
    if max(per_layer) != kv_heads:
        raise BadInput(f"config.json: num_key_value_heads={kv_heads} must be the largest of {KV_HEADS_PER_LAYER} {per_layer}; {fix}")
    return tuple(per_layer)


def kind_kv_heads(stated: Any, heads: int, layers: int, kind: str) -> tuple[int, ...]:
    """Each layer's kv heads of one attention kind from KV_HEADS_PER_ATTENTION's entry (None: `heads`)."""
    if stated is None:
        return (heads,) * layers
    counts = [stated] * layers if isinstance(stated, int) and not isinstance(stated, bool) else stated
    valid = isinstance(counts, list) and len(counts) == layers and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in counts)
    if not valid or any(heads % k for k in counts):
        raise BadInput(
            f"config.json: {KV_HEADS_PER_ATTENTION}.{kind} must be one count or one per layer ({layers}) dividing {heads} heads, "
            f"found {stated!r}; re-run headfold convert or fix config.json"
        )
    return tuple(counts)
