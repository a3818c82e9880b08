"""Both tiers: the shared session fixtures (tests/support/fixtures.py), and each test marked `unit` or
`integration` by its folder, so `pytest -m unit` runs the fast tier alone."""

from __future__ import annotations

import pytest
from support.fixtures import tiny_checkpoint, tiny_export, tmpfs  # noqa: F401  (fixtures are found by name)

TIERS = ("unit", "integration")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = next((part for part in item.path.relative_to(item.config.rootpath).parts if part in TIERS), None)
        if tier:
            item.add_marker(tier)
