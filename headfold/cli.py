"""The `headfold` command line (contract in docs/design.md): exit 0 ok, 1 a check failed, 2 bad input, 3 a bug.

The options are declared once, in groups, in headfold/options.py; each command here says which
groups it takes and does its work with the objects they build. Every command takes the same
output options (-q, -v, --json where it has a result, --overwrite where it writes): results go to
stdout, progress and warnings to stderr. Heavy libraries are imported inside the commands, so
`headfold --help` starts without torch.
"""

from __future__ import annotations

import errno
import io
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from headfold.converter.recipes import MODIFIERS, get_method
from headfold.converter.seq2seq import KIND_NAMES
from headfold.converter.sources import checkpoint_folders
from headfold.ground import manifest
from headfold.ground.atomic import check_outputs, cleanup_on_sigterm, library_scratch
from headfold.ground.errors import HeadfoldError, first_line, is_panic
from headfold.ground.inputs import printable
from headfold.ground.units import whole_number
from headfold.options import (
    CHECKPOINT,
    DISTILL_EVALUATION,
    DISTILL_TOKENS,
    DISTILL_TRAINING,
    PATH,
    REPORTS,
    REVISION,
    WHOLE,
    Calibration,
    ExportOptions,
    Fraction,
    Group,
    Output,
    Profile,
    calibration_options,
    color_allowed,
    configure_logging,
    conversion_options,
    distill_stage_options,
    export_options,
    given,
    input_options,
    method_spec,
    options,
    output_options,
    profile_options,
    refuse,
    spec,
    threshold_options,
)

if TYPE_CHECKING:
    from headfold.distillation.stage import DistillStage
    from headfold.ground.settings import InputSpec
    from headfold.verification.budget import Thresholds
    from headfold.verification.report import Report

EXIT_CODES = (
    "Exit codes: 0 ok, 1 a check or gate failed, 2 bad input or environment (one line, nothing written), 3 internal error (a bug; --debug shows the traceback)."
)
SOURCE = options(REVISION, title="Source")
_debug = False  # set by the group's --debug, read by main() once the command has failed


def _kv_text(kv_heads: int | tuple[int, ...]) -> str:
    return str(kv_heads) if isinstance(kv_heads, int) else ",".join(map(str, kv_heads))


def _checkpoint_folders(*sources: str | Path, revision: str | None, allow_pickle: bool = False) -> list[Path]:
    """Each checkpoint argument as a local folder: hub ids (ORG/NAME) resolved through the Hugging Face
    cache before any heavy import, so a wrong id fails in a second; other paths as they are."""
    return checkpoint_folders(*sources, revision=revision, allow_pickle=allow_pickle)


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    global _debug
    _debug = value


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True}, epilog=EXIT_CODES)
@click.version_option(package_name="headfold")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug, help="Show the traceback of any failure.")
@click.option("--verbose", "-v", is_flag=True, help="Also debug lines and the libraries' own warnings, on stderr (every command takes -v too).")
@click.option("--quiet", "-q", is_flag=True, help="Only results, warnings and errors: no progress bars or progress lines (every command takes -q too).")
@click.pass_context
def cli(ctx: click.Context, verbose: bool, quiet: bool) -> None:
    """Convert MHA transformers to GQA/MQA, export, build engines, verify."""
    ctx.color = color_allowed()
    configure_logging(int(verbose) - int(quiet))


