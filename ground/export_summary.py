"""export.json, written by `headfold export`: what the graphs in an export folder are and which
checkpoint they came from. `headfold build`, `verify` and the lint read it through `load`.

Format 1 added the `format` key; a file without it (older headfold) loads the same. Facts added
over time (`attention`, `optimize`, `layout`) are None when an older file lacks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headfold.ground.artifacts import EXPORT_SUMMARY, Record, keep_unknown, load_record, mark, optional
from headfold.ground.inputs import contained
from headfold.ground.precision import Precision

FORMAT = 1


@dataclass(kw_only=True)
class ExportSummary(Record):
    format: int = FORMAT
    created_by: str = mark()  # --overwrite replaces the folder only with this mark in it
    source: str  # the checkpoint folder as it was given to export (relative to where export ran)
    model_type: str | None = None
    opset: int | None = None
    dtype: Precision = Precision.FP32  # an unknown one: the file is corrupt
    attention: str | None = None  # onnx | ort-gqa
    layers: int | None = None
    heads: int | None = None
    kv_heads: int | list[int] | None = None  # one count, or one per layer
    optimize: str | None = None
    layout: str | None = None  # merged | split | encoder
    graphs: dict[str, dict[str, Any]]  # graph file -> its export facts (nodes, fusions, …)
    genai: dict[str, Any] | None = optional()  # merged decoders: the onnxruntime-genai model folder
    quantization: dict[str, Any] | None = optional()  # dtype int4: how the MatMul weights were quantized
    extra: dict[str, Any] = keep_unknown()

    def save_in(self, folder: Path) -> None:
        self.save(Path(folder) / EXPORT_SUMMARY)


def fix(folder: Path) -> str:
    return f"re-run headfold export into {folder}"


def exists(folder: Path) -> bool:
    return (Path(folder) / EXPORT_SUMMARY).is_file()


def load(folder: Path) -> ExportSummary:
    """The export.json in `folder`; BadInput when it is corrupt or names a graph outside `folder`."""
    summary = load_record(ExportSummary, Path(folder) / EXPORT_SUMMARY, fix(folder))
    for name in summary.graphs:  # every reader finds its graphs here: none may lead out of the folder
        contained(Path(folder), name, EXPORT_SUMMARY, fix(folder))
    return summary


def export_source(summary: ExportSummary, folder: Path) -> Path | None:
    """The source checkpoint an export.json (in `folder`) names, if it still exists."""
    source = Path(summary.source)
    candidates = [source] if source.is_absolute() else [Path.cwd() / source, folder.parent / source]
    return next((p.resolve() for p in candidates if (p / "config.json").is_file()), None)


def graph_source(graph: Path) -> Path | None:
    """The checkpoint a graph was exported from, through the export.json next to it (None if unknown)."""
    folder = graph.resolve().parent
    return export_source(load(folder), folder) if exists(folder) else None
