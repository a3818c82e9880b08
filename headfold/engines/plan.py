"""What `headfold build` will do, decided without TensorRT: graphs, precision, profiles, plugins, lint.

The plan is pure data (testable on CPU, printed by --dry-run) and the only input of the build:
- graphs: one .onnx, or every graph of an export folder (one engine per graph);
- precision: TensorRT 11 is always strongly typed, so the precision must be the graph's own
  (`headfold export --dtype`); on 10.x a reduced-precision graph is built strongly typed and an
  fp32 graph gets the FP16/BF16 builder flag when a lower precision is asked for;
- one optimization profile per graph: every dynamic dimension is named by the exporter
  (batch, sequence, past_sequence, "past_sequence + 1") and sized from --batch/--seq/--past or,
  failing those, from the model's position limit;
- the TensorRT-compatibility lint (graphs/trt_lint.py) per graph, after the plugin emitter where
  the graph needs plugins: a graph the parser would reject is refused before any build.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx_ir as ir

from headfold import plugins as custom_ops
from headfold.converter.checkpoint import CheckpointFacts
from headfold.engines.env import Target
from headfold.graphs.onnx_files import external_data_files, load_graph
from headfold.graphs.rewrite import is_attention_node
from headfold.graphs.rewrite.decompose import DECOMPOSITIONS
from headfold.graphs.trt_lint import Finding, LintReport, lint
from headfold.ground import export_summary
from headfold.ground.artifacts import CREATED_BY, ENGINE_SUFFIXES, EXPORT_SUMMARY, SIDECAR_SUFFIX, created_by, engine_name
from headfold.ground.errors import BadInput
from headfold.ground.hashing import sha256_file
from headfold.ground.inputs import check_links, contained
from headfold.ground.precision import Precision
from headfold.ground.units import parse_size

# Option name -> the dimension names exporters give it (headfold's torch.export Dims first).
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "batch": ("batch", "batch_size"),
    "seq": ("sequence", "sequence_length", "seq_len"),
    "past": ("past_sequence", "past_sequence_length", "past_seq_len"),
}
_DIM_EXPR = re.compile(r"\s*(\w+)\s*(?:([+-])\s*(\d+))?\s*")  # "past_sequence + 1"
_LOWEST = {"batch": 1, "seq": 1, "past": 0}
_OPT_CAP = 512  # opt length: half the position limit, at most this (typical prompt / cache length)
_DEFAULT_BATCH = (1, 4, 8)
_DEFAULT_LIMIT = 2048  # when no config names a position limit


class Unparsable(BadInput):
    """The target TensorRT's ONNX parser would reject a graph (lint error): exit 2."""


@dataclass(frozen=True)
class Range:
    """min/opt/max of one dynamic dimension and where the numbers came from."""

    min: int
    opt: int
    max: int
    source: str = "option"

    def __str__(self) -> str:
        return f"{self.min}:{self.opt}:{self.max}"

    def shifted(self, offset: int) -> tuple[int, int, int]:
        return self.min + offset, self.opt + offset, self.max + offset