@cli.command()
@click.argument("src", type=CHECKPOINT)
@click.argument("out", type=CHECKPOINT)  # as typed: a trailing slash makes an ONNX OUT a folder
@conversion_options()
@calibration_options
@SOURCE
@output_options()
def convert(
    src: str | Path,  # each checkpoint argument is its local folder once resolved
    out: str | Path,
    kv_heads: int | tuple[int, ...],
    method: str,
    pool: str | None,
    local_steps: int | None,
    shard_size: str | None,
    allow_pickle: bool,
    calibration: Calibration,
    revision: str | None,
    output: Output,
) -> None:
    """Convert the checkpoint SRC (a Hugging Face folder or hub id ORG/NAME) to a GQA/MQA checkpoint in OUT.

    Reads config.json and model.safetensors (or sharded safetensors with their index),
    pools the K/V projection heads of each group of query heads, and writes weights in the
    source dtype, the updated config.json, every tokenizer/other file and a headfold.json
    manifest. OUT appears only when complete; SRC is never modified.

    SRC may also be an MHA model.onnx (methods mean/first; mean unless --method says first): its
    K/V projection initializers are pooled and the graph rewritten to GQA Attention nodes, into OUT.onnx
    (OUT/SRC's name where OUT ends in a slash).

    An encoder-decoder (T5, BART, Whisper) pools its decoder's self- and cross-attention (--pool).
    """
    if Path(src).suffix == ".onnx":
        onnx = Path(src)  # into OUT/SRC's name where OUT ends in a slash
        _convert_onnx(onnx, Path(out, onnx.name) if str(out).endswith(os.sep) else Path(out), kv_heads, method, output)
        return
    out = Path(out)
    (src,) = _checkpoint_folders(src, revision=revision, allow_pickle=allow_pickle)
    reads = [src, *([] if calibration.text in (None, "weights") else [Path(calibration.text)])]
    output.check(reads, [out])
    if not get_method(method).data_aware:
        refuse(("calibration", "calibration_tokens", "seed"), f"to --method {method} (only {', '.join(MODIFIERS[:-1])} and {MODIFIERS[-1]} calibrate)")
    from headfold import corpus  # the built-in text (pydoc's topics) and tqdm: not loaded for `headfold --help`
    from headfold.converter import convert as run_convert

    result = run_convert(
        src,
        out,
        kv_heads,
        method,
        overwrite=output.overwrite,
        max_shard_size=shard_size,
        allow_pickle=allow_pickle,
        progress=output.progress,
        builtin_text=corpus.calibration_text(),
        pool=pool,
        local_steps=local_steps,
        **calibration.kwargs(),
    )
    from headfold.converter.conversion import load_hint

    record = manifest.load(result)
    pooled = [KIND_NAMES[kind] for kind, entry in (record.conversion.attentions or {}).items() if entry["pooled"]]  # an encoder-decoder's
    where = f" in {' and '.join(pooled)}" if pooled else ""
    applied = record.conversion.method  # the default drops local where there is no text: say what ran
    lines = [f"wrote {result} ({_kv_text(kv_heads)} kv heads{where}, method {applied})", *filter(None, [load_hint(result)])]
    output.emit("\n".join(lines), {"output": str(result), **record.to_dict()}, reads)


def _convert_onnx(src: Path, out: Path, kv_heads: int | tuple[int, ...], method: str, output: Output) -> None:
    """convert on a model.onnx: its K/V initializers pooled (mean unless --method says first) and the graph rewritten to GQA."""
    refuse(
        ("pool", "local_steps", "shard_size", "allow_pickle", "calibration", "calibration_tokens", "seed", "revision"),
        f"to an ONNX source ({src.name}: its weights are initializers, pooled without calibration)",
    )
    from headfold.graphs.onnx_convert import convert_onnx

    method = method if given(click.get_current_context(), ("method",)) else "mean"
    output.check([src], [out, out.with_name(f"{out.name}.data")])  # the graph and its weights
    summary = convert_onnx(src, out, kv_heads, method, overwrite=output.overwrite)
    line = f"wrote {out} ({summary['attention_nodes']} {summary['attention_op']} nodes, {_kv_text(kv_heads)} kv heads, method {method})"
    output.emit(line, {"output": str(out), "method": method, **summary}, [src])


