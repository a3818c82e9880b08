"""`scored`: the predicted loss of pooling a group is zero exactly when refit can rebuild every head from one
pooled head (equal heads, a head that is another under a map refit may fold), and the search finds such
groups wherever the heads sit."""

from __future__ import annotations

import torch

from headfold.converter import alignment
from headfold.converter.scoring import PredictedLoss, scored_groups

T, D, HIDDEN = 256, 8, 32


def heads(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(T, D, generator=gen, dtype=torch.float64) for _ in range(n)]


def readers(n: int, seed: int = 9) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per kv head one query head's activations [T, 1, D] and W_O rows [1, D, HIDDEN]."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(T, 1, D, generator=gen) for _ in range(n)], [torch.randn(1, D, HIDDEN, generator=gen) for _ in range(n)]


def phase_rotation(seed: int) -> torch.Tensor:
    """A rotation (and scale) per RoPE pair (i, i + D/2): what refit folds into W_Q under RoPE."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.complex(torch.randn(D // 2, generator=gen, dtype=torch.float64), torch.randn(D // 2, generator=gen, dtype=torch.float64))
    return alignment._pair_blocks(scale, D, D, torch.float64)


def test_heads_that_refit_rebuilds_predict_no_loss() -> None:
    """Pairs (0, 4), (1, 5), (2, 6), (3, 7): K related by a per-pair complex scale, V by any invertible map."""
    base_k, base_v = heads(4, 0), heads(4, 1)
    gen = torch.Generator().manual_seed(2)
    keys = base_k + [k @ phase_rotation(10 + j) for j, k in enumerate(base_k)]
    values = base_v + [v @ torch.randn(D, D, generator=gen, dtype=torch.float64) for v in base_v]
    loss = PredictedLoss(keys, values, *readers(8), key_rotary=D)
    paired = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert loss.total(paired) < 1e-9
    assert loss.total([[0, 1], [2, 3], [4, 5], [6, 7]]) > 0.1
    assert scored_groups(loss, [[[0, 1], [2, 3], [4, 5], [6, 7]]]) == paired


def test_rope_keys_allow_only_per_pair_maps() -> None:
    """A key head that is another under a general rotation (not per RoPE pair) cannot be rebuilt under RoPE,
    but can without it (a full map folds into W_Q)."""
    keys = heads(1, 3)
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
    keys.append(keys[0] @ q)
    values = heads(1, 5) * 2
    with_rope = PredictedLoss(keys, values, *readers(2), key_rotary=D)
    without = PredictedLoss(keys, values, *readers(2), key_rotary=0)
    assert with_rope.total([[0, 1]]) > 0.05 and without.total([[0, 1]]) < 1e-9


def test_fixed_keys_predict_mean_poolings_residual() -> None:
    """Keys that nothing may transform (a per-dimension norm follows W_K): equal keys pool for free, others do not."""
    keys, values = heads(2, 6), heads(1, 7) * 2
    fixed = PredictedLoss([keys[0], keys[0]], values, *readers(2), key_rotary=None)
    assert fixed.total([[0, 1]]) < 1e-12
    other = PredictedLoss(keys, values, *readers(2), key_rotary=None)
    expected = sum(float((k - (keys[0] + keys[1]) / 2).square().sum()) for k in keys) / sum(float(k.square().sum()) for k in keys)
    assert abs(other.total([[0, 1]]) - expected) < 1e-9


def test_search_never_ends_above_its_best_start() -> None:
    keys, values = heads(8, 11), heads(8, 12)
    loss = PredictedLoss(keys, values, *readers(8), key_rotary=D // 2)
    starts = [[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]]
    groups = scored_groups(loss, starts)
    assert sorted(j for g in groups for j in g) == list(range(8)) and all(len(g) == 4 for g in groups)
    assert loss.total(groups) <= min(loss.total(s) for s in starts)
