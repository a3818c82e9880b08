"""Run a TensorRT engine behind headfold's runner interface, with torch CUDA tensors (no pycuda).

Per feed: pick the optimization profile whose min/max admit the input shapes, set the input
shapes and tensor addresses, `execute_async_v3` on the runner's own CUDA stream (the legacy
default stream makes TensorRT add synchronisations, which the latency would include), copy the
outputs back. Empty tensors (a decode step with no past yet) are bound to a placeholder buffer:
TensorRT requires a non-null address for every input, and an empty torch tensor has none.
With `timed_runs` > 0 the same bindings are executed that many more times between CUDA events,
and the median goes into `describe()` (and so into the verify report).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from headfold.ground.errors import BadInput
from headfold.verification.runners import BaseRunner

Shape = tuple[int, ...]
ProfileShapes = dict[str, tuple[Shape, Shape]]  # input -> (min, max)


def pick_profile(shapes: Mapping[str, Shape], profiles: Sequence[ProfileShapes]) -> int | None:
    """The first profile whose min/max bounds admit every input shape, else None."""
    for index, bounds in enumerate(profiles):
        if all(_fits(shapes[name], *bounds[name]) for name in shapes):
            return index
    return None


def _fits(shape: Shape, low: Shape, high: Shape) -> bool:
    return len(shape) == len(low) and all(lo <= s <= hi for s, lo, hi in zip(shape, low, high))


def _torch_dtypes(trt: Any) -> dict[Any, Any]:
    import torch

    pairs = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT32": torch.int32, "INT64": torch.int64, "BOOL": torch.bool, "INT8": torch.int8, "UINT8": torch.uint8}
    return {getattr(trt.DataType, name): dtype for name, dtype in pairs.items() if hasattr(trt.DataType, name)}


class TensorRTRunner(BaseRunner):
    """A serialized engine (`headfold build`) on the current CUDA device."""

    def __init__(self, engine: Path, *, timed_runs: int = 10, plugins: list[str] | None = None) -> None:
        super().__init__(f"tensorrt:{Path(engine).name}")
        self.engine_path = Path(engine)
        self.timed_runs = timed_runs
        self.plugins = plugins
        self.latencies: list[float] = []  # per feed: median milliseconds of the timed runs
        self._trt: Any = None

    def activate_impl(self) -> None:
        from headfold.engines.env import engine_support

        why_not = engine_support()
        if why_not:
            raise BadInput(f"cannot run the TensorRT engine {self.engine_path}: {why_not}")
        import tensorrt as trt
        import torch

        self._register_plugins()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engine = self._runtime.deserialize_cuda_engine(self.engine_path.read_bytes())
        if self.engine is None:
            raise BadInput(f"TensorRT {trt.__version__} cannot load {self.engine_path}; rebuild it here with headfold build")
        self.context = self.engine.create_execution_context()
        self._trt, self._profile, self._dtypes = trt, 0, _torch_dtypes(trt)
        self._stream = torch.cuda.Stream()
        self._placeholder = torch.empty(256, dtype=torch.uint8, device="cuda")  # the address of empty tensors
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.profiles = [self._profile_shapes(p) for p in range(self.engine.num_optimization_profiles)]

    def _register_plugins(self) -> None:
        if self.plugins is None:
            from headfold.engines.sidecar import read_sidecar

            self.plugins = read_sidecar(self.engine_path).get("plugins", [])
        if self.plugins:
            from headfold import plugins as custom_ops

            custom_ops.register_tensorrt(self.plugins)

    def _profile_shapes(self, profile: int) -> ProfileShapes:
        shapes = {}
        for name in self.inputs:
            low, _, high = self.engine.get_tensor_profile_shape(name, profile)
            shapes[name] = (tuple(low), tuple(high))
        return shapes

    def deactivate_impl(self) -> None:
        self.context = self.engine = self._runtime = self._stream = self._placeholder = None

    def infer_impl(self, feed_dict: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        missing = [n for n in self.inputs if n not in feed_dict]
        if missing:
            raise BadInput(f"{self.engine_path.name} needs inputs {', '.join(missing)}; the feed has {', '.join(feed_dict)}")
        stream = self._stream
        with torch.cuda.stream(stream):  # the copies to and from the GPU too
            self._select_profile({n: tuple(np.shape(feed_dict[n])) for n in self.inputs}, stream)
            buffers = {name: self._bind_input(name, feed_dict[name]) for name in self.inputs}
            buffers |= {name: self._bind_output(name) for name in self.outputs}
            self._execute(stream)
            if self.timed_runs > 0:
                self.latencies.append(self._time(stream))
            outputs = {name: _to_numpy(buffers[name]) for name in self.outputs}
        stream.synchronize()
        return outputs

    def _select_profile(self, shapes: dict[str, Shape], stream: Any) -> None:
        profile = pick_profile(shapes, self.profiles)
        if profile is None:
            raise BadInput(
                f"{self.engine_path.name}: input shapes {shapes} fit none of its optimization profiles "
                f"{self.profiles}; rebuild with larger --batch/--seq/--past"
            )
        if profile != self._profile:
            self.context.set_optimization_profile_async(profile, stream.cuda_stream)
            self._profile = profile

    def _bind_input(self, name: str, value: np.ndarray) -> Any:
        import torch

        dtype = self._dtypes[self.engine.get_tensor_dtype(name)]
        tensor = torch.from_numpy(np.ascontiguousarray(value)).to(device="cuda", dtype=dtype).contiguous()
        self.context.set_input_shape(name, tuple(tensor.shape))
        self._set_address(name, tensor)
        return tensor

    def _bind_output(self, name: str) -> Any:
        import torch

        shape = tuple(self.context.get_tensor_shape(name))
        if any(d < 0 for d in shape):
            raise BadInput(f"{self.engine_path.name}: output {name} has a data-dependent shape {shape}; headfold's graphs have none")
        tensor = torch.empty(shape, dtype=self._dtypes[self.engine.get_tensor_dtype(name)], device="cuda")
        self._set_address(name, tensor)
        return tensor

    def _set_address(self, name: str, tensor: Any) -> None:
        self.context.set_tensor_address(name, tensor.data_ptr() if tensor.numel() else self._placeholder.data_ptr())

    def _execute(self, stream: Any) -> None:
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT execute_async_v3 failed for {self.engine_path.name}")

    def _time(self, stream: Any) -> float:
        """Median milliseconds of `timed_runs` executions of the current bindings (CUDA events)."""
        import torch

        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.timed_runs)]
        for start, end in events:
            start.record(stream)
            self._execute(stream)
            end.record(stream)
        stream.synchronize()
        return statistics.median(start.elapsed_time(end) for start, end in events)

    def latency(self) -> dict[str, Any]:
        """Median over feeds of each feed's median (ms), for the report."""
        if not self.latencies:
            return {}
        return {"latency_ms": round(statistics.median(self.latencies), 4), "latency_runs": self.timed_runs, "latency_feeds": len(self.latencies)}

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"runner": self.name}
        if self._trt is not None:
            import torch

            info |= {"backend": f"tensorrt {self._trt.__version__}", "device": torch.cuda.get_device_name()}
        return info | self.latency()


def _to_numpy(tensor: Any) -> np.ndarray:
    import torch

    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        tensor = tensor.float()
    return tensor.cpu().numpy()
