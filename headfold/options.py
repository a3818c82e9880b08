"""The command line's option groups, each declared once, and the logging the CLI configures.

A group (conversion, calibration, input spec, thresholds, export, TensorRT, output) is a
decorator that adds its options under its own help heading and hands the command one object
built from them (an InputSpec, a Thresholds, ...), so a command takes what it works with,
not fifteen loose values. Every flag is spelled here once, with one meaning and one help text.
Nothing heavy is imported at module level: `headfold --help` must start without torch.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from headfold.converter.per_layer import parse_kv_heads
from headfold.converter.recipes import DEFAULT_LOCAL_STEPS, DEFAULT_METHOD
from headfold.converter.seq2seq import DEFAULT_POOL, POOL_CHOICES
from headfold.ground.artifacts import CREATED_BY, created_by
from headfold.ground.atomic import atomic_output, check_outputs
from headfold.ground.errors import BadInput, BadOption, HeadfoldError
from headfold.ground.inputs import printable
from headfold.ground.precision import Precision
from headfold.ground.settings import LOSSES, OPSETS, TRAIN_MODES, Calibration, DistillOptions, ExportOptions, InputSpec, Profile
from headfold.ground.units import parse_fraction, whole_number

log = logging.getLogger(__name__)
OPTIONS = "Options"  # the heading of a command's own options, listed first
CONVERSION, EXPORT = "Conversion options", "Export options"
PATH = click.Path(path_type=Path)
CHECKPOINT = click.Path()  # a str as typed: converter/sources.py reads "./x" and "x/" as paths, "ORG/NAME" as a hub id


class Option(click.Option):
    """A click option that knows its help heading."""

    def __init__(self, *args: Any, section: str = OPTIONS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


class Command(click.Command):
    """Help in headed sections; OS errors without a file name (a full disk) name the output."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {OPTIONS: []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx) if isinstance(param, click.Option) else None
            if record is not None:
                sections.setdefault(getattr(param, "section", OPTIONS), []).append(record)
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OSError as err:
            if err.filename is None:
                err.filename = next((str(ctx.params[k]) for k in ("out", "out_dir", "json_path") if ctx.params.get(k)), None)
            raise


class Group(click.Group):
    command_class = Command


# -- option specs: (declarations, click keywords), each flag once -------------------------------

Spec = tuple[tuple[str, ...], dict[str, Any]]


def spec(*decls: str, **kwargs: Any) -> Spec:
    return decls, kwargs


class KvHeads(click.ParamType):
    """One K/V head count for every layer ("4"), or one per layer ("8,4,4,2")."""

    name = "N[,N...]"

    def convert(self, value, param, ctx):
        # BadInput passes through: main() prints it as one line and exits 2, like a bad list length
        return parse_kv_heads(value) if isinstance(value, str) else value


