"""TensorRT ONNX-parser support as data: which ops each TensorRT release parses, with which types.

Sources (stored copies, checked Nov 2026):
- onnx/onnx-tensorrt docs/operators.md for TensorRT 10.15: the op table below ("Y" rows and their
  "Supported Types"), and the documented opset range 9..24.
- onnx/onnx-tensorrt docs/Changelog.md: 10.14 "Added support for the `Attention` operator";
  10.15 "Added support for `RotaryEmbedding`, `RMSNormalization` and `TensorScatter`"; 10.11
  "Updated ONNX version to 1.18" (whose newest opset is 23).
- NVIDIA/TensorRT 11.0 release notes: parser adds `Swish` and the custom ops `TRT_Attention`,
  `TRT_MoE`, `TRT_KVCacheUpdate`; 11.5 notes: "Added support for ONNX opset 25" (so 11.0 stops at 24).
operators.md was not found for 10.13, 10.14 or 11.0: their op sets are the 10.15 table minus/plus
the changelog deltas above, which is exact for the ops headfold's graphs contain.
"""

from __future__ import annotations

from dataclasses import dataclass

_F = ("FLOAT", "FLOAT16", "BFLOAT16")
_FI = (*_F, "INT32", "INT64")
_FIB = (*_FI, "BOOL")
_FP32_16 = ("FLOAT", "FLOAT16")
_BOOL = ("BOOL",)
_QUANT = ("INT8", "FLOAT8E4M3FN", "FLOAT4E2M1", "INT4")

# op -> types of its data input accepted by the 10.15 parser (operators.md "Supported Types").
OPERATORS_10_15: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("Abs", "Add", "ArgMax", "ArgMin", "DepthToSpace", "Div", "Equal", "Greater"), _FI),
    **dict.fromkeys(("GreaterOrEqual", "IsNaN", "Less", "LessOrEqual", "Max", "Min", "Mod", "Mul"), _FI),
    **dict.fromkeys(("Neg", "Pad", "Pow", "Range", "Relu", "Scatter", "ScatterElements", "ScatterND"), _FI),
    **dict.fromkeys(("Shrink", "Sign", "SpaceToDepth", "Sub", "Sum", "TopK"), _FI),
    **dict.fromkeys(("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin"), _FI),
    **dict.fromkeys(("ReduceProd", "ReduceSum", "ReduceSumSquare"), _FI),
    **dict.fromkeys(("Concat", "Expand", "EyeLike", "Flatten", "Gather", "GatherElements", "GatherND"), _FIB),
    **dict.fromkeys(("Identity", "If", "Loop", "OneHot", "Reshape", "ReverseSequence", "Shape", "Size"), _FIB),
    **dict.fromkeys(("Slice", "Split", "Squeeze", "Tile", "Transpose", "Trilu", "Unsqueeze", "Where"), _FIB),
    **dict.fromkeys(("Cast", "CastLike"), (*_FIB, "UINT8")),
    **dict.fromkeys(("Constant", "ConstantOfShape"), (*_FI, "BOOL", "FLOAT8E4M3FN", "FLOAT4E2M1", "INT4")),
    **dict.fromkeys(("And", "Not", "Or", "Xor"), _BOOL),
    **dict.fromkeys(("Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "AveragePool"), _F),
    **dict.fromkeys(("BatchNormalization", "Ceil", "Celu", "Clip", "Conv", "ConvTranspose", "Cos", "Cosh"), _F),
    **dict.fromkeys(("CumSum", "Dropout", "Einsum", "Elu", "Erf", "Exp", "Floor", "Gemm"), _F),
    **dict.fromkeys(("GlobalAveragePool", "GlobalLpPool", "GlobalMaxPool", "GroupNormalization", "GRU"), _F),
    **dict.fromkeys(("HardSigmoid", "HardSwish", "Hardmax", "ImageScaler", "InstanceNormalization", "IsInf"), _F),
    **dict.fromkeys(("LayerNormalization", "LeakyRelu", "Log", "LogSoftmax", "LRN", "LSTM"), _F),
    **dict.fromkeys(("LpNormalization", "LpPool", "MatMul", "MaxPool", "MeanVarianceNormalization"), _F),
    **dict.fromkeys(("ParametricSoftplus", "PRelu", "QuantizeLinear", "RandomNormal", "RandomNormalLike"), _F),
    **dict.fromkeys(("RandomUniform", "RandomUniformLike", "Reciprocal", "Resize", "RMSNormalization"), _F),
    **dict.fromkeys(("RNN", "RotaryEmbedding", "Round", "ScaledTanh", "Scan", "Selu", "Sigmoid", "Sin"), _F),
    **dict.fromkeys(("Sinh", "Softmax", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu"), _F),
    "Upsample": _F,
    **dict.fromkeys(("BlackmanWindow", "DeformConv", "GridSample", "HammingWindow", "HannWindow"), _FP32_16),
    **dict.fromkeys(("Mish", "NonMaxSuppression", "NonZero", "RoiAlign"), _FP32_16),
    "STFT": ("FLOAT",),
    "Attention": (*_F, "INT8", "FLOAT8E4M3FN"),
    "DequantizeLinear": _QUANT,
    "Gelu": (*_F, "INT8", "INT32", "INT64"),
    "Mean": (*_F, "FLOAT8E4M3FN", "INT32", "INT64"),
    "TensorScatter": (*_F, "INT32"),
}

# Which input the "Supported Types" column describes, where it is not input 0.
TYPED_INPUT: dict[str, int] = {"Where": 1}


@dataclass(frozen=True)
class Release:
    """What one TensorRT release's ONNX parser takes beyond the previous release in RELEASES."""

    version: tuple[int, int]
    max_opset: int  # documented upper end of the opset range (lower end: 9 for all of 10.x/11.x)
    added_ops: dict[str, tuple[str, ...] | None]  # op -> supported types; None: types undocumented
    custom_ops: frozenset[str] = frozenset()  # TensorRT's own ops (any domain), parsed natively


MIN_OPSET = 9  # operators.md: "inclusive range of opset 9 to opset N"; the parser warns below 7

_LATER = ("Attention", "RotaryEmbedding", "RMSNormalization", "TensorScatter")
RELEASES: tuple[Release, ...] = (
    Release((10, 13), 23, {op: t for op, t in OPERATORS_10_15.items() if op not in _LATER}),
    Release((10, 14), 23, {"Attention": OPERATORS_10_15["Attention"]}),
    Release((10, 15), 24, {op: OPERATORS_10_15[op] for op in _LATER[1:]}),
    Release((11, 0), 24, {"Swish": None}, frozenset({"TRT_Attention", "TRT_MoE", "TRT_KVCacheUpdate"})),
)
