"""Both tiers: the shared session fixtures (tests/support/fixtures.py), and each test marked `unit` or
`integration` by its folder, so `pytest -m unit` runs the fast tier alone."""

from __future__ import annotations

import shutil
import tempfile

import pytest
from support.fixtures import tiny_checkpoint, tiny_export, tmpfs  # noqa: F401  (fixtures are found by name)

TIERS = ("unit", "integration")
FREE_AT_START = pytest.StashKey[str]()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = next((part for part in item.path.relative_to(item.config.rootpath).parts if part in TIERS), None)
        if tier:
            item.add_marker(tier)


def _free_disk() -> str:
    return f"{shutil.disk_usage(tempfile.gettempdir()).free / 2**30:.1f} GiB"


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[FREE_AT_START] = _free_disk()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The free disk where tests write, before and after: a run that fails part-way on a full disk says so."""
    terminalreporter.write_line(f"free disk under {tempfile.gettempdir()}: {config.stash[FREE_AT_START]} at the start, {_free_disk()} at the end")
