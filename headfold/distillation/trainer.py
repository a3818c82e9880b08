"""The training loop: AdamW on what trains, linear warmup then cosine, evaluations, resumable checkpoints."""

from __future__ import annotations

import math
from dataclasses import replace
from itertools import islice
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers.modeling_layers import GradientCheckpointingLayer

from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.modeling import load_model, parameter_names
from headfold.distillation import sharding, state
from headfold.distillation.audio import AudioPlan, Batch
from headfold.distillation.data import WindowPlan
from headfold.distillation.objective import Objective, evaluate
from headfold.distillation.trainable import attention_blocks, merged, select, trainable_state
from headfold.ground.atomic import raise_if_signalled
from headfold.ground.errors import BadInput, first_line
from headfold.ground.settings import RunOptions

MAX_GRAD_NORM = 1.0
# Without --eval-every, evaluation takes at most EVAL_SHARE of a run's compute: up to EVALUATIONS after the one
# before training, on every held-out window while that fits, else fewer evaluations, then fewer windows (at
# least MIN_EVAL_WINDOWS). Compute counted in forward passes of one window: a training window runs the teacher
# and the student forward and the student backward (about two forwards), an evaluated one both forward.
EVAL_SHARE, EVALUATIONS, MIN_EVAL_WINDOWS = 0.1, 8, 8
TRAIN_PASSES, EVAL_PASSES = 4, 2


