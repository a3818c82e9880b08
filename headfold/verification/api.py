"""`headfold.verify(reference, candidate)`: decide the check, feed both sides, gate, report."""

from __future__ import annotations

import json
import os
from pathlib import Path

from headfold.errors import BadInput
from headfold.verification.artifacts import Artifact, check_kind, loosest, resolve
from headfold.verification.budget import FidelityBudget, LossBudget, Thresholds
from headfold.verification.checks import CheckResult, CheckSpec, run_checks
from headfold.verification.inputs import Inputs, InputSpec, make_inputs
from headfold.verification.report import Report

CHECK_NAMES = {"fidelity": "fidelity", "loss": "conversion-loss"}


def _vocab(artifact: Artifact) -> int | None:
    if artifact.model is None:
        return None
    config = json.loads((artifact.model / "config.json").read_text())
    return config.get("vocab_size")


def check_vocab(reference: Artifact, candidate: Artifact) -> None:
    vocab = {_vocab(reference), _vocab(candidate)} - {None}
    if len(vocab) > 1:
        raise BadInput(f"{reference.path} and {candidate.path} have different vocabularies ({' vs '.join(map(str, sorted(vocab)))})")


def run_artifact_checks(checks: list[tuple[str, str, Artifact, Artifact, FidelityBudget | LossBudget]], inputs: Inputs) -> list[CheckResult]:
    """(name, kind, reference, candidate, budget) per check; an artifact used twice runs once per feed."""
    runners = {}
    specs = []
    for name, kind, reference, candidate, budget in checks:
        check_vocab(reference, candidate)
        ref, cand = (runners.setdefault(a.path, a.runner()) for a in (reference, candidate))
        specs.append(CheckSpec(name, kind, ref, cand, budget))
    results = run_checks(specs, inputs)
    for (_, _, reference, candidate, _), result in zip(checks, results):
        result.reference = {**reference.describe(), **result.reference}
        result.candidate = {**candidate.describe(), **result.candidate}
    return results


def verify(
    reference: str | os.PathLike,
    candidate: str | os.PathLike,
    *,
    inputs: InputSpec = InputSpec(),
    thresholds: Thresholds = Thresholds(),
    check: str = "auto",
) -> Report:
    """Compare CANDIDATE with REFERENCE; the report says what passed (`report.passed`).

    `check` is "auto" (same model → fidelity, converted from REFERENCE → loss), "fidelity" or
    "loss". Raises BadInput for paths, texts or budgets headfold cannot use.
    """
    if check not in ("auto", *CHECK_NAMES):
        raise BadInput(f"unknown check {check!r}; use auto, fidelity or loss")
    ref, cand = resolve(Path(reference)), resolve(Path(candidate))
    kind = check_kind(ref, cand, check)
    precision = loosest(ref.precision, cand.precision)
    budget = thresholds.fidelity(precision, floors=True) if kind == "fidelity" else thresholds.loss(precision)
    feeds = make_inputs(ref.model or cand.model, inputs)
    return Report(run_artifact_checks([(CHECK_NAMES[kind], kind, ref, cand, budget)], feeds), feeds.info)
