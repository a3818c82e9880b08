"""ONNX-level MHA → GQA/MQA: pool each `Attention` node's K/V projection weights inside the graph.

For users who only hold ONNX. Each standard Attention node's K and V inputs are traced back to a
constant projection: [past Concat] ← per-head ops (Transpose, RotaryEmbedding, norms, scalar
scales) ← the head-splitting Reshape (B, S, heads·d) → (B, S, heads, d) ← [Reshape, Split of a
fused Q/K/V projection, bias Add] ← MatMul or Gemm with a constant weight. The K/V columns (and
biases) are pooled per contiguous group with the converter's methods on the canonical head
layout, the head Reshape is pointed at kv-heads, and past/present K/V graph inputs/outputs get
kv-heads. The walk is imperative on purpose: the chain has a family-dependent number of per-head
ops, which a fixed rewriter pattern can't express.
"""

from __future__ import annotations

import itertools
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
import torch

from headfold.converter.conversion import target_shape
from headfold.converter.layout import AttentionWeights, HeadShape, merge_heads, split_heads
from headfold.converter.methods import Recipe, convert_attention, get_method
from headfold.converter.per_layer import collapse, expand
from headfold.graphs.onnx_files import external_data_files, load_graph
from headfold.graphs.rewrite import attention_nodes, attention_op, check_attention, is_attention_node
from headfold.ground import VERSION
from headfold.ground.artifacts import CREATED_BY, MARK
from headfold.ground.atomic import atomic_outputs, check_outputs
from headfold.ground.errors import BadInput, first_line

__all__ = ["convert_onnx"]

# Ops between the head-splitting Reshape and the Attention input that act per head (input 0 is
# the data); Mul/Div only with a constant scalar.
_PER_HEAD_OPS = {"Transpose", "RotaryEmbedding", "RMSNormalization", "LayerNormalization", "Cast", "Identity", "Mul", "Div"}


def _input(node: ir.Node, index: int) -> ir.Value:
    """Input `index` of `node`, which the walk has found present."""
    value = node.inputs[index] if index < len(node.inputs) else None
    if value is None:
        raise BadInput(f"{node.op_type} {node.name!r} has no input {index}")
    return value


def _constant(value: ir.Value) -> np.ndarray:
    """The values of a constant the walk has found (an initializer or a folded Constant)."""
    if value.const_value is None:
        raise BadInput(f"{value.name} is not a constant")
    return value.const_value.numpy()


def _graph(node: ir.Node) -> ir.Graph:
    if node.graph is None:  # every node the walk reaches sits in the model's graph
        raise BadInput(f"{node.op_type} {node.name!r} is in no graph")
    return node.graph


@dataclass
class Slot:
    """A column range [start, start + width) of a constant tensor, read by input `index` of `node`."""

    node: ir.Node
    index: int
    axis: int  # the tensor's output-feature axis
    start: int
    width: int

    @property
    def tensor(self) -> ir.Value:
        return _input(self.node, self.index)

    def read(self) -> torch.Tensor:
        array = _constant(self.tensor)
        return torch.from_numpy(array.copy()).narrow(self.axis, self.start, self.width).float()


@dataclass
class Projection:
    """Where one K or V input of an Attention node comes from."""

    weight: Slot
    bias: Slot | None
    reshape: ir.Node  # (B, S, heads·d) → (B, S, heads, d)
    splits: list[tuple[ir.Node, int]] = field(default_factory=list)  # fused Q/K/V Split and our output index
    views: list[ir.Node] = field(default_factory=list)  # Reshapes of the fused projection that keep its last axis
    head_values: list[ir.Value] = field(default_factory=list)  # values with the head axis at 1 (BNSH)
    rotaries: list[ir.Node] = field(default_factory=list)


def convert_onnx(src: str | os.PathLike, out: str | os.PathLike, kv_heads: int | Sequence[int], method: str = "mean", *, overwrite: bool = False) -> dict:
    """Convert the ONNX model `src` so every Attention node has `kv_heads` K/V heads; write `out`.

    `kv_heads` is one count, or one per Attention node in graph order (= layer order).

    Raises BadInput (nothing written) for a missing/corrupt model, an impossible kv-heads, a
    graph without (traceable) Attention nodes, a method that rewrites Q/O, or an existing output.
    """
    src, out = Path(src), Path(out)
    recipe = get_method(method)
    if recipe.data_aware:
        raise BadInput(f"method {method!r} rewrites Q/O from calibration data; ONNX convert supports mean and first")
    model = _load(src)
    reads = [src, *external_data_files(model, src)]
    outputs = [(out, False), (_data_file(out), False)]
    check_outputs(outputs, overwrite=overwrite, sources=reads)  # before the work: never over an input, not even X's own .data
    nodes = attention_nodes(model)
    if not nodes:
        raise BadInput(f"{src}: no standard ONNX Attention node found; export with opset ≥ 23 (headfold export)")
    per_layer = expand(kv_heads, len(nodes))
    by_layer = not isinstance(kv_heads, int)  # name the layer in errors
    graph_nodes = [n for n in model.graph if is_attention_node(n, "onnx")]
    source_kv = {_convert_attention(node, kv, recipe, i if by_layer else None) for i, (node, kv) in enumerate(zip(graph_nodes, per_layer, strict=True))}
    _refresh_shapes(model)
    check_attention(attention_nodes(model), kv_heads=collapse(per_layer), layers=len(nodes), graph=src.name)
    _save(model, out, overwrite, reads)
    return {
        "source": str(src),
        "output": str(out),
        "attention_nodes": len(nodes),
        "attention_op": attention_op("onnx"),
        "source_kv_heads": sorted(source_kv),
        "kv_heads": collapse(per_layer),
        "method": method,
    }


