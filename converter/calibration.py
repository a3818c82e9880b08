"""Calibration: each layer's attention input on real text, for the data-aware methods.

Windows of the calibration text run through the source model one layer at a time (layerwise.py:
peak memory is one layer plus the activations, never the model); a hook on every layer's Q (or
fused QKV) projection keeps its input, which is also the input of K and V. Methods then derive
any head's activations as X W_jᵀ + b_j without running the model again.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from headfold.converter import layerwise
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.methods import compute_device
from headfold.converter.tokens import load_tokenizer
from headfold.ground.errors import BadInput

WINDOW = 256  # tokens per calibration window


def token_ids(folder: Path, text: str, vocab_size: int) -> list[int]:
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


def attention_inputs(ckpt: SourceCheckpoint, text: str, tokens: int, seed: int, progress: bool = True) -> list[torch.Tensor]:
    """Per layer [tokens, hidden]: what the attention projections of the source model read."""
    batch = sample_windows(token_ids(ckpt.folder, text, ckpt.facts.vocab_size), tokens, seed)
    return calibrate(ckpt, batch, progress)


def check_settings() -> None:
    """$HEADFOLD_DEVICE and $HEADFOLD_CALIBRATION_RAM: BadInput before any slow work."""
    compute_device()
    layerwise.ram_limit()


def calibrate(ckpt: SourceCheckpoint, batch: torch.Tensor, progress: bool = True) -> list[torch.Tensor]:
    """Per layer [tokens, hidden]: the attention inputs on `batch` ([windows, T] token ids), layer by
    layer on the methods' compute device ($HEADFOLD_DEVICE, else the first GPU, else the CPU)."""
    return layerwise.attention_inputs(ckpt, batch, compute_device(), progress)
