"""Custom ops a runtime lacks, one sub-package per op (emitter rules + CPU reference + TensorRT plugin).

API (used by `headfold build`):
- plan_plugins(model, trt_version): the plugin names ("namespace::name") that graph needs;
- emit(model, trt_version): rewrites the graph in place, returns it and the plugins introduced;
- register_tensorrt(names): defines those plugins in TensorRT (lazy `tensorrt.plugin` import);
- reference_ops(): onnx.reference kernels, to run graphs with plugin nodes on CPU:
  `onnx.reference.ReferenceEvaluator(proto, new_ops=reference_ops())`.

Adding an op is adding a sub-package that exposes a `PluginOp` and listing it in REGISTRY. A plugin
is "needed" exactly when one of its emitter rules matches the graph for that TensorRT version (the
rules' checks consult the parser's rule set from headfold.graphs.trt_lint).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import onnx_ir as ir
from onnx.reference.op_run import OpRun
from onnxscript.rewriter import RewriteRule, RewriteRuleSet

from headfold.graphs.onnx_files import load_graph
from headfold.graphs.trt_lint import rule_set
from headfold.ground.errors import BadInput
from headfold.plugins import gqa_decode_attention
from headfold.plugins._spec import PluginOp

__all__ = ["REGISTRY", "PluginOp", "emit", "plan_plugins", "reference_ops", "register_tensorrt"]

REGISTRY: dict[str, PluginOp] = {op.name: op for op in (gqa_decode_attention.SPEC,)}


def plan_plugins(model: ir.Model | str | os.PathLike, trt_version: str) -> list[str]:
    """Plugin names `model` needs for TensorRT `trt_version`: those its emitter rules would
    introduce and those whose nodes the graph already holds (emitted earlier). The model is not changed."""
    ir_model = _load(model)
    parser = rule_set(trt_version)
    present = {(node.domain, node.op_type) for node in ir_model.graph}
    return [name for name, op in REGISTRY.items() if (op.domain, op.op_type) in present or _matches(ir_model, op.rules(parser))]


def emit(model: ir.Model, trt_version: str) -> tuple[ir.Model, list[str]]:
    """Apply every op's emitter rules for `trt_version` in place; returns the model and the plugins
    it now contains (those whose rules fired)."""
    parser = rule_set(trt_version)
    introduced = [name for name, op in REGISTRY.items() if RewriteRuleSet(list(op.rules(parser))).apply_to_model(model)]
    return model, introduced


def register_tensorrt(names: Iterable[str]) -> None:
    """Define the named plugins with tensorrt.plugin; BadInput for unknown names or no TensorRT."""
    ops = [_lookup(name) for name in names]
    if not ops:
        return
    _require_tensorrt_plugin_api(ops)
    for op in ops:
        op.register_tensorrt()


def reference_ops(names: Iterable[str] | None = None) -> list[type[OpRun]]:
    """onnx.reference kernels for the named plugins (all by default)."""
    return [_lookup(name).reference for name in (REGISTRY if names is None else names)]


def _matches(model: ir.Model, rules: Sequence[RewriteRule]) -> bool:
    return any(rule.match(model, model.graph, node) for node in model.graph for rule in rules)


def _lookup(name: str) -> PluginOp:
    if name not in REGISTRY:
        raise BadInput(f"unknown plugin {name!r}; headfold provides {', '.join(REGISTRY)}")
    return REGISTRY[name]


def _require_tensorrt_plugin_api(ops: list[PluginOp]) -> None:
    try:
        importlib.import_module("tensorrt.plugin")
    except (ImportError, OSError) as error:  # OSError: bindings present, libraries missing
        names = ", ".join(op.name for op in ops)
        raise BadInput(f"plugin(s) {names} need TensorRT's Python plugin API (tensorrt.plugin, TensorRT ≥ 10.10) and an NVIDIA GPU: {error}") from None


def _load(model: ir.Model | str | os.PathLike) -> ir.Model:
    if isinstance(model, ir.Model):
        return model
    return load_graph(Path(model))  # external weights stay on disk: only shapes and attributes are read
