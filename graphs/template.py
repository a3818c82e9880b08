"""Trace two layers, copy the rest: the export of a model whose layers are all alike.

Tracing (torch.export, torch.onnx's translation) and onnxscript's optimizer cost time in proportion
to the graph. When every layer of the model is alike (same module types, parameter shapes and
per-layer config values), export traces and optimizes the model cut to its first two layers and
then writes layers 2…L-1 as copies of layer 1's optimized nodes in onnx_ir: each copy reads its own
weights (lazy, from the checkpoint), its own past K/V inputs and present outputs, carries its own
module scope (the attention check counts layers by it) and takes the previous layer's output.

Layer 1 is the template, not layer 0, because it is traced as every later layer runs: after a
layer, taking the previous one's output, with the nodes it shares with the others (rotary tables,
mask, shapes) already computed once outside it or in layer 0, where the optimizer's common
subexpression elimination keeps the first copy.

The template's weights are lazy whatever their size, so the constant folder never folds one into a
constant that belongs to layer 1 alone (their lone Transposes are folded lazily instead, as the
streamed export does for large weights). The replication checks that layer 1 is a copyable unit,
taking exactly one value computed from layer 0's own inputs and giving exactly one to the nodes after
it, and raises NotAlike otherwise; export then traces every layer.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import onnx_ir as ir
import transformers
from torch import nn

from headfold.converter.checkpoint import TensorInfo
from headfold.graphs.weights import SOURCE, lazy_weight

__all__ = ["LayerTemplate", "NotAlike", "TRACED_LAYERS"]

TRACED_LAYERS = 2  # layer 0 and the template, layer 1
_NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # torch.onnx's module scopes of a node
_SHAPE_ONLY = ("Shape", "Size")


class NotAlike(Exception):
    """The traced layer 1 cannot be copied as the model's later layers."""


@dataclass(frozen=True)
class LayerTemplate:
    """The model's stack of alike layers: the ModuleList at `path` in the transformers model, whose
    parameters and module scopes are named `{owner}.{path}.{i}` in the traced graph."""

    model: transformers.PreTrainedModel
    path: str
    layers: int
    owner: str

    @classmethod
    def of(cls, model: transformers.PreTrainedModel, layers: int, owner: str) -> LayerTemplate | None:
        """The template for `model`, or None when its layers differ or are too few to gain from one."""
        if layers <= TRACED_LAYERS:
            return None
        stacks = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == layers]
        if len(stacks) != 1 or not _alike(model.get_submodule(stacks[0])) or _per_layer_values(model.config, layers, alike=False):
            return None
        return cls(model, stacks[0], layers, owner)

    def scope(self, layer: int) -> str:
        return f"{self.owner}.{self.path}.{layer}"

    @contextmanager
    def traced(self) -> Iterator[int]:
        """The model cut to its first TRACED_LAYERS layers (config too) while tracing; yields that count."""
        parent_name, _, attribute = self.path.rpartition(".")
        parent, config = self.model.get_submodule(parent_name), self.model.config
        stack = getattr(parent, attribute)
        lists = _per_layer_values(config, self.layers, alike=True)
        setattr(parent, attribute, nn.ModuleList(list(stack)[:TRACED_LAYERS]))
        config.num_hidden_layers = TRACED_LAYERS
        for key, values in lists.items():
            setattr(config, key, values[:TRACED_LAYERS])
        try:
            yield TRACED_LAYERS
        finally:
            setattr(parent, attribute, stack)
            config.num_hidden_layers = self.layers
            for key, values in lists.items():
                setattr(config, key, values)

    def in_layer(self, name: str, layer: int) -> str:
        """A name under layer 1's scope (a parameter) renamed into `layer`'s; any other name as it is."""
        old = f"{self.scope(1)}."
        return f"{self.scope(layer)}.{name.removeprefix(old)}" if name.startswith(old) else name

    def lazy_prefixes(self) -> tuple[str, ...]:
        """The parameter prefixes whose weights stay lazy in the traced graph (graphs.weights.attach)."""
        return tuple(f"{self.scope(i)}." for i in range(TRACED_LAYERS))

    def replicate(self, model: ir.Model, sources: dict[str, TensorInfo]) -> None:
        """Append layers TRACED_LAYERS…layers-1 to the traced, optimized graph as copies of layer 1;
        NotAlike when layer 1 is not a copyable unit."""
        _Copier(self, model.graph, sources).run()


