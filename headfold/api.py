"""The Python API: one function per command, taking the settings objects the command builds from its
options (as Polygraphy passes a CreateConfig whole): Calibration, ExportOptions, Profile, DistillOptions,
DistillStage, InputSpec and Thresholds, each default declared once (headfold.ground.settings).

Each returns the typed artifact its stage produces (a checkpoint folder, ExportSummary, Report,
Inspection, engine sidecars) and raises the errors the CLI turns into exit codes
(headfold.ground.errors: BadInput → 2, CheckFailed → 1). Nothing heavy is imported until a
function runs, so `import headfold` stays cheap.
"""

from __future__ import annotations

import functools
import inspect as signatures
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from headfold.converter.recipes import DEFAULT_METHOD
from headfold.ground.settings import Calibration, DistillOptions, ExportOptions, InputSpec, LocalFit, Profile

if TYPE_CHECKING:
    import transformers
    from sentence_transformers import SentenceTransformer

    from headfold.distillation.stage import DistillStage
    from headfold.engines.plan import BuildPlan
    from headfold.engines.sidecar import EngineSidecar
    from headfold.ground.export_summary import ExportSummary
    from headfold.inspection import CacheInspection, Inspection
    from headfold.verification import Report, Thresholds

PathLike = str | os.PathLike


def _cli_output(function: Callable) -> Callable:
    """`function` printing what its command prints: the CLI's default with `progress`, else its -q (options.api_output)."""
    signature = signatures.signature(function)
    default = signature.parameters["progress"].default if "progress" in signature.parameters else False

    @functools.wraps(function)
    def call(*args, **kwargs):
        from headfold.ground.atomic import cleanup_on_sigterm
        from headfold.options import api_output

        with cleanup_on_sigterm(), api_output(signature.bind(*args, **kwargs).arguments.get("progress", default)):
            return function(*args, **kwargs)

    return call


@_cli_output
def convert(
    source: PathLike,
    output: PathLike,
    kv_heads: int | Sequence[int],
    method: str = DEFAULT_METHOD,
    calibration: Calibration | PathLike | None = Calibration(),
    *,
    revision: str | None = None,
    max_shard_size: str | int | None = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    pool: str | None = None,
    local_steps: int | None = None,
    local_fit: LocalFit = LocalFit(),
) -> Path:
    """Convert a checkpoint to `kv_heads` K/V heads (`headfold convert`); the output folder.

    Args:
        source: a Hugging Face checkpoint folder (config.json + safetensors) or hub id ORG/NAME.
        output: the folder to write; it appears only when complete.
        kv_heads: one count for every layer (1 = MQA), or one per layer; each divides the heads.
        method: mean, first, or data-aware modifiers joined by "+": aligned, grouped, scored, refit, local
            (docs/methods.md); the default ranks best over the quality zoo, without local when there is no text.
        calibration: what the data-aware methods fit on: Calibration(text, tokens, seed), or a text
            file alone; text None: the built-in offline text (the weights alone for a checkpoint without
            tokenizer files); "weights": the weights alone.
        revision: branch, tag or commit of a hub id.
        max_shard_size: largest output shard, e.g. "2GB"; None: shard like the source.
        allow_pickle: accept pytorch_model.bin pickles (loaded with weights_only=True).
        overwrite: replace an output headfold wrote before.
        progress: show progress bars.
        pool: encoder-decoders (T5, BART, Whisper) only: the attentions to pool, "self", "cross",
            "decoder" (both: the default), "encoder" or "all" (`--pool`; docs/convert.md).
        local_steps: Adam steps per layer of a method with local (None: the default budget).
        local_fit: how local fits each layer (LocalFit: what it frees, its rate, minibatch, validation and stopping).
    """
    from headfold import corpus
    from headfold.converter import convert as convert_checkpoint

    return convert_checkpoint(
        source, output, kv_heads, method, revision=revision, overwrite=overwrite, max_shard_size=max_shard_size, allow_pickle=allow_pickle,
        progress=progress, builtin_text=corpus.calibration_text(), pool=pool, local_steps=local_steps, local_fit=local_fit,
        **_calibration(calibration).kwargs(),
    )  # fmt: skip


