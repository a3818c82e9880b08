"""Build a runnable torch model for a Hugging Face checkpoint folder, source or converted (whole, or
as an empty skeleton whose parts calibration loads one at a time: `empty_model`).

Families whose transformers code knows `num_key_value_heads` (llama, mistral, qwen2, qwen3,
phi3, phi, gemma, olmo, stablelm; gpt_bigcode's multi_query) and every unconverted checkpoint load
with plain `from_pretrained`. gpt2, gpt_neox, opt, bert, roberta and gptj have no GQA in
transformers: for them each self-attention module is swapped for a small subclass that projects
K/V at N heads and sets `num_key_value_groups`, so transformers' own SDPA attention (masks, RoPE,
DynamicCache, generate) runs the grouping, exactly as it does for llama. bloom computes attention
by hand (ALiBi, no SDPA in transformers): its swapped-in module, used for MHA checkpoints too, runs
SDPA with the ALiBi bias as its mask. Weights are then loaded strictly from the safetensors files.

Encoder-decoders (t5, bart, whisper) have no GQA in transformers either: every attention module
(encoder self, decoder self, decoder cross), found by its kind's path in the spec, gets its block's kv
heads. Their forwards view K/V with -1 heads and cache them in an EncoderDecoderCache as they come,
so the self- and cross-attention caches hold kv heads and SDPA groups them (T5's relative position
bias, per query head, included).

A config with `num_key_value_heads_per_layer` (headfold's per-layer conversions) gives each layer
its own kv heads: the GQA subclasses are adopted per layer, and native-GQA families get each
layer's K/V projections resized (transformers itself would refuse the smaller layers).
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.nn import functional as F
from transformers.cache_utils import Cache, EncoderDecoderCache, LinearAttentionCacheLayerMixin
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
from transformers.initialization import no_init_weights
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bart.modeling_bart import BartAttention
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.bloom.modeling_bloom import BloomAttention, BloomModel, dropout_add
from transformers.models.bloom.modeling_bloom import build_alibi_tensor as bloom_alibi
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, apply_rotary_pos_emb
from transformers.models.gpt_neox.modeling_gpt_neox import eager_attention_forward as neox_eager
from transformers.models.gptj.modeling_gptj import GPTJAttention
from transformers.models.opt.modeling_opt import OPTAttention
from transformers.models.opt.modeling_opt import eager_attention_forward as opt_eager
from transformers.models.roberta.modeling_roberta import RobertaSelfAttention
from transformers.models.t5.modeling_t5 import T5Attention
from transformers.models.whisper.modeling_whisper import WhisperAttention
from transformers.models.whisper.modeling_whisper import eager_attention_forward as whisper_eager
from transformers.pytorch_utils import Conv1D
from transformers.utils.deprecation import deprecate_kwarg

from headfold.converter.checkpoint import HEAD_KEYS, SIZE_KEYS, CheckpointFacts
from headfold.converter.layout import HeadShape, head_axis_sizes
from headfold.converter.per_layer import KV_HEADS_PER_LAYER
from headfold.converter.spec import HEAD, spec_for, supported_model_types
from headfold.converter.support import builtin_class
from headfold.ground.errors import BadInput, first_line
from headfold.ground.inputs import read_json_object
from headfold.ground.lazy import lazy_import

accelerate = lazy_import("accelerate")

__all__ = ["load_model", "empty_model", "hollow_model", "parameter_names", "check_loadable", "at_kv_heads", "GQA_ATTENTION"]

# The only attention implementation the GQA subclasses are wired for: transformers' SDPA
# path repeats/groups K/V from `num_key_value_groups`; the families' own eager functions don't.
_ATTN_IMPLEMENTATION = "sdpa"
# Buffers that older checkpoints saved but today's modules keep non-persistent.
_STALE_BUFFERS = (r"embeddings\.position_ids$", r"\.inv_freq$", r"\.masked_bias$", r"\.attn\.bias$")
_Meta = dict[str, tuple[tuple[int, ...], torch.dtype | None]]  # tensor name -> (shape, dtype)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# GQA attention modules: subclasses that change only how q/k/v are projected and split.
# ---------------------------------------------------------------------------------------------


def _resized_linear(old: nn.Linear, out_features: int) -> nn.Linear:
    """A Linear like `old` (input size, bias, device, dtype) with `out_features` outputs."""
    return nn.Linear(
        old.in_features,
        out_features,
        bias=old.bias is not None,
        device=old.weight.device,
        dtype=old.weight.dtype,
    )


def _linear(module: nn.Module, name: str) -> nn.Linear:
    """The Linear submodule `name` of `module`."""
    linear = module.get_submodule(name)
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{type(module).__name__}.{name} is a {type(linear).__name__}, not a Linear")
    return linear


def _resize(module: nn.Module, name: str, out_features: int) -> None:
    """Replace the Linear `name` of `module` by one with `out_features` outputs (as _resized_linear)."""
    module.register_module(name, _resized_linear(_linear(module, name), out_features))


def _set_plain(module: nn.Module, **values: object) -> None:
    """Plain attributes (head counts, split sizes, a bound method) of a transformers module: torch types a
    module's attribute assignment as tensors and submodules only."""
    for name, value in values.items():
        setattr(module, name, value)


