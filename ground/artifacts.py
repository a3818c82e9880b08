"""The names of the files headfold writes and reads back, spelled once.

A stage finds another stage's output through these names only; what is inside each file is
the writing stage's business.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from headfold.ground.errors import read_json_object

MANIFEST = "headfold.json"  # headfold convert / distill: how a checkpoint was made
EXPORT_SUMMARY = "export.json"  # headfold export: graphs, layout, dtype and the source checkpoint
GENAI_CONFIG = "genai_config.json"  # headfold export: onnxruntime-genai's model folder config
LEDGER = "stages.json"  # headfold run: per stage its key, output digest and timing


def read_export_summary(folder: Path) -> dict[str, Any]:
    """The export.json in `folder`; BadInput when it is corrupt."""
    return read_json_object(folder / EXPORT_SUMMARY, f"re-run headfold export into {folder}")


def export_source(summary: dict[str, Any], folder: Path) -> Path | None:
    """The source checkpoint an export.json (in `folder`) names, if it still exists."""
    source = Path(summary.get("source", ""))
    candidates = [source] if source.is_absolute() else [Path.cwd() / source, folder.parent / source]
    return next((p.resolve() for p in candidates if (p / "config.json").is_file()), None)


def graph_source(graph: Path) -> Path | None:
    """The checkpoint a graph was exported from, through the export.json next to it (None if unknown)."""
    folder = graph.resolve().parent
    if not (folder / EXPORT_SUMMARY).is_file():
        return None
    return export_source(read_export_summary(folder), folder)
