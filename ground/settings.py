"""The settings of each stage, as objects: what the command line builds from its options and the
Python API takes whole (as Polygraphy passes a CreateConfig), so one request is one object.

Each default is declared here once; the click options (headfold/options.py), the API
(headfold/api.py) and the stages' own keyword defaults read it. Each object checks its fields'
domains as it is built (BadOption naming the option), whoever builds it. Plain Python: building
one loads nothing heavy.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from headfold.ground.errors import BadInput, BadOption
from headfold.ground.precision import Precision
from headfold.ground.units import finite, parse_fraction, whole

# The opsets export writes: 23 is the first with Attention; torch 2.13 writes an invalid model above 25
# (opset_import 18 next to an Attention node).
OPSETS = (23, 24, 25)
TRAIN_MODES = ("kv", "attention", "all", "lora")  # what distillation trains (distillation/trainable.py)
LOSSES = ("kl", "kl+ce")


@dataclass(frozen=True)
class Calibration:
    """The text the data-aware methods fit on (convert, inspect, run's convert stage)."""

    text: str | os.PathLike | None = None  # a text file, "weights" (the weights alone), or None: the built-in text
    tokens: int = 16384  # tokens of calibration text run through the source model (local fits minibatches of it: docs/methods.md)
    seed: int = 0  # seed of the calibration windows

    def __post_init__(self) -> None:
        whole("--calibration-tokens", self.tokens, 1)

    def kwargs(self) -> dict[str, Any]:
        """As headfold.converter.convert / inspect_checkpoint take them."""
        return {"calibration": self.text, "calibration_tokens": self.tokens, "seed": self.seed}


FREE_KINDS = ("auto", "all", "maps")  # what local's fit changes (converter/local.py)


@dataclass(frozen=True)
class LocalFit:
    """How `local` fits each pooled layer's attention (converter/local.py; each default chosen on the zoo's
    trained models, docs/methods.md). Passed whole by the API and the benchmarks; the CLI takes the defaults."""

    free: str = "auto"  # "all" (every attention tensor), "maps" (pooled K/V, a head_dim map per query head on Q and on O), or "auto"
    determined: float = 0.25  # "auto" frees every tensor up to this many parameters per fitted target, the maps beyond
    rate: float = 0.05  # Adam's step, as a fraction of each tensor's RMS
    floor: float = 0.1  # the steps shrink (cosine) to this fraction of `rate` over the step budget
    runaway: float = 2.0  # a validation error this many times the best so far: back to the best weights, at half the rate
    validation: float = 0.25  # share of the calibration windows held out: they pick the kept iterate and stop the fit
    batch: int = 8  # windows per step (a minibatch: a step's cost does not grow with the calibration tokens)
    every: int = 10  # steps between validations
    patience: int = 5  # validations in a row without a new best end the fit
    sequential: bool = False  # each layer reads the converted layers before it (GPTQ's order), not the source's hidden states

    def __post_init__(self) -> None:
        if self.free not in FREE_KINDS:
            raise BadOption("local fit", f"free={self.free!r} is not one of {', '.join(FREE_KINDS)}")
        for name in ("batch", "every", "patience"):
            whole(name, getattr(self, name), 1)
        finite("rate", self.rate, above=0)
        finite("determined", self.determined, least=0)
        finite("floor", self.floor, least=0, most=1)
        finite("runaway", self.runaway, above=1)
        finite("validation", self.validation, least=0, most=0.5)


@dataclass(frozen=True)
class ExportOptions:
    """What `headfold export` (and run's export stage) writes: opset, weights and graph layout."""

    opset: int = OPSETS[0]
    dtype: Precision | None = None  # None: the checkpoint's own (run: fp32 for bf16); text is parsed
    attention: str = "auto"  # GroupQueryAttention in the merged decoder graph ONNX Runtime runs, else the standard Attention
    graphs: str | None = None  # None: split for a TensorRT target, else merged (run: split where TensorRT builds)
    optimize: str = "auto"  # ORT's fusions on GroupQueryAttention graphs
    position_ids: bool = False  # merged decoders: a position_ids input
    trt_version: str | None = None  # decompose what that TensorRT release's parser lacks
    int4_block_size: int | None = None  # None: the int4 default (graphs.rewrite.int4.Int4)
    int4_symmetric: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype is not None:
            object.__setattr__(self, "dtype", Precision.parse(self.dtype, "--dtype"))

    def kwargs(self) -> dict[str, Any]:
        """As headfold.graphs.export.export takes them; graphs None: export's default layout (split for
        a TensorRT target, else merged: graph_layout), or run's (split where TensorRT builds)."""
        return asdict(self)


@dataclass(frozen=True)
class Profile:
    """The TensorRT build: precision and optimization profile ranges (None: derived from the model)."""

    precision: Precision | None = None  # None: the graph's own; text is parsed
    batch: str | None = None  # "MIN:OPT:MAX"
    seq: str | None = None
    past: str | None = None
    workspace: str | None = None  # e.g. "4GiB"
    timing_cache: Path | None = None  # a path as text is taken too

    def __post_init__(self) -> None:
        if self.precision is not None:
            object.__setattr__(self, "precision", Precision.parse(self.precision, "--precision", Precision.floats()))
        as_paths(self, "timing_cache")

    def kwargs(self) -> dict[str, Any]:
        """As headfold.engines.plan.make_plan takes them."""
        return asdict(self)


DEFAULT_DECODE_STEPS = 16  # KV-cache steps per row through a decoder export's decode graph


@dataclass(frozen=True)
class InputSpec:
    """How to turn a text into feeds (verify, run's verify stage); recorded in every report."""

    text: Path | None = None  # None: the built-in held-out text
    window: int = 256  # longest row, in tokens
    max_rows: int | None = 128  # seeded subset of rows when the text has more; None = all
    batch_size: int = 8
    seed: int = 0
    decode_steps: int = DEFAULT_DECODE_STEPS  # the last tokens of each row fed one by one; 0 = none
    token_ids: Path | None = None  # rows of token ids instead of a text

    def __post_init__(self) -> None:
        """Every field within its option's domain, whoever builds this (verify, run, the Python API):
        BadOption naming the option, before anything runs."""
        as_paths(self, "text", "token_ids")
        whole("--window", self.window, 2, " (a token and the one it predicts)")
        whole("--max-rows", self.max_rows, 1, " (0 on the command line: all rows)")
        whole("--batch-size", self.batch_size, 1)
        whole("--seed", self.seed, 0)
        whole("--decode-steps", self.decode_steps, 0)


@dataclass(frozen=True)
class DistillOptions:
    """Everything that shapes a distillation's result (recorded in the manifest; a resumed run must
    repeat it). None: the measured default for the student's kind (distillation/run.py resolve_defaults)."""

    tokens: int | str | None = None  # training tokens over all processes: 200000, or text: "200k", "1.5M", "5%"
    steps: int | None = None
    seq_len: int = 256
    batch_size: int | None = None  # None: default_batch_size()
    lr: float | None = None  # peak rate; None: chosen on --data (headfold/distillation/rate.py)
    hidden_weight: float | None = None  # None: DECODER_HIDDEN_WEIGHT or ENCODER_HIDDEN_WEIGHT; 0: logits (or last state) only
    attention_weight: float | None = None  # None: ATTENTION_WEIGHT; 0: no attention-output match
    warmup: float = 0.1  # fraction of the steps with a linear LR ramp, then cosine to 0
    train: str | None = None  # None: DECODER_TRAIN or ENCODER_TRAIN
    loss: str = "kl"
    temperature: float = 1.0
    eval_every: int | None = None  # steps; default: 8 evaluations over the run
    eval_at: tuple[int, ...] = ()  # further steps to evaluate at (benchmarks: fixed token budgets)
    eval_windows: int = 32
    until_kl: float | None = None
    until_ppl_increase: float | None = None
    gradient_checkpointing: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        """Every option within its domain, whoever builds this (distill, run's stage, the Python API):
        BadOption naming the option, before anything runs."""
        whole("--seq-len", self.seq_len, 2, " (a token and the one it predicts)")
        for option, value in (
            ("--steps", self.steps),
            ("--batch-size", self.batch_size),
            ("--eval-every", self.eval_every),
            ("--eval-windows", self.eval_windows),
        ):
            whole(option, value, 1)
        whole("--tokens", None if isinstance(self.tokens, str) else self.tokens, 1)  # text (200k, 5%): parsed with the teacher (requested)
        whole("--seed", self.seed, 0)
        for step in self.eval_at:
            whole("eval_at", step, 1)
        finite("--lr", self.lr, above=0)
        finite("--temperature", self.temperature, above=0)
        finite("--hidden-weight", self.hidden_weight, least=0)
        finite("--attention-weight", self.attention_weight, least=0)
        finite("--until-kl", self.until_kl, least=0)
        if isinstance(self.until_ppl_increase, str):  # "2%", as the command line takes it
            object.__setattr__(self, "until_ppl_increase", parse_fraction(self.until_ppl_increase, "--until-ppl-increase"))
        finite("--until-ppl-increase", self.until_ppl_increase, least=0)
        finite("warmup", self.warmup, least=0, most=1)
        if self.train not in (None, *TRAIN_MODES):
            raise BadOption("--train", f"{self.train!r} is not one of {', '.join(TRAIN_MODES)}")
        if self.loss not in LOSSES:
            raise BadOption("--loss", f"{self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.tokens is not None and self.steps is not None:
            raise BadInput("give --tokens or --steps, not both")

    def given(self) -> dict[str, Any]:
        """The fields set away from their defaults: what a distill stage records as asked."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}


@dataclass(frozen=True, kw_only=True)
class RunOptions(DistillOptions):
    """DistillOptions as a run trains with them: --tokens a count, and every default set for the student's
    kind and the process count (distillation/run.py resolve_defaults)."""

    tokens: int | None
    batch_size: int
    hidden_weight: float
    attention_weight: float
    train: str


def as_paths(settings: object, *names: str) -> None:
    """The path fields `names` of a frozen settings object as Paths: the API takes text too."""
    for name in names:
        if isinstance(value := getattr(settings, name), str):
            object.__setattr__(settings, name, Path(value))
