"""Precision: the one precision vocabulary, its order and its dtypes in torch, ONNX and safetensors."""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest
import torch

from headfold.ground.errors import BadOption
from headfold.ground.precision import Precision

FLOATS = {
    Precision.FP32: (torch.float32, ir.DataType.FLOAT, "F32"),
    Precision.FP16: (torch.float16, ir.DataType.FLOAT16, "F16"),
    Precision.BF16: (torch.bfloat16, ir.DataType.BFLOAT16, "BF16"),
}


def test_names_are_what_users_type_and_files_hold() -> None:
    assert [str(p) for p in Precision] == ["fp32", "fp16", "bf16", "int4"]
    assert json.dumps({"dtype": Precision.BF16}) == '{"dtype": "bf16"}' and f"--dtype {Precision.INT4}" == "--dtype int4"
    assert Precision.parse("fp16") is Precision.FP16 and Precision.parse(Precision.INT4) is Precision.INT4


@pytest.mark.parametrize("bad", ("fp64", "FP16", "", 16, None))
def test_parse_refuses_in_one_line_naming_the_value_and_the_choices(bad: object) -> None:
    with pytest.raises(BadOption) as err:
        Precision.parse(bad, "--dtype")
    assert str(err.value) == f"--dtype {bad!r} is not one of fp32, fp16, bf16, int4"


def test_parse_holds_to_the_choices_given() -> None:
    with pytest.raises(BadOption, match=r"^--precision 'int4' is not one of fp32, fp16, bf16$"):
        Precision.parse("int4", "--precision", Precision.floats())


def test_order_is_by_mantissa_bits() -> None:
    assert sorted(Precision, key=lambda p: -p.mantissa_bits) == list(Precision)
    assert [p.mantissa_bits for p in Precision.floats()] == [23, 10, 7]  # IEEE fp32, fp16, bfloat16
    assert Precision.coarsest(Precision.FP32, Precision.BF16) is Precision.BF16
    assert Precision.coarsest(Precision.FP16, Precision.BF16) is Precision.BF16
    assert Precision.coarsest(Precision.INT4, Precision.FP32) is Precision.INT4


@pytest.mark.parametrize("precision", FLOATS)
def test_dtypes_round_trip(precision: Precision) -> None:
    torch_dtype, ir_dtype, code = FLOATS[precision]
    assert (precision.torch_dtype, precision.ir_dtype) == (torch_dtype, ir_dtype)
    assert Precision.of(torch_dtype) is Precision.of(ir_dtype) is Precision.of(code) is precision
    assert precision.itemsize == torch_dtype.itemsize == ir_dtype.itemsize
    assert precision.is_float and precision.computed_in is precision


def test_int4_is_weight_only() -> None:
    assert Precision.floats() == (Precision.FP32, Precision.FP16, Precision.BF16)
    assert not Precision.INT4.is_float and Precision.INT4.computed_in is Precision.FP32 and Precision.INT4.itemsize == 0.5
    with pytest.raises(ValueError, match="computed_in"):
        Precision.INT4.torch_dtype  # noqa: B018


def test_other_dtypes_have_no_precision() -> None:
    assert {Precision.of(d) for d in (torch.float64, torch.int64, ir.DataType.DOUBLE, ir.DataType.INT4, "F64", "I8")} == {None}
