"""`headfold distill TEACHER STUDENT OUT`: recover what pooling lost by distilling from the MHA original.

Everything the request can get wrong is checked before a model loads (nothing is written on bad
input). Training runs through 🤗 Accelerate: one process here, or data-parallel (DDP, or FSDP2
from `accelerate launch --use_fsdp` or an Accelerate config: sharding.py) under `accelerate
launch` / `torchrun`, where every process takes its slice of each global batch and only the main
process writes. The teacher is frozen (eval, no grad) and never sharded; the student runs with
dropout off, so distillation matches the teacher's deterministic function and a resumed run
repeats an uninterrupted one exactly on CPU.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import torch

from headfold import corpus
from headfold.converter.checkpoint import CheckpointFacts, SourceCheckpoint
from headfold.converter.sources import checkpoint_folders
from headfold.distillation import output, rate, sharding, state
from headfold.distillation.audio import AudioPlan, audio_plan
from headfold.distillation.budget import is_embedded, parse_tokens, pretraining_tokens
from headfold.distillation.data import WindowPlan, builtin_source, encoder_for, file_source
from headfold.distillation.objective import Objective
from headfold.distillation.trainer import Trainer
from headfold.ground import manifest as manifests
from headfold.ground.artifacts import MANIFEST
from headfold.ground.atomic import atomic_output, check_disjoint, check_output, cleanup_on_sigterm
from headfold.ground.errors import BadInput, BadOption
from headfold.ground.hashing import sha256_file
from headfold.ground.lazy import lazy_import
from headfold.ground.settings import DistillOptions, RunOptions
from headfold.ground.units import whole

log = logging.getLogger(__name__)
accelerate = lazy_import("accelerate")

DEFAULT_STEPS = 40


# The defaults for each kind of student are the best measured on the recovery benchmarks
# (benchmarks/distill_recovery.py, distill_zoo.py; the figures are in benchmarks/results/, rendered in docs/benchmarks.md).
# Weight of the per-layer hidden-state match (objective.hidden_distance): it cut a decoder's held-out KL
# for the same tokens, most at this weight once steps were small (distill_recipe_sweep_batch1.json).
# An encoder's loss already matches its last hidden state, and the match left MiniLM's cosine where it
# was (`encoder_hidden_weight`), so encoders skip its memory by default.
DECODER_HIDDEN_WEIGHT, ENCODER_HIDDEN_WEIGHT = 30.0, 0.0
# Weight of the per-layer attention-output match (the same distance between each attention block's
# outputs): off unless asked for.
ATTENTION_WEIGHT = 0.0
# What trains: Q/K/V/O alone ended below every tensor in KL at every kv and start (`decoder` against
# `decoder_train_all`), with optimizer state for the attention weights only; free MLPs fit the training
# text more than the teacher. Encoders keep `all`, what MiniLM was measured with.
DECODER_TRAIN, ENCODER_TRAIN = "attention", "all"
# Windows per step and process. 8 beat 16 (distill_recipe_sweep.json), and for a small budget more,
# smaller steps keep winning (distill_recipe_sweep_batch1.json, `decoder_quarter_batch8`): so --tokens
# shrinks the default batch, down to 1, until the run takes MIN_STEPS steps. That costs wall time only
# on such small budgets; larger ones keep batch 8, which uses a GPU better.
DEFAULT_BATCH, MIN_STEPS = 8, 640


def distill(
    teacher: str | os.PathLike,
    student: str | os.PathLike,
    out: str | os.PathLike,
    *,
    data: str | os.PathLike | None = None,
    eval_data: str | os.PathLike | None = None,
    save_every: int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    revision: str | None = None,
    **options: Any,
) -> Path:
    """Distill STUDENT (a headfold conversion of TEACHER) towards TEACHER on `data`; the output folder.

    TEACHER and STUDENT are checkpoint folders or hub ids ORG/NAME (at `revision`). `options` are the
    fields of DistillOptions. Raises BadInput (nothing written) for a bad request.
    """
    teacher, student = checkpoint_folders(teacher, student, revision=revision)
    asked = requested(teacher, options)
    whole("--save-every", save_every, 1)
    teacher_ckpt, student_ckpt, manifest = check_pair(teacher, student)
    reads = [teacher, student, *(Path(p) for p in (data, eval_data) if p is not None)]
    out = check_output(Path(out), overwrite=overwrite, sources=reads, is_dir=True)
    check_disjoint(state.state_folder(out), reads)
    encoder_model = student_ckpt.facts.kind == "encoder"
    check_options(asked, student_ckpt.facts, encoder_model)
    log.info(
        f"distill: tokenising {data or 'the built-in text'} with {teacher}'s tokenizer"
    )  # the request is valid: say what the silence before the budget line is
    decoder_start = seq2seq_start(student_ckpt)
    plan = window_plan(teacher, student_ckpt, data, eval_data, asked, encoder_model)
    plan.check()

    gpu = torch.cuda.is_available()  # cpu=True: Accelerate's only way to data-parallel CPU processes (gloo)
    # an encoder's pooler never reaches the hidden-state loss: DDP must be told, or it waits for its gradients
    unused = accelerate.DistributedDataParallelKwargs(find_unused_parameters=encoder_model)
    sharding.check_request(save_every, resume)
    accelerator = accelerate.Accelerator(cpu=not gpu, mixed_precision="bf16" if gpu else "no", kwargs_handlers=[unused])
    sharding.shard_cpu_processes(accelerator)
    opts = resolve_defaults(asked, encoder_model, accelerator.num_processes)
    steps = total_steps(opts, accelerator.num_processes)
    if accelerator.is_main_process:
        log.info(budget_line(plan, opts, steps, accelerator.num_processes))
        if notes := plan.notes:
            log.info(f"distill: the targets are {notes['targets']}; log-mel features from {notes['features']}")
    identity = run_identity(teacher, student, plan, opts, accelerator.num_processes)
    folder = state.state_folder(out)
    keep = save_every is not None or resume
    hold = state.claimed(folder, resume=resume, keep=keep) if accelerator.is_main_process else nullcontext()
    with cleanup_on_sigterm(), hold:  # SIGTERM unwinds like Ctrl-C: the state goes unless kept, exit 143
        accelerator.wait_for_everyone()  # the main process has removed a stale state before anyone reads it
        checkpoint = state.open_run(folder, identity, resume)
        accelerator.wait_for_everyone()  # every process has read the state before the main one starts a new one
        trainer = Trainer(
            accelerator,
            teacher,
            student_ckpt,
            plan,
            opts,
            steps,
            Objective(encoder_model, opts.loss, opts.temperature, opts.hidden_weight, opts.attention_weight, decoder_start),
        )
        start = time.perf_counter()
        if checkpoint is not None:
            trainer.restore(checkpoint)
            if "rate" in trainer.progress.log:  # the rate the interrupted run chose (its optimizer state holds it too)
                trainer.opts = replace(trainer.opts, lr=trainer.progress.log["rate"][0]["lr"])
            if accelerator.is_main_process:
                log.info(f"distill: resumed from {checkpoint} (step {trainer.progress.step} of {steps})")
        else:
            if opts.lr is None:
                chosen(trainer, progress)
            if accelerator.is_main_process and save_every is not None:
                state.begin(folder, identity)
        final, reached = trainer.train(folder, save_every, progress)
        seconds = time.perf_counter() - start
        weights = trainer.checkpoint_state()  # every process: FSDP gathers the shards to the main one
        if accelerator.is_main_process:
            record = run_record(teacher, student, manifest, identity, plan, opts, accelerator, trainer, final, reached, seconds)
            with atomic_output(out, overwrite=overwrite, sources=reads) as tmp:
                files = output.write_checkpoint(student_ckpt, weights, tmp)
                output.write_log(tmp, trainer.progress.log, trainer.metric)
                output.write_manifest(tmp, manifest, record, files)
            state.finish(folder)
    # The DDP reducer holds the process group: dropped here, while every process is still at the same
    # point, the group ends in end_training; dropped after it (when distill returns), gloo's teardown
    # could wait on a process that has already exited.
    del trainer
    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return out


def chosen(trainer: Trainer, progress: bool) -> None:
    """The run's rate chosen on --data (rate.choose), said and kept in the run's log (a resumed run reads it there)."""
    choice = rate.choose(trainer, progress)
    trainer.progress.log["rate"] = [choice.record()]
    if trainer.accelerator.is_main_process:
        tried = ", ".join(f"{lr} → {score:.4g}" if math.isfinite(score) else f"{lr} diverged" for lr, score in choice.scores.items())
        log.info(f"distill: --lr {choice.lr:g}, the lowest held-out loss after {choice.steps} steps from {choice.start:.4g} ({tried}); --lr overrides")


def run_record(
    teacher: Path,
    student: Path,
    manifest: dict,
    identity: dict,
    plan: WindowPlan | AudioPlan,
    opts: DistillOptions,
    accelerator,
    trainer: Trainer,
    final,
    reached,
    seconds: float,
) -> dict[str, Any]:
    """The manifest's `distillation` entry: inputs and their hashes, options, the run and its scores."""
    return {
        "teacher": {"path": str(teacher.resolve()), "config_sha256": identity["teacher_config_sha256"]},
        "student": {"path": str(student.resolve()), "manifest": manifest},
        "data": {
            "train": plan.train.name,
            "train_sha256": plan.train.sha256,
            "heldout": plan.heldout.name if plan.heldout else f"first {opts.eval_windows} windows of the training data",
            "heldout_sha256": (plan.heldout or plan.train).sha256,
            "tokenizer": plan.encoder.name,
            **plan.notes,
        },
        "options": asdict(trainer.opts),
        "learning_rate": trainer.progress.log["rate"][0] if "rate" in trainer.progress.log else {"given": opts.lr},
        "evaluation": {"every": trainer.eval_every, "windows": len(trainer.eval_batch)},
        "processes": accelerator.num_processes,
        "fsdp": accelerator.is_fsdp2,
        "steps": trainer.progress.step,
        "tokens": trainer.progress.tokens,
        "target_reached": reached,
        "final_eval": final,
        "initial_eval": trainer.progress.log["eval"][0],
        "seconds": round(seconds, 1),
    }


