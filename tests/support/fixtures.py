"""Session fixtures (imported by tests/conftest.py): tiny checkpoints and their ONNX exports are built once per session and never modified."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub: everything is built in-process
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from support.tiny_models import make_checkpoint  # noqa: E402


def _key(*args, **kwargs) -> tuple:
    return (*args, tuple(sorted(kwargs.items(), key=str)))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """tiny_checkpoint(model_type, **kwargs) → a cached source checkpoint folder (treat as read-only)."""
    cache: dict[tuple, Path] = {}

    def get(model_type: str, **kwargs) -> Path:
        key = _key(model_type, **kwargs)
        if key not in cache:
            cache[key] = make_checkpoint(model_type, tmp_path_factory.mktemp(model_type), **kwargs)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_export(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """tiny_export(model_type, kv_heads=None, checkpoint=None, **export_options) → (checkpoint, ONNX folder).

    tiny_checkpoint(model_type, **checkpoint) converted to `kv_heads` (None: as is, MHA) with the
    default method, then exported by headfold.graphs.export with `export_options` (default graphs="split").
    A torch export of a tiny model costs 15-30 CPU seconds, so the modules that need the same graphs
    share one: treat both folders as read-only.
    """
    from headfold import convert  # imported on first use: collecting the tests stays cheap
    from headfold.graphs.export import export

    cache: dict[tuple, tuple[Path, Path]] = {}

    def get(model_type: str, kv_heads: int | None = None, checkpoint: dict | None = None, **export_options) -> tuple[Path, Path]:
        checkpoint, export_options = checkpoint or {}, {"graphs": "split", **export_options}
        key = (_key(model_type, **checkpoint), kv_heads, _key(**export_options))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{model_type}-kv{kv_heads or 'mha'}-export")
            source = tiny_checkpoint(model_type, **checkpoint)
            if kv_heads is not None:
                source = convert(source, folder / "checkpoint", kv_heads, method="mean", progress=False)
            export(source, folder / "onnx", progress=False, **export_options)
            cache[key] = source, folder / "onnx"
        return cache[key]

    return get


@pytest.fixture
def tmpfs(tmp_path: Path):
    """mount(options, at=None) → a fresh tmpfs (mount -o OPTIONS) at `at` or a new folder, unmounted
    afterwards; skips where this machine cannot mount one (needs root or CAP_SYS_ADMIN)."""
    mounts: list[Path] = []

    def mount(options: str, at: Path | None = None) -> Path:
        point = at or tmp_path / f"tmpfs{len(mounts)}"
        point.mkdir(exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", point], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or 'mount failed'}); needs root or CAP_SYS_ADMIN")
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        if subprocess.run(["umount", point]).returncode:
            subprocess.run(["umount", "-l", point])  # detach it anyway; the test has failed already
