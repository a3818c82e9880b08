"""A Hugging Face checkpoint folder: its facts read and checked once, its tensors read lazily.

`CheckpointFacts` is what every stage (convert, load_model, export, verify, inspect, build) knows
about a checkpoint: config and family spec, per-layer heads and kv heads, head_dim, rotary, precision,
position limit, tokenizer location and the tensor index of the weight files' headers. It is the
one reader of config.json and of those headers, so a fault has one error message everywhere.

`SourceCheckpoint` adds what converting needs on top: a supported family, every attention
tensor located and its shape and dtype checked, tensors read one at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from safetensors import SafetensorError, safe_open

from headfold.converter.layout import HeadShape, expected_shapes
from headfold.converter.per_layer import KV_HEADS_PER_ATTENTION, KV_HEADS_PER_LAYER, config_kv_heads, kind_kv_heads
from headfold.converter.spec import CACHES, ArchitectureSpec, AttentionKind, ConfigKeys, spec_for, supported_model_types
from headfold.converter.support import common_keys, export_blocker, unconverted_kind, unsupported
from headfold.ground import inputs
from headfold.ground.errors import BadInput
from headfold.ground.lazy import lazy_import
from headfold.ground.precision import CODE_OF_DTYPE, FLOAT_CODES, FP8_CODES, SAFETENSORS_DTYPES, Precision

if TYPE_CHECKING:
    import torch
else:  # torch loads where tensors are made: a mean/first conversion runs without it
    torch = lazy_import("torch")
# transformers' activation table imports torch: checked when a model is built, never in read()
activations = lazy_import("transformers.activations")


SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
MAX_LAYERS = 10_000  # far above any real model; guards allocations sized by config.json
MAX_SIZE = 1 << 24  # 16 777 216: above any real width, head count, vocabulary, mel bins or context (the longest, ~10M tokens)
# Config keys that size a model, under every name the families give them: layer stacks (at most
# MAX_LAYERS) and heads, widths, vocabularies, position tables and audio features (at most MAX_SIZE).
# Each must be a positive integer (null: unset), checked before anything is sized by it or copied.
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers", "max_window_layers")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads", "num_key_value_heads", "head_dim", "d_kv")
SIZE_KEYS = (
    *HEAD_KEYS, "hidden_size", "n_embd", "d_model", "word_embed_proj_dim", "intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim",
    "decoder_ffn_dim", "rotary_dim", "vocab_size", "type_vocab_size", "max_position_embeddings", "n_positions", "n_ctx",
    "original_max_position_embeddings", "max_source_positions", "max_target_positions", "num_mel_bins", "sliding_window",
    "relative_attention_num_buckets", "relative_attention_max_distance",
)  # fmt: skip
# Tensor-name endings of quantized checkpoints: their weights are codes, pooling them is garbage.
QUANTIZATION_TENSORS = {
    "FP8": ("weight_scale", "weight_scale_inv", "input_scale"),
    "GPTQ/AWQ": ("qweight", "qzeros", "scales", "g_idx"),
    "bitsandbytes": ("SCB", "weight_format", "absmax", "quant_map", "quant_state"),
}
DEQUANTIZE = "headfold pools floating-point weights: dequantize first (e.g. load with transformers and save_pretrained in bf16)"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")
# Leave room for position offsets such as RoBERTa's padding_idx + 1.
SPARE_POSITIONS = 2
WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|onnx|onnx_data|onnx\.data|ot|gguf)$|.*\.(safetensors|bin)\.index\.json$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    code: str  # safetensors dtype code: "BF16", "F32", ...
    shape: tuple[int, ...]
    file: Path
    offset: int = 0  # byte offset in a safetensors file (unused for pickles)

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.code)

    @property
    def nbytes(self) -> int:
        return SAFETENSORS_DTYPES[self.code].itemsize * math.prod(self.shape)


def dtype_code(dtype: Any) -> str:
    """The safetensors code of a torch dtype (by name: torch is not imported) or of a code; KeyError for others."""
    return dtype if isinstance(dtype, str) else CODE_OF_DTYPE[str(dtype).removeprefix("torch.")]


def torch_dtype(code: str) -> torch.dtype:
    return getattr(torch, SAFETENSORS_DTYPES[code].torch)


@dataclass(frozen=True)
class FileRange:
    """Tensor bytes as they sit in a file: the writer copies them in the kernel, unread."""

    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class AttentionLayout:
    """Where each layer's attention tensors are: layer → {spec suffix: tensor name}."""

    layers: list[dict[str, str]]

    def owner(self) -> dict[str, int]:
        """tensor name → layer index."""
        return {name: i for i, layer in enumerate(self.layers) for name in layer.values()}


