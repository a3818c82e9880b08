"""The peak learning rate a run takes when --lr is not given, chosen on the user's own data.

One fixed rate does not transfer: from a start close to the original a small rate damages least, from a far
one (mean pooling, an unseen model) a larger one recovers several times more (docs/distill.md). So each
candidate (CANDIDATES) trains the student from its start for the run's first few steps at that peak rate (its
warmup's rates), on the same windows of --data, and is scored on other windows of --data that the probe does not train on (never the evaluation
text): KL per token, or 1 − the embedding cosine for an encoder. The run takes the lowest, then starts from the
start again: the student, its optimizer, torch's RNG and the data stream are as before the probe, so the run
is the one `--lr CHOSEN` makes. The steps are sized so that the candidates together cost at most PROBE_SHARE
of the run (counted as trainer.evaluation_schedule counts); every process takes the main process's choice.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

from tqdm.auto import tqdm

from headfold.distillation.objective import evaluate
from headfold.distillation.trainer import EVAL_PASSES, TRAIN_PASSES, Trainer
from headfold.ground.lazy import lazy_import

accelerate_utils = lazy_import("accelerate.utils")

CANDIDATES = (1e-4, 3e-4, 1e-3, 3e-3)  # the fixed rates the recipe was measured at (benchmarks/distill_zoo.py)
PROBE_SHARE = 0.1  # of the run's compute, for all the candidates together
PROBE_WINDOWS = 8  # at most, held-out windows of --data each candidate is scored on


@dataclass(frozen=True)
class RateChoice:
    lr: float  # the chosen peak rate
    steps: int  # probe steps per candidate
    windows: int  # held-out windows of --data each candidate was scored on
    start: float  # their score before any step
    scores: dict[str, float]  # candidate (as text) → score after its steps (inf: it diverged)

    def record(self) -> dict[str, Any]:
        """As headfold.json keeps it: a diverged candidate's score is null (JSON has no infinity)."""
        return asdict(self) | {"scores": {lr: score if math.isfinite(score) else None for lr, score in self.scores.items()}}


def probe_size(steps: int, windows_per_step: int, candidates: int = len(CANDIDATES)) -> tuple[int, int]:
    """(steps, held-out windows) per candidate so that all of them cost at most PROBE_SHARE of a run of `steps`: at
    most half of each candidate's share scores (up to PROBE_WINDOWS windows), the rest trains. A run too short for
    one step and one window within its share still probes with those (its share then exceeds PROBE_SHARE)."""
    share = PROBE_SHARE * steps * windows_per_step * TRAIN_PASSES / candidates
    windows = min(PROBE_WINDOWS, max(1, int(share / 2 // EVAL_PASSES)))
    return max(1, int((share - windows * EVAL_PASSES) // (windows_per_step * TRAIN_PASSES))), windows


def choose(trainer: Trainer, show: bool) -> RateChoice:
    """The candidate whose probe ends lowest on held-out windows of --data; `trainer` left at its start, at that rate."""
    acc, per_process = trainer.accelerator, trainer.opts.batch_size
    width, rank = per_process * acc.num_processes, acc.process_index
    steps, windows = probe_size(trainer.steps, width)
    stream = trainer.plan.train_windows()
    held = trainer.batch(list(islice(stream, windows)))
    batches = [trainer.batch(rows[rank * per_process : (rank + 1) * per_process]) for rows in (list(islice(stream, width)) for _ in range(steps))]
    start = trainer.snapshot()
    first, scores = _score(trainer, held), {}
    with tqdm(total=steps * len(CANDIDATES), desc="choosing --lr", unit="step", disable=not (show and acc.is_main_process), dynamic_ncols=True) as bar:
        for lr in CANDIDATES:
            bar.set_postfix_str(f"lr {lr:g}")
            scores[f"{lr:g}"] = _score(trainer, held) if _trained(trainer, lr, batches, bar) else math.inf
            trainer.restore_snapshot(start)
    chosen = [min(CANDIDATES, key=lambda lr: scores[f"{lr:g}"])]
    accelerate_utils.broadcast_object_list(chosen)  # one choice, the main process's, whatever the float noise
    trainer.use_rate(chosen[0])
    return RateChoice(chosen[0], steps, len(held), first, scores)


def _trained(trainer: Trainer, peak: float, batches: list, bar) -> bool:
    """Whether `batches` trained the student, at the rates the run's first steps take at `peak` (its warmup: Adam's
    first steps at a whole peak rate would undo any start), without a non-finite loss (a rate that diverges)."""
    for step, ids in enumerate(batches):
        bar.update()
        trainer.set_rate(peak * trainer.rate_factor(step))
        if not math.isfinite(trainer.update(ids)):
            return False
    return True


def _score(trainer: Trainer, held) -> float:
    scores = evaluate(trainer.objective, trainer.plain, trainer.teacher, held, trainer.opts.batch_size)
    value = 1 - scores["cosine"] if trainer.objective.encoder else scores["kl"]
    return value if math.isfinite(value) else math.inf