def _load(src: Path) -> ir.Model:
    if src.suffix != ".onnx" or not src.is_file():
        raise BadInput(f"{src} is not an .onnx file")
    model = load_graph(src)  # empty, garbage, external data outside its folder: refused
    try:
        onnx.checker.check_model(str(src))  # path-based: also reads external data
    except Exception as e:  # onnx raises several unrelated types for corrupt files
        raise BadInput(f"{src} is not a valid ONNX model: {first_line(e)}") from None
    return model


def _convert_attention(node: ir.Node, kv_heads: int, recipe: Recipe, layer: int | None = None) -> int:
    """Pool this node's K/V projections to kv_heads in place; return the source kv-heads."""
    (heads, head_size), (source_kv, _) = (_heads(node, i) for i in (0, 1))
    target = target_shape(HeadShape(heads, source_kv, head_size), kv_heads, layer)
    k, v = (_trace(node, i, source_kv, head_size) for i in (1, 2))
    attn = AttentionWeights(
        q=torch.empty(0),
        o=torch.empty(0),  # the methods allowed here pool K/V only
        k=split_heads(k.weight.read(), k.weight.axis, source_kv),
        v=split_heads(v.weight.read(), v.weight.axis, source_kv),
        k_bias=split_heads(k.bias.read(), 0, source_kv) if k.bias else None,
        v_bias=split_heads(v.bias.read(), 0, source_kv) if v.bias else None,
    )
    pooled = convert_attention(recipe, attn, target.kv_heads).attn
    updates = [(k.weight, merge_heads(pooled.k, k.weight.axis)), (v.weight, merge_heads(pooled.v, v.weight.axis))]
    for slot, bias in ((k.bias, pooled.k_bias), (v.bias, pooled.v_bias)):
        if slot is not None and bias is not None:  # pooling keeps a bias exactly where the source had one
            updates.append((slot, merge_heads(bias, 0)))
    _write(updates)
    for projection in (k, v):
        _to_kv_heads(projection, target.kv_heads, head_size)
    views = {id(view): (view, p.weight) for p in (k, v) for view in p.views}  # K and V may share a fused one
    for view, weight in views.values():
        _set_last_axis(view, _constant(weight.tensor).shape[weight.axis])
    return source_kv


def _heads(node: ir.Node, index: int) -> tuple[int, int]:
    """(heads, head size) of the Attention input `index`, (B, heads, S, d) with both static."""
    value = node.inputs[index]
    if value is None or value.shape is None or value.shape.rank() != 4 or not all(isinstance(value.shape[i], int) for i in (1, 3)):
        raise BadInput(f"Attention node {node.name!r}: input {index} is not 4D (B, heads, S, d) with static heads")
    _, heads, _, head_size = value.shape
    assert isinstance(heads, int) and isinstance(head_size, int)  # checked above
    return heads, head_size


def _unsupported(node: ir.Node, index: int, why: str) -> BadInput:
    role = "K" if index == 1 else "V"
    return BadInput(f"Attention node {node.name!r}: cannot trace {role} to a constant projection ({why})")


def _trace(node: ir.Node, index: int, heads: int, head_size: int) -> Projection:
    """Walk from the Attention's K or V input back to its projection weight."""
    value, head_values, rotaries = _input(node, index), [], []
    while True:
        head_values.append(value)
        producer = value.producer()
        if producer is None:
            raise _unsupported(node, index, f"{value.name} is a graph input")
        if producer.op_type == "Concat" and len(producer.inputs) == 2 and _input(producer, 0).is_graph_input():
            head_values.append(_input(producer, 0))  # the past K/V: its head axis shrinks too
            value = _input(producer, 1)
        elif producer.op_type == "Reshape":
            break
        elif producer.op_type in _PER_HEAD_OPS and _per_head(producer):
            rotaries += [producer] if producer.op_type == "RotaryEmbedding" else []
            value = _input(producer, 0)
        else:
            raise _unsupported(node, index, f"{producer.op_type} {producer.name!r} between the heads and Attention")
    flat = _input(producer, 0)
    if (dims := _dims(flat)) is None or len(dims) != 3 or dims[2] != heads * head_size:
        raise _unsupported(node, index, f"Reshape {producer.name!r} does not split (B, S, {heads}·{head_size}) into heads")
    return _projection(node, index, flat, producer, head_values, rotaries)


