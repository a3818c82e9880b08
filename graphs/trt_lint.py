"""TensorRT-compatibility lint on CPU: would a TensorRT release's ONNX parser take this graph?

Checks every node (subgraphs included) against the per-release data in headfold.graphs.trt_ops and
the standard `Attention` node against the parser's own checks (onnx-tensorrt onnxOpImporters.cpp,
onnxOpCheckers.cpp, importerUtils.cpp, docs/operators.md). An error is something the parser
rejects; a warning is something documented as unsupported that the parser does not itself reject
(it may still fail at engine build). A graph is parsable when it has no errors.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import onnx_ir as ir

from headfold.graphs.onnx_files import load_graph
from headfold.graphs.trt_ops import MIN_OPSET, RELEASES, TYPED_INPUT
from headfold.ground import export_summary
from headfold.ground.artifacts import Record, optional
from headfold.ground.errors import BadInput

__all__ = ["Finding", "LintReport", "RuleSet", "rule_set", "lint", "lint_export", "format_table", "export_table"]

FORMAT = 1  # of a saved LintReport
Severity = Literal["error", "warning"]
STANDARD_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class Finding(Record):
    node: str  # node name, or "<model>" for model-level findings
    rule: str
    message: str
    severity: Severity
    op: str | None = optional()  # the node's op type ("domain.op" outside the standard domain); None for the model
    since: str | None = optional()  # the first TensorRT release whose parser takes it; None when none does


@dataclass(kw_only=True)
class LintReport(Record):
    """One graph against one rule set; saved (e.g. in a build plan) as the rule set, the verdict and the findings."""

    format: int = FORMAT
    trt_version: str  # as asked
    rules: str  # the rule set applied, e.g. "10.15"
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def parsable(self) -> bool:
        return not self.errors


@dataclass(frozen=True)
class RuleSet:
    """Everything one TensorRT release's parser takes: cumulative over trt_ops.RELEASES."""

    version: tuple[int, int]
    max_opset: int
    ops: dict[str, tuple[str, ...] | None]  # standard op -> supported types (None: undocumented)
    custom_ops: frozenset[str]
    plugins: frozenset[str] = frozenset()  # "domain::op_type" plugins the user will register

    @property
    def name(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


def _rule_sets() -> list[RuleSet]:
    sets: list[RuleSet] = []
    ops: dict[str, tuple[str, ...] | None] = {}
    custom: frozenset[str] = frozenset()
    for release in RELEASES:
        ops = {**ops, **release.added_ops}
        custom = custom | release.custom_ops
        sets.append(RuleSet(release.version, release.max_opset, ops, custom))
    return sets


RULE_SETS: tuple[RuleSet, ...] = tuple(_rule_sets())
# op -> first release that parses it, for "parsed from X on" hints
FIRST_RELEASE: dict[str, tuple[int, int]] = {op: s.version for s in reversed(RULE_SETS) for op in (*s.ops, *s.custom_ops)}


def _parse_version(text: str) -> tuple[int, int]:
    try:
        major, minor = (int(part) for part in str(text).split(".")[:2])
    except ValueError:
        raise BadInput(f"TensorRT version {text!r} is not of the form MAJOR.MINOR (e.g. 10.14)") from None
    return major, minor


def rule_set(trt_version: str) -> RuleSet:
    """The newest rule set not newer than `trt_version` (10.14.1 → 10.14; 11.5 → 11.0); a major
    release newer than the rule sets' is refused (its parser is unknown, not "like 11.0")."""
    version = _parse_version(trt_version)
    known = [s for s in RULE_SETS if s.version <= version]
    if not known or version[0] > RULE_SETS[-1].version[0]:
        names = ", ".join(s.name for s in RULE_SETS)
        majors = " and ".join(sorted({str(s.version[0]) for s in RULE_SETS}))
        raise BadInput(f"no TensorRT rule set for {trt_version}: known releases are {names} (later minors of {majors} use their newest); pass one of them")
    return known[-1]


# ---- rules: each yields findings for one node -------------------------------------------------

Check = Callable[[ir.Node, str, RuleSet], Iterator[Finding]]


def _since(rules: RuleSet, op: str) -> str | None:
    """The first release after `rules` whose parser takes `op` ("10.15"), None if there is none."""
    first = FIRST_RELEASE.get(op)
    return f"{first[0]}.{first[1]}" if first and first > rules.version else None


def _hint(since: str | None) -> str:
    return f" (parsed from TensorRT {since} on)" if since else ""


def check_op_supported(node: ir.Node, name: str, rules: RuleSet) -> Iterator[Finding]:
    """Standard ops without an importer fall back to a plugin lookup, which fails: an error."""
    if node.domain in STANDARD_DOMAINS and node.op_type not in rules.ops:
        since = _since(rules, node.op_type)
        yield Finding(name, "op-unsupported", f"{node.op_type} has no importer in TensorRT {rules.name}{_hint(since)}", "error", since=since)


def check_custom_domain(node: ir.Node, name: str, rules: RuleSet) -> Iterator[Finding]:
    """Custom-domain nodes are looked up as plugins, op type = plugin name, domain = namespace
    (onnx-tensorrt changelog 10.10); only TensorRT's own TRT_* ops have importers."""
    if node.domain in STANDARD_DOMAINS or node.op_type in rules.custom_ops:
        return
    if f"{node.domain}::{node.op_type}" not in rules.plugins:
        since = _since(rules, node.op_type)
        plugin = f"{node.domain}::{node.op_type}"
        yield Finding(name, "custom-domain", f"{node.domain}.{node.op_type} needs a TensorRT plugin registered as {plugin}{_hint(since)}", "error", since=since)


def check_dtype(node: ir.Node, name: str, rules: RuleSet) -> Iterator[Finding]:
    """operators.md lists the types each op supports; the parser does not check all of them."""
    types = rules.ops.get(node.op_type) if node.domain in STANDARD_DOMAINS else None
    index = TYPED_INPUT.get(node.op_type, 0)
    value = _input(node, index)
    if types and value is not None and value.dtype is not None and value.dtype.name not in types:
        yield Finding(name, "op-dtype", f"{node.op_type} on {value.dtype.name} is outside the documented types {', '.join(types)}", "warning")


# Attention input/output positions (ONNX Attention-23/24).
_MASK, _PAST_KEY, _PAST_VALUE, _NONPAD_KV_SEQLEN = 3, 4, 5, 6


def check_attention(node: ir.Node, name: str, rules: RuleSet) -> Iterator[Finding]:
    """The parser's Attention importer and checker (onnx-tensorrt onnxOpImporters.cpp / onnxOpCheckers.cpp)."""
    if node.op_type != "Attention" or node.domain not in STANDARD_DOMAINS or "Attention" not in rules.ops:
        return
    yield from _attention_io(node, name)
    yield from _attention_mask(node, name)
    yield from _attention_attributes(node, name)


def _attention_io(node: ir.Node, name: str) -> Iterator[Finding]:
    if len(node.outputs) != 1:  # importer: node.output().size() == 1, declared (even empty) outputs count
        extra = [o.name for o in node.outputs[1:] if o.name] or ["(empty names)"]
        yield Finding(name, "attention-outputs", f"Attention must declare exactly one output (Y); also declares {', '.join(extra)}", "error")
    for index, label in ((_PAST_KEY, "past_key"), (_PAST_VALUE, "past_value")):
        if _input(node, index) is not None:
            yield Finding(name, "attention-past", f"Attention input {label} is not supported; keep the KV cache outside the node", "error")
    if _input(node, _NONPAD_KV_SEQLEN) is not None:  # operators.md
        yield Finding(name, "attention-inputs", "Attention input nonpad_kv_seqlen is not supported", "error")
    ranks = {_rank(v) for v in node.inputs[:3]}
    if None not in ranks and len(ranks) > 1:
        yield Finding(name, "attention-rank", "Q, K and V must have the same rank", "error")


def _attention_mask(node: ir.Node, name: str) -> Iterator[Finding]:
    mask = _input(node, _MASK)
    if mask is None:
        return
    rank = _rank(mask)
    if rank is None:
        yield Finding(name, "attention-mask-rank", "attn_mask rank unknown; the parser needs rank ≤ 4", "warning")
    elif rank > 4:  # importerUtils.cpp convertToMaskTensor
        yield Finding(name, "attention-mask-rank", f"attn_mask has rank {rank}; the parser needs rank ≤ 4", "error")
    if _int_attr(node, "is_causal"):
        # TensorRT IAttention::setCausal: "Cannot be used together with setMask()".
        yield Finding(name, "attention-causal-mask", "is_causal=1 together with attn_mask: TensorRT's IAttention takes one or the other", "error")


def _attention_attributes(node: ir.Node, name: str) -> Iterator[Finding]:
    if float(_attr(node, "softcap", 0.0)) != 0.0:  # onnxOpCheckers.cpp
        yield Finding(name, "attention-attributes", "softcap is not supported", "error")
    if "softmax_precision" in node.attributes:  # onnxOpCheckers.cpp rejects its mere presence
        yield Finding(name, "attention-attributes", "softmax_precision is not supported (remove the attribute)", "error")
    if _int_attr(node, "qk_matmul_output_mode"):  # operators.md
        yield Finding(name, "attention-attributes", "qk_matmul_output_mode ≠ 0 is not supported", "error")


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if len(node.inputs) > index else None


def _attr(node: ir.Node, key: str, default: float | int) -> float | int:
    attr = node.attributes.get(key)
    return attr.value if attr is not None else default


def _int_attr(node: ir.Node, key: str) -> int:
    return int(_attr(node, key, 0))


def _rank(value: ir.Value | None) -> int | None:
    return value.shape.rank() if value is not None and value.shape is not None else None


NODE_CHECKS: tuple[Check, ...] = (check_op_supported, check_custom_domain, check_dtype, check_attention)


# ---- model level ------------------------------------------------------------------------------


def _opset_findings(model: ir.Model, rules: RuleSet) -> Iterator[Finding]:
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
    if opset is not None and not MIN_OPSET <= opset <= rules.max_opset:
        yield Finding(
            "<model>",
            "opset-range",
            f"opset {opset} is outside TensorRT {rules.name}'s documented range {MIN_OPSET}–{rules.max_opset}",
            "warning",
        )


def _load(model: str | os.PathLike | ir.Model) -> ir.Model:
    if isinstance(model, ir.Model):
        return model
    return load_graph(Path(model))  # external weights stay on disk: only shapes and attributes are read


def _nodes(model: ir.Model) -> Iterator[tuple[ir.Node, str]]:
    for index, node in enumerate(ir.traversal.RecursiveGraphIterator(model.graph)):
        yield node, node.name or f"{node.op_type}#{index}"


def lint(model: str | os.PathLike | ir.Model, trt_version: str, *, plugins: Iterable[str] = ()) -> LintReport:
    """Lint one ONNX model (path or onnx_ir model) against TensorRT `trt_version`'s parser.

    `plugins`: "domain::op_type" names of TensorRT plugins that will be registered at build time.
    """
    rules = replace(rule_set(trt_version), plugins=frozenset(plugins))
    ir_model = _load(model)
    report = LintReport(trt_version=str(trt_version), rules=rules.name, findings=list(_opset_findings(ir_model, rules)))
    for node, name in _nodes(ir_model):
        op = node.op_type if node.domain in STANDARD_DOMAINS else f"{node.domain}.{node.op_type}"
        for check in NODE_CHECKS:
            report.findings.extend(replace(f, op=op) for f in check(node, name, rules))
    return report


def lint_export(out_dir: str | os.PathLike, trt_version: str, *, plugins: Iterable[str] = ()) -> dict[str, LintReport]:
    """Lint every graph of a `headfold export` folder (those listed in export.json, else *.onnx)."""
    folder = Path(out_dir)
    names = list(export_summary.load(folder).graphs) if export_summary.exists(folder) else sorted(p.name for p in folder.glob("*.onnx"))
    if not names:
        raise BadInput(f"no ONNX graphs in {folder}")
    return {name: lint(folder / name, trt_version, plugins=plugins) for name in names}


# ---- presentation -----------------------------------------------------------------------------


def _summaries(report: LintReport, limit: int) -> list[str]:
    """Identical findings on many nodes collapse to one line with a count."""
    counts = Counter((f.severity, f.rule, f.message) for f in report.findings)
    ordered = sorted(counts.items(), key=lambda item: item[0][0] != "error")  # errors first, stable
    lines = [f"{sev}: {msg} [{rule}]" + (f" ×{n}" if n > 1 else "") for (sev, rule, msg), n in ordered]
    return lines[:limit] + ([f"… {len(lines) - limit} more"] if len(lines) > limit else [])


def format_table(reports: dict[str, LintReport], limit: int = 3) -> str:
    """One row per graph: parsable or not, error/warning counts, the first findings under it."""
    first = next(iter(reports.values()))
    width = max(len("graph"), *map(len, reports))
    lines = [f"TensorRT {first.trt_version} (rule set {first.rules})", f"{'graph':<{width}}  parsable  errors  warnings"]
    for name, report in reports.items():
        verdict = "yes" if report.parsable else "no"
        lines.append(f"{name:<{width}}  {verdict:<8}  {len(report.errors):>6}  {len(report.warnings):>8}")
        lines.extend(f"{'':<{width}}    {line}" for line in _summaries(report, limit))
    return "\n".join(lines)


def export_table(out_dir: str | os.PathLike, trt_version: str) -> str:
    """For `headfold export ... --trt-version V`: the table for every graph just exported."""
    return format_table(lint_export(out_dir, trt_version))
