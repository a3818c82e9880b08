"""Build the engines of a BuildPlan with Polygraphy's TensorRT loaders, then inspect their layers.

NetworkFromOnnxPath (strongly typed as planned) → CreateConfig (one profile per graph, precision
flags, workspace, timing cache, DETAILED profiling verbosity so the inspector names layers and
tactics) → EngineFromNetwork (saves the timing cache) → SaveEngine. TensorRT and Polygraphy's TRT
backend are imported inside the functions. Outputs are atomic: a failed or unfused
(--require-fused-attention) build leaves nothing at OUT.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from headfold.atomic import atomic_output, check_output
from headfold.engines.env import Target, engine_support
from headfold.engines.plan import BuildPlan, GraphPlan, make_plan, sidecar_path
from headfold.engines.sidecar import make_sidecar
from headfold.errors import BadInput, CheckFailed

Log = Callable[[str], None]

# Inspector text of a fused attention kernel (IAttention layer, Myelin/fMHA tactics) vs a Softmax layer
# left between two MatMuls. Layer names carry the ONNX node names (node_Attention_12, …).
_FUSED = re.compile(r"attention|fmha|\bmha|mha_|_mha|flash", re.IGNORECASE)
_UNFUSED = re.compile(r"softmax", re.IGNORECASE)
_LAYER_TEXT = ("Name", "LayerType", "TacticName", "Metadata")


# ---- pure parts (tested on CPU) ---------------------------------------------------------------


def attention_verdict(layers: list[dict[str, Any] | str]) -> dict[str, Any]:
    """fused / unfused / unknown from the engine inspector's JSON "Layers" (dicts at DETAILED, names below).

    unfused: a separate Softmax layer survived; fused: a layer whose type, name or tactic is an
    attention kernel and no Softmax; unknown: the inspector gave no such detail.
    """
    texts = [(_name(layer), " ".join(str(layer.get(k, "")) for k in _LAYER_TEXT) if isinstance(layer, dict) else layer) for layer in layers]
    softmax = [name for name, text in texts if _UNFUSED.search(text)]
    fused = [name for name, text in texts if _FUSED.search(text)]
    verdict = "unfused" if softmax else "fused" if fused else "unknown"
    types = Counter(layer.get("LayerType", "?") for layer in layers if isinstance(layer, dict))
    return {"verdict": verdict, "attention_layers": fused[:16], "softmax_layers": softmax[:16], "layers": len(layers), "layer_types": dict(types)}


def _name(layer: dict[str, Any] | str) -> str:
    return str(layer.get("Name", "?")) if isinstance(layer, dict) else str(layer)


def config_arguments(plan: BuildPlan, graph: GraphPlan, trt: ModuleType) -> dict[str, Any]:
    """Keyword arguments for Polygraphy's CreateConfig; `trt` is the tensorrt module (passed in for the enums)."""
    from polygraphy.backend.trt import Profile

    profile = Profile()
    for name, (low, opt, high) in graph.profile.items():
        profile.add(name, min=low, opt=opt, max=high)
    flags = plan.precision.builder_flags
    arguments: dict[str, Any] = {
        "profiles": [profile],
        "tf32": False,  # fp32 means fp32: TF32 would cost the 1e-3 fidelity budget
        "fp16": "FP16" in flags or None,
        "bf16": "BF16" in flags or None,
        "profiling_verbosity": trt.ProfilingVerbosity.DETAILED,  # layer names and tactics for the inspector
    }
    if plan.workspace_bytes:
        arguments["memory_pool_limits"] = {trt.MemoryPoolType.WORKSPACE: plan.workspace_bytes}
    if plan.timing_cache:
        arguments["load_timing_cache"] = str(plan.timing_cache)  # Polygraphy starts empty when missing
    return arguments


# ---- TensorRT ---------------------------------------------------------------------------------


def gpu_info() -> dict[str, str]:
    import torch

    major, minor = torch.cuda.get_device_capability()
    return {"name": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}"}


