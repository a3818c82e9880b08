"""The distillation losses' exact values and their zero gradient where student and teacher agree."""

from __future__ import annotations

import pytest
import torch

from headfold.distillation.objective import Objective, Outputs, hidden_distance


def layers(seed: int, scales=(1.0, 100.0)) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(scale * torch.randn(2, 5, 8, generator=g) for scale in scales)


def test_hidden_distance_is_the_mean_over_layers_of_the_relative_mse() -> None:
    teacher = layers(0)
    doubled = tuple(2 * t for t in teacher)  # every layer off by itself: relative MSE 1, whatever its scale
    assert float(hidden_distance(doubled, teacher)) == pytest.approx(1.0, rel=1e-6)
    half_wrong = (teacher[0], 2 * teacher[1])
    assert float(hidden_distance(half_wrong, teacher)) == pytest.approx(0.5, rel=1e-6)


def test_hidden_distance_of_equal_layers_is_zero_with_a_zero_gradient() -> None:
    teacher = layers(1)
    student = tuple(t.clone().requires_grad_(True) for t in teacher)
    loss = hidden_distance(student, teacher)
    loss.backward()
    assert float(loss.detach()) == 0.0 and all(torch.count_nonzero(s.grad) == 0 for s in student)


def test_the_objective_adds_the_weighted_hidden_distance_to_the_logit_kl() -> None:
    g = torch.Generator().manual_seed(2)
    logits_s, logits_t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    hidden_s, hidden_t = layers(3), layers(4)
    plain = Objective(encoder=False)(Outputs(logits_s), Outputs(logits_t), ids)
    weighted = Objective(encoder=False, hidden_weight=10.0)(Outputs(logits_s, hidden_s), Outputs(logits_t, hidden_t), ids)
    assert float(weighted) == pytest.approx(float(plain) + 10.0 * float(hidden_distance(hidden_s, hidden_t)), rel=1e-6)


def test_the_objective_adds_the_weighted_attention_output_distance() -> None:
    g = torch.Generator().manual_seed(7)
    logits_s, logits_t = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    attn_s, attn_t, hidden_s, hidden_t = layers(8), layers(9), layers(10), layers(11)
    plain = Objective(encoder=False)(Outputs(logits_s), Outputs(logits_t), ids)
    both = Objective(encoder=False, hidden_weight=10.0, attention_weight=3.0)(Outputs(logits_s, hidden_s, attn_s), Outputs(logits_t, hidden_t, attn_t), ids)
    expected = float(plain) + 10.0 * float(hidden_distance(hidden_s, hidden_t)) + 3.0 * float(hidden_distance(attn_s, attn_t))
    assert float(both) == pytest.approx(expected, rel=1e-6)


def test_outputs_collect_each_blocks_output_in_order_and_leave_no_hook() -> None:
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])

    class Model(torch.nn.Module):
        def forward(self, input_ids, output_hidden_states=False):
            x = input_ids.float()
            for block in blocks:
                x = block(x) + 1
            return type("Out", (), {"logits": x, "hidden_states": None})()

    ids = torch.arange(8).reshape(2, 4)
    out = Objective(encoder=False, attention_weight=1.0).outputs(Model(), ids, blocks=list(blocks))
    x, expected = ids.float(), []
    for block in blocks:
        expected.append(block(x))
        x = expected[-1] + 1
    assert len(out.attention) == 3 and all(torch.equal(a, e) for a, e in zip(out.attention, expected, strict=True))
    assert not any(b._forward_hooks for b in blocks)
    assert Objective(encoder=False).outputs(Model(), ids, blocks=list(blocks)).attention == ()  # weight 0: nothing collected


def test_a_batch_scores_the_mean_of_its_halves() -> None:
    """What data-parallel processes rely on: averaging the halves' losses (and so gradients) gives the whole batch's."""
    student, teacher = layers(5), layers(6)
    halves = [hidden_distance(tuple(x[i : i + 1] for x in student), tuple(x[i : i + 1] for x in teacher)) for i in range(2)]
    assert float(hidden_distance(student, teacher)) == pytest.approx(float(sum(halves)) / 2, rel=1e-6)
