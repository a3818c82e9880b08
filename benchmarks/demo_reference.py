"""What `headfold demo` measures against the embedded model's reference budget (demo-budget.toml).

Runs the demo as the command does (through headfold.demo.demo: convert, distill, export, verify on
held-out text), and the variants the budget is meant to tell apart: training-free alone
(`--no-distill`) and plain mean pooling. Records the conversion-loss check of each and whether the
budget held. Prints a table and writes JSON (benchmarks/results/demo_reference.json).

    python -m benchmarks.demo_reference [--skip-mean]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from headfold.demo import demo, demo_budget
from headfold.verification import Thresholds

VARIANTS = {
    "headfold demo": {},
    "headfold demo --no-distill": {"distill": None},
    "headfold demo --no-distill --method mean": {"distill": None, "method": "mean"},
}


def measure(command: str, options: dict) -> dict:
    start = time.perf_counter()
    report = demo(thresholds=Thresholds(file=demo_budget()), **options)
    loss = next(c for c in report.checks if c.kind == "loss")
    m = loss.metrics
    return {"command": command, "ppl_increase": m["ppl_increase"], "kl": m["kl"], "top1": m["top1"], "reference_ppl": m["reference_ppl"],
            "candidate_ppl": m["candidate_ppl"], "passed": report.passed, "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-mean", action="store_true")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "demo_reference.json")
    args = parser.parse_args()
    variants = {k: v for k, v in VARIANTS.items() if not (args.skip_mean and "mean" in k)}
    rows = []
    for command, options in variants.items():
        rows.append(measure(command, options))
        print(json.dumps(rows[-1]), flush=True)
    load = os.getloadavg()[0]
    result = {
        "what": "the conversion-loss check of `headfold demo` (embedded model → 4 kv heads, distilled as the demo does, verified on held-out text) "
        "and of its training-free variants, against demo-budget.toml",
        "machine": f"{os.cpu_count()} CPU cores, torch threads: {torch.get_num_threads()}, load average {load:.1f} at the end",
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
