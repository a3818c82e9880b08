"""Rule: MatMul → scale → (mask Add) → Softmax → MatMul, fused into one ONNX `Attention` node.

Two exporter shapes are matched:
- scores scaled after the product (transformers' eager attention): (Q @ Kᵀ) * s or (Q @ Kᵀ) / s;
- Q and Kᵀ each scaled by √s before it (torch.onnx's SDPA decomposition at opsets < 23).
Kᵀ is a Transpose(0, 1, 3, 2) of 4D K, or torch's rank-agnostic Reshape → Transpose(0, 2, 1) →
Reshape. The mask must be additive (float); a bool mask becomes Where/IsNaN and is not matched.
"""

from __future__ import annotations

from onnxscript.rewriter import MatchResult, pattern

from headfold.graphs.rewrite.cleanup import ATTENTION_OPSET
from headfold.graphs.rewrite.values import dims, same_dim, same_dims, scalar


class FuseDecomposedAttention(pattern.RewriteRuleClassBase):
    """One variant per (prescaled, masked): optional inputs can't be expressed inside one pattern."""

    def __init__(self, *, prescaled: bool, masked: bool) -> None:
        name = "FuseDecomposedAttention" + ("Prescaled" if prescaled else "") + ("Masked" if masked else "")
        super().__init__(name)
        self.prescaled = prescaled
        self.masked = masked

    def pattern(self, op, query, key, value, scale, mask):
        key_t = pattern.OrValue(
            [
                op.Transpose(key, perm=[0, 1, 3, 2]),
                op.Reshape(
                    op.Transpose(op.Reshape(key, pattern.ANY_VALUE, _outputs=["key_3d"]), perm=[0, 2, 1]),
                    pattern.ANY_VALUE,
                ),
            ],
            name="key_t",
        )
        if self.prescaled:
            scores = op.MatMul(op.Mul(query, scale), op.Mul(key_t, pattern.Var("key_scale")))
        else:
            scores = pattern.OrValue(
                [op.Mul(op.MatMul(query, key_t), scale), op.Div(op.MatMul(query, key_t), scale)],
                tag_var="scale_op",
                tag_values=["Mul", "Div"],
            )
        if self.masked:
            scores = op.Add(scores, mask)
        probs = op.Softmax(scores, axis=pattern.AttrVar("axis"))
        return op.MatMul(probs, value)

    def check(self, context, query, key, value, key_t, axis, scale, key_3d=None, key_scale=None, **_) -> MatchResult:
        result = MatchResult()
        if context.model.opset_imports.get("", 0) < ATTENTION_OPSET:
            return result.fail(f"Attention needs opset {ATTENTION_OPSET}; convert the model's version first")
        if axis.as_int() not in (-1, 3):
            return result.fail("Softmax is not over the last axis")
        q, k, v, kt = dims(query, 4), dims(key, 4), dims(value, 4), dims(key_t, 4)
        if q is None or k is None or v is None or kt is None:
            return result.fail("Q/K/V/Kᵀ shapes unknown or not 4D (run shape inference first)")
        if not (same_dims(kt, (*k[:2], k[3], k[2])) and same_dim(q[3], k[3]) and same_dim(k[2], v[2])):
            return result.fail(f"shapes Q {q}, K {k}, Kᵀ {kt}, V {v} are not one attention")
        if not (same_dims(k[:2], v[:2]) and (same_dim(k[1], q[1]) or k[1] == 1)):
            return result.fail(f"K/V heads {k[1]} neither equal Q's {q[1]} nor 1")
        if key_3d is not None and not same_dims((dims(key_3d, 3) or ())[1:], k[2:]):
            return result.fail("the Reshape around the 3D Transpose is not a plain Kᵀ")
        if self._scale(scale, key_scale, **_) is None:
            return result.fail("scale is not a constant scalar (or Q and K scales differ)")
        return result

    def _scale(self, scale, key_scale, scale_op: str = "Mul", **_) -> float | None:
        """The softmax scale the matched graph applies to Q @ Kᵀ."""
        factor = scalar(scale)
        if factor is None or factor == 0:
            return None
        if self.prescaled:
            return factor * factor if scalar(key_scale) == factor else None
        return 1.0 / factor if scale_op == "Div" else factor

    def rewrite(self, op, query, key, value, scale, mask=None, key_scale=None, **bindings):
        inputs = [query, key, value] if mask is None else [query, key, value, mask]
        return op.Attention(*inputs, scale=self._scale(scale, key_scale, **bindings))


rules = [FuseDecomposedAttention.rule(prescaled=prescaled, masked=masked) for prescaled in (False, True) for masked in (True, False)]
