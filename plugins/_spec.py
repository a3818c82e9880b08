"""What one custom op contributes to headfold.plugins: a registry entry (data)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from onnx.reference.op_run import OpRun
from onnxscript.rewriter import RewriteRule

from headfold.graphs.trt_lint import RuleSet


@dataclass(frozen=True)
class PluginOp:
    """One custom op: its TensorRT plugin id, emitter rules, CPU reference and TensorRT registration.

    In ONNX the node's domain is the plugin namespace and its op_type the plugin name, which is how
    TensorRT's ONNX parser (10.10+) finds a registered `tensorrt.plugin` plugin.
    """

    name: str  # "namespace::op_type"
    # The emitter rules for one TensorRT release's parser: each rule's check decides whether that
    # parser needs the plugin, so "which graphs need it" and "what gets rewritten" cannot drift.
    rules: Callable[[RuleSet], Sequence[RewriteRule]]
    reference: type[OpRun]  # onnx.reference implementation: ReferenceEvaluator(model, new_ops=[...])
    register_tensorrt: Callable[[], None]  # imports tensorrt lazily; idempotent

    @property
    def domain(self) -> str:
        return self.name.split("::")[0]

    @property
    def op_type(self) -> str:
        return self.name.split("::")[1]
