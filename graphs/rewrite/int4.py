"""`--dtype int4`: MatMul weights in 4 bits, by ONNX Runtime's own quantizer, one weight at a time.

Each MatMul whose B is a constant 2D weight [K, N] becomes ORT's `com.microsoft.MatMulNBits` (A, B
packed, scales[, zero points]; attributes K, N, bits, block_size, accuracy_level), as
`onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer` (its DEFAULT algorithm:
blockwise round-to-nearest along K) writes it. The packed weight, scales and zero points are that
quantizer's own `qbits_block_quant` of the weight, computed lazily when the graph is saved: a weight
streamed from the checkpoint is read, quantized and written without the model ever being in memory,
and the bytes equal what the quantizer writes for the fp32 export. Everything else stays fp32.

GPT-2's and OPT's tied LM heads reach ORT as FusedMatMul(x, embedding, transB) after --optimize ort:
the same weight transposed, quantized the same way.

accuracy_level 4 (int8 activations against the int4 weights) is what onnxruntime-genai's model
builder writes for CPU; CUDA ignores it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.rewriter import MatchResult, RewriteRuleSet, pattern

from headfold.graphs.rewrite.ort_gqa import DOMAIN
from headfold.graphs.rewrite.values import float_attr, int_attr

__all__ = ["Int4", "quantize_weights", "BLOCK_SIZES"]

BLOCK_SIZES = (16, 32, 64, 128, 256)  # what MatMulNBits takes (a power of two ≥ 16)
QUANTIZER = "onnxruntime MatMulNBitsQuantizer, DEFAULT (blockwise round-to-nearest along K)"


@dataclass(frozen=True)
class Int4:
    """The int4 settings an export records (export.json "quantization"); the defaults are the model builder's."""

    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4

    def summary(self) -> dict:
        return {"weights": "int4", "op": f"{DOMAIN}.MatMulNBits", "method": QUANTIZER, **asdict(self), "activations": "fp32"}

    def quantizer(self):
        from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

        config = DefaultWeightOnlyQuantConfig(block_size=self.block_size, is_symmetric=self.symmetric, accuracy_level=self.accuracy_level, bits=4)
        return DefaultWeightOnlyQuantizer(config)


class _Quantized:
    """One weight's (packed, scales[, zero points]), computed on first read and kept until each part
    was read once (its initializers are written one after the other); read again, computed again."""

    def __init__(self, weight: Callable[[], np.ndarray], config: Int4) -> None:
        self.weight, self.config = weight, config
        self.parts: tuple[np.ndarray, ...] | None = None
        self.unread: set[int] = set()

    def part(self, index: int) -> ir.TensorProtocol:
        if self.parts is None or index not in self.unread:
            self.parts = self.config.quantizer().qbits_block_quant(np.ascontiguousarray(self.weight(), dtype=np.float32))
            self.unread = {0, 1} if self.config.symmetric else {0, 1, 2}
        result = self.parts[index]
        self.unread.discard(index)
        if not self.unread:
            self.parts = None  # all written: let it go
        return ir.tensor(result)


def _shapes(k: int, n: int, block: int) -> tuple[tuple[int, ...], ...]:
    """The quantizer's (packed, scales, zero points) shapes for a [K, N] weight."""
    blocks = -(-k // block)
    return (n, blocks, block // 2), (n, blocks), (n, -(-blocks // 2))


class QuantizeWeight(pattern.RewriteRuleClassBase):
    """MatMul(x, W) with a constant 2D W (or FusedMatMul(x, E, transB=1) with W = Eᵀ) → MatMulNBits."""

    def __init__(self, config: Int4, transposed: bool) -> None:
        super().__init__("FusedMatMulToMatMulNBits" if transposed else "MatMulToMatMulNBits")
        self.config, self.transposed = config, transposed
        self.done: dict[ir.Value, list[ir.Value]] = {}  # a weight two MatMuls read is quantized once

    def pattern(self, op, x, w):
        if self.transposed:
            return op.FusedMatMul(x, w, _domain=DOMAIN, _allow_other_attributes=True, _outputs=["product"])
        return op.MatMul(x, w, _outputs=["product"])

    def check(self, context, x, w, product, **_) -> MatchResult:
        result = MatchResult()
        if w.const_value is None or w.const_value.shape is None or len(w.const_value.shape) != 2:
            return result.fail("B is not a constant 2D weight", w)
        if w.dtype != ir.DataType.FLOAT:
            return result.fail("int4 quantizes fp32 weights", w)
        if self.transposed:
            node = product.producer()
            unit = (
                float_attr(node, "alpha", 1.0) == 1.0
                and not int_attr(node, "transA")
                and not int_attr(node, "transBatchA")
                and not int_attr(node, "transBatchB")
            )
            if not (unit and int_attr(node, "transB")):
                return result.fail("a FusedMatMul other than x·Wᵀ")
        return result

    def rewrite(self, op, x, w, **_):
        k, n = w.const_value.shape[::-1] if self.transposed else w.const_value.shape
        if w not in self.done:
            self.done[w] = self._initializers(op, w, k, n)
        attributes = {"K": k, "N": n, "bits": 4, "block_size": self.config.block_size, "accuracy_level": self.config.accuracy_level}
        return op.MatMulNBits(x, *self.done[w], _domain=DOMAIN, **attributes)

    def _initializers(self, op, w: ir.Value, k: int, n: int) -> list[ir.Value]:
        tensor = w.const_value
        assert tensor is not None  # check matched only constant weights
        weight = (lambda: tensor.numpy().T) if self.transposed else tensor.numpy
        quantized = _Quantized(weight, self.config)
        dtypes = (ir.DataType.UINT8, ir.DataType.FLOAT, ir.DataType.UINT8)
        names = (f"{w.name}_Q4", f"{w.name}_scales", f"{w.name}_zero_points")
        parts = [
            op.initializer(ir.LazyTensor(partial(quantized.part, i), dtype=dtype, shape=ir.Shape(shape)), name=name)
            for i, (dtype, shape, name) in enumerate(zip(dtypes, _shapes(k, n, self.config.block_size), names, strict=True))
        ]
        return parts if not self.config.symmetric else parts[:2]  # symmetric: no zero points (the quantizer's 8 is implied)


def quantize_weights(model: ir.Model, config: Int4) -> dict[str, int]:
    """Every MatMul (and tied-head FusedMatMul) with a constant fp32 weight to MatMulNBits, in place; rule → count."""
    rules = [QuantizeWeight.rule(config, transposed) for transposed in (False, True)]
    counts = {rule.name: RewriteRuleSet([rule]).apply_to_model(model) for rule in rules}
    common.RemoveUnusedNodesPass()(model)  # and the fp32 weights no node reads any more
    return counts
