"""Calibration: each layer's attention input on real text, for the data-aware methods.

Windows of the calibration text run through the source model one layer at a time (layerwise.py:
peak memory is one layer plus the activations, never the model); a hook on every layer's Q (or
fused QKV) projection keeps its input, which is also the input of K and V. Methods then derive
any head's activations as X W_jᵀ + b_j without running the model again.

Encoder-decoders (`seq2seq_inputs`) run whole, once, in fp32: each window's first half is the source
and the rest the target, read teacher-forced; a hook on every attention's K projection keeps its input
(the encoder output for cross-attention). Whisper runs on SYNTHESIZED_AUDIO instead of text.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from headfold.converter import layerwise
from headfold.converter.checkpoint import CheckpointFacts, SourceCheckpoint
from headfold.converter.methods import compute_device
from headfold.converter.modeling import load_model, parameter_names
from headfold.converter.seq2seq import SynthesizedAudio
from headfold.converter.tokens import load_tokenizer
from headfold.ground.errors import BadInput

WINDOW = 256  # tokens per calibration window


def token_ids(folder: Path, text: str, vocab_size: int | None) -> list[int]:
    """The checkpoint's own tokenizer (never its code) when it has one; bytes for byte-level models like ours."""
    return load_tokenizer(folder, vocab_size, "add its tokenizer files to calibrate, or pass --calibration weights").encode(text)


def sample_windows(ids: list[int], tokens: int, seed: int, window: int = WINDOW) -> torch.Tensor:
    """`tokens // window` windows at seeded random offsets: [count, window]."""
    if len(ids) < window:
        raise BadInput(f"calibration text has {len(ids)} tokens, fewer than one window of {window}; give a longer text")
    return torch.tensor([ids[s : s + window] for s in window_starts(len(ids), tokens, seed, window)])


