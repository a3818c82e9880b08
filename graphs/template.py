"""Trace three layers, copy the rest: the export of a model whose layers are all alike.

Tracing (torch.export, torch.onnx's translation) and onnxscript's optimizer cost time in proportion
to the graph. When every layer of the model is alike, export traces and optimizes the model cut to
its first TRACED_LAYERS layers and then writes the later layers as copies of the TEMPLATE layer's
optimized nodes in onnx_ir: each copy reads its own weights (lazy, from the checkpoint), its own past
K/V inputs and present outputs (named by ground.cache_names), carries its own module scope (the
attention check counts layers by it) and takes the previous layer's output.

The template is layer 1, not layer 0, because it is traced as every later layer runs: after a layer,
taking the previous one's output, with the nodes it shares with the others (rotary tables, mask,
shapes) already computed once outside it or in layer 0, where the optimizer's common subexpression
elimination keeps the first copy.

Why a copy of layer 1 computes what layer k computes, for every later k (else NotAlike, and export
traces every layer, saying why):
- before tracing (`LayerTemplate.of`): every layer has the same module types and parameter names,
  shapes and dtypes; the config's per-layer lists (layer_types, per-layer kv heads: any list with
  one entry per layer) hold one value; and every later layer's non-parameter state equals the
  template's: each submodule's attributes (scalings, sliding windows, rotary settings, flags, what a
  constructor derived from the config and the layer index, such as GPT-2's `scaling` under
  scale_attn_by_inverse_layer_idx) and its buffers' values, all but the layer index itself (an
  integer attribute equal to the layer's index in every layer);
- after tracing (`replicate`): the WITNESS, layer 2, traced like any layer, must be the template
  renamed: node for node the same ops, attributes and constant values, wired alike (layer 1's input
  from layer 0 ↔ layer 2's from layer 1, each layer's own cache inputs and outputs by name, its own
  weights by checkpoint name, everything else the very same shared value), taking one value and
  giving one. So whatever the model's forward computes from the layer index, or from anything else
  the checks above do not read, gives the same graph for layers 1 and 2; and the witness, the last
  traced layer, runs where code treats the last layer apart.
What this does not prove: code that reads the layer index itself (in a layer, or in the model's loop
over its layers, handing each a value of its own) and treats layers 1 and 2 alike but a later one
differently (`layer_idx % 4 == 3`, `layer_idx >= n` with n > 2, the last layer by another measure
than the config's layer count), with no config list or module attribute saying so.
transformers' families state such patterns in config lists (layer_types) and module attributes set
at construction, which the checks above read. The witness costs one more traced layer, a fixed
time whatever the model's size.

The traced layers' weights are lazy whatever their size, so the constant folder folds none into a
constant that one layer alone holds (their lone Transposes are folded lazily instead, as the
streamed export does for large weights).
"""

from __future__ import annotations

import ast
import functools
import re
import types
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
import torch
import transformers
from torch import nn

from headfold.converter.checkpoint import TensorInfo
from headfold.graphs.rewrite.values import element_type, named
from headfold.graphs.weights import SOURCE, lazy_weight
from headfold.ground.cache_names import CacheName

__all__ = ["LayerTemplate", "NotAlike", "TRACED_LAYERS", "TEMPLATE"]

TEMPLATE = 1  # the traced layer the later ones are copies of
FIRST, WITNESS = TEMPLATE - 1, TEMPLATE + 1  # traced before it, and after it (to prove the copies)
TRACED_LAYERS = WITNESS + 1
_NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # torch.onnx's module scopes of a node
_SHAPE_ONLY = ("Shape", "Size")
_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # parameters, buffers, submodules, hooks, training
_DEPTH = 4  # how deep the state comparison follows containers and objects before it asks ==


