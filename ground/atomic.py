"""The one output policy: every path a command writes appears whole or not at all, together with
the command's other outputs, from one writer, never over an input, never through a link.

A writer holds an exclusive lock on the sibling `.OUT.lock` (recording its pid; opened without
following a link, and refused when it is a link or a hard link to another file), builds in the
hidden sibling `.OUT.partial-PID` and renames it into place at the end; `atomic_outputs` does that
for all of a command's outputs at once and puts back the ones already placed when a later one
cannot be. Before any work an output is refused when it is a link, is or overlaps anything the
command reads (resolved real paths: files, links and index entries of the source folders), exists
without --overwrite, is of the other kind (a folder where a file goes, or a file where a folder
goes), or was not written by headfold (artifacts.written_by_headfold: the mark of a folder's records,
or of a file). Under the lock any other `.OUT.partial-*` / `.OUT.old-*` was left by a writer that died
(kill -9, power loss), so it is removed. SIGTERM, like SIGINT, unwinds and cleans up (exit 143); a
signal whose exception a library swallowed is raised again before any output is placed.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import glob
import itertools
import logging
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from headfold.ground.artifacts import MARK, OWN_RECORDS, hidden_sibling, hidden_stem, written_by_headfold
from headfold.ground.errors import BadInput
from headfold.ground.inputs import read_json

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
        weight_map = read_json(index, "")["weight_map"]
        return [(index.parent / entry).resolve() for entry in set(weight_map.values()) if isinstance(entry, str)]
    except (OSError, BadInput, ValueError, KeyError, TypeError, AttributeError):
        return []


def output_path(out: Path) -> Path:
    """`out` absolute with its parent folders resolved, its own name kept: a link there is the
    output's problem (refused), never followed."""
    out = Path(os.path.abspath(out))
    return out if out.name in ("", "..") else out.parent.resolve() / out.name


def check_parent(out: Path) -> None:
    """BadInput when a folder `out` would be made in is a file (or anything else that is not a folder)."""
    existing = next((p for p in out.parents if p.exists() or p.is_symlink()), None)
    if existing is not None and not existing.is_dir():
        raise BadInput(
            f"cannot write {out}: {existing} is {'a file, not a folder' if existing.is_file() else 'not a folder'}; choose a location under a folder"
        )


def check_disjoint(out: Path, sources: Iterable[Path]) -> Path:
    """`output_path(out)`; BadInput when its parent is a file, or it is, lies inside, or contains anything a source reads."""
    out = output_path(out)
    check_parent(out)
    for src in sources:
        root = src.resolve()
        if out == root or root in out.parents:
            raise BadInput(f"output {out} is inside the source {root}; choose an output path outside it")
        if out in root.parents:
            raise BadInput(f"output {out} contains the source {root}; choose another output path")
        for real, how in read_paths(src).items():
            if real == out or out in real.parents:
                raise BadInput(f"output {out} contains {real}, read through {how}; choose an output path that holds none of the inputs")
            if real in out.parents:
                raise BadInput(f"output {out} is inside {real}, read through {how}; choose an output path outside the inputs")
    return out


def check_output(out: Path, *, overwrite: bool, sources: Iterable[Path] = (), is_dir: bool | None = None) -> Path:
    """Refuse an output that exists (without overwrite), is a link, is of the other kind (`is_dir`:
    a folder or a file is expected; None: either), is not headfold's, or overlaps what a source reads."""
    out = check_disjoint(out, sources)
    _refuse_existing(out, overwrite, "already exists", ours=False, is_dir=is_dir)
    return out


def refuse_link(out: Path) -> None:
    """BadInput when `out` is a symbolic link (dangling or not), or its lock file is not one headfold
    could have made (a link, a hard link to another file, a FIFO): headfold never writes through one."""
    if out.is_symlink():
        raise BadInput(f"output {out} is a symbolic link (to {os.readlink(out)}); headfold never writes through a link: remove it or choose another path")
    lock = lock_path(out)
    if lock.is_symlink():
        raise BadInput(f"{lock} is a symbolic link (to {os.readlink(lock)}), not headfold's lock file; remove it")
    if lock.exists() and (not lock.is_file() or lock.stat().st_nlink != 1):
        raise BadInput(f"{lock} is not headfold's lock file (a special file or a hard link to another one); remove it")


