"""Cleanup between and after the rules: constant folding, dead code, shape inference (onnx_ir passes)."""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.optimizer import fold_constants
from onnxscript.version_converter import ConvertVersionPass

from headfold.graphs.rewrite.values import never_fold_lazy

ATTENTION_OPSET = 23  # first opset with a standard Attention op


class FoldConstantsPass(ir.passes.InPlacePass):
    """onnxscript's constant folding as a pass: the rules read scales and axes as constants. Weights
    still in the checkpoint (an export streams them) stay there."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return fold_constants(model, should_fold=never_fold_lazy)  # a PassResult


def cleanup(model: ir.Model) -> None:
    """Fold constants, drop unused nodes/initializers, sort, and give every value a shape."""
    ir.passes.Sequential(
        FoldConstantsPass(),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedOpsetsPass(),
        common.TopologicalSortPass(),
        common.ShapeInferencePass(),
    )(model)


def upgrade_opset(model: ir.Model) -> None:
    """Models from older exporters are converted to the opset that has Attention before fusing."""
    if model.opset_imports.get("", ATTENTION_OPSET) < ATTENTION_OPSET:
        ConvertVersionPass(ATTENTION_OPSET)(model)


def deduplicate(model: ir.Model) -> None:
    """Merge identical nodes, e.g. the per-layer copies of a value a rule derives from a graph input."""
    common.CommonSubexpressionEliminationPass()(model)