class _AsciiDigits(click.ParamType):
    """An integer option written in the digits 0-9 (click's int() would also take '5_0', '+9' and '٥٠')."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and whole_number(value) is None:
            self.fail(f"{value!r} is not a whole number; write it in the digits 0-9", param, ctx)
        return super().convert(value, param, ctx)


class Whole(_AsciiDigits, click.types.IntParamType):
    """An integer in ASCII digits."""


class WholeRange(_AsciiDigits, click.IntRange):
    """An integer in ASCII digits within a range."""


WHOLE = Whole()


class Fraction(click.ParamType):
    """0.05 or 5% (finite, not negative)."""

    name = "FRACTION"

    def convert(self, value, param, ctx):
        try:
            return parse_fraction(value, param.opts[0] if param else "value") if isinstance(value, str) else value
        except HeadfoldError as err:
            self.fail(str(err), param, ctx)


class Nats(Fraction):
    """A KL divergence in nats: a finite, non-negative number (no percent sign)."""

    name = "NATS"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().endswith("%"):
            self.fail(f"{value!r}: a KL divergence is in nats, not a percentage; write e.g. 0.05", param, ctx)
        return super().convert(value, param, ctx)


class Finite(click.ParamType):
    """A finite float: inf and nan would train or gate on nothing."""

    name = "FLOAT"

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


FINITE = Finite()


class PrecisionChoice(click.Choice):
    """A precision by its name (fp16), handed to the command as a Precision: parsed here, once."""

    def __init__(self, choices: Iterable[Precision] = tuple(Precision)) -> None:
        super().__init__([p.value for p in choices])  # click would list an Enum's member names (FP16)

    def convert(self, value, param, ctx):
        return value if isinstance(value, Precision) else Precision(super().convert(value, param, ctx))


KV_HEADS_HELP = "one value for every layer, or one per layer comma-separated (8,4,4,2); each must divide the attention heads"
METHOD_HELP = (
    "How the K/V heads of a group become one. mean: average them (Ainslie et al. 2023); first: keep the first; "
    "or combine with '+': aligned (rotate heads to a common basis first, function-preserving), grouped (pick groups "
    "by activation similarity), scored (pick groups by the loss they predict), refit (least-squares fit of W_Q/W_O to the pooled K/V), "
    "local (fit each layer's attention output by gradient descent). The default ranks best over the quality zoo "
    "(docs/methods.md); without calibration text it leaves local out, and an ONNX source pools with mean."
)


def kv_heads_spec(default: str | None = None) -> Spec:
    help = f"K/V heads after conversion: {KV_HEADS_HELP} (1 = MQA, all heads = unchanged)."
    return spec("--kv-heads", type=KvHeads(), required=default is None, default=default, help=help)


def method_spec() -> Spec:
    return spec("--method", default=DEFAULT_METHOD, metavar="METHOD", help=METHOD_HELP)


def batch_size_spec(default: int | None) -> Spec:
    return spec(
        "--batch-size",
        type=WHOLE,
        default=default,
        help="Rows per batch: padded evaluation rows (verify, run); training windows per step and process (distill: 8, or fewer, down to 1, where "
        "--tokens would give under 640 steps).",
    )


SEED = spec(
    "--seed",
    type=WholeRange(0, 2**32 - 1),
    default=Calibration.seed,
    help="Seed of the command's random choices: calibration windows (convert, inspect), evaluation rows (verify, run), the training shuffle (distill).",
)
OVERWRITE = spec(
    "--overwrite",
    is_flag=True,
    help="Replace outputs that exist, when headfold wrote them (never a file or folder of yours, never an input): atomically, once the command "
    "succeeded (run: other files in OUT_DIR stay).",
)
QUIET = spec("--quiet", "-q", is_flag=True, help="Only results, warnings and errors: no progress bars or progress lines (the same as `headfold -q`).")
VERBOSE = spec("--verbose", "-v", is_flag=True, help="Also debug lines and the libraries' own warnings, on stderr (the same as `headfold -v`).")
JSON_HELP = "Write the result as JSON to FILE (atomically); without FILE, or with '-', print it to stdout instead of the table, and nothing else."
JSON = spec("--json", "json_path", type=PATH, is_flag=False, flag_value=Path("-"), default=None, metavar="[FILE]", help=JSON_HELP)
REVISION = spec(
    "--revision",
    default=None,
    metavar="REV",
    help="Branch, tag or commit of the hub ids (ORG/NAME) given as checkpoints; they are read from the Hugging Face cache (HF_HOME), fetched when online.",
)
TRT_VERSION = spec(
    "--trt-version",
    default=None,
    metavar="MAJOR.MINOR",
    help="The TensorRT release to target instead of the installed one (rule sets 10.13, 10.14, 10.15, 11.0).",
)
OPSET = spec(
    "--opset",
    type=WHOLE,
    default=ExportOptions.opset,
    help=f"ONNX opset: {', '.join(map(str, OPSETS))} (Attention exists from {OPSETS[0]}; torch writes invalid models above {OPSETS[-1]}).",
)
DTYPE = spec(
    "--dtype",
    type=PrecisionChoice(),
    default=None,
    help="Exported weight dtype (normalisations stay fp32 inside); picks verify's defaults. int4 (export, decoders): MatMul weights in 4 bits by "
    "ONNX Runtime's MatMulNBits quantizer, everything else fp32; verify then gates its loss. [default: the checkpoint's own; run: fp32 for a "
    "bf16 checkpoint, which its CPU verify cannot run]",
)


# -- groups: options under one heading that become one argument --------------------------------


@dataclass(frozen=True)
class OptionGroup:
    """Options under the help heading `title`; `build(**values)` becomes the command's argument
    `into` (without `build` the values pass through as they are).

    Two groups of one command may share an option (one `--seed` for calibration and evaluation in
    `run`): it is declared once and each group reads it. With `prefix="distill"` every flag is
    spelled `--distill-…`: another command's options, in a command that runs its stage (run)."""

    title: str
    specs: tuple[Spec, ...]
    into: str | None = None
    build: Callable[..., Any] | None = None
    prefix: str = ""

    def __call__(self, f: Callable) -> Callable:
        declared = {p.name for p in getattr(f, "__click_params__", [])}  # by groups applied before (inner)
        params = [Option(decls, section=self.title, **kwargs) for decls, kwargs in self._specs()]
        names = {p.name: p.name.removeprefix(f"{self.prefix}_" if self.prefix else "") for p in params}  # param → field

        @functools.wraps(f)
        def command(*args: Any, **values: Any) -> Any:
            if self.build is not None:  # an option an inner group declared too stays for that group
                assert self.into is not None  # a group that builds names where its value goes
                given = {field: values[name] if name in declared else values.pop(name) for name, field in names.items()}
                try:
                    values[self.into] = self.build(**given)
                except BadOption as err:  # named as this command spells it: --distill-seq-len
                    raise err.respelled(self.prefix) if self.prefix else err from None
                log.debug(f"{self.into}: {values[self.into]!r}")  # -v shows what the options became
            return f(*args, **values)

        fresh = [p for p in params if p.name not in declared]
        setattr(command, "__click_params__", [*getattr(f, "__click_params__", []), *reversed(fresh)])  # noqa: B010 (click's attribute; lists them reversed)
        return command

    def _specs(self) -> tuple[Spec, ...]:
        """The specs, with --flag → --PREFIX-flag and a named destination → PREFIX_name (short flags dropped)."""
        if not self.prefix:
            return self.specs
        renamed = []
        for decls, kwargs in self.specs:
            flag = next(d for d in decls if d.startswith("--"))
            dest = [f"{self.prefix}_{d}" for d in decls if not d.startswith("-")]
            renamed.append(((f"--{self.prefix}-{flag[2:]}", *dest), kwargs))
        return tuple(renamed)


