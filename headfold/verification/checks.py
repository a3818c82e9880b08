"""A check feeds the same inputs to a reference and a candidate runner and gates the metrics.

Fidelity (same model, two backends) gates elements outside atol and rtol, top-1 agreement and
cosine; conversion loss (original vs converted) gates the perplexity increase, KL and top-1
for decoders, the embedding cosine for encoders. A gate is hard: one failure fails the check.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from headfold.ground.errors import BadInput
from headfold.verification.budget import FidelityBudget, LossBudget
from headfold.verification.inputs import Inputs
from headfold.verification.metrics import EmbeddingMeter, FidelityMeter, LossMeter
from headfold.verification.runners import Runner
from headfold.verification.seq2seq import target_view

DECODER_OUTPUT, ENCODER_OUTPUT = "logits", "last_hidden_state"


@dataclass(frozen=True)
class Gate:
    metric: str
    value: float
    op: str  # "<=" or ">="
    budget: float

    @property
    def passed(self) -> bool:
        return self.value <= self.budget if self.op == "<=" else self.value >= self.budget

    def shown(self, percent: bool = False) -> tuple[str, str]:
        """(value, budget) with the digits that decide the gate: the budget as it was given (the shortest
        that reads back as it), the value with as many as it takes to fall on its own side of the budget
        (0.999996 against 0.99999 prints as 1, 0.999986 as 0.99999 would not: it prints 0.999986)."""
        base = 2 if percent else 4

        def text(x: float, digits: int) -> str:
            return f"{x:.{digits}%}" if percent else f"{x:.{digits}g}"

        def back(shown: str) -> float:
            return float(Decimal(shown[:-1]) / 100) if percent else float(shown)  # decimal: 99.999 % reads back as 0.99999

        def side(x: float) -> int:
            return (x > self.budget) - (x < self.budget)

        budget = next((t for d in range(base, base + 16) if back(t := text(self.budget, d)) == self.budget), repr(self.budget))
        if not math.isfinite(self.value):
            return str(self.value), budget
        value = next((t for d in range(base, base + 16) if side(back(t := text(self.value, d))) == side(self.value)), repr(self.value))
        return value, budget

    def message(self) -> str:
        worse = ">" if self.op == "<=" else "<"
        value, budget = self.shown()
        return f"{self.metric} = {value} {worse} budget {budget}"


@dataclass
class CheckResult:
    name: str
    kind: str  # "fidelity" | "loss"
    reference: dict[str, Any]
    candidate: dict[str, Any]
    metrics: dict[str, Any]
    gates: list[Gate]
    budget: dict[str, float]
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def failures(self) -> list[Gate]:
        return [g for g in self.gates if not g.passed]

    def to_dict(self) -> dict[str, Any]:
        gates = [{**asdict(g), "passed": g.passed} for g in self.gates]
        return {**asdict(self), "gates": gates, "passed": self.passed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckResult:
        """Inverse of `to_dict` (a stored report.json)."""
        fields = {k: v for k, v in data.items() if k != "passed"}
        gates = [Gate(g["metric"], g["value"], g["op"], g["budget"]) for g in data["gates"]]
        return cls(**{**fields, "gates": gates})


def fidelity_gates(metrics: dict[str, float], budget: FidelityBudget) -> list[Gate]:
    gates = [Gate("mismatched", metrics["mismatched"], "<=", 0), Gate("cosine", metrics["cosine"], ">=", budget.min_cosine)]
    if "top1" in metrics:
        gates.append(Gate("top1", metrics["top1"], ">=", budget.min_top1))
    return gates


def loss_gates(metrics: dict[str, float], budget: LossBudget) -> list[Gate]:
    if "embedding_cosine" in metrics:
        return [Gate("embedding_cosine", metrics["embedding_cosine"], ">=", budget.min_cosine)]
    return [
        Gate("ppl_increase", metrics["ppl_increase"], "<=", budget.max_ppl_increase),
        Gate("kl", metrics["kl"], "<=", budget.max_kl),
        Gate("top1", metrics["top1"], ">=", budget.min_top1),
    ]


@dataclass
class CheckSpec:
    """One check to run: its name and kind, the two runners and the budget.

    `positions(feed)` → [B, S] bool picks the positions compared (default: every real token).
    """

    name: str
    kind: str
    reference: Runner
    candidate: Runner
    budget: FidelityBudget | LossBudget
    positions: Callable[[Mapping[str, np.ndarray]], np.ndarray] | None = None
    notes: list[str] = field(default_factory=list)

    def compared(self, feed: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """The feed as the meters see it (an encoder-decoder's target): its attention_mask marks the positions compared."""
        view = target_view(feed)
        return view if self.positions is None else {**view, "attention_mask": self.positions(view)}


def _output_name(outputs: dict[str, Any]) -> str:
    for name in (DECODER_OUTPUT, ENCODER_OUTPUT):
        if name in outputs:
            return name
    raise BadInput(f"no {DECODER_OUTPUT} or {ENCODER_OUTPUT} among the outputs {sorted(outputs)}")


def _meter(kind: str, output: str, budget) -> FidelityMeter | LossMeter | EmbeddingMeter:
    if kind == "fidelity":
        return FidelityMeter(budget.atol, budget.rtol, top1=output == DECODER_OUTPUT)
    return LossMeter() if output == DECODER_OUTPUT else EmbeddingMeter()


def _gate(spec: CheckSpec, metrics: dict[str, Any]) -> list[Gate]:
    if spec.kind == "fidelity":
        assert isinstance(spec.budget, FidelityBudget)  # a check's budget is of its kind (verification.api, pipeline, decoding)
        return fidelity_gates(metrics, spec.budget)
    assert isinstance(spec.budget, LossBudget)
    return loss_gates(metrics, spec.budget)


def _timed(runner: Runner, feed: dict[str, Any], clock: dict[int, float]) -> dict[str, Any]:
    start = time.perf_counter()
    out = runner.infer(feed)
    clock[id(runner)] = clock.get(id(runner), 0.0) + time.perf_counter() - start
    return out


def run_checks(specs: list[CheckSpec], inputs: Inputs, *, progress: bool = False) -> list[CheckResult]:
    """Run every check on every feed; a runner shared by several checks runs once per feed.

    A check's seconds are its two runners' inference time (a shared runner's counts in both).
    `progress`: a bar of the rows done (each row through every runner, its decode steps included).
    """
    runners = list({id(r): r for s in specs for r in (s.reference, s.candidate)}.values())
    meters: list[Any] = [None] * len(specs)
    names: list[str] = [""] * len(specs)
    clock: dict[int, float] = {}
    with ExitStack() as stack:
        for runner in runners:
            if not runner.is_active:  # a KV-cache runner may have activated the prefill runner it shares
                stack.enter_context(runner)
        rows = [len(next(iter(feed.values()))) for feed in inputs.feeds]  # every input is batch-first
        bar = stack.enter_context(tqdm(total=sum(rows), desc="verify", unit="row", disable=not progress))
        for feed, batch in zip(inputs.feeds, rows, strict=True):
            outputs = {id(r): _timed(r, feed, clock) for r in runners}
            bar.update(batch)
            for i, spec in enumerate(specs):
                ref, cand = outputs[id(spec.reference)], outputs[id(spec.candidate)]
                names[i] = names[i] or _output_name(ref)
                if names[i] not in cand:
                    raise BadInput(f"{spec.candidate.name} has no output {names[i]!r} (it returned {', '.join(sorted(cand))})")
                if (theirs := np.shape(cand[names[i]])) != (ours := np.shape(ref[names[i]])):  # a rank or a width of another model
                    raise BadInput(
                        f"{spec.candidate.name} gives {names[i]} of shape {list(theirs)} where {spec.reference.name} gives {list(ours)} on the "
                        "same feed; the two are not the same kind of model: verify a graph headfold export wrote of the reference"
                    )
                meters[i] = meters[i] or _meter(spec.kind, names[i], spec.budget)
                meters[i].add(ref[names[i]], cand[names[i]], spec.compared(feed))
        described = {id(r): _describe(r) for r in runners}
    results = []
    for spec, meter, name in zip(specs, meters, names, strict=True):
        metrics = {"output": name, **meter.metrics()}
        ref, cand = described[id(spec.reference)], described[id(spec.candidate)]
        took = clock[id(spec.reference)] + clock[id(spec.candidate)]
        results.append(CheckResult(spec.name, spec.kind, ref, cand, metrics, _gate(spec, metrics), asdict(spec.budget), took, list(spec.notes)))
    return results


def run_check(name: str, kind: str, reference: Runner, candidate: Runner, inputs: Inputs, budget: FidelityBudget | LossBudget) -> CheckResult:
    """One check; both runners are loaded at once."""
    return run_checks([CheckSpec(name, kind, reference, candidate, budget)], inputs)[0]


def _describe(runner: Runner) -> dict[str, Any]:
    describe = getattr(runner, "describe", None)  # Polygraphy's runners have only a name
    return describe() if describe else {"runner": runner.name}
