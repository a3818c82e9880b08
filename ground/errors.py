"""The ways headfold stops early; the CLI maps them to exit codes (DESIGN.md): 1 a check failed,
2 bad input, 3 anything else (a bug)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class HeadfoldError(Exception):
    """Base class: the message is one line naming the problem and the fix."""

    exit_code = 1


class BadInput(HeadfoldError):
    """Missing or corrupt input, impossible request, existing output: exit 2, nothing written."""

    exit_code = 2


class BadOption(BadInput):
    """A value outside its option's domain, naming the option as the command line spells it; a command
    that takes another's options under a prefix (`run --distill-seq-len`) respells it."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option} {problem}")
        self.option, self.problem = option, problem

    def respelled(self, prefix: str) -> BadOption:
        """The same error for the option spelled --PREFIX-NAME."""
        return BadOption(f"--{prefix}-{self.option.removeprefix('--')}", self.problem)


class CheckFailed(HeadfoldError):
    """A verification or fusion check failed: exit 1."""

    exit_code = 1


def is_panic(err: BaseException) -> bool:
    """A Rust library's panic (tokenizers, safetensors) as pyo3 raises it: a BaseException, not an Exception."""
    return type(err).__name__ == "PanicException"


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    return next(iter(str(err).strip().splitlines()), type(err).__name__)


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """A JSON object headfold wrote (headfold.json, export.json, sidecars); BadInput naming `path` and
    `fix` when it is corrupt, too large or too deep (ground/inputs.py, the one reader). OS errors
    pass through: the CLI names them with their own fix."""
    from headfold.ground.inputs import read_json_object as read

    return read(Path(path), fix)
