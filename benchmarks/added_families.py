"""Training-free methods and a short distillation on small trained models of the added families.

The tiny test models are random; the methods' differences only show on trained heads. This trains a
small byte-level model per family on the corpus' training split (seeded, a few minutes on 2 CPU
cores: GPT-J for interleaved RoPE, BLOOM for ALiBi, StableLM for per-head q/k LayerNorms), converts it
with every method the family allows at kv = h/2, h/4 and 1, measures KL(original ‖ converted),
perplexity and top-1 on held-out text, then distills the best kv = h/4 start for a few steps. Prints
a table and writes JSON (benchmarks/results/added_families.json).

    python -m benchmarks.added_families [--families gptj,bloom,stablelm] [--steps 400] [--distill-steps 40]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
import transformers

from headfold import DistillOptions, convert, corpus, distill
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.conversion import refused_modifiers
from headfold.converter.modeling import load_model
from headfold.verification.metrics import compare, log_probs, windows

METHODS = ("first", "mean", "aligned", "grouped", "aligned+grouped", "refit", "aligned+refit", "aligned+grouped+refit")
HEADS, WIDTH, LAYERS, WINDOW = 8, 128, 2, 128
BYTES = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {  # (config class, model class, kwargs): byte-level, 8 heads of 16 dims, 2 layers
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=WIDTH, n_head=HEADS, n_layer=LAYERS, n_positions=512, rotary_dim=8, n_inner=4 * WIDTH)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=WIDTH, n_head=HEADS, n_layer=LAYERS)),
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(
            hidden_size=WIDTH,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            num_hidden_layers=LAYERS,
            intermediate_size=3 * WIDTH,
            max_position_embeddings=512,
            partial_rotary_factor=0.5,
            qk_layernorm=True,
        ),
    ),
}


def train(family: str, folder: Path, steps: int, seed: int = 0) -> dict:
    """A small byte-level model of `family`, AdamW on random training-split windows; saved to `folder`."""
    config_cls, model_cls, kwargs = CONFIGS[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**BYTES, **kwargs))
    data = torch.tensor(corpus.encode(corpus.train_text()))
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    start = time.perf_counter()
    model.train()
    for _ in range(steps):
        starts = [rng.randrange(len(data) - WINDOW - 1) for _ in range(16)]
        batch = torch.stack([data[s : s + WINDOW] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad()
    model.eval().save_pretrained(folder)
    return {
        "train_steps": steps,
        "train_batch": 16,
        "train_window": WINDOW,
        "train_s": round(time.perf_counter() - start, 1),
        "final_train_loss": round(loss.item(), 4),
    }


def allowed(source: Path, method: str) -> bool:
    """Whether the family's maths allows every part of `method` (BLOOM: no grouped)."""
    with SourceCheckpoint(source) as ckpt:
        return not set(method.split("+")) & set(refused_modifiers(ckpt))


def family_rows(family: str, tmp: Path, steps: int, distill_steps: int) -> list[dict]:
    source = tmp / f"{family}-source"
    training = train(family, source, steps)
    print(f"{family}: trained {training}", flush=True)
    batch = windows(corpus.encode(corpus.heldout_text()), WINDOW)
    reference = log_probs(load_model(source), batch)
    rows = []
    for kv in (HEADS // 2, HEADS // 4, 1):
        for method in (m for m in METHODS if allowed(source, m)):
            start = time.perf_counter()
            out = convert(source, tmp / f"{family}-{kv}-{method}", kv, method, progress=False)
            seconds = time.perf_counter() - start
            report = compare(reference, log_probs(load_model(out), batch), batch)
            rows.append(
                {
                    "family": family,
                    "kv_heads": kv,
                    "method": method,
                    "kl": report.kl,
                    "ppl": report.candidate_ppl,
                    "reference_ppl": report.reference_ppl,
                    "top1": report.top1,
                    "convert_s": round(seconds, 2),
                    **training,
                }
            )
            print(_line(rows[-1]), flush=True)
    best = min((r for r in rows if r["kv_heads"] == HEADS // 4), key=lambda r: r["kl"])
    text = tmp / "train.txt"
    text.write_text(corpus.train_text())
    student = tmp / f"{family}-{best['kv_heads']}-{best['method']}"
    start = time.perf_counter()
    out = distill(source, student, tmp / f"{family}-distilled", DistillOptions(steps=distill_steps, seq_len=WINDOW, batch_size=16), data=text, progress=False)
    seconds = time.perf_counter() - start
    report = compare(reference, log_probs(load_model(out), batch), batch)
    rows.append(
        {
            "family": family,
            "kv_heads": best["kv_heads"],
            "method": f"{best['method']} + distill {distill_steps} steps",
            "kl": report.kl,
            "ppl": report.candidate_ppl,
            "reference_ppl": report.reference_ppl,
            "top1": report.top1,
            "distill_s": round(seconds, 1),
            **training,
        }
    )
    print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    return (
        f"{row['family']:<9} kv={row['kv_heads']:<2} {row['method']:<36} KL {row['kl']:.4f}  ppl {row['ppl']:.3f} "
        f"(orig {row['reference_ppl']:.3f})  top-1 {row['top1']:.1%}"
    )


WHAT = (
    "Tiny byte-level models of the added families, trained by this script on the offline corpus: KL to the original and "
    "perplexity on held-out text for every training-free method the family allows at kv h/2, h/4 and MQA, then the best h/4 start distilled"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=400, help="training steps per family")
    parser.add_argument("--distill-steps", type=int, default=40)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "added_families.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for family in args.families.split(",") for row in family_rows(family, Path(tmp), args.steps, args.distill_steps)]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"what": WHAT, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
