"""The `headfold` command line (contract in DESIGN.md): exit 0 ok, 1 a check failed, 2 bad input, 3 a bug.

The options are declared once, in groups, in headfold/options.py; each command here says which
groups it takes and does its work with the objects they build. Heavy libraries are imported
inside the commands, so `headfold --help` starts without torch.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click

from headfold.ground.errors import HeadfoldError
from headfold.options import (
    BEST_METHOD,
    DTYPE,
    JSON,
    OPSET,
    PATH,
    SEED,
    TENSORRT,
    TRT_VERSION,
    Calibration,
    Fraction,
    Group,
    Output,
    OptionGroup,
    Profile,
    batch_size_spec,
    calibration_options,
    configure_logging,
    input_options,
    kv_heads_spec,
    method_spec,
    options,
    output_options,
    profile_options,
    quiet_libraries,
    refuse,
    report_options,
    spec,
    threshold_options,
)

if TYPE_CHECKING:
    from headfold.distillation.stage import DistillStage
    from headfold.verification.budget import Thresholds
    from headfold.verification.inputs import InputSpec

EXIT_CODES = "Exit codes: 0 ok, 1 a check or gate failed, 2 bad input or environment (one line, nothing written), 3 internal error (a bug; --debug shows the traceback)."
CONVERSION = "Conversion options"
EXPORT = "Export options"
_debug = False  # set by the group's --debug, read by main() once the command has failed


def _kv_text(kv_heads: int | tuple[int, ...]) -> str:
    return str(kv_heads) if isinstance(kv_heads, int) else ",".join(map(str, kv_heads))


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    global _debug
    _debug = value


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True}, epilog=EXIT_CODES)
@click.version_option(package_name="headfold")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug, help="Show the traceback of any failure.")
@click.option("--verbose", "-v", is_flag=True, help="Also print debug lines.")
@click.option("--quiet", "-q", is_flag=True, help="Only warnings and errors: no progress bars or progress lines (results still print).")
def cli(verbose: bool, quiet: bool) -> None:
    """Convert MHA transformers to GQA/MQA, export, build engines, verify."""
    configure_logging(int(verbose) - int(quiet))


@cli.command()
@click.argument("src", type=PATH)
@click.argument("out", type=PATH)
@options(
    kv_heads_spec(), method_spec(),
    spec("--shard-size", default=None, metavar="SIZE", help="Largest output shard, e.g. 2GB or 500MiB. Default: like the source (one file stays one file)."),
    spec("--allow-pickle", is_flag=True, help="Accept pytorch_model.bin pickles (loaded with weights_only=True). Off by default: pickles can run code."),
    title=CONVERSION,
)  # fmt: skip
@calibration_options
@output_options()
def convert(src: Path, out: Path, kv_heads: int | tuple[int, ...], method: str, shard_size: str | None, allow_pickle: bool, calibration: Calibration, output: Output) -> None:
    """Convert the Hugging Face checkpoint folder SRC to a GQA/MQA checkpoint in OUT.

    Reads config.json and model.safetensors (or sharded safetensors with their index),
    pools the K/V projection heads of each group of query heads, and writes weights in the
    source dtype, the updated config.json, every tokenizer/other file and a headfold.json
    manifest. OUT appears only when complete; SRC is never modified.

    SRC may also be an MHA model.onnx (methods mean/first): its K/V projection
    initializers are pooled and the graph rewritten to GQA Attention nodes, into OUT.onnx.
    """
    if output.quiet:
        quiet_libraries()
    if src.suffix == ".onnx":
        refuse(("shard_size", "allow_pickle", "calibration", "calibration_tokens", "seed"), f"to an ONNX source ({src.name}: its weights are initializers, pooled without calibration)")
        from headfold.graphs.onnx_convert import convert_onnx

        summary = convert_onnx(src, out, kv_heads, method, overwrite=output.overwrite)
        click.echo(f"wrote {out} ({summary['attention_nodes']} Attention nodes, {_kv_text(kv_heads)} kv heads, method {method})")
        return
    from headfold.converter.recipes import get_method

    if not get_method(method).data_aware:
        refuse(("calibration", "calibration_tokens", "seed"), f"to --method {method} (only grouped, aligned and refit calibrate)")
    from headfold import corpus
    from headfold.converter import convert as run_convert

    result = run_convert(
        src, out, kv_heads, method, overwrite=output.overwrite, max_shard_size=shard_size, allow_pickle=allow_pickle,
        progress=output.progress, builtin_text=corpus.calibration_text(), **calibration.kwargs(),
    )  # fmt: skip
    click.echo(f"wrote {result} ({_kv_text(kv_heads)} kv heads, method {method})")
    from headfold.converter.conversion import load_hint

    if hint := load_hint(result):
        click.echo(hint)


@cli.command("export")
@click.argument("src", type=PATH)
@click.argument("out_dir", type=PATH)
@options(
    OPSET, DTYPE,
    spec("--attention", type=click.Choice(("onnx", "ort-gqa")), default="onnx", help="Fused node: onnx = standard Attention (ORT, TensorRT); ort-gqa = com.microsoft.GroupQueryAttention for ONNX Runtime CUDA decoding (decoders only; unpadded or right-padded batches; CUDA runs it in fp16/bf16)."),
    spec("--graphs", type=click.Choice(("merged", "split")), default=None, help="Decoders: merged = one model.onnx for prompt and decode steps + genai_config.json (onnxruntime-genai); split = prefill.onnx + decode.onnx (TensorRT profiles). [default: merged; split with --trt-version, the pair `headfold build` takes]"),
    spec("--optimize", type=click.Choice(("ort",)), default=None, help="ort = ONNX Runtime's fusions (onnxscript ort_fusions: simplified/skip layer norm, fused matmuls), counted in export.json; the graph then runs in ONNX Runtime only."),
    spec("--position-ids", is_flag=True, help="Merged decoder graph: take a position_ids [B, S] input (named in genai_config.json) instead of counting positions over the mask's real tokens."),
    title=EXPORT,
)  # fmt: skip
@options(TRT_VERSION, title=TENSORRT)
@output_options()
def export_cmd(
    src: Path, out_dir: Path, opset: int, dtype: str, attention: str, graphs: str | None, optimize: str | None, position_ids: bool, trt_version: str | None, output: Output
) -> None:
    """Export the checkpoint folder SRC to ONNX with one GQA Attention node per layer.

    Decoders get one merged model.onnx (any number of new tokens after a past of any length, KV
    cache at kv-heads) with genai_config.json and the tokenizer files: an onnxruntime-genai model
    folder; --graphs split gives prefill.onnx + decode.onnx instead. Encoders get model.onnx.
    Weights go to .onnx.data. Exits 1 when an attention layer did not fuse. With --trt-version,
    the ops that release's parser lacks are decomposed and the graphs linted against it.
    """
    from headfold.graphs.export import export

    if output.quiet:
        quiet_libraries()
    graphs = graphs or ("split" if trt_version else "merged")  # a TensorRT target gets the graphs TensorRT builds
    summary = export(
        src, out_dir, opset=opset, dtype=dtype, attention=attention, overwrite=output.overwrite, progress=output.progress,
        trt_version=trt_version, graphs=graphs, optimize=optimize, explicit_positions=position_ids,
    )  # fmt: skip
    for name, graph in summary["graphs"].items():
        decomposed = {op: n for op, n in graph.get("decomposed_for_tensorrt", {}).items() if op != "version"}
        note = f"; decomposed for TensorRT {trt_version}: {', '.join(f'{n} {op}' for op, n in decomposed.items())}" if decomposed else ""
        click.echo(f"wrote {out_dir / name}: {graph['attention_nodes']} Attention nodes, kv-heads {graph['attention_kv_heads']}{note}")
    if trt_version:
        from headfold.graphs.trt_lint import export_table

        click.echo(export_table(out_dir, trt_version))


@cli.command("build")
@click.argument("src", type=PATH)
@click.argument("out", type=PATH)
@options(
    spec("--dry-run", is_flag=True, help="Print the build plan (graphs, precision, profiles, plugins, lint) and build nothing; needs no TensorRT."),
    spec("--require-fused-attention", is_flag=True, help="Exit 1 (and write nothing) when an engine's attention is not one fused kernel."),
)  # fmt: skip
@profile_options
@output_options(JSON, quiet=False)
def build_cmd(src: Path, out: Path, dry_run: bool, require_fused_attention: bool, profile: Profile, trt_version: str | None, json_path: Path | None, output: Output) -> None:
    """Build TensorRT engines from SRC (a .onnx or an export folder) into OUT.

    A .onnx gives one engine: OUT must end with .engine, its sidecar is OUT.json. An export
    folder gives a folder OUT with one engine per graph (prefill.engine + decode.engine, or
    model.engine), each with its .engine.json sidecar (TensorRT, GPU, profiles, precision, source
    sha256, fused-attention verdict). Exit 2 when the TensorRT-compatibility lint says the parser
    would reject a graph, 1 when --require-fused-attention fails. --json is the dry run's plan.
    """
    from headfold.engines.env import target_for
    from headfold.engines.plan import make_plan

    if not dry_run:
        refuse(("json_path",), "without --dry-run (the plan goes to JSON; a build writes .engine.json sidecars)")
    target = target_for(trt_version, dry_run=dry_run)
    plan = make_plan(src, out, target, **profile.kwargs())
    if dry_run:
        _print_or_write(plan.describe(), plan.to_json(), json_path, output.overwrite)
        plan.check()
        return
    from headfold.engines.build import build

    build(plan, overwrite=output.overwrite, require_fused_attention=require_fused_attention)
    click.echo(f"wrote {out}: {', '.join(g.engine.name for g in plan.graphs)} with .engine.json sidecars")


def _print_or_write(table: str, as_json: str, json_path: Path | None, overwrite: bool) -> None:
    """--json's one meaning: the JSON to a file (then the table still prints) or, as '-', instead of the table."""
    if json_path is None:
        click.echo(table)
        return
    if str(json_path) == "-":
        click.echo(as_json, nl=not as_json.endswith("\n"))
        return
    from headfold.ground.atomic import atomic_output

    with atomic_output(json_path, is_dir=False, overwrite=overwrite) as tmp:
        tmp.write_text(as_json if as_json.endswith("\n") else as_json + "\n")
    click.echo(table)
    click.echo(f"wrote JSON {json_path}")


