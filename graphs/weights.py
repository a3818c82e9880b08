"""Export without the weights in memory: trace a hollow model, stream its weights from the checkpoint.

The model is built with its parameters on the meta device (converter.modeling.hollow_model) and
traced with fake CPU parameters (`fake_parameters`): torch.export needs no values, so tracing costs
no weight memory. The traced graph's parameter initializers then get their values back from the
checkpoint's safetensors files (`attach`): small ones are read at once (the rewrites fold and
inspect them as usual), large ones become lazy tensors that read their checkpoint tensor, cast to the
graph's dtype, only when the graph is saved, one at a time, straight into `.onnx.data`.

What onnxscript's optimizer would do to a large weight is done lazily here first: a Transpose that
is its only consumer (torch writes Linear as MatMul(x, Transpose(W))) becomes a lazy transposed
initializer under the Transpose's output name, as the constant folder names it. Large inputs are
never folded otherwise (the folder's own size limit), so the graphs are those of a real-weight export.
"""

from __future__ import annotations

from collections.abc import Callable

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

from headfold.converter.checkpoint import TensorInfo, read_tensor
from headfold.graphs.rewrite.values import is_lazy, never_fold_lazy

__all__ = ["fake_parameters", "attach", "lazy_weight", "optimize_like_torch", "EAGER_ELEMENTS", "SOURCE"]

# Weights up to this many elements are read when attached: the constant folder folds what it may
# (it folds no larger input but a lone Transpose), and they are small (norms, biases, tables).
EAGER_ELEMENTS = DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT
# Value.meta key of a lazy weight: (parameter name in `sources`, permutation or None) — where its
# values come from, so that graphs.template can give a copied layer its own.
SOURCE = "headfold.source"
_TORCH_DTYPES = {ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16, ir.DataType.BFLOAT16: torch.bfloat16}


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


def _reader(info: TensorInfo, dtype: torch.dtype, perm: tuple[int, ...] | None) -> Callable[[], ir.Tensor]:
    def read() -> ir.Tensor:
        tensor = read_tensor(info).to(dtype)
        return _as_ir(tensor if perm is None else tensor.permute(perm).contiguous())

    return read


def lazy_weight(info: TensorInfo, dtype: ir.DataType, perm: tuple[int, ...] | None, *, name: str, source: str) -> ir.Value:
    """An initializer that reads checkpoint tensor `info` (permuted by `perm`) in `dtype` only when saved."""
    shape = info.shape if perm is None else [info.shape[p] for p in perm]
    tensor = ir.LazyTensor(_reader(info, _TORCH_DTYPES[dtype], perm), dtype=dtype, shape=ir.Shape(shape), name=name)
    value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(dtype), const_value=tensor)
    value.meta[SOURCE] = (source, perm)
    return value


def attach(model: ir.Model, sources: dict[str, TensorInfo], *, lazy_prefixes: tuple[str, ...] = ()) -> None:
    """Give the initializers named in `sources` (initializer name → checkpoint tensor) their values in
    the dtype the graph has for them, then fold each lone Transpose of a lazy one lazily. Those named
    with one of `lazy_prefixes` stay lazy whatever their size (graphs.template)."""
    for name, value in model.graph.initializers.items():
        if (info := sources.get(name)) is None:
            continue
        read = _reader(info, _TORCH_DTYPES[value.dtype], None)
        eager = value.const_value is not None and value.const_value.size <= EAGER_ELEMENTS and not name.startswith(lazy_prefixes)
        value.const_value = read() if eager else ir.LazyTensor(read, dtype=value.dtype, shape=ir.Shape(info.shape))
        value.const_value.name = name
        if not eager:
            value.meta[SOURCE] = (name, None)
    _fold_lazy_transposes(model, sources)


def _fold_lazy_transposes(model: ir.Model, sources: dict[str, TensorInfo]) -> None:
    graph = model.graph
    for value in [v for v in graph.initializers.values() if is_lazy(v)]:
        users = value.consumers()
        if len(users) != 1 or users[0].op_type != "Transpose" or users[0].domain not in ("", "ai.onnx"):
            continue
        node, shape = users[0], value.const_value.shape
        attribute = node.attributes.get("perm")
        perm = tuple(attribute.as_ints()) if attribute is not None else tuple(reversed(range(len(shape))))
        out, source = node.outputs[0], value.meta[SOURCE][0]
        folded = lazy_weight(sources[source], value.dtype, perm, name=out.name, source=source)
        ir.convenience.replace_all_uses_with(out, folded)
        graph.remove(node, safe=True)
        graph.initializers.pop(value.name)
        graph.register_initializer(folded)


def optimize_like_torch(model: ir.Model) -> None:
    """What torch.onnx.export(optimize=True) runs on its graph, lazy weights left unread."""
    optimize_ir(model, should_fold=never_fold_lazy)
    onnx_fusions.fuse(model)