def lock_path(out: Path) -> Path:
    return hidden_sibling(out, "lock")


def _refuse_existing(out: Path, overwrite: bool, how: str, ours: bool, is_dir: bool | None = None) -> None:
    """The checks on what is at `out` now: see check_output; `ours`: the caller knows it is headfold's."""
    refuse_link(out)
    if not out.exists():
        return
    if not overwrite:
        raise BadInput(f"output {out} {how}; pass --overwrite to replace it or choose another path")
    if not out.is_dir() and not out.is_file():
        raise BadInput(f"output {out} is neither a file nor a folder; remove it first")
    if is_dir is not None and out.is_dir() != is_dir:
        wanted, found = ("a folder", "a file") if is_dir else ("a file", "a folder")
        raise BadInput(f"output {out} is {found}, and this command writes {wanted} there, which --overwrite never does; choose another path")
    if not ours and not written_by_headfold(out):
        what = f"none of {', '.join(OWN_RECORDS)} or an engine sidecar with headfold's mark in it" if out.is_dir() else f"no '{MARK}' mark in it"
        raise BadInput(
            f"output {out} is a {'folder' if out.is_dir() else 'file'} headfold did not write ({what}), which --overwrite never replaces; "
            "choose another path, or remove it yourself"
        )


# -- SIGTERM -------------------------------------------------------------------------------


class Terminated(SystemExit):
    """SIGTERM raised where it lands, so every `finally` runs; exit 143 like a shell reports it."""


_signalled: list[int] = []  # the signals that arrived inside cleanup_on_sigterm, in order


def _on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
    _signalled.append(signum)
    sys.stderr.write("headfold: terminated (SIGTERM); removing partial outputs\n")
    raise Terminated(128 + signum)


def _on_sigint(signum: int, frame: object) -> None:
    _signalled.append(signum)
    raise KeyboardInterrupt


def raise_if_signalled() -> None:
    """Raise again the exception of a signal that arrived while inside cleanup_on_sigterm. Raised where
    it lands, it is lost when that is a __del__ or a weakref callback of a library ("Exception ignored
    in …"), and the command would run on and write its outputs; it is checked again before any output
    is placed (and at each training step), so a signal always stops the command."""
    if _signalled:
        raise Terminated(128 + _signalled[-1]) if _signalled[-1] == signal.SIGTERM else KeyboardInterrupt


def _unraisable(hook: Callable[[Any], None]) -> Callable[[Any], None]:
    """sys.unraisablehook that is quiet about a signal's exception (raise_if_signalled raises it again)."""

    def quiet(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)):
            hook(unraisable)

    return quiet


@contextmanager
def cleanup_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM unwinds like Ctrl-C instead of killing outright, and both are recorded for
    raise_if_signalled (main thread only; handlers someone else installed are left alone)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    own_sigint, hook = signal.getsignal(signal.SIGINT) is signal.default_int_handler, sys.unraisablehook
    _signalled.clear()
    signal.signal(signal.SIGTERM, _on_sigterm)
    if own_sigint:
        signal.signal(signal.SIGINT, _on_sigint)
    sys.unraisablehook = _unraisable(hook)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if own_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)


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
        try:  # never through a link planted at the lock's name: it would truncate what it points at
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise BadInput(f"{lock} is a symbolic link (to {os.readlink(lock)}), not headfold's lock file; remove it") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # a FIFO, or a hard link to another file
            os.close(fd)
            raise BadInput(f"{lock} is not headfold's lock file (a special file or a hard link to another one); remove it")
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
    lock = lock_path(out)
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # deepest first
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = _lock_fd(lock, out)
    except OSError as e:
        check_parent(out)
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
    stem = hidden_stem(out)
    pattern = re.compile(rf"{re.escape(stem)}\.(?:partial|old)-(\d+)")
    for path in out.parent.glob(f"{glob.escape(stem)}.*-*"):
        if (m := pattern.fullmatch(path.name)) and int(m[1]) != os.getpid():
            _remove(path)
            log.warning(f"headfold: removed {path}, left by writer pid {m[1]}, which stopped before finishing")