def _finish(report) -> None:
    """Print the table (click drops the colours when not a terminal), then exit 1 on a failed budget."""
    click.echo(report.table())
    report.raise_for_failures()
    click.secho("all checks passed", fg="green")


@cli.command("verify")
@click.argument("reference", type=PATH)
@click.argument("candidate", type=PATH)
@options(spec("--check", type=click.Choice(("auto", "fidelity", "loss")), default="auto", help="auto: same model on both sides → fidelity; CANDIDATE converted from REFERENCE → loss."))
@input_options(token_ids=True)
@threshold_options
@report_options
def verify_cmd(reference: Path, candidate: Path, check: str, inputs: InputSpec, thresholds: Thresholds, json_path: Path | None, markdown_path: Path | None, junit_path: Path | None) -> None:
    """Compare CANDIDATE with REFERENCE on the same text; exit 1 when a budget is exceeded.

    Each side is a checkpoint folder (run in torch), an export folder or a .onnx file (run in
    ONNX Runtime). Fidelity: the same model on two backends (abs/rel error, cosine, top-1); a
    decoder export also runs its KV-cache path (prefill, then --decode-steps steps through
    the same model.onnx, or decode.onnx of a split export) as the check fidelity-decode. Conversion loss: original vs converted (perplexity increase, KL, top-1; encoders: cosine).
    """
    from headfold.verification.api import verify

    quiet_libraries()
    report = verify(reference, candidate, inputs=inputs, thresholds=thresholds, check=check)
    report.write(json_path, markdown_path, junit_path)
    _finish(report)


