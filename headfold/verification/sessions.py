"""ONNX Runtime sessions as headfold opens them, for every runner that runs an exported graph."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from polygraphy.backend.base import BaseLoader

from headfold.ground.errors import BadInput, first_line
from headfold.ground.lazy import lazy_import

ort = lazy_import("onnxruntime")  # loaded when the first session is made

# Preferred ONNX Runtime providers, best first; those the installed build lacks are skipped.
ORT_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
# What ONNX Runtime names a graph's float input types, and their numpy dtypes.
ORT_FLOATS = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


class SessionFromGraph(BaseLoader):
    """An ONNX Runtime session, loaded lazily like Polygraphy's SessionFromOnnx but with headfold's
    choices: the best provider the installed build has (ORT_PROVIDERS; SessionFromOnnx refuses a
    missing one), ORT's default threads, errors-only session logging (ORT warns about unused
    initializers), and a graph ORT cannot load reported as bad input."""

    def __init__(self, graph: Path, providers: Sequence[str] | None = None) -> None:
        self.graph, self.providers = Path(graph), providers

    def call_impl(self) -> Any:
        available = set(ort.get_available_providers())
        providers = [p for p in (self.providers or ORT_PROVIDERS) if p in available] or ["CPUExecutionProvider"]
        options = ort.SessionOptions()
        options.log_severity_level = 3
        try:
            return ort.InferenceSession(str(self.graph), options, providers=providers)
        except Exception as err:  # ORT's errors subclass only Exception; a graph it cannot load is bad input
            raise BadInput(f"ONNX Runtime cannot load {self.graph} ({first_line(err)}); re-run headfold export (a truncated .onnx.data?)") from None