@contextmanager
def graph_for_tensorrt(graph: GraphPlan, target: Target) -> Iterator[Path]:
    """The ONNX file to parse: the source itself, or a temporary copy the plugin emitter rewrote."""
    if not graph.plugins:
        yield graph.onnx
        return
    import onnx_ir as ir

    from headfold import plugins as custom_ops

    with tempfile.TemporaryDirectory(prefix="headfold-emit-") as tmp:
        model, _ = custom_ops.emit(ir.load(graph.onnx), target.version)
        path = Path(tmp) / graph.onnx.name
        ir.save(model, path, external_data=f"{path.name}.data")
        yield path


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _parse(path: Path, graph: GraphPlan, strongly_typed: bool) -> tuple:
    from polygraphy.backend.trt import NetworkFromOnnxPath
    from polygraphy.exception import PolygraphyException

    try:
        return NetworkFromOnnxPath(str(path), strongly_typed=strongly_typed)()
    except PolygraphyException as err:
        raise BadInput(f"TensorRT's ONNX parser rejected {graph.onnx.name}: {_first_line(err)}") from None


def _engine(network: tuple, plan: BuildPlan, graph: GraphPlan) -> Any:
    import tensorrt as trt
    from polygraphy.backend.trt import CreateConfig, EngineFromNetwork
    from polygraphy.exception import PolygraphyException

    config = CreateConfig(**config_arguments(plan, graph, trt))
    cache = str(plan.timing_cache) if plan.timing_cache else None
    try:
        return EngineFromNetwork(network, config, save_timing_cache=cache)()
    except PolygraphyException as err:
        raise BadInput(f"TensorRT could not build {graph.onnx.name}: {_first_line(err)}") from None


def engine_layers(engine: Any) -> list[dict[str, Any] | str]:
    """The inspector's per-layer JSON (IEngineInspector, LayerInformationFormat.JSON)."""
    import tensorrt as trt

    inspector = engine.create_engine_inspector()
    return json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON)).get("Layers", [])


def build_graph(plan: BuildPlan, graph: GraphPlan, dest: Path, *, require_fused: bool, log: Log) -> dict[str, Any]:
    """Build, save and inspect one engine at `dest`; its sidecar dict."""
    from polygraphy.backend.trt import SaveEngine

    start = time.perf_counter()
    with graph_for_tensorrt(graph, plan.target) as onnx_path:
        network = _parse(onnx_path, graph, plan.precision.strongly_typed)
        engine = _engine(network, plan, graph)
    seconds = time.perf_counter() - start
    SaveEngine(engine, str(dest))()
    attention = attention_verdict(engine_layers(engine))
    log(f"built {graph.engine.name} in {seconds:.1f} s: {attention['layers']} layers, attention {attention['verdict']}")
    if require_fused and attention["verdict"] != "fused":
        evidence = ", ".join(attention["softmax_layers"][:3]) or "no attention kernel among the layers"
        raise CheckFailed(f"{graph.engine.name}: attention is {attention['verdict']} ({evidence}); nothing written")
    return make_sidecar(plan, graph, gpu=gpu_info(), attention=attention, seconds=seconds)


def _quiet_polygraphy() -> None:
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.WARNING  # its INFO lines (TF32 notice, per-step banners) drown the summary


def build(plan: BuildPlan, *, overwrite: bool = False, require_fused_attention: bool = False, log: Log = print) -> list[dict[str, Any]]:
    """Build every engine of `plan` (atomically) and write their sidecars; the sidecars.

    Raises Unparsable/BadInput (exit 2) before building anything the lint or the options refuse,
    CheckFailed (exit 1) for an unfused engine under `require_fused_attention`.
    """
    plan.check()
    check_output(plan.out, overwrite=overwrite, sources=(plan.source,))
    if plan.plugins:
        from headfold import plugins as custom_ops

        custom_ops.register_tensorrt(plan.plugins)
    _quiet_polygraphy()

    def build_one(graph: GraphPlan, dest: Path) -> dict[str, Any]:
        return build_graph(plan, graph, dest, require_fused=require_fused_attention, log=log)

    if plan.layout == "file":
        with atomic_output(plan.out, is_dir=False) as engine:
            sidecars = [build_one(plan.graphs[0], engine)]
        _write_json(sidecar_path(plan.out), sidecars[0])  # once the engine is in place
        return sidecars
    with atomic_output(plan.out) as folder:
        sidecars = [build_one(graph, folder / graph.engine.name) for graph in plan.graphs]
        for graph, sidecar in zip(plan.graphs, sidecars):
            _write_json(sidecar_path(folder / graph.engine.name), sidecar)
    return sidecars


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def build_export(onnx_dir: Path, out: Path, log: Log = print) -> list[dict[str, Any]]:
    """`headfold run`'s build stage: every graph of an export folder, default profiles, the graph's precision."""
    why_not = engine_support()
    if why_not:
        raise BadInput(why_not)
    plan = make_plan(onnx_dir, out, Target.installed())
    return build(plan, overwrite=True, log=log)
