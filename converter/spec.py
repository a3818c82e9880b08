"""Architecture specs: which tensors of a family hold Q/K/V/O, as data (specs/*.json).

A spec names tensors by their suffix below an arbitrary prefix (``model.``, ``bert.``,
none), with ``{layer}`` standing for the layer index. ``head_axis`` is the weight axis that
is split into heads: 0 for ``nn.Linear`` Q/K/V, 1 for its O projection, the reverse for
GPT-2's transposed ``Conv1D``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

from headfold.ground.errors import BadInput

Role = Literal["q", "k", "v", "o"]
FusedLayout = Literal["blocks", "grouped"]


@dataclass(frozen=True)
class Projection:
    """One projection (or a fused Q/K/V one): weight and optional bias suffixes."""

    weight: str
    bias: str | None = None
    head_axis: int = 0


@dataclass(frozen=True)
class FusedQKV(Projection):
    """Q, K and V in one tensor.

    ``blocks``:  [Q (H·d) | K (N·d) | V (N·d)] along the head axis (GPT-2, Phi-3).
    ``grouped``: per kv head g, [its G query heads | k_g | v_g] (GPT-NeoX; with G = 1 this is
    the original per-head q/k/v interleave, so identity conversion is byte-identical).
    """

    layout: FusedLayout = "blocks"


@dataclass(frozen=True)
class ConfigKeys:
    """Where a config.json keeps the numbers the converter needs."""

    heads: str
    hidden: str
    layers: str
    kv_heads: str = "num_key_value_heads"
    head_dim: str | None = "head_dim"


@dataclass(frozen=True)
class ArchitectureSpec:
    family: str
    model_types: tuple[str, ...]
    kind: Literal["decoder", "encoder"]
    native_gqa: bool  # transformers itself honours num_key_value_heads
    rope: bool
    config: ConfigKeys
    layer_prefix: str  # e.g. "layers.{layer}.self_attn."
    projections: dict[Role, Projection]  # q/k/v/o, or only o when fused
    fused_qkv: FusedQKV | None = None
    qk_norm: str | None = None  # per-dimension norm after W_K (Qwen3): K may not be rotated

    def tensor_pattern(self, suffix: str) -> re.Pattern[str]:
        """Regex for a per-layer tensor: group 1 = prefix, group 2 = layer index."""
        literal = re.escape(self.layer_prefix + suffix).replace(re.escape("{layer}"), r"(\d+)")
        return re.compile(r"^(.*?)" + literal + "$")


def _projection(raw: dict[str, Any], cls: type[Projection] = Projection) -> Projection:
    return cls(**raw)


def _parse(raw: dict[str, Any]) -> ArchitectureSpec:
    fused = raw.pop("fused_qkv", None)
    return ArchitectureSpec(
        family=raw["family"],
        model_types=tuple(raw["model_types"]),
        kind=raw["kind"],
        native_gqa=raw["native_gqa"],
        rope=raw["rope"],
        config=ConfigKeys(**raw["config"]),
        layer_prefix=raw["layer_prefix"],
        projections={role: _projection(p) for role, p in raw["projections"].items()},
        fused_qkv=_projection(fused, FusedQKV) if fused else None,
        qk_norm=raw.get("qk_norm"),
    )


@cache
def all_specs() -> tuple[ArchitectureSpec, ...]:
    folder = resources.files("headfold.converter") / "specs"
    files = sorted(p for p in folder.iterdir() if p.name.endswith(".json"))
    return tuple(_parse(json.loads(p.read_text())) for p in files)


def supported_model_types() -> list[str]:
    return sorted(t for spec in all_specs() for t in spec.model_types)


def spec_for(model_type: str | None) -> ArchitectureSpec:
    for spec in all_specs():
        if model_type in spec.model_types:
            return spec
    raise BadInput(
        f"unsupported architecture {model_type!r} (config.json model_type); "
        f"supported: {', '.join(supported_model_types())}"
    )
