"""The defaults distillation resolves from the request: the batch that a --tokens budget gets, and how often
and on how many held-out windows it evaluates."""

from __future__ import annotations

import pytest

from headfold.distillation.run import DEFAULT_BATCH, MIN_STEPS, default_batch_size
from headfold.distillation.trainer import EVAL_PASSES, EVAL_SHARE, TRAIN_PASSES, evaluation_schedule


@pytest.mark.parametrize(
    "tokens, processes, expected",
    [
        (None, 1, DEFAULT_BATCH),  # --steps (or neither): the batch is not the budget's to choose
        (1_310_720, 1, 8),  # 40 % of the embedded model's pre-training: 640 steps of 8 × 256
        (10_000_000, 1, 8),  # never above the default
        (655_360, 1, 4),  # 20 %: 640 steps of 4 windows, not 320 of 8
        (163_840, 1, 1),  # 5 %: 640 steps of one window, not 80 of 8
        (10, 1, 1),
        (1_310_720, 2, 4),  # per process: two processes of 4 take the same 640 steps
    ],
)
def test_a_tokens_budget_shrinks_the_batch_until_the_run_takes_min_steps(tokens, processes, expected) -> None:
    batch = default_batch_size(tokens, 256, processes)
    assert batch == expected
    if tokens is not None and expected < DEFAULT_BATCH and expected > 1:
        assert tokens // (batch * 256 * processes) >= MIN_STEPS > tokens // ((batch + 1) * 256 * processes)


@pytest.mark.parametrize(
    "steps, windows_per_step, expected",
    [
        (976, 8, (122, 32)),  # 2M tokens: 8 evaluations on all 32 held-out windows, well within the share
        (40, 8, (40, 32)),  # the default 40 steps: the start and the end, on all of them
        (78, 1, (78, 8)),  # 20k tokens at one window a step: the start and the end, on 8 windows
        (2, 1, (2, 8)),  # never fewer than 8 windows, never fewer than the two evaluations
    ],
)
def test_evaluation_keeps_within_its_share_of_a_run(steps: int, windows_per_step: int, expected: tuple[int, int]) -> None:
    every, windows = evaluation_schedule(steps, windows_per_step, 32, None)
    assert (every, windows) == expected
    evaluations = 1 + -(-steps // every)  # the one before training, then every `every` steps and the last
    share = evaluations * windows * EVAL_PASSES / (evaluations * windows * EVAL_PASSES + steps * windows_per_step * TRAIN_PASSES)
    assert share <= EVAL_SHARE or windows == 8  # at 8 windows a tiny run may spend more: its start and end are still measured
    assert evaluation_schedule(steps, windows_per_step, 32, 5) == (5, 32)  # --eval-every: as asked, on every window