def options(*specs: Spec, title: str = OPTIONS) -> OptionGroup:
    """Plain options (the command's own, or a heading without an object)."""
    return OptionGroup(title, specs)


def stacked(*groups: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """Several groups as one decorator, applied in the order listed (the first one's options first)."""

    def apply(f: Callable) -> Callable:
        for group in reversed(groups):
            f = group(f)
        return f

    return apply


# Output: the same options on every command
@dataclass(frozen=True)
class Output:
    """-q, -v, --json and --overwrite as one command took them."""

    overwrite: bool = False
    quiet: bool = False
    verbose: bool = False
    json_path: Path | None = None  # None: print the table; "-": the JSON on stdout instead; else a file

    @property
    def progress(self) -> bool:
        return not self.quiet

    @property
    def json_to_stdout(self) -> bool:
        return self.json_path is not None and str(self.json_path) == "-"

    def check(self, sources: Iterable[Path] = (), writes: Iterable[Path] = ()) -> None:
        """Refuse a --json FILE the policy would refuse (a link, an input, one of yours, the command's
        own outputs `writes` or a path inside one), before the work."""
        if self.json_path is not None and not self.json_to_stdout:
            check_outputs([(self.json_path, False)], overwrite=self.overwrite, sources=sources, beside=writes)

    def emit(self, table: str, result: dict[str, Any] | str, sources: Iterable[Path] = (), *, written: bool = False) -> None:
        """The result: the table, or with --json - the JSON alone, or with --json FILE both (the file
        written atomically, marked as headfold's, never over one of `sources`; `written`: the stage
        wrote it already). Strings from files are printed with their control characters escaped."""
        text = result if isinstance(result, str) else json.dumps({CREATED_BY: created_by(), **result}, indent=2, default=str) + "\n"
        if self.json_to_stdout:
            click.echo(text.replace("\x7f", "\\u007f"), nl=not text.endswith("\n"))  # json.dumps escapes every control but DEL
            return
        if self.json_path is not None and not written:
            with atomic_output(self.json_path, is_dir=False, overwrite=self.overwrite, sources=sources) as tmp:
                tmp.write_text(text)
        click.echo(printable(table, lines=True, styles=True))
        if self.json_path is not None:
            click.echo(printable(f"wrote JSON {self.json_path}"))

    def say(self, line: str) -> None:
        """A line beside the result: on stdout, or on stderr when stdout carries the JSON alone."""
        click.echo(printable(line, styles=True), err=self.json_to_stdout)


def _output(quiet: bool = False, verbose: bool = False, overwrite: bool = False, json_path: Path | None = None) -> Output:
    level = verbosity() + int(verbose) - int(quiet)
    configure_logging(level)
    if level <= 0:
        quiet_libraries()
    return Output(overwrite, level < 0, level > 0, json_path)


def output_options(*, writes: bool = True, result: bool = True, extra: tuple[Spec, ...] = (), json_alias: str | None = None) -> Callable[[Callable], Callable]:
    """-q, -v, and --json where the command has a result, --overwrite where it writes, as an Output;
    `extra` (verify's --markdown, inspect's --heatmap) pass through beside it; `json_alias` is a
    second name of --json (verify's --report, from the command-line contract)."""
    json_spec = (("--json", json_alias, *JSON[0][1:]), JSON[1]) if json_alias else JSON
    specs = (QUIET, VERBOSE, *((json_spec,) if result else ()), *((OVERWRITE,) if writes else ()))
    group = OptionGroup("Output", specs, "output", _output)
    return stacked(options(*extra, title="Output"), group) if extra else group


# Calibration of the data-aware methods (convert, inspect)
calibration_options = OptionGroup(
    "Calibration (data-aware methods)",
    (
        spec(
            "--calibration",
            default=None,
            metavar="TEXT_FILE",
            help="Text the data-aware methods fit on (inspect measures the loss on other windows of it). Default: built-in offline text; 'weights': "
            "the weights alone.",
        ),
        spec(
            "--calibration-tokens",
            type=WHOLE,
            default=Calibration.tokens,
            help="Tokens of calibration text to run through the source model (inspect measures on as many others).",
        ),
        SEED,
    ),
    "calibration",
    lambda calibration, calibration_tokens, seed: Calibration(calibration, calibration_tokens, seed),
)


# Input spec of verify / run
def _input_spec(text: Path | None, window: int, max_rows: int, batch_size: int, seed: int, decode_steps: int, token_ids: Path | None = None) -> InputSpec:
    if text is not None and token_ids is not None:
        raise BadInput("--text and --token-ids both name the inputs; give one of them")
    return InputSpec(text=text, window=window, max_rows=max_rows or None, batch_size=batch_size, seed=seed, decode_steps=decode_steps, token_ids=token_ids)


INPUT_SPECS = (
    spec("--text", type=PATH, default=None, help="UTF-8 text to feed both sides. Default: the built-in held-out text."),
    spec("--window", type=WHOLE, default=InputSpec.window, help="Longest row in tokens; rows are cut at seeded lengths between half and this."),
    spec("--max-rows", type=WHOLE, default=InputSpec.max_rows, help="Use a seeded subset of this many rows when the text has more (0 = all)."),
    batch_size_spec(InputSpec.batch_size),
    SEED,
    spec(
        "--decode-steps",
        type=WHOLE,
        default=InputSpec.decode_steps,
        help="Decoder exports: the last N tokens of each row go one by one through the KV cache (model.onnx fed its own present K/V, or "
        "decode.onnx), gated like the prefill (0 = skip).",
    ),
)
TOKEN_IDS = spec(
    "--token-ids",
    type=PATH,
    default=None,
    metavar="FILE",
    help="Feed these token ids instead of a text: one row per line, whitespace-separated ids. Without it, a model with no tokenizer files gets "
    "seeded random ids (fidelity only).",
)


def input_options(token_ids: bool = False, **changed: dict[str, Any]) -> OptionGroup:
    """The input group; `changed` replaces click keywords of an option by its name (demo: max_rows's default)."""
    specs = [(decls, {**kwargs, **changed.get(decls[0][2:].replace("-", "_"), {})}) for decls, kwargs in INPUT_SPECS + ((TOKEN_IDS,) if token_ids else ())]
    return OptionGroup("Input options", tuple(specs), "inputs", _input_spec)


# Thresholds of verify / run / demo
def _thresholds(budget_file: Path | None, **values: float | None):
    from headfold.verification.budget import Thresholds

    return Thresholds(budget_file, **values)


threshold_options = OptionGroup(
    "Thresholds",
    (
        spec("--budget", "budget_file", type=PATH, default=None, help="TOML/YAML/JSON file with [fidelity] and [loss] budgets (options below override it)."),
        spec("--max-ppl-increase", type=Fraction(), default=None, help="Loss: largest relative perplexity increase, e.g. 5% or 0.05. [default: 5%]"),
        spec("--max-kl", type=Nats(), default=None, help="Loss: largest mean per-token KL(original || converted), in nats. [default: 0.05]"),
        spec(
            "--min-top1",
            type=Fraction(),
            default=None,
            help="Smallest top-1 agreement (loss check; in verify, whichever check runs). [default: loss 90%, fidelity fp32 99.9%]",
        ),
        spec(
            "--min-cosine",
            type=Fraction(),
            default=None,
            help="Smallest cosine (loss: encoder embeddings; in verify, whichever check runs). [default: loss 0.99, fidelity fp32 0.99999]",
        ),
        spec("--atol", type=Fraction(), default=None, help="Fidelity: an element fails when it exceeds both atol and rtol. [default fp32: 1e-4, fp16: 1e-2]"),
        spec("--rtol", type=Fraction(), default=None, help="Fidelity: relative tolerance. [default fp32: 1e-3, fp16: 1e-2]"),
    ),
    "thresholds",
    _thresholds,
)

REPORTS = (
    spec("--markdown", "markdown_path", type=PATH, default=None, help="Write the tables as Markdown (for a PR comment)."),
    spec("--junit", "junit_path", type=PATH, default=None, help="Write JUnit XML: one testcase per check."),
)


# Conversion (convert, run, demo)
# --pool, not --attention: export and run already take --attention for the exported attention op
POOL = spec(
    "--pool",
    type=click.Choice(tuple(POOL_CHOICES)),
    default=None,
    help="Encoder-decoders (T5, BART, Whisper): the attentions to pool. self: decoder self-attention; cross: decoder cross-attention; "
    f"decoder: both; encoder: encoder self-attention (it caches nothing); all. [default: {DEFAULT_POOL}]",
)


LOCAL_STEPS = spec(
    "--local-steps",
    type=WHOLE,
    default=None,
    metavar="N",
    help="the most Adam steps per layer of a method with local (it stops earlier when its held-out windows stop improving); each runs the layer's "
    f"attention over a minibatch of calibration windows. [default: {DEFAULT_LOCAL_STEPS}]",
)


def conversion_options(*, kv_default: str | None = None, written: bool = True, with_pool: bool = True) -> OptionGroup:
    """--kv-heads, --method and --local-steps; where a checkpoint is written (convert, run) --shard-size and
    --allow-pickle; `with_pool`: --pool too (convert, run: not the demo, whose model is a decoder)."""
    checkpoint = (
        spec(
            "--shard-size", default=None, metavar="SIZE", help="Largest output shard, e.g. 2GB or 500MiB. Default: like the source (one file stays one file)."
        ),
        spec(
            "--allow-pickle",
            is_flag=True,
            help="Accept pytorch_model.bin pickles (loaded with weights_only=True; from the hub only when the repo has no safetensors). Off by "
            "default: pickles can run code.",
        ),
    )
    return options(kv_heads_spec(kv_default), method_spec(), *((POOL,) if with_pool else ()), LOCAL_STEPS, *(checkpoint if written else ()), title=CONVERSION)


# Export (export, run)
export_options = OptionGroup(
    EXPORT,
    (
        OPSET,
        DTYPE,
        spec(
            "--attention",
            type=click.Choice(("auto", "onnx", "ort-gqa")),
            default=ExportOptions.attention,
            help="Fused node: ort-gqa = ONNX Runtime's com.microsoft.GroupQueryAttention, K/V cache written in place into one shared buffer "
            "(decoders; unpadded or right-padded batches, as onnxruntime-genai feeds them); onnx = the standard Attention (any runtime, "
            "TensorRT). auto = ort-gqa in a merged decoder graph whose attention it computes, onnx for TensorRT targets, split graphs, "
            f"encoders, encoder-decoders and ALiBi models; export.json says which and why. [default: {ExportOptions.attention}]",
        ),
        spec(
            "--graphs",
            type=click.Choice(("merged", "split")),
            default=None,
            help="Decoders: merged = one model.onnx for prompt and decode steps + genai_config.json (onnxruntime-genai); split = prefill.onnx + "
            "decode.onnx (TensorRT profiles). [default: merged; split for a TensorRT target]",
        ),
        spec(
            "--optimize",
            type=click.Choice(("auto", "ort", "none")),
            default=ExportOptions.optimize,
            help="ort = ONNX Runtime's fusions (skip layer norm, fused matmuls; with GroupQueryAttention: rotary inside it, packed Q/K/V), counted "
            "in export.json; the graph then runs in ONNX Runtime only. auto = ort on GroupQueryAttention graphs, none on the standard graph. "
            f"[default: {ExportOptions.optimize}]",
        ),
        spec(
            "--position-ids",
            is_flag=True,
            help="Merged decoder graph: take a position_ids [B, S] input (named in genai_config.json) instead of counting positions over the mask's "
            "real tokens.",
        ),
        spec(
            "--int4-block-size",
            type=WHOLE,
            default=None,
            help="--dtype int4: weights per quantization block along K (16, 32, 64, 128 or 256). [default: 32, as onnxruntime-genai's builder]",
        ),
        spec(
            "--int4-symmetric/--int4-asymmetric",
            default=None,
            help="--dtype int4: symmetric blocks (int4, no zero points) or asymmetric (uint4 with zero points). [default: symmetric, as "
            "onnxruntime-genai's builder]",
        ),
        TRT_VERSION,
    ),
    "export",
    ExportOptions,
)


# Distillation (distill; run and demo as --distill-…)
DISTILL_DATA = spec(
    "--data",
    type=PATH,
    default=None,
    help="Training data: a text file, .jsonl/.parquet with a 'text' field (encoder-decoders: or 'source' and 'target'), or a datasets save_to_disk "
    "folder; Whisper: a .jsonl of 'audio' and 'text' or a folder of WAVs at its sampling rate. Default only for the embedded model: its "
    "training split.",
)
DISTILL_TOKENS = spec(
    "--tokens",
    type=str,
    default=None,
    help="Training tokens over all processes: 200000, 200k, 1.5M, or 5% of the teacher's pre-training tokens (known only for the embedded model); "
    "rounded down to whole steps.",
)
DISTILL_TRAINING = (
    DISTILL_DATA,
    spec("--eval-data", type=PATH, default=None, help="Held-out text (same formats). Default: the first --eval-windows windows of --data, never trained on."),
    DISTILL_TOKENS,
    spec("--steps", type=WHOLE, default=None, help="Optimizer steps, instead of --tokens. [default without --tokens: 40]"),
    spec("--seq-len", type=WHOLE, default=DistillOptions.seq_len, help="Tokens per training window."),
    batch_size_spec(None),  # None: the run's default_batch_size()
    spec(
        "--lr",
        type=FINITE,
        default=None,
        help="Peak learning rate (AdamW; linear warmup over 10 % of the steps, then cosine to 0). "
        "[default: chosen on --data among 1e-4, 3e-4, 1e-3, 3e-3 by a probe of the run's first steps, docs/distill.md]",
    ),
    spec(
        "--train",
        type=click.Choice(TRAIN_MODES),
        default=None,
        help="What trains: kv = K/V projections, attention = Q/K/V/O, all, lora = PEFT adapters on Q/K/V/O merged at the end. [default: attention "
        "for decoders, all for encoders]",
    ),
    spec(
        "--loss",
        type=click.Choice(LOSSES),
        default=DistillOptions.loss,
        help="Decoders: KL(teacher || student) of the logits, optionally + next-token cross-entropy. Encoders always: hidden-state MSE + (1 - "
        "embedding cosine).",
    ),
    spec("--temperature", type=FINITE, default=DistillOptions.temperature, help="Softmax temperature of the KL (loss scaled by T²)."),
    spec(
        "--hidden-weight",
        type=FINITE,
        default=None,
        help="Weight of the per-layer hidden-state match added to the loss: MSE of each layer's output against the teacher's, over the teacher's "
        "mean square, averaged over layers; 0 turns it off. [default: by the student's kind, docs/distill.md]",
    ),
    spec(
        "--attention-weight",
        type=FINITE,
        default=None,
        help="Weight of the per-layer attention-output match added to the loss: the same distance between each layer's attention block outputs; 0 "
        "turns it off. [default: docs/distill.md]",
    ),
    spec("--gradient-checkpointing", is_flag=True, help="Recompute layer activations in the backward pass: less memory, slower."),
    SEED,
)
DISTILL_EVALUATION = (
    spec(
        "--eval-every",
        type=WHOLE,
        default=None,
        help="Evaluate on every held-out window every N steps. [default: up to 8 evaluations, at most a tenth of the run's compute: fewer, on fewer "
        "windows, on short runs]",
    ),
    spec("--eval-windows", type=WHOLE, default=DistillOptions.eval_windows, help="Held-out windows of --seq-len tokens."),
    spec("--until-kl", type=Nats(), default=None, help="Stop once the held-out KL (nats per token) is at most this (checked at each evaluation)."),
    spec("--until-ppl-increase", type=Fraction(), default=None, help="Stop once the held-out perplexity is within this of the teacher's, e.g. 2%."),
)


def _distill_stage(data: Path | None = None, eval_data: Path | None = None, **values: Any):
    """The distill stage `run` adds when any --distill-… option is given (None: convert → export directly)."""
    ctx = click.get_current_context()
    asked = {name for name in ctx.params if name.startswith("distill_") and ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)}
    if not asked:
        return None
    from headfold.distillation.stage import DistillStage

    return DistillStage(data, {name: value for name, value in values.items() if f"distill_{name}" in asked}, eval_data)


