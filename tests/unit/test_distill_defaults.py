"""The defaults distillation resolves from the request: the batch that a --tokens budget gets."""

from __future__ import annotations

import pytest

from headfold.distillation.run import DEFAULT_BATCH, MIN_STEPS, default_batch_size


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