@contextmanager
def staging_folder(out: Path, *, overwrite: bool = False, ours: bool = False, is_dir: bool | None = None) -> Iterator[Path]:
    """Under `out`'s lock, the hidden sibling folder `.OUT.partial-PID`, removed at the end, on any
    error and on SIGTERM. `atomic_output(s)` build on it. `ours`: the caller knows an existing `out`
    is headfold's (a state folder names it), so it need not carry one of its records."""
    out = output_path(out)
    with output_lock(out):
        _refuse_existing(out, overwrite, "already exists", ours, is_dir)
        folder = hidden_sibling(out, f"partial-{os.getpid()}")
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


Outputs = Mapping[Path, bool] | Iterable[tuple[Path, bool]]  # each output path → whether it is a folder


def check_outputs(outputs: Outputs, *, overwrite: bool, sources: Iterable[Path] = (), ours: bool = False, beside: Iterable[Path] = ()) -> dict[Path, bool]:
    """What atomic_outputs refuses, checked before the work: {output_path: is_dir}. `beside`: the
    command's other outputs, written on their own (a --json FILE's command writes OUT): none of
    `outputs` may be one of them, hold one or lie inside one."""
    sources, pairs = list(sources), list(outputs.items() if isinstance(outputs, Mapping) else outputs)
    paths = {check_disjoint(out, sources): is_dir for out, is_dir in pairs}
    if len(paths) < len(pairs):
        raise BadInput(f"two outputs name the same path ({', '.join(sorted(map(str, (p for p, _ in pairs))))}); give each its own")
    others = [output_path(other) for other in beside]
    for out, is_dir in paths.items():
        if out in others:
            raise BadInput(f"two outputs name the same path ({out}); give each its own")
        if inner := [o for o in [*paths, *others] if out in o.parents]:
            raise BadInput(f"output {inner[0]} lies inside output {out}; give them separate paths")
        if outer := [o for o in others if o in out.parents]:
            raise BadInput(f"output {out} lies inside output {outer[0]}; give them separate paths")
        _refuse_existing(out, overwrite, "already exists", ours, is_dir)
    return paths


@contextmanager
def atomic_outputs(outputs: Outputs, *, overwrite: bool = False, ours: bool = False, sources: Iterable[Path] = ()) -> Iterator[dict[Path, Path]]:
    """The one way headfold writes what a user names: `outputs` maps each path to whether it is a
    folder; yields each path's temporary twin (a folder made, a file for the caller to write), built
    in its staging folder beside it. On success all of them are moved into place together (one
    put back if a later one cannot be); on any error or signal none is. Refused before any work:
    a link at a path, a path that is or overlaps anything `sources` read, the same path twice, an
    existing one without `overwrite`, one of the other kind or not written by headfold (`ours`:
    the caller knows it is)."""
    sources, pairs = list(sources), list(outputs.items() if isinstance(outputs, Mapping) else outputs)
    paths = check_outputs(pairs, overwrite=overwrite, sources=sources, ours=ours)
    with ExitStack() as stack:
        staged = {}
        for out, is_dir in sorted(paths.items()):  # locks in one order: two commands never deadlock
            staged[out] = stack.enter_context(staging_folder(out, overwrite=overwrite, ours=ours, is_dir=is_dir)) / out.name
            if is_dir:
                staged[out].mkdir()
        yield {original: staged[output_path(original)] for original, _ in pairs}
        raise_if_signalled()  # a Ctrl-C or SIGTERM a library swallowed: no output is placed after one
        for out, is_dir in paths.items():  # a writer that skipped the lock, or an input that appeared there
            _refuse_existing(out, overwrite, "appeared while this command ran", ours, is_dir)
            check_disjoint(out, sources)
        _place_all([(staged[out], out) for out in paths])