def _layer(module: nn.Module) -> int:
    """The layer index a cache reads for this attention module (transformers sets it on every layer it builds)."""
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise TypeError(f"{type(module).__name__} has no layer_idx, which its cache needs")
    return layer


class _GQA:
    """Mixin: turns an instance of `base` into a GQA module in place (class swap + smaller K/V).

    Swapping `__class__` keeps every attribute the family's constructor set (layer_idx,
    is_causal, scaling, ...) without re-running constructors whose signatures differ per family.
    """

    base: ClassVar[type[nn.Module]]
    num_key_value_heads: int  # set by adopt
    num_key_value_groups: int
    attn_implementation: ClassVar[str] = _ATTN_IMPLEMENTATION  # what the model is built with
    always: ClassVar[bool] = False  # swapped in for MHA checkpoints too (transformers' own cannot serve)

    @classmethod
    def prepare(cls, model: nn.Module) -> None:
        """Whatever the model around the swapped modules needs (nothing by default)."""

    @classmethod
    def adopt(cls, module: nn.Module, heads: int, kv_heads: int, head_dim: int) -> None:
        _check_forward_signature(cls)
        # num_key_value_groups: read by transformers' sdpa_attention_forward
        _set_plain(module, __class__=cls, num_key_value_heads=kv_heads, num_key_value_groups=heads // kv_heads)
        cls._shrink(module, heads * head_dim, kv_heads * head_dim)

    @classmethod
    def _shrink(cls, module: nn.Module, q_size: int, kv_size: int) -> None:
        raise NotImplementedError


class _SeparateKV(_GQA):
    """K and V are their own Linear layers: only their output size changes."""

    kv_names: ClassVar[tuple[str, str]]

    @classmethod
    def _shrink(cls, module: nn.Module, q_size: int, kv_size: int) -> None:
        for name in cls.kv_names:
            _resize(module, name, kv_size)


class BertGQASelfAttention(_SeparateKV, BertSelfAttention):
    """The parent views K/V with `-1` heads, so smaller key/value layers are all it takes."""

    base = BertSelfAttention
    kv_names = ("key", "value")


class RobertaGQASelfAttention(_SeparateKV, RobertaSelfAttention):
    base = RobertaSelfAttention
    kv_names = ("key", "value")


class GPT2GQAAttention(_GQA, GPT2Attention):
    """c_attn columns are [Q (H·d) | K (N·d) | V (N·d)]; the parent splits by `split_size`,
    which torch's `split` also accepts as a list of sizes, and views K/V with `-1` heads."""

    base = GPT2Attention

    @classmethod
    def _shrink(cls, module: nn.Module, q_size: int, kv_size: int) -> None:
        old = module.get_submodule("c_attn")
        assert isinstance(old, Conv1D)  # GPT2Attention's fused QKV projection
        with torch.device(old.weight.device):
            module.register_module("c_attn", Conv1D(q_size + 2 * kv_size, old.nx).to(old.weight.dtype))
        _set_plain(module, split_size=[q_size, kv_size, kv_size])


class OPTGQAAttention(_SeparateKV, OPTAttention):
    """The parent views K/V with `self.num_heads`; only those two views change below."""

    base = OPTAttention
    kv_names = ("k_proj", "v_proj")

    # Mirrors OPTAttention.forward (transformers 5.x); K/V are viewed at num_key_value_heads.
    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling  # OPT scales q before the matmul
        query_states = query_states.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
        kv_shape = (bsz, -1, self.num_key_value_heads, self.head_dim)
        key_states = self.k_proj(hidden_states).view(kv_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(kv_shape).transpose(1, 2)

        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, _layer(self), kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, opt_eager)
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.dropout,
            scaling=1.0,
            **kwargs,
        )
        attn_output = attn_output.reshape(bsz, tgt_len, -1).contiguous()
        return self.out_proj(attn_output), attn_weights


