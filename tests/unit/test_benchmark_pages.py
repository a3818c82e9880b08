"""docs/benchmarks.md and the README's figures are generated from benchmarks/results/*.json
(benchmarks/render.py): every results file renders, an unknown shape is an error, and the pages in
the repository are what the results give."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def render():
    return importlib.import_module("benchmarks.render")


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results").glob("*.json")), ids=lambda p: p.name)
def test_every_results_file_renders(render, path: Path) -> None:
    """Its section says what the file measures and shows every row: each row's model, family and method appear."""
    section, data = render.render_file(path), json.loads(path.read_text())
    assert section.startswith(f"## `{path.name}`") and "|---|" in section
    rows, what = (data.get("rows", []), data.get("what")) if isinstance(data, dict) else (data, None)  # some files are a bare list of rows
    assert not isinstance(what, str) or what[:60] in section
    named = {row[key] for row in rows if isinstance(row, dict) for key in ("model", "family", "method") if isinstance(row.get(key), str)}
    assert sorted(name for name in named if name not in section) == []


def test_pages_are_what_the_results_give() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.render", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    readme = (ROOT / "README.md").read_text()
    assert "<!-- results:headline -->\nMeasured:" in readme  # the marker is filled, not empty


def test_a_file_of_unknown_shape_is_an_error(render, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "export_throughput.json").write_text(json.dumps({"what": "new benchmark", "rows": [{"model": "x", "s": 1.5}]}))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    monkeypatch.setattr(render, "ROOT", tmp_path)
    assert "| model | s |" in render.benchmarks_page()  # the standard shape needs no renderer

    (tmp_path / "export_throughput.json").write_text(json.dumps({"series": {"a": [1, 2]}}))
    with pytest.raises(render.RenderError, match="export_throughput.json: cannot render it"):
        render.benchmarks_page()
    (tmp_path / "export_throughput.json").write_text(json.dumps({"what": "nested", "rows": [{"model": {"layers": 2}}]}))
    with pytest.raises(render.RenderError, match="export_throughput.json"):
        render.benchmarks_page()
    (tmp_path / "export_throughput.json").unlink()
    (tmp_path / "generate_throughput_new.json").write_text(json.dumps({"rows": []}))  # a known benchmark's file must fit its renderer
    with pytest.raises(render.RenderError, match="generate_throughput_new.json.*generate_throughput"):
        render.benchmarks_page()


def test_an_unknown_marker_is_an_error(render, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(render, "ROOT", tmp_path)
    page = tmp_path / "page.md"
    with pytest.raises(render.RenderError, match="unknown marker results:nonsense"):
        render.fill_markers("<!-- results:nonsense -->\n<!-- /results:nonsense -->\n", page)


def test_the_default_method_is_the_zoo_rankings_winner(render) -> None:
    """DEFAULT_METHOD is the method docs/methods.md's rule chooses from the zoo's results: a default changed without
    the measurements that choose it, or results that no longer choose it, fail here."""
    from headfold.converter.recipes import DEFAULT_METHOD

    data = json.loads((ROOT / "benchmarks" / "results" / "zoo_quality.json").read_text())
    assert next(iter(render.zoo_ranks(data))) == data["default_method"] == DEFAULT_METHOD