def _projection(node: ir.Node, index: int, flat: ir.Value, reshape: ir.Node, head_values: list[ir.Value], rotaries: list[ir.Node]) -> Projection:
    """From the head Reshape's input back through [Reshape, Split, bias Add] to MatMul/Gemm (`flat`: (B, S, width))."""
    width, offset, bias, splits, views, value = _last_dim(flat), 0, None, [], [], flat
    while (producer := value.producer()) is not None:
        if producer.op_type == "Split":
            position = list(producer.outputs).index(value)
            sizes = _split_sizes(producer)
            if sizes is None or _axis(producer) not in (-1, len(_dims(producer.inputs[0]) or ()) - 1):
                raise _unsupported(node, index, f"Split {producer.name!r} is not a constant split of the last axis")
            offset += sum(sizes[:position])
            splits.append((producer, position))
            value = _input(producer, 0)
        elif producer.op_type == "Reshape" and (dims := _dims(value)) and (_dims(producer.inputs[0]) or (None,))[-1] == dims[-1]:
            views.append(producer)  # e.g. (B·S, F) → (B, S, F) after a Gemm
            value = _input(producer, 0)
        elif producer.op_type == "Add" and (slot := _bias_slot(producer, offset, width)):
            bias, value = slot, _input(producer, 1 - slot.index)
        elif producer.op_type in ("MatMul", "Gemm") and (weight := _weight_slot(producer, offset, width)):
            if bias is None and producer.op_type == "Gemm" and len(producer.inputs) > 2 and producer.inputs[2] is not None:
                bias = Slot(producer, 2, 0, offset, width)
            return Projection(weight, bias, reshape, splits, views, head_values, rotaries)
        else:
            break
    raise _unsupported(node, index, f"no constant MatMul/Gemm weight behind {flat.name!r}")


def _dims(value: ir.Value | None) -> tuple[int | ir.SymbolicDim, ...] | None:
    return None if value is None or value.shape is None else tuple(value.shape)


def _last_dim(value: ir.Value) -> int:
    """The static size of the value's last axis (the caller has checked it: a projection's feature width)."""
    dims = _dims(value)
    if not dims or not isinstance(dims[-1], int):
        raise BadInput(f"{value.name} has no static last axis")
    return dims[-1]


def _per_head(node: ir.Node) -> bool:
    """Scalar Mul/Div only: a per-channel scale would differ between the heads of a group."""
    if node.op_type not in ("Mul", "Div"):
        return True
    other = _input(node, 1).const_value
    return other is not None and other.numpy().size == 1


def _axis(node: ir.Node) -> int:
    attr = node.attributes.get("axis")
    return attr.as_int() if attr is not None else 0