class NotAlike(Exception):
    """The model's later layers cannot be written as copies of its traced layer 1 (the message says why)."""


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
        """The template for `model`; None when its layers are too few to gain from one, NotAlike
        when they differ (module types, parameters, per-layer config values, non-parameter state)."""
        if layers <= TRACED_LAYERS:
            return None
        stacks = {name: m for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == layers}
        if len(stacks) != 1:
            raise NotAlike(f"{len(stacks)} module lists of {layers} layers, not one")
        ((path, stack),) = stacks.items()
        if not _alike(stack):
            raise NotAlike("the layers' module types or parameter shapes differ")
        if differing := _per_layer_values(model.config, layers, alike=False):
            raise NotAlike(f"config.{next(iter(differing))} differs between layers")
        for layer in range(TEMPLATE + 1, layers):
            if (where := _state_difference(stack[TEMPLATE], stack[layer], TEMPLATE, layer)) is not None:
                raise NotAlike(f"layer {layer}'s {where} differs from layer {TEMPLATE}'s")
        return cls(model, path, layers, owner)

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
        """A name under the template's scope (a parameter) renamed into `layer`'s; any other name as it is."""
        old = f"{self.scope(TEMPLATE)}."
        return f"{self.scope(layer)}.{name.removeprefix(old)}" if name.startswith(old) else name

    def lazy_prefixes(self) -> tuple[str, ...]:
        """The parameter prefixes whose weights stay lazy in the traced graph (graphs.weights.attach)."""
        return tuple(f"{self.scope(i)}." for i in range(TRACED_LAYERS))

    def replicate(self, model: ir.Model, sources: dict[str, TensorInfo]) -> None:
        """Append layers TRACED_LAYERS…layers-1 to the traced, optimized graph as copies of the
        template; NotAlike when the witness is not the template renamed or the template is not a
        copyable unit."""
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


def _state(module: nn.Module) -> dict[str, Any]:
    """A module's non-parameter state: its own attributes and its buffers (its submodules apart)."""
    return {key: value for key, value in vars(module).items() if key not in _MODULE_INTERNALS} | {
        f"buffer {key}": value for key, value in module._buffers.items()
    }


