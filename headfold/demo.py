"""`headfold demo`: the whole pipeline (`headfold run`: convert → distill → export → verify) on the embedded default model."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

from headfold.converter.recipes import DEFAULT_METHOD
from headfold.distillation.stage import DistillStage
from headfold.ground.atomic import scratch_dir
from headfold.ground.settings import InputSpec
from headfold.pipeline import run
from headfold.verification.report import Report

# Enough held-out rows for stable figures, few enough to keep the demo short on a laptop CPU.
DEMO_INPUTS = InputSpec(max_rows=32)
# Distillation on the model's own training split, by distill's defaults except the learning rate: what
# demo-budget.toml's gates were set from (benchmarks/demo_reference.py measures it;
# benchmarks/results/demo_reference.json), at the rate that budget was measured with.
DEMO_DISTILL = DistillStage(None, {"tokens": "1.5%", "eval_windows": 16, "lr": 1e-3})


def default_model_path() -> Path:
    """The embedded trained MHA decoder (Llama layout, 4 layers × 8 heads, byte vocabulary)."""
    return Path(str(resources.files("headfold") / "data" / "default_model"))


def demo_budget() -> Path:
    """Reference gates for the embedded model at 4 kv heads, the default method, then DEMO_DISTILL."""
    return default_model_path() / "demo-budget.toml"


def demo(
    kv_heads: int | tuple[int, ...] = 4,
    method: str = DEFAULT_METHOD,
    distill: DistillStage | None = DEMO_DISTILL,
    *,
    keep: str | os.PathLike | None = None,
    overwrite: bool = False,
    **options: Any,
) -> Report:
    """`run` on the embedded model; the verify report. In a temporary folder, removed afterwards (also
    on SIGTERM, and by the next demo after a kill -9), or in `keep`, kept (a run folder: a second demo
    into it skips the stages whose inputs did not change). `distill=None` skips distillation;
    `options` are run's."""
    options.setdefault("inputs", DEMO_INPUTS)
    if keep is not None:
        return run(default_model_path(), keep, kv_heads, method=method, distill=distill, overwrite=overwrite, **options)
    with scratch_dir("headfold-demo") as tmp:
        return run(default_model_path(), tmp / "run", kv_heads, method=method, distill=distill, **options)