DISTILL_TOKENS = spec("--distill-tokens", type=str, default=None, help="Tokens the distill stage trains on, as distill --tokens takes them (200k, 1.5M, 5%). [default: run 40 steps of 8 × 256; demo 1.5%] In run without --distill-data, for the embedded model: its own training split.")


def _distill_stage(distill_data: Path | None, distill_tokens: str | None) -> DistillStage | None:
    """The distill stage `run` adds when asked for (None: convert → export directly)."""
    if distill_data is None and distill_tokens is None:
        return None
    from headfold.distillation.stage import DistillStage

    return DistillStage(distill_data, {} if distill_tokens is None else {"tokens": distill_tokens})


distill_stage_options = OptionGroup(
    "Distill stage",
    (spec("--distill-data", type=PATH, default=None, help="Add the distill stage between convert and export, trained on this text (formats as for `headfold distill --data`)."), DISTILL_TOKENS),
    "distill",
    _distill_stage,
)  # fmt: skip


@cli.command("run")
@click.argument("src", type=PATH)
@click.argument("out_dir", type=PATH)
@options(kv_heads_spec(), method_spec(), title=CONVERSION)
@distill_stage_options
@options(OPSET, DTYPE, title=EXPORT)
@input_options()
@threshold_options
@output_options(quiet=False)
def run_cmd(src: Path, out_dir: Path, kv_heads: int | tuple[int, ...], method: str, distill: DistillStage | None, opset: int, dtype: str, inputs: InputSpec, thresholds: Thresholds, output: Output) -> None:
    """Convert → export → build → verify SRC into OUT_DIR/{convert,export,build,verify}.

    Stages whose inputs (content hashes and options, in OUT_DIR/stages.json) are unchanged and
    whose folders still hash to what stages.json recorded are skipped. OUT_DIR must be new, empty
    or a run folder unless --overwrite. Engines are built only where TensorRT and a GPU are
    present. The reports land in OUT_DIR/verify (report.json, report.md, junit.xml); exit 1 when
    a budget is exceeded.
    """
    from headfold.pipeline import run

    quiet_libraries()
    report = run(src, out_dir, kv_heads, method=method, opset=opset, dtype=dtype, overwrite=output.overwrite, distill=distill, inputs=inputs, thresholds=thresholds)
    _finish(report)