# -- staying inside the folder (the input policy: ground/inputs.py) ------------------
def check_links(folder: Path) -> None:
    """BadInput naming a link in `folder` that leads outside it, or a special file in it."""
    inputs.check_links(folder, "checkpoint folder")


def inside(folder: Path, entry: Any, index: Path) -> Path:
    """`folder / entry` for an index entry, refused when it is absolute, has '..' or resolves outside."""
    return inputs.contained(folder, entry, index, "shards must lie in the checkpoint folder: restore the index from the original checkpoint")


# -- config.json ----------------------------------------------------------------------
def _read_config_json(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    try:  # open, not is_file(): an unreadable file is "permission denied", never "missing"
        config = inputs.read_json(path, "restore it from the original checkpoint")
    except (FileNotFoundError, IsADirectoryError):
        raise BadInput(f"{path} is missing: a Hugging Face checkpoint folder needs its config.json") from None
    if not isinstance(config, dict):
        raise BadInput(f"{path} must hold a JSON object; restore it from the original checkpoint")
    return config


def _check_config(config: dict[str, Any], spec: ArchitectureSpec | None) -> None:
    """Refuse config values that make no sense before anything is sized by them (`spec` None: a
    family headfold does not convert, checked under the common key names)."""
    if quantization := config.get("quantization_config"):
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise BadInput(f"config.json has a quantization_config (quant_method {inputs.shown(method)}): {DEQUANTIZE}")
    _check_sizes(config, spec)
    _check_values(config)
    _check_rope(config)


def _check_sizes(config: dict[str, Any], spec: ArchitectureSpec | None) -> None:
    """Every size key (SIZE_KEYS, LAYER_KEYS and the family's own) a positive integer within its limit."""
    keys = spec.config if spec else common_keys(config.get("model_type"))
    kinds = spec.attentions if spec else ()
    layers = {keys.layers, *LAYER_KEYS, *(k for kind in kinds for k in kind.layers)}
    sizes = {keys.heads, keys.hidden, keys.kv_heads, keys.head_dim, *SIZE_KEYS, *(kind.heads for kind in kinds)} - layers
    for key in [k for k in config if k in layers | sizes and config[k] is not None]:  # the file's order: its first bad key
        value, limit = _positive_int(config, key), MAX_LAYERS if key in layers else MAX_SIZE
        if value > limit:
            raise BadInput(f"config.json: {key!r} is {value}, more than {limit}, which no model has; fix config.json")


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return (_integer(value) or isinstance(value, float)) and math.isfinite(value)


def _token_ids(value: Any, vocab: int | None) -> bool:  # eos may list several
    ids = value if isinstance(value, list) and value else [value]
    return all(_integer(i) and 0 <= i < (vocab or 2**63) for i in ids)


# Config values the model builder and the exporter read, by the names families give them: what each
# must be, checked here (null means "unset" for all of them), so a bad one is one line before any work.
CONFIG_VALUES: dict[str, tuple[Callable[[Any, int | None], bool], tuple[str, ...]]] = {
    "a positive number": (lambda v, _: _number(v) and v > 0, (
        "rope_theta", "rotary_emb_base", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps",
    )),
    "a number from 0 to 1": (lambda v, _: _number(v) and 0 <= v <= 1, (
        "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "dropout",
        "attention_probs_dropout_prob", "activation_dropout", "classifier_dropout", "summary_first_dropout", "layerdrop",
    )),
    "a number of at least 0": (lambda v, _: _number(v) and v >= 0, ("initializer_range",)),
    "true or false": (lambda v, _: isinstance(v, bool), (
        "tie_word_embeddings", "attention_bias", "mlp_bias", "use_cache", "use_parallel_residual", "do_layer_norm_before",
        "enable_bias", "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "is_decoder",
        "add_cross_attention", "use_sliding_window",
    )),
    "a token id inside the vocabulary": (_token_ids, (
        "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id",
    )),
    "an activation name": (lambda v, _: isinstance(v, str) and bool(v), ("hidden_act", "activation_function", "hidden_activation")),
    "a model type name": (lambda v, _: isinstance(v, str) and bool(v), ("model_type",)),
    "float32, float16, bfloat16, float64 or auto": (lambda v, _: v in ("float32", "float16", "bfloat16", "float64", "auto"), ("dtype", "torch_dtype")),
}  # fmt: skip
ACTIVATION_KEYS = CONFIG_VALUES["an activation name"][1]


def _check_values(config: dict[str, Any]) -> None:
    vocab = config.get("vocab_size") if _integer(config.get("vocab_size")) else None
    for kind, (fits, keys) in CONFIG_VALUES.items():
        for key in keys:
            if config.get(key) is not None and not fits(config[key], vocab):
                where = f" [0, {vocab})" if fits is _token_ids and vocab else ""
                raise BadInput(f"config.json: {key!r} must be {kind}{where}, found {inputs.shown(config[key])}; fix config.json")
    architectures = config.get("architectures")
    if architectures is not None and not (isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures)):
        raise BadInput(
            f"config.json: 'architectures' must be a list of class names like [\"LlamaForCausalLM\"], found {inputs.shown(architectures)}; fix config.json"
        )


