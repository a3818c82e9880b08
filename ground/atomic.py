"""Outputs appear whole or not at all, from one writer, never over an input.

A writer holds an exclusive lock on the sibling `.OUT.lock` (recording its pid), builds in the
hidden sibling `.OUT.partial-PID` and renames it into place at the end; an existing OUT is replaced
only when asked. Under the lock any other `.OUT.partial-*` / `.OUT.old-*` was left by a writer that
died (kill -9, power loss), so it is removed. SIGTERM, like SIGINT, unwinds and cleans up (exit 143).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import itertools
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from headfold.ground.artifacts import OWN_RECORDS, written_by_headfold
from headfold.ground.errors import BadInput

log = logging.getLogger("headfold")


# -- what a command reads ------------------------------------------------------------------


def read_paths(source: Path) -> dict[Path, str]:
    """Real path of everything reading `source` may touch → how it is reached (for messages):
    the source itself, targets of the links inside it, files its weight indexes name, and for a
    file its same-named siblings (`model.onnx.data`)."""
    root = source.resolve()
    found = {root: str(source)}
    if not root.is_dir():
        for sibling in root.parent.glob(glob.escape(root.name) + ".*"):
            found.setdefault(sibling.resolve(), f"the data file {sibling}")
        return found
    for folder, dirs, files in os.walk(root):  # links are not followed, their targets are counted
        for name in (*dirs, *files):
            path = Path(folder, name)
            if path.is_symlink():
                found.setdefault(path.resolve(), f"the link {path}")
            if name.endswith(".index.json") and path.is_file():
                found.update((real, f"the index {path}") for real in _index_entries(path) if real not in found)
    return found


def _index_entries(index: Path) -> list[Path]:
    """Real paths of the files a safetensors/pickle weight index names (none when it is malformed:
    the checkpoint reader reports that)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        return [(index.parent / entry).resolve() for entry in set(weight_map.values()) if isinstance(entry, str)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def check_disjoint(out: Path, sources: Iterable[Path]) -> Path:
    """The resolved `out`; BadInput when it is, lies inside, or contains anything a source reads."""
    out = out.resolve()
    for src in sources:
        root = src.resolve()
        if out == root or root in out.parents:
            raise BadInput(f"output {out} is inside the source {root}; choose an output folder outside it")
        if out in root.parents:
            raise BadInput(f"output {out} contains the source {root}; choose another output path")
        for real, how in read_paths(src).items():
            if real == out or out in real.parents:
                raise BadInput(f"output {out} contains {real}, read through {how}; choose an output path that holds none of the inputs")
            if real in out.parents:
                raise BadInput(f"output {out} is inside {real}, read through {how}; choose an output path outside the inputs")
    return out


def check_output(out: Path, *, overwrite: bool, sources: Iterable[Path] = ()) -> Path:
    """Refuse an output that exists (without overwrite) or that overlaps what a source reads."""
    out = check_disjoint(out, sources)
    if out.exists() and not overwrite:
        raise BadInput(f"output {out} already exists; pass --overwrite to replace it or choose another path")
    if out.exists() and not out.is_dir() and not out.is_file():
        raise BadInput(f"output {out} is neither a file nor a folder; remove it first")
    _refuse_foreign(out)
    return out


def _refuse_foreign(out: Path) -> None:
    """`--overwrite` replaces only what headfold wrote: never a folder of the user's (a typo'd OUT)."""
    if out.is_dir() and not out.is_symlink() and not written_by_headfold(out):
        raise BadInput(
            f"output {out} is a folder headfold did not write (none of {', '.join(OWN_RECORDS)} or an engine sidecar in it), "
            "which --overwrite never replaces; choose another path, or empty it yourself"
        )


# -- SIGTERM -------------------------------------------------------------------------------


class Terminated(SystemExit):
    """SIGTERM raised where it lands, so every `finally` runs; exit 143 like a shell reports it."""


def _on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
    sys.stderr.write("headfold: terminated (SIGTERM); removing partial outputs\n")
    raise Terminated(128 + signum)


@contextmanager
def cleanup_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM unwinds like Ctrl-C instead of killing outright (main thread only;
    a handler someone else installed is left alone)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# -- one writer ----------------------------------------------------------------------------


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _lock_fd(lock: Path, out: Path) -> int:
    """An fd holding flock(LOCK_EX) on `lock`, which still names that file (its previous holder
    unlinks it on release, so a lock taken on the unlinked inode would guard nothing)."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise BadInput(f"{out} is being written by another headfold process (pid {holder}); wait for it to finish or choose another output") from None
        try:
            if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold the exclusive lock `.OUT.lock` beside `out` (BadInput naming the holder's pid when
    another process has it); remove what dead writers left beside `out`."""
    lock = out.with_name(f".{out.name}.lock")
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # deepest first
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = _lock_fd(lock, out)
    except OSError as e:
        raise BadInput(f"cannot write {out}: {e.strerror} ({e.filename}); choose a writable location") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        with cleanup_on_sigterm():
            _remove_leftovers(out)
            yield
    except BaseException:
        lock.unlink(missing_ok=True)
        for folder in made:
            try:
                folder.rmdir()  # empty ones only: a failed write leaves no parent it made either
            except OSError:
                break
        raise
    finally:
        lock.unlink(missing_ok=True)  # before releasing: a waiter then retries on a fresh file
        os.close(fd)


def _remove_leftovers(out: Path) -> None:
    """Under the lock, no live writer owns another pid's temporary sibling."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(?:partial|old)-(\d+)")
    for path in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
        if (m := pattern.fullmatch(path.name)) and int(m[1]) != os.getpid():
            _remove(path)
            log.warning(f"headfold: removed {path}, left by writer pid {m[1]}, which stopped before finishing")


def _refuse_existing(out: Path, overwrite: bool, how: str, ours: bool) -> None:
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise BadInput(f"output {out} {how}; pass --overwrite to replace it or choose another path")
    if not ours:
        _refuse_foreign(out)


@contextmanager
def staging_folder(out: Path, *, overwrite: bool = False, ours: bool = False) -> Iterator[Path]:
    """Under `out`'s lock, the hidden sibling folder `.OUT.partial-PID`, removed at the end, on any
    error and on SIGTERM. `atomic_output` builds on it; a writer that moves several files into place
    itself (a graph and its `.onnx.data`) can use it directly. `ours`: the caller knows an existing
    `out` is headfold's (a state folder names it), so it need not carry one of its records."""
    with output_lock(out):
        _refuse_existing(out, overwrite, "already exists", ours)
        folder = out.with_name(f".{out.name}.partial-{os.getpid()}")
        try:
            _remove(folder)  # a dead process that had our pid
            folder.mkdir()
            yield folder
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise BadInput(f"no space left on the device while writing {out}; free some space or choose another output") from None
            raise
        finally:
            _remove(folder)


@contextmanager
def atomic_output(out: Path, *, is_dir: bool = True, overwrite: bool = False, ours: bool = False) -> Iterator[Path]:
    """Yield a temporary path named like `out` in its staging folder; on success it becomes `out`
    (replacing an existing one only with `overwrite`, and a folder only when headfold wrote it),
    on any error or signal it vanishes."""
    with staging_folder(out, overwrite=overwrite, ours=ours) as folder:
        tmp = folder / out.name
        if is_dir:
            tmp.mkdir()
        yield tmp
        _refuse_existing(out, overwrite, "appeared while this command ran", ours)  # a writer that skipped the lock
        try:
            _place(tmp, out)
        except OSError as e:
            why = "is it a mount point? choose a path inside it" if e.errno in (errno.EBUSY, errno.EXDEV) else "check the folder's permissions"
            raise BadInput(f"cannot move the finished output into place at {out} ({e.strerror}); {why}") from None


def _place(tmp: Path, out: Path) -> None:
    """Rename the finished `tmp` to `out` (the caller holds the lock and checked `overwrite`)."""
    exists = out.exists() or out.is_symlink()
    if exists and (tmp.is_dir() or out.is_dir()):  # rename(2) replaces a file by a file only
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        try:
            tmp.rename(out)
        except OSError:
            old.rename(out)  # put the previous output back
            raise
        _remove(old)
    else:
        os.replace(tmp, out)


# -- scratch folders -----------------------------------------------------------------------

_scratch_ids = itertools.count()


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A private temporary folder `TMPDIR/prefix-PID-N`, removed on exit, on error and on SIGTERM;
    folders of this prefix whose process is gone (kill -9) are removed first."""
    base = Path(tempfile.gettempdir())
    for path in base.glob(f"{glob.escape(prefix)}-*"):
        if (m := re.fullmatch(rf"{re.escape(prefix)}-(\d+)-\d+", path.name)) and not _alive(int(m[1])):
            _remove(path)
            log.warning(f"headfold: removed {path}, left by pid {m[1]}, which no longer runs")
    path = base / f"{prefix}-{os.getpid()}-{next(_scratch_ids)}"
    _remove(path)
    path.mkdir()
    with cleanup_on_sigterm():
        try:
            yield path
        finally:
            _remove(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