def _alike(stack: nn.ModuleList) -> bool:
    """Same module types and parameter names and shapes in every layer."""

    def signature(layer: nn.Module) -> tuple:
        return (
            tuple(type(m).__qualname__ for m in layer.modules()),
            tuple((name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters()),
        )

    first = signature(stack[0])
    return all(signature(layer) == first for layer in stack)


def _per_layer_values(config: transformers.PretrainedConfig, layers: int, *, alike: bool) -> dict[str, list]:
    """The config's per-layer lists (one entry per layer: layer_types, per-layer kv heads) whose
    entries are all equal (`alike`) or not."""
    lists = {key: value for key, value in vars(config).items() if isinstance(value, list) and len(value) == layers}
    return {key: value for key, value in lists.items() if (len({repr(v) for v in value}) == 1) == alike}


class _Copier:
    """One replication: the template's nodes, its boundary values, then one copy per later layer."""

    def __init__(self, template: LayerTemplate, graph: ir.Graph, sources: dict[str, TensorInfo]) -> None:
        self.template, self.graph, self.sources = template, graph, sources
        self.inputs = _per_layer(graph.inputs)
        self.outputs = _per_layer(graph.outputs)
        self.first, self.copied = (_layer_nodes(graph, template.scope(i), self.outputs[i].values()) for i in (0, 1))
        if not self.first or not self.copied:
            raise NotAlike("no nodes carry the layers' module scopes")
        self.from_layer = _dependence(graph, self.inputs, template)

    def run(self) -> None:
        chain_in, weights = self._inputs()
        chain_out, tail_uses, output_slot = self._outputs()
        previous, after = chain_out, list(self.copied.values())[-1]
        for layer in range(TRACED_LAYERS, self.template.layers):
            own = {value: self._input(value, layer) for value in self.inputs[1].values()}  # in the graph's order
            own |= {value: self._weight(value, layer) for value in weights}
            copies = self._copy(layer, {chain_in: previous, **own})
            self.graph.insert_after(after, copies.nodes)
            after, previous = copies.nodes[-1], copies.values[chain_out]
        for node, index in tail_uses:
            node.replace_input_with(index, previous)
        if output_slot is not None:  # an encoder's last layer output is the graph's output
            name, chain_out.name = chain_out.name, f"{chain_out.name}__1"
            previous.name = name
            self.graph.outputs[output_slot] = previous

    def _inputs(self) -> tuple[ir.Value, list[ir.Value]]:
        """The one value layer 1 takes from layer 0 (its hidden state), and layer 1's weights; with
        its past K/V inputs, every copy replaces them. Everything else layer 1 reads is shared."""
        chain, weights = set(), []
        for node in self.copied.values():
            if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
                raise NotAlike(f"{node.name} holds a subgraph")
            for value in node.inputs:
                if value is None or (value.producer() is not None and id(value.producer()) in self.copied):
                    continue
                kind = self.from_layer.get(id(value))
                if kind == 1 and value.is_initializer() and value.meta.get(SOURCE) is not None:
                    weights.append(value)
                elif kind == 1 and value.name in self.inputs[1]:
                    continue
                elif kind == 0 and value.producer() is not None and id(value.producer()) in self.first:
                    chain.add(value)
                elif kind is not None:
                    raise NotAlike(f"layer 1 reads {value.name}, computed from layer {kind}'s own inputs outside its nodes")
        if len(chain) != 1:
            raise NotAlike(f"layer 1 takes {len(chain)} values from layer 0, not one")
        return chain.pop(), list(dict.fromkeys(weights))

    def _outputs(self) -> tuple[ir.Value, list[tuple[ir.Node, int]], int | None]:
        """The one value layer 1 gives the nodes after it (or the graph), its uses there, and its
        graph output slot if it is one."""
        chain = {}
        for node in self.copied.values():
            for value in node.outputs:
                outside = [(user, i) for user, i in value.uses() if id(user) not in self.copied]
                as_output = value.is_graph_output() and value.name not in self.outputs[1]
                if outside or as_output:
                    chain[value] = outside
        if len(chain) != 1:
            raise NotAlike(f"layer 1 gives {len(chain)} values to the nodes after it, not one")
        value, uses = chain.popitem()
        slot = next((i for i, out in enumerate(self.graph.outputs) if out is value), None)
        return value, uses, slot

    def _input(self, value: ir.Value, layer: int) -> ir.Value:
        """Layer `layer`'s counterpart of a graph input of layer 1 (past K/V)."""
        copy = ir.Value(name=_renumbered(value.name, 1, layer), shape=_copied(value.shape), type=value.type)
        self.graph.inputs.append(copy)
        return copy

    def _weight(self, value: ir.Value, layer: int) -> ir.Value:
        """Layer `layer`'s counterpart of a weight of layer 1, read from the checkpoint when saved."""
        name, perm = value.meta[SOURCE]
        own = self.template.in_layer(name, layer)
        if own == name or (source := self.sources.get(own)) is None or source.shape != self.sources[name].shape:
            raise NotAlike(f"layer {layer} has no weight like {name}")
        copy_name = self.template.in_layer(value.name, layer)  # a folded transpose keeps its graph name
        copy = lazy_weight(source, value.dtype, perm, name=copy_name if copy_name != value.name else f"{value.name}__{layer}", source=own)
        self.graph.register_initializer(copy)
        return copy

    def _copy(self, layer: int, mapped: dict[ir.Value, ir.Value]) -> _Copies:
        nodes, values = [], dict(mapped)
        old, new = self.template.scope(1), self.template.scope(layer)
        for node in self.copied.values():
            copy = ir.Node(
                node.domain, node.op_type, [values.get(v, v) if v is not None else None for v in node.inputs],
                list(node.attributes.values()), overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                name=f"{node.name}__{layer}" if node.name else None,
                metadata_props={key: _rescoped(text, old, new) for key, text in node.metadata_props.items()},
            )  # fmt: skip
            for original, output in zip(node.outputs, copy.outputs):
                output.name, output.shape, output.type = self._output_name(original, layer), _copied(original.shape), original.type
                values[original] = output
            nodes.append(copy)
        for value in self.outputs[1].values():  # present K/V, in the graph's order
            self.graph.outputs.append(values[value])
        return _Copies(nodes, values)

    def _output_name(self, value: ir.Value, layer: int) -> str:
        if value.is_graph_output() and value.name in self.outputs[1]:
            return _renumbered(value.name, 1, layer)
        return f"{value.name}__{layer}"


@dataclass
class _Copies:
    nodes: list[ir.Node]
    values: dict[ir.Value, ir.Value]


def _layer_nodes(graph: ir.Graph, scope: str, outputs: Iterable[ir.Value]) -> dict[int, ir.Node]:
    """A layer's nodes, by id, in graph order: those inside its module scope (torch.onnx's
    name_scopes), and the nodes the optimizer's rewrites made without a scope that lie between them
    (after one of them, and before one of them or one of the layer's graph outputs)."""
    scoped, unscoped = set(), set()
    for node in graph:
        scopes = node.metadata_props.get(_NAME_SCOPES)
        if not scopes:
            unscoped.add(id(node))
        elif scope in ast.literal_eval(scopes):
            scoped.add(id(node))
    after, before, outputs = set(scoped), set(scoped), {id(v) for v in outputs}
    for node in graph:
        if id(node) in unscoped and any(v is not None and id(v.producer()) in after for v in node.inputs):
            after.add(id(node))
    for node in reversed(graph):
        if id(node) in unscoped and any(id(v) in outputs or any(id(u) in before for u in v.consumers()) for v in node.outputs):
            before.add(id(node))
    return {id(node): node for node in graph if id(node) in after & before}


def _per_layer(values: list[ir.Value]) -> dict[int, dict[str, ir.Value]]:
    """Graph inputs or outputs named per layer (past_key_values.3.key), by layer, for layers 0 and 1:
    a name with `.1.` whose `.0.` twin is there too."""
    names = {v.name: v for v in values}
    found: dict[int, dict[str, ir.Value]] = {0: {}, 1: {}}
    for name, value in names.items():
        if ".1." in name and _renumbered(name, 1, 0) in names:
            found[1][name] = value
            found[0][_renumbered(name, 1, 0)] = names[_renumbered(name, 1, 0)]
    return found


def _dependence(graph: ir.Graph, inputs: dict[int, dict[str, ir.Value]], template: LayerTemplate) -> dict[int, int]:
    """For every value computed from a traced layer's own inputs (its past K/V, its weights): that
    layer (1 wins over 0), by value id. What depends on neither (shapes, rotary tables, the mask) is
    the same in every layer, wherever it is computed."""
    layer_of: dict[int, int] = {}
    for layer, named in inputs.items():
        layer_of |= {id(v): layer for v in named.values()}
    for value in graph.initializers.values():
        source = value.meta.get(SOURCE)
        for layer in (0, 1):
            if source is not None and source[0].startswith(f"{template.scope(layer)}."):
                layer_of[id(value)] = layer
    for node in graph:
        if node.op_type in _SHAPE_ONLY and node.domain in ("", "ai.onnx"):
            continue  # alike layers' inputs have alike shapes: the past length may be read from any layer's
        found = [layer_of[id(v)] for v in node.inputs if v is not None and id(v) in layer_of]
        if found:
            layer_of |= {id(out): max(found) for out in node.outputs}
    return layer_of


def _copied(shape: ir.Shape | None) -> ir.Shape | None:
    return shape.copy() if shape is not None else None


def _renumbered(name: str, old: int, new: int) -> str:
    return name.replace(f".{old}.", f".{new}.", 1)


def _rescoped(text: str, old: str, new: str) -> str:
    """Metadata naming module scope `old` (and its children) renamed to `new`; model.layers.1 is not model.layers.10."""
    return re.sub(re.escape(old) + r"(?![0-9])", new, text)
