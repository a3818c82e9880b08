"""Verify encoder-decoders (T5, BART, Whisper) on (source, target) pairs, decoder logits teacher-forced.

Feeds: each row of the text (verification.inputs) is split in two, its first half the source and
its second the target; the decoder reads the start token then the target, so its logits at
position t predict target token t + 1 and the meters (perplexity of the target, KL, top-1; or
fidelity's errors) read `decoder_input_ids` / `decoder_attention_mask` as a decoder's
`input_ids` / `attention_mask` (`target_view`). Whisper's source is SYNTHESIZED_AUDIO (seeded
features of its full frame count) and the whole row its target: its encoder reads no text.

Runners: the torch side is TorchRunner (the model takes the feed as it is); an export folder runs
in `Seq2SeqOnnxRunner`: encoder.onnx once per batch, then decoder.onnx on the target with an empty
self-attention past, except its last `decode_steps` tokens, fed one at a time with the past: the
fidelity check covers the cache path too.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata
from polygraphy.datatype import DataType

from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.seq2seq import SYNTHESIZED_AUDIO
from headfold.graphs.seq2seq import AUDIO_INPUT, ENCODER_MASK
from headfold.ground.cache_names import PAST, PRESENT, SELF_HALF, CacheName, is_cache
from headfold.ground.errors import BadInput
from headfold.verification.sessions import ORT_FLOATS, SessionFromGraph, ort

DECODER_IDS, DECODER_MASK = "decoder_input_ids", "decoder_attention_mask"
_AUDIO_SCALE = 0.5  # as calibration synthesizes them: the feature extractor's normalised log-mel range is about [-1, 1]


def target_view(feed: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
    """What the meters read: an encoder-decoder's logits are over its target, a decoder's over its input."""
    if DECODER_IDS not in feed:
        return feed
    return {"input_ids": feed[DECODER_IDS], "attention_mask": feed[DECODER_MASK]}


def _right_padded(rows: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(r) for r in rows)
    ids, mask = np.full((len(rows), width), pad_id, dtype=np.int64), np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return ids, mask


def pair_feeds(facts: CheckpointFacts, rows: list[np.ndarray], batch_size: int, seed: int) -> tuple[list[dict[str, np.ndarray]], dict[str, Any]]:
    """Right-padded (source, target) batches from `rows`, and what the report records of them."""
    config = facts.config
    pad, start = config.get("pad_token_id") or 0, config.get("decoder_start_token_id") or 0
    limit = config.get("max_target_positions")  # Whisper's decoder positions (BART's are facts.position_limit)
    rng = np.random.default_rng(seed)
    feeds = []
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        if facts.audio_input:
            source = {AUDIO_INPUT: (rng.standard_normal((len(batch), facts.mel_bins, facts.audio_frames)) * _AUDIO_SCALE).astype(np.float32)}
            targets = batch
        else:
            halves = [len(r) // 2 for r in batch]
            ids, mask = _right_padded([r[:h] for r, h in zip(batch, halves, strict=True)], pad)
            source, targets = {"input_ids": ids, "attention_mask": mask}, [r[h:] for r, h in zip(batch, halves, strict=True)]
        decoder = [np.concatenate([[start], t])[: limit or None] for t in targets]
        ids, mask = _right_padded(decoder, pad)
        feeds.append({**source, DECODER_IDS: ids, DECODER_MASK: mask})
    pairs = f"{SYNTHESIZED_AUDIO} → each row as the target" if facts.audio_input else "each row's first half → its second half"
    return feeds, {"pairs": pairs, "target_tokens": int(sum(f[DECODER_MASK].sum() - len(f[DECODER_MASK]) for f in feeds))}


def token_metadata(facts: CheckpointFacts) -> TensorMetadata:
    """The feed's names, dtypes and shapes: source then target."""
    meta = TensorMetadata()
    if facts.audio_input:
        meta.add(AUDIO_INPUT, DataType.FLOAT32, ("batch", facts.mel_bins, "frames"))
    else:
        for name in ("input_ids", "attention_mask"):
            meta.add(name, DataType.INT64, ("batch", "source"))
    return _with_target(meta)


