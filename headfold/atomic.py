"""Outputs appear whole or not at all: build in a hidden sibling folder, rename at the end."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from headfold.errors import BadInput


def check_output(out: Path, *, overwrite: bool, sources: tuple[Path, ...] = ()) -> Path:
    """Refuse an output that exists (without overwrite) or that overlaps a source."""
    out = out.resolve()
    for src in sources:
        src = src.resolve()
        if out == src or src in out.parents:
            raise BadInput(f"output {out} is inside the source {src}; choose an output folder outside it")
        if out in src.parents:
            raise BadInput(f"output {out} contains the source {src}; choose another output path")
    if out.exists() and not overwrite:
        raise BadInput(f"output {out} already exists; pass --overwrite to replace it or choose another path")
    if out.exists() and not out.is_dir() and not out.is_file():
        raise BadInput(f"output {out} is neither a file nor a folder; remove it first")
    return out


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextmanager
def atomic_output(out: Path, *, is_dir: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling path; on success it replaces `out`, on error it vanishes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    _remove(tmp)
    if is_dir:
        tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    _remove(old)
