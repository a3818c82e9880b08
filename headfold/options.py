"""The command line's option groups, each declared once, and the logging the CLI configures.

A group (conversion, calibration, input spec, thresholds, export, TensorRT, output) is a
decorator that adds its options under its own help heading and hands the command one object
built from them (an InputSpec, a Thresholds, ...), so a command takes what it works with,
not fifteen loose values. Every flag is spelled here once, with one meaning and one help text.
Nothing heavy is imported at module level: `headfold --help` must start without torch.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from headfold.ground.errors import BadInput, HeadfoldError
from headfold.ground.inputs import printable

log = logging.getLogger(__name__)
OPTIONS = "Options"  # the heading of a command's own options, listed first
PATH = click.Path(path_type=Path)


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
        from headfold.converter.per_layer import parse_kv_heads

        # BadInput passes through: main() prints it as one line and exits 2, like a bad list length
        return parse_kv_heads(value) if isinstance(value, str) else value


class Fraction(click.ParamType):
    """0.05 or 5%."""

    name = "FRACTION"

    def convert(self, value, param, ctx):
        from headfold.verification.budget import parse_fraction

        try:
            return parse_fraction(value, f"--{param.name.replace('_', '-')}") if isinstance(value, str) else value
        except HeadfoldError as err:
            self.fail(str(err), param, ctx)


class Finite(click.ParamType):
    """A finite float: inf and nan would train or gate on nothing."""

    name = "FLOAT"

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


FINITE = Finite()
KV_HEADS_HELP = "one value for every layer, or one per layer comma-separated (8,4,4,2); each must divide the attention heads"
METHOD_HELP = (
    "How the K/V heads of a group become one. mean: average them (Ainslie et al. 2023); first: keep the first; "
    "or combine with '+': grouped (pick groups by activation similarity), aligned (rotate heads to a common basis "
    "first, function-preserving), refit (least-squares fit of W_Q/W_O to the pooled K/V). Best: aligned+grouped+refit."
)
BEST_METHOD = "aligned+grouped+refit"


def kv_heads_spec(default: str | None = None) -> Spec:
    help = f"K/V heads after conversion: {KV_HEADS_HELP} (1 = MQA, all heads = unchanged)."
    return spec("--kv-heads", type=KvHeads(), required=default is None, default=default, help=help)


def method_spec(default: str = "mean") -> Spec:
    return spec("--method", default=default, metavar="METHOD", help=METHOD_HELP)


def batch_size_spec(default: int | None) -> Spec:
    return spec("--batch-size", type=int, default=default, help="Rows per batch: padded evaluation rows (verify, run); training windows per step and process (distill: 8, or fewer, down to 1, where --tokens would give under 640 steps).")


SEED = spec("--seed", type=click.IntRange(0, 2**32 - 1), default=0, help="Seed of the command's random choices: calibration windows (convert, inspect), evaluation rows (verify, run), the training shuffle (distill).")
OVERWRITE = spec("--overwrite", is_flag=True, help="Replace outputs that exist, when headfold wrote them (never a file or folder of yours, never an input): atomically, once the command succeeded (run: other files in OUT_DIR stay).")
QUIET = spec("--quiet", "-q", is_flag=True, help="No progress bars or progress lines; the same as `headfold -q`.")
JSON = spec("--json", "json_path", type=PATH, is_flag=False, flag_value=Path("-"), default=None, metavar="[FILE]", help="Write the result as JSON to FILE (atomically); without FILE, or '-', print it instead of the table.")
TRT_VERSION = spec("--trt-version", default=None, metavar="MAJOR.MINOR", help="The TensorRT release to target instead of the installed one (rule sets 10.13, 10.14, 10.15, 11.0).")
OPSET = spec("--opset", type=int, default=23, help="ONNX opset: 23, 24 or 25 (Attention exists from 23; torch writes invalid models above 25).")
DTYPE = spec("--dtype", type=click.Choice(("fp32", "fp16", "bf16")), default="fp32", help="Exported weight dtype (normalisations stay fp32 inside); picks the fidelity defaults.")


# -- groups: options under one heading that become one argument --------------------------------


@dataclass(frozen=True)
class OptionGroup:
    """Options under the help heading `title`; `build(**values)` becomes the command's argument
    `into` (without `build` the values pass through as they are)."""

    title: str
    specs: tuple[Spec, ...]
    into: str | None = None
    build: Callable[..., Any] | None = None

    def __call__(self, f: Callable) -> Callable:
        params = [Option(decls, section=self.title, **kwargs) for decls, kwargs in self.specs]
        names = [p.name for p in params]

        @functools.wraps(f)
        def command(*args: Any, **values: Any) -> Any:
            if self.build is not None:
                values[self.into] = self.build(**{name: values.pop(name) for name in names})
                log.debug(f"{self.into}: {values[self.into]!r}")  # -v shows what the options became
            return f(*args, **values)

        command.__click_params__ = [*getattr(f, "__click_params__", []), *reversed(params)]  # click lists them reversed
        return command


def options(*specs: Spec, title: str = OPTIONS) -> OptionGroup:
    """Plain options (the command's own, or a heading without an object)."""
    return OptionGroup(title, specs)


# Output: --overwrite and --quiet (and --json where a command writes JSON)
@dataclass(frozen=True)
class Output:
    overwrite: bool = False
    quiet: bool = False

    @property
    def progress(self) -> bool:
        return not self.quiet


def _output(overwrite: bool = False, quiet: bool = False) -> Output:
    quiet = quiet or verbosity() < 0
    if quiet:
        configure_logging(-1)
    return Output(overwrite, quiet)


def output_options(*extra: Spec, quiet: bool = True) -> OptionGroup:
    """--overwrite [--quiet] as an Output; `extra` (e.g. --json) pass through beside it."""
    group = OptionGroup("Output", (OVERWRITE, *((QUIET,) if quiet else ())), "output", _output)
    if not extra:
        return group
    return _stacked(options(*extra, title="Output"), group)


def _stacked(*groups: OptionGroup) -> Callable[[Callable], Callable]:
    def apply(f: Callable) -> Callable:
        for group in reversed(groups):
            f = group(f)
        return f

    return apply


# Calibration of the data-aware methods (convert, inspect)
@dataclass(frozen=True)
class Calibration:
    text: str | None = None  # a text file, 'weights', or None for the built-in text
    tokens: int = 4096
    seed: int = 0

    def kwargs(self) -> dict[str, Any]:
        """As headfold.converter.convert / inspect_checkpoint take them."""
        return {"calibration": self.text, "calibration_tokens": self.tokens, "seed": self.seed}


calibration_options = OptionGroup(
    "Calibration (data-aware methods)",
    (
        spec("--calibration", default=None, metavar="TEXT_FILE", help="Text the data-aware methods fit on (inspect measures the loss on other windows of it). Default: built-in offline text; 'weights': the weights alone."),
        spec("--calibration-tokens", type=int, default=4096, help="Tokens of calibration text to run through the source model (inspect measures on as many others)."),
        SEED,
    ),
    "calibration",
    lambda calibration, calibration_tokens, seed: Calibration(calibration, calibration_tokens, seed),
)  # fmt: skip


# Input spec of verify / run
def _input_spec(text: Path | None, window: int, max_rows: int, batch_size: int, seed: int, decode_steps: int, token_ids: Path | None = None):
    from headfold.verification.inputs import InputSpec

    if text is not None and token_ids is not None:
        raise BadInput("--text and --token-ids both name the inputs; give one of them")
    return InputSpec(text, window, max_rows or None, batch_size, seed, decode_steps, token_ids)


INPUT_SPECS = (
    spec("--text", type=PATH, default=None, help="UTF-8 text to feed both sides. Default: the built-in held-out text."),
    spec("--window", type=int, default=256, help="Longest row in tokens; rows are cut at seeded lengths between half and this."),
    spec("--max-rows", type=int, default=128, help="Use a seeded subset of this many rows when the text has more (0 = all)."),
    batch_size_spec(8),
    SEED,
    spec("--decode-steps", type=int, default=16, help="Decoder exports: the last N tokens of each row go one by one through the KV cache (model.onnx fed its own present K/V, or decode.onnx), gated like the prefill (0 = skip)."),
)  # fmt: skip
TOKEN_IDS = spec("--token-ids", type=PATH, default=None, metavar="FILE", help="Feed these token ids instead of a text: one row per line, whitespace-separated ids. Without it, a model with no tokenizer files gets seeded random ids (fidelity only).")


def input_options(token_ids: bool = False) -> OptionGroup:
    return OptionGroup("Input options", INPUT_SPECS + ((TOKEN_IDS,) if token_ids else ()), "inputs", _input_spec)


# Thresholds of verify / run / demo
def _thresholds(budget_file: Path | None, **values: float | None):
    from headfold.verification.budget import Thresholds

    return Thresholds(budget_file, **values)


threshold_options = OptionGroup(
    "Thresholds",
    (
        spec("--budget", "budget_file", type=PATH, default=None, help="TOML/YAML/JSON file with [fidelity] and [loss] budgets (options below override it)."),
        spec("--max-ppl-increase", type=Fraction(), default=None, help="Loss: largest relative perplexity increase, e.g. 5% or 0.05. [default: 5%]"),
        spec("--max-kl", type=Fraction(), default=None, help="Loss: largest mean per-token KL(original || converted), nats. [default: 0.05]"),
        spec("--min-top1", type=Fraction(), default=None, help="Smallest top-1 agreement (loss check; in verify, whichever check runs). [default: loss 90%, fidelity fp32 99.9%]"),
        spec("--min-cosine", type=Fraction(), default=None, help="Smallest cosine (loss: encoder embeddings; in verify, whichever check runs). [default: loss 0.99, fidelity fp32 0.99999]"),
        spec("--atol", type=Fraction(), default=None, help="Fidelity: an element fails when it exceeds both atol and rtol. [default fp32: 1e-4, fp16: 1e-2]"),
        spec("--rtol", type=Fraction(), default=None, help="Fidelity: relative tolerance. [default fp32: 1e-3, fp16: 1e-2]"),
    ),
    "thresholds",
    _thresholds,
)  # fmt: skip

report_options = options(
    spec("--report", "json_path", type=PATH, default=None, help="Write every metric, budget, verdict, version and input hash as JSON."),
    spec("--markdown", "markdown_path", type=PATH, default=None, help="Write the tables as Markdown (for a PR comment)."),
    spec("--junit", "junit_path", type=PATH, default=None, help="Write JUnit XML: one testcase per check."),
    OVERWRITE,
    title="Output",
)  # fmt: skip


# The TensorRT build profile (build)
@dataclass(frozen=True)
class Profile:
    precision: str | None = None
    batch: str | None = None
    seq: str | None = None
    past: str | None = None
    workspace: str | None = None
    timing_cache: Path | None = None

    def kwargs(self) -> dict[str, Any]:
        """As headfold.engines.plan.make_plan takes them."""
        return asdict(self)


TENSORRT = "TensorRT options"
profile_options = _stacked(
    OptionGroup(
        TENSORRT,
        (
            spec("--precision", type=click.Choice(("fp32", "fp16", "bf16")), default=None, help="Engine precision. Default: the graph's own. TensorRT 11 takes only that (re-export with --dtype); 10.x builds an fp32 graph in fp16/bf16 with builder flags."),
            spec("--batch", default=None, metavar="MIN:OPT:MAX", help="Batch sizes of the optimization profile, e.g. 1:4:8 (one number: fixed). [default: 1:4:8]"),
            spec("--seq", default=None, metavar="MIN:OPT:MAX", help="Sequence lengths (prefill / encoder graphs). [default: 1:limit/2:limit, limit = the model's max positions]"),
            spec("--past", default=None, metavar="MIN:OPT:MAX", help="KV-cache lengths (decode graph). [default: 0:limit/2:limit-1]"),
            spec("--workspace", default=None, metavar="SIZE", help="Builder workspace limit, e.g. 4GiB. [default: TensorRT's]"),
            spec("--timing-cache", type=PATH, default=None, help="Tactic timing cache: loaded when present, updated after the build."),
        ),
        "profile",
        Profile,
    ),
    options(TRT_VERSION, title=TENSORRT),
)  # fmt: skip


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
    """Prints a record as click.echo did: info and debug on stdout, warnings and errors on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            click.echo(printable(self.format(record)), err=record.levelno >= logging.WARNING)  # a path or name from a file may hold escapes
        except Exception:  # a closed pipe must not turn a log line into a failure
            self.handleError(record)


_handler = EchoHandler()


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
    warnings.filterwarnings("ignore")  # torch.onnx's "torchvision is not installed" and friends
    for name in ("torch.onnx", "onnxscript", "torch._dynamo", "torch.export"):
        logging.getLogger(name).setLevel(logging.ERROR)
