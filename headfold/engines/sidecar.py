"""The engine sidecar (MODEL.engine.json): how an engine was built and from which ONNX graph.

`headfold verify` follows it from an engine to its source graph, the export.json next to that
graph, and the checkpoint export.json names — so an engine verifies like its ONNX graph does.
Its `format` has been "headfold.engine/1" since the first sidecar; a file with another is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from headfold.engines.plan import BuildPlan, GraphPlan, sidecar_path
from headfold.ground import VERSION
from headfold.ground.artifacts import Malformed, Record, keep_unknown
from headfold.ground.errors import BadInput, first_line
from headfold.ground.precision import Precision

FORMAT = "headfold.engine/1"


class NotASidecar(Malformed):
    """A JSON file without the sidecar's format: some other file, not a damaged sidecar."""


@dataclass(kw_only=True)
class EnginePrecision(Record):
    name: Precision  # what the engine computes in
    graph: Precision  # the graph's own weight precision
    strongly_typed: bool
    builder_flags: list[str]


@dataclass(kw_only=True)
class EngineSource(Record):
    onnx: str
    onnx_relative: str  # relative to the engine's folder: survives moving both folders
    sha256: str
    data_sha256: str | None  # the .onnx.data weights, when external


@dataclass(kw_only=True)
class EngineSidecar(Record):
    format: str = FORMAT
    headfold: str = VERSION
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    tensorrt: str
    gpu: dict[str, str]
    precision: EnginePrecision
    profiles: list[dict[str, list[list[int]]]]
    ranges: dict[str, str]  # option -> "min:opt:max"
    source: EngineSource
    plugins: list[str]
    attention: dict[str, Any]  # the inspector's verdict (build.attention_verdict)
    build_seconds: float
    workspace_bytes: int | None
    timing_cache: str | None
    extra: dict[str, Any] = keep_unknown()

    @classmethod
    def from_dict(cls, data: Any) -> EngineSidecar:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise NotASidecar(f"format is not {FORMAT}")
        return super().from_dict(data)

    def summary(self) -> dict[str, Any]:
        """The sidecar facts a verify report carries for an engine."""
        return {"tensorrt": self.tensorrt, "gpu": self.gpu.get("name"), "attention": self.attention.get("verdict"), "source_sha256": self.source.sha256}


KEYS = tuple(f.name for f in dataclasses.fields(EngineSidecar) if f.name != "extra")


def make_sidecar(plan: BuildPlan, graph: GraphPlan, *, gpu: dict[str, str], attention: dict[str, Any], seconds: float) -> EngineSidecar:
    """The sidecar of `graph`'s engine (written next to it as .engine.json)."""
    precision = plan.precision
    return EngineSidecar(
        tensorrt=plan.target.version,
        gpu=gpu,
        precision=EnginePrecision(
            name=precision.name, graph=precision.graph, strongly_typed=precision.strongly_typed, builder_flags=list(precision.builder_flags)
        ),
        profiles=[graph.profile],
        ranges={name: str(r) for name, r in plan.ranges.items()},
        source=EngineSource(
            onnx=str(graph.onnx), onnx_relative=os.path.relpath(graph.onnx, graph.engine.parent), sha256=graph.sha256, data_sha256=graph.data_sha256
        ),
        plugins=graph.plugins,
        attention=attention,
        build_seconds=round(seconds, 2),
        workspace_bytes=plan.workspace_bytes,
        timing_cache=str(plan.timing_cache) if plan.timing_cache else None,
    )


def save_sidecar(engine: Path, sidecar: EngineSidecar) -> None:
    sidecar.save(sidecar_path(engine))


def load_sidecar(engine: Path) -> EngineSidecar:
    """The sidecar of `engine`; BadInput naming the fix when it is missing, unreadable or not headfold's."""
    path = sidecar_path(engine)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{engine} has no sidecar {path.name}; rebuild it with headfold build") from None
    except (OSError, ValueError) as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadInput(f"cannot read {path}: {first_line(err)}") from None
    try:
        return EngineSidecar.from_dict(data)
    except NotASidecar:
        raise BadInput(f"{path} is not a headfold engine sidecar ({FORMAT}); rebuild the engine with headfold build") from None
    except Malformed as err:
        raise BadInput(f"{path} is corrupt ({err}); rebuild the engine with headfold build") from None


def source_onnx(engine: Path, info: EngineSidecar) -> Path | None:
    """The graph the engine was built from, if it still exists (absolute path, else relative to the engine)."""
    source = info.source
    candidates = (Path(source.onnx), engine.parent / source.onnx_relative)
    return next((p.resolve() for p in candidates if p.is_file()), None)
