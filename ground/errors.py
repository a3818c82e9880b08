"""The ways headfold stops early; the CLI maps them to exit codes (docs/design.md): 1 a check failed,
2 bad input, 3 anything else (a bug)."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


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


@contextmanager
def quiet_panics() -> Iterator[None]:
    """While inside, what native code writes to file descriptor 2 waits in a temporary file. A Rust
    panic's hook writes its message there (and, under RUST_BACKTRACE, a backtrace of a hundred lines)
    before the panic reaches Python: after one it is dropped (logged at debug level), so the panic is
    only the one line its handler makes of it. Anything else written meanwhile is passed on to stderr."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all: nothing to hold back
        yield
        return
    panicked = False
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException as err:
            panicked = is_panic(err)
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            written = held.read()
            if panicked:
                logging.getLogger("headfold").debug(written.decode(errors="replace"))
            elif written:
                os.write(2, written)


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    return next(iter(str(err).strip().splitlines()), type(err).__name__)