def _split_grouped(qkv: torch.Tensor, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """[B, S, (H + 2N)·d] laid out per kv head g as [its G query heads | k_g | v_g] → Q [B, H, S, d], K/V [B, N, S, d]."""
    input_shape = qkv.shape[:-1]
    qkv = qkv.view(*input_shape, kv_heads, -1, head_dim)
    query = qkv[..., :-2, :].reshape(*input_shape, -1, head_dim)
    key, value = qkv[..., -2, :], qkv[..., -1, :]
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


class GPTNeoXGQAAttention(_GQA, GPTNeoXAttention):
    """query_key_value rows are grouped per kv head g: [G query heads | k_g | v_g] (each d rows).

    With G = 1 this is GPT-NeoX's own per-head [q, k, v] interleave.
    """

    base = GPTNeoXAttention

    @classmethod
    def _shrink(cls, module: nn.Module, q_size: int, kv_size: int) -> None:
        _resize(module, "query_key_value", q_size + 2 * kv_size)

    def _split_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _split_grouped(self.query_key_value(hidden_states), self.num_key_value_heads, self.head_size)

    # Mirrors GPTNeoXAttention.forward (transformers 5.x) with the grouped split above.
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        layer_past: Cache | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        query_states, key_states, value_states = self._split_qkv(hidden_states)

        assert position_embeddings is not None  # GPTNeoXModel passes them to every layer
        cos, sin = position_embeddings  # partial rotary: cos/sin cover rotary_ndims only
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if layer_past is not None:
            key_states, value_states = layer_past.update(key_states, value_states, _layer(self))

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, neox_eager)
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            scaling=self.scaling,
            dropout=0.0 if not self.training else self.attention_dropout,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.dense(attn_output), attn_weights


class GPTJGQAAttention(_SeparateKV, GPTJAttention):
    """The parent views K/V with `-1` heads; interleaved RoPE rotates each head alike at any count."""

    base = GPTJAttention
    kv_names = ("k_proj", "v_proj")


def _alibi_any_mask(self: BloomModel, attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """BloomModel.build_alibi_tensor, also for the [B, 1, S, P + S] boolean mask of the merged export
    graph: its last query sees every real key (and itself, the last key, which no other key follows),
    so its row is the padding mask ALiBi counts positions over."""
    if attention_mask.dim() == 4 and attention_mask.dtype == torch.bool:
        attention_mask = attention_mask[:, 0, -1].long()
    return bloom_alibi(attention_mask, num_heads, dtype)


class BloomGQAAttention(_GQA, BloomAttention):
    """query_key_value rows grouped per kv head like GPT-NeoX's ([G query heads | k_g | v_g]; G = 1 is
    bloom's own per-head interleave). Scores run through SDPA with ALiBi (per query head, so pooling
    K/V keeps every head's slope) plus the causal mask as the additive mask: one fused Attention node
    per layer in an export. Bloom's mask code is eager's (a float mask, always made)."""

    base = BloomAttention
    attn_implementation = "eager"
    always = True

    @classmethod
    def prepare(cls, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, BloomModel):
                _set_plain(module, build_alibi_tensor=_alibi_any_mask.__get__(module))

    @classmethod
    def _shrink(cls, module: nn.Module, q_size: int, kv_size: int) -> None:
        _resize(module, "query_key_value", q_size + 2 * kv_size)

    # Replaces BloomAttention.forward (transformers 5.x): same arguments and results, SDPA inside.
    def forward(
        self,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        alibi: torch.Tensor,
        attention_mask: torch.Tensor,
        layer_past: Cache | None = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        batch, length, _ = hidden_states.shape
        query, key, value = _split_grouped(self.query_key_value(hidden_states), self.num_key_value_heads, self.head_dim)
        if layer_past is not None:
            key, value = layer_past.update(key, value, _layer(self))
        if attention_mask.dtype == torch.bool:  # True = attend (the merged export's mask)
            attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(~attention_mask, torch.finfo(query.dtype).min)
        bias = alibi.view(batch, self.num_heads, 1, -1).to(query.dtype) + attention_mask
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=bias, dropout_p=self.attention_dropout.p if self.training else 0.0,
            scale=self.inv_norm_factor, enable_gqa=self.num_key_value_groups > 1,
        )  # fmt: skip
        out = self.dense(out.transpose(1, 2).reshape(batch, length, -1))
        return dropout_add(out, residual, self.hidden_dropout, self.training), None


class T5GQAAttention(_SeparateKV, T5Attention):
    """Self- and cross-attention alike; the position bias stays per query head (`n_heads`)."""

    base = T5Attention
    kv_names = ("k", "v")


class BartGQAAttention(_SeparateKV, BartAttention):
    base = BartAttention
    kv_names = ("k_proj", "v_proj")


class WhisperGQAAttention(_SeparateKV, WhisperAttention):
    """The parent views K/V with `self.num_heads`; only that view changes below."""

    base = WhisperAttention
    kv_names = ("k_proj", "v_proj")

    # Mirrors WhisperAttention.forward (transformers 5.x); K/V are viewed at num_key_value_heads.
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        is_cross_attention = key_value_states is not None
        input_shape = hidden_states.shape[:-1]
        query_states = (self.q_proj(hidden_states) * self.scaling).view(*input_shape, -1, self.head_dim).transpose(1, 2).contiguous()
        is_updated = False  # the encoder's layers have no cache, nor a layer index
        if isinstance(cache, EncoderDecoderCache):  # the cross-attention half is filled once, then reused
            is_updated = bool(cache.is_updated.get(_layer(self)))
            if is_cross_attention:
                cache.is_updated[_layer(self)] = True
                cache = cache.cross_attention_cache
            else:
                cache = cache.self_attention_cache
        current_states = key_value_states if is_cross_attention else hidden_states
        if is_cross_attention and cache and is_updated:
            filled = cache.layers[_layer(self)]
            assert not isinstance(filled, LinearAttentionCacheLayerMixin)  # Whisper's cache holds keys and values
            key_states, value_states = filled.keys, filled.values
        else:
            kv_shape = (input_shape[0], -1, self.num_key_value_heads, self.head_dim)
            key_states = self.k_proj(current_states).view(kv_shape).transpose(1, 2).contiguous()
            value_states = self.v_proj(current_states).view(kv_shape).transpose(1, 2).contiguous()
            if cache is not None:
                key_states, value_states = cache.update(key_states, value_states, _layer(self), kwargs=kwargs)
        assert self.config is not None  # WhisperModel builds each attention with its config
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, whisper_eager)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.dropout, scaling=1.0, output_attentions=output_attentions, **kwargs,
        )  # fmt: skip
        return self.out_proj(attn_output.reshape(*input_shape, -1).contiguous()), attn_weights


