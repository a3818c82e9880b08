"""Runners: one model on one backend behind one interface (Polygraphy's shape).

A runner is a context manager that loads its model lazily on entry and releases it on exit;
`infer(feed)` maps input names to numpy arrays and returns output names to numpy arrays, with
the names of the exported graph (input_ids, attention_mask [, token_type_ids] → logits or
last_hidden_state). Polygraphy's own runners (TrtRunner for engines, OnnxrtRunner) satisfy the
same `Runner` protocol, so a TensorRT engine plugs in without changes here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from headfold.ground.errors import BadInput

# Preferred ONNX Runtime providers, best first; those the installed build lacks are skipped.
ORT_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
PAST = "past_key_values."  # graphs.export's past K/V inputs: past_key_values.{i}.key / .value
_ORT_FLOATS = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


@runtime_checkable
class Runner(Protocol):
    name: str

    def __enter__(self) -> Runner: ...

    def __exit__(self, *exc: object) -> None: ...

    def infer(self, feed_dict: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]: ...


class BaseRunner:
    """activate/deactivate around a lazily loaded model; `with runner:` does both."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_active = False

    def __enter__(self) -> BaseRunner:
        self.activate()
        return self

    def __exit__(self, *exc: object) -> None:
        self.deactivate()

    def activate(self) -> None:
        if not self.is_active:
            self.activate_impl()
            self.is_active = True

    def deactivate(self) -> None:
        if self.is_active:
            self.deactivate_impl()
            self.is_active = False

    def infer(self, feed_dict: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.is_active:
            raise RuntimeError(f"runner {self.name} is not active; use it inside `with runner:`")
        return self.infer_impl(feed_dict)

    def activate_impl(self) -> None:
        raise NotImplementedError

    def deactivate_impl(self) -> None:
        raise NotImplementedError

    def infer_impl(self, feed_dict: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def describe(self) -> dict[str, str]:
        """Backend details for reports (filled once active)."""
        return {"runner": self.name}


class TorchRunner(BaseRunner):
    """A checkpoint folder (source or converted) as `headfold.load_model` builds it, on CPU."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__(f"torch:{Path(checkpoint).name}")
        self.checkpoint = Path(checkpoint)
        self.model = None

    def activate_impl(self) -> None:
        from headfold.converter.modeling import load_model

        self.model = load_model(self.checkpoint)

    def deactivate_impl(self) -> None:
        self.model = None

    def infer_impl(self, feed_dict: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = {name: torch.from_numpy(np.asarray(value)) for name, value in feed_dict.items()}
        with torch.no_grad():
            out = self.model(**inputs)
        if self.model.can_generate():
            return {"logits": out.logits.float().numpy()}
        return {"last_hidden_state": out.last_hidden_state.float().numpy()}

    def describe(self) -> dict[str, str]:
        dtype = str(next(self.model.parameters()).dtype) if self.model is not None else "unloaded"
        return {"runner": self.name, "backend": f"torch {torch.__version__}", "device": "cpu", "dtype": dtype}


class OnnxRuntimeRunner(BaseRunner):
    """An ONNX graph in ONNX Runtime, on the best provider present (CUDA/TensorRT EPs, else CPU)."""

    def __init__(self, graph: Path, providers: tuple[str, ...] | None = None) -> None:
        super().__init__(f"onnxruntime:{Path(graph).name}")
        self.graph = Path(graph)
        self.providers = providers
        self.session = None

    def activate_impl(self) -> None:
        import onnxruntime as ort

        available = set(ort.get_available_providers())
        providers = [p for p in (self.providers or ORT_PROVIDERS) if p in available] or ["CPUExecutionProvider"]
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: ORT warns about unused initializers
        try:
            self.session = ort.InferenceSession(str(self.graph), options, providers=providers)
        except Exception as err:  # ORT's errors subclass only Exception; a graph it cannot load is bad input
            first_line = next(iter(str(err).strip().splitlines()), type(err).__name__)
            raise BadInput(f"ONNX Runtime cannot load {self.graph} ({first_line}); re-run headfold export (a truncated .onnx.data?)") from None

    def deactivate_impl(self) -> None:
        self.session = None

    def infer_impl(self, feed_dict: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [o.name for o in self.session.get_outputs()]
        feed = {**self._empty_past(feed_dict), **feed_dict}
        return dict(zip(names, self.session.run(names, feed)))

    def _empty_past(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A merged decoder graph fed without past K/V runs a prompt: past of length 0 [B, kvᵢ, 0, d]."""
        batch = len(feed["input_ids"]) if "input_ids" in feed else 0
        missing = [i for i in self.session.get_inputs() if i.name.startswith(PAST) and i.name not in feed]
        if any(i.type not in _ORT_FLOATS for i in missing):
            raise BadInput(f"{self.graph.name} takes its past K/V as {missing[0].type}, which numpy cannot build; export it in fp32 or fp16 to verify it")
        return {i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), _ORT_FLOATS[i.type]) for i in missing}

    def describe(self) -> dict[str, str]:
        import onnxruntime as ort

        providers = self.session.get_providers() if self.session is not None else list(self.providers or ())
        return {"runner": self.name, "backend": f"onnxruntime {ort.__version__}", "providers": ",".join(providers)}
