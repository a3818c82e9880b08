"""The Python API: one function per command, with the command's options as keyword arguments.

Each returns the typed artifact its stage produces (a checkpoint folder, ExportSummary, Report,
Inspection, engine sidecars) and raises the errors the CLI turns into exit codes
(headfold.ground.errors: BadInput → 2, CheckFailed → 1). Nothing heavy is imported until a
function runs, so `import headfold` stays cheap. Defaults are the commands' defaults
(tests/unit/test_api.py holds them to the stages' own).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headfold.converter.recipes import DEFAULT_METHOD

if TYPE_CHECKING:
    import transformers
    from sentence_transformers import SentenceTransformer

    from headfold.engines.plan import BuildPlan
    from headfold.engines.sidecar import EngineSidecar
    from headfold.ground.export_summary import ExportSummary
    from headfold.inspection import CacheInspection, Inspection
    from headfold.verification import InputSpec, Report, Thresholds

PathLike = str | os.PathLike
Fraction = float | str  # 0.05, "0.05" or "5%"


def convert(
    source: PathLike,
    output: PathLike,
    kv_heads: int | Sequence[int],
    method: str = DEFAULT_METHOD,
    *,
    revision: str | None = None,
    calibration: PathLike | None = None,
    calibration_tokens: int = 4096,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    pool: str | None = None,
    local_steps: int | None = None,
) -> Path:
    """Convert a checkpoint to `kv_heads` K/V heads (`headfold convert`); the output folder.

    Args:
        source: a Hugging Face checkpoint folder (config.json + safetensors) or hub id ORG/NAME.
        output: the folder to write; it appears only when complete.
        kv_heads: one count for every layer (1 = MQA), or one per layer; each divides the heads.
        method: mean, first, or data-aware modifiers joined by "+": aligned, grouped, scored, refit, local
            (docs/methods.md); the default ranks best over the quality zoo, without local when there is no text.
        revision: branch, tag or commit of a hub id.
        calibration: text file the data-aware methods fit on; None: the built-in offline text (the
            weights alone for a checkpoint without tokenizer files); "weights": the weights alone.
        calibration_tokens: tokens of calibration text run through the source model.
        seed: seed of the calibration windows.
        max_shard_size: largest output shard, e.g. "2GB"; None: shard like the source.
        allow_pickle: accept pytorch_model.bin pickles (loaded with weights_only=True).
        overwrite: replace an output headfold wrote before.
        progress: show progress bars.
        pool: encoder-decoders (T5, BART, Whisper) only: the attentions to pool, "self", "cross",
            "decoder" (both: the default), "encoder" or "all" (`--pool`; docs/convert.md).
        local_steps: Adam steps per layer of a method with local (None: the default budget).
    """
    from headfold import corpus
    from headfold.converter import convert as convert_checkpoint

    return convert_checkpoint(
        source, output, kv_heads, method, revision=revision, overwrite=overwrite, max_shard_size=max_shard_size, allow_pickle=allow_pickle,
        calibration=calibration, calibration_tokens=calibration_tokens, seed=seed, progress=progress, builtin_text=corpus.calibration_text(), pool=pool,
        local_steps=local_steps,
    )  # fmt: skip


def inspect(
    source: PathLike,
    *,
    candidates: str | Sequence[int] | None = None,
    method: str = DEFAULT_METHOD,
    revision: str | None = None,
    kv_budget: float | int | None = None,
    calibration: PathLike | None = None,
    calibration_tokens: int = 4096,
    seed: int = 0,
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
        revision: branch, tag or commit of a hub id.
        kv_budget: plan per-layer kv heads for this KV cache: a fraction of the source's (0.25),
            or an integer total of kv heads over all layers. The report's `plan` and `uniform`.
        calibration, calibration_tokens, seed: as for `convert`; the loss is measured on windows
            of the same text not used for fitting.
        heatmap: write the PNG heatmap here.
        json_path: write the report as JSON here.
        overwrite: replace existing heatmap / JSON files.
        progress: show a progress bar.
    """
    from headfold.inspection import inspect_checkpoint

    if candidates is not None and not isinstance(candidates, str):
        candidates = ",".join(map(str, candidates))
    return inspect_checkpoint(
        source, candidates=candidates, method=method, kv_budget=kv_budget, calibration=calibration, calibration_tokens=calibration_tokens, seed=seed,
        heatmap=_path(heatmap), json_path=_path(json_path), overwrite=overwrite, progress=progress, revision=revision,
    )  # fmt: skip