@cli.command("distill")
@click.argument("teacher", type=PATH)
@click.argument("student", type=PATH)
@click.argument("out", type=PATH)
@options(
    spec("--data", type=PATH, default=None, help="Training text: a text file, .jsonl/.parquet with a 'text' field, or a datasets save_to_disk folder. Default only for the embedded model: its training split."),
    spec("--eval-data", type=PATH, default=None, help="Held-out text (same formats). Default: the first --eval-windows windows of --data, never trained on."),
    spec("--tokens", type=str, default=None, help="Training tokens over all processes: 200000, 200k, 1.5M, or 5% of the teacher's pre-training tokens (known only for the embedded model); rounded down to whole steps. [default: 40 steps]"),
    spec("--steps", type=int, default=None, help="Optimizer steps, instead of --tokens."),
    spec("--seq-len", type=int, default=256, help="Tokens per training window."),
    batch_size_spec(None),  # None: default_batch_size()
    spec("--lr", type=float, default=None, help="Peak learning rate (AdamW; linear warmup over 10 % of the steps, then cosine to 0). [default: 1e-3 for decoders, 1e-4 for encoders]"),
    spec("--train", type=click.Choice(("kv", "attention", "all", "lora")), default=None, help="What trains: kv = K/V projections, attention = Q/K/V/O, all, lora = PEFT adapters on Q/K/V/O merged at the end. [default: attention for decoders, all for encoders]"),
    spec("--loss", type=click.Choice(("kl", "kl+ce")), default="kl", help="Decoders: KL(teacher || student) of the logits, optionally + next-token cross-entropy. Encoders always: hidden-state MSE + (1 - embedding cosine)."),
    spec("--temperature", type=float, default=1.0, help="Softmax temperature of the KL (loss scaled by T²)."),
    spec("--hidden-weight", type=float, default=None, help="Weight of the per-layer hidden-state match added to the loss: MSE of each layer's output against the teacher's, over the teacher's mean square, averaged over layers; 0 turns it off. [default: 30 for decoders, 0 for encoders]"),
    spec("--gradient-checkpointing", is_flag=True, help="Recompute layer activations in the backward pass: less memory, ~30 % slower."),
    SEED,
    title="Training options",
)  # fmt: skip
@options(
    spec("--eval-every", type=int, default=None, help="Evaluate on the held-out windows every N steps. [default: 8 evaluations per run]"),
    spec("--eval-windows", type=int, default=32, help="Held-out windows of --seq-len tokens."),
    spec("--until-kl", type=float, default=None, help="Stop once the held-out KL is at most this (checked at each evaluation)."),
    spec("--until-ppl-increase", type=Fraction(), default=None, help="Stop once the held-out perplexity is within this of the teacher's, e.g. 2%."),
    title="Evaluation and stopping",
)  # fmt: skip
@options(
    spec("--save-every", type=int, default=None, help="Write a resumable checkpoint every N steps into .OUT.distill-state beside OUT."),
    spec("--resume", is_flag=True, help="Continue from the last checkpoint in .OUT.distill-state (same inputs and options)."),
    title="Resumable state",
)  # fmt: skip
@output_options()
def distill_cmd(teacher: Path, student: Path, out: Path, output: Output, **options) -> None:
    """Distill STUDENT (a headfold conversion of TEACHER) from TEACHER into OUT.

    The teacher (the MHA original) is frozen; the student learns to match its next-token
    distributions (decoders) or hidden states (encoders) on --data. OUT is a checkpoint like
    `convert` writes (same files, config and kv heads; trained tensors in the source dtype) with a
    chained headfold.json, distill-log.json and distill-curve.png. Runs data-parallel under
    `accelerate launch` or `torchrun` (only the main process writes).
    """
    from headfold.distillation import distill
    from headfold.ground import manifest

    quiet_libraries()
    result = distill(teacher, student, out, overwrite=output.overwrite, progress=output.progress, **options)
    if os.environ.get("RANK", "0") != "0":
        return  # under torchrun / accelerate launch only the main process reports (and writes)
    final = manifest.load(result).distillation
    scores = ", ".join(f"{k} {v:.4g}" for k, v in final["final_eval"].items())
    click.echo(f"wrote {result} ({final['steps']} steps, {final['tokens']} tokens; held-out {scores})")
    if final["target_reached"] is False:
        click.echo("note: the --until target was not reached within the token budget")


