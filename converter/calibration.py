"""Calibration: each layer's attention input on real text, for the data-aware methods.

The source model runs once (whole, in fp32 — the one step that is not streamed); forward
hooks on every layer's Q (or fused QKV) projection keep its input, which is also the input of
K and V. Methods then derive any head's activations as X W_jᵀ + b_j without running it again.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tqdm.auto import tqdm

from headfold import corpus
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.errors import BadInput

WINDOW = 256  # tokens per calibration window


def token_ids(folder: Path, text: str, vocab_size: int) -> list[int]:
    """The checkpoint's own tokenizer when it has one; bytes for byte-level models like ours."""
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        import transformers

        return transformers.AutoTokenizer.from_pretrained(folder).encode(text, add_special_tokens=False, verbose=False)  # windows come later
    if vocab_size == corpus.VOCAB_SIZE:
        return corpus.encode(text)
    raise BadInput(f"{folder} has no tokenizer files and is not byte-level; add its tokenizer to calibrate")


def sample_windows(ids: list[int], tokens: int, seed: int, window: int = WINDOW) -> torch.Tensor:
    """`tokens // window` windows at seeded random offsets: [count, window]."""
    if len(ids) < window:
        raise BadInput(f"calibration text has {len(ids)} tokens, fewer than one window of {window}; give a longer text")
    return torch.tensor([ids[s : s + window] for s in window_starts(len(ids), tokens, seed, window)])


def window_starts(length: int, tokens: int, seed: int, window: int = WINDOW) -> list[int]:
    """Where `sample_windows` cuts its windows (for picking other, held-out windows)."""
    rng = random.Random(seed)
    return sorted(rng.randrange(length - window + 1) for _ in range(max(1, tokens // window)))


def _projection_suffixes(ckpt: SourceCheckpoint) -> list[str]:
    spec = ckpt.spec
    proj = spec.fused_qkv or spec.projections["q"]
    return [spec.layer_prefix.format(layer=i) + proj.weight.removesuffix(".weight") for i in range(ckpt.layers)]


@torch.no_grad()
def attention_inputs(ckpt: SourceCheckpoint, text: str, tokens: int, seed: int, progress: bool = True) -> list[torch.Tensor]:
    """Per layer [tokens, hidden]: what the attention projections of the source model read."""
    from headfold.graphs.modeling import load_model  # torch model building lives in graphs/

    model = load_model(ckpt.folder, dtype=torch.float32)
    batch = sample_windows(token_ids(ckpt.folder, text, model.config.vocab_size), tokens, seed)
    return capture_inputs(ckpt, model, batch, progress)


@torch.no_grad()
def capture_inputs(ckpt: SourceCheckpoint, model: torch.nn.Module, batch: torch.Tensor, progress: bool = True) -> list[torch.Tensor]:
    """Per layer [tokens, hidden]: the attention input of the loaded `model` on `batch` windows."""
    modules = dict(model.named_modules())
    captured: list[list[torch.Tensor]] = [[] for _ in range(ckpt.layers)]
    handles = []
    for i, suffix in enumerate(_projection_suffixes(ckpt)):
        name = next((n for n in modules if n == suffix or n.endswith("." + suffix)), None)
        if name is None:
            raise BadInput(f"cannot find module {suffix} in {type(model).__name__} to calibrate")
        handles.append(modules[name].register_forward_hook(lambda m, args, out, i=i: captured[i].append(args[0].reshape(-1, args[0].shape[-1]))))
    try:
        for rows in tqdm(batch.split(8), desc="calibrate", unit="batch", disable=not progress):
            model(input_ids=rows)
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(c) for c in captured]