def check_pair(teacher: Path, student: Path) -> tuple[SourceCheckpoint, SourceCheckpoint, dict[str, Any]]:
    """Both checkpoints valid, the same vocabulary, layers and width, and STUDENT converted from TEACHER."""
    t, s = SourceCheckpoint(teacher), SourceCheckpoint(student)
    for what, fact in (("vocabulary", "vocab_size"), ("layers", "layers"), ("hidden size", "hidden")):
        if (ours := getattr(t.facts, fact)) != (theirs := getattr(s.facts, fact)):
            raise BadInput(f"teacher and student differ in {what} ({ours} vs {theirs}); the student must be a headfold conversion of the teacher")
    manifest_file = student / MANIFEST
    if not manifest_file.is_file():
        raise BadInput(
            f"student {student} has no {MANIFEST}, so it is not a headfold conversion; make one with headfold convert {teacher} STUDENT --kv-heads N"
        )
    manifest = manifests.load(student)
    if manifest.source.config_sha256 != sha256_file(teacher / "config.json"):
        raise BadInput(
            f"student {student} was converted from {manifest.source.path}, not from teacher {teacher} (config.json differs); pass the student's own original"
        )
    check_copied_tensor(t, s, student)
    return t, s, manifest.to_dict()


def check_copied_tensor(t: SourceCheckpoint, s: SourceCheckpoint, student: Path) -> None:
    """Models fine-tuned from one base share their config.json, so also compare the bytes of a tensor
    conversion copies unchanged: the token embedding (vocabulary rows), else the largest non-attention one."""
    attention = set(t.attention.owner())
    same = [i for n, i in t.tensors.items() if n not in attention and n in s.tensors and (s.tensors[n].shape, s.tensors[n].dtype) == (i.shape, i.dtype)]
    if not same:
        raise BadInput(f"student {student} shares no unchanged tensor with teacher {t.folder}; the student must be a headfold conversion of the teacher")
    vocab = t.facts.vocab_size
    name = max(same, key=lambda i: (i.shape[:1] == (vocab,), i.nbytes, i.name)).name
    if not torch.equal(t.get(name).reshape(-1).view(torch.uint8), s.get(name).reshape(-1).view(torch.uint8)):
        raise BadInput(
            f"student {student} was not converted from teacher {t.folder}: its {name} differs (same config.json, other weights); pass the "
            "student's own original"
        )


