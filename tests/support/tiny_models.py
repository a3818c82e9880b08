"""Tiny random-weight models for every supported family (a factory, not a test module).

All configs share 2 layers and 8 attention heads so that kv-heads 8/4/2/1 are all valid.
Weights are seeded and every parameter is non-trivial: HF init zeroes biases and sets
norms to 1, which would let bugs in bias/norm handling pass unnoticed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

BYTES = dict(vocab_size=256)  # byte-level: the corpus text needs no tokenizer files

FAMILIES: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gpt2",
    "gpt_neox",
    "opt",
    "bert",
    "roberta",
    "phi",
    "gemma",
    "olmo",
    "stablelm",
    "gptj",
    "bloom",
)
ENCODERS: frozenset[str] = frozenset({"bert", "roberta"})
# Encoder-decoders (kept out of FAMILIES: their inputs, outputs and attention kinds differ).
SEQ2SEQ: tuple[str, ...] = ("t5", "bart", "whisper")
# One conversion per later-added family (kv across h/2, h/4, 1), exported as a merged graph once per
# session (fixture tiny_export) and shared by the export and onnxruntime-genai tests.
MERGED_CASES: tuple[tuple[str, int], ...] = (("phi", 2), ("gemma", 4), ("olmo", 1), ("stablelm", 2), ("gptj", 2), ("bloom", 2))
# Every decoder family (gpt2 at kv 1 is written as gpt_bigcode), exported as the default merged folder
# once per session (fixture tiny_export, graphs="merged") and shared by the export, verify and
# onnxruntime-genai tests.
DECODER_CASES: tuple[tuple[str, int], ...] = (
    ("llama", 2), ("gpt2", 1), ("gpt2", 2), ("mistral", 4), ("qwen2", 1), ("qwen3", 2), ("phi3", 2), ("gpt_neox", 2), ("opt", 2), *MERGED_CASES,
)  # fmt: skip

VOCAB = 160
HEADS = 8
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}

# Per-family config kwargs: (config class, architecture, kwargs). Hidden 64 / 8 heads -> head_dim 8.
_LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=HEADS,
    max_position_embeddings=64,
    attention_dropout=0.0,
    **_IDS,
)
_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_LLAMA_LIKE)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_LLAMA_LIKE, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_LLAMA_LIKE)),
    # head_dim != hidden / heads covers the explicit-head_dim path; qwen3 has q_norm / k_norm.
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_LLAMA_LIKE, hidden_size=32, head_dim=8)),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(_LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0, original_max_position_embeddings=64),
    ),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            vocab_size=VOCAB,
            n_positions=64,
            n_embd=64,
            n_layer=2,
            n_head=HEADS,
            n_inner=96,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **_IDS,
        ),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            max_position_embeddings=64,
            rotary_pct=0.5,  # partial rotary: half of each head is rotated
            attention_dropout=0.0,
            hidden_dropout=0.0,
            **_IDS,
        ),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            word_embed_proj_dim=64,
            ffn_dim=96,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            **_IDS,
        ),
    ),
    "bert": (
        "BertConfig",
        "BertModel",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **_IDS,
        ),
    ),
    "roberta": (
        "RobertaConfig",
        "RobertaModel",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            max_position_embeddings=66,  # roberta offsets positions by padding_idx + 1
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
    ),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_LLAMA_LIKE, resid_pdrop=0.0, embd_pdrop=0.0, partial_rotary_factor=0.5)),
    # head_dim 8 with hidden 32: 8 heads of 8 dims are twice the model width, like Gemma-7B's 16 × 256 > 3072
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_LLAMA_LIKE, hidden_size=32, head_dim=8)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(_LLAMA_LIKE)),
    # partial rotary, q/k biases and one LayerNorm per head on Q and K (qk_layernorm, StableLM-2-12B's)
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(_LLAMA_LIKE, partial_rotary_factor=0.5, use_qkv_bias=True, qk_layernorm=True, hidden_dropout=0.0),
    ),
    # GPT-J's RoPE is a sinusoid table of n_positions rows: room for calibration's 256-token windows
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=HEADS, n_inner=96, rotary_dim=4, **_NO_DROPOUT, **_IDS),
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0, **_IDS),
    ),
    # d_kv 8 with d_model 32: T5's head dims need not be d_model / heads
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=HEADS,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=0,
        ),
    ),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        dict(
            vocab_size=VOCAB,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS,
            encoder_ffn_dim=96,
            decoder_ffn_dim=96,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            decoder_start_token_id=2,
            forced_eos_token_id=None,
            **_IDS,
        ),
    ),
    # 8 mel bins and 32 frames (16 positions after the stride-2 convolution): input_features [B, 8, 32]
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        dict(
            vocab_size=VOCAB,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS,
            encoder_ffn_dim=96,
            decoder_ffn_dim=96,
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=32,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            decoder_start_token_id=1,
            suppress_tokens=None,
            begin_suppress_tokens=None,
            **_IDS,
        ),
    ),
}


def tiny_config(model_type: str, **overrides: Any) -> transformers.PretrainedConfig:
    """A 2-layer, 8-head config of `model_type` with its LM-head (decoders) or base (encoders) class."""
    config_cls, architecture, kwargs = _SPECS[model_type]
    config = getattr(transformers, config_cls)(**{**kwargs, **overrides})
    config.architectures = [architecture]
    return config


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: weights N(0, 0.1), biases N(0, 0.1), norm scales 1 + N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters are listed once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.1
            is_scale = param.ndim == 1 and not name.endswith("bias")
            param.copy_(noise + 1.0 if is_scale else noise)


def make_checkpoint(
    model_type: str,
    path: Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a seeded random tiny checkpoint (config.json + safetensors) to `path`; return `path`."""
    config = tiny_config(model_type, **config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config)
    _randomize(model, seed)
    model.to(dtype)
    path = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)  # transformers 5 always writes safetensors
    return path


def sample_batch(config: transformers.PretrainedConfig, batch: int = 2, seq: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids + attention_mask; the last row is padded (left for decoders, right for encoders)."""
    gen = torch.Generator().manual_seed(seed)
    first_free = 3  # keep clear of pad/bos/eos
    input_ids = torch.randint(first_free, config.vocab_size, (batch, seq), generator=gen)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    n_pad = min(2, seq - 1)
    pad_slice = slice(seq - n_pad, seq) if config.model_type in ENCODERS else slice(0, n_pad)
    attention_mask[-1, pad_slice] = 0
    input_ids[-1, pad_slice] = config.pad_token_id if config.pad_token_id is not None else 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def seq2seq_batch(config: transformers.PretrainedConfig, batch: int = 2, source: int = 7, target: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    """An encoder-decoder's inputs: source ids with a padded last row (Whisper: log-mel-shaped features
    of its full frame count) and teacher-forced decoder ids."""
    gen = torch.Generator().manual_seed(seed)
    decoder_input_ids = torch.randint(3, config.vocab_size, (batch, target), generator=gen)
    if config.model_type == "whisper":
        frames = 2 * config.max_source_positions
        return {"input_features": torch.randn(batch, config.num_mel_bins, frames, generator=gen), "decoder_input_ids": decoder_input_ids}
    encoded = sample_batch(config, batch, source, seed)
    encoded["attention_mask"][-1, :] = 1
    encoded["attention_mask"][-1, -2:] = 0  # right padding on the source
    encoded["input_ids"][-1, -2:] = config.pad_token_id
    return {**encoded, "decoder_input_ids": decoder_input_ids}
