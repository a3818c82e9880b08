"""The one precision vocabulary: what export writes (--dtype), build builds (--precision), verify's
budgets key on and a checkpoint's weights are in. Parsed once where a user's text comes in; every
room then asks the member for what it needs (its order, its torch and ONNX dtypes), so no room keeps
a table of its own. The values are the names users type and files hold (export.json, budgets, reports).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Any

from headfold.ground.errors import BadOption
from headfold.ground.inputs import shown
from headfold.ground.lazy import lazy_import

if TYPE_CHECKING:
    import torch
else:  # `import headfold` stays free of torch and ONNX: they load when a dtype is first asked for
    torch = lazy_import("torch")
ir = lazy_import("onnx_ir")  # not even for type checking: the converter, which asks for precisions, imports no ONNX

# member value → (mantissa bits, bytes per element, torch / onnx_ir / safetensors dtype name); int4
# is weight-only: 4-bit MatMul codes with 3 bits of magnitude, the graph otherwise fp32.
_FACTS = {
    "fp32": (23, 4.0, "float32", "FLOAT", "F32"),
    "fp16": (10, 2.0, "float16", "FLOAT16", "F16"),
    "bf16": (7, 2.0, "bfloat16", "BFLOAT16", "BF16"),
    "int4": (3, 0.5, None, None, None),
}


@dataclass(frozen=True)
class StoredDtype:
    """A safetensors dtype code's facts (the dtypes checkpoints are stored in)."""

    torch: str  # torch's dtype name
    itemsize: int  # bytes per element
    kind: str  # "float", "fp8" (quantized), "int" or "bool"
    numpy: str | None = None  # the numpy dtype that holds its bytes for pooling without torch (bf16: its bits, uint16)


SAFETENSORS_DTYPES: dict[str, StoredDtype] = {
    "F64": StoredDtype("float64", 8, "float", "float64"), "F32": StoredDtype("float32", 4, "float", "float32"),
    "F16": StoredDtype("float16", 2, "float", "float16"), "BF16": StoredDtype("bfloat16", 2, "float", "uint16"),
    "I64": StoredDtype("int64", 8, "int"), "I32": StoredDtype("int32", 4, "int"), "I16": StoredDtype("int16", 2, "int"),
    "I8": StoredDtype("int8", 1, "int"), "U8": StoredDtype("uint8", 1, "int"), "BOOL": StoredDtype("bool", 1, "bool"),
    "F8_E4M3": StoredDtype("float8_e4m3fn", 1, "fp8"), "F8_E5M2": StoredDtype("float8_e5m2", 1, "fp8"),
}  # fmt: skip
CODE_OF_DTYPE = {stored.torch: code for code, stored in SAFETENSORS_DTYPES.items()}  # torch dtype name → code
FLOAT_CODES = tuple(code for code, stored in SAFETENSORS_DTYPES.items() if stored.kind == "float")
FP8_CODES = tuple(code for code, stored in SAFETENSORS_DTYPES.items() if stored.kind == "fp8")


class Precision(StrEnum):
    """A precision by the name users type; `str(p)` and JSON give that name."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT4 = "int4"  # export's 4-bit MatMul weights (ONNX Runtime's MatMulNBits): no engine precision, gated by its loss

    @classmethod
    def parse(cls, text: Any, option: str = "precision", choices: tuple[Precision, ...] | None = None) -> Precision:
        """`text` ("fp16", or a member) as a member of `choices` (default: all); BadOption (bad input)
        naming `option`, the bad value and the choices otherwise."""
        choices = choices or tuple(cls)
        if isinstance(text, str) and text in choices:  # a member, or its name: StrEnum members equal their values
            return cls(text)
        raise BadOption(
            option, f"{shown(str(text) if isinstance(text, str) else text)} is not one of {', '.join(choices)}"
        )  # str: a member's name, not its repr

    @classmethod
    def floats(cls) -> tuple[Precision, ...]:
        """The float precisions, most to fewest mantissa bits: what an engine is built in and a graph computes in."""
        return tuple(p for p in cls if p.is_float)

    @classmethod
    def of(cls, dtype: Any) -> Precision | None:
        """The float precision of a torch or onnx_ir dtype or a safetensors code (torch.float16,
        ir.DataType.FLOAT16, "F16"); None for any other (fp64, integers)."""
        name = str(dtype).removeprefix("torch.")  # str(ir.DataType.FLOAT16) is "FLOAT16"
        return next((p for p in cls.floats() if name in _FACTS[p][2:]), None)

    @property
    def mantissa_bits(self) -> int:
        """Bits kept of each value's mantissa: orders precisions from finest (fp32) to coarsest (int4)."""
        return _FACTS[self][0]

    @property
    def itemsize(self) -> float:
        """Bytes per stored element, as torch and numpy name it (int4: half a byte, its block scales not counted)."""
        return _FACTS[self][1]

    @property
    def is_float(self) -> bool:
        """A float type the whole graph computes in; False for int4, a weight-only quantization."""
        return _FACTS[self][2] is not None

    @property
    def computed_in(self) -> Precision:
        """The float precision the graph is traced and computes in: its own, fp32 for int4 weights."""
        return self if self.is_float else Precision.FP32

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of a float precision (ValueError for int4: see computed_in)."""
        return getattr(torch, self._float_fact(2))

    @property
    def ir_dtype(self) -> IntEnum:
        """The ONNX (onnx_ir) element type of a float precision (ValueError for int4: see computed_in): an
        ir.DataType, typed as its IntEnum base since ground names no ONNX type (see `ir` above)."""
        return getattr(ir.DataType, self._float_fact(3))

    def _float_fact(self, index: int) -> str:
        fact = _FACTS[self][index]
        if not isinstance(fact, str):  # int4 (not is_float): no dtype names
            raise ValueError(f"{self} is weight-only quantization, not an element type; ask for its computed_in precision")
        return fact

    @staticmethod
    def coarsest(*precisions: Precision) -> Precision:
        """The precision with the fewest mantissa bits: the one a comparison between them is held to."""
        return min(precisions, key=lambda p: Precision(p).mantissa_bits)