def _check_rope(config: dict[str, Any]) -> None:
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if params is None:
            continue
        nested = params.values() if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()) else [params]
        for entry in nested:  # one dict, or one per layer type (sliding / full attention)
            if not isinstance(entry, dict):
                raise BadInput(f'config.json: {key!r} must be an object like {{"rope_type": "default", "rope_theta": 10000.0}}, found {inputs.shown(params)}')
            for name in ("rope_theta", "factor"):
                if name in entry and not _positive_number(entry[name]):
                    raise BadInput(f"config.json: {key}.{name} must be a positive number, found {inputs.shown(entry[name])}")
            _check_fraction(entry, f"{key}.", "partial_rotary_factor")
    _check_fraction(config, "", "partial_rotary_factor")
    _check_fraction(config, "", "rotary_pct")


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _check_fraction(config: dict[str, Any], where: str, key: str) -> None:
    value = config.get(key)
    if value is not None and not (_positive_number(value) and value <= 1):
        raise BadInput(f"config.json: {where}{key} must be a fraction of the head dims in (0, 1], found {inputs.shown(value)}")


def _positive_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BadInput(f"config.json: {key!r} must be a positive integer, found {inputs.shown(value)}; fix config.json")
    return value


def _spec_or_refusal(config: dict[str, Any], convertible: bool) -> ArchitectureSpec | None:
    """The family's spec; None for a family headfold does not convert but exports as it is. Any
    other model (or any unconverted one, when `convertible`) gets the one unsupported line."""
    model_type = config.get("model_type")
    if model_type in supported_model_types():
        return spec_for(model_type)
    if convertible or export_blocker(config):
        raise unsupported(config)
    return None


def _head_shape(config: dict[str, Any], keys: ConfigKeys) -> HeadShape:
    """Heads, kv heads (the largest layer's) and head_dim under a family's config key names."""
    heads = _positive_int(config, keys.heads)
    kv_heads = _positive_int(config, keys.kv_heads) if config.get(keys.kv_heads) is not None else heads
    if keys.multi_query and config.get(keys.multi_query) is not None:  # gpt_bigcode: transformers derives kv heads from it
        if not isinstance(config[keys.multi_query], bool):
            raise BadInput(f"config.json: {keys.multi_query!r} must be true or false, found {config[keys.multi_query]!r}")
        kv_heads = 1 if config[keys.multi_query] else heads
    hidden = _positive_int(config, keys.hidden)
    if keys.head_dim and config.get(keys.head_dim) is not None:
        head_dim = _positive_int(config, keys.head_dim)
    elif hidden % heads:
        raise BadInput(f"config.json: {keys.hidden} {hidden} is not divisible by {keys.heads} {heads}; fix config.json")
    else:
        head_dim = hidden // heads
    if heads % kv_heads:
        raise BadInput(f"config.json: {keys.kv_heads}={kv_heads} must divide {keys.heads}={heads}; fix config.json")
    return HeadShape(heads, kv_heads, head_dim)


def head_terms(config: dict[str, Any], keys: ConfigKeys, shape: HeadShape) -> str:
    """A head shape with the values named as config.json names them (T5's d_kv, Whisper's d_model), for
    a message about a tensor that does not fit it."""

    def named(key: str | None, value: int, otherwise: str) -> str:
        return f"{key} {value}" if key and config.get(key) is not None else otherwise

    heads, kv_heads = named(keys.heads, shape.heads, f"{shape.heads} heads"), named(keys.kv_heads, shape.kv_heads, f"{shape.kv_heads} kv heads")
    return f"{heads}, {kv_heads}, {named(keys.head_dim, shape.head_dim, f'head_dim {shape.head_dim}')}, {keys.hidden} {config[keys.hidden]}"


@dataclass(frozen=True)
class AttentionBlock:
    """One attention module of an encoder-decoder: its kind, its layer in that kind's stack, its heads."""

    kind: str  # AttentionKind.name
    layer: int
    shape: HeadShape


