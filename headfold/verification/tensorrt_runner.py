"""A TensorRT engine as Polygraphy's TrtRunner, adding only optimization profile choice and timing.

Polygraphy deserializes the engine, binds inputs and outputs (empty tensors included), runs
`execute_async_v3` on the runner's own CUDA stream and copies the outputs back. This subclass
adds, per feed: the feed cast to the engine's input dtypes; the first optimization profile whose
min/max admit the input shapes (Polygraphy keeps whichever is set); with `timed_runs` > 0 that
many more executions of the same bindings between CUDA events (torch's, on Polygraphy's stream),
the median going into `describe()` and so into the verify report; outputs as numpy copies
(Polygraphy reuses its host buffers between calls, and a shared prefill runner is called again
before its outputs are compared). TensorRT loads on activation only.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from polygraphy.backend.trt import EngineFromPath, TrtRunner
from polygraphy.datatype import DataType

from headfold import plugins as custom_ops
from headfold.engines import env
from headfold.engines.sidecar import load_sidecar
from headfold.ground.errors import BadInput
from headfold.ground.lazy import lazy_import
from headfold.verification.runners import polygraphy_errors

trt = lazy_import("tensorrt")  # on activation, once engine_support() found it and a GPU

Shape = tuple[int, ...]
ProfileShapes = dict[str, tuple[Shape, Shape]]  # input -> (min, max)


def pick_profile(shapes: Mapping[str, Shape], profiles: Sequence[ProfileShapes]) -> int | None:
    """The first profile whose min/max bounds admit every input shape, else None."""
    for index, bounds in enumerate(profiles):
        if all(_fits(shapes[name], *bounds[name]) for name in shapes):
            return index
    return None


def _fits(shape: Shape, low: Shape, high: Shape) -> bool:
    return len(shape) == len(low) and all(lo <= s <= hi for s, lo, hi in zip(shape, low, high, strict=True))


class TensorRTRunner(TrtRunner):
    """A serialized engine (`headfold build`) on the current CUDA device."""

    def __init__(self, engine: Path, *, timed_runs: int = 10, plugins: list[str] | None = None) -> None:
        self.engine_path = Path(engine)
        super().__init__(self._load_engine, name=f"tensorrt:{self.engine_path.name}")
        self.timed_runs = timed_runs
        self.plugins = plugins
        self.latencies: list[float] = []  # per feed: median milliseconds of the timed runs
        self._backend: dict[str, str] = {}

    def _load_engine(self) -> Any:
        """Polygraphy's loader, called on activation: TensorRT and a GPU checked first, plugins registered."""
        why_not = env.engine_support()
        if why_not:
            raise BadInput(f"cannot run the TensorRT engine {self.engine_path}: {why_not}")

        self._register_plugins()
        self._backend = {"backend": f"tensorrt {trt.__version__}", "device": torch.cuda.get_device_name()}
        with polygraphy_errors(f"TensorRT {trt.__version__} cannot load {self.engine_path}", "rebuild it here with headfold build"):
            return EngineFromPath(str(self.engine_path))()

    def _register_plugins(self) -> None:
        if self.plugins is None:
            self.plugins = load_sidecar(self.engine_path).plugins
        if self.plugins:
            custom_ops.register_tensorrt(self.plugins)

    def infer(self, feed_dict: Mapping[str, np.ndarray], check_inputs: bool = True, *args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
        """Polygraphy's infer on the feed cast to the engine's dtypes, in the profile that fits its shapes.

        `infer`, not `infer_impl`: Polygraphy checks the feed's dtypes before `infer_impl`, and a
        bf16 engine's inputs have no numpy dtype the feed could already hold."""
        if not self.is_active:  # Polygraphy refuses it: a bug of the caller, not bad input
            return super().infer(feed_dict, check_inputs, *args, **kwargs)
        feed = self.engine_feed(feed_dict)
        self.choose_profile({name: tuple(value.shape) for name, value in feed.items()})
        with polygraphy_errors(f"{self.engine_path.name} does not take headfold's feed", "rebuild it from a headfold export"):
            outputs = super().infer(feed, check_inputs, *args, **kwargs)
        if self.timed_runs > 0:
            self.latencies.append(self._time())
        return {name: _to_numpy(value) for name, value in outputs.items()}

    def engine_feed(self, feed_dict: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """The engine's inputs as torch CPU tensors of its dtypes (bf16 too, which numpy lacks); other keys dropped."""
        meta = self.get_input_metadata(use_numpy_dtypes=False)
        missing = [name for name in meta if name not in feed_dict]
        if missing:
            raise BadInput(f"{self.engine_path.name} needs inputs {', '.join(missing)}; the feed has {', '.join(feed_dict)}")
        return {name: torch.from_numpy(np.ascontiguousarray(feed_dict[name])).to(DataType.to_dtype(meta[name].dtype, "torch")) for name in meta}

    def profiles(self) -> list[ProfileShapes]:
        """Per optimization profile of the engine: input → (min shape, max shape)."""
        names = list(self.get_input_metadata(use_numpy_dtypes=False))
        bounds = [{name: self.engine.get_tensor_profile_shape(name, p) for name in names} for p in range(self.engine.num_optimization_profiles)]
        return [{name: (tuple(low), tuple(high)) for name, (low, _, high) in profile.items()} for profile in bounds]

    def choose_profile(self, shapes: dict[str, Shape]) -> None:
        """Switch to the first profile admitting `shapes` (Polygraphy's set_profile) unless it is the active one."""
        profiles = self.profiles()
        profile = pick_profile(shapes, profiles)
        if profile is None:
            raise BadInput(
                f"{self.engine_path.name}: input shapes {shapes} fit none of its optimization profiles {profiles}; rebuild with larger --batch/--seq/--past"
            )
        if profile != self.context.active_optimization_profile:
            self.set_profile(profile)

    def _time(self) -> float:
        """Median milliseconds of `timed_runs` executions of the current bindings (CUDA events)."""
        stream = torch.cuda.ExternalStream(self.stream.ptr)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.timed_runs)]
        for start, end in events:
            start.record(stream)
            if not self.context.execute_async_v3(self.stream.ptr):
                raise RuntimeError(f"TensorRT execute_async_v3 failed for {self.engine_path.name}")
            end.record(stream)
        stream.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    def latency(self) -> dict[str, Any]:
        """Median over feeds of each feed's median (ms), for the report."""
        if not self.latencies:
            return {}
        return {"latency_ms": round(statistics.median(self.latencies), 4), "latency_runs": self.timed_runs, "latency_feeds": len(self.latencies)}

    def describe(self) -> dict[str, Any]:
        return {"runner": self.name, **self._backend, **self.latency()}


def _to_numpy(tensor: Any) -> np.ndarray:
    """A numpy copy of an output tensor (bf16 as fp32: numpy has no bfloat16)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    return tensor.numpy().copy()
