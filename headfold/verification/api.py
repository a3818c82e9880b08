"""`headfold.verify(reference, candidate)`: decide the check, feed both sides, gate, report."""

from __future__ import annotations

import os
from pathlib import Path

from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.sources import checkpoint_folders
from headfold.ground.errors import BadInput
from headfold.ground.precision import Precision
from headfold.verification.artifacts import Artifact, check_kind, resolve
from headfold.verification.budget import FidelityBudget, LossBudget, Thresholds
from headfold.verification.checks import CheckResult, CheckSpec, run_checks
from headfold.verification.decoding import KvCacheRunner, decode_check
from headfold.verification.inputs import Inputs, InputSpec, make_inputs
from headfold.verification.report import Report
from headfold.verification.runners import BaseRunner
from headfold.verification.seq2seq import check_same_kind

CHECK_NAMES = {"fidelity": "fidelity", "loss": "conversion-loss"}
QUANTIZATION_LOSS = "quantization-loss"  # the loss check of an int4 export against its own model (torch or another export)


def _vocab(artifact: Artifact) -> int | None:
    if artifact.model is None:
        return None
    return CheckpointFacts.read(artifact.model).vocab_size


def check_vocab(reference: Artifact, candidate: Artifact) -> None:
    vocab = {v for v in (_vocab(reference), _vocab(candidate)) if v is not None}
    if len(vocab) > 1:
        raise BadInput(f"{reference.path} and {candidate.path} have different vocabularies ({' vs '.join(map(str, sorted(vocab)))})")


Pair = tuple[Artifact, Artifact]


def run_artifact_checks(
    checks: list[tuple[str, str, Artifact, Artifact, FidelityBudget | LossBudget]], inputs: Inputs, *, progress: bool = False
) -> list[CheckResult]:
    """(name, kind, reference, candidate, budget) per check; an artifact used twice runs once per feed.

    A fidelity check with a decoder export on a side is followed by its KV-cache twin
    (verification.decoding), unless `inputs.decode_steps` is 0 (then the check notes the skip).
    """
    runners = _RunnerCache(inputs.decode_steps)
    planned: list[tuple[CheckSpec, Pair]] = []
    for name, kind, reference, candidate, budget in checks:
        check_vocab(reference, candidate)
        spec = CheckSpec(name, kind, runners.full(reference), runners.full(candidate), budget)
        planned.append((spec, (reference, candidate)))
        if kind == "fidelity" and (reference.decode or candidate.decode):
            # the candidate's cache path against the reference's full forward when both could decode:
            # two KV paths compared with each other would hide a decode bug they share
            truth = runners.full(reference) if candidate.decode else runners.kv_cache_or_full(reference)
            sides = truth, runners.kv_cache_or_full(candidate)
            twin = decode_check(spec, *sides, inputs.decode_steps)
            planned += [(twin, (reference, candidate))] if twin else []
    results = run_checks([spec for spec, _ in planned], inputs, progress=progress)
    for (_, (reference, candidate)), result in zip(planned, results, strict=True):
        result.reference = {**reference.describe(), **result.reference}
        result.candidate = {**candidate.describe(), **result.candidate}
    return results


class _RunnerCache:
    """One runner per artifact and path (full forward / KV cache), so shared sides run once per feed.

    KV-cache runners cost nothing until a check runs them (they load on entry).
    """

    def __init__(self, decode_steps: int) -> None:
        self.decode_steps = decode_steps
        self._full: dict[Path, BaseRunner] = {}
        self._kv_cache: dict[Path, KvCacheRunner] = {}

    def full(self, artifact: Artifact) -> BaseRunner:
        if artifact.path not in self._full:
            self._full[artifact.path] = artifact.runner(self.decode_steps)
        return self._full[artifact.path]

    def kv_cache_or_full(self, artifact: Artifact) -> BaseRunner:
        """The KV-cache path of a decoder export or engine pair (its prefill runner shared), else the full forward."""
        if artifact.decode is None:
            return self.full(artifact)
        if artifact.path not in self._kv_cache:
            # a merged graph continues through its own runner: one session for both paths
            decode = self.full(artifact) if artifact.decode == artifact.path else artifact.decode_runner()
            self._kv_cache[artifact.path] = KvCacheRunner(self.full(artifact), decode, self.decode_steps, shared=artifact.shared_cache)
        return self._kv_cache[artifact.path]


def files_read(reference: Path, candidate: Path, inputs: InputSpec, thresholds: Thresholds) -> list[Path]:
    """Every path verifying `reference` against `candidate` reads: both sides, the models and graphs
    behind them, the text, token ids and budget (no output may land on one of them)."""
    reads = [p for p in (inputs.text, inputs.token_ids, thresholds.file) if p is not None]
    for side in (Path(reference), Path(candidate)):
        artifact = resolve(side) if side.exists() else None
        reads += [side] if artifact is None else [side, *artifact.reads]
    return reads


def verify(
    reference: str | os.PathLike,
    candidate: str | os.PathLike,
    *,
    inputs: InputSpec = InputSpec(),
    thresholds: Thresholds = Thresholds(),
    check: str = "auto",
    revision: str | None = None,
    progress: bool = False,
) -> Report:
    """Compare CANDIDATE with REFERENCE; the report says what passed (`report.passed`).

    Each side is a checkpoint (a folder, or a hub id ORG/NAME at `revision`), an export folder, a
    .onnx file or an engine. `check` is "auto" (same model → fidelity, converted from REFERENCE →
    loss), "fidelity" or "loss"; `progress` shows a bar of the rows done. Raises BadInput for paths,
    texts or budgets headfold cannot use.
    """
    if check not in ("auto", *CHECK_NAMES):
        raise BadInput(f"unknown check {check!r}; use auto, fidelity or loss")
    ref, cand = (resolve(path) for path in checkpoint_folders(reference, candidate, revision=revision))
    if ref.model is not None and cand.model is not None:
        check_same_kind(CheckpointFacts.read(ref.model), CheckpointFacts.read(cand.model), (ref.path, cand.path))
    kind = check_kind(ref, cand, check)
    precision = Precision.coarsest(ref.precision, cand.precision)  # the budget of the coarser side
    if kind == "fidelity" and precision == Precision.INT4:
        raise BadInput(
            "int4 weights differ from their model by quantization, element by element: compare them by their loss (KL, perplexity, top-1), --check loss or auto"
        )
    budget = thresholds.fidelity(precision, floors=True) if kind == "fidelity" else thresholds.loss(precision)
    model = ref.model or cand.model
    assert model is not None  # check_kind refuses a pair without a checkpoint on either side
    feeds = make_inputs(model, inputs, allow_random=kind == "fidelity")
    name = QUANTIZATION_LOSS if kind == "loss" and precision == Precision.INT4 and ref.model == cand.model else CHECK_NAMES[kind]
    return Report(run_artifact_checks([(name, kind, ref, cand, budget)], feeds, progress=progress), feeds.info)
