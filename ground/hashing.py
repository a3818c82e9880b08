"""The digests and version lists headfold writes into its manifests, reports and sidecars."""

from __future__ import annotations

import hashlib
import mmap
import platform
import shutil
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def update_from_file(digest: Any, path: Path, offset: int, nbytes: int) -> None:
    """Feed bytes [offset, offset + nbytes) of a file to `digest` straight from the page cache
    (mmap, no copy into Python); unmapping keeps them out of the caller's RSS. hashlib releases
    the GIL while it hashes, so this overlaps other threads' work."""
    if nbytes == 0:
        return
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f, mmap.mmap(f.fileno(), offset + nbytes - start, offset=start, access=mmap.ACCESS_READ) as m:
        with memoryview(m) as view:
            digest.update(view[offset - start :])


def copy_hashed(src: Path, dst: Path) -> str:
    """Copy a file (content and mode; the kernel copies) and return the sha256 of what was copied."""
    shutil.copyfile(src, dst)
    shutil.copymode(src, dst)
    return sha256_file(dst)


def versions(packages: Iterable[str]) -> dict[str, str]:
    """Python's version and each package's installed version ("not installed" when missing)."""
    found = {"python": platform.python_version()}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found
