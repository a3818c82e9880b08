"""Small, shared facts about ir.Values used by the rules' checks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

Dim = int | ir.SymbolicDim


def named(value: ir.Value) -> str:
    """The value's name: torch.onnx names every initializer and node output."""
    if value.name is None:
        raise ValueError("an unnamed value where torch.onnx names each one")
    return value.name


def element_type(value: ir.Value) -> ir.DataType:
    """The value's element type: torch.onnx types every initializer."""
    if value.dtype is None:
        raise ValueError(f"the value {value.name} has no element type")
    return value.dtype


def dims(value: ir.Value | None, rank: int) -> tuple[Dim, ...] | None:
    """The value's dimensions when its rank is `rank`, else None."""
    if value is None or value.shape is None or value.shape.rank() != rank:
        return None
    return tuple(value.shape)


def same_dim(a: Dim, b: Dim) -> bool:
    """Equal and known: two unnamed symbolic dims compare equal in onnx_ir but prove nothing."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a.value is not None and a.value == b.value


def same_dims(a: Sequence[Dim], b: Sequence[Dim]) -> bool:
    return len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b, strict=True))


def is_lazy(value: ir.Value | None) -> bool:
    """Whether the value is an initializer whose contents are read (from the checkpoint) only when saved."""
    return value is not None and isinstance(value.const_value, ir.LazyTensor)


def never_fold_lazy(node: ir.Node) -> bool | None:
    """The constant folder's `should_fold`: lazy inputs are never folded (that would hold them in memory);
    None leaves every other node to the folder's own rules."""
    return False if any(is_lazy(value) for value in node.inputs) else None


def constant(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant contents (initializer or folded Constant), else None."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    return None if tensor is None else tensor.numpy()


def scalar(value: ir.Value | None) -> float | None:
    """A one-element constant as a float, else None."""
    array = constant(value)
    return float(array.reshape(())) if array is not None and array.size == 1 else None


def int_list(value: ir.Value | None) -> list[int] | None:
    array = constant(value)
    return None if array is None else [int(x) for x in array.reshape(-1)]


def gqa_problem(query: ir.Value, key: ir.Value, value: ir.Value) -> str | None:
    """Why 4D (B, heads, S, head_size) Q/K/V are not one GQA attention with static heads, or None."""
    q, k, v = dims(query, 4), dims(key, 4), dims(value, 4)
    if q is None or k is None or v is None or not (isinstance(q[1], int) and isinstance(k[1], int) and isinstance(q[3], int)):
        return "Q/K/V are not 4D with static heads and head size"
    if q[1] % k[1] or k[1] != v[1] or q[3] != k[3]:
        return f"Q {q}, K {k}, V {v} are not one GQA attention"
    return None


def int_attr(node: ir.Node, name: str, default: int = 0) -> int:
    attr = node.attributes.get(name)
    return attr.as_int() if attr is not None else default


def float_attr(node: ir.Node, name: str, default: float = 0.0) -> float:
    attr = node.attributes.get(name)
    return attr.as_float() if attr is not None else default
