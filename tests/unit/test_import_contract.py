"""The layers of docs/design.md are what the imports do: import-linter's contracts in pyproject.toml
(`[tool.importlinter]`) hold, and no private name crosses from one room into another.

grimp reads a package from its folder tree, and the editable install maps headfold.converter,
headfold.graphs, headfold.plugins and headfold.ground to top-level folders, so the contracts are
checked on a copy laid out as `pip install .` lays the package out (following pyproject's package-dir)."""

from __future__ import annotations

import ast
import graphlib
import os
import subprocess
import sys
from pathlib import Path

from support.layout import PYPROJECT, ROOT, laid_out, package_dirs


def test_import_contracts_hold(tmp_path: Path) -> None:
    laid_out(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([lint, "--no-cache", "--no-logo", PYPROJECT], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _room(module: str) -> str:
    """headfold.graphs.rewrite.cleanup → headfold.graphs; headfold.cli → headfold.cli."""
    return ".".join(module.split(".")[:2])


def _imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every absolute import of headfold in `path`; name "" for `import x`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:  # `from headfold import corpus` imports the module headfold.corpus
                module = f"headfold.{alias.name}" if node.module == "headfold" else node.module
                found.append((node.lineno, module, alias.name))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, "") for alias in node.names]
    return [(line, module, name) for line, module, name in found if module.startswith("headfold.")]


def test_no_private_name_crosses_rooms() -> None:
    crossings = []
    for package, folder in package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            module = ".".join((package, *parts))
            for line, imported, name in _imports(path):
                private = [p for p in (*imported.split("."), name) if p.startswith("_") and not p.startswith("__")]
                if private and _room(imported) != _room(module):
                    crossings.append(f"{path.relative_to(ROOT)}:{line} imports {' '.join(private)} from {imported}")
    assert not crossings, "private names imported across rooms:\n" + "\n".join(crossings)


def test_no_files_import_each_other_in_a_loop() -> None:
    """No circle, not even one broken by an import inside a function (import-linter's layers see
    only the rooms): a name two files need lives in the one that the other imports."""
    modules: dict[str, Path] = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            modules[".".join((package, *parts))] = path
    graph = {module: set() for module in modules}
    for module, path in modules.items():
        for _, imported, name in _imports(path):
            target = f"{imported}.{name}" if f"{imported}.{name}" in modules else imported
            if target in modules and target != module:
                graph[module].add(target)
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as err:
        raise AssertionError(f"files import each other in a loop: {' -> '.join(err.args[1])}") from None