@contextmanager
def atomic_output(out: Path, *, is_dir: bool = True, overwrite: bool = False, ours: bool = False, sources: Iterable[Path] = ()) -> Iterator[Path]:
    """atomic_outputs for one path: yield its temporary twin; on success it becomes `out`."""
    with atomic_outputs([(out, is_dir)], overwrite=overwrite, ours=ours, sources=sources) as staged:
        yield staged[out]


def _place_all(moves: list[tuple[Path, Path]]) -> None:
    """Rename each finished temporary to its output (the caller holds the locks and checked
    `overwrite`); when one fails, the ones already placed are put back as they were."""
    done: list[tuple[Path, Path, Path | None]] = []
    try:
        for tmp, out in moves:
            done.append((tmp, out, _place(tmp, out)))
    except OSError as e:
        for tmp, out, old in reversed(done):
            out.rename(tmp)
            if old is not None:
                old.rename(out)
        why = "is it a mount point? choose a path inside it" if e.errno in (errno.EBUSY, errno.EXDEV) else "check the folder's permissions"
        raise BadInput(f"cannot move the finished output into place at {moves[len(done)][1]} ({e.strerror}); {why}") from None
    for _, _, old in done:
        if old is not None:
            _remove(old)


def _place(tmp: Path, out: Path) -> Path | None:
    """Rename `tmp` to `out`. An existing `out` is kept as `.OUT.old-PID`, returned for the caller
    to remove or put back: a file by a second link, so rename(2) replaces it with no moment
    without one; a folder (rename replaces no folder) by moving it aside first."""
    if not (out.exists() or out.is_symlink()):
        tmp.rename(out)
        return None
    old = hidden_sibling(out, f"old-{os.getpid()}")
    _remove(old)
    if out.is_file() and tmp.is_file():
        try:
            os.link(out, old)
            os.replace(tmp, out)
            return old
        except OSError:
            _remove(old)  # a file system without hard links: the folder way below
    out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)  # put the previous output back
        raise
    return old


# -- scratch folders -----------------------------------------------------------------------

_scratch_ids: dict[str, itertools.count] = collections.defaultdict(itertools.count)  # per prefix: names stay predictable


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A private temporary folder `TMPDIR/prefix-PID-N`, removed on exit, on error and on SIGTERM;
    folders of this prefix whose process is gone (kill -9) are removed first."""
    base = Path(tempfile.gettempdir())
    for path in base.glob(f"{glob.escape(prefix)}-*"):
        if (m := re.fullmatch(rf"{re.escape(prefix)}-(\d+)-\d+", path.name)) and not _alive(int(m[1])):
            _remove(path)
            log.warning(f"headfold: removed {path}, left by pid {m[1]}, which no longer runs")
    path = base / f"{prefix}-{os.getpid()}-{next(_scratch_ids[prefix])}"
    _remove(path)
    path.mkdir()
    with cleanup_on_sigterm():
        try:
            yield path
        finally:
            _remove(path)


LIBRARY_SCRATCH = {"TMPDIR": "", "TORCHINDUCTOR_CACHE_DIR": "torchinductor"}  # variable → sub-folder


@contextmanager
def library_scratch() -> Iterator[Path]:
    """A command's own scratch folder for what libraries leave in the temp folder (ONNX Runtime's
    session file, torch's inductor cache): those variables point into it while the command runs,
    and it is removed at exit, on error and on SIGTERM. Python's own temp files stay where they were."""
    tempfile.gettempdir()  # cached now: scratch_dir and tempfile keep the user's TMPDIR
    with scratch_dir("headfold-scratch") as folder:
        saved = {name: os.environ.get(name) for name in LIBRARY_SCRATCH}
        os.environ.update({name: str(folder / sub) for name, sub in LIBRARY_SCRATCH.items()})
        try:
            yield folder
        finally:
            for name, value in saved.items():
                os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