def evaluation_schedule(steps: int, windows_per_step: int, held_out: int, eval_every: int | None) -> tuple[int, int]:
    """(steps between evaluations, held-out windows each evaluation reads); `eval_every` given: it, on every window."""
    if eval_every is not None:
        return eval_every, held_out
    budget = EVAL_SHARE * steps * windows_per_step * TRAIN_PASSES
    evaluations = min(EVALUATIONS, max(1, int(budget // (held_out * EVAL_PASSES)) - 1))  # besides the one before training
    affordable = int(budget // ((evaluations + 1) * EVAL_PASSES))
    return math.ceil(steps / evaluations), min(held_out, max(MIN_EVAL_WINDOWS, affordable))


class Trainer:
    def __init__(
        self, accelerator, teacher: Path, student: SourceCheckpoint, plan: WindowPlan | AudioPlan, opts: RunOptions, steps: int, objective: Objective
    ) -> None:
        self.accelerator, self.plan, self.opts, self.steps, self.objective = accelerator, plan, opts, steps, objective
        self.metric = "cosine" if objective.encoder else "kl"
        device = accelerator.device
        torch.manual_seed(opts.seed)  # LoRA's initialisation
        self.teacher = load_model(teacher, dtype=torch.float32).to(device).requires_grad_(False)
        model = load_model(student.folder, dtype=torch.float32)
        self.names = parameter_names(model, student.folder)  # checkpoint tensor → parameter
        if opts.gradient_checkpointing:
            _checkpoint_layers(model)
        # the attention blocks whose outputs the loss matches, found before LoRA wraps the model (they stay the same modules)
        matched = objective.attention_weight > 0
        self.teacher_blocks, self.student_blocks = [attention_blocks(m, student, self.names) for m in (self.teacher, model)] if matched else ([], [])
        trained, self.changed = select(model, student, self.names, opts.train)  # the model, or LoRA's wrapper of it
        if accelerator.is_fsdp2:
            sharding.one_module_per_tied_embedding(trained)
        params = [p for p in trained.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=opts.lr or 0.0, weight_decay=0.0)  # no --lr: rate.choose sets it
        # together: under FSDP2 Accelerate shards the model, then points the optimizer at the shards
        self.model, self.optimizer = accelerator.prepare(trained, optimizer)
        # not accelerator.prepare'd: its wrapper would step once per process
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _warmup_cosine(steps, opts.warmup))
        self.eval_every, evaluated = evaluation_schedule(steps, opts.batch_size * accelerator.num_processes, opts.eval_windows, opts.eval_every)
        self.eval_batch = plan.held_out(evaluated, device, self.teacher, opts.batch_size)
        self.progress = state.Progress()

    @property
    def plain(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def restore(self, checkpoint: Path) -> None:
        self.progress, tensors, states = state.load(checkpoint)
        fix = f"delete {checkpoint.parent} to start over"
        missing = set(tensors) - {n for n, _ in self.plain.named_parameters()}
        if missing:
            raise BadInput(f"the resumable state {checkpoint} has tensors the model lacks (e.g. {sorted(missing)[0]}); {fix}")
        try:
            self.plain.load_state_dict(tensors, strict=False)
            self.optimizer.load_state_dict(states["optimizer"])
            self.schedule.load_state_dict(states["schedule"])
            torch.set_rng_state(states["rng"])
        except (RuntimeError, ValueError, KeyError, TypeError) as err:
            raise BadInput(f"the resumable state {checkpoint} does not fit this run ({type(err).__name__}: {first_line(err)}); {fix}") from None

    def evaluate(self) -> dict[str, float]:
        return evaluate(self.objective, self.plain, self.teacher, self.eval_batch, self.opts.batch_size)

    def _record_eval(self, bar=None) -> dict[str, float]:
        if bar is not None:
            bar.set_postfix_str(f"evaluating on {len(self.eval_batch)} held-out windows")  # said while it runs
        scores = self.evaluate()
        if not all(math.isfinite(v) for v in scores.values()):
            if self.progress.step == 0:
                raise BadInput(
                    f"the teacher and student give non-finite held-out scores before any training ({scores}); check both checkpoints (config.json, weights)"
                )
            self._diverged(f"the held-out {self.metric} became {scores[self.metric]}")
        self.check_finite()
        self.progress.log["eval"].append({"step": self.progress.step, "tokens": self.progress.tokens, **scores})
        return scores

    def _diverged(self, what: str) -> None:
        raise state.Diverged(f"distillation diverged at step {self.progress.step}: {what}; nothing was written: lower --lr (it was {self.opts.lr:g})")

    def check_finite(self) -> None:
        """Diverged when any trained weight is NaN or infinite (checked at each evaluation, save and the
        end; every process checks its shard and all agree, so none waits for one that stopped)."""
        local = [getattr(p, "to_local", lambda p=p: p)() for p in self.model.parameters() if p.requires_grad]
        bad = torch.tensor(float(sum(not bool(torch.isfinite(t.detach()).all()) for t in local)), device=self.accelerator.device)
        if float(self.accelerator.reduce(bad, "sum")) > 0:
            self._diverged("a trained weight became NaN or infinite")

    def reached(self, scores: dict[str, float]) -> bool:
        o = self.opts
        return (o.until_kl is not None and scores["kl"] <= o.until_kl) or (o.until_ppl_increase is not None and scores["ppl_increase"] <= o.until_ppl_increase)

    def train(self, folder: Path, save_every: int | None, show: bool) -> tuple[dict[str, float], bool | None]:
        """Run to the last step (or the --until target); (final held-out scores, target reached or None)."""
        acc, p = self.accelerator, self.progress
        per_process, rank = self.opts.batch_size, acc.process_index
        stream = self.plan.train_windows(skip=p.windows)
        bar = tqdm(total=self.steps * per_process * acc.num_processes * self.plan.seq_len, initial=p.tokens, unit="tok", unit_scale=True,
                   desc="distill", disable=not (show and acc.is_main_process), dynamic_ncols=True)  # fmt: skip
        scores = self._record_eval(bar) if p.step == 0 else p.log["eval"][-1]
        targeted = self.opts.until_kl is not None or self.opts.until_ppl_increase is not None
        with bar:
            while p.step < self.steps and not (targeted and self.reached(scores)):
                raise_if_signalled()  # one a library swallowed while the models loaded or a step ran
                rows = list(islice(stream, per_process * acc.num_processes))  # the global batch: this process trains on its slice
                loss = self.step(self.batch(rows[rank * per_process : (rank + 1) * per_process]))
                tokens = len(rows) * self.plan.seq_len
                p.step, p.windows, p.tokens = p.step + 1, p.windows + len(rows), p.tokens + tokens
                p.log["train"].append({"step": p.step, "tokens": p.tokens, "loss": loss, "lr": self.schedule.get_last_lr()[0]})
                if p.step % self.eval_every == 0 or p.step == self.steps or p.step in self.opts.eval_at:
                    scores = self._record_eval(bar)
                if save_every and p.step % save_every == 0 and p.step < self.steps:
                    self.save(folder)
                bar.update(tokens)
                bar.set_postfix({"loss": f"{loss:.4g}", self.metric: f"{scores[self.metric]:.4g}"})
        if p.log["eval"][-1]["step"] != p.step:
            scores = self._record_eval()
        return scores, (self.reached(scores) if targeted else None)

    def batch(self, rows: list) -> Batch:
        """Rows of the data stream as the objective's input on this process's device (audio: with targets)."""
        return self.plan.batch(rows, self.accelerator.device, self.teacher, self.opts.batch_size)

    def step(self, ids) -> float:
        """One step of the run: an update, then the schedule's next rate."""
        value = self.update(ids)
        self.schedule.step()
        if not math.isfinite(value):
            self._diverged(f"the training loss became {value}")
        return value

    def update(self, ids) -> float:
        """One optimizer update on `ids` at the rate the optimizer holds; the loss, averaged over the processes."""
        acc, objective = self.accelerator, self.objective
        with acc.autocast():
            with torch.no_grad():
                target = objective.outputs(self.teacher, ids, blocks=self.teacher_blocks)
            loss = objective(objective.outputs(self.model, ids, blocks=self.student_blocks), target, ids)
        acc.backward(loss)
        acc.clip_grad_norm_(self.trained(), MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(acc.reduce(loss.detach(), "mean"))

    def trained(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def snapshot(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """What the student trains and torch's RNG, as they are now (rate.choose probes from here)."""
        return [p.detach().clone() for p in self.trained()], torch.get_rng_state()

    def restore_snapshot(self, snapshot: tuple[list[torch.Tensor], torch.Tensor]) -> None:
        """Back to `snapshot`, with the optimizer's moments cleared: as if no step had been taken."""
        tensors, rng = snapshot
        with torch.no_grad():
            for p, t in zip(self.trained(), tensors, strict=True):
                p.copy_(t)
        self.optimizer.state.clear()
        torch.set_rng_state(rng)

    def rate_factor(self, step: int) -> float:
        """The schedule's factor on the peak rate at `step` (optimizer steps already taken)."""
        return _warmup_cosine(self.steps, self.opts.warmup)(step)

    def set_rate(self, lr: float) -> None:
        """Every parameter group at `lr`, constant (the schedule untouched)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def use_rate(self, lr: float) -> None:
        """The run's peak rate becomes `lr`: the schedule starts over from it."""
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] = lr
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _warmup_cosine(self.steps, self.opts.warmup))
        self.opts = replace(self.opts, lr=lr)

    def save(self, folder: Path) -> None:
        self.check_finite()  # a resumable checkpoint of NaN weights would resume into nothing
        if self.accelerator.is_main_process:
            state.save(folder, self.progress, trainable_state(self.plain), self.optimizer.state_dict(), self.schedule.state_dict())
        self.accelerator.wait_for_everyone()

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """Trained tensors by checkpoint name (LoRA merged), for the output writer."""
        self.check_finite()
        weights = self.accelerator.get_state_dict(merged(self.plain))
        return {ckpt: weights[param] for ckpt, param in self.names.items() if param in self.changed and param in weights}


def _checkpoint_layers(model: transformers.PreTrainedModel) -> None:
    """Recompute each layer in the backward pass. transformers checkpoints only layers in training
    mode; the model stays in eval mode (dropout off, as in the teacher) and only the layers claim it."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True  # this module only, not its children


def _warmup_cosine(steps: int, warmup: float):
    ramp = max(1, round(steps * warmup))

    def factor(step: int) -> float:  # `step` optimizer steps already taken
        if step < ramp:
            return (step + 1) / ramp
        return 0.5 * (1 + math.cos(math.pi * (step - ramp) / max(1, steps - ramp)))

    return factor