def _kind_layers(config: dict[str, Any], kind: AttentionKind) -> int:
    return _positive_int(config, next((k for k in kind.layers if config.get(k) is not None), kind.layers[-1]))  # bounded by _check_sizes


def _attention_blocks(config: dict[str, Any], spec: ArchitectureSpec) -> tuple[AttentionBlock, ...]:
    """An encoder-decoder's attention modules, kind by kind, with the kv heads KV_HEADS_PER_ATTENTION states
    (a converted checkpoint's; a source has as many as query heads)."""
    stated = config.get(KV_HEADS_PER_ATTENTION) or {}
    names = [kind.name for kind in spec.attentions]
    if not isinstance(stated, dict) or set(stated) - set(names):
        raise BadInput(
            f"config.json: {KV_HEADS_PER_ATTENTION} must map {', '.join(names)} to kv-head counts, found {inputs.shown(stated)}; re-run "
            "headfold convert or fix config.json"
        )
    keys, blocks = spec.config, []
    for kind in spec.attentions:  # head_dim: the family's key (T5's d_kv), else the width over this kind's heads
        layers, heads = _kind_layers(config, kind), _positive_int(config, kind.heads)
        head_dim = {keys.head_dim: config.get(keys.head_dim)} if keys.head_dim else {}
        shape = _head_shape({kind.heads: heads, keys.hidden: config[keys.hidden], **head_dim}, replace(keys, heads=kind.heads))
        counts = kind_kv_heads(stated.get(kind.name), heads, layers, kind.name)
        blocks += [AttentionBlock(kind.name, layer, replace(shape, kv_heads=kv)) for layer, kv in enumerate(counts)]
    return tuple(blocks)


@dataclass(frozen=True)
class Rotary:
    """RoPE as the config states it (partial rotary under its several names)."""

    dims: int  # leading head dims RoPE rotates; 0 without RoPE
    fraction: float  # of head_dim; 0.0 without RoPE
    theta: float | None  # base frequency; None: transformers' default for the family