@cli.command("export")
@click.argument("src", type=CHECKPOINT)
@click.argument("out_dir", type=PATH)
@export_options
@SOURCE
@output_options()
def export_cmd(src: str | Path, out_dir: Path, export: ExportOptions, revision: str | None, output: Output) -> None:
    """Export the checkpoint SRC (a folder or hub id ORG/NAME) to ONNX with one GQA Attention node per layer.

    Decoders get one merged model.onnx (any number of new tokens after a past of any length, KV
    cache at kv-heads) with genai_config.json and the tokenizer files: an onnxruntime-genai model
    folder; --graphs split gives prefill.onnx + decode.onnx instead. Encoders get model.onnx.
    Weights go to .onnx.data. Exits 1 when an attention layer did not fuse. With --trt-version,
    the ops that release's parser lacks are decomposed and the graphs linted against it.
    """
    (src,) = _checkpoint_folders(src, revision=revision)
    output.check([src], [out_dir])
    from headfold.graphs.export import export as run_export

    summary = run_export(src, out_dir, overwrite=output.overwrite, progress=output.progress, **export.kwargs())
    lines = []
    for name, graph in summary["graphs"].items():
        decomposed = {op: n for op, n in graph.get("decomposed_for_tensorrt", {}).items() if op != "version"}
        note = f"; decomposed for TensorRT {export.trt_version}: {', '.join(f'{n} {op}' for op, n in decomposed.items())}" if decomposed else ""
        lines.append(f"wrote {out_dir / name}: {graph['attention_nodes']} {graph['attention_op']} nodes, kv-heads {graph['attention_kv_heads']}{note}")
    if export.trt_version:
        from headfold.graphs.trt_lint import export_table

        lines.append(export_table(out_dir, export.trt_version))
    output.emit("\n".join(lines), summary, [src])


@cli.command("build")
@click.argument("src", type=PATH)
@click.argument("out", type=PATH)
@options(
    spec("--dry-run", is_flag=True, help="Print the build plan (graphs, precision, profiles, plugins, lint) and build nothing; needs no TensorRT."),
    spec("--require-fused-attention", is_flag=True, help="Exit 1 (and write nothing) when an engine's attention is not one fused kernel."),
)
@profile_options
@output_options()
def build_cmd(src: Path, out: Path, dry_run: bool, require_fused_attention: bool, profile: Profile, trt_version: str | None, output: Output) -> None:
    """Build TensorRT engines from SRC (a .onnx or an export folder) into OUT.

    A .onnx gives one engine: OUT must end with .engine, its sidecar is OUT.json. An export
    folder gives a folder OUT with one engine per graph (prefill.engine + decode.engine, or
    model.engine), each with its .engine.json sidecar (TensorRT, GPU, profiles, precision, source
    sha256, fused-attention verdict). Exit 2 when the TensorRT-compatibility lint says the parser
    would reject a graph, 1 when --require-fused-attention fails. --json: the plan (with
    --dry-run) or the engines' sidecars.
    """
    from headfold.engines.env import target_for
    from headfold.engines.plan import make_plan

    target = target_for(trt_version, dry_run=dry_run)
    plan = make_plan(src, out, target, **profile.kwargs())
    output.check(plan.reads, [path for path, _ in plan.outputs])
    if dry_run:
        output.emit(plan.describe(), plan.to_json(), plan.reads)
        plan.check()
        return
    from headfold.engines.build import build

    sidecars = build(plan, overwrite=output.overwrite, require_fused_attention=require_fused_attention)
    line = f"wrote {out}: {', '.join(g.engine.name for g in plan.graphs)} with .engine.json sidecars"
    output.emit(line, {"output": str(out), "engines": [s.to_dict() for s in sidecars]}, plan.reads)


def _finish(report: Report, output: Output, sources: list[Path] | None = None) -> None:
    """Print the table (coloured on a terminal) or the JSON, then exit 1 on a failed budget."""
    output.emit(report.table(color=True), report.to_json(), sources or [])
    report.raise_for_failures()
    output.say(click.style("all checks passed", fg="green"))