class KvBudget(Fraction):
    """0.25 or 25% of the source's KV cache, or an integer total of kv heads over all layers."""

    name = "FRACTION|TOTAL"

    def convert(self, value, param, ctx):
        return int(value) if isinstance(value, str) and value.strip().isdigit() else super().convert(value, param, ctx)


@cli.command("inspect")
@click.argument("src", type=PATH)
@options(
    spec("--candidates", default=None, metavar="K,K,...", help="kv-head counts to predict the loss of, e.g. 4,2,1. [default: every divisor of the kv heads below them]"),
    method_spec(BEST_METHOD),
    spec("--kv-budget", type=KvBudget(), default=None, help="Propose per-layer kv heads for this KV cache: 0.25 (or 25%) of the source's, or a total of kv heads summed over layers."),
    title="Inspection options",
)  # fmt: skip
@calibration_options
@output_options(spec("--heatmap", type=PATH, default=None, metavar="OUT.png", help="Write a PNG: layers × heads similarity, layers × candidates predicted loss."), JSON)
def inspect_cmd(src: Path, candidates: str | None, method: str, kv_budget, calibration: Calibration, heatmap: Path | None, json_path: Path | None, output: Output) -> None:
    """Per layer of SRC: K/V head similarity and the predicted loss of each kv-head count.

    The predicted loss of a (layer, kv heads) pair is the calibration loss with only that layer
    converted: KL(original ‖ converted) per token for decoders, 1 − cosine of the mean-pooled
    embedding for encoders. With --kv-budget, prints the per-layer `--kv-heads` list with the least
    summed predicted loss that fits (exact knapsack), next to the best uniform choice.
    """
    import time

    from headfold.inspection import inspect_checkpoint

    to_stdout = json_path is not None and str(json_path) == "-"
    if heatmap is None and (json_path is None or to_stdout):
        refuse(("overwrite",), "without --heatmap or --json FILE (inspect writes no other file)")
    quiet_libraries()
    start = time.perf_counter()
    report = inspect_checkpoint(
        src, candidates=candidates, method=method, kv_budget=kv_budget, heatmap=heatmap, json_path=None if to_stdout else json_path,
        overwrite=output.overwrite, progress=output.progress, **calibration.kwargs(),
    )  # fmt: skip
    click.echo(json.dumps(report.to_json(), indent=1) if to_stdout else report.table())
    for option, path in (("heatmap", heatmap), ("JSON", None if to_stdout else json_path)):
        if path is not None:
            click.echo(f"wrote {option} {path}")
    if not to_stdout:
        click.echo(f"done in {time.perf_counter() - start:.1f} s")


