"""The installed package's layout: pyproject's package-dir maps headfold.converter, headfold.graphs,
headfold.plugins and headfold.ground to top-level folders, which tools that read a package from its
folder tree (grimp, mypy) cannot follow; `laid_out` copies the sources as `pip install .` lays them out."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"


def package_dirs() -> dict[str, Path]:
    """Installed package name (headfold, headfold.converter, ...) → its source folder."""
    mapping = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def laid_out(into: Path) -> Path:
    """The package's sources copied under `into` as installed (modification times kept); returns `into`."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "data")
    for name, folder in sorted(package_dirs().items()):  # headfold before headfold.converter, ...
        shutil.copytree(folder, into.joinpath(*name.split(".")), ignore=ignore, dirs_exist_ok=True)
    return into


def source_path(installed: str) -> str:
    """headfold/converter/local.py (as laid out) → converter/local.py (in the repository)."""
    for name, folder in sorted(package_dirs().items(), key=lambda item: -len(item[0])):
        prefix = name.replace(".", "/") + "/"
        if installed.startswith(prefix):
            return str((folder / installed[len(prefix) :]).relative_to(ROOT))
    return installed