def distill(
    teacher: PathLike,
    student: PathLike,
    output: PathLike,
    *,
    revision: str | None = None,
    data: PathLike | None = None,
    eval_data: PathLike | None = None,
    tokens: int | str | None = None,
    steps: int | None = None,
    seq_len: int = 256,
    batch_size: int | None = None,
    lr: float | None = None,
    train: str | None = None,
    loss: str = "kl",
    temperature: float = 1.0,
    hidden_weight: float | None = None,
    attention_weight: float | None = None,
    warmup: float = 0.1,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    eval_every: int | None = None,
    eval_windows: int = 32,
    until_kl: float | None = None,
    until_ppl_increase: Fraction | None = None,
    save_every: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Train a converted student towards its MHA teacher (`headfold distill`); the output folder.

    None means "the default for the student's kind" (decoder or encoder), recorded in the
    output's headfold.json as resolved. See docs/distill.md.

    Args:
        teacher: the MHA checkpoint `student` was converted from (a folder or hub id).
        student: a headfold conversion of `teacher`.
        revision: branch, tag or commit of the hub ids among them.
        output: the folder to write (a checkpoint like convert's, with distill-log.json and
            distill-curve.png).
        data: training text: a text file, .jsonl/.json/.parquet with a "text" field, or a datasets
            save_to_disk folder; None only for the embedded model (its own training split).
        eval_data: held-out text; None: the first `eval_windows` windows of `data`.
        tokens: training tokens over all processes: 200000, "200k", "1.5M", or "5%" of the
            teacher's pre-training tokens where headfold knows them.
        steps: optimizer steps, instead of `tokens` (neither: 40 steps).
        seq_len: tokens per training window.
        batch_size: windows per step and process.
        lr: peak learning rate (AdamW, linear warmup then cosine to 0).
        train: what trains: "kv", "attention" (Q/K/V/O), "all" or "lora".
        loss: decoders: "kl" or "kl+ce"; encoders always match hidden states and embeddings.
        temperature: softmax temperature of the KL (the loss is scaled by T²).
        hidden_weight: weight of the per-layer hidden-state match; 0 turns it off.
        attention_weight: weight of the per-layer attention-output match; 0 turns it off.
        warmup: fraction of the steps with a linear learning-rate ramp.
        gradient_checkpointing: recompute activations in the backward pass (less memory).
        seed: seed of the training-window shuffle.
        eval_every: steps between held-out evaluations (None: 8 per run).
        eval_windows: held-out windows of `seq_len` tokens.
        until_kl: stop at the first evaluation whose KL is at most this.
        until_ppl_increase: stop once the perplexity is within this of the teacher's, e.g. "2%".
        save_every: write a resumable checkpoint every N steps beside `output`.
        resume: continue from that checkpoint (same inputs and options).
        overwrite: replace an output headfold wrote before.
        progress: show a progress bar.
    """
    from headfold.distillation import distill as run_distill

    increase = None if until_ppl_increase is None else _fraction(until_ppl_increase, "until_ppl_increase")
    return run_distill(
        teacher, student, output, revision=revision, data=data, eval_data=eval_data, save_every=save_every, resume=resume, overwrite=overwrite, progress=progress,
        tokens=tokens, steps=steps, seq_len=seq_len, batch_size=batch_size, lr=lr, train=train, loss=loss, temperature=temperature,
        hidden_weight=hidden_weight, attention_weight=attention_weight, warmup=warmup, gradient_checkpointing=gradient_checkpointing, seed=seed, eval_every=eval_every,
        eval_windows=eval_windows, until_kl=until_kl, until_ppl_increase=increase,
    )  # fmt: skip


def export(
    source: PathLike,
    output: PathLike,
    *,
    revision: str | None = None,
    opset: int = 23,
    dtype: str | None = None,
    attention: str = "auto",
    graphs: str | None = None,
    optimize: str | None = "auto",
    position_ids: bool = False,
    trt_version: str | None = None,
    int4_block_size: int | None = None,
    int4_symmetric: bool | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> ExportSummary:
    """Export a checkpoint folder to ONNX, one fused attention node per layer (`headfold export`).

    Returns the folder's export.json. Raises CheckFailed when a layer did not fuse.

    Args:
        source: a checkpoint folder (source or converted) or hub id.
        revision: branch, tag or commit of a hub id.
        output: the folder to write.
        opset: 23, 24 or 25.
        dtype: "fp32", "fp16" or "bf16" weights; "int4": MatMul weights in 4 bits (ONNX Runtime's
            MatMulNBits, decoders), everything else fp32; None: the checkpoint's own.
        attention: "auto" (GroupQueryAttention in a merged decoder graph that ONNX Runtime runs, else the
            standard Attention), "onnx" (standard Attention) or "ort-gqa" (com.microsoft.GroupQueryAttention).
        graphs: decoders: "merged" (model.onnx + genai_config.json: an onnxruntime-genai folder) or
            "split" (prefill.onnx + decode.onnx, what `build` takes); None: split for a `trt_version`
            target, else merged, as the command.
        optimize: "ort" for ONNX Runtime's fused ops; "auto" for them on GroupQueryAttention graphs; "none".
        position_ids: merged decoders: take a position_ids input.
        trt_version: decompose what that TensorRT release's parser lacks, e.g. "10.14".
        int4_block_size: dtype "int4": weights per quantization block (16 to 256; None: 32).
        int4_symmetric: dtype "int4": symmetric blocks without zero points (None: True) or asymmetric.
        overwrite: replace an output headfold wrote before.
        progress: show progress.
    """
    from headfold.graphs.export import export as export_checkpoint
    from headfold.ground import export_summary

    export_checkpoint(
        source, output, revision=revision, opset=opset, dtype=dtype, attention=attention, overwrite=overwrite, progress=progress,
        trt_version=trt_version, graphs=graphs, optimize=optimize, explicit_positions=position_ids,
        int4_block_size=int4_block_size, int4_symmetric=int4_symmetric,
    )  # fmt: skip
    return export_summary.load(Path(output))


def build(
    source: PathLike,
    output: PathLike,
    *,
    precision: str | None = None,
    batch: str | None = None,
    seq: str | None = None,
    past: str | None = None,
    workspace: str | None = None,
    timing_cache: PathLike | None = None,
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
        precision: "fp32", "fp16" or "bf16"; None: the graph's own.
        batch, seq, past: optimization profile ranges "MIN:OPT:MAX" (None: derived from the model).
        workspace: builder workspace limit, e.g. "4GiB".
        timing_cache: tactic timing cache, loaded when present and updated.
        trt_version: the release to plan for (dry runs only, where it differs from the installed one).
        require_fused_attention: fail unless every engine's attention is one fused kernel.
        dry_run: plan and lint only.
        overwrite: replace an output headfold wrote before.
    """
    from headfold.engines.env import target_for
    from headfold.engines.plan import make_plan

    target = target_for(trt_version, dry_run=dry_run)
    plan = make_plan(Path(source), Path(output), target, precision=precision, batch=batch, seq=seq, past=past, workspace=workspace, timing_cache=_path(timing_cache))
    if dry_run:
        plan.check()
        return plan
    from headfold.engines.build import build as build_engines

    return build_engines(plan, overwrite=overwrite, require_fused_attention=require_fused_attention)


def verify(
    reference: PathLike,
    candidate: PathLike,
    *,
    check: str = "auto",
    revision: str | None = None,
    text: PathLike | None = None,
    token_ids: PathLike | None = None,
    window: int = 256,
    max_rows: int | None = 128,
    batch_size: int = 8,
    seed: int = 0,
    decode_steps: int = 16,
    budget: PathLike | None = None,
    max_ppl_increase: Fraction | None = None,
    max_kl: float | None = None,
    min_top1: Fraction | None = None,
    min_cosine: float | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    progress: bool = True,
) -> Report:
    """Compare CANDIDATE with REFERENCE on the same inputs (`headfold verify`); the report.

    `report.passed` says whether every budget held; `report.raise_for_failures()` raises
    CheckFailed (the CLI's exit 1); `report.write(json_path=…, markdown_path=…, junit_path=…)`.

    Args:
        reference, candidate: checkpoint folders or hub ids (run in torch), export folders or .onnx files
            (ONNX Runtime), engines (TensorRT).
        check: "auto" (same model → fidelity, a conversion of `reference` → loss), "fidelity", "loss".
        revision: branch, tag or commit of the hub ids among them.
        text: UTF-8 text fed to both sides; None: the built-in held-out text.
        token_ids: rows of token ids (one row per line) instead of a text.
        window: longest row in tokens.
        max_rows: seeded subset of this many rows; None: all.
        batch_size: rows per batch.
        seed: seed of the row choice.
        decode_steps: decoder exports: tokens per row fed one by one through the KV cache (0: none).
        budget: a TOML/YAML/JSON budget file; the arguments below override it.
        max_ppl_increase: loss: largest relative perplexity increase, e.g. "5%".
        max_kl: loss: largest mean per-token KL(reference ‖ candidate), in nats.
        min_top1: smallest top-1 agreement, e.g. "90%".
        min_cosine: smallest cosine.
        atol, rtol: fidelity: an element fails when it exceeds both.
        progress: show a progress bar (rows done).
    """
    from headfold.verification.api import verify as run_verify

    return run_verify(
        reference, candidate, check=check, revision=revision, progress=progress,
        inputs=_inputs(text, token_ids, window, max_rows, batch_size, seed, decode_steps),
        thresholds=_thresholds(budget, max_ppl_increase, max_kl, min_top1, min_cosine, atol, rtol),
    )  # fmt: skip


def run(
    source: PathLike,
    output: PathLike,
    kv_heads: int | Sequence[int],
    *,
    method: str = DEFAULT_METHOD,
    revision: str | None = None,
    calibration: PathLike | None = None,
    calibration_tokens: int = 4096,
    max_shard_size: str | int | None = None,
    allow_pickle: bool = False,
    distill_data: PathLike | None = None,
    distill_tokens: int | str | None = None,
    distill_options: dict[str, Any] | None = None,
    opset: int = 23,
    dtype: str | None = None,
    attention: str = "onnx",
    graphs: str | None = None,
    optimize: str | None = None,
    position_ids: bool = False,
    trt_version: str | None = None,
    precision: str | None = None,
    batch: str | None = None,
    seq: str | None = None,
    past: str | None = None,
    workspace: str | None = None,
    timing_cache: PathLike | None = None,
    text: PathLike | None = None,
    window: int = 256,
    max_rows: int | None = 128,
    batch_size: int = 8,
    seed: int = 0,
    decode_steps: int = 16,
    budget: PathLike | None = None,
    max_ppl_increase: Fraction | None = None,
    max_kl: float | None = None,
    min_top1: Fraction | None = None,
    min_cosine: float | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Report:
    """convert → (distill) → export → build → verify into `output`/{convert,distill,export,build,verify}
    (`headfold run`); the verify report. Stages whose inputs are unchanged are skipped.

    Args:
        source: the MHA checkpoint folder or hub id.
        output: the run folder: new, empty, or one `run` wrote (`overwrite`: any folder; its
            other files stay).
        kv_heads, method, revision, calibration, calibration_tokens, max_shard_size, allow_pickle:
            as for `convert` (`seed` below seeds the calibration windows too).
        distill_data: add the distill stage, trained on this text (as `distill`'s `data`).
        distill_tokens: the distill stage's `tokens` (alone: the embedded model's own text).
        distill_options: further keywords of `distill` for that stage (lr, train, seq_len, …).
        opset, dtype, attention, graphs, optimize, position_ids, trt_version: as for `export`
            (graphs None: split where TensorRT builds engines, else merged; dtype None: the
            checkpoint's own, but fp32 for bf16, which the verify stage's CPU ONNX Runtime cannot run).
        precision, batch, seq, past, workspace, timing_cache: as for `build`, where it runs.
        text … rtol: the inputs and budgets, as for `verify`.
        overwrite: accept an output folder of other files.
        progress: show each stage's progress.
    """
    from headfold.pipeline import run as run_pipeline

    stage = None
    if distill_data is not None or distill_tokens is not None or distill_options:
        from headfold.distillation.stage import DistillStage

        options = {**(distill_options or {}), **({} if distill_tokens is None else {"tokens": distill_tokens})}
        stage = DistillStage(_path(distill_data), options, _path(options.pop("eval_data", None)))
    exporting = {"opset": opset, "dtype": dtype, "attention": attention, "graphs": graphs, "optimize": optimize, "explicit_positions": position_ids, "trt_version": trt_version}
    profile = {"precision": precision, "batch": batch, "seq": seq, "past": past, "workspace": workspace, "timing_cache": _path(timing_cache)}
    return run_pipeline(
        source, output, kv_heads, method=method, revision=revision, max_shard_size=max_shard_size, allow_pickle=allow_pickle,
        calibration={"calibration": calibration, "calibration_tokens": calibration_tokens, "seed": seed}, distill=stage, export=exporting,
        build=profile, inputs=_inputs(text, None, window, max_rows, batch_size, seed, decode_steps),
        thresholds=_thresholds(budget, max_ppl_increase, max_kl, min_top1, min_cosine, atol, rtol), overwrite=overwrite, progress=progress,
    )  # fmt: skip


def load_model(path: PathLike) -> transformers.PreTrainedModel:
    """A runnable torch model (eval mode) for any source or converted checkpoint folder, including
    families whose converted checkpoints plain transformers cannot load (docs/deploying.md); an
    encoder-decoder's with GQA self- and cross-attention, generate() keeping the EncoderDecoderCache."""
    from headfold.converter.modeling import load_model as load

    return load(path)


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


def _fraction(value: Fraction | None, name: str) -> float | None:
    from headfold.ground.units import parse_fraction

    return None if value is None else parse_fraction(value, name)


def _inputs(text, token_ids, window: int, max_rows: int | None, batch_size: int, seed: int, decode_steps: int) -> InputSpec:
    from headfold.verification import InputSpec

    return InputSpec(text=_path(text), token_ids=_path(token_ids), window=window, max_rows=max_rows, batch_size=batch_size, seed=seed, decode_steps=decode_steps)


def _thresholds(budget, max_ppl_increase, max_kl, min_top1, min_cosine, atol, rtol) -> Thresholds:
    from headfold.verification import Thresholds

    given = {"max_ppl_increase": max_ppl_increase, "max_kl": max_kl, "min_top1": min_top1, "min_cosine": min_cosine, "atol": atol, "rtol": rtol}
    return Thresholds(file=_path(budget), **{name: _fraction(value, name) for name, value in given.items()})