def _split_sizes(split: ir.Node) -> list[int] | None:
    if len(split.inputs) > 1 and split.inputs[1] is not None:
        sizes = split.inputs[1].const_value
        return None if sizes is None else [int(s) for s in sizes.numpy()]
    total = (_dims(split.inputs[0]) or (None,))[-1]
    parts = len(split.outputs)
    return [total // parts] * parts if isinstance(total, int) and total % parts == 0 else None


def _bias_slot(add: ir.Node, offset: int, width: int) -> Slot | None:
    for index in (0, 1):
        tensor = _input(add, index).const_value
        if tensor is not None and len(tensor.shape) == 1 and add.inputs[1 - index] is not None:
            return Slot(add, index, 0, offset, width)
    return None


def _weight_slot(node: ir.Node, offset: int, width: int) -> Slot | None:
    """The weight (input 1) of MatMul(x, W) or Gemm(x, W[ᵀ]) with alpha = beta = 1, transA = 0."""
    weight = _input(node, 1).const_value
    if weight is None or len(weight.shape) != 2:
        return None
    attrs = {name: attr.value for name, attr in node.attributes.items()}
    if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
        return None
    return Slot(node, 1, 0 if attrs.get("transB", 0) else 1, offset, width)


def _write(updates: list[tuple[Slot, torch.Tensor]]) -> None:
    """Replace each slot's columns with the pooled ones; slots of one fused tensor are written together."""
    by_tensor: dict[tuple[int, int], list[tuple[Slot, torch.Tensor]]] = defaultdict(list)
    for slot, new in updates:
        by_tensor[id(slot.node), slot.index].append((slot, new))
    for pieces in by_tensor.values():
        slot = pieces[0][0]
        source = _constant(slot.tensor)
        parts, cursor = [], 0
        for piece, new in sorted(pieces, key=lambda p: p[0].start):
            parts += [np.take(source, range(cursor, piece.start), axis=piece.axis), new.numpy().astype(source.dtype)]
            cursor = piece.start + piece.width
        parts.append(np.take(source, range(cursor, source.shape[slot.axis]), axis=slot.axis))
        _set_constant(slot.node, slot.index, np.concatenate(parts, axis=slot.axis), f"{slot.tensor.name}.gqa")


def _set_constant(node: ir.Node, index: int, array: np.ndarray, name: str) -> None:
    """A new initializer for this input only: other readers of the old tensor keep it."""
    graph = _graph(node)
    name = next(n for n in itertools.chain([name], (f"{name}_{i}" for i in itertools.count(1))) if n not in graph.initializers)
    value = ir.Value(
        name=name,
        const_value=ir.tensor(array, name=name),
        shape=ir.Shape(array.shape),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
    )
    graph.register_initializer(value)
    node.replace_input_with(index, value)


def _to_kv_heads(projection: Projection, kv_heads: int, head_size: int) -> None:
    """Point the shapes downstream of the pooled projection at kv-heads."""
    reshape = projection.reshape
    _set_constant(reshape, 1, np.array([0, 0, kv_heads, head_size], dtype=np.int64), f"{reshape.name}.gqa_shape")
    reshape.attributes["allowzero"] = ir.AttrInt64("allowzero", 0)  # 0 = copy B and S from the input
    for split, position in projection.splits:
        _resize_split(split, position, kv_heads * head_size)
    for rotary in projection.rotaries:
        if "num_heads" in rotary.attributes:
            rotary.attributes["num_heads"] = ir.AttrInt64("num_heads", kv_heads)
    for value in projection.head_values:
        if (value.is_graph_input() or value.is_graph_output()) and value.shape is not None:  # set: _heads read it
            value.shape = ir.Shape([value.shape[0], kv_heads, *value.shape[2:]])


def _set_last_axis(view: ir.Node, width: int) -> None:
    """The view's target shape spells the old feature width as a constant: write the new one."""
    shape = _input(view, 1)
    if shape.const_value is not None:
        target = shape.const_value.numpy().copy()
        target[-1] = width
        return _set_constant(view, 1, target, f"{shape.name}.gqa")
    concat = shape.producer()
    if concat is not None and concat.op_type == "Concat" and _input(concat, len(concat.inputs) - 1).const_value is not None:
        # A copy of the shape expression for this view only: other Reshapes may read the original.
        copy = ir.node("Concat", concat.inputs, attributes={"axis": 0}, name=f"{view.name}.gqa_shape")
        _graph(view).insert_before(view, copy)
        view.replace_input_with(1, copy.outputs[0])
        return _set_constant(copy, len(copy.inputs) - 1, np.array([width], dtype=np.int64), "gqa_width")
    raise BadInput(f"Reshape {view.name!r} of a fused Q/K/V projection has a shape headfold cannot re-derive")


def _resize_split(split: ir.Node, position: int, width: int) -> None:
    sizes = _split_sizes(split)
    assert sizes is not None  # _projection kept only constant splits
    sizes[position] = width
    split.attributes.pop("num_outputs", None)
    if len(split.inputs) < 2:
        split.resize_inputs(2)
    _set_constant(split, 1, np.array(sizes, dtype=np.int64), f"{split.name}.gqa_split")


def _refresh_shapes(model: ir.Model) -> None:
    """Drop stale intermediate shapes (graph inputs/outputs were set exactly), then re-infer."""
    for node in model.graph:
        for value in node.outputs:
            if not value.is_graph_output():
                value.shape = None
    common.RemoveUnusedNodesPass()(model)
    common.ShapeInferencePass()(model)


def _data_file(graph: Path) -> Path:
    return graph.with_name(f"{graph.name}.data")


def _save(model: ir.Model, out: Path, overwrite: bool, reads: list[Path]) -> None:
    """Graph + `<name>.data`, written and checked in hidden staging folders, then moved into place
    together (ground.atomic); on any error neither remains. The graph carries headfold's mark."""
    data = _data_file(out)
    model.metadata_props[CREATED_BY] = f"{MARK} {VERSION}"
    with atomic_outputs([(out, False), (data, False)], overwrite=overwrite, sources=reads) as staged:
        graph = staged[data].with_name(out.name)  # beside its weights, as the graph names them
        ir.save(model, graph, external_data=data.name)
        onnx.checker.check_model(str(graph))
        os.replace(graph, staged[out])