def parse_range(text: str, option: str) -> Range:
    """'1:4:8' (min:opt:max) or '8' (fixed); BadInput naming the option otherwise."""
    lowest = _LOWEST[option]
    try:
        parts = [int(p) for p in str(text).split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3 or not lowest <= parts[0] <= parts[1] <= parts[2] or parts[2] < 1:
        raise BadInput(f"--{option} {text!r}: write MIN:OPT:MAX with {lowest} <= MIN <= OPT <= MAX and MAX >= 1, e.g. --{option} {lowest}:4:8")
    low, opt, high = parts
    return Range(low, opt, high)


def derived_ranges(limit: int | None, **given: Range | None) -> dict[str, Range]:
    """The --batch/--seq/--past ranges, each given one kept, the others from the position limit."""
    source = f"position limit {limit} (config)" if limit else f"default (no config: limit {_DEFAULT_LIMIT})"
    limit = limit or _DEFAULT_LIMIT
    opt = min(_OPT_CAP, max(1, limit // 2))
    derived = {
        "batch": Range(*_DEFAULT_BATCH, "default"),
        "seq": Range(1, opt, limit, source),
        "past": Range(0, min(opt, limit - 1), limit - 1, source),  # past + 1 new token <= limit
    }
    return {name: given.get(name) or derived[name] for name in DIMENSIONS}


@dataclass(frozen=True)
class BuildPrecision:
    name: Precision  # what the engine computes in
    graph: Precision  # the graph's own weight precision
    strongly_typed: bool
    builder_flags: tuple[str, ...]  # trt.BuilderFlag names to set ("FP16", "BF16")
    how: str


def decide_precision(requested: Precision | str | None, graph: Precision, target: Target) -> BuildPrecision:
    """Strongly typed wherever the graph fixes the precision; builder flags only for fp32 graphs on 10.x."""
    requested = Precision.parse(requested or graph, "--precision", Precision.floats())
    if requested == graph and target.strongly_typed and (graph != Precision.FP32 or not target.precision_flags):
        return BuildPrecision(requested, graph, True, (), f"strongly typed: the graph's own {graph}")
    if requested == graph:
        return BuildPrecision(requested, graph, False, (), "fp32 graph, no reduced-precision flag (TF32 off)")
    if not target.precision_flags:
        raise BadInput(
            f"TensorRT {target.version} builds strongly typed (no FP16/BF16 builder flags): the precision comes from "
            f"the graph, which is {graph}; re-export with headfold export --dtype {requested}"
        )
    if graph != Precision.FP32:
        raise BadInput(f"the graph is {graph}; TensorRT cannot build it as {requested}: re-export with headfold export --dtype {requested}")
    flag = requested.upper()
    return BuildPrecision(requested, graph, False, (flag,), f"fp32 graph with BuilderFlag.{flag} (TensorRT picks per layer)")


def graph_precision(model: ir.Model) -> Precision:
    """The floating type that holds most weight elements (norms may stay fp32 in an fp16 graph)."""
    sizes: Counter[Precision] = Counter()
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None and (precision := Precision.of(tensor.dtype)) is not None:
            sizes[precision] += max(1, tensor.size)
    return sizes.most_common(1)[0][0] if sizes else Precision.FP32


# ---- profiles ---------------------------------------------------------------------------------


def _dimension(dim: int | ir.SymbolicDim, graph: str, name: str, ranges: Mapping[str, Range]) -> tuple[int, int, int]:
    if isinstance(dim, int):
        return dim, dim, dim
    match = _DIM_EXPR.fullmatch(dim.value or "")
    option = next((o for o, names in DIMENSIONS.items() if match and match[1] in names), None)
    if match is None or option is None:  # no match: no option either
        raise BadInput(f"{graph}: input {name} has a dynamic dimension {dim.value!r} headfold cannot size; re-export with headfold export")
    offset = int(match[3] or 0) * (-1 if match[2] == "-" else 1)
    return ranges[option].shifted(offset)


def input_profile(model: ir.Model, graph: str, ranges: Mapping[str, Range]) -> dict[str, list[list[int]]]:
    """{input: [min shape, opt shape, max shape]} for every graph input."""
    profile: dict[str, list[list[int]]] = {}
    for value in model.graph.inputs:
        assert value.name is not None  # a graph input read from ONNX is named (ValueInfoProto.name)
        if value.shape is None:
            raise BadInput(f"{graph}: input {value.name} has no shape; re-export with headfold export")
        dims = [_dimension(d, graph, value.name, ranges) for d in value.shape.dims]
        profile[value.name] = [list(shape) for shape in zip(*dims, strict=True)] if dims else [[], [], []]
    return profile


def uses(model: ir.Model, option: str) -> bool:
    """Whether any input of `model` has a dimension sized by `option`."""
    names = DIMENSIONS[option]
    return any(
        isinstance(d, ir.SymbolicDim) and (m := _DIM_EXPR.fullmatch(d.value or "")) and m[1] in names
        for v in model.graph.inputs
        if v.shape is not None
        for d in v.shape.dims
    )


# ---- lint and plugins -------------------------------------------------------------------------


def lint_graph(model: ir.Model, path: Path, target: Target) -> tuple[LintReport, list[str]]:
    """Lint the graph as TensorRT will see it: after the plugin emitter when it needs plugins."""
    names = custom_ops.plan_plugins(model, target.version)
    if not names:
        return lint(model, target.version), []
    emitted, _ = custom_ops.emit(load_graph(path), target.version)  # rewrites a fresh in-memory copy
    return lint(emitted, target.version, plugins=names), list(names)  # also plugin nodes already in the graph


def _since(finding: Finding) -> tuple[int, ...]:
    """The release that first parses what `finding` is about, to compare; () when none does."""
    return tuple(int(p) for p in finding.since.split(".")) if finding.since else ()


def _fix(finding: Finding, target: Target) -> str:
    since = finding.since
    if since and finding.rule == "op-unsupported" and finding.op in DECOMPOSITIONS:
        return f"re-export with headfold export --trt-version {target.version} (decomposes {finding.op}), or use TensorRT {since} or newer"
    if since:
        return f"use TensorRT {since} or newer, or check the plan with --dry-run --trt-version {since}"
    if finding.rule == "custom-domain":
        return "export with --attention onnx (the standard Attention op), or register the plugin"
    return f"re-export with headfold export (see headfold export --trt-version {target.version})"


def refusal(graph: str, report: LintReport, target: Target) -> str:
    """One line: the error that needs the newest TensorRT (else the first), its node, how many more, what to do."""
    first = max(report.errors, key=_since)
    more = f" (+{len(report.errors) - 1} more errors)" if len(report.errors) > 1 else ""
    return f"TensorRT {target.version} cannot parse {graph}: {first.message} at node {first.node}{more}; {_fix(first, target)}"


# ---- the plan ---------------------------------------------------------------------------------


@dataclass
class GraphPlan:
    name: str  # e.g. "prefill"
    onnx: Path
    engine: Path
    sha256: str
    data_sha256: str | None  # the .onnx.data weights, when external
    attention_nodes: int
    profile: dict[str, list[list[int]]]
    plugins: list[str]
    lint: LintReport  # after the plugin emitter, when the graph needs plugins
    data: list[Path] = field(default_factory=list)  # its external weight files (inside its folder)

    @property
    def sidecar(self) -> Path:
        return sidecar_path(self.engine)


@dataclass
class BuildPlan:
    target: Target
    source: Path
    out: Path
    layout: str  # "file": OUT is the engine; "folder": OUT holds one engine per graph
    precision: BuildPrecision
    ranges: dict[str, Range]
    graphs: list[GraphPlan]
    workspace_bytes: int | None = None
    timing_cache: Path | None = None
    notes: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)

    @property
    def plugins(self) -> list[str]:
        return sorted({p for g in self.graphs for p in g.plugins})

    @property
    def reads(self) -> list[Path]:
        """Everything building reads: the source, every graph and its weights, the timing cache."""
        graphs = [p for g in self.graphs for p in (g.onnx, *g.data)]
        return [self.source, *graphs, *([self.timing_cache] if self.timing_cache else [])]

    @property
    def outputs(self) -> list[tuple[Path, bool]]:
        """What building writes (besides the timing cache): the engine folder, or one engine and its sidecar."""
        if self.layout == "folder":
            return [(self.out, True)]
        return [(self.out, False), (self.graphs[0].sidecar, False)]

    def check(self) -> None:
        """Unparsable (exit 2) when the lint says TensorRT would reject a graph."""
        if self.refusals:
            raise Unparsable(self.refusals[0])

    def to_dict(self) -> dict[str, Any]:
        graphs = [asdict(g) | {"lint": g.lint.to_dict() | {"parsable": g.lint.parsable}} for g in self.graphs]
        plan = {CREATED_BY: created_by()} | asdict(self) | {"plugins": self.plugins, "graphs": graphs}  # headfold's mark first
        return json.loads(json.dumps(plan, default=str))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def describe(self) -> str:
        how = self.target.how
        layout = "one engine per graph in this folder" if self.layout == "folder" else "one engine file"
        cache = f"{self.timing_cache} (loaded if present, updated after)" if self.timing_cache else "none"
        lines = [
            f"TensorRT {self.target.version} ({how})",
            f"source:      {self.source}",
            f"output:      {self.out} ({layout})",
            f"precision:   {self.precision.name} ({self.precision.how})",
            "profiles:    " + ", ".join(f"--{k} {v} [{v.source}]" for k, v in self.ranges.items()),
            f"workspace:   {_bytes(self.workspace_bytes) if self.workspace_bytes else 'TensorRT default (device memory)'}",
            f"timing cache: {cache}",
            f"plugins:     {', '.join(self.plugins) or 'none'}",
        ]
        for graph in self.graphs:
            lines += _describe_graph(graph)
        lines += [f"note: {n}" for n in self.notes] + [f"refused: {r}" for r in self.refusals]
        return "\n".join(lines)


def _bytes(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


def _describe_graph(graph: GraphPlan) -> list[str]:
    report = graph.lint
    lint_line = (
        f"lint (rule set {report.rules}): {'parsable' if report.parsable else 'NOT parsable'}, {len(report.errors)} errors, {len(report.warnings)} warnings"
    )
    width = max(map(len, graph.profile), default=0)
    lines = [
        f"{graph.onnx.name} -> {graph.engine}",
        f"  sha256 {graph.sha256[:16]}…  Attention nodes {graph.attention_nodes}  plugins {', '.join(graph.plugins) or 'none'}",
        f"  {lint_line}",
    ]
    lines += [f"  {name:<{width}}  min {tuple(s[0])}  opt {tuple(s[1])}  max {tuple(s[2])}" for name, s in graph.profile.items()]
    return lines


def sidecar_path(engine: Path) -> Path:
    return engine.with_name(engine.name + SIDECAR_SUFFIX)


# ---- making the plan --------------------------------------------------------------------------


def source_graphs(src: Path) -> tuple[list[Path], str]:
    """(graphs, layout) of a .onnx file or an export folder; BadInput for anything else."""
    if src.is_file() and src.suffix == ".onnx":
        return [src.resolve()], "file"
    if src.is_dir() and export_summary.exists(src):
        check_links(src, "export folder")
        summary = export_summary.load(src)
        if summary.layout == "merged":  # its total length P + S is no profile dimension
            raise BadInput(
                f"{src} holds the merged decoder graph (ONNX Runtime, onnxruntime-genai); TensorRT builds the split pair: headfold export SRC "
                "OUT --graphs split"
            )
        if summary.layout == "seq2seq":  # profiles for a source length and a self past: not sized by headfold
            raise BadInput(f"{src} holds an encoder-decoder's graphs, which headfold builds no engines of; run them in ONNX Runtime (docs/deploying.md)")
        paths = [contained(src, name, EXPORT_SUMMARY, f"re-run headfold export into {src}") for name in summary.graphs]
        missing = [p.name for p in paths if not p.is_file()]
        if missing or not paths:
            raise BadInput(f"export folder {src} lacks {', '.join(missing) or 'graphs'}; re-run headfold export")
        return [p.resolve() for p in paths], "folder"
    if src.is_dir() and (src / "config.json").is_file():
        raise BadInput(f"{src} is a checkpoint folder; export it first: headfold export {src} ONNX_DIR, then headfold build ONNX_DIR OUT")
    if src.is_dir() and any(src.glob("*.onnx")):
        check_links(src, "graph folder")
        return sorted(p.resolve() for p in src.glob("*.onnx")), "folder"
    raise BadInput(f"{src} is neither a .onnx file nor an export folder (export.json)")


def position_limit_for(graph: Path) -> int | None:
    """The model's position limit from the checkpoint its export.json names (None if unknown)."""
    model = export_summary.graph_source(graph)
    return CheckpointFacts.read(model).position_limit if model is not None else None


def _out_engine(out: Path, layout: str, graph: Path) -> Path:
    if layout == "file":
        if out.suffix not in ENGINE_SUFFIXES:
            raise BadInput(f"output {out} must end with .engine (or .plan) for a single graph")
        return out
    return out / engine_name(graph.name)


def _graph_plan(path: Path, model: ir.Model, engine: Path, ranges: dict[str, Range], target: Target) -> GraphPlan:
    report, plugins = lint_graph(model, path, target)
    data = external_data_files(model, path)
    return GraphPlan(
        name=path.stem,
        onnx=path,
        engine=engine,
        sha256=sha256_file(path),
        data_sha256=sha256_file(data[0]) if len(data) == 1 and data[0].is_file() else None,
        attention_nodes=sum(map(is_attention_node, ir.traversal.RecursiveGraphIterator(model.graph))),
        profile=input_profile(model, path.name, ranges),
        plugins=plugins,
        lint=report,
        data=data,
    )


def parse_workspace(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text)
    except BadInput:
        raise BadInput(f"--workspace {text!r} is not a size; write e.g. 4GiB or 512MiB") from None


def make_plan(
    src: Path,
    out: Path,
    target: Target,
    *,
    precision: Precision | str | None = None,
    batch: str | None = None,
    seq: str | None = None,
    past: str | None = None,
    workspace: str | None = None,
    timing_cache: Path | None = None,
) -> BuildPlan:
    """The plan for `src` (a .onnx or an export folder) into `out`; BadInput for unusable options.

    Lint refusals are recorded (`plan.refusals`), not raised, so a dry run can print them;
    `plan.check()` raises them.
    """
    given = {name: parse_range(text, name) if text else None for name, text in (("batch", batch), ("seq", seq), ("past", past))}
    workspace_bytes = parse_workspace(workspace)
    graphs, layout = source_graphs(Path(src))
    limit = position_limit_for(graphs[0])
    ranges = derived_ranges(limit, **given)
    models = {path: load_graph(path) for path in graphs}
    precisions = {graph_precision(m) for m in models.values()}
    if len(precisions) > 1:
        raise BadInput(f"the graphs in {src} mix precisions ({', '.join(sorted(precisions))}); re-export them with one --dtype")
    chosen = decide_precision(precision, precisions.pop(), target)
    plans, refusals = [], []
    for path in graphs:
        graph = _graph_plan(path, models[path], _out_engine(Path(out), layout, path), ranges, target)
        plans.append(graph)
        if not graph.lint.parsable:
            refusals.append(refusal(path.name, graph.lint, target))
    plan = BuildPlan(target, Path(src), Path(out), layout, chosen, ranges, plans, workspace_bytes, timing_cache, refusals=refusals)
    plan.ranges = {k: v for k, v in ranges.items() if any(uses(m, k) for m in models.values())}
    plan.notes = _notes(given, limit, plan.ranges)
    return plan


def _notes(given: dict[str, Range | None], limit: int | None, used: dict[str, Range]) -> list[str]:
    notes = [f"--{k} is ignored: no graph input has that dimension" for k, v in given.items() if v and k not in used]
    for name in ("seq", "past"):
        if limit and name in used and used[name].max + (name == "past") > limit:
            notes.append(f"--{name} max {used[name].max} exceeds the model's position limit {limit}")
    return notes
