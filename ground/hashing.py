"""The digests and version lists headfold writes into its manifests, reports and sidecars."""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def versions(packages: Iterable[str]) -> dict[str, str]:
    """Python's version and each package's installed version ("not installed" when missing)."""
    found = {"python": platform.python_version()}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found