distill_stage_options = OptionGroup("Distill stage", DISTILL_TRAINING + DISTILL_EVALUATION, "distill", _distill_stage, prefix="distill")


# The TensorRT build profile (build)
TENSORRT = "TensorRT options"
profile_options = stacked(
    OptionGroup(
        TENSORRT,
        (
            spec(
                "--precision",
                type=PrecisionChoice(Precision.floats()),
                default=None,
                help="Engine precision. Default: the graph's own. TensorRT 11 takes only that (re-export with --dtype); 10.x builds an fp32 graph "
                "in fp16/bf16 with builder flags.",
            ),
            spec(
                "--batch", default=None, metavar="MIN:OPT:MAX", help="Batch sizes of the optimization profile, e.g. 1:4:8 (one number: fixed). [default: 1:4:8]"
            ),
            spec(
                "--seq",
                default=None,
                metavar="MIN:OPT:MAX",
                help="Sequence lengths (prefill / encoder graphs). [default: 1:limit/2:limit, limit = the model's max positions]",
            ),
            spec("--past", default=None, metavar="MIN:OPT:MAX", help="KV-cache lengths (decode graph). [default: 0:limit/2:limit-1]"),
            spec("--workspace", default=None, metavar="SIZE", help="Builder workspace limit, e.g. 4GiB. [default: TensorRT's]"),
            spec("--timing-cache", type=PATH, default=None, help="Tactic timing cache: loaded when present, updated after the build."),
        ),
        "profile",
        Profile,
    ),
    options(TRT_VERSION, title=TENSORRT),
)