@cli.command("verify")
@click.argument("reference", type=CHECKPOINT)
@click.argument("candidate", type=CHECKPOINT)
@options(
    spec(
        "--check",
        type=click.Choice(("auto", "fidelity", "loss")),
        default="auto",
        help="auto: same model on both sides → fidelity; CANDIDATE converted from REFERENCE → loss.",
    )
)
@input_options(token_ids=True)
@threshold_options
@SOURCE
@output_options(extra=REPORTS, json_alias="--report")
def verify_cmd(
    reference: str | Path,
    candidate: str | Path,
    check: str,
    inputs: InputSpec,
    thresholds: Thresholds,
    revision: str | None,
    markdown_path: Path | None,
    junit_path: Path | None,
    output: Output,
) -> None:
    """Compare CANDIDATE with REFERENCE on the same text; exit 1 when a budget is exceeded.

    Each side is a checkpoint (a folder or hub id ORG/NAME, run in torch), an export folder or a
    .onnx file (run in ONNX Runtime), or an engine. Fidelity: the same model on two backends (abs/rel
    error, cosine, top-1); a decoder export also runs its KV-cache path (prefill, then --decode-steps
    steps through the same model.onnx, or decode.onnx of a split export) as the check
    fidelity-decode. Conversion loss: original vs converted (perplexity increase, KL, top-1;
    encoders: cosine). --json (alias --report) is the whole report.
    """
    from headfold.verification.api import files_read, verify

    reference, candidate = _checkpoint_folders(reference, candidate, revision=revision)
    files = [p for p in (None if output.json_to_stdout else output.json_path, markdown_path, junit_path) if p is not None]
    reads = files_read(reference, candidate, inputs, thresholds)
    check_outputs([(p, False) for p in files], overwrite=output.overwrite, sources=reads)  # before the work
    report = verify(reference, candidate, inputs=inputs, thresholds=thresholds, check=check, progress=output.progress)
    report.write(None if output.json_to_stdout else output.json_path, markdown_path, junit_path, overwrite=output.overwrite, sources=reads)
    _finish(report, replace(output, json_path=Path("-") if output.json_to_stdout else None))


@cli.command("run")
@click.argument("src", type=CHECKPOINT)
@click.argument("out_dir", type=PATH)
@conversion_options()
@calibration_options
@distill_stage_options
@export_options
@profile_options
@input_options()
@threshold_options
@SOURCE
@output_options()
def run_cmd(
    src: str | Path,
    out_dir: Path,
    kv_heads: int | tuple[int, ...],
    method: str,
    pool: str | None,
    local_steps: int | None,
    shard_size: str | None,
    allow_pickle: bool,
    calibration: Calibration,
    distill: DistillStage | None,
    export: ExportOptions,
    profile: Profile,
    trt_version: str | None,
    inputs: InputSpec,
    thresholds: Thresholds,
    revision: str | None,
    output: Output,
) -> None:
    """Convert → (distill) → export → build → verify the checkpoint SRC (a folder or hub id) into OUT_DIR/{convert,distill,export,build,verify}.

    Takes every option of the stages it runs: convert's, distill's as --distill-… (the stage runs
    when any is given), export's, build's and verify's. Stages whose inputs (content hashes and
    options, in OUT_DIR/stages.json) are unchanged and whose folders still hash to what
    stages.json recorded are skipped. OUT_DIR must be new, empty or a run folder unless
    --overwrite. Engines are built only where TensorRT and a GPU are present. The reports land in
    OUT_DIR/verify (report.json, report.md, junit.xml); exit 1 when a budget is exceeded.
    """
    from headfold.pipeline import run

    (src,) = _checkpoint_folders(src, revision=revision, allow_pickle=allow_pickle)
    output.check([src], [out_dir])
    report = run(
        src,
        out_dir,
        kv_heads,
        method=method,
        max_shard_size=shard_size,
        allow_pickle=allow_pickle,
        calibration=calibration,
        pool=pool,
        local_steps=local_steps,
        distill=distill,
        export=export,
        build=profile,
        inputs=inputs,
        thresholds=thresholds,
        overwrite=output.overwrite,
        progress=output.progress,
    )
    _finish(report, output, [src, out_dir])


def _distill_summary(record: dict[str, Any]) -> list[str]:
    """Held-out scores at the start and the end, in verify's units (percent, nats, cosine)."""
    from headfold.verification.report import fmt

    first, last = record["initial_eval"], record["final_eval"]
    names = {"kl": "KL", "ppl_increase": "perplexity increase", "top1": "top-1", "cosine": "cosine", "mse": "hidden MSE"}
    rows = [f"  {names[m]:<20} {fmt(m, first[m]):>10} → {fmt(m, last[m])}" for m in names if m in last]
    return [f"held-out {'metric':<11} {'start':>10}   end", *rows]


