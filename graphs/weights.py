"""Export without the weights in memory: trace a hollow model, stream its weights from the checkpoint.

The model is built with its parameters on the meta device (converter.modeling.hollow_model) and
traced with fake CPU parameters (`fake_parameters`): torch.export needs no values, so tracing costs
no weight memory. The traced graph's parameter initializers then get their values back from the
checkpoint's safetensors files (`attach`): small ones are read at once (the rewrites fold and
inspect them as usual), large ones become lazy tensors that read their checkpoint tensor, cast to the
graph's dtype, only when the graph is saved, one at a time, straight into `.onnx.data`.

Saving costs what reading and writing the bytes costs: a weight that needs no cast and no transpose
is copied in the kernel, unread (copy_file_range); the others are read and cast in buffers reused from
one weight to the next (`reused_buffers`), and a transposed matrix is written band by band from a
buffer that stays in cache.

What onnxscript's optimizer would do to a large weight is done lazily here first: a Transpose that
is its only consumer (torch writes Linear as MatMul(x, Transpose(W))) becomes a lazy transposed
initializer under the Transpose's output name, as the constant folder names it. Large inputs are
never folded otherwise (the folder's own size limit), so the graphs are those of a real-weight export.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import ml_dtypes
import numpy as np
import onnx_ir as ir
import torch
from onnxscript.optimizer import optimize_ir
from onnxscript.optimizer._constant_folding import DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
from onnxscript.rewriter import onnx_fusions
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from headfold.converter.checkpoint import FileRange, TensorInfo, read_tensor
from headfold.converter.writer import copy_range
from headfold.graphs.rewrite.values import element_type, is_lazy, named, never_fold_lazy
from headfold.ground.errors import BadInput
from headfold.ground.precision import Precision

__all__ = ["fake_parameters", "attach", "lazy_weight", "joined", "reused_buffers", "StreamedWeight", "optimize_like_torch", "EAGER_ELEMENTS", "SOURCE"]

# Weights up to this many elements are read when attached: the constant folder folds what it may
# (it folds no larger input but a lone Transpose), and they are small (norms, biases, tables).
EAGER_ELEMENTS = DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
# Value.meta key of a lazy weight: (parameter name in `sources`, permutation or None) — where its
# values come from, so that graphs.template can give a copied layer its own.
SOURCE = "headfold.source"


def fake_parameters(model: nn.Module) -> None:
    """Give each meta-device parameter a fake CPU tensor in its place (shape and dtype, no data), so
    the model runs under torch.export next to real CPU inputs and buffers."""
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fakes: dict[int, nn.Parameter] = {}  # by the meta parameter: tied weights stay one parameter
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in fakes:
                    fake = mode.fake_tensor_converter.from_meta_and_device(mode, param, torch.device("cpu"))
                    fakes[id(param)] = nn.Parameter(fake, requires_grad=False)
                module._parameters[name] = fakes[id(param)]


def _as_ir(tensor: torch.Tensor) -> ir.Tensor:
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: the same bits as ml_dtypes'
        return ir.Tensor(tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16))
    return ir.Tensor(tensor.numpy())


class _Buffers:
    """Byte buffers by role, each grown to the largest weight that needed it."""

    def __init__(self) -> None:
        self._held: dict[str, torch.Tensor] = {}

    def get(self, role: str, nbytes: int) -> torch.Tensor:
        held = self._held.get(role)
        if held is None or held.numel() < nbytes:
            self._held.pop(role, None)  # released before the larger one is made
            held = self._held[role] = torch.empty(nbytes, dtype=torch.uint8)
        return held[:nbytes]


_REUSED: ContextVar[_Buffers | None] = ContextVar("reused weight buffers", default=None)


@contextmanager
def reused_buffers() -> Iterator[None]:
    """While a graph is saved: its streamed weights are read and cast in buffers kept from one weight to
    the next (two at most, each as large as the largest weight, and a transposed band), not in new memory."""
    token = _REUSED.set(_Buffers())
    try:
        yield
    finally:
        _REUSED.reset(token)


class StreamedWeight(ir.LazyTensor):
    """A weight left in the checkpoint until it is used: `parts` (checkpoint tensors of one dtype, joined
    along their first axis: packed QKV) cast to `dtype`, then permuted by `perm`. numpy() reads it into
    new memory, as any lazy tensor. tofile(), which writes it into .onnx.data, copies it in the kernel
    when it needs no cast or permutation; else it reads and casts it in the `reused_buffers` and writes
    a transposed matrix band by band (`_write_transposed`)."""

    __slots__ = ("parts", "perm")

    def __init__(self, parts: Sequence[TensorInfo], dtype: ir.DataType, perm: tuple[int, ...] | None, *, name: str | None) -> None:
        self.parts, self.perm = tuple(parts), perm
        shape = self._source_shape() if perm is None else [self._source_shape()[p] for p in perm]
        super().__init__(self.read, dtype=dtype, shape=ir.Shape(shape), name=name)

    def read(self) -> ir.Tensor:
        """The values, read into new memory."""
        values = self._cast(_Buffers())
        return _as_ir(values if self.perm is None else values.permute(self.perm).contiguous())

    def tofile(self, file) -> None:
        if self.perm is None and self.parts[0].dtype == self._torch_dtype:
            self._copy(file)
            return
        buffers = _REUSED.get() or _Buffers()
        values = self._cast(buffers)
        if self.perm == (1, 0):
            _write_transposed(_numpy_bits(values), file, buffers)
        else:
            file.write(_numpy_bits(values if self.perm is None else values.permute(self.perm).contiguous()).data)

    @property
    def _torch_dtype(self) -> torch.dtype:
        """The weight's dtype in torch: a float one (checkpoint tensors are weights; an integer buffer is no StreamedWeight)."""
        precision = Precision.of(self.dtype)
        if precision is None:
            raise TypeError(f"{self.name}: a streamed weight is a float tensor, not {self.dtype}")
        return precision.torch_dtype

    def _source_shape(self) -> list[int]:
        first = list(self.parts[0].shape)
        return first if len(self.parts) == 1 else [sum(part.shape[0] for part in self.parts), *first[1:]]

    def _cast(self, buffers: _Buffers) -> torch.Tensor:
        """The parts read back to back and cast to the weight's dtype (as Tensor.to: a contiguous copy, the
        same rounding), not yet permuted; in buffers from `buffers`."""
        dtype, source_dtype = self._torch_dtype, self.parts[0].dtype
        raw, start = buffers.get("read", sum(part.nbytes for part in self.parts)), 0
        for part in self.parts:
            read_tensor(part, out=raw[start : start + part.nbytes])
            start += part.nbytes
        values = raw.view(source_dtype).view(self._source_shape())
        if source_dtype == dtype:
            return values
        return buffers.get("cast", values.numel() * dtype.itemsize).view(dtype).view(values.shape).copy_(values)

    def _copy(self, file) -> None:
        """The parts' bytes copied by the kernel, unread."""
        file.flush()  # what the file object holds goes first: the kernel writes at its descriptor's position
        for part in self.parts:
            try:
                copy_range(FileRange(part.file, part.offset, part.nbytes), file)
            except EOFError:
                raise BadInput(f"{part.file} ends inside tensor {part.name}: it changed after headfold checked it; restore the file and rerun") from None