def seq2seq_start(student: SourceCheckpoint) -> int | None:
    """An encoder-decoder's decoder start token (its windows split into source → target, or a clip and
    its transcript); None for other kinds."""
    if not student.spec.encoder_decoder:
        return None
    start = student.config.get("decoder_start_token_id")
    if start is None:
        raise BadInput(
            f"config.json of {student.folder} has no decoder_start_token_id, which teacher forcing starts the target with; restore it from the "
            "original checkpoint"
        )
    return start


def requested(teacher: Path, options: dict[str, Any]) -> DistillOptions:
    """`options` (DistillOptions fields) as DistillOptions; tokens may be text: 200k, 1.5M, 5% (the CLI passes it as given)."""
    if isinstance(options.get("tokens"), str):
        options = {**options, "tokens": parse_tokens(options["tokens"], pretraining_tokens(teacher))}
    return DistillOptions(**options)


def resolve_defaults(opts: DistillOptions, encoder_model: bool, processes: int) -> RunOptions:
    """The options left unset get the measured best for the student's kind (and are recorded so), the batch
    for the process count (default_batch_size); --tokens as text must have been read (`requested`)."""
    if isinstance(opts.tokens, str):
        raise TypeError(f"--tokens {opts.tokens!r} is read by requested() before its defaults are resolved")
    given = {f.name: getattr(opts, f.name) for f in fields(opts)}
    return RunOptions(
        **given
        | {
            "tokens": opts.tokens,
            "batch_size": default_batch_size(opts.tokens, opts.seq_len, processes) if opts.batch_size is None else opts.batch_size,
            "hidden_weight": (ENCODER_HIDDEN_WEIGHT if encoder_model else DECODER_HIDDEN_WEIGHT) if opts.hidden_weight is None else opts.hidden_weight,
            "attention_weight": ATTENTION_WEIGHT if opts.attention_weight is None else opts.attention_weight,
            "train": (ENCODER_TRAIN if encoder_model else DECODER_TRAIN) if opts.train is None else opts.train,
        }
    )