def window_starts(length: int, tokens: int, seed: int, window: int = WINDOW) -> list[int]:
    """Where `sample_windows` cuts its windows (for picking other, held-out windows)."""
    rng = random.Random(seed)
    return sorted(rng.randrange(length - window + 1) for _ in range(max(1, tokens // window)))


def attention_inputs(ckpt: SourceCheckpoint, text: str | SynthesizedAudio, tokens: int, seed: int, progress: bool = True) -> list[torch.Tensor]:
    """Per layer [tokens, hidden]: what the attention projections of the source model read."""
    if ckpt.spec.encoder_decoder:
        return seq2seq_inputs(ckpt, text, tokens, seed, progress)
    assert isinstance(text, str)  # audio calibrates an encoder-decoder (Whisper) only
    return calibrate(ckpt, text_windows(ckpt, text, tokens, seed), progress)


def text_windows(ckpt: SourceCheckpoint, text: str, tokens: int, seed: int) -> torch.Tensor:
    """The calibration windows [count, WINDOW] of token ids that a decoder or encoder runs on."""
    ckpt.facts.require_positions(WINDOW, f"calibration (windows of {WINDOW} tokens)", "pass --calibration weights, which reads no text", table_only=True)
    return sample_windows(token_ids(ckpt.folder, text, ckpt.facts.vocab_size), tokens, seed)


def check_settings() -> None:
    """$HEADFOLD_DEVICE and $HEADFOLD_CALIBRATION_RAM: BadInput before any slow work."""
    compute_device()
    layerwise.ram_limit()


def calibrate(ckpt: SourceCheckpoint, batch: torch.Tensor, progress: bool = True) -> list[torch.Tensor]:
    """Per layer [tokens, hidden]: the attention inputs on `batch` ([windows, T] token ids), layer by
    layer on the methods' compute device ($HEADFOLD_DEVICE, else the first GPU, else the CPU)."""
    return layerwise.attention_inputs(ckpt, batch, compute_device(), progress)


@torch.no_grad()
def seq2seq_inputs(ckpt: SourceCheckpoint, text: str | SynthesizedAudio, tokens: int, seed: int, progress: bool = True) -> list[torch.Tensor]:
    """Per attention block [tokens, hidden]: the input of its K/V projections (module doc); the model runs on the
    compute device, the inputs are kept on the CPU as the decoders' are."""
    return [run.inputs for run in _seq2seq_runs(ckpt, text, tokens, seed, progress, blocks=False)]


def local_runs(
    ckpt: SourceCheckpoint, text: str | SynthesizedAudio, tokens: int, seed: int, sequential: bool, progress: bool = True
) -> Iterator[layerwise.LayerRun]:
    """What `local` fits on: each attention block with what it read and returned on the calibration text (or
    Whisper's synthesized audio). A decoder or encoder runs layer by layer (layerwise.layer_runs: `sequential`
    or teacher-forced); an encoder-decoder whole, once, teacher-forced. Each run holds one call per window (an
    audio model's: per synthesized clip), the unit local splits into fit and validation."""
    if ckpt.spec.encoder_decoder:
        return _seq2seq_runs(ckpt, text, tokens, seed, progress, blocks=True)
    assert isinstance(text, str)  # audio calibrates an encoder-decoder (Whisper) only
    return layerwise.layer_runs(ckpt, text_windows(ckpt, text, tokens, seed), compute_device(), sequential, progress, chunk=1)


@torch.no_grad()
def _seq2seq_runs(ckpt: SourceCheckpoint, text: str | SynthesizedAudio, tokens: int, seed: int, progress: bool, blocks: bool) -> Iterator[layerwise.LayerRun]:
    """Every attention block after one pass of the whole model: its K/V projections' input (on the CPU) and, with
    `blocks`, the block's arguments and output (on the compute device, as the model)."""
    device = compute_device()
    model = load_model(ckpt.facts, dtype=torch.float32)
    torch.nn.Module.to(model, device)  # transformers' own `to` (a wraps() of this one) is typed unbound
    names = parameter_names(model, ckpt.facts)
    key = ckpt.spec.projections["k"].weight
    paths = [names[layer[key]][: -len(key) - 1] for layer in ckpt.attention.layers]  # each attention block's module
    modules = [model.get_submodule(path) for path in paths]
    inputs: list[list[torch.Tensor]] = [[] for _ in paths]
    calls: list[list] = [[] for _ in paths]
    outputs: list[list[torch.Tensor]] = [[] for _ in paths]
    per_feed = 1 if blocks else 4  # local splits a block's calls: one window each
    if ckpt.facts.audio_input:
        feeds = audio_feeds(ckpt.facts, model, tokens, seed, per_feed)  # before the hooks: Whisper's generates
    else:
        assert isinstance(text, str)  # audio calibrates an audio model only
        feeds = text_feeds(ckpt, model, text, tokens, seed, per_feed)
    hooks = []
    for i, block in enumerate(modules):
        hooks.append(block.get_submodule(key.removesuffix(".weight")).register_forward_pre_hook(_keep_input(inputs[i])))
        if blocks:
            hooks += layerwise.record_block(block, calls[i], outputs[i], stop=False)
    try:
        for feed in tqdm(feeds, desc="calibrate", unit="batch", disable=not progress):
            model(**{name: t.to(device) for name, t in feed.items()}, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    for i, (block, path) in enumerate(zip(modules, paths, strict=True)):
        block_names = {source: names[source][len(path) + 1 :] for source in ckpt.attention.layers[i].values()}
        yield layerwise.LayerRun(i, torch.cat(inputs[i]), block, block_names, calls[i], outputs[i])


def _keep_input(kept: list[torch.Tensor]):
    return lambda module, args: kept.append(args[0].detach().flatten(0, -2).float().cpu())


def text_feeds(
    ckpt: SourceCheckpoint, model: transformers.PreTrainedModel, text: str, tokens: int, seed: int, per_feed: int = 4
) -> list[dict[str, torch.Tensor]]:
    """Windows of the calibration text, `per_feed` a feed, each split into source → target (teacher-forced after the decoder's start token)."""
    half = min(WINDOW // 2, ckpt.facts.position_limit or WINDOW)  # source and target each within the position table
    batch = sample_windows(token_ids(ckpt.folder, text, ckpt.facts.vocab_size), tokens, seed, 2 * half)
    start = torch.full_like(batch[:, :1], model.config.decoder_start_token_id)
    return [
        {"input_ids": rows[:, :half], "decoder_input_ids": torch.cat([s, rows[:, half:-1]], 1)}
        for rows, s in zip(batch.split(per_feed), start.split(per_feed), strict=True)
    ]


def audio_feeds(facts: CheckpointFacts, model: transformers.PreTrainedModel, tokens: int, seed: int, per_feed: int = 4) -> list[dict[str, torch.Tensor]]:
    """SYNTHESIZED_AUDIO: seeded features of the encoder's full frame count (the feature extractor's
    normalised log-mel range is about [-1, 1]), and the model's own greedy transcript of each."""
    assert isinstance(model, transformers.GenerationMixin)  # Whisper: it transcribes
    config = model.config
    frames, target = facts.audio_frames, min(WINDOW // 2, config.max_target_positions - 1)
    count = max(1, tokens // (frames // 2 + target))  # the encoder's positions (half the frames) and the target's
    features = torch.randn(count, facts.mel_bins, frames, generator=torch.Generator().manual_seed(seed)) * 0.5
    feeds = []
    for part in features.split(per_feed):
        part = part.to(model.device)
        transcript = model.generate(input_features=part, max_new_tokens=target, min_new_tokens=target, do_sample=False)  # without the start token
        start = torch.full_like(transcript[:, :1], config.decoder_start_token_id)
        feeds.append({"input_features": part, "decoder_input_ids": torch.cat([start, transcript[:, :-1]], 1)})
    return feeds
