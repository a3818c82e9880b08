"""The learning rate distill chooses on the data (no --lr: headfold/distillation/rate.py) against each fixed rate.

Each model (--models, as benchmarks/method_parts.py names them: trained models with a known pre-training
token count) is converted to kv = h/4 from two starts, the default method (calibrated on its built-in text) and
`mean` (the GQA paper's start), and each student is distilled on the model's training text, for each budget
(--budgets, fractions of its pre-training tokens; each budget a run of its own, as a user gives --tokens), once
per fixed rate (rate.CANDIDATES) and once with the rate distill chooses. Scored on the model's held-out windows
(method_parts.py's scoring, never seen by the probe): KL(original ‖ student) per token and the perplexity
increase; the chosen rate and the run's wall seconds (so the probe's share shows against the fixed runs).
Rows are merged into benchmarks/results/distill_rate.json (a run measured again replaces its row).

    python -m benchmarks.distill_rate [--models gptj,bloom,stablelm,embedded] [--budgets 0.01,0.05] [--starts default,mean]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from benchmarks import method_parts
from headfold import corpus
from headfold.converter import convert
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.modeling import load_model
from headfold.converter.recipes import DEFAULT_METHOD
from headfold.distillation import distill, rate
from headfold.verification.metrics import compare

DEFAULT_JSON = Path(__file__).parent / "results" / "distill_rate.json"
STARTS = {"default": DEFAULT_METHOD, "mean": "mean"}
WHAT = (
    "distill's own choice of the peak learning rate (no --lr: candidates probed on the training text) against each fixed rate, "
    "from the default conversion and from mean pooling at kv = h/4, each budget a run of its own: KL(original ‖ student) per token "
    "and perplexity increase on the model's held-out windows, wall seconds of the run on a shared 2-core machine"
)


def pretraining_tokens(m: method_parts.Model) -> int:
    """The tokens the model was trained on (its training.json; the embedded model's, as distill knows it)."""
    if m.name == "embedded":
        recipe = json.loads((m.folder / "training.json").read_text())["recipe"]
        return recipe["steps"] * recipe["batch_size"] * recipe["seq_len"]
    record = json.loads((m.folder / "training.json").read_text())
    return record["train_steps"] * record["train_batch"] * record["train_window"]


def rows_for(m: method_parts.Model, starts: list[str], budgets: list[float], rates: list[float | None], tmp: Path) -> list[dict]:
    reference, ids = method_parts.scored_log_probs(load_model(m.folder), m.heldout)
    data = tmp / "train.txt"
    data.write_text(corpus.train_text())
    window, pretraining = m.heldout.shape[1], pretraining_tokens(m)
    with SourceCheckpoint(m.folder) as ckpt:
        kv = ckpt.shape.heads // 4
    rows = []
    for start in starts:
        student = convert(m.folder, tmp / f"{m.name}-{start}", kv, STARTS[start], builtin_text=m.calibration, progress=False, overwrite=True)
        before = compare(reference, method_parts.scored_log_probs(load_model(student), m.heldout)[0], ids)
        for budget in budgets:
            for lr in rates:
                began = time.perf_counter()
                tokens = round(budget * pretraining)
                out = distill(m.folder, student, tmp / "out", data=data, tokens=tokens, seq_len=window, lr=lr, overwrite=True, progress=False)
                seconds = time.perf_counter() - began
                report = compare(reference, method_parts.scored_log_probs(load_model(out), m.heldout)[0], ids)
                record = json.loads((out / "headfold.json").read_text())["distillation"]
                rows.append(
                    {
                        "model": m.name,
                        "start": start,
                        "budget": budget,
                        "lr": "chosen" if lr is None else lr,
                        "chosen_lr": record["options"]["lr"] if lr is None else None,
                        "probe": record["learning_rate"] if lr is None else None,
                        "steps": record["steps"],
                        "start_kl": before.kl,
                        "start_ppl_increase": before.candidate_ppl / before.reference_ppl - 1,
                        "kl": report.kl,
                        "ppl_increase": report.candidate_ppl / report.reference_ppl - 1,
                        "wall_s": round(seconds, 1),
                    }
                )
                r = rows[-1]
                chosen = f"→ {r['chosen_lr']:g}" if lr is None else ""
                print(f"{m.name:<9} {start:<8} {budget:<5} lr {r['lr']!s:<7}{chosen:<8} KL {before.kl:.4f} → {r['kl']:.4f}  {seconds:.0f}s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gptj,bloom,stablelm,embedded")
    parser.add_argument("--budgets", default="0.01,0.05")
    parser.add_argument("--starts", default="default,mean")
    parser.add_argument("--rates", default="fixed,chosen", help="fixed: each of rate.CANDIDATES; chosen: distill's own choice")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    rates = [*(rate.CANDIDATES if "fixed" in args.rates else ()), *([None] if "chosen" in args.rates else [])]
    rows = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            rows += rows_for(method_parts.model(name), args.starts.split(","), [float(b) for b in args.budgets.split(",")], rates, Path(tmp))
    old = json.loads(args.json.read_text())["rows"] if args.json.exists() else []  # read last: runs beside this one merge
    key = lambda r: (r["model"], r["start"], r["budget"], str(r["lr"]))  # noqa: E731
    kept = [r for r in old if key(r) not in {key(n) for n in rows}]
    args.json.write_text(json.dumps({"what": WHAT, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "rows": kept + rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
