"""The distill stage of `headfold run` / `headfold demo`, between convert and export."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from headfold import corpus
from headfold.converter.checkpoint import CheckpointFacts
from headfold.distillation.data import builtin_source, file_source
from headfold.distillation.run import DistillOptions, distill, requested, resolve_defaults


@dataclass(frozen=True)
class DistillStage:
    """What to distill on: `data` (None: the embedded model's own training split), DistillOptions
    fields, and `eval_data` (None: the first windows of `data`, or the embedded model's held-out split)."""

    data: Path | None = None
    options: dict[str, Any] = field(default_factory=dict)
    eval_data: Path | None = None

    def __post_init__(self) -> None:
        DistillOptions(**self.options)  # unknown option names fail before any stage runs

    def key(self, teacher: Path, student: Path) -> dict[str, Any]:
        """The stage's ledger inputs: the data's content hash and every option as the run resolves it
        (one process), so that a changed default re-runs the stage as a changed option does."""
        source = builtin_source(corpus.train_text(), "built-in") if self.data is None else file_source(Path(self.data))
        heldout = None if self.eval_data is None else file_source(Path(self.eval_data), "--distill-eval-data").sha256
        encoder_model = CheckpointFacts.read(student).kind == "encoder"
        options = resolve_defaults(requested(teacher, self.options), encoder_model, processes=1)
        return {"data_sha256": source.sha256, "eval_data_sha256": heldout, "options": asdict(options)}

    def __call__(self, teacher: Path, student: Path, out: Path, progress: bool = False) -> Path:
        return distill(teacher, student, out, data=self.data, eval_data=self.eval_data, overwrite=True, progress=progress, **self.options)
