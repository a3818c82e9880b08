"""Shared fixtures: tiny checkpoints are built once per session and never modified."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub: everything is built in-process
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from tiny_models import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """tiny_checkpoint(model_type, **kwargs) → a cached source checkpoint folder (treat as read-only)."""
    cache: dict[tuple, Path] = {}

    def get(model_type: str, **kwargs) -> Path:
        key = (model_type, tuple(sorted(kwargs.items(), key=str)))
        if key not in cache:
            cache[key] = make_checkpoint(model_type, tmp_path_factory.mktemp(model_type), **kwargs)
        return cache[key]

    return get
