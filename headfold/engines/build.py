"""Build the engines of a BuildPlan with Polygraphy's TensorRT loaders, then inspect their layers.

NetworkFromOnnxPath (strongly typed as planned) → CreateConfig (one profile per graph, precision
flags, workspace, timing cache, DETAILED profiling verbosity so the inspector names layers and
tactics) → EngineFromNetwork (saves the timing cache) → SaveEngine. A real build (`headfold build`,
run's build stage) imports this module; TensorRT itself loads on first use. Outputs are atomic: a
failed or unfused (--require-fused-attention) build leaves nothing at OUT.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import onnx_ir as ir
import torch
from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxPath, Profile, SaveEngine
from polygraphy.exception import PolygraphyException
from polygraphy.logger import G_LOGGER

from headfold import plugins as custom_ops
from headfold.engines.env import Target, engine_support
from headfold.engines.plan import BuildPlan, GraphPlan, make_plan, sidecar_path
from headfold.engines.sidecar import EngineSidecar, make_sidecar
from headfold.graphs.onnx_files import load_graph
from headfold.ground.atomic import atomic_output, atomic_outputs, check_outputs, scratch_dir
from headfold.ground.errors import BadInput, CheckFailed
from headfold.ground.lazy import lazy_import

log = logging.getLogger(__name__)
trt = lazy_import("tensorrt")

# How the engine inspector (DETAILED) shows attention. Fused kernels are named after their tactic
# (Myelin "kgen" kernels such as _gemm_mha_v2_*, fmha, flash, xqa; NVIDIA/TensorRT#4397) or are
# IAttention layers; a Softmax layer outside them means the scores were materialised. Only names,
# layer types and tactics are read: a kernel's Metadata lists every ONNX node it swallowed, Softmax
# included, and layer names carry ONNX node names ("node_Attention_12") whether fused or not.
_FUSED_KERNEL = re.compile(r"mha|fmha|flash|xqa", re.IGNORECASE)
_FUSED_TYPES = {"Attention"}
_PLUGIN_TYPES = {"PluginV2", "PluginV3"}


def _layer_kind(layer: dict[str, Any] | str) -> str:
    """fused / softmax / plugin / other for one inspector layer (a bare name below DETAILED)."""
    if isinstance(layer, str):
        return "fused" if _FUSED_KERNEL.search(layer) else "softmax" if "softmax" in layer.lower() else "other"
    kind, text = str(layer.get("LayerType", "")), f"{layer.get('Name', '')} {layer.get('TacticName', '')}"
    if kind in _FUSED_TYPES or _FUSED_KERNEL.search(text):
        return "fused"
    if kind in _PLUGIN_TYPES:
        return "plugin"
    return "softmax" if kind == "Softmax" or "softmax" in str(layer.get("Name", "")).lower() else "other"


def attention_verdict(layers: list[dict[str, Any] | str]) -> dict[str, Any]:
    """fused / unfused / plugin / unknown from the engine inspector's JSON "Layers".

    unfused: a separate Softmax layer survived; fused: an attention kernel or IAttention layer and
    no Softmax; plugin: attention runs in a plugin layer (headfold's computes it unfused in torch);
    unknown: the inspector gave no such detail.
    """
    kinds = [(_name(layer), _layer_kind(layer)) for layer in layers]
    by_kind = {k: [name for name, kind in kinds if kind == k] for k in ("fused", "softmax", "plugin")}
    verdict = "unfused" if by_kind["softmax"] else "fused" if by_kind["fused"] else "plugin" if by_kind["plugin"] else "unknown"
    types = Counter(layer.get("LayerType", "?") for layer in layers if isinstance(layer, dict))
    return {
        "verdict": verdict, "attention_layers": by_kind["fused"][:16], "softmax_layers": by_kind["softmax"][:16],
        "plugin_layers": by_kind["plugin"][:16], "layers": len(layers), "layer_types": dict(types),
    }  # fmt: skip


def _name(layer: dict[str, Any] | str) -> str:
    return str(layer.get("Name", "?")) if isinstance(layer, dict) else str(layer)


def config_arguments(plan: BuildPlan, graph: GraphPlan, trt: ModuleType) -> dict[str, Any]:
    """Keyword arguments for Polygraphy's CreateConfig; `trt` is the tensorrt module (passed in for the enums)."""
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
    major, minor = torch.cuda.get_device_capability()
    return {"name": torch.cuda.get_device_name(), "compute_capability": f"{major}.{minor}"}


@contextmanager
def graph_for_tensorrt(graph: GraphPlan, target: Target) -> Iterator[Path]:
    """The ONNX file to parse: the source itself, or a temporary copy the plugin emitter rewrote."""
    if not graph.plugins:
        yield graph.onnx
        return
    with scratch_dir("headfold-emit") as tmp:
        model, _ = custom_ops.emit(load_graph(graph.onnx), target.version)
        path = Path(tmp) / graph.onnx.name
        ir.save(model, path, external_data=f"{path.name}.data")
        yield path


def _last_line(err: Exception) -> str:
    """Polygraphy's final verdict; the parser's own errors are logged above it (G_LOGGER.error)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _parse(path: Path, graph: GraphPlan, strongly_typed: bool) -> tuple:
    try:
        return NetworkFromOnnxPath(str(path), strongly_typed=strongly_typed)()
    except PolygraphyException as err:
        raise BadInput(f"TensorRT's ONNX parser rejected {graph.onnx.name}: {_last_line(err)} (its errors are printed above)") from None


def _engine(network: tuple, plan: BuildPlan, graph: GraphPlan) -> Any:
    config = CreateConfig(**config_arguments(plan, graph, trt))
    cache = str(plan.timing_cache) if plan.timing_cache else None  # build() points it at a scratch copy
    try:
        return EngineFromNetwork(network, config, save_timing_cache=cache)()
    except PolygraphyException as err:
        raise BadInput(f"TensorRT could not build {graph.onnx.name}: {_last_line(err)}") from None


def engine_layers(engine: Any) -> list[dict[str, Any] | str]:
    """The inspector's per-layer JSON (IEngineInspector, LayerInformationFormat.JSON)."""
    inspector = engine.create_engine_inspector()
    return json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON)).get("Layers", [])


