"""The distill stage of `headfold run` / `headfold demo`, between convert and export."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from headfold import corpus
from headfold.converter.checkpoint import CheckpointFacts, SourceCheckpoint
from headfold.distillation import rate
from headfold.distillation.audio import audio_sha256
from headfold.distillation.data import builtin_source, file_source
from headfold.distillation.run import DistillOptions, check_options, distill, requested, resolve_defaults, total_steps, window_plan
from headfold.ground.errors import BadOption


@dataclass(frozen=True, init=False)
class DistillStage:
    """What to distill on: `data` (None: the embedded model's own training split), the options (DistillOptions,
    or the fields given as a dict; kept as the fields given, which the demo lays over its own), and `eval_data`
    (None: the first windows of `data`, or the embedded model's held-out split)."""

    data: Path | None
    options: dict[str, Any]
    eval_data: Path | None

    def __init__(self, data: Path | None = None, options: Mapping[str, Any] | DistillOptions | None = None, eval_data: Path | None = None) -> None:
        given = options.given() if isinstance(options, DistillOptions) else dict(options or {})
        DistillOptions(**given)  # unknown option names fail before any stage runs
        object.__setattr__(self, "data", data)
        object.__setattr__(self, "options", given)
        object.__setattr__(self, "eval_data", eval_data)

    def check(self, teacher: Path) -> None:
        """What the stage would refuse in its options and data, before run's first stage: the plan distill
        makes, made on the teacher (the student, its conversion, shares its kind, vocabulary, positions and
        tokenizer) and checked, every row of the data read."""
        ckpt = SourceCheckpoint(teacher)
        encoder_model = ckpt.facts.kind == "encoder"
        try:
            opts = resolve_defaults(requested(teacher, self.options), encoder_model, processes=1)
            check_options(opts, ckpt.facts, encoder_model)
            total_steps(opts, processes=1)
        except BadOption as err:
            raise err.respelled("distill") from None
        window_plan(teacher, ckpt, self.data, self.eval_data, opts, encoder_model).check()

    def key(self, teacher: Path, student: Path) -> dict[str, Any]:
        """The stage's ledger inputs: the data's content hash and every option as the run resolves it
        (one process), so that a changed default re-runs the stage as a changed option does."""
        facts = CheckpointFacts.read(student)
        options = resolve_defaults(requested(teacher, self.options), facts.kind == "encoder", processes=1)
        data = self._sha256(facts, self.data, "--distill-data")
        heldout = None if self.eval_data is None else self._sha256(facts, self.eval_data, "--distill-eval-data")
        chosen = {"lr_candidates": list(rate.CANDIDATES), "lr_probe_share": rate.PROBE_SHARE} if options.lr is None else {}  # the rule, where it chooses
        return {"data_sha256": data, "eval_data_sha256": heldout, "options": asdict(options), **chosen}

    @staticmethod
    def _sha256(facts: CheckpointFacts, data: Path | None, option: str) -> str:
        """What the run records of the data: audio for Whisper (clips and transcripts), text for the rest."""
        if data is None:
            return builtin_source(corpus.train_text(), "built-in").sha256
        if facts.audio_input:
            return audio_sha256(facts, Path(data), option)
        return file_source(Path(data), option).sha256

    def __call__(self, teacher: Path, student: Path, out: Path, progress: bool = False) -> Path:
        return distill(teacher, student, out, data=self.data, eval_data=self.eval_data, overwrite=True, progress=progress, **self.options)
