"""A merged decoder export as an onnxruntime-genai model folder: genai_config.json + tokenizer files.

onnxruntime-genai runs one decoder graph that takes past K/V (empty at the prompt) and any number
of new tokens, which is what graphs.export's merged model.onnx is; the config names its inputs and
outputs, head counts and token ids. Per-layer kv heads need no entry: the runtime reads each
layer's count from the graph's past shapes. `past_present_share_buffer` (K/V written in place into
one max-length buffer) needs every layer's present to come from GroupQueryAttention, so it is on
for --attention ort-gqa graphs only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import transformers

from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.seq2seq import DECODER_CROSS, DECODER_SELF, ENCODER_SELF
from headfold.graphs.seq2seq import AUDIO_INPUT, ENCODER_OUTPUT
from headfold.ground.artifacts import DECODER_GRAPH, ENCODER_GRAPH, GENAI_CONFIG
from headfold.ground.cache_names import CROSS_HALF, PAST, PRESENT, SELF_HALF, name_template
from headfold.ground.inputs import read_json_object

__all__ = ["TOKENIZER_FILES", "copy_tokenizer", "genai_config", "write_model_folder", "whisper_genai_config", "seq2seq_genai_blocker", "GENAI_WHISPER_FRAMES"]

# What Hugging Face tokenizers read, and what og.Tokenizer reads (tokenizer.json + tokenizer_config.json).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
)
# Greedy by default, like transformers' generate without a generation config.
_SEARCH = {
    "do_sample": False,
    "num_beams": 1,
    "num_return_sequences": 1,
    "min_length": 0,
    "top_k": 1,
    "top_p": 1.0,
    "temperature": 1.0,
    "repetition_penalty": 1.0,
    "length_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "diversity_penalty": 0.0,
    "early_stopping": True,
}


# og needs a context length (its default max_length and the size of shared K/V buffers). A model
# without a position limit (ALiBi: BLOOM) gets its tokenizer's model_max_length, else this.
UNLIMITED_CONTEXT = 2048


def _context_length(facts: CheckpointFacts) -> int:
    if facts.positions:
        return facts.positions
    try:
        stated = json.loads((facts.folder / "tokenizer_config.json").read_text()).get("model_max_length")
    except (OSError, ValueError, AttributeError):  # none, or not a JSON object: the default
        stated = None
    return stated if isinstance(stated, int) and 0 < stated < 1 << 24 else UNLIMITED_CONTEXT


def _token_ids(src: Path, config: transformers.PretrainedConfig) -> dict[str, Any]:
    """bos/eos/pad ids: generation_config.json first (what generate uses), then config.json.

    A model without an EOS never stops early; without a pad id, padding uses the EOS id.
    """
    generation = {}
    if (src / "generation_config.json").is_file():
        generation = read_json_object(src / "generation_config.json", "restore it from the original checkpoint")
    ids = {key: generation.get(key, getattr(config, key, None)) for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    eos = ids["eos_token_id"]
    first_eos = eos[0] if isinstance(eos, list) and eos else eos
    ids["pad_token_id"] = ids["pad_token_id"] if ids["pad_token_id"] is not None else first_eos
    ids["bos_token_id"] = ids["bos_token_id"] if ids["bos_token_id"] is not None else first_eos
    return {key: (-1 if value is None else value) for key, value in ids.items()}  # -1: none


def genai_config(facts: CheckpointFacts, config: transformers.PretrainedConfig, graph: str, *, attention: str, position_ids: bool = False) -> dict[str, Any]:
    """The genai_config.json of a merged decoder graph exported from the checkpoint `facts` describes;
    the position_ids input is named only when the graph has one (og then feeds its positions)."""
    length = _context_length(facts)
    decoder = {
        "filename": graph,
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "head_size": facts.head_dim,
        "hidden_size": facts.hidden,
        "num_attention_heads": facts.heads,
        "num_hidden_layers": facts.layers,
        "num_key_value_heads": max(facts.kv_heads),  # the largest; each layer's count is in the graph
        "inputs": {
            "input_ids": "input_ids",
            "attention_mask": "attention_mask",
            **({"position_ids": "position_ids"} if position_ids else {}),
            "past_key_names": name_template(PAST, "key"),
            "past_value_names": name_template(PAST, "value"),
        },
        "outputs": {"logits": "logits", "present_key_names": name_template(PRESENT, "key"), "present_value_names": name_template(PRESENT, "value")},
    }
    model = {"type": "decoder", "vocab_size": facts.vocab_size, "context_length": length, **_token_ids(facts.folder, config), "decoder": decoder}
    search = {**_SEARCH, "max_length": length, "past_present_share_buffer": attention == "ort-gqa"}
    return {"model": model, "search": search}


# onnxruntime-genai's Whisper takes 30 s of log-mel features only ("Whisper uses num_frames = 3000").
GENAI_WHISPER_FRAMES = 3000


def _counts(facts: CheckpointFacts, kind: str) -> set[int]:
    return {b.shape.kv_heads for b in facts.blocks if b.kind == kind}


def seq2seq_genai_blocker(facts: CheckpointFacts) -> str | None:
    """Why onnxruntime-genai cannot run this encoder-decoder's export (for export.json); None when it
    can (a Whisper it takes as it is)."""
    if not facts.audio_input:
        return "onnxruntime-genai runs Whisper among headfold's encoder-decoders only"
    if facts.audio_frames != GENAI_WHISPER_FRAMES:
        return f"onnxruntime-genai takes {GENAI_WHISPER_FRAMES} log-mel frames only; this Whisper's encoder takes {facts.audio_frames}"
    if len(_counts(facts, DECODER_SELF)) > 1 or len(_counts(facts, DECODER_CROSS)) > 1:
        return "onnxruntime-genai sizes every decoder layer's cache alike; this conversion gives its layers different kv heads"
    return None


def whisper_genai_config(facts: CheckpointFacts, config: transformers.PretrainedConfig) -> dict[str, Any]:
    """genai_config.json of a Whisper export (graphs.seq2seq): encoder.onnx writes the cross K/V once,
    decoder.onnx reads them with its self-attention past.

    onnxruntime-genai sizes the cross-attention cache by the decoder's `num_attention_heads` and the
    self-attention cache by its `num_key_value_heads`: the former gets the cross-attention's kv heads
    (the query heads are in the graph)."""
    (self_kv,), (cross_kv,), (encoder_kv,) = (_counts(facts, kind) for kind in (DECODER_SELF, DECODER_CROSS, ENCODER_SELF))
    shape = {"head_size": facts.head_dim, "hidden_size": facts.hidden}
    encoder = {
        "filename": ENCODER_GRAPH, **shape, "num_attention_heads": config.encoder_attention_heads,
        "num_key_value_heads": encoder_kv, "num_hidden_layers": config.encoder_layers,
        "inputs": {"audio_features": AUDIO_INPUT},
        "outputs": {
            "encoder_hidden_states": ENCODER_OUTPUT,
            "cross_present_key_names": name_template(PRESENT, "key", CROSS_HALF),
            "cross_present_value_names": name_template(PRESENT, "value", CROSS_HALF),
        },
    }  # fmt: skip
    decoder = {
        "filename": DECODER_GRAPH, **shape, "num_attention_heads": cross_kv, "num_key_value_heads": self_kv,
        "num_hidden_layers": config.decoder_layers,
        "inputs": {
            "input_ids": "input_ids",
            "past_key_names": name_template(PAST, "key", SELF_HALF),
            "past_value_names": name_template(PAST, "value", SELF_HALF),
            "cross_past_key_names": name_template(PAST, "key", CROSS_HALF),
            "cross_past_value_names": name_template(PAST, "value", CROSS_HALF),
        },
        "outputs": {
            "logits": "logits",
            "present_key_names": name_template(PRESENT, "key", SELF_HALF),
            "present_value_names": name_template(PRESENT, "value", SELF_HALF),
        },
    }  # fmt: skip
    length = config.max_target_positions
    model = {
        "type": "whisper", "vocab_size": facts.vocab_size, "context_length": length, **_token_ids(facts.folder, config),
        "decoder_start_token_id": config.decoder_start_token_id, "encoder": encoder, "decoder": decoder,
    }  # fmt: skip
    return {"model": model, "search": {**_SEARCH, "max_length": length, "past_present_share_buffer": False}}


def write_model_folder(
    facts: CheckpointFacts, folder: Path, config: transformers.PretrainedConfig, graph: str, *, attention: str, position_ids: bool = False
) -> dict[str, Any]:
    """genai_config.json and the checkpoint's tokenizer files into `folder`; what was written."""
    if facts.kind == "seq2seq":
        genai = whisper_genai_config(facts, config)
    else:
        genai = genai_config(facts, config, graph, attention=attention, position_ids=position_ids)
    (folder / GENAI_CONFIG).write_text(json.dumps(genai, indent=2) + "\n")
    return {"config": GENAI_CONFIG, "tokenizer_files": copy_tokenizer(facts.folder, folder)}


def copy_tokenizer(src: Path, folder: Path) -> list[str]:
    """The checkpoint's tokenizer files into an export folder (decoders and encoders alike); their names."""
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copyfile(src / name, folder / name)
    return copied
