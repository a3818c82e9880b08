"""Architecture specs: which tensors of a family hold Q/K/V/O, as data (specs/*.json).

A spec names tensors by their suffix below an arbitrary prefix (``model.``, ``bert.``,
none), with ``{layer}`` standing for the layer index. ``head_axis`` is the weight axis that
is split into heads: 0 for ``nn.Linear`` Q/K/V, 1 for its O projection, the reverse for
GPT-2's transposed ``Conv1D``.

Optional facts a family may add: per-head norms after W_Q / W_K (``head_norms``, ``{head}`` standing
for the head index), RoPE's pairing of dimensions, ALiBi, MQA as the only grouping transformers
knows (``multi_query``), and another family an MQA conversion is written as (``mqa_as``).

An encoder-decoder (``kind`` "seq2seq": T5, BART, Whisper) lists its ``attentions``: encoder
self-attention, decoder self-attention and decoder cross-attention, each with its own layer prefix
and config keys; the projections are the same in all three. ``head_position_bias``: a learned bias
per query head on the scores (T5's relative attention bias), which stays with its query head;
``audio_encoder``: the encoder reads log-mel features (Whisper).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from typing import Any, Literal, TypeVar

from headfold.ground.errors import BadInput

Role = Literal["q", "k", "v", "o"]
FusedLayout = Literal["blocks", "grouped"]
RotaryPairs = Literal["half", "interleaved"]
HEAD = "{head}"  # stands for the head index in a per-head tensor suffix


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
    multi_query: str | None = None  # a boolean key meaning 1 kv head (gpt_bigcode); kv_heads then follows it


@dataclass(frozen=True)
class Retarget:
    """Writing a conversion as another transformers family with the same maths (GPT-2 MQA as gpt_bigcode).

    ``transpose`` and ``drop`` are tensor suffixes (``{layer}`` for the index, any prefix before):
    weights the target stores transposed (GPT-2's Conv1D → nn.Linear) and stale buffers it lacks.
    ``refuse_if`` are source config values the target cannot express: such a source keeps its family.
    """

    model_type: str
    architectures: dict[str, str]  # source class → target class
    config: dict[str, Any]  # values set in the source's config.json
    transpose: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    refuse_if: dict[str, Any] = field(default_factory=dict)

    def applies(self, config: dict[str, Any]) -> bool:
        known = config.get("architectures") or []
        return bool(known) and known[0] in self.architectures and not any(config.get(k) == v for k, v in self.refuse_if.items())


ENCODER_SELF, DECODER_SELF, DECODER_CROSS = "encoder_self", "decoder_self", "decoder_cross"  # an encoder-decoder's attention kinds
CACHES = {DECODER_SELF: "self", DECODER_CROSS: "cross"}  # the EncoderDecoderCache half each kind fills


@dataclass(frozen=True)
class AttentionKind:
    """One attention of an encoder-decoder layer stack: where its tensors are and how many."""

    name: str  # encoder_self | decoder_self | decoder_cross
    layer_prefix: str
    layers: tuple[str, ...]  # config keys for its layer count: the first one set counts (T5's num_decoder_layers)
    heads: str  # config key for its query heads


@dataclass(frozen=True)
class ArchitectureSpec:
    family: str
    model_types: tuple[str, ...]
    kind: Literal["decoder", "encoder", "seq2seq"]
    native_gqa: bool  # transformers itself honours num_key_value_heads
    rope: bool
    config: ConfigKeys
    layer_prefix: str  # e.g. "layers.{layer}.self_attn."
    projections: dict[Role, Projection]  # q/k/v/o, or only o when fused
    fused_qkv: FusedQKV | None = None
    qk_norm: str | None = None  # per-dimension norm after W_K (Qwen3): K may not be rotated
    # -- optional facts added later (kept last, with defaults: specs without them are unchanged) --
    head_norms: dict[str, str] | None = None  # "q"/"k" → per-head norm suffix with {head} (StableLM qk_layernorm)
    rotary_pairs: RotaryPairs = "half"  # RoPE rotates dims (i, i + r/2) ("half", rotate_half) or (2i, 2i + 1) (GPT-J)
    alibi: bool = False  # ALiBi: each query head has its own fixed slope, so query heads may not move
    mqa_only: bool = False  # transformers knows 1 kv head or all, nothing between (gpt_bigcode's multi_query)
    mqa_as: Retarget | None = None  # an MQA conversion is written as this family (GPT-2 → gpt_bigcode)
    rotary_table: bool = False  # RoPE's sin/cos are a table of max-positions rows (GPT-J): no position past it
    attentions: tuple[AttentionKind, ...] = ()  # an encoder-decoder's attention kinds, in block order
    head_position_bias: bool = False  # a learned score bias per query head (T5): query heads may not move
    audio_encoder: bool = False  # the encoder reads log-mel features, not token ids (Whisper)

    @property
    def encoder_decoder(self) -> bool:
        """Kind "seq2seq": the one test of it (the spec lists its attentions; _parse checks the two agree)."""
        return bool(self.attentions)

    def for_kind(self, kind: AttentionKind) -> ArchitectureSpec:
        """This spec for one attention kind of an encoder-decoder: its tensors under the kind's prefix."""
        return replace(self, layer_prefix=kind.layer_prefix, attentions=())

    @property
    def loads_in(self) -> str:
        """Where a converted checkpoint of this family loads (the README's family table says the same)."""
        if self.native_gqa:
            return "transformers (MQA only)" if self.mqa_only else "transformers"
        if self.mqa_as:
            return f"headfold.load_model; MQA as {self.mqa_as.model_type}: transformers"
        return "headfold.load_model (sentence-transformers models: headfold.sentence_transformer)" if self.kind == "encoder" else "headfold.load_model"

    def head_norm_suffixes(self, role: str, heads: int) -> list[str]:
        """The per-head norm suffixes of `role` ("q"/"k") for `heads` heads; [] without per-head norms."""
        template = (self.head_norms or {}).get(role)
        return [template.replace(HEAD, str(h)) for h in range(heads)] if template else []

    def tensor_pattern(self, suffix: str) -> re.Pattern[str]:
        """Regex for a per-layer attention tensor: group 1 = prefix, group 2 = layer index."""
        return layer_tensor_pattern(self.layer_prefix + suffix)


def layer_tensor_pattern(suffix: str) -> re.Pattern[str]:
    """Regex for a tensor named `suffix` ({layer} for the index) below any prefix: group 1 = prefix, group 2 = layer."""
    literal = re.escape(suffix).replace(re.escape("{layer}"), r"(\d+)")
    return re.compile(r"^(.*?)" + literal + "$")


P = TypeVar("P", bound=Projection)


def _projection(raw: dict[str, Any], cls: type[P]) -> P:
    return cls(**raw)


def _parse(raw: dict[str, Any]) -> ArchitectureSpec:
    if (raw["kind"] == "seq2seq") != bool(raw.get("attentions")):
        raise ValueError(f"spec {raw['family']}: kind seq2seq and a list of attentions go together")  # a broken spec file of headfold's own
    fused = raw.pop("fused_qkv", None)
    retarget = raw.get("mqa_as")
    return ArchitectureSpec(
        family=raw["family"],
        model_types=tuple(raw["model_types"]),
        kind=raw["kind"],
        native_gqa=raw["native_gqa"],
        rope=raw["rope"],
        config=ConfigKeys(**raw["config"]),
        layer_prefix=raw["layer_prefix"],
        projections={role: _projection(p, Projection) for role, p in raw["projections"].items()},
        fused_qkv=_projection(fused, FusedQKV) if fused else None,
        qk_norm=raw.get("qk_norm"),
        head_norms=raw.get("head_norms"),
        rotary_pairs=raw.get("rotary_pairs", "half"),
        alibi=raw.get("alibi", False),
        mqa_only=raw.get("mqa_only", False),
        rotary_table=raw.get("rotary_table", False),
        attentions=tuple(AttentionKind(**{**a, "layers": tuple(a["layers"])}) for a in raw.get("attentions", ())),
        head_position_bias=raw.get("head_position_bias", False),
        audio_encoder=raw.get("audio_encoder", False),
        mqa_as=Retarget(**{**retarget, "transpose": tuple(retarget.get("transpose", ())), "drop": tuple(retarget.get("drop", ()))}) if retarget else None,
    )


@cache
def all_specs() -> tuple[ArchitectureSpec, ...]:
    folder = resources.files("headfold.converter") / "specs"
    files = sorted((p for p in folder.iterdir() if p.name.endswith(".json")), key=lambda p: p.name)  # one folder: as its paths sort
    return tuple(_parse(json.loads(p.read_text())) for p in files)


def supported_model_types() -> list[str]:
    return sorted(t for spec in all_specs() for t in spec.model_types)


def spec_for(model_type: str | None) -> ArchitectureSpec:
    for spec in all_specs():
        if model_type in spec.model_types:
            return spec
    raise BadInput(f"unsupported architecture {model_type!r} (config.json model_type); supported: {', '.join(supported_model_types())}")