def build_graph(plan: BuildPlan, graph: GraphPlan, dest: Path, *, require_fused: bool) -> EngineSidecar:
    """Build, save and inspect one engine at `dest`; its sidecar."""
    start = time.perf_counter()
    with graph_for_tensorrt(graph, plan.target) as onnx_path:
        network = _parse(onnx_path, graph, plan.precision.strongly_typed)
        engine = _engine(network, plan, graph)
    seconds = time.perf_counter() - start
    SaveEngine(engine, str(dest))()
    attention = attention_verdict(engine_layers(engine))
    log.info(f"built {graph.engine.name} in {seconds:.1f} s: {attention['layers']} layers, attention {attention['verdict']}")
    if require_fused and attention["verdict"] != "fused":
        evidence = ", ".join(attention["softmax_layers"][:3]) or "no attention kernel among the layers"
        raise CheckFailed(f"{graph.engine.name}: attention is {attention['verdict']} ({evidence}); nothing written")
    return make_sidecar(plan, graph, gpu=gpu_info(), attention=attention, seconds=seconds)


def _quiet_polygraphy() -> None:
    G_LOGGER.module_severity = G_LOGGER.WARNING  # its INFO lines (TF32 notice, per-step banners) drown the summary


def build(plan: BuildPlan, *, overwrite: bool = False, require_fused_attention: bool = False) -> list[EngineSidecar]:
    """Build every engine of `plan` (atomically) and write their sidecars; the sidecars.

    Raises Unparsable/BadInput (exit 2) before building anything the lint or the options refuse,
    CheckFailed (exit 1) for an unfused engine under `require_fused_attention`. The engines and
    sidecars appear together; the timing cache (read and updated, TensorRT's own format) is used
    through a scratch copy and replaced after the build, never through a link or over an input.
    """
    plan.check()
    reads = [p for p in plan.reads if p != plan.timing_cache]
    check_outputs(plan.outputs, overwrite=overwrite, sources=plan.reads)
    if plan.timing_cache:
        check_outputs([(plan.timing_cache, False)], overwrite=True, sources=reads, ours=True)  # updated by design; TensorRT's format carries no mark
    if plan.plugins:
        custom_ops.register_tensorrt(plan.plugins)
    _quiet_polygraphy()
    with scratch_dir("headfold-build") as scratch, atomic_outputs(plan.outputs, overwrite=overwrite, sources=plan.reads) as staged:
        local = replace(plan, timing_cache=_scratch_cache(plan.timing_cache, scratch))
        sidecars = [build_graph(local, graph, _staged_engine(plan, graph, staged), require_fused=require_fused_attention) for graph in plan.graphs]
        for graph, sidecar in zip(plan.graphs, sidecars, strict=True):
            sidecar.timing_cache = str(plan.timing_cache) if plan.timing_cache else None
            sidecar.save(staged[graph.sidecar] if plan.layout == "file" else sidecar_path(_staged_engine(plan, graph, staged)))
        if plan.timing_cache and local.timing_cache is not None and local.timing_cache.is_file():
            with atomic_output(plan.timing_cache, is_dir=False, overwrite=True, ours=True, sources=reads) as cache:
                shutil.copyfile(local.timing_cache, cache)
    return sidecars


def _staged_engine(plan: BuildPlan, graph: GraphPlan, staged: dict[Path, Path]) -> Path:
    """Where `graph`'s engine is built before it moves into place."""
    return staged[plan.out] if plan.layout == "file" else staged[plan.out] / graph.engine.name


def _scratch_cache(cache: Path | None, scratch: Path) -> Path | None:
    """A private copy of the timing cache for TensorRT to load and save (None without one)."""
    if cache is None:
        return None
    local = scratch / "timing.cache"
    if cache.is_file():
        shutil.copyfile(cache, local)
    return local


def build_export(onnx_dir: Path, out: Path, **profile: Any) -> list[EngineSidecar]:
    """`headfold run`'s build stage: every graph of an export folder, with the profile run was given
    (make_plan's keywords; unset: the default profiles and the graph's precision)."""
    why_not = engine_support()
    if why_not:
        raise BadInput(why_not)
    plan = make_plan(onnx_dir, out, Target.installed(), **profile)
    return build(plan, overwrite=True)
