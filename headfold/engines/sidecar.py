"""The engine sidecar (MODEL.engine.json): how an engine was built and from which ONNX graph.

`headfold verify` follows it from an engine to its source graph, the export.json next to that
graph, and the checkpoint export.json names — so an engine verifies like its ONNX graph does.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from headfold.engines.plan import BuildPlan, GraphPlan, sidecar_path
from headfold.ground import VERSION
from headfold.ground.errors import BadInput

FORMAT = "headfold.engine/1"
KEYS = (
    "format", "headfold", "created", "tensorrt", "gpu", "precision", "profiles", "ranges", "source",
    "plugins", "attention", "build_seconds", "workspace_bytes", "timing_cache",
)  # fmt: skip


def make_sidecar(plan: BuildPlan, graph: GraphPlan, *, gpu: dict[str, str], attention: dict[str, Any], seconds: float) -> dict[str, Any]:
    """The sidecar of `graph`'s engine (written next to it as .engine.json)."""
    return {
        "format": FORMAT,
        "headfold": VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tensorrt": plan.target.version,
        "gpu": gpu,
        "precision": {"name": plan.precision.name, "graph": plan.precision.graph, "strongly_typed": plan.precision.strongly_typed, "builder_flags": list(plan.precision.builder_flags)},
        "profiles": [graph.profile],
        "ranges": {name: str(r) for name, r in plan.ranges.items()},
        "source": {
            "onnx": str(graph.onnx),
            "onnx_relative": os.path.relpath(graph.onnx, graph.engine.parent),  # survives moving both folders
            "sha256": graph.sha256,
            "data_sha256": graph.data_sha256,
        },
        "plugins": graph.plugins,
        "attention": attention,
        "build_seconds": round(seconds, 2),
        "workspace_bytes": plan.workspace_bytes,
        "timing_cache": str(plan.timing_cache) if plan.timing_cache else None,
    }


def read_sidecar(engine: Path) -> dict[str, Any]:
    path = sidecar_path(engine)
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{engine} has no sidecar {path.name}; rebuild it with headfold build") from None
    except (OSError, json.JSONDecodeError) as err:
        raise BadInput(f"cannot read {path}: {str(err).splitlines()[0]}") from None
    if info.get("format") != FORMAT:
        raise BadInput(f"{path} is not a headfold engine sidecar ({FORMAT}); rebuild the engine with headfold build")
    return info


def source_onnx(engine: Path, info: dict[str, Any]) -> Path | None:
    """The graph the engine was built from, if it still exists (absolute path, else relative to the engine)."""
    source = info["source"]
    candidates = (Path(source["onnx"]), engine.parent / source["onnx_relative"])
    return next((p.resolve() for p in candidates if p.is_file()), None)


def summary(info: dict[str, Any]) -> dict[str, Any]:
    """The sidecar facts a verify report carries for an engine."""
    return {
        "tensorrt": info["tensorrt"],
        "gpu": info["gpu"].get("name"),
        "attention": info["attention"].get("verdict"),
        "source_sha256": info["source"]["sha256"],
    }
