"""Train headfold's embedded default model: a small byte-level MHA Llama decoder.

Reproduce the shipped checkpoint (about 9 minutes on 2 idle CPU cores) from the repository root:

    PYTHONPATH=. python examples/train_default_model.py --out headfold/data/default_model

The data is the stdlib's ``pydoc_data.topics`` (see ``headfold.corpus``), so no network is
needed.  The run writes config.json + model.safetensors (fp32) via ``save_pretrained`` and a
training.json with the recipe, versions, timings and held-out metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from headfold import corpus


@dataclass(frozen=True)
class Recipe:
    """Every knob of the run; recorded verbatim in training.json."""

    seed: int = 0
    steps: int = 800  # ~8 epochs of the train split; longer runs mostly memorise it
    batch_size: int = 16
    seq_len: int = 256  # training window in bytes
    eval_window: int = 256  # held-out windows: non-overlapping, this many bytes each
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    hidden_size: int = 256  # head_dim 32 (even, as RoPE needs); fp32 weights stay under 10 MB
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    max_position_embeddings: int = 512
    threads: int = 2
    log_every: int = 50


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--steps", type=int, default=Recipe.steps)
    p.add_argument("--seed", type=int, default=Recipe.seed)
    return p.parse_args()


def make_deterministic(recipe: Recipe) -> None:
    """Same seed + same thread count gives the same weights on CPU."""
    random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    torch.use_deterministic_algorithms(True)


def build_model(recipe: Recipe) -> LlamaForCausalLM:
    """Multi-head attention (kv heads == heads): the input headfold folds into GQA/MQA."""
    config = LlamaConfig(
        vocab_size=corpus.VOCAB_SIZE,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_attention_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True,
        # Byte vocabulary: every id is a byte, there are no special tokens.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    config.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(config).to(torch.float32)


def make_optimizer(model: torch.nn.Module, recipe: Recipe) -> torch.optim.AdamW:
    """Decay matrices only; decaying RMSNorm gains just fights the normalisation."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": recipe.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas)


def lr_factor(step: int, recipe: Recipe) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio``."""
    if step < recipe.warmup_steps:
        return (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * cosine


def sample_batch(data: torch.Tensor, recipe: Recipe, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows; targets are the inputs shifted by one byte."""
    starts = torch.randint(0, len(data) - recipe.seq_len, (recipe.batch_size,), generator=gen)
    window = torch.stack([data[s : s + recipe.seq_len + 1] for s in starts.tolist()])
    return window[:, :-1], window[:, 1:]


def train(model: LlamaForCausalLM, data: torch.Tensor, recipe: Recipe) -> float:
    """Run the recipe; returns the mean training loss (nats/byte) of the last log interval."""
    optimizer = make_optimizer(model, recipe)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, recipe))
    gen = torch.Generator().manual_seed(recipe.seed)
    model.train()
    recent: list[float] = []
    start = time.perf_counter()
    for step in range(recipe.steps):
        inputs, targets = sample_batch(data, recipe, gen)
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        schedule.step()
        recent = (recent + [loss.item()])[-recipe.log_every :]
        if (step + 1) % recipe.log_every == 0 or step + 1 == recipe.steps:
            elapsed = time.perf_counter() - start
            eta = elapsed / (step + 1) * (recipe.steps - step - 1)
            print(
                f"step {step + 1:5d}/{recipe.steps}  loss {sum(recent) / len(recent):.4f}  "
                f"lr {schedule.get_last_lr()[0]:.2e}  {elapsed:6.0f}s elapsed  eta {eta:4.0f}s",
                flush=True,
            )
    return sum(recent) / len(recent)


@torch.no_grad()
def heldout_cross_entropy(model: LlamaForCausalLM, ids: list[int], window: int) -> float:
    """Nats per byte over non-overlapping windows; each byte after the first is predicted once."""
    model.eval()
    data = torch.tensor(ids)
    total, count = 0.0, 0
    for start in range(0, len(data) - 1, window):
        chunk = data[start : start + window + 1]
        logits = model(input_ids=chunk[None, :-1]).logits[0]
        total += F.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += len(chunk) - 1
    return total / count


def unigram_cross_entropy(train_ids: list[int], heldout_ids: list[int]) -> float:
    """Baseline: held-out nats/byte under add-one smoothed training byte frequencies."""
    counts = Counter(train_ids)
    denom = len(train_ids) + corpus.VOCAB_SIZE
    return -sum(math.log((counts[b] + 1) / denom) for b in heldout_ids) / len(heldout_ids)


def main() -> None:
    args = parse_args()
    recipe = Recipe(seed=args.seed, steps=args.steps)
    make_deterministic(recipe)
    train_ids, heldout_ids = corpus.encode(corpus.train_text()), corpus.encode(corpus.heldout_text())
    model = build_model(recipe)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params:,} parameters; {len(train_ids):,} train / {len(heldout_ids):,} held-out bytes")

    start = time.perf_counter()
    final_loss = train(model, torch.tensor(train_ids), recipe)
    train_seconds = time.perf_counter() - start
    ce = heldout_cross_entropy(model, heldout_ids, recipe.eval_window)
    unigram = unigram_cross_entropy(train_ids, heldout_ids)
    print(f"held-out {ce:.4f} nats/byte (ppl {math.exp(ce):.3f}); unigram ppl {math.exp(unigram):.3f}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    report = {
        "recipe": asdict(recipe),
        "parameters": n_params,
        "data": {
            "source": "pydoc_data.topics",
            "split": "held out: zlib.crc32(topic_key) % 10 == 0; topics joined in sorted-key order",
            "tokenizer": "byte-level, token id = UTF-8 byte (vocab 256)",
            "train_bytes": len(train_ids),
            "heldout_bytes": len(heldout_ids),
        },
        "train_wall_seconds": round(train_seconds, 1),
        "final_train_loss_nats_per_byte": round(final_loss, 4),
        "final_train_loss_note": f"mean of the last {recipe.log_every} steps",
        "heldout_cross_entropy_nats_per_byte": round(ce, 4),
        "heldout_perplexity": round(math.exp(ce), 4),
        "heldout_eval": f"non-overlapping {recipe.eval_window}-byte windows, no context across them",
        "unigram_baseline_cross_entropy_nats_per_byte": round(unigram, 4),
        "unigram_baseline_perplexity": round(math.exp(unigram), 4),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
