"""Per-layer kv-head plans: the least predicted loss under a total KV-cache budget.

Each layer offers a few kv-head counts, each with a predicted loss (the calibration loss of
converting that layer alone); a plan picks one per layer. Losses are treated as additive
across layers, so the best plan is a multiple-choice knapsack, solved exactly by dynamic
programming over the kv heads used so far (at most layers × heads states).
"""

from __future__ import annotations

from dataclasses import dataclass

from headfold.ground.errors import BadInput

LayerOptions = dict[int, float]  # kv-head count -> predicted loss of converting this layer to it


@dataclass(frozen=True)
class Plan:
    kv_heads: tuple[int, ...]  # one per layer
    loss: float  # sum of the layers' predicted losses

    @property
    def total(self) -> int:
        """KV-cache size in kv heads summed over layers (head_dim is the same in every layer)."""
        return sum(self.kv_heads)

    @property
    def argument(self) -> str:
        """What `headfold convert` takes: one value when uniform, else one per layer."""
        uniform = len(set(self.kv_heads)) == 1
        return f"--kv-heads {self.kv_heads[0] if uniform else ','.join(map(str, self.kv_heads))}"


def divisors_below(n: int) -> list[int]:
    """Every kv-head count a layer with `n` kv heads can be pooled to, largest first."""
    return [k for k in range(n - 1, 0, -1) if n % k == 0]


def parse_candidates(text: str | None, kv_heads: int) -> list[int]:
    """'4,2,1' → [4, 2, 1] (largest first); None → every divisor of `kv_heads` below it."""
    if text is None:
        candidates = divisors_below(kv_heads)
        if not candidates:
            raise BadInput(f"the source already has {kv_heads} kv head; there is nothing fewer to inspect")
        return candidates
    choices = ", ".join(map(str, reversed([kv_heads, *divisors_below(kv_heads)])))
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise BadInput(f"--candidates {text!r} is not a comma-separated list of integers; write e.g. 4,2,1") from None
    bad = [k for k in values if k < 1 or kv_heads % k]
    if bad:
        raise BadInput(f"--candidates {bad[0]} does not divide the source's {kv_heads} kv heads; choose from {choices}")
    return sorted(set(values), reverse=True)


def budget_total(budget: float | int, source_total: int) -> int:
    """The most kv heads summed over layers: a float is a fraction of the source cache
    (0.25 = a quarter), an int a total of kv heads."""
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise BadInput(f"--kv-budget {budget} is not a fraction of the cache in (0, 1]; write e.g. 0.25, or a total of kv heads")
        budget = int(budget * source_total + 1e-9)  # tolerate 0.3 · 40 = 11.999…
    if budget < 1:
        raise BadInput(f"--kv-budget leaves {budget} kv heads; give a larger fraction or total")
    return budget


def best_plan(layers: list[LayerOptions], budget: int) -> Plan:
    """The plan with the least total loss whose total kv heads is ≤ `budget` (exact DP).

    Ties go to the smaller cache, then to the lexicographically larger kv counts (earlier
    layers keep more heads), so the answer is deterministic.
    """
    smallest = sum(min(options) for options in layers)
    if smallest > budget:
        raise BadInput(
            f"--kv-budget allows {budget} kv heads in total but the smallest plan needs {smallest}; "
            "raise the budget (a whole number is a total of kv heads; 0.5 or 50% a fraction of the cache) or add smaller --candidates"
        )
    states: dict[int, Plan] = {0: Plan((), 0.0)}  # kv heads used so far -> best partial plan
    for options in layers:
        grown: dict[int, Plan] = {}
        for used, plan in states.items():
            for kv in sorted(options, reverse=True):
                if used + kv <= budget:
                    step = Plan((*plan.kv_heads, kv), plan.loss + options[kv])
                    if used + kv not in grown or step.loss < grown[used + kv].loss:
                        grown[used + kv] = step
        states = grown
    return min(states.values(), key=lambda p: (p.loss, p.total, [-k for k in p.kv_heads]))


def best_uniform(layers: list[LayerOptions], budget: int) -> Plan | None:
    """The best plan using one kv-head count everywhere, or None when none fits the budget."""
    common = set.intersection(*(set(options) for options in layers))
    fits = [Plan((kv,) * len(layers), sum(options[kv] for options in layers)) for kv in common if kv * len(layers) <= budget]
    return min(fits, key=lambda p: (p.loss, p.total), default=None)