def check_options(opts: DistillOptions, student: CheckpointFacts, encoder_model: bool) -> None:
    """What the options cannot be for this student (their domains DistillOptions checks itself)."""
    if encoder_model and (opts.loss != "kl" or opts.until_kl is not None or opts.until_ppl_increase is not None):
        raise BadInput("an encoder has no next-token distribution: --loss kl+ce, --until-kl and --until-ppl-increase are for decoders")
    if student.positions and opts.seq_len > student.positions:
        raise BadOption("--seq-len", f"{opts.seq_len} exceeds the model's {student.positions} positions; choose at most {student.positions}")


def window_plan(teacher: Path, student: SourceCheckpoint, data, eval_data, opts: DistillOptions, encoder_model: bool) -> WindowPlan | AudioPlan:
    """Training and held-out text (the embedded model's own corpus splits when no --data is given), or
    an audio encoder-decoder's clips and transcripts."""
    if student.facts.audio_input:
        vocab = int(student.facts.vocab_size or 0)
        return audio_plan(student.facts, vocab, data, eval_data, opts.seq_len, opts.eval_windows, opts.seed)
    embedded = is_embedded(teacher)
    if data is None and not embedded:
        raise BadInput("--data is required: pass a text, .jsonl or .parquet file or a datasets folder (the built-in text is the embedded model's own corpus)")
    pairs = student.spec.encoder_decoder
    train = builtin_source(corpus.train_text(), "built-in training split") if data is None else file_source(Path(data), pairs=pairs)
    heldout = file_source(Path(eval_data), "--eval-data", pairs) if eval_data is not None else None
    if heldout is None and data is None:
        heldout = builtin_source(corpus.heldout_text(), "built-in held-out split")
    encoder = encoder_for(student.folder, int(student.facts.vocab_size or 0), encoder_model)
    return WindowPlan(train, heldout, encoder, opts.seq_len, opts.eval_windows, opts.seed)


def default_batch_size(tokens: int | None, seq_len: int, processes: int = 1) -> int:
    """DEFAULT_BATCH windows per process, or fewer (down to 1) where `tokens` would give under MIN_STEPS steps."""
    if tokens is None:
        return DEFAULT_BATCH
    return max(1, min(DEFAULT_BATCH, tokens // (seq_len * processes * MIN_STEPS)))


def total_steps(opts: RunOptions, processes: int) -> int:
    per_step = opts.batch_size * opts.seq_len * processes
    if opts.tokens is None:
        return DEFAULT_STEPS if opts.steps is None else opts.steps
    if opts.tokens < per_step:
        raise BadInput(
            f"--tokens {opts.tokens} is below one batch ({opts.batch_size} × {opts.seq_len} tokens × {processes} process(es) = {per_step}); "
            "give more tokens, a smaller --batch-size or a shorter --seq-len"
        )
    return opts.tokens // per_step


def budget_line(plan: WindowPlan | AudioPlan, opts: RunOptions, steps: int, processes: int) -> str:
    """What the token budget means for the data: how many passes over --data it makes."""
    needed = steps * opts.batch_size * processes
    available = plan.repeated(needed)
    over = f"{needed / available:.1f} passes over the {available} windows of" if available else "less than one pass over"
    return (
        f"distill: {steps} steps × {opts.batch_size * processes} windows × {opts.seq_len} tokens = {needed * opts.seq_len:,} tokens, {over} {plan.train.name}"
    )


def run_identity(teacher: Path, student: Path, plan: WindowPlan | AudioPlan, opts: DistillOptions, processes: int) -> dict[str, Any]:
    """What a resumed run must share with the one that wrote the state (as JSON reads it back)."""
    identity = {
        "teacher_config_sha256": sha256_file(teacher / "config.json"),
        "student_manifest_sha256": sha256_file(student / MANIFEST),
        "data_sha256": plan.train.sha256,
        "eval_data_sha256": plan.heldout.sha256 if plan.heldout else None,
        "options": asdict(opts),
        "processes": processes,
    }
    return json.loads(json.dumps(identity))