@cli.command()
@options(
    kv_heads_spec("4"),
    method_spec(BEST_METHOD),
    title=CONVERSION,
)  # fmt: skip
@options(DISTILL_TOKENS, spec("--no-distill", is_flag=True, help="Skip distillation: what training-free conversion alone reaches (the reference budget then fails)."), title="Distill stage")
@threshold_options
def demo(kv_heads: int | tuple[int, ...], method: str, distill_tokens: str | None, no_distill: bool, thresholds: Thresholds) -> None:
    """`headfold run` on the embedded trained model (Llama layout, 4 layers × 8 heads) in a temporary folder.

    Converts, distills on the model's own training split, exports, (builds where TensorRT is
    present) and verifies on Python documentation text the model never saw in training, then
    prints the report table. Without --budget the
    gates are the embedded model's reference budget (headfold/data/default_model/demo-budget.toml).
    """
    from headfold.demo import DEMO_DISTILL, demo_budget
    from headfold.demo import demo as run_demo
    from headfold.distillation.stage import DistillStage

    if no_distill:
        refuse(("distill_tokens",), "with --no-distill")
    quiet_libraries()
    distill = None if no_distill else DEMO_DISTILL if distill_tokens is None else DistillStage(None, {**DEMO_DISTILL.options, "tokens": distill_tokens})
    _finish(run_demo(kv_heads, method, distill=distill, thresholds=thresholds if thresholds.file else replace(thresholds, file=demo_budget())))


def os_error_line(err: OSError) -> str:
    """One line naming the path and the fix for an OS error (errno decides the fix)."""
    path = " → ".join(str(p) for p in (err.filename, err.filename2) if p is not None) or "a file"
    fixes = {
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
    click.secho(f"headfold: error: {' '.join(message.splitlines())}", fg="red", err=True)  # one line, whatever the message
    return code


def main(argv: list[str] | None = None) -> int:
    """Console entry point: every failure becomes one line on stderr and an exit code (EXIT_CODES)."""
    global _debug
    _debug = False
    try:
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
    except Exception as e:  # anything else is a bug in headfold
        first_line = next(iter(str(e).strip().splitlines()), "")
        return _fail(f"internal error ({type(e).__name__}: {first_line}); this is a bug: rerun with --debug for the traceback", 3)
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