@cli.command("distill")
@click.argument("teacher", type=CHECKPOINT)
@click.argument("student", type=CHECKPOINT)
@click.argument("out", type=PATH)
@options(*DISTILL_TRAINING, title="Training options")
@options(*DISTILL_EVALUATION, title="Evaluation and stopping")
@options(
    spec("--save-every", type=WHOLE, default=None, help="Write a resumable checkpoint every N steps into .OUT.distill-state beside OUT."),
    spec("--resume", is_flag=True, help="Continue from the last checkpoint in .OUT.distill-state (same inputs and options)."),
    title="Resumable state",
)
@SOURCE
@output_options()
def distill_cmd(teacher: str | Path, student: str | Path, out: Path, revision: str | None, output: Output, **options: Any) -> None:
    """Distill STUDENT (a headfold conversion of TEACHER) from TEACHER into OUT.

    The teacher (the MHA original; a folder or hub id) is frozen; the student learns to match its
    next-token distributions (decoders) or hidden states (encoders) on --data. OUT is a checkpoint like
    `convert` writes (same files, config and kv heads; trained tensors in the source dtype) with a
    chained headfold.json, distill-log.json and distill-curve.png. Runs data-parallel under
    `accelerate launch` or `torchrun` (only the main process writes).
    """
    from headfold.distillation import distill
    from headfold.distillation.sharding import main_process
    from headfold.distillation.state import state_folder

    teacher, student = _checkpoint_folders(teacher, student, revision=revision)
    reads = [teacher, student, *(Path(options[k]) for k in ("data", "eval_data") if options.get(k) is not None)]
    output.check(reads, [out, state_folder(out)])
    result = distill(teacher, student, out, overwrite=output.overwrite, progress=output.progress, **options)
    if not main_process():
        return  # under torchrun / accelerate launch only the main process reports (and writes)
    record = manifest.load(result).distillation
    assert record is not None  # distill's output manifest always carries its distillation
    lines = [f"wrote {result} ({record['steps']} steps, {record['tokens']} tokens)", *_distill_summary(record)]
    if record["target_reached"] is False:
        lines.append("note: the --until target was not reached within the token budget")
    output.emit("\n".join(lines), {"output": str(result), **record}, reads)


class KvBudget(click.ParamType):
    """0.25 or 25% of the source's KV cache, or an integer total of kv heads over all layers."""

    name = "FRACTION|TOTAL"

    def convert(self, value, param, ctx):
        return total if isinstance(value, str) and (total := whole_number(value)) is not None and total >= 0 else Fraction().convert(value, param, ctx)


@cli.command("inspect")
@click.argument("src", type=CHECKPOINT)
@options(
    spec(
        "--candidates",
        default=None,
        metavar="K,K,...",
        help="kv-head counts to predict the loss of, e.g. 4,2,1. [default: every divisor of the kv heads below them]",
    ),
    method_spec(),
    spec(
        "--kv-budget",
        type=KvBudget(),
        default=None,
        help="Propose per-layer kv heads for this KV cache: 0.25 (or 25%) of the source's, or a total of kv heads summed over layers.",
    ),
    title="Inspection options",
)
@calibration_options
@SOURCE
@output_options(
    extra=(spec("--heatmap", type=PATH, default=None, metavar="OUT.png", help="Write a PNG: layers × heads similarity, layers × candidates predicted loss."),)
)
def inspect_cmd(
    src: str | Path, candidates: str | None, method: str, kv_budget, calibration: Calibration, revision: str | None, heatmap: Path | None, output: Output
) -> None:
    """Per layer of SRC (a folder or hub id): K/V head similarity and the predicted loss of each kv-head count.

    The predicted loss of a (layer, kv heads) pair is the calibration loss with only that layer
    converted: KL(original ‖ converted) per token for decoders, 1 − cosine of the mean-pooled
    embedding for encoders. With --kv-budget, prints the per-layer `--kv-heads` list with the least
    summed predicted loss that fits (exact knapsack), next to the best uniform choice.
    """
    from headfold.inspection import inspect_checkpoint

    (src,) = _checkpoint_folders(src, revision=revision)
    json_file = None if output.json_to_stdout else output.json_path
    if heatmap is None and json_file is None:
        refuse(("overwrite",), "without --heatmap or --json FILE (inspect writes no other file)")
    report = inspect_checkpoint(
        src,
        candidates=candidates,
        method=method,
        kv_budget=kv_budget,
        heatmap=heatmap,
        json_path=json_file,
        overwrite=output.overwrite,
        progress=output.progress,
        **calibration.kwargs(),
    )
    written = [f"wrote {what} {path}" for what, path in (("heatmap", heatmap), ("JSON", json_file)) if path is not None]
    output.emit("\n".join([report.table(), *written]), report.to_json(), written=json_file is not None)


