"""Graph rewrite pipeline: one fused ONNX `Attention` per layer, K/V at kv-heads, counted and checked.

Each rule is a pattern/check/rewrite class (onnxscript's rewriter) in its own module, exposing
`rules`; adding a rule is adding a module and listing it in RULES. Order matters: decomposed
attention is fused first so that its repeated K/V can then be collapsed. With
attention="ort-gqa" the fused nodes then become ONNX Runtime's GroupQueryAttention (ort_gqa).
decompose is not in RULES: export applies it after them, only for the ops a target TensorRT
release cannot parse (RMSNormalization, RotaryEmbedding before 10.15).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Literal

import onnx_ir as ir
from onnxscript.rewriter import RewriteRule

from headfold.converter.per_layer import collapse, expand
from headfold.graphs.rewrite import decomposed, ort_gqa, repeat_kv
from headfold.graphs.rewrite.cleanup import cleanup, deduplicate, upgrade_opset
from headfold.ground.errors import BadInput, CheckFailed

__all__ = [
    "RULES",
    "ATTENTION_OPS",
    "AttentionKind",
    "AttentionNode",
    "FusionReport",
    "optimize",
    "attention_nodes",
    "attention_op",
    "check_attention",
    "is_attention_node",
]

RULES: tuple[RewriteRule, ...] = (*decomposed.rules, *repeat_kv.rules)

AttentionKind = Literal["onnx", "ort-gqa"]
# The fused node each kind ends with: (domain, op_type).
ATTENTION_OPS: dict[str, tuple[str, str]] = {"onnx": ("", "Attention"), "ort-gqa": (ort_gqa.DOMAIN, ort_gqa.OP_TYPE)}

_NAME_SCOPES = "pkg.torch.onnx.name_scopes"  # written by torch.onnx.export on every node
_LAYER_INDEX = re.compile(r"\.(\d+)$")


@dataclass(frozen=True)
class AttentionNode:
    name: str
    layer: int | None  # from the exporter's module scopes; None when the graph has no such metadata
    kv_heads: int | None  # None when K's head axis is not static
    module: str | None = None  # the exporter's innermost module scope (model.decoder.layers.0.encoder_attn)


@dataclass
class FusionReport:
    fusions: dict[str, int]  # rule name -> times applied
    attention: list[AttentionNode] = field(default_factory=list)


def optimize(
    model: ir.Model,
    *,
    kv_heads: int | Sequence[int],
    layers: int,
    graph: str = "graph",
    attention: AttentionKind = "onnx",
    layer_of: Callable[[AttentionNode], int | None] | None = None,
    windows: Sequence[int | None] = (),
) -> FusionReport:
    """Apply every rule in place, then fail (CheckFailed) unless each layer has one fused GQA node
    at its kv heads (`kv_heads`: one count for every layer, or one per layer).

    `layer_of` numbers the nodes where a graph holds more than one attention per numbered module
    (an encoder-decoder's decoder block: self- and cross-attention); by default a node's layer is
    its innermost numbered module scope.

    attention="ort-gqa" (decoder graphs only: the contrib op is causal) ends with
    com.microsoft.GroupQueryAttention instead of the standard Attention; see ort_gqa for its
    padding contract. Each node's layer's sliding window (`windows`, one per layer; the standard
    node has it in its mask) becomes its local_window_size.
    """
    if attention not in ATTENTION_OPS:
        raise BadInput(f"unknown attention kind {attention!r}; use one of {', '.join(ATTENTION_OPS)}")
    upgrade_opset(model)
    cleanup(model)  # the rules' checks read shapes and constants
    fusions = {str(rule): rule.apply_to_model(model) for rule in RULES}  # str: its name (every rule here has one)
    cleanup(model)
    if attention == "ort-gqa":
        fusions |= {str(rule): rule.apply_to_model(model) for rule in ort_gqa.rules(model, partial(_window, windows))}
        deduplicate(model)  # one seqlens_k / total_sequence_length for all layers
        cleanup(model)
    found = attention_nodes(model, attention)
    if layer_of is not None:
        found = [replace(node, layer=layer_of(node)) for node in found]
    report = FusionReport(fusions, found)
    check_attention(report.attention, kv_heads=kv_heads, layers=layers, graph=graph, op=ATTENTION_OPS[attention][1])
    return report


def is_attention_node(node: ir.Node, kind: AttentionKind | None = None) -> bool:
    """Whether `node` is a fused attention node of `kind` (None: of any kind headfold writes)."""
    ops = [ATTENTION_OPS[kind]] if kind else ATTENTION_OPS.values()
    return any(node.op_type == op_type and node.domain in (("", "ai.onnx") if domain == "" else (domain,)) for domain, op_type in ops)


def attention_op(kind: AttentionKind = "onnx") -> str:
    """The fused node of `kind` as the docs name it: Attention, or com.microsoft.GroupQueryAttention."""
    domain, op_type = ATTENTION_OPS[kind]
    return f"{domain}.{op_type}" if domain else op_type


def attention_nodes(model: ir.Model, kind: AttentionKind = "onnx") -> list[AttentionNode]:
    """The fused attention nodes of `kind` in graph order, with their layer and K/V head count."""
    return [
        AttentionNode(node.name or f"#{i}", _layer(node), _kv_heads(node), _module(node)) for i, node in enumerate(model.graph) if is_attention_node(node, kind)
    ]


def check_attention(found: list[AttentionNode], *, kv_heads: int | Sequence[int], layers: int, graph: str, op: str = "Attention") -> None:
    """One `op` node per layer 0..layers-1, each with K/V at its layer's kv heads (`kv_heads`: one
    count, or one per layer); else CheckFailed naming layers."""
    expected = expand(kv_heads, layers)
    wanted = str(collapse(expected))  # "2", or "[4, 2]" per layer
    # Without scope metadata the i-th node (graph order) is layer i: layers depend on each other.
    per_layer = [n.layer if n.layer is not None else i for i, n in enumerate(found)]
    problems = []
    missing = [i for i in range(layers) if per_layer.count(i) == 0]
    extra = sorted({i for i in per_layer if per_layer.count(i) > 1 or not 0 <= i < layers})
    wrong = [f"{i} ({n.kv_heads})" for i, n in zip(per_layer, found, strict=True) if 0 <= i < layers and n.kv_heads != expected[i]]
    if missing:
        problems.append(f"no fused {op} in layer(s) {_join(missing)}")
    if extra:
        problems.append(f"more than one {op} in layer(s) {_join(extra)}")
    if wrong:
        problems.append(f"K/V heads ≠ {wanted} in layer(s) {', '.join(wrong)}")
    if problems:
        raise CheckFailed(
            f"{graph}: {'; '.join(problems)} — expected one {op} per layer ({layers} layers) "
            f"with {wanted} kv-heads; the exporter produced a pattern no rewrite rule covers"
        )


def _window(windows: Sequence[int | None], node: ir.Node) -> int | None:
    """The sliding window of the layer `node` belongs to (by its module scope); None: full attention."""
    if not any(w is not None for w in windows):
        return None
    layer = _layer(node)
    if layer is None or not 0 <= layer < len(windows):
        raise CheckFailed(f"{node.name}: no layer in its module scopes, so its sliding window is unknown")
    return windows[layer]


def _join(indices: list[int]) -> str:
    return ", ".join(map(str, indices))


def _layer(node: ir.Node) -> int | None:
    """Index of the innermost numbered module around the node (model.layers.3.self_attn → 3)."""
    scopes = node.metadata_props.get(_NAME_SCOPES)
    if not scopes:
        return None
    numbered = [m.group(1) for s in ast.literal_eval(scopes) if (m := _LAYER_INDEX.search(s))]
    return int(numbered[-1]) if numbered else None


def _module(node: ir.Node) -> str | None:
    """The innermost module scope around the node (the last scope names the op itself)."""
    scopes = node.metadata_props.get(_NAME_SCOPES)
    modules = ast.literal_eval(scopes)[:-1] if scopes else []
    return modules[-1] if modules else None


def _kv_heads(node: ir.Node) -> int | None:
    """K's head count: axis 1 of 4D K, or the kv_num_heads attribute of the 3D form (and of GQA)."""
    key = node.inputs[1]
    if key is not None and key.shape is not None and key.shape.rank() == 4:
        heads = key.shape[1]
        return heads if isinstance(heads, int) else None
    attr = node.attributes.get("kv_num_heads")
    return attr.as_int() if attr is not None else None