# model_type -> GQA attention class, for families whose transformers code has no GQA.
GQA_ATTENTION: dict[str, type[_GQA]] = {
    "gpt2": GPT2GQAAttention,
    "gpt_neox": GPTNeoXGQAAttention,
    "opt": OPTGQAAttention,
    "bert": BertGQASelfAttention,
    "roberta": RobertaGQASelfAttention,
    "gptj": GPTJGQAAttention,
    "bloom": BloomGQAAttention,
    "t5": T5GQAAttention,
    "bart": BartGQAAttention,
    "whisper": WhisperGQAAttention,
}


def _check_forward_signature(cls: type[_GQA]) -> None:
    """A copied forward must take what the family's layers pass, or cache/kwargs get lost silently."""
    if "forward" not in vars(cls):
        return
    ours = list(inspect.signature(vars(cls)["forward"]).parameters)
    theirs = list(inspect.signature(cls.base.forward).parameters)
    if ours != theirs:
        raise RuntimeError(
            f"transformers {transformers.__version__} changed {cls.base.__name__}.forward{tuple(theirs)}; update headfold's {cls.__name__} to match"
        )


# ---------------------------------------------------------------------------------------------
# Checkpoint folder: config, model class, tensor index.
# ---------------------------------------------------------------------------------------------


def _transformers_config(facts: CheckpointFacts) -> transformers.PretrainedConfig:
    """transformers' config for a checkpoint whose facts (sizes, rope, links, quantization) are already checked."""
    facts.check_activations()
    try:
        return transformers.AutoConfig.from_pretrained(facts.folder, trust_remote_code=False, local_files_only=True)
    except StrictDataclassError as err:  # transformers' own validation of a value the facts do not check
        raise BadInput(f"config.json: {err.__cause__ or err}; fix config.json") from None
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as err:
        raise BadInput(f"cannot read {facts.folder / 'config.json'} ({first_line(err)}); headfold needs a built-in transformers model type") from None


def _model_class(config: transformers.PretrainedConfig) -> type[transformers.PreTrainedModel]:
    """The class named by config.architectures[0], from transformers itself (never remote code)."""
    names = getattr(config, "architectures", None) or []
    if not names:
        raise BadInput("config.json has no 'architectures' entry: add the model class, e.g. \"LlamaForCausalLM\"")
    cls = builtin_class(names[0])
    if cls is None:
        raise BadInput(
            f"unknown architecture {names[0]!r} in config.json: headfold loads built-in transformers "
            "classes only (no remote code); set 'architectures' to one of them"
        )
    if cls.config_class is None or not isinstance(config, cls.config_class):
        raise BadInput(f"architecture {names[0]} does not match model_type {config.model_type!r} in config.json; fix one of them")
    return cls


def _gqa_class(config: transformers.PretrainedConfig, heads: int, kv_heads: tuple[int, ...]) -> type[_GQA] | None:
    """The attention class to swap in, or None when transformers' own class serves (resized per layer if need be)."""
    gqa = GQA_ATTENTION.get(config.model_type)
    if all(kv == heads for kv in kv_heads):
        return gqa if gqa and gqa.always else None
    if gqa:
        return gqa
    if _native_gqa(config):
        return None
    raise BadInput(
        f"model_type {config.model_type!r} has no grouped-query support in transformers or headfold "
        f"(headfold adds it for {', '.join(GQA_ATTENTION)}); use num_key_value_heads={heads}"
    )