DEMO_TOKENS = (("--distill-tokens",), {**DISTILL_TOKENS[1], "default": "1.5%"})


def _demo_rows() -> int:
    """--max-rows of the demo: the rows its reference budget was measured on (imported when the demo runs)."""
    from headfold.demo import DEMO_INPUTS

    return DEMO_INPUTS.max_rows or 0  # None (every row) is --max-rows 0


@cli.command()
@conversion_options(kv_default="4", written=False, with_pool=False)
@calibration_options
@distill_stage_options
@options(
    DEMO_TOKENS,
    spec("--no-distill", is_flag=True, help="Skip distillation: what training-free conversion alone reaches (the reference budget then fails)."),
    title="Distill stage",
)
@export_options
@profile_options
@input_options(max_rows={"default": _demo_rows, "show_default": "the rows of the reference budget"})
@threshold_options
@options(
    spec(
        "--keep",
        type=PATH,
        default=None,
        metavar="DIR",
        help="Run in DIR and keep it (the stage folders and reports); default: a temporary folder, removed at the end.",
    ),
    title="Output",
)
@output_options(writes=True)
def demo(
    kv_heads: int | tuple[int, ...],
    method: str,
    local_steps: int | None,
    calibration: Calibration,
    distill: DistillStage | None,
    distill_tokens: str,
    no_distill: bool,
    export: ExportOptions,
    profile: Profile,
    trt_version: str | None,
    inputs: InputSpec,
    thresholds: Thresholds,
    keep: Path | None,
    output: Output,
) -> None:
    """`headfold run` on the embedded trained model (Llama layout, 4 layers × 8 heads).

    Converts, distills on the model's own training split, exports, (builds where TensorRT is
    present) and verifies on Python documentation text the model never saw in training, then
    prints the report table. Without --budget the gates are the embedded model's reference budget
    (headfold/data/default_model/demo-budget.toml). Takes run's options for every stage
    (--distill-… over the demo's own distillation).
    """
    from headfold.demo import DEMO_DISTILL, demo_budget
    from headfold.demo import demo as run_demo
    from headfold.distillation.stage import DistillStage

    if no_distill:
        refuse([name for name in click.get_current_context().params if name.startswith("distill_")], "with --no-distill")
    if keep is None:
        refuse(("overwrite",), "without --keep DIR (the demo writes nowhere else)")
    output.check(writes=[keep] if keep else [])
    asked = distill or DistillStage(None, {})  # the --distill-… options given, over the demo's own distillation
    own = {**DEMO_DISTILL.options, **({} if "steps" in asked.options else {"tokens": distill_tokens})}  # --distill-steps replaces its tokens
    distill = None if no_distill else DistillStage(asked.data, {**own, **asked.options}, asked.eval_data)
    budget = thresholds if thresholds.file else replace(thresholds, file=demo_budget())
    report = run_demo(
        kv_heads,
        method,
        distill=distill,
        thresholds=budget,
        keep=keep,
        overwrite=output.overwrite,
        progress=output.progress,
        calibration=calibration,
        local_steps=local_steps,
        export=export,
        build=profile,
        inputs=inputs,
    )
    _finish(report, output)
    if keep is not None:
        output.say(f"kept {keep}: convert/, {'distill/, ' if distill else ''}export/, verify/ (report.json, report.md, junit.xml)")


