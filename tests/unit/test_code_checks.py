"""The code checks itself: ruff's lint and format check over the repository, and mypy over the
package as installed (configuration in pyproject.toml). A new finding fails the suite, named by its
file in the repository."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from support.layout import PYPROJECT, ROOT, laid_out, source_path

BIN = Path(sys.executable).parent


def _run(*args: object, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True)


def test_ruff_finds_nothing() -> None:
    done = _run(BIN / "ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_changes_nothing() -> None:
    done = _run(BIN / "ruff", "format", "--no-cache", "--check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing(tmp_path: Path) -> None:
    laid_out(tmp_path / "src")
    done = _run(sys.executable, "-m", "mypy", "--config-file", PYPROJECT, "--cache-dir", tmp_path / "cache", "-p", "headfold", cwd=tmp_path / "src")
    found = re.sub(r"^(headfold/\S+?\.py)", lambda m: source_path(m.group(1)), done.stdout, flags=re.MULTILINE)
    assert done.returncode == 0, found + done.stderr


def _bare_sibling_imports(folder: Path, siblings: set[str]) -> list[str]:
    """`import x` / `from x import y` in folder/*.py where x is a module that only a sys.path entry for `folder` finds."""
    found = []
    for file in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{file.relative_to(ROOT)}:{node.lineno} imports {name}" for name in names if name.split(".")[0] in siblings]
    return found


def test_benchmarks_and_tests_import_each_other_as_packages() -> None:
    """A benchmark imports another as `benchmarks.x`, a test shares helpers through tests/support, never a test module."""
    benchmarks = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__"}
    test_modules = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    assert _bare_sibling_imports(ROOT / "benchmarks", benchmarks) + _bare_sibling_imports(ROOT / "tests", test_modules) == []