def _native_gqa(config: transformers.PretrainedConfig) -> bool:
    """Whether transformers groups this family's K/V itself: the spec says so (gpt_bigcode: multi_query);
    for a family without a spec, its config class declares num_key_value_heads or derives it (falcon
    from multi_query, transformers 5.25 on): read off a config built from the class's defaults, so that
    a stray key in config.json does not count."""
    if config.model_type in supported_model_types():
        return spec_for(config.model_type).native_gqa
    try:
        return hasattr(type(config)(), "num_key_value_heads")
    except (ValueError, TypeError, StrictDataclassError):  # a class with no defaults for everything: what it declares
        return hasattr(type(config), "num_key_value_heads")


def _open(file: Path) -> safe_open:
    """safe_open, with a corrupt or truncated file reported as BadInput."""
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as err:
        raise BadInput(f"cannot read {file} ({err}); re-save or re-download the checkpoint") from None


def _tensor_meta(facts: CheckpointFacts) -> tuple[_Meta, dict[str, Path]]:
    """Name -> (shape, dtype) and name -> file, from the checkpoint's tensor index (headers only)."""
    tensors = facts.tensor_index().tensors
    return {n: (t.shape, t.dtype) for n, t in tensors.items()}, {n: t.file for n, t in tensors.items()}


# ---------------------------------------------------------------------------------------------
# Building and strict loading.
# ---------------------------------------------------------------------------------------------


def _swap_attention(model: nn.Module, gqa: type[_GQA], facts: CheckpointFacts) -> None:
    """Each self-attention module (in layer order) becomes `gqa` at its layer's kv heads."""
    if facts.blocks:
        return _swap_blocks(model, gqa, facts)
    found = [m for m in model.modules() if type(m) is gqa.base and not getattr(m, "is_cross_attention", False)]
    if len(found) != facts.layers:  # pragma: no cover - guards against renamed classes in a future transformers
        raise RuntimeError(f"{len(found)} {gqa.base.__name__} modules in {type(model).__name__}, expected {facts.layers}")
    for module, kv in zip(found, facts.kv_heads, strict=True):
        gqa.adopt(module, facts.heads, kv, facts.head_dim)


def _swap_blocks(model: nn.Module, gqa: type[_GQA], facts: CheckpointFacts) -> None:
    """Each attention module of an encoder-decoder, found by its kind's path, becomes `gqa` at its block's kv heads."""
    spec = facts.spec
    assert spec is not None  # a family with a GQA class is one headfold converts
    paths = {kind.name: spec.for_kind(kind).tensor_pattern("") for kind in spec.attentions}  # module name + "." → (prefix, layer)
    found = {
        (kind, int(m.group(2))): module
        for name, module in model.named_modules() if type(module) is gqa.base
        for kind, path in paths.items() if (m := path.match(name + "."))
    }  # fmt: skip
    if set(found) != {(b.kind, b.layer) for b in facts.blocks}:  # pragma: no cover - guards against renamed modules
        raise RuntimeError(f"{len(found)} {gqa.base.__name__} modules found in {type(model).__name__}, expected {len(facts.blocks)}")
    for block in facts.blocks:
        gqa.adopt(found[block.kind, block.layer], block.shape.heads, block.shape.kv_heads, block.shape.head_dim)


def _resize_native(model: nn.Module, facts: CheckpointFacts) -> None:
    """Native-GQA families build every layer at num_key_value_heads (the largest); give each layer
    its own K/V projection size and counts. Their forwards view K/V with -1 heads (llama-likes)
    or slice a fused qkv_proj by num_key_value_heads (phi3); SDPA groups by num_key_value_groups."""
    spec = facts.spec or spec_for(facts.config.get("model_type"))
    heads, head_dim, kv_heads = facts.heads, facts.head_dim, facts.kv_heads
    kv_projections = [spec.fused_qkv] if spec.fused_qkv else [spec.projections["k"], spec.projections["v"]]
    module_layer = spec.tensor_pattern("")  # module name + "." → (prefix, layer index)
    resized = set()
    for name, module in model.named_modules():
        if not (m := module_layer.match(name + ".")):
            continue
        layer = int(m.group(2))
        sizes = head_axis_sizes(spec, HeadShape(heads, kv_heads[layer], head_dim))
        for projection in kv_projections:
            _resize(module, projection.weight.removesuffix(".weight"), sizes[projection.weight][1])
        norms = (spec.head_norms or {}).get("k", "").split("." + HEAD)[0]  # StableLM: a ModuleList, one norm per kv head
        if norms and norms.split(".")[0] in module._modules:  # present with qk_layernorm only
            del module.get_submodule(norms)[kv_heads[layer] :]
        _set_kv_counts(module, heads, kv_heads[layer])
        resized.add(layer)
    if resized != set(range(len(kv_heads))):  # pragma: no cover - guards against renamed modules
        raise RuntimeError(f"attention modules of layers {sorted(resized)} found in {type(model).__name__}, expected {len(kv_heads)}")


