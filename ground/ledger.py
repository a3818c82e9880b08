"""stages.json, the ledger of `headfold run`: per stage its key, inputs, output folder, the sha256
of what it wrote and its time. headfold/pipeline.py decides what to skip from it.

Format 1 wraps the stages as {"format": 1, "stages": {...}}; a ledger from before it (the stages
alone) loads the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headfold.ground.artifacts import LEDGER, Malformed, Record, keep_unknown, mark, optional
from headfold.ground.errors import BadInput
from headfold.ground.inputs import read_json_object

FORMAT = 1


@dataclass(kw_only=True)
class StageEntry(Record):
    key: str | None  # None while the stage runs (claimed) or after it failed
    inputs: dict[str, Any] | None = optional()
    output: str  # the stage's folder, relative to the run folder
    sha256: str | None = optional()  # of the folder it wrote (pipeline.tree_digest)
    seconds: float | None = optional()
    extra: dict[str, Any] = keep_unknown()


@dataclass(kw_only=True)
class RunLedger(Record):
    format: int = FORMAT
    created_by: str = mark()  # --overwrite replaces the folder only with this mark in it
    stages: dict[str, StageEntry] = field(default_factory=dict)
    extra: dict[str, Any] = keep_unknown()

    @classmethod
    def from_dict(cls, data: Any) -> RunLedger:
        if isinstance(data, dict) and "format" not in data:  # before format 1: the stages alone
            data = {"format": FORMAT, "stages": data}
        return super().from_dict(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str) + "\n"  # stage inputs may hold any option value


def path_in(run_folder: Path) -> Path:
    return Path(run_folder) / LEDGER


def load(path: Path) -> RunLedger:
    """The ledger at `path`; BadInput when it is unreadable or does not fit (the run cannot trust it)."""
    fix = f"remove {path.parent} (or choose another OUT_DIR) to run every stage again"
    try:
        return RunLedger.from_dict(read_json_object(path, fix))
    except (OSError, Malformed, BadInput):
        raise BadInput(f"{path} is corrupt; {fix}") from None
