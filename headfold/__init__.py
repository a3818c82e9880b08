"""headfold: MHA → GQA/MQA conversion, distillation, ONNX export, TensorRT engines, verification.

One function per command (headfold.api): convert, inspect, distill, export, build, verify, run, and
load_model; each takes the settings objects its command builds from its options: Calibration,
LocalFit (convert's local fit), ExportOptions, Profile, DistillOptions, DistillStage, InputSpec, Thresholds. The rooms are importable
as ``headfold.converter``, ``headfold.graphs`` and ``headfold.plugins``; heavy dependencies (torch,
transformers, onnx) load only when a function runs (or DistillStage / Thresholds are first named).
"""

from typing import Any

from headfold.api import build, convert, distill, export, inspect, load_model, run, sentence_transformer, verify
from headfold.ground import VERSION as __version__
from headfold.ground.settings import Calibration, DistillOptions, ExportOptions, InputSpec, LocalFit, Profile

_LAZY = {"DistillStage": "headfold.distillation.stage", "Thresholds": "headfold.verification.budget"}  # their modules load torch

__all__ = [
    "convert", "inspect", "distill", "export", "build", "verify", "run", "load_model", "sentence_transformer",
    "Calibration", "LocalFit", "ExportOptions", "Profile", "DistillOptions", "DistillStage", "InputSpec", "Thresholds", "__version__",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'headfold' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