def _with_target(meta: TensorMetadata) -> TensorMetadata:
    for name in (DECODER_IDS, DECODER_MASK):
        meta.add(name, DataType.INT64, ("batch", "target"))
    return meta


class Seq2SeqOnnxRunner(BaseRunner):
    """An encoder-decoder export folder (encoder.onnx + decoder.onnx) in ONNX Runtime → logits over the target."""

    def __init__(self, encoder: Path, decoder: Path, decode_steps: int = 0) -> None:
        self.graphs, self.decode_steps = (Path(encoder), Path(decoder)), decode_steps
        super().__init__(name=f"onnxruntime:{self.graphs[0].parent.name}/{self.graphs[1].name}")
        self.sessions: tuple[Any, Any] | None = None

    def activate_impl(self) -> None:
        self.sessions = tuple(SessionFromGraph(graph)() for graph in self.graphs)

    def deactivate_impl(self) -> None:
        self.sessions = None

    def get_input_metadata_impl(self) -> TensorMetadata:
        assert self.sessions is not None  # opened by activate_impl: Polygraphy asks only while active
        meta = TensorMetadata()
        for i in self.sessions[0].get_inputs():
            meta.add(i.name, DataType.FLOAT32 if i.type in ORT_FLOATS else DataType.INT64, tuple(i.shape))  # features are fed in fp32
        return _with_target(meta)

    def infer_impl(self, feed_dict: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.sessions is not None  # opened by activate_impl: Polygraphy infers only while active
        encoder, decoder = self.sessions
        start = time.perf_counter()
        source = {i.name: feed_dict[i.name].astype(ORT_FLOATS.get(i.type, feed_dict[i.name].dtype)) for i in encoder.get_inputs()}
        outputs = dict(zip([o.name for o in encoder.get_outputs()], encoder.run(None, source), strict=True))
        cross = {_as_past(name): value for name, value in outputs.items() if is_cache(name, PRESENT)}
        mask = {ENCODER_MASK: source["attention_mask"]} if "attention_mask" in source else {}
        target = feed_dict[DECODER_IDS]
        past = {i.name: np.zeros((len(target), i.shape[1], 0, i.shape[3]), ORT_FLOATS[i.type]) for i in decoder.get_inputs() if _is_self_past(i.name)}
        names, logits = [o.name for o in decoder.get_outputs()], []
        for chunk in _chunks(target.shape[1], self.decode_steps):
            out = dict(zip(names, decoder.run(None, {"input_ids": target[:, chunk], **mask, **past, **cross}), strict=True))
            logits.append(out.pop("logits"))
            past = {_as_past(name): value for name, value in out.items()}
        self.inference_time = time.perf_counter() - start
        return {"logits": np.concatenate(logits, axis=1)}

    def describe(self) -> dict[str, str]:
        providers = self.sessions[1].get_providers() if self.sessions else []
        return {"runner": self.name, "backend": f"onnxruntime {ort.__version__}", "providers": ",".join(providers), "decode_steps": str(self.decode_steps)}


def _as_past(name: str) -> str:
    cache = CacheName.parse(name)
    if cache is None:  # a decoder output neither logits nor a present K/V
        raise BadInput(f"{name} is not a K/V cache output; verify an export written by headfold export")
    return str(cache.as_past())


def _is_self_past(name: str) -> bool:
    return is_cache(name, PAST, SELF_HALF)


def _chunks(length: int, steps: int) -> list[slice]:
    """The target's first tokens at once (at least one), then its last `steps` one at a time."""
    first = max(1, length - steps)
    return [slice(0, first), *(slice(t, t + 1) for t in range(first, length))]


def check_same_kind(reference: CheckpointFacts, candidate: CheckpointFacts, paths: tuple[Path, Path]) -> None:
    """BadInput when one side is an encoder-decoder and the other is not: no check compares them."""
    kinds = [_KIND_NAMES.get(f.kind, f.kind) for f in (reference, candidate)]
    if "an encoder-decoder" in kinds and kinds[0] != kinds[1]:
        raise BadInput(f"{paths[0]} holds {kinds[0]} but {paths[1]} holds {kinds[1]}; verify compares a model with its own export or conversion")


_KIND_NAMES = {"seq2seq": "an encoder-decoder", "decoder": "a decoder", "encoder": "an encoder"}