@_cli_output
def inspect(
    source: PathLike,
    *,
    candidates: str | Sequence[int] | None = None,
    method: str = DEFAULT_METHOD,
    calibration: Calibration | PathLike | None = Calibration(),
    revision: str | None = None,
    kv_budget: float | int | None = None,
    heatmap: PathLike | None = None,
    json_path: PathLike | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Inspection | CacheInspection:
    """Per layer: K/V head similarity and the predicted loss of each kv-head count (`headfold inspect`);
    for an encoder-decoder (T5, BART, Whisper) a CacheInspection: the decoder's self- and cross-cache
    bytes per token for each candidate (no loss prediction yet, so no `kv_budget` or `heatmap`).

    Args:
        source: a checkpoint folder or hub id with one kv-head count in every layer.
        candidates: kv-head counts to predict, e.g. [4, 2, 1]; None: every divisor below the source's.
        method: the conversion method whose loss is predicted.
        calibration: as for `convert`; the loss is measured on windows of the same text not used for fitting.
        revision: branch, tag or commit of a hub id.
        kv_budget: plan per-layer kv heads for this KV cache: a fraction of the source's (0.25),
            or an integer total of kv heads over all layers. The report's `plan` and `uniform`.
        heatmap: write the PNG heatmap here.
        json_path: write the report as JSON here.
        overwrite: replace existing heatmap / JSON files.
        progress: show a progress bar.
    """
    from headfold.inspection import inspect_checkpoint

    if candidates is not None and not isinstance(candidates, str):
        candidates = ",".join(map(str, candidates))
    return inspect_checkpoint(
        source, candidates=candidates, method=method, kv_budget=kv_budget, heatmap=_path(heatmap), json_path=_path(json_path),
        overwrite=overwrite, progress=progress, revision=revision, **_calibration(calibration).kwargs(),
    )  # fmt: skip


@_cli_output
def distill(
    teacher: PathLike,
    student: PathLike,
    output: PathLike,
    options: DistillOptions = DistillOptions(),
    *,
    data: PathLike | None = None,
    eval_data: PathLike | None = None,
    revision: str | None = None,
    save_every: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Train a converted student towards its MHA teacher (`headfold distill`); the output folder.

    Args:
        teacher: the MHA checkpoint `student` was converted from (a folder or hub id).
        student: a headfold conversion of `teacher`.
        output: the folder to write (a checkpoint like convert's, with distill-log.json and
            distill-curve.png).
        options: DistillOptions: the token budget (tokens=200000, "200k", "1.5M", or "5%" of the
            teacher's pre-training tokens where headfold knows them; or steps), seq_len, batch_size, lr,
            train, loss, the stopping targets, ...; a None field is the default for the student's kind
            (decoder or encoder), recorded in the output's headfold.json as resolved (docs/distill.md).
        data: training text: a text file, .jsonl/.json/.parquet with a "text" field, or a datasets
            save_to_disk folder; None only for the embedded model (its own training split).
        eval_data: held-out text; None: the first `options.eval_windows` windows of `data`.
        revision: branch, tag or commit of the hub ids among them.
        save_every: write a resumable checkpoint every N steps beside `output`.
        resume: continue from that checkpoint (same inputs and options).
        overwrite: replace an output headfold wrote before.
        progress: show a progress bar.
    """
    from headfold.distillation import distill as run_distill

    return run_distill(
        teacher, student, output, revision=revision, data=data, eval_data=eval_data, save_every=save_every, resume=resume,
        overwrite=overwrite, progress=progress, **asdict(options),
    )  # fmt: skip


@_cli_output
def export(
    source: PathLike,
    output: PathLike,
    options: ExportOptions = ExportOptions(),
    *,
    revision: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> ExportSummary:
    """Export a checkpoint folder to ONNX, one fused attention node per layer (`headfold export`).

    Returns the folder's export.json. Raises CheckFailed when a layer did not fuse.

    Args:
        source: a checkpoint folder (source or converted) or hub id.
        output: the folder to write.
        options: ExportOptions, as `headfold export` builds them from its options: opset (one of OPSETS);
            dtype ("fp32", "fp16", "bf16", or "int4": MatMul weights in 4 bits, decoders; None: the
            checkpoint's own); attention ("auto", "onnx", "ort-gqa"); graphs ("merged" or "split"; None:
            split for a `trt_version` target, else merged); optimize ("auto", "ort", "none");
            position_ids; trt_version (decompose what that TensorRT release's parser lacks, e.g.
            "10.14"); int4_block_size and int4_symmetric.
        revision: branch, tag or commit of a hub id.
        overwrite: replace an output headfold wrote before.
        progress: show progress.
    """
    from headfold.graphs.export import export as export_checkpoint
    from headfold.ground import export_summary

    export_checkpoint(source, output, revision=revision, overwrite=overwrite, progress=progress, **options.kwargs())
    return export_summary.load(Path(output))


@_cli_output
def build(
    source: PathLike,
    output: PathLike,
    profile: Profile = Profile(),
    *,
    trt_version: str | None = None,
    require_fused_attention: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
) -> list[EngineSidecar] | BuildPlan:
    """Build TensorRT engines from a .onnx or an export folder (`headfold build`).

    Returns the engines' sidecars, or with `dry_run` the checked plan (needs no TensorRT).
    Raises BadInput where TensorRT or a GPU is missing, CheckFailed when
    `require_fused_attention` finds an unfused engine.

    Args:
        source: a .onnx file (then `output` ends with .engine) or an export folder.
        output: the engine file or folder.
        profile: Profile: precision ("fp32", "fp16" or "bf16"; None: the graph's own), the optimization
            profile ranges batch, seq, past ("MIN:OPT:MAX"; None: derived from the model), workspace
            (e.g. "4GiB") and timing_cache (loaded when present and updated).
        trt_version: the release to plan for (dry runs only, where it differs from the installed one).
        require_fused_attention: fail unless every engine's attention is one fused kernel.
        dry_run: plan and lint only.
        overwrite: replace an output headfold wrote before.
    """
    from headfold.engines.env import target_for
    from headfold.engines.plan import make_plan

    target = target_for(trt_version, dry_run=dry_run)
    plan = make_plan(Path(source), Path(output), target, **profile.kwargs())
    if dry_run:
        plan.check()
        return plan
    from headfold.engines.build import build as build_engines

    return build_engines(plan, overwrite=overwrite, require_fused_attention=require_fused_attention)


@_cli_output
def verify(
    reference: PathLike,
    candidate: PathLike,
    *,
    check: str = "auto",
    inputs: InputSpec = InputSpec(),
    thresholds: Thresholds | PathLike | None = None,
    revision: str | None = None,
    progress: bool = True,
) -> Report:
    """Compare CANDIDATE with REFERENCE on the same inputs (`headfold verify`); the report.

    `report.passed` says whether every budget held; `report.raise_for_failures()` raises
    CheckFailed (the CLI's exit 1); `report.write(json_path=…, markdown_path=…, junit_path=…)`.

    Args:
        reference, candidate: checkpoint folders or hub ids (run in torch), export folders or .onnx files
            (ONNX Runtime), engines (TensorRT).
        check: "auto" (same model → fidelity, a conversion of `reference` → loss), "fidelity", "loss".
        inputs: InputSpec: the text (None: the built-in held-out text) or token_ids fed to both sides,
            window, max_rows, batch_size, seed, decode_steps.
        thresholds: Thresholds: a budget file and the budgets that override it (max_ppl_increase,
            max_kl, min_top1, min_cosine, atol, rtol; fractions, 0.05 for 5 %); a path: the budget
            file alone; None: the default budgets.
        revision: branch, tag or commit of the hub ids among them.
        progress: show a progress bar (rows done).
    """
    from headfold.verification.api import verify as run_verify

    return run_verify(reference, candidate, check=check, revision=revision, progress=progress, inputs=inputs, thresholds=_thresholds(thresholds))


@_cli_output
def run(
    source: PathLike,
    output: PathLike,
    kv_heads: int | Sequence[int],
    method: str = DEFAULT_METHOD,
    *,
    calibration: Calibration | PathLike | None = Calibration(),
    pool: str | None = None,
    local_steps: int | None = None,
    distill: DistillStage | None = None,
    export: ExportOptions = ExportOptions(),
    profile: Profile = Profile(),
    inputs: InputSpec = InputSpec(),
    thresholds: Thresholds | PathLike | None = None,
    revision: str | None = None,
    max_shard_size: str | int | None = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
    progress: bool = False,
) -> Report:
    """convert → (distill) → export → build → verify into `output`/{convert,distill,export,build,verify}
    (`headfold run`); the verify report. Stages whose inputs are unchanged are skipped.

    Args:
        source: the MHA checkpoint folder or hub id.
        output: the run folder: new, empty, or one `run` wrote (`overwrite`: any folder; its
            other files stay).
        kv_heads, method, calibration, pool, local_steps, revision, max_shard_size, allow_pickle: as for `convert`.
        distill: a DistillStage(data, options, eval_data) adds the distill stage (as `distill` takes
            them; data None: the embedded model's own text); None: no distill stage.
        export: as for `export` (graphs None: split where TensorRT builds engines, else merged;
            dtype None: the checkpoint's own, but fp32 for bf16, which the verify stage's CPU ONNX
            Runtime cannot run).
        profile: as for `build`, where it runs.
        inputs, thresholds: as for `verify`.
        overwrite: accept an output folder of other files.
        progress: show each stage's progress.
    """
    from headfold.pipeline import run as run_pipeline

    return run_pipeline(
        source, output, kv_heads, method=method, revision=revision, max_shard_size=max_shard_size, allow_pickle=allow_pickle,
        calibration=_calibration(calibration), pool=pool, local_steps=local_steps, distill=distill, export=export, build=profile, inputs=inputs,
        thresholds=_thresholds(thresholds), overwrite=overwrite, progress=progress,
    )  # fmt: skip


@_cli_output
def load_model(path: PathLike) -> transformers.PreTrainedModel:
    """A runnable torch model (eval mode) for any source or converted checkpoint folder, including
    families whose converted checkpoints plain transformers cannot load (docs/deploying.md); an
    encoder-decoder's with GQA self- and cross-attention, generate() keeping the EncoderDecoderCache."""
    from headfold.converter.modeling import load_model as load

    return load(path)


@_cli_output
def sentence_transformer(path: PathLike, *, device: str | None = None) -> SentenceTransformer:
    """A sentence-transformers checkpoint folder, converted or not, as a `SentenceTransformer`: its
    own modules (pooling, normalize, …) as saved, the transformer built by `load_model` (plain
    sentence-transformers cannot load a converted BERT: transformers has no GQA for it).

    Args:
        path: the folder (modules.json and the module folders, as `convert` copies them).
        device: the torch device to run on ("cpu", "cuda"); None: sentence-transformers' choice.
    """
    from headfold.converter.sentence import sentence_transformer as load

    return load(path, **({} if device is None else {"device": device}))


def _path(value: PathLike | None) -> Path | None:
    return None if value is None else Path(value)


def _calibration(value: Calibration | PathLike | None) -> Calibration:
    """A Calibration as given, or one on the text file (or "weights") given alone; None: the defaults."""
    return value if isinstance(value, Calibration) else Calibration(text=None if value is None else os.fspath(value))


def _thresholds(value: Thresholds | PathLike | None) -> Thresholds:
    """Thresholds as given; a path: its budget file alone; None: the default budgets."""
    from headfold.verification import Thresholds

    return value if isinstance(value, Thresholds) else Thresholds(file=_path(value))
