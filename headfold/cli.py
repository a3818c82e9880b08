"""The `headfold` command line (contract in DESIGN.md): exit 0 ok, 1 a check failed, 2 bad input, 3 a bug."""

from __future__ import annotations

import errno
import logging
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import click

from headfold.ground.errors import HeadfoldError

EXIT_CODES = "Exit codes: 0 ok, 1 a check or gate failed, 2 bad input or environment (one line, nothing written), 3 internal error (a bug; --debug shows the traceback)."
_debug = False  # set by the group's --debug, read by main() once the command has failed


class KvHeads(click.ParamType):
    """One K/V head count for every layer ("4"), or one per layer ("8,4,4,2")."""

    name = "N[,N...]"

    def convert(self, value, param, ctx):
        from headfold.converter.per_layer import parse_kv_heads

        # BadInput passes through: main() prints it as one line and exits 2, like a bad list length
        return parse_kv_heads(value) if isinstance(value, str) else value


KV_HEADS_HELP = "one value for every layer, or one per layer comma-separated (8,4,4,2); each must divide the attention heads"


def _kv_text(kv_heads: int | tuple[int, ...]) -> str:
    return str(kv_heads) if isinstance(kv_heads, int) else ",".join(map(str, kv_heads))


class Command(click.Command):
    """A command whose OS errors without a file name (a full disk during a write) name its output."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OSError as err:
            if err.filename is None:
                err.filename = next((str(ctx.params[k]) for k in ("out", "out_dir", "json_path") if ctx.params.get(k)), None)
            raise


class Group(click.Group):
    command_class = Command


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    global _debug
    _debug = value


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"], "show_default": True}, epilog=EXIT_CODES)
@click.version_option(package_name="headfold")
@click.option("--debug", is_flag=True, expose_value=False, is_eager=True, callback=_set_debug, help="Show the traceback of any failure.")
def cli() -> None:
    """Convert MHA transformers to GQA/MQA, export, build engines, verify."""


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--kv-heads", type=KvHeads(), required=True, help=f"K/V heads after conversion: {KV_HEADS_HELP} (1 = MQA, all heads = unchanged).")
@click.option(
    "--method", default="mean", metavar="METHOD",
    help="How the K/V heads of a group become one. mean: average them (Ainslie et al. 2023); first: keep the first; "
    "or combine with '+': grouped (pick groups by activation similarity), aligned (rotate heads to a common basis "
    "first, function-preserving), refit (least-squares fit of W_Q/W_O to the pooled K/V). Best: aligned+grouped+refit.",
)  # fmt: skip
@click.option("--calibration", default=None, metavar="TEXT_FILE", help="Text for the data-aware methods (default: built-in offline text); 'weights' uses the weights alone.")
@click.option("--calibration-tokens", type=int, default=4096, help="Tokens of calibration text to run through the source model.")
@click.option("--seed", type=int, default=0, help="Seed for picking calibration windows.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists (atomically, only after the conversion succeeded).")
@click.option("--shard-size", default=None, metavar="SIZE", help="Largest output shard, e.g. 2GB or 500MiB. Default: like the source (one file stays one file).")
@click.option("--allow-pickle", is_flag=True, help="Accept pytorch_model.bin pickles (loaded with weights_only=True). Off by default: pickles can run code.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def convert(src: Path, out: Path, kv_heads: int | tuple[int, ...], method: str, quiet: bool, shard_size: str | None, **options) -> None:
    """Convert the Hugging Face checkpoint folder SRC to a GQA/MQA checkpoint in OUT.

    Reads config.json and model.safetensors (or sharded safetensors with their index),
    pools the K/V projection heads of each group of query heads, and writes weights in the
    source dtype, the updated config.json, every tokenizer/other file and a headfold.json
    manifest. OUT appears only when complete; SRC is never modified.

    SRC may also be an MHA model.onnx (methods mean/first): its K/V projection
    initializers are pooled and the graph rewritten to GQA Attention nodes, into OUT.onnx.
    """
    if quiet:
        _quiet_libraries()
    if src.suffix == ".onnx":
        from headfold.graphs.onnx_convert import convert_onnx

        summary = convert_onnx(src, out, kv_heads, method, overwrite=options["overwrite"])
        click.echo(f"wrote {out} ({summary['attention_nodes']} Attention nodes, {_kv_text(kv_heads)} kv heads, method {method})")
        return
    from headfold import corpus
    from headfold.converter import convert as run_convert

    result = run_convert(src, out, kv_heads, method, max_shard_size=shard_size, progress=not quiet, builtin_text=corpus.calibration_text(), **options)
    click.echo(f"wrote {result} ({_kv_text(kv_heads)} kv heads, method {method})")


@cli.command("export")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--opset", type=int, default=23, help="ONNX opset: 23, 24 or 25 (Attention exists from 23; torch writes invalid models above 25).")
@click.option("--dtype", type=click.Choice(("fp32", "fp16", "bf16")), default="fp32", help="Weight dtype; normalisations stay fp32 inside.")
@click.option("--attention", type=click.Choice(("onnx", "ort-gqa")), default="onnx", help="Fused node: onnx = standard Attention (ORT, TensorRT); ort-gqa = com.microsoft.GroupQueryAttention for ONNX Runtime CUDA decoding (decoders only; unpadded or right-padded batches; CUDA runs it in fp16/bf16).")
@click.option("--overwrite", is_flag=True, help="Replace OUT_DIR if it exists (atomically).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--graphs", type=click.Choice(("merged", "split")), default=None, help="Decoders: merged = one model.onnx for prompt and decode steps + genai_config.json (onnxruntime-genai); split = prefill.onnx + decode.onnx (TensorRT profiles). [default: merged; split with --trt-version, the pair `headfold build` takes]")
@click.option("--optimize", type=click.Choice(("ort",)), default=None, help="ort = ONNX Runtime's fusions (onnxscript ort_fusions: simplified/skip layer norm, fused matmuls), counted in export.json; the graph then runs in ONNX Runtime only.")
@click.option("--trt-version", default=None, metavar="MAJOR.MINOR", help="Target this TensorRT version: decompose the ops its ONNX parser lacks (RMSNormalization, RotaryEmbedding before 10.15) into primitives, then print which exported graphs it takes (a lint on CPU; rule sets 10.13, 10.14, 10.15, 11.0).")
def export_cmd(src: Path, out_dir: Path, opset: int, dtype: str, attention: str, graphs: str | None, optimize: str | None, overwrite: bool, quiet: bool, trt_version: str | None) -> None:
    """Export the checkpoint folder SRC to ONNX with one GQA Attention node per layer.

    Decoders get one merged model.onnx (any number of new tokens after a past of any length, KV
    cache at kv-heads) with genai_config.json and the tokenizer files: an onnxruntime-genai model
    folder; --graphs split gives prefill.onnx + decode.onnx instead. Encoders get model.onnx.
    Weights go to .onnx.data. Exits 1 when an attention layer did not fuse.
    """
    from headfold.graphs.export import export

    if quiet:
        _quiet_libraries()
    graphs = graphs or ("split" if trt_version else "merged")  # a TensorRT target gets the graphs TensorRT builds
    summary = export(
        src, out_dir, opset=opset, dtype=dtype, attention=attention, overwrite=overwrite, progress=not quiet,
        trt_version=trt_version, graphs=graphs, optimize=optimize,
    )  # fmt: skip
    for name, graph in summary["graphs"].items():
        decomposed = {op: n for op, n in graph.get("decomposed_for_tensorrt", {}).items() if op != "version"}
        note = f"; decomposed for TensorRT {trt_version}: {', '.join(f'{n} {op}' for op, n in decomposed.items())}" if decomposed else ""
        click.echo(f"wrote {out_dir / name}: {graph['attention_nodes']} Attention nodes, kv-heads {graph['attention_kv_heads']}{note}")
    if trt_version:
        from headfold.graphs.trt_lint import export_table

        click.echo(export_table(out_dir, trt_version))


@cli.command("build")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--precision", type=click.Choice(("fp32", "fp16", "bf16")), default=None, help="Engine precision. Default: the graph's own. TensorRT 11 takes only that (re-export with --dtype); 10.x builds an fp32 graph in fp16/bf16 with builder flags.")
@click.option("--batch", default=None, metavar="MIN:OPT:MAX", help="Batch sizes of the optimization profile, e.g. 1:4:8 (one number: fixed). [default: 1:4:8]")
@click.option("--seq", default=None, metavar="MIN:OPT:MAX", help="Sequence lengths (prefill / encoder graphs). [default: 1:limit/2:limit, limit = the model's max positions]")
@click.option("--past", default=None, metavar="MIN:OPT:MAX", help="KV-cache lengths (decode graph). [default: 0:limit/2:limit-1]")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None, help="Tactic timing cache: loaded when present, updated after the build.")
@click.option("--workspace", default=None, metavar="SIZE", help="Builder workspace limit, e.g. 4GiB. [default: TensorRT's]")
@click.option("--trt-version", default=None, metavar="MAJOR.MINOR", help="Plan for this TensorRT release instead of the installed one (with --dry-run).")
@click.option("--dry-run", is_flag=True, help="Print the build plan (graphs, precision, profiles, plugins, lint) and build nothing; needs no TensorRT.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print the plan as JSON.")
@click.option("--require-fused-attention", is_flag=True, help="Exit 1 (and write nothing) when an engine's attention is not one fused kernel.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists (atomically, after the build succeeded).")
def build_cmd(src: Path, out: Path, precision, batch, seq, past, timing_cache, workspace, trt_version, dry_run: bool, as_json: bool, require_fused_attention: bool, overwrite: bool) -> None:
    """Build TensorRT engines from SRC (a .onnx or an export folder) into OUT.

    A .onnx gives one engine: OUT must end with .engine, its sidecar is OUT.json. An export
    folder gives a folder OUT with one engine per graph (prefill.engine + decode.engine, or
    model.engine), each with its .engine.json sidecar (TensorRT, GPU, profiles, precision, source
    sha256, fused-attention verdict). Exit 2 when the TensorRT-compatibility lint says the parser
    would reject a graph, 1 when --require-fused-attention fails.
    """
    from headfold.engines.env import target_for
    from headfold.engines.plan import make_plan

    target = target_for(trt_version, dry_run=dry_run)
    plan = make_plan(src, out, target, precision=precision, batch=batch, seq=seq, past=past, workspace=workspace, timing_cache=timing_cache)
    if dry_run:
        click.echo(plan.to_json() if as_json else plan.describe(), nl=not as_json)
        plan.check()
        return
    from headfold.engines.build import build

    build(plan, overwrite=overwrite, require_fused_attention=require_fused_attention, log=click.echo)
    click.echo(f"wrote {out}: {', '.join(g.engine.name for g in plan.graphs)} with .engine.json sidecars")


class Fraction(click.ParamType):
    """0.05 or 5%."""

    name = "FRACTION"

    def convert(self, value, param, ctx):
        from headfold.verification.budget import parse_fraction

        try:
            return parse_fraction(value, f"--{param.name.replace('_', '-')}") if isinstance(value, str) else value
        except HeadfoldError as err:
            self.fail(str(err), param, ctx)


def _options(*options: Callable) -> Callable:
    """Apply a group of click options as one decorator (shared by verify, run and demo)."""

    def apply(f: Callable) -> Callable:
        for option in reversed(options):
            f = option(f)
        return f

    return apply


input_options = _options(
    click.option("--text", type=click.Path(path_type=Path), default=None, help="UTF-8 text to feed both sides. Default: the built-in held-out text."),
    click.option("--window", type=int, default=256, help="Longest row in tokens; rows are cut at seeded lengths between half and this."),
    click.option("--max-rows", type=int, default=128, help="Use a seeded subset of this many rows when the text has more (0 = all)."),
    click.option("--batch-size", type=int, default=8, help="Rows per padded batch."),
    click.option("--seed", type=int, default=0, help="Seed for row lengths and the row subset."),
    click.option("--decode-steps", type=int, default=16, help="Decoder exports: the last N tokens of each row go one by one through the KV cache (model.onnx fed its own present K/V, or decode.onnx), gated like the prefill (0 = skip)."),
)
threshold_options = _options(
    click.option("--budget", "budget_file", type=click.Path(path_type=Path), default=None, help="TOML/YAML/JSON file with [fidelity] and [loss] budgets (options below override it)."),
    click.option("--max-ppl-increase", type=Fraction(), default=None, help="Loss: largest relative perplexity increase, e.g. 5% or 0.05. [default: 5%]"),
    click.option("--max-kl", type=Fraction(), default=None, help="Loss: largest mean per-token KL(original || converted), nats. [default: 0.05]"),
    click.option("--min-top1", type=Fraction(), default=None, help="Smallest top-1 agreement (loss check; in verify, whichever check runs). [default: loss 90%, fidelity fp32 99.9%]"),
    click.option("--min-cosine", type=Fraction(), default=None, help="Smallest cosine (loss: encoder embeddings; in verify, whichever check runs). [default: loss 0.99, fidelity fp32 0.99999]"),
    click.option("--atol", type=Fraction(), default=None, help="Fidelity: an element fails when it exceeds both atol and rtol. [default fp32: 1e-4, fp16: 1e-2]"),
    click.option("--rtol", type=Fraction(), default=None, help="Fidelity: relative tolerance. [default fp32: 1e-3, fp16: 1e-2]"),
)
report_options = _options(
    click.option("--report", "json_path", type=click.Path(path_type=Path), default=None, help="Write every metric, budget, verdict, version and input hash as JSON."),
    click.option("--markdown", "markdown_path", type=click.Path(path_type=Path), default=None, help="Write the tables as Markdown (for a PR comment)."),
    click.option("--junit", "junit_path", type=click.Path(path_type=Path), default=None, help="Write JUnit XML: one testcase per check."),
)


def _input_spec(text: Path | None, window: int, max_rows: int, batch_size: int, seed: int, decode_steps: int, token_ids: Path | None = None):
    from headfold.verification.inputs import InputSpec

    return InputSpec(text, window, max_rows or None, batch_size, seed, decode_steps, token_ids)


def _thresholds(budget_file: Path | None, **values: float | None):
    from headfold.verification.budget import Thresholds

    return Thresholds(budget_file, **values)


def _finish(report) -> None:
    """Print the table (click drops the colours when not a terminal), then exit 1 on a failed budget."""
    click.echo(report.table())
    report.raise_for_failures()
    click.secho("all checks passed", fg="green")


def _quiet_libraries() -> None:
    """Only errors from the libraries: no progress bars, no warnings (also the exporter's)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per runner otherwise
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")  # torch.onnx's "torchvision is not installed" and friends
    for name in ("torch.onnx", "onnxscript", "torch._dynamo", "torch.export"):
        logging.getLogger(name).setLevel(logging.ERROR)


@cli.command("verify")
@click.argument("reference", type=click.Path(path_type=Path))
@click.argument("candidate", type=click.Path(path_type=Path))
@click.option("--check", type=click.Choice(("auto", "fidelity", "loss")), default="auto", help="auto: same model on both sides → fidelity; CANDIDATE converted from REFERENCE → loss.")
@click.option("--token-ids", type=click.Path(path_type=Path), default=None, metavar="FILE", help="Feed these token ids instead of a text: one row per line, whitespace-separated ids. Without it, a model with no tokenizer files gets seeded random ids (fidelity only).")
@input_options
@threshold_options
@report_options
def verify_cmd(reference: Path, candidate: Path, check: str, token_ids, text, window, max_rows, batch_size, seed, decode_steps, budget_file, json_path, markdown_path, junit_path, **thresholds) -> None:
    """Compare CANDIDATE with REFERENCE on the same text; exit 1 when a budget is exceeded.

    Each side is a checkpoint folder (run in torch), an export folder or a .onnx file (run in
    ONNX Runtime). Fidelity: the same model on two backends (abs/rel error, cosine, top-1); a
    decoder export also runs its KV-cache path (prefill, then --decode-steps steps through
    the same model.onnx, or decode.onnx of a split export) as the check fidelity-decode. Conversion loss: original vs converted (perplexity increase, KL, top-1; encoders: cosine).
    """
    from headfold.verification.api import verify

    _quiet_libraries()
    report = verify(reference, candidate, inputs=_input_spec(text, window, max_rows, batch_size, seed, decode_steps, token_ids), thresholds=_thresholds(budget_file, **thresholds), check=check)
    report.write(json_path, markdown_path, junit_path)
    _finish(report)


distill_stage_options = _options(
    click.option("--distill-data", type=click.Path(path_type=Path), default=None, help="Add the distill stage between convert and export, trained on this text (formats as for `headfold distill --data`)."),
    click.option("--distill-tokens", type=int, default=None, help="Tokens the distill stage trains on. [default: 40 steps of 16 × 256] Alone, for the embedded model: its own training split."),
)


def _distill_stage(data: Path | None, tokens: int | None):
    """The distill stage `run` adds when asked for (None: convert → export directly)."""
    if data is None and tokens is None:
        return None
    from headfold.distillation.stage import DistillStage

    return DistillStage(data, {} if tokens is None else {"tokens": tokens})


@cli.command("run")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--kv-heads", type=KvHeads(), required=True, help=f"K/V heads after conversion: {KV_HEADS_HELP} (1 = MQA).")
@click.option("--method", default="mean", metavar="METHOD", help="How the K/V heads of a group become one, as for `headfold convert --method`.")
@click.option("--opset", type=int, default=23, help="ONNX opset: 23, 24 or 25.")
@click.option("--dtype", type=click.Choice(("fp32", "fp16", "bf16")), default="fp32", help="Export precision; picks the fidelity defaults.")
@click.option("--overwrite", is_flag=True, help="Also accept an OUT_DIR holding other files (they stay: run replaces only the stage folders its stages.json records).")
@input_options
@threshold_options
@distill_stage_options
def run_cmd(src: Path, out_dir: Path, kv_heads: int | tuple[int, ...], method: str, opset: int, dtype: str, overwrite: bool, text, window, max_rows, batch_size, seed, decode_steps, budget_file, **thresholds) -> None:
    """Convert → export → build → verify SRC into OUT_DIR/{convert,export,build,verify}.

    Stages whose inputs (content hashes and options, in OUT_DIR/stages.json) are unchanged and
    whose folders still hash to what stages.json recorded are skipped. OUT_DIR must be new, empty
    or a run folder unless --overwrite. Engines are built only where TensorRT and a GPU are
    present. The reports land in OUT_DIR/verify (report.json, report.md, junit.xml); exit 1 when
    a budget is exceeded.
    """
    from headfold.pipeline import run

    _quiet_libraries()
    distill = _distill_stage(thresholds.pop("distill_data"), thresholds.pop("distill_tokens"))
    report = run(src, out_dir, kv_heads, method=method, opset=opset, dtype=dtype, overwrite=overwrite, distill=distill, inputs=_input_spec(text, window, max_rows, batch_size, seed, decode_steps), thresholds=_thresholds(budget_file, **thresholds), log=click.echo)
    _finish(report)


@cli.command("distill")
@click.argument("teacher", type=click.Path(path_type=Path))
@click.argument("student", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--data", type=click.Path(path_type=Path), default=None, help="Training text: a text file, .jsonl/.parquet with a 'text' field, or a datasets save_to_disk folder. Default only for the embedded model: its training split.")
@click.option("--eval-data", type=click.Path(path_type=Path), default=None, help="Held-out text (same formats). Default: the first --eval-windows windows of --data, never trained on.")
@click.option("--tokens", type=int, default=None, help="Training tokens (over all processes); rounded down to whole steps. [default: 40 steps]")
@click.option("--steps", type=int, default=None, help="Optimizer steps, instead of --tokens.")
@click.option("--seq-len", type=int, default=256, help="Tokens per training window.")
@click.option("--batch-size", type=int, default=16, help="Windows per step and process.")
@click.option("--lr", type=float, default=1e-3, help="Peak learning rate (AdamW; linear warmup over 10 % of the steps, then cosine to 0).")
@click.option("--train", type=click.Choice(("kv", "attention", "all", "lora")), default="all", help="What trains: kv = K/V projections, attention = Q/K/V/O, all, lora = PEFT adapters on Q/K/V/O merged at the end.")
@click.option("--loss", type=click.Choice(("kl", "kl+ce")), default="kl", help="Decoders: KL(teacher || student) of the logits, optionally + next-token cross-entropy. Encoders always: hidden-state MSE + (1 - embedding cosine).")
@click.option("--temperature", type=float, default=1.0, help="Softmax temperature of the KL (loss scaled by T²).")
@click.option("--eval-every", type=int, default=None, help="Evaluate on the held-out windows every N steps. [default: 8 evaluations per run]")
@click.option("--eval-windows", type=int, default=32, help="Held-out windows of --seq-len tokens.")
@click.option("--until-kl", type=float, default=None, help="Stop once the held-out KL is at most this (checked at each evaluation).")
@click.option("--until-ppl-increase", type=Fraction(), default=None, help="Stop once the held-out perplexity is within this of the teacher's, e.g. 2%.")
@click.option("--save-every", type=int, default=None, help="Write a resumable checkpoint every N steps into .OUT.distill-state beside OUT.")
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint in .OUT.distill-state (same inputs and options).")
@click.option("--gradient-checkpointing", is_flag=True, help="Recompute layer activations in the backward pass: less memory, ~30 % slower.")
@click.option("--seed", type=int, default=0, help="Seed of the window shuffle (and LoRA's initialisation).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists (atomically, after the run succeeded).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def distill_cmd(teacher: Path, student: Path, out: Path, quiet: bool, **options) -> None:
    """Distill STUDENT (a headfold conversion of TEACHER) from TEACHER into OUT.

    The teacher (the MHA original) is frozen; the student learns to match its next-token
    distributions (decoders) or hidden states (encoders) on --data. OUT is a checkpoint like
    `convert` writes (same files, config and kv heads; trained tensors in the source dtype) with a
    chained headfold.json, distill-log.json and distill-curve.png. Runs data-parallel under
    `accelerate launch` or `torchrun` (only the main process writes).
    """
    import json

    from headfold.distillation import distill
    from headfold.ground.artifacts import MANIFEST

    _quiet_libraries()
    result = distill(teacher, student, out, progress=not quiet, log=click.echo, **options)
    final = json.loads((result / MANIFEST).read_text())["distillation"]
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
@click.argument("src", type=click.Path(path_type=Path))
@click.option("--candidates", default=None, metavar="K,K,...", help="kv-head counts to predict the loss of, e.g. 4,2,1. [default: every divisor of the kv heads below them]")
@click.option("--method", default="aligned+grouped+refit", metavar="METHOD", help="Conversion method to predict for, as for `headfold convert --method`.")
@click.option("--calibration", default=None, metavar="TEXT_FILE", help="Text to fit the method on and measure the loss on (other windows of it) (default: built-in offline text); 'weights' fits on the weights alone.")
@click.option("--calibration-tokens", type=int, default=4096, help="Tokens to fit on; as many other tokens measure the loss.")
@click.option("--seed", type=int, default=0, help="Seed for picking the fit and evaluation windows.")
@click.option("--kv-budget", type=KvBudget(), default=None, help="Propose per-layer kv heads for this KV cache: 0.25 (or 25%) of the source's, or a total of kv heads summed over layers.")
@click.option("--heatmap", type=click.Path(path_type=Path), default=None, metavar="OUT.png", help="Write a PNG: layers × heads similarity, layers × candidates predicted loss.")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, metavar="OUT.json", help="Write every number as JSON.")
@click.option("--overwrite", is_flag=True, help="Replace existing --heatmap / --json files.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def inspect_cmd(src: Path, quiet: bool, **options) -> None:
    """Per layer of SRC: K/V head similarity and the predicted loss of each kv-head count.

    The predicted loss of a (layer, kv heads) pair is the calibration loss with only that layer
    converted: KL(original ‖ converted) per token for decoders, 1 − cosine of the mean-pooled
    embedding for encoders. With --kv-budget, prints the per-layer `--kv-heads` list with the least
    summed predicted loss that fits (exact knapsack), next to the best uniform choice.
    """
    import time

    from headfold.inspection import inspect_checkpoint

    _quiet_libraries()
    start = time.perf_counter()
    report = inspect_checkpoint(src, progress=not quiet, **options)
    click.echo(report.table())
    for option, path in (("heatmap", options["heatmap"]), ("JSON", options["json_path"])):
        if path is not None:
            click.echo(f"wrote {option} {path}")
    click.echo(f"done in {time.perf_counter() - start:.1f} s")


@cli.command()
@click.option("--kv-heads", type=KvHeads(), default="4", help="K/V heads to convert the embedded 8-head, 4-layer model to: one value (1 = MQA) or one per layer (4,2,1,1).")
@click.option("--method", default="aligned+grouped+refit", metavar="METHOD", help="How the K/V heads of a group become one, as for `headfold convert --method`.")
@click.option("--distill-tokens", type=int, default=None, help="Tokens to distill on. [default: 24 steps of 8 × 256, the reference budget's recipe]")
@click.option("--no-distill", is_flag=True, help="Skip distillation: what training-free conversion alone reaches (the reference budget then fails).")
@threshold_options
def demo(kv_heads: int | tuple[int, ...], method: str, distill_tokens: int | None, no_distill: bool, budget_file, **thresholds) -> None:
    """`headfold run` on the embedded trained model (Llama layout, 8 heads) in a temporary folder.

    Converts, distills on the model's own training split, exports, (builds where TensorRT is
    present) and verifies on Python documentation text the model never saw in training, then
    prints the report table. Without --budget the
    gates are the embedded model's reference budget (headfold/data/default_model/demo-budget.toml).
    """
    from headfold.demo import DEMO_DISTILL, demo_budget
    from headfold.demo import demo as run_demo
    from headfold.distillation.stage import DistillStage

    _quiet_libraries()
    distill = None if no_distill else DEMO_DISTILL if distill_tokens is None else DistillStage(None, {**DEMO_DISTILL.options, "steps": None, "tokens": distill_tokens})
    _finish(run_demo(kv_heads, method, log=click.echo, distill=distill, thresholds=_thresholds(budget_file or demo_budget(), **thresholds)))


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
