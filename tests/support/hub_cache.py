"""A Hugging Face hub cache entry laid out in-process, as huggingface_hub writes one:
HUB/models--ORG--NAME/{refs/REF, snapshots/COMMIT/<file → ../../blobs/SHA>, blobs/SHA}."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def cache_entry(hub: Path, repo_id: str, folder: Path, *, ref: str = "main", commit: str | None = None) -> Path:
    """Put the files of `folder` into the cache `hub` as repo `repo_id` at `commit` (default: a digest
    of the files) named by `ref`; the snapshot folder."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    commit = commit or hashlib.sha1("".join(digests.values()).encode()).hexdigest()
    repo = Path(hub) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    for path, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot
