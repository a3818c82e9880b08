"""`--optimize ort`: ONNX Runtime's fused kernels, through onnxscript's ort_fusions rules, counted.

onnxscript's ORT fusions match the *decomposed* RMS norm (Pow/ReduceMean/Sqrt); torch writes the
opset-23 `RMSNormalization` op, so one rule here first renames it to ORT's
`SimplifiedLayerNormalization` (the same function: x / sqrt(mean(x²) + ε) · scale, computed in
the stash type), which lets onnxscript's skip rule fuse each residual Add into it
(`SkipSimplifiedLayerNormalization`, com.microsoft); norms without a residual Add go back to
`RMSNormalization` (ORT registers SimplifiedLayerNormalization in the ONNX domain, which onnx's
checker does not know). Transpose + MatMul pairs become
`FusedMatMul`, and the per-layer copies of the rotary cos/sin tables are merged. The result runs
in ONNX Runtime only (the contrib ops are its own).
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.rewriter import MatchResult, RewriteRuleSet, pattern
from onnxscript.rewriter.ort_fusions import fused_matmul_rule_sets
from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

from headfold.graphs.rewrite.values import float_attr, int_attr

__all__ = ["fuse_for_ort"]


class RenameRMSNormalization(pattern.RewriteRuleClassBase):
    """RMSNormalization over the last axis ⇄ ORT's SimplifiedLayerNormalization (same attributes)."""

    def __init__(self, source: str, target: str) -> None:
        super().__init__(f"{source}To{target}")
        self.source, self.target = source, target

    def pattern(self, op, x, scale):
        return getattr(op, self.source)(x, scale, _allow_other_attributes=True, _outputs=["normalized"])

    def check(self, context, x, scale, normalized, **_) -> MatchResult:
        result = MatchResult()
        node = normalized.producer()
        rank = x.shape.rank() if x.shape is not None else None
        if int_attr(node, "axis", -1) not in (-1, (rank or 0) - 1):
            return result.fail("normalizes other axes than the last; ORT's op takes the last axes from `axis` on too, keep it")
        return result

    def rewrite(self, op, x, scale, normalized, **_):
        node = normalized.producer()
        return getattr(op, self.target)(
            x, scale, axis=-1, epsilon=float_attr(node, "epsilon", 1e-5), stash_type=int_attr(node, "stash_type", 1)
        )


def fuse_for_ort(model: ir.Model) -> dict[str, int]:
    """Apply the ORT fusions in place; rule name → times applied."""
    RenameRMSNormalization.rule("RMSNormalization", "SimplifiedLayerNormalization").apply_to_model(model)
    counts = {"SkipSimplifiedLayerNormalization": fuse_skip_rms_normalization(model)}
    RenameRMSNormalization.rule("SimplifiedLayerNormalization", "RMSNormalization").apply_to_model(model)
    counts["FusedMatMul"] = RewriteRuleSet(fused_matmul_rule_sets.fused_matmul_rule_sets()).apply_to_model(model)
    before = len(model.graph)
    common.CommonSubexpressionEliminationPass()(model)
    common.RemoveUnusedNodesPass()(model)
    counts["merged_duplicate_nodes"] = before - len(model.graph)
    return counts