def _set_kv_counts(module: nn.Module, heads: int, kv_heads: int) -> None:
    """A native-GQA block's head counts: SDPA groups by num_key_value_groups, phi3 and stablelm split by num_key_value_heads."""
    _set_plain(module, num_key_value_groups=heads // kv_heads)
    if hasattr(module, "num_key_value_heads"):
        _set_plain(module, num_key_value_heads=kv_heads)


def at_kv_heads(block: nn.Module, model_type: str, shape: HeadShape, kv_heads: int) -> nn.Module | None:
    """A copy of the attention block `block` of a checkpoint at `shape` that reads K/V at `kv_heads` heads as the
    converted model's does: a family without GQA in transformers adopts its GQA subclass (on the one module of
    the block that is its base: BERT's is the block's `self`), a native one's head counts are set. The copy shares
    `block`'s weights; what it changes (its class, counts, resized K/V projections) leaves `block` as it was.
    None where the block has no module to adopt nor a head count to set."""
    grouped = _own_copy(block)
    if gqa := GQA_ATTENTION.get(model_type):
        paths = [name for name, module in block.named_modules() if isinstance(module, gqa.base)]
        if len(paths) != 1:
            return None
        gqa.adopt(_copied_path(grouped, paths[0]), shape.heads, kv_heads, shape.head_dim)
    elif isinstance(getattr(block, "num_key_value_groups", None), int):
        _set_kv_counts(grouped, shape.heads, kv_heads)
    else:
        return None
    return grouped


def _own_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` whose parameters, buffers and submodules can be replaced without touching `module`."""
    copied = copy.copy(module)
    copied._parameters, copied._buffers, copied._modules = dict(module._parameters), dict(module._buffers), dict(module._modules)
    return copied


def _copied_path(root: nn.Module, path: str) -> nn.Module:
    """The submodule of `root` at `path` (dotted; "" for `root`), each module on the way replaced by its own copy."""
    module = root
    for name in filter(None, path.split(".")):
        child = module._modules[name]
        assert child is not None
        module._modules[name] = module = _own_copy(child)
    return module


def _build(
    cls: type[transformers.PreTrainedModel],
    config: transformers.PretrainedConfig,
    facts: CheckpointFacts,
    gqa: type[_GQA] | None,
    dtype: torch.dtype | None,
    device: str,
) -> transformers.PreTrainedModel:
    """The model with GQA attention swapped in, weights uninitialized (they are loaded next), tied."""
    config = copy.deepcopy(config)  # _from_config writes dtype / attention choice into it
    with torch.device(device), no_init_weights():
        model = cls._from_config(config, dtype=dtype, attn_implementation=gqa.attn_implementation if gqa else _ATTN_IMPLEMENTATION)
        if gqa is not None:
            _swap_attention(model, gqa, facts)
            gqa.prepare(model)
        elif len(set(facts.kv_heads)) > 1:
            _resize_native(model, facts)
    model.tie_weights()  # no_init_weights also skipped tying
    return model


class _Renamer:
    """Checkpoint name -> model name, with transformers' own load-time renames (e.g. gpt_neox
    embed_out -> lm_head, LayerNorm.gamma -> weight) and base-model prefix added or dropped.

    save_pretrained writes the original names back, so converted checkpoints carry them too.
    """

    def __init__(self, model: transformers.PreTrainedModel, expected: dict[str, torch.Tensor]) -> None:
        mapping = get_model_conversion_mapping(model)
        self.renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        self.converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self.prefix = model.base_model_prefix
        self.expected = expected

    def __call__(self, name: str) -> tuple[str, bool]:
        """(model name, whether a transformers WeightConverter merges/splits it on load)."""
        renamed, pattern = rename_source_key(name, self.renamings, self.converters, self.prefix, self.expected)
        if renamed not in self.expected and name in self.expected:  # as transformers does: keep exact hits
            renamed, pattern = name, None
        return renamed, pattern is not None


def _plan(model: transformers.PreTrainedModel, facts: CheckpointFacts, meta: _Meta, *, converters_ok: bool) -> dict[str, str]:
    """model tensor -> checkpoint tensor; BadInput unless every tensor is accounted for, shapes included.

    Tensors that a transformers WeightConverter merges or splits (MoE experts, ...) can only be
    loaded by from_pretrained: they count as present but are not planned (`converters_ok`).
    """
    expected = model.state_dict()  # parameters + persistent buffers; tied weights under both names
    rename = _Renamer(model, expected)
    plan: dict[str, str] = {}
    converted: set[str] = set()
    for ckpt_name in meta:
        name, is_converted = rename(ckpt_name)
        if is_converted:
            converted.add(name)
        else:
            plan[name] = ckpt_name
    if converted and not converters_ok:
        raise BadInput(
            f"{type(model).__name__} needs transformers' weight conversion for {sorted(converted)[0]!r}, "
            "which headfold's GQA loader does not do; load an unconverted checkpoint"
        )
    _check_extra(model, plan, expected)
    _check_shapes(facts, plan, expected, meta)
    _check_missing(model, plan.keys() | converted, expected)
    return {name: ckpt_name for name, ckpt_name in plan.items() if name in expected}


def _check_extra(model: transformers.PreTrainedModel, plan: dict[str, str], expected: dict) -> None:
    ignorable = [*_STALE_BUFFERS, *(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())]
    extra = sorted(ckpt_name for name, ckpt_name in plan.items() if name not in expected and not any(re.search(p, name) for p in ignorable))
    if extra:
        raise BadInput(f"{len(extra)} checkpoint tensor(s) unknown to {type(model).__name__}, e.g. {extra[0]!r}; check 'architectures' in config.json")


def _check_shapes(facts: CheckpointFacts, plan: dict[str, str], expected: dict, meta: _Meta) -> None:
    for name, ckpt_name in plan.items():
        if name in expected and (want := tuple(expected[name].shape)) != (have := meta[ckpt_name][0]):
            raise BadInput(
                f"tensor {ckpt_name} has shape {list(have)} but config.json ({_sized_by(facts, want, have)}) implies {list(want)}; "
                "config.json and the weights disagree: restore config.json from the original checkpoint, or re-run headfold convert"
            )


def _sized_by(facts: CheckpointFacts, want: tuple[int, ...], have: tuple[int, ...]) -> str:
    """The config values behind a dimension that differs: a size key holding it (a position table, mel
    bins, an MLP width), else the head shape."""
    wrong = {w for w, h in zip(want, have, strict=True) if w != h} if len(want) == len(have) else set()
    named = [f"{key}={value}" for key, value in facts.config.items() if key in SIZE_KEYS and key not in HEAD_KEYS and value in wrong]
    per_layer = f", {KV_HEADS_PER_LAYER}={list(facts.kv_heads)}" if len(set(facts.kv_heads)) > 1 else ""
    return ", ".join(named) or f"{facts.head_terms()}{per_layer}"


def _check_missing(model: transformers.PreTrainedModel, present: set[str], expected: dict) -> None:
    """Only tied weights may be absent (non-persistent buffers are not in the state dict at all)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    partners = {**tied, **{source: target for target, source in tied.items()}}
    missing = sorted(n for n in expected if n not in present and partners.get(n) not in present)
    if missing:
        raise BadInput(f"{len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[0]!r}; the checkpoint is incomplete or does not match config.json")


def _load_weights(model: nn.Module, plan: dict[str, str], files: dict[str, Path]) -> None:
    """Copy tensors file by file into the model (casting to its dtype); one tensor in memory at a time."""
    targets = model.state_dict()  # shares storage with the parameters
    by_file: dict[Path, list[str]] = {}
    for name, ckpt_name in plan.items():
        by_file.setdefault(files[ckpt_name], []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with _open(file) as f:
                for name in names:
                    targets[name].copy_(f.get_tensor(plan[name]))


def _resolve_dtype(dtype: torch.dtype | None, facts: CheckpointFacts, meta: _Meta) -> torch.dtype:
    """Like from_pretrained's dtype="auto": explicit, else config.json's dtype, else the weights' own."""
    stored = (d for _, d in meta.values() if d in _FLOATS)
    return next(d for d in (dtype, facts.dtype, *stored, torch.float32) if d is not None)


def _facts(path: str | os.PathLike | CheckpointFacts) -> CheckpointFacts:
    """The facts a caller already holds, else read (and checked) from the folder at `path`."""
    return path if isinstance(path, CheckpointFacts) else CheckpointFacts.read(Path(path))


def load_model(path: str | os.PathLike | CheckpointFacts, *, dtype: torch.dtype | None = None) -> transformers.PreTrainedModel:
    """A runnable model (eval mode, SDPA attention) for the checkpoint folder at `path` (or its facts).

    Raises BadInput for a missing/unknown config, remote-code or unknown architectures, and tensors
    whose names or shapes don't match config.json (e.g. K/V sized for another num_key_value_heads).
    """
    facts = _facts(path)  # missing, unreadable, links out, quantized, bad sizes or rope: before transformers sizes anything
    folder = facts.folder
    config = _transformers_config(facts)
    _generation_config(folder)  # from_pretrained would skip a broken one with a warning: refused as bad input
    cls = _model_class(config)
    gqa = _gqa_class(config, facts.heads, facts.kv_heads)
    meta, files = _tensor_meta(facts)

    if gqa is None and len(set(facts.kv_heads)) == 1:
        # Check names and shapes on a weightless skeleton first, so mismatches are one-line BadInput.
        _plan(_build(cls, config, facts, None, dtype, device="meta"), facts, meta, converters_ok=True)
        model = cls.from_pretrained(
            folder,
            dtype=dtype if dtype is not None else "auto",
            attn_implementation=_ATTN_IMPLEMENTATION,
            local_files_only=True,
        )
    else:
        model_dtype = _resolve_dtype(dtype, facts, meta)
        _plan(_build(cls, config, facts, gqa, model_dtype, device="meta"), facts, meta, converters_ok=False)  # before allocating
        model = _build(cls, config, facts, gqa, model_dtype, device="cpu")
        _load_weights(model, _plan(model, facts, meta, converters_ok=False), files)
        _finish_like_from_pretrained(model, facts)
    return model.eval()


def empty_model(facts: CheckpointFacts, shapes: dict[str, tuple[int, ...]]) -> tuple[transformers.PreTrainedModel, dict[str, str]]:
    """The fp32 model for the checkpoint folder on the meta device (it holds no memory), GQA attention
    swapped in as `load_model` does, and model tensor -> checkpoint tensor for every tensor it loads.

    `shapes` are the checkpoint's tensor shapes by name (from its headers); BadInput as for load_model.
    """
    config = _transformers_config(facts)
    cls = _model_class(config)
    model = _build(cls, config, facts, _gqa_class(config, facts.heads, facts.kv_heads), torch.float32, device="meta")
    plan = _plan(model, facts, {name: (shape, None) for name, shape in shapes.items()}, converters_ok=False)
    return model.eval(), _with_tied_names(model, plan)


def hollow_model(facts: CheckpointFacts, dtype: torch.dtype) -> tuple[transformers.PreTrainedModel, dict[str, str]]:
    """The model for the checkpoint folder in `dtype` with its parameters on the meta device (no memory)
    and its buffers real (rotary frequencies, masks: computed from config.json, small), GQA attention
    swapped in as `load_model` does; and model tensor -> checkpoint tensor for every parameter and
    persistent buffer, tied names included. An exporter traces it and streams the weights itself.
    BadInput as for load_model.
    """
    config = _transformers_config(facts)
    _generation_config(facts.folder)
    cls = _model_class(config)
    with accelerate.init_empty_weights(include_buffers=False):
        model = _build(cls, config, facts, _gqa_class(config, facts.heads, facts.kv_heads), dtype, device="cpu")
    model.tie_weights()  # again: init_empty_weights wraps every parameter assigned under it in a new one
    plan = _plan(model, facts, _tensor_meta(facts)[0], converters_ok=False)
    _finish_like_from_pretrained(model, facts)
    return model.eval(), _with_tied_names(model, plan)


def _with_tied_names(model: transformers.PreTrainedModel, plan: dict[str, str]) -> dict[str, str]:
    """`plan` with each tied weight under both names (the checkpoint stores either)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for name, partner in [*tied.items(), *((b, a) for a, b in tied.items())]:
        if partner in plan and name not in plan:
            plan[name] = plan[partner]
    return plan


def _finish_like_from_pretrained(model: transformers.PreTrainedModel, facts: CheckpointFacts) -> None:
    """What from_pretrained also does: record the source and use its generation defaults."""
    model.config.name_or_path = str(facts.folder)
    if facts.kind != "encoder" and (generation := _generation_config(facts.folder)) is not None:  # decoders and encoder-decoders generate
        model.generation_config = generation


def _generation_config(folder: Path) -> transformers.GenerationConfig | None:
    """generation_config.json, when the folder has one; BadInput when transformers cannot read it."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return None
    read_json_object(path, "restore it from the original checkpoint")  # size and depth first
    try:
        return transformers.GenerationConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, TypeError, OSError, StrictDataclassError) as err:
        raise BadInput(f"{path} is invalid ({first_line(err)}); restore it from the original checkpoint") from None


def check_loadable(path: str | os.PathLike | CheckpointFacts) -> None:
    """What load_model would refuse, without allocating anything (a pipeline checks it before its first
    stage): config values transformers validates, the architecture, generation_config.json, and every
    tensor's name and shape against the model config.json describes, built on the meta device."""
    facts = _facts(path)
    config = _transformers_config(facts)
    cls = _model_class(config)
    _generation_config(facts.folder)
    gqa = _gqa_class(config, facts.heads, facts.kv_heads)
    uniform = gqa is None and len(set(facts.kv_heads)) == 1  # load_model's from_pretrained path, which merges converted tensors
    _plan(_build(cls, config, facts, gqa, torch.float32, device="meta"), facts, _tensor_meta(facts)[0], converters_ok=uniform)


def parameter_names(model: transformers.PreTrainedModel, path: str | os.PathLike | CheckpointFacts) -> dict[str, str]:
    """Checkpoint tensor name -> name in `model`'s state dict (prefixes and load-time renames
    resolved), for `model` loaded from the folder at `path` (or its facts). Tensors that a
    transformers WeightConverter merges or splits on load have no single counterpart and are left out."""
    facts = _facts(path)
    plan = _plan(model, facts, _tensor_meta(facts)[0], converters_ok=True)
    return {ckpt_name: name for name, ckpt_name in plan.items()}
