"""The two ways headfold stops early; the CLI maps them to exit codes (DESIGN.md)."""


class HeadfoldError(Exception):
    """Base class: the message is one line naming the problem and the fix."""

    exit_code = 1


class BadInput(HeadfoldError):
    """Missing or corrupt input, impossible request, existing output: exit 2, nothing written."""

    exit_code = 2


class CheckFailed(HeadfoldError):
    """A verification or fusion check failed: exit 1."""

    exit_code = 1