def _state_difference(template: nn.Module, layer: nn.Module, template_index: int, layer_index: int) -> str | None:
    """The first submodule attribute or buffer (named) whose value differs between two alike layers,
    the layer index excepted; None when there is none."""
    theirs = dict(layer.named_modules())
    for name, module in template.named_modules():
        ours, other = _state(module), _state(theirs[name])
        for key in sorted(ours.keys() | other.keys()):
            a, b = ours.get(key), other.get(key)
            if type(a) is int and type(b) is int and (a, b) == (template_index, layer_index):
                continue  # the layer index itself: what the code computes from it, the witness compares
            if key not in ours or key not in other or not _same(a, b):
                return (f"{name}.{key}" if name else key) + f" ({_short(b)} against {_short(a)})"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether two attribute values are equal as state: tensors by value, modules and plain objects
    by their state, containers item by item, functions by identity."""
    if a is b:
        return True
    if isinstance(a, nn.Module) and isinstance(b, nn.Module):  # transformers makes some per instance (kernel wrappers)
        return type(a).__qualname__ == type(b).__qualname__ and (depth >= _DEPTH or _same(_state(a), _state(b), depth + 1))
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and (a.is_meta or bool(torch.equal(a, b)))
    if depth < _DEPTH and isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth + 1) for k in a)
    if depth < _DEPTH and isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b, strict=True))
    if isinstance(a, functools.partial):
        return a.func is b.func and _same((a.args, a.keywords), (b.args, b.keywords), depth + 1)
    if isinstance(a, types.MethodType):
        return a.__func__ is b.__func__
    try:
        return bool(a == b)
    except Exception:  # an object without a meaningful ==: not provably the same
        return False


class _Copier:
    """One replication: the traced layers' nodes and boundary values, the witness checked against
    the template, then one copy of the template per later layer."""

    def __init__(self, template: LayerTemplate, graph: ir.Graph, sources: dict[str, TensorInfo]) -> None:
        self.template, self.graph, self.sources = template, graph, sources
        self.inputs = _per_layer(graph.inputs)
        self.outputs = _per_layer(graph.outputs)
        self.nodes = [_layer_nodes(graph, template.scope(i), self.outputs[i].values()) for i in range(TRACED_LAYERS)]
        if not all(self.nodes):
            raise NotAlike("no nodes carry the layers' module scopes")
        self.from_layer = _dependence(graph, self.inputs, template)

    def run(self) -> None:
        chain_in, weights = self._inputs()
        template_out, uses, _ = self._outputs(TEMPLATE)
        if not all(id(user) in self.nodes[WITNESS] for user, _ in uses):
            raise NotAlike(f"nodes after layer {WITNESS} read layer {TEMPLATE}'s output")
        witnessed = _Witness(self, chain_in, template_out).prove()
        chain_out, tail_uses, output_slot = self._outputs(WITNESS)
        if chain_out is not witnessed[template_out]:
            raise NotAlike(f"layer {WITNESS} gives the nodes after it another value than layer {TEMPLATE} gives its successor")
        previous, after = chain_out, list(self.nodes[WITNESS].values())[-1]
        for layer in range(TRACED_LAYERS, self.template.layers):
            own = {value: self._input(value, layer) for value in self.inputs[TEMPLATE].values()}  # in the graph's order
            own |= {value: self._weight(value, layer) for value in weights}
            copies = self._copy(layer, {chain_in: previous, **own})
            self.graph.insert_after(after, copies.nodes)
            after, previous = copies.nodes[-1], copies.values[template_out]
        for node, index in tail_uses:
            node.replace_input_with(index, previous)
        if output_slot is not None:  # an encoder's last layer output is the graph's output
            name, chain_out.name = chain_out.name, f"{chain_out.name}__{WITNESS}"
            previous.name = name
            self.graph.outputs[output_slot] = previous

    def _inputs(self) -> tuple[ir.Value, list[ir.Value]]:
        """The one value the template takes from the layer before it (its hidden state), and its
        weights; with its past K/V inputs, every copy replaces them. Everything else it reads is shared."""
        chain, weights = set(), []
        for node in self.nodes[TEMPLATE].values():
            if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
                raise NotAlike(f"{node.name} holds a subgraph")
            for value in node.inputs:
                if value is None or self._produced_in(value, TEMPLATE):
                    continue
                kind = self.from_layer.get(id(value))
                if kind == TEMPLATE and _source(value) is not None:
                    weights.append(value)
                elif kind == TEMPLATE and value.name in self.inputs[TEMPLATE]:
                    continue
                elif kind == FIRST and self._produced_in(value, FIRST):
                    chain.add(value)
                elif kind is not None:
                    raise NotAlike(f"layer {TEMPLATE} reads {value.name}, computed from layer {kind}'s own inputs outside its nodes")
        if len(chain) != 1:
            raise NotAlike(f"layer {TEMPLATE} takes {len(chain)} values from layer {FIRST}, not one")
        return chain.pop(), list(dict.fromkeys(weights))

    def _outputs(self, layer: int) -> tuple[ir.Value, list[tuple[ir.Node, int]], int | None]:
        """The one value traced `layer` gives the nodes after it (or the graph), its uses there, and
        its graph output slot if it is one."""
        chain = {}
        for node in self.nodes[layer].values():
            for value in node.outputs:
                outside = [(user, i) for user, i in value.uses() if id(user) not in self.nodes[layer]]
                as_output = value.is_graph_output() and value.name not in self.outputs[layer]
                if outside or as_output:
                    chain[value] = outside
        if len(chain) != 1:
            raise NotAlike(f"layer {layer} gives {len(chain)} values to the nodes after it, not one")
        value, uses = chain.popitem()
        slot = next((i for i, out in enumerate(self.graph.outputs) if out is value), None)
        return value, uses, slot

    def _produced_in(self, value: ir.Value, layer: int) -> bool:
        return value.producer() is not None and id(value.producer()) in self.nodes[layer]

    def _input(self, value: ir.Value, layer: int) -> ir.Value:
        """Layer `layer`'s counterpart of a graph input of the template (past K/V)."""
        copy = ir.Value(name=_in_layer(named(value), layer), shape=_copied(value.shape), type=value.type)
        self.graph.inputs.append(copy)
        return copy

    def _weight(self, value: ir.Value, layer: int) -> ir.Value:
        """Layer `layer`'s counterpart of a weight of the template, read from the checkpoint when saved."""
        name, perm = value.meta[SOURCE]
        own = self.template.in_layer(name, layer)
        if own == name or (source := self.sources.get(own)) is None or source.shape != self.sources[name].shape:
            raise NotAlike(f"layer {layer} has no weight like {name}")
        copy_name = self.template.in_layer(named(value), layer)  # a folded transpose keeps its graph name
        copy = lazy_weight(source, element_type(value), perm, name=copy_name if copy_name != value.name else f"{value.name}__{layer}", source=own)
        self.graph.register_initializer(copy)
        return copy

    def _copy(self, layer: int, mapped: dict[ir.Value, ir.Value]) -> _Copies:
        nodes, values = [], dict(mapped)
        old, new = self.template.scope(TEMPLATE), self.template.scope(layer)
        for node in self.nodes[TEMPLATE].values():
            copy = ir.Node(
                node.domain, node.op_type, [values.get(v, v) if v is not None else None for v in node.inputs],
                list(node.attributes.values()), overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                name=f"{node.name}__{layer}" if node.name else None,
                metadata_props={key: _rescoped(text, old, new) for key, text in node.metadata_props.items()},
            )  # fmt: skip
            for original, output in zip(node.outputs, copy.outputs, strict=True):
                output.name, output.shape, output.type = self._output_name(original, layer), _copied(original.shape), original.type
                values[original] = output
            nodes.append(copy)
        for value in self.outputs[TEMPLATE].values():  # present K/V, in the graph's order
            self.graph.outputs.append(values[value])
        return _Copies(nodes, values)

    def _output_name(self, value: ir.Value, layer: int) -> str:
        if value.is_graph_output() and value.name in self.outputs[TEMPLATE]:
            return _in_layer(value.name, layer)
        return f"{value.name}__{layer}"