def os_error_line(err: OSError) -> str:
    """One line naming the path and the fix for an OS error (errno decides the fix)."""
    path = " → ".join(str(p) for p in (err.filename, err.filename2) if p is not None) or "a file"
    fixes: dict[int | None, str] = {
        errno.ENOSPC: f"no space left on the device holding {path}; free space there or choose another output",
        errno.EDQUOT: f"disk quota exceeded writing {path}; free space or choose another output",
        errno.EROFS: f"{path} is on a read-only file system; choose an output on a writable one",
        errno.EACCES: f"permission denied: {path}; fix its permissions or choose another path",
        errno.EPERM: f"operation not permitted on {path}; fix its permissions or choose another path",
        errno.ENAMETOOLONG: f"the name {path} is too long for the file system; choose a shorter name",
        errno.ENOTDIR: f"a parent of {path} is a file, not a folder; choose a path whose parents are folders",
        errno.ENOENT: f"{path} does not exist; check the path",
        errno.EISDIR: f"{path} is a folder where a file was expected; pass a file",
    }
    return fixes.get(err.errno, f"{err.strerror or err}: {path}; check the path and the device")


def _usage_line(err: click.UsageError) -> str:
    """Click's usage block as one line: the problem, then where the help is."""
    command = err.ctx.command_path if err.ctx else "headfold"
    return f"{err.format_message().rstrip('.')} (see '{command} --help')"


def _fail(message: str, code: int) -> int:
    if _debug:
        traceback.print_exc()
    line = printable(" ".join(message.splitlines()))  # one line, whatever the message; no escape sequence from a file
    click.secho(f"headfold: error: {line}", fg="red", err=True, color=color_allowed())
    return code


class _PipeSafe(io.RawIOBase):
    """stdout's file descriptor for a reader that may leave (`| head`, `| true`): once a write finds
    the pipe closed, it and the rest go to /dev/null, so the command finishes and its own verdict
    (exit code) stands, with no traceback and no extra line."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        try:
            return os.write(self.fd, data)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.fd)
            os.close(devnull)
            return len(data)


@contextmanager
def _pipe_safe_stdout() -> Iterator[None]:
    """sys.stdout on _PipeSafe while a command runs (only the process's real stdout: a test's capture stays)."""
    real = sys.stdout
    try:
        fd = real.fileno() if real is sys.__stdout__ and real is not None else None
        real.flush()
    except (AttributeError, OSError, ValueError):
        fd = None
    if fd is None:
        yield
        return
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_PipeSafe(fd)), encoding=real.encoding, errors=real.errors, line_buffering=True)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = real


def main(argv: list[str] | None = None) -> int:
    """Console entry point: every failure becomes one line on stderr and an exit code (EXIT_CODES)."""
    with _pipe_safe_stdout():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    global _debug
    _debug = False
    try:
        # Signals are recorded for the whole command, not only inside a stage's outputs: a Ctrl-C between
        # them that a library swallows still stops the command before anything is placed.
        with cleanup_on_sigterm(), library_scratch():  # what libraries write to the temp folder is removed at exit
            code = cli.main(args=argv, prog_name="headfold", standalone_mode=False)
    except HeadfoldError as e:
        return _fail(str(e), e.exit_code)
    except click.exceptions.Abort:
        click.echo("headfold: aborted", err=True)
        return 130
    except click.UsageError as e:
        return _fail(_usage_line(e), 2)
    except click.ClickException as e:
        return _fail(e.format_message(), e.exit_code)
    except OSError as e:
        return _fail(os_error_line(e), 2)
    except MemoryError:
        return _fail("out of memory; use a machine with more memory, or fewer --calibration-tokens / a smaller --batch-size", 2)
    except RecursionError:  # headfold's readers bound nesting; a library reading a deeper input file hit Python's limit
        return _fail(
            "an input file nests deeper than Python's recursion limit (a hostile or damaged JSON/YAML file?); check the inputs, --debug shows which reader", 2
        )
    except Exception as e:  # anything else is a bug in headfold
        return _fail(f"internal error ({type(e).__name__}: {first_line(e)}); this is a bug: rerun with --debug for the traceback", 3)
    except BaseException as e:
        if not is_panic(e):  # SystemExit (SIGTERM's 143), KeyboardInterrupt: as they are
            raise
        return _fail(f"internal error (a native library panicked: {first_line(e)}); rerun with --debug for the traceback", 3)
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
