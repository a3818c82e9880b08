"""The ways headfold stops early; the CLI maps them to exit codes (DESIGN.md): 1 a check failed,
2 bad input, 3 anything else (a bug)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class HeadfoldError(Exception):
    """Base class: the message is one line naming the problem and the fix."""

    exit_code = 1


class BadInput(HeadfoldError):
    """Missing or corrupt input, impossible request, existing output: exit 2, nothing written."""

    exit_code = 2


class CheckFailed(HeadfoldError):
    """A verification or fusion check failed: exit 1."""

    exit_code = 1


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """A JSON object headfold wrote (headfold.json, export.json, sidecars); BadInput naming `path` and
    `fix` when it is corrupt. OS errors pass through: the CLI names them with their own fix."""
    try:
        data = json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadInput(f"{path} is corrupt (not JSON: {err}); {fix}") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path} is corrupt (not a JSON object); {fix}")
    return data