class _Witness:
    """The proof that the traced layer 2 is the template renamed (see the module's docstring)."""

    def __init__(self, copier: _Copier, chain_in: ir.Value, template_out: ir.Value) -> None:
        self.copier, self.template = copier, copier.template
        # template value → the witness's: what the template takes from layer 0, the witness takes from layer 1
        self.mapped: dict[ir.Value, ir.Value] = {chain_in: template_out}
        for name, value in copier.inputs[TEMPLATE].items():
            if (twin := copier.inputs[WITNESS].get(_in_layer(name, WITNESS))) is None:
                raise NotAlike(f"layer {WITNESS} has no input like {name}")
            self.mapped[value] = twin

    def prove(self) -> dict[ir.Value, ir.Value]:
        """Template value → witness value, for every value the template's nodes read and compute;
        NotAlike naming the first difference."""
        ours, theirs = list(self.copier.nodes[TEMPLATE].values()), list(self.copier.nodes[WITNESS].values())
        if len(ours) != len(theirs):
            raise self._differs(f"it has {len(theirs)} nodes, layer {TEMPLATE} {len(ours)}")
        for index, (node, twin) in enumerate(zip(ours, theirs, strict=True)):
            if (problem := _node_difference(node, twin)) is not None:
                raise self._differs(f"node {index} ({node.op_type}) {problem}")
            for slot, (value, other) in enumerate(zip(node.inputs, twin.inputs, strict=True)):
                if not self._corresponds(value, other):
                    raise self._differs(f"node {index} ({node.op_type}) reads another input {slot} ({_label(other)} for {_label(value)})")
            self.mapped |= zip(node.outputs, twin.outputs, strict=True)
        for name, value in self.copier.outputs[TEMPLATE].items():
            if self.mapped.get(value) is not self.copier.outputs[WITNESS].get(_in_layer(name, WITNESS)):
                raise self._differs(f"its output {_in_layer(name, WITNESS)} is not computed as {name} is")
        return self.mapped

    def _corresponds(self, value: ir.Value | None, other: ir.Value | None) -> bool:
        if value is None or other is None:
            return value is other
        if value in self.mapped:
            return self.mapped[value] is other
        if self.copier._produced_in(value, TEMPLATE):
            return False  # computed by a template node the witness has no twin of
        if (source := _source(value)) is not None:
            name, perm = source
            return _source(other) == (self.template.in_layer(name, WITNESS), perm) and other.dtype == value.dtype
        return value is other or _equal_constants(value, other)

    @staticmethod
    def _differs(why: str) -> NotAlike:
        return NotAlike(f"layer {WITNESS}'s traced graph is not layer {TEMPLATE}'s renamed: {why}")