def _rotary(config: dict[str, Any], spec: ArchitectureSpec | None, head_dim: int) -> Rotary:
    if spec is None or not spec.rope:
        return Rotary(0, 0.0, None)
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    fraction = params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or config.get("rotary_pct") or 1.0
    theta = params.get("rope_theta") or config.get("rope_theta") or config.get("rotary_emb_base")
    if config.get("rotary_dim") is not None:  # GPT-J states the rotated dims themselves
        dims = _positive_int(config, "rotary_dim")
        if dims > head_dim or dims % 2:
            raise BadInput(f"config.json: rotary_dim {dims} must be an even number of dims of a {head_dim}-dim head; fix config.json")
        return Rotary(dims, dims / head_dim, theta)
    return Rotary(int(head_dim * fraction) // 2 * 2, float(fraction), theta)


def tokenizer_location(folder: Path) -> Path | None:
    """Where a checkpoint's tokenizer files are: its folder when it holds any, else None."""
    return folder if any((folder / name).is_file() for name in TOKENIZER_FILES) else None


def _config_dtype(config: dict[str, Any]) -> str | None:
    """The safetensors code of the dtype config.json declares (transformers writes "dtype", older versions "torch_dtype")."""
    name = config.get("dtype") or config.get("torch_dtype")
    return CODE_OF_DTYPE.get(name) if isinstance(name, str) else None


@dataclass(frozen=True)
class TensorIndex:
    """The weight files' headers: each tensor's dtype, shape, file and byte offset, no data read."""

    files: list[Path]
    tensors: dict[str, TensorInfo]
    pickles: dict[Path, dict[str, torch.Tensor]]  # weights-only pickles, loaded (mmap) only when allowed


@dataclass(frozen=True)
class CheckpointFacts:
    """What every stage knows about a checkpoint folder, read from config.json and checked once.

    Build it with `CheckpointFacts.read(folder)`; the tensor index is read on first use.
    """

    folder: Path
    config: dict[str, Any]
    spec: ArchitectureSpec | None  # None: a transformers family headfold loads but does not convert
    layers: int
    heads: int
    kv_heads: tuple[int, ...]  # per layer
    head_dim: int
    hidden: int
    rotary: Rotary
    dtype_code: str | None  # the dtype config.json declares, as a safetensors code
    positions: int | None  # max_position_embeddings / n_positions
    vocab_size: int | None
    tokenizer: Path | None  # the folder holding tokenizer files; None without any
    blocks: tuple[AttentionBlock, ...] = ()  # an encoder-decoder's attention modules; its "layers" are these
    _indexes: dict[bool, TensorIndex] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def read(cls, folder: str | os.PathLike, *, convertible: bool = False) -> CheckpointFacts:
        """BadInput for a missing, corrupt or linked-out config or impossible values; `convertible`:
        also for a family headfold does not convert (before its values are checked)."""
        folder = Path(folder)
        if not _is_dir(folder):
            raise BadInput(f"source {folder} is not a folder; pass a Hugging Face checkpoint folder")
        check_links(folder)
        config = _read_config_json(folder)
        spec = _spec_or_refusal(config, convertible)
        _check_config(config, spec)
        keys = spec.config if spec else common_keys(config.get("model_type"))
        shape = _head_shape(config, keys)
        layers = _positive_int(config, keys.layers)
        blocks = _attention_blocks(config, spec) if spec and spec.encoder_decoder else ()
        kv_heads = tuple(b.shape.kv_heads for b in blocks) or config_kv_heads(shape.kv_heads, config.get(KV_HEADS_PER_LAYER), shape.heads, layers)
        return cls(
            folder=folder,
            config=config,
            spec=spec,
            layers=len(blocks) or layers,
            heads=shape.heads,
            kv_heads=kv_heads,
            head_dim=shape.head_dim,
            hidden=config[keys.hidden],
            rotary=_rotary(config, spec, shape.head_dim),
            dtype_code=_config_dtype(config),
            positions=config.get("max_position_embeddings") or config.get("n_positions"),
            vocab_size=config.get("vocab_size"),
            tokenizer=tokenizer_location(folder),
            blocks=blocks,
        )

    @property
    def audio_input(self) -> bool:
        """The encoder reads log-mel features (Whisper), not token ids: the one place that says."""
        return self.spec is not None and self.spec.audio_encoder

    @property
    def audio_frames(self) -> int:
        """The log-mel frames an audio encoder reads (its whole window): twice its positions, which its
        second convolution halves."""
        return 2 * self.config["max_source_positions"]

    @property
    def mel_bins(self) -> int:
        """The log-mel bins of each frame an audio encoder reads."""
        return self.config["num_mel_bins"]

    @property
    def kind(self) -> Literal["decoder", "encoder", "seq2seq"]:
        """Decoder (causal LM: generates, exports with a KV cache), encoder or encoder-decoder: the one
        place that says (a family without a spec is never seq2seq here: support.export_blocker refuses it)."""
        return self.spec.kind if self.spec else unconverted_kind(self.config)

    def require_positions(self, needed: int, why: str, fix: str = "fix config.json", *, table_only: bool = False) -> None:
        """BadInput unless the model takes `needed` positions (its limit less SPARE_POSITIONS).
        `table_only`: only where the limit is the size of a learned position table, which holds
        `positions` rows (RoPE models run past their configured limit unless their sin/cos are such a
        table too, as GPT-J's; a table has no row past its end)."""
        if table_only and self.rotary.dims and not (self.spec and self.spec.rotary_table):
            return
        limit = self.positions if table_only else self.position_limit
        if limit is not None and limit < needed:
            key = "max_position_embeddings" if "max_position_embeddings" in self.config else "n_positions"
            raise BadInput(f"config.json: {key} {self.positions} leaves {max(limit, 0)} usable positions, and {why} needs {needed}; {fix}")

    def check_activations(self) -> None:
        """BadInput for an activation transformers does not know. Checked when a model is built, not
        in read(): transformers' activation table imports torch, which a mean conversion never loads."""
        for key in ACTIVATION_KEYS:
            if isinstance(name := self.config.get(key), str) and name not in activations.ACT2FN:
                raise BadInput(
                    f"config.json: {key!r} is {inputs.shown(name)}, which transformers does not know; use one of {', '.join(sorted(activations.ACT2FN)[:8])}, …"
                )

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype config.json declares (None when it declares none)."""
        return torch_dtype(self.dtype_code) if self.dtype_code else None

    @property
    def precision(self) -> Precision:
        """The precision of the weights as from_pretrained's dtype="auto" loads them: config.json's
        dtype, else the first floating tensor's (headers only); fp32 for fp64 and anything else. What
        export keeps by default and verify budgets a checkpoint by: rooms ask this, not the config."""
        code = self.dtype_code or next((t.code for t in self.tensor_index().tensors.values() if t.code in FLOAT_CODES), None)
        return Precision.of(code) or Precision.FP32

    def head_terms(self) -> str:
        """The head shape as config.json names its values (for a message)."""
        return head_terms(self.config, self.spec.config if self.spec else common_keys(self.config.get("model_type")), self.shape)

    @property
    def shape(self) -> HeadShape:
        """Heads, the largest layer's kv heads, head_dim."""
        return HeadShape(self.heads, max(self.kv_heads), self.head_dim)

    @property
    def layer_shapes(self) -> tuple[HeadShape, ...]:
        """Each layer's head shape (an encoder-decoder's: each attention block's): a chained conversion's
        source may hold per-layer kv heads."""
        if self.blocks:
            return tuple(b.shape for b in self.blocks)
        return tuple(HeadShape(self.heads, kv, self.head_dim) for kv in self.kv_heads)

    def cache_bytes_per_token(self, element_bytes: int, shapes: Sequence[HeadShape] | None = None) -> dict[str, int]:
        """The K/V cache's bytes per token over all layers, at `shapes` (default: the checkpoint's own
        layer_shapes): "self" per token; an encoder-decoder's decoder self-attention per target token and
        "cross" per source token."""
        shapes = shapes or self.layer_shapes
        kinds = [b.kind for b in self.blocks] or ["self"] * len(shapes)
        halves = CACHES if self.blocks else {"self": "self"}
        total = dict.fromkeys(halves.values(), 0)
        for kind, shape in zip(kinds, shapes, strict=True):
            if kind in halves:
                total[halves[kind]] += 2 * shape.kv_heads * shape.head_dim * element_bytes  # K and V
        return total

    @property
    def position_limit(self) -> int | None:
        """The longest sequence the model takes, less SPARE_POSITIONS (None when the config has no limit)."""
        return self.positions - SPARE_POSITIONS if self.positions else None

    def tensor_index(self, *, allow_pickle: bool = False) -> TensorIndex:
        """The weight files and their headers, validated; read once per pickle choice."""
        if allow_pickle not in self._indexes:
            self._indexes[allow_pickle] = read_tensor_index(self.folder, allow_pickle)
        return self._indexes[allow_pickle]


def read_tensor(info: TensorInfo, out: torch.Tensor | None = None) -> torch.Tensor:
    """One safetensors tensor, read with a plain positioned read: no mmap, so memory holds only what is in use.
    Into `out` (uint8, info.nbytes long) when given: a buffer the caller reuses."""
    buffer = torch.empty(info.nbytes, dtype=torch.uint8) if out is None else out
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        if f.readinto(buffer.numpy().data) != info.nbytes:  # else the rest would be whatever the buffer held
            raise BadInput(f"{info.file} ends inside tensor {info.name}: it changed after headfold checked it; restore the file and rerun")
    return buffer.view(info.dtype).reshape(info.shape)


def _safetensors_header(file: Path) -> list[TensorInfo]:
    """Validate a safetensors file with the library, then take data offsets from its header."""
    with open(file, "rb") as f:  # first: safetensors reports "permission denied" as "No such file"
        f.read(1)
    try:
        safe_open(file, framework="numpy")  # checks header, dtypes and that the data is complete (numpy: torch stays unloaded)
    except (SafetensorError, OSError) as e:
        raise BadInput(f"cannot read {file}: unreadable or truncated ({e}); download it again") from None
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise BadInput(f"{file.name}: tensor {name} has unsupported dtype {entry['dtype']}")
        infos.append(TensorInfo(name, entry["dtype"], tuple(entry["shape"]), file, 8 + length + entry["data_offsets"][0]))
    return sorted(infos, key=lambda t: t.offset)  # storage order: sequential reads


def _is_dir(path: Path) -> bool:
    """Like Path.is_dir, but a folder we may not look into raises PermissionError instead of "not a folder"."""
    try:
        path.stat()
    except FileNotFoundError:
        return False
    return path.is_dir()


def _quantization_scheme(name: str) -> str | None:
    parts = name.split(".")  # bitsandbytes 4-bit: "<weight>.quant_state.bitsandbytes__nf4"
    last = "quant_state" if "quant_state" in parts else parts[-1]
    return next((scheme for scheme, endings in QUANTIZATION_TENSORS.items() if last in endings), None)


def _check_stored_tensor(info: TensorInfo) -> None:
    """No quantization data, no 0-size tensors: both would convert into garbage, exit 0."""
    if scheme := _quantization_scheme(info.name):
        raise BadInput(f"tensor {info.name} in {info.file.name} is {scheme} quantization data: {DEQUANTIZE}")
    if 0 in info.shape:
        raise BadInput(f"tensor {info.name} in {info.file.name} has shape {list(info.shape)} with a 0-size dimension; re-save or download the checkpoint again")


def read_tensor_index(folder: Path, allow_pickle: bool) -> TensorIndex:
    """Every tensor's header entry, after checking the weight files (index, shards, truncation, format)."""
    files, index = _find_weight_files(folder, allow_pickle)
    tensors: dict[str, TensorInfo] = {}
    pickles: dict[Path, dict[str, torch.Tensor]] = {}
    for file in files:  # pickles only when allowed: _find_weight_files decides the format
        if file.suffix == ".safetensors":
            infos = _safetensors_header(file)
        else:
            pickles[file] = _load_pickle(file)
            infos = [TensorInfo(n, _pickle_code(file, n, t), tuple(t.shape), file) for n, t in pickles[file].items()]
        for info in infos:  # a source's tensors, whatever their format; the header parse itself stays neutral
            _check_stored_tensor(info)
            if (first := tensors.setdefault(info.name, info)) is not info:
                raise BadInput(
                    f"tensor {info.name} is in two shards, {first.file.name} and {file.name}; restore the checkpoint (each tensor lives in one shard)"
                )
    if missing := set(index) - set(tensors):
        raise BadInput(f"the weight index names {len(missing)} tensor(s) absent from the shards (e.g. {min(missing)}); the checkpoint is incomplete")
    if wrong := next((n for n, f in sorted(index.items()) if tensors[n].file != f), None):
        raise BadInput(
            f"the weight index maps tensor {wrong} to {index[wrong].name}, which does not hold it ({tensors[wrong].file.name} does); restore "
            "the index from the original checkpoint"
        )
    return TensorIndex(files, tensors, pickles)


def _find_weight_files(folder: Path, allow_pickle: bool) -> tuple[list[Path], dict[str, Path]]:
    """The weight files, and the file their index names for each tensor (none without an index)."""
    if (folder / SAFETENSORS_INDEX).is_file():
        files, names = _files_from_index(folder, folder / SAFETENSORS_INDEX)
        if pickle := next((f for f in files if f.suffix != ".safetensors"), None):  # never torch.load what the index names
            raise BadInput(f"{SAFETENSORS_INDEX} lists {pickle.name}, which is not a .safetensors file; restore the index from the original checkpoint")
        return files, names
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"], {}
    pickles = (folder / PICKLE_INDEX, folder / "pytorch_model.bin")
    if any(p.is_file() for p in pickles):
        if not allow_pickle:
            raise BadInput(
                f"{folder} holds only pickle weights (pytorch_model.bin), which can run code when "
                "loaded; convert them to safetensors or pass --allow-pickle (loaded with weights_only=True)"
            )
        return _files_from_index(folder, pickles[0]) if pickles[0].is_file() else ([pickles[1]], {})
    raise BadInput(f"no weights in {folder}: no model.safetensors, nor {SAFETENSORS_INDEX} with its shards")


def _files_from_index(folder: Path, index: Path) -> tuple[list[Path], dict[str, Path]]:
    fix = "restore it from the original checkpoint"
    try:
        weight_map = inputs.read_json(index, fix)["weight_map"]
        entries = set(weight_map.values())
    except (KeyError, TypeError, AttributeError) as e:
        raise BadInput(f"{index} is corrupt ({type(e).__name__}: {inputs.shown(str(e))}); {fix}") from None
    paths = {entry: inside(folder, entry, index) for entry in entries}
    files = sorted(set(paths.values()))
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise BadInput(f"{index.name} lists missing shard(s) {', '.join(missing)}; download the complete checkpoint")
    return files, {name: paths[entry] for name, entry in weight_map.items()}


def _pickle_code(file: Path, name: str, tensor: torch.Tensor) -> str:
    try:
        return dtype_code(tensor.dtype)
    except KeyError:
        raise BadInput(f"{file.name}: tensor {name} has unsupported dtype {tensor.dtype}") from None


def _load_pickle(file: Path) -> dict[str, torch.Tensor]:
    try:  # mmap: tensors are paged in only when read
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types for a bad pickle
        raise BadInput(f"{file} is not a loadable weights-only pickle ({type(e).__name__}); download it again") from None


def _ranges(layers: set[int]) -> str:
    """{0, 1, 2} → "0..2"; other sets as a list."""
    ordered = sorted(layers)
    return f"{ordered[0]}..{ordered[-1]}" if ordered and ordered == list(range(ordered[0], ordered[-1] + 1)) else str(ordered)


class SourceCheckpoint:
    """A checkpoint folder headfold converts: its facts, attention tensors located and checked,
    tensors read only when asked for."""

    def __init__(self, folder: Path, *, allow_pickle: bool = False) -> None:
        self.facts = CheckpointFacts.read(folder, convertible=True)
        spec = self.facts.spec
        assert spec is not None  # convertible=True: read refused the family otherwise
        self.folder, self.config, self.spec = self.facts.folder, self.facts.config, spec
        self.shape = self.facts.shape  # kv_heads: the largest layer's
        self.layers = self.facts.layers
        self.layer_shapes = self.facts.layer_shapes
        index = self.facts.tensor_index(allow_pickle=allow_pickle)
        self.weight_files, self.tensors, self._pickles = index.files, index.tensors, index.pickles
        self.attention = self._locate_attention()

    # -- attention tensors --------------------------------------------------------------
    def _locate_attention(self) -> AttentionLayout:
        if not self.spec.encoder_decoder:
            return AttentionLayout(self._locate(self.spec, list(self.layer_shapes)))
        layers: list[dict[str, str]] = []
        for kind in self.spec.attentions:  # kind by kind, as the blocks are ordered
            layers += self._locate(self.spec.for_kind(kind), [b.shape for b in self.facts.blocks if b.kind == kind.name])
        return AttentionLayout(layers)

    def _locate(self, spec: ArchitectureSpec, shapes: list[HeadShape]) -> list[dict[str, str]]:
        """Each layer's attention tensors under `spec`'s layer prefix, shapes checked against `shapes`."""
        hidden = self.config[spec.config.hidden]
        sizes = [expected_shapes(spec, shape, hidden) for shape in shapes]
        expected = {s: {i for i, layer in enumerate(sizes) if s in layer} for layer in sizes for s in layer}  # per-head norms: per layer
        found: dict[str, dict[int, str]] = defaultdict(dict)
        prefixes: set[str] = set()
        for suffix in expected:
            pattern = spec.tensor_pattern(suffix)
            for name in self.tensors:
                if m := pattern.match(name):
                    prefixes.add(m.group(1))
                    found[suffix][int(m.group(2))] = name
        if len(prefixes) > 1:
            raise BadInput(f"attention tensors under several prefixes ({', '.join(sorted(prefixes))}); only single-model checkpoints are supported")
        layers: list[dict[str, str]] = [{} for _ in range(len(shapes))]
        for suffix, by_layer in found.items():
            if set(by_layer) != expected[suffix]:
                raise BadInput(
                    f"tensor '*{suffix}' found for layers {sorted(by_layer)}, expected {_ranges(expected[suffix])}; weights and config.json disagree"
                )
            for i, name in by_layer.items():
                self._check_attention_tensor(name, sizes[i][suffix], shapes[i])
                layers[i][suffix] = name
        required = self._required_suffixes()
        if missing := [s for s in required if s not in found]:
            raise BadInput(f"no '{missing[0]}' tensors for {spec.family}; is this a {spec.family} checkpoint?")
        for role in spec.head_norms or {}:  # optional (StableLM's qk_layernorm), but then one per head
            norms = spec.head_norm_suffixes(role, self.shape.heads if role == "q" else self.shape.kv_heads)
            if any(n in found for n in norms) and (absent := [n for n in norms if n not in found]):
                raise BadInput(f"no '{absent[0]}' tensors although other heads have their norm; the checkpoint is incomplete")
        return layers

    def _required_suffixes(self) -> list[str]:
        weights = [p.weight for p in self.spec.projections.values()]
        return weights + ([self.spec.fused_qkv.weight] if self.spec.fused_qkv else [])

    def _check_attention_tensor(self, name: str, expected: tuple[int, ...], s: HeadShape) -> None:
        """An attention tensor's full shape and dtype against the spec and config.json."""
        info = self.tensors[name]
        dtype = f"torch.{SAFETENSORS_DTYPES[info.code].torch}"  # the name users know
        if info.code in FP8_CODES:
            raise BadInput(f"tensor {name} is {dtype} (quantized): {DEQUANTIZE}")
        if info.code not in FLOAT_CODES:
            raise BadInput(f"tensor {name} has dtype {dtype}; attention weights must be floating point (if the checkpoint is quantized: {DEQUANTIZE})")
        if info.shape != expected:
            raise BadInput(
                f"tensor {name} has shape {list(info.shape)}, expected {list(expected)} for {head_terms(self.config, self.spec.config, s)}; "
                "weights and config.json disagree"
            )

    # -- reading ------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (see read_tensor)."""
        info = self.tensors[name]
        if info.file in self._pickles:
            return self._pickles[info.file][name]
        return read_tensor(info)

    def byte_range(self, name: str) -> FileRange | None:
        """Where a tensor's bytes sit in a safetensors file (None for pickles)."""
        info = self.tensors[name]
        return None if info.file in self._pickles else FileRange(info.file, info.offset, info.nbytes)

    def close(self) -> None:
        self._pickles.clear()

    def __enter__(self) -> SourceCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