# A transposed matrix is written this many bytes of rows at a time (at least _TILE rows): a band stays in
# the core's cache until it is written, where a whole transposed copy goes out to memory and back.
_BAND_BYTES = 512 << 10
_TILE = 64  # rows of the source transposed at a time: a tile stays in the L1 cache


def _write_transposed(matrix: np.ndarray, file, buffers: _Buffers) -> None:
    """Write the 2-D `matrix`'s transpose, a band of its rows (the matrix's columns) at a time, each
    band filled tile by tile: the same bytes as torch's transposed copy, in half its time or less
    (numbers: benchmarks/results/export_throughput.json)."""
    rows, columns = matrix.shape
    band_rows = max(_TILE, min(columns, _BAND_BYTES // (rows * matrix.itemsize)))
    band = buffers.get("band", band_rows * rows * matrix.itemsize).numpy().view(matrix.dtype).reshape(band_rows, rows)
    for first in range(0, columns, band_rows):
        out = band[: min(band_rows, columns - first)]
        for row in range(0, rows, _TILE):
            out[:, row : row + _TILE] = matrix[row : row + _TILE, first : first + band_rows].T
        file.write(out.data)


def _numpy_bits(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's elements as unsigned integers of their size (numpy has no bfloat16; moving
    bits, never values, keeps every NaN payload)."""
    return tensor.view(torch.uint8).numpy().view(f"u{tensor.element_size()}").reshape(tensor.shape)


def lazy_weight(info: TensorInfo, dtype: ir.DataType, perm: tuple[int, ...] | None, *, name: str, source: str) -> ir.Value:
    """An initializer that reads checkpoint tensor `info` (permuted by `perm`) in `dtype` only when saved."""
    tensor = StreamedWeight([info], dtype, perm, name=name)
    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(dtype), const_value=tensor)
    value.meta[SOURCE] = (source, perm)
    return value


def joined(tensors: Sequence[ir.TensorProtocol], axis: int) -> StreamedWeight | None:
    """`tensors` concatenated along `axis`, as one streamed weight read part after part, when all are
    streamed weights of one dtype and permutation whose `axis` is their checkpoint tensors' first (packed
    QKV: the transposed Q, K and V projections side by side); else None."""
    streamed = [t for t in tensors if isinstance(t, StreamedWeight)]
    if len(streamed) != len(tensors):
        return None
    first = streamed[0]
    if (first.perm[axis] if first.perm else axis) != 0:
        return None
    parts = [part for t in streamed for part in t.parts]
    if any(t.dtype != first.dtype or t.perm != first.perm for t in streamed) or len({(p.code, p.shape[1:]) for p in parts}) != 1:
        return None
    return StreamedWeight(parts, first.dtype, first.perm, name=None)


def attach(model: ir.Model, sources: dict[str, TensorInfo], *, lazy_prefixes: tuple[str, ...] = ()) -> None:
    """Give the initializers named in `sources` (initializer name → checkpoint tensor) their values in
    the dtype the graph has for them, then fold each lone Transpose of a lazy one lazily. Those named
    with one of `lazy_prefixes` stay lazy whatever their size (graphs.template)."""
    for name, value in model.graph.initializers.items():
        if (info := sources.get(name)) is None:
            continue
        eager = value.const_value is not None and value.const_value.size <= EAGER_ELEMENTS and not name.startswith(lazy_prefixes)
        value.const_value = StreamedWeight([info], element_type(value), None, name=name)
        if eager:
            value.const_value = value.const_value.read()
            value.const_value.name = name
        else:
            value.meta[SOURCE] = (name, None)
    _fold_lazy_transposes(model, sources)


def _fold_lazy_transposes(model: ir.Model, sources: dict[str, TensorInfo]) -> None:
    graph = model.graph
    for name, value in [(n, v) for n, v in graph.initializers.items() if is_lazy(v)]:
        users, tensor = value.consumers(), value.const_value
        if len(users) != 1 or users[0].op_type != "Transpose" or users[0].domain not in ("", "ai.onnx") or tensor is None:
            continue
        node, shape = users[0], tensor.shape
        attribute = node.attributes.get("perm")
        perm = tuple(attribute.as_ints()) if attribute is not None else tuple(reversed(range(len(shape))))
        out, source = node.outputs[0], value.meta[SOURCE][0]
        folded = lazy_weight(sources[source], element_type(value), perm, name=named(out), source=source)
        ir.convenience.replace_all_uses_with(out, folded)
        graph.remove(node, safe=True)
        graph.initializers.pop(name)
        graph.register_initializer(folded)


def optimize_like_torch(model: ir.Model) -> None:
    """What torch.onnx.export(optimize=True) runs on its graph, lazy weights left unread."""
    optimize_ir(model, should_fold=never_fold_lazy)
    onnx_fusions.fuse(model)