def _node_difference(node: ir.Node, twin: ir.Node) -> str | None:
    """How two nodes differ as operations (op, version, arity, attributes); None when they do not."""
    for what in ("domain", "op_type", "overload", "version"):
        if getattr(node, what) != getattr(twin, what):
            return f"has {what} {getattr(twin, what)!r} against {getattr(node, what)!r}"
    if (len(node.inputs), len(node.outputs)) != (len(twin.inputs), len(twin.outputs)):
        return "has another number of inputs or outputs"
    if node.attributes.keys() != twin.attributes.keys():
        return f"has attributes {sorted(twin.attributes)} against {sorted(node.attributes)}"
    for name, attribute in node.attributes.items():
        if not _equal_attributes(attribute, twin.attributes[name]):
            return f"has {name} = {_shown(twin.attributes[name])} against {_shown(attribute)}"
    return None


def _equal_attributes(a: ir.Attr, b: ir.Attr) -> bool:
    if a.type != b.type:
        return False
    if a.type == ir.AttributeType.TENSOR:
        return _equal_tensors(a.value, b.value)
    if a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS, ir.AttributeType.TENSORS):
        return False  # not compared: not provably the same
    return a.value == b.value


def _equal_constants(a: ir.Value, b: ir.Value) -> bool:
    """Two constant values (initializers, not lazy weights) with the same dtype, shape and contents."""
    return a.const_value is not None and b.const_value is not None and _equal_tensors(a.const_value, b.const_value)


def _equal_tensors(a: ir.TensorProtocol, b: ir.TensorProtocol) -> bool:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if isinstance(a, ir.LazyTensor) or isinstance(b, ir.LazyTensor):
        return False  # weights: compared by where they come from, never read here
    return np.array_equal(a.numpy(), b.numpy(), equal_nan=True)


def _shown(attribute: ir.Attr) -> str:
    return "a tensor" if attribute.type == ir.AttributeType.TENSOR else repr(attribute.value)


def _label(value: ir.Value | None) -> str:
    return "nothing" if value is None else value.name or "an unnamed value"


def _source(value: ir.Value) -> tuple[str, tuple[int, ...] | None] | None:
    """Where a lazy weight's values come from (graphs.weights.SOURCE); None for any other value."""
    return value.meta.get(SOURCE) if value.is_initializer() else None


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
    after, before, output_ids = set(scoped), set(scoped), {id(v) for v in outputs}
    for node in graph:
        if id(node) in unscoped and any(v is not None and id(v.producer()) in after for v in node.inputs):
            after.add(id(node))
    for node in reversed(graph):
        if id(node) in unscoped and any(id(v) in output_ids or any(id(u) in before for u in v.consumers()) for v in node.outputs):
            before.add(id(node))
    return {id(node): node for node in graph if id(node) in after & before}


def _per_layer(values: Sequence[ir.Value]) -> list[dict[str, ir.Value]]:
    """The traced layers' cache inputs or outputs (past_key_values.1.key), by layer, then name."""
    found: list[dict[str, ir.Value]] = [{} for _ in range(TRACED_LAYERS)]
    for value in values:
        if (name := CacheName.parse(named(value))) is not None and name.layer < TRACED_LAYERS:
            found[name.layer][named(value)] = value
    return found


def _dependence(graph: ir.Graph, inputs: list[dict[str, ir.Value]], template: LayerTemplate) -> dict[int, int]:
    """For every value computed from a traced layer's own inputs (its past K/V, its weights): that
    layer (the latest wins), by value id. What depends on none (shapes, rotary tables, the mask) is
    the same in every layer, wherever it is computed."""
    layer_of: dict[int, int] = {}
    for layer, by_name in enumerate(inputs):
        layer_of |= {id(v): layer for v in by_name.values()}
    for value in graph.initializers.values():
        source = value.meta.get(SOURCE)
        for layer in range(TRACED_LAYERS):
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


def _in_layer(name: str, layer: int) -> str:
    """A cache input's or output's name (ground.cache_names) moved to `layer`."""
    if (cache := CacheName.parse(name)) is None:
        raise NotAlike(f"the graph input {name} is no cache tensor")
    return str(cache.in_layer(layer))


def _rescoped(text: str, old: str, new: str) -> str:
    """Metadata naming module scope `old` (and its children) renamed to `new`; model.layers.1 is not model.layers.10."""
    return re.sub(re.escape(old) + r"(?![0-9])", new, text)