# -- options that do not apply ------------------------------------------------------------------


def given(ctx: click.Context, names: Iterable[str]) -> list[str]:
    """The options among `names` (parameter names) the user set, as they are spelled."""
    spelled = {p.name: p.opts[0] for p in ctx.command.params}
    return [spelled[n] for n in names if ctx.get_parameter_source(n) not in (None, ParameterSource.DEFAULT)]


def refuse(names: Iterable[str], why: str) -> None:
    """BadInput (exit 2, before anything is written) when the running command was given any of
    `names`: `why` says what makes them not apply."""
    wrong = given(click.get_current_context(), names)
    if wrong:
        raise BadInput(f"{' and '.join(wrong)} {'does' if len(wrong) == 1 else 'do'} not apply {why}; drop {'it' if len(wrong) == 1 else 'them'}")


# -- logging: -v / -q on the command group ------------------------------------------------------

LOGGER = "headfold"


class EchoHandler(logging.Handler):
    """Prints every record on stderr: stdout carries results only (a table, a JSON, "wrote …")."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            click.echo(printable(self.format(record)), err=True)  # a path or name from a file may hold escapes
        except Exception:  # a closed pipe must not turn a log line into a failure
            self.handleError(record)


_handler = EchoHandler()


def color_allowed() -> bool | None:
    """Colours on a terminal only (click strips them elsewhere), and never with NO_COLOR set (no-color.org)."""
    return False if os.environ.get("NO_COLOR") else None


def configure_logging(level: int) -> None:
    """-1 (-q): warnings and errors only; 0: progress lines too; 1 (-v): debug as well."""
    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.WARNING if level < 0 else logging.INFO if level == 0 else logging.DEBUG)
    if _handler not in logger.handlers:
        logger.addHandler(_handler)
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        ctx.meta["headfold.verbosity"] = level


def verbosity() -> int:
    ctx = click.get_current_context(silent=True)
    return 0 if ctx is None else ctx.meta.get("headfold.verbosity", 0)


def quiet_libraries() -> None:
    """Only errors from the libraries (no progress bars, no warnings), unless -v asked for more.

    transformers is told through its environment variables when it is not imported yet: a mean
    conversion never imports it."""
    if verbosity() > 0:
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one "Loading weights" bar per runner otherwise
        hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    # torch.onnx's "torchvision is not installed" lines and friends: torch resets its own loggers when
    # it is imported, so a torch imported later is told through TORCH_LOGS ('-': errors only).
    os.environ.setdefault("TORCH_LOGS", "-onnx,-export")
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


QUIET_LOGGERS = ("torch.onnx", "onnxscript", "torch._dynamo", "torch.export")
_LIBRARY_ENV = ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS", "TORCH_LOGS")


@contextmanager
def api_output(progress: bool) -> Iterator[None]:
    """The command line's output policy around one Python API call: `progress` True prints what the CLI
    prints by default (headfold's progress lines and bars, none of the libraries' warnings or bars), False
    what -q prints (warnings and errors). The caller's logging levels, warning filters and environment
    are as they were afterwards."""
    names = (LOGGER, *QUIET_LOGGERS)
    levels, env = {name: logging.getLogger(name).level for name in names}, {key: os.environ.get(key) for key in _LIBRARY_ENV}
    handled = _handler in logging.getLogger(LOGGER).handlers
    hf = _transformers_output()
    with warnings.catch_warnings():
        try:
            configure_logging(0 if progress else -1)
            quiet_libraries()
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            if not handled:
                logging.getLogger(LOGGER).removeHandler(_handler)
            for key, value in env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            _restore_transformers_output(hf)


def _transformers_output() -> tuple[int, bool] | None:
    """transformers' verbosity and whether its progress bars show (None: not imported, its defaults)."""
    if "transformers" not in sys.modules:
        return None
    from transformers.utils import logging as hf_logging

    return hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()


def _restore_transformers_output(saved: tuple[int, bool] | None) -> None:
    if "transformers" not in sys.modules:
        return
    from transformers.utils import logging as hf_logging

    verbosity, bars = saved or (logging.WARNING, True)
    hf_logging.set_verbosity(verbosity)
    if bars:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
