"""What distillation minimises and how the held-out windows are scored.

Decoders: forward KL(teacher ‖ student) of the next-token distributions per token, both softened by
the temperature T and scaled by T² (Hinton et al.) so the gradient size does not depend on T;
`kl+ce` adds the student's next-token cross-entropy. Encoder-decoders (`decoder_start` set): each
window is split into a prefix, the source, and its continuation, the target (Whisper: a clip's log-mel
features and its transcript, audio.py), which the decoder reads teacher-forced after its start token;
the same KL of the decoder's next-token distributions. A window
made from a (source, target) pair marks the positions it does not fill with data.ABSENT: they are
masked out of the encoder's attention and of the loss and scores. Encoders: MSE of the last hidden states plus
1 − cosine of the mean-pooled sentence embeddings (what sentence-transformers compares).
Both may add `hidden_weight` × the per-layer hidden-state match (hidden_distance): it tells every
layer what its output should be, not only the last one, and on the recovery benchmark it lowered the
decoder's held-out KL for the same tokens at every kv and start (`decoder_kl_only` against
`decoder_hw10_batch8` in benchmarks/results/distill_recovery.json). And `attention_weight` × the same
distance between each attention block's outputs (the module the spec's layer prefix names, as the
`local` conversion part fits it), read by forward hooks: the part of each layer that pooling changed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from headfold.distillation.audio import AudioBatch, Batch


@dataclass(frozen=True)
class Outputs:
    final: torch.Tensor  # logits (decoders) or last hidden states (encoders)
    layers: tuple[torch.Tensor, ...] = ()  # every layer's output hidden states, when they are matched
    attention: tuple[torch.Tensor, ...] = ()  # every attention block's output, when they are matched


@dataclass(frozen=True)
class Objective:
    encoder: bool
    loss: str = "kl"  # "kl" | "kl+ce"
    temperature: float = 1.0
    hidden_weight: float = 0.0
    attention_weight: float = 0.0
    decoder_start: int | None = None  # encoder-decoders: the decoder's start token; None for decoders and encoders

    def outputs(self, model: torch.nn.Module, ids: Batch, *, layers: bool = True, blocks: Sequence[torch.nn.Module] = ()) -> Outputs:
        """Of full windows (no padding, no mask); each layer's output too when the loss matches them, and
        the output of each of `blocks` (the model's attention blocks) when the loss matches those."""
        with _block_outputs(blocks if layers and self.attention_weight > 0 else ()) as attention:
            outputs = self._outputs(model, ids, layers and self.hidden_weight > 0)
        return replace(outputs, attention=tuple(attention))

    def _outputs(self, model: torch.nn.Module, ids: Batch, layers: bool) -> Outputs:
        if self.decoder_start is not None:
            return self._seq2seq_outputs(model, ids, layers)
        out = model(input_ids=ids, output_hidden_states=layers)
        final = out.last_hidden_state if self.encoder else out.logits
        return Outputs(final, tuple(out.hidden_states[1:]) if layers else ())  # [0]: the embeddings

    def split(self, ids: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """An encoder-decoder's window → (source, target): its first half and the continuation; a clip's
        log-mel features and its transcript's ids."""
        if isinstance(ids, AudioBatch):
            assert ids.ids is not None  # the plan completed the batch: the teacher transcribed what the data did not
            return ids.features, ids.ids
        half = ids.shape[1] // 2
        return ids[:, :half], ids[:, half:]

    def _seq2seq_outputs(self, model: torch.nn.Module, ids: Batch, layers: bool) -> Outputs:
        source, target = self.split(ids)
        assert self.decoder_start is not None  # only encoder-decoders come here
        start = torch.full_like(target[:, :1], self.decoder_start)
        decoder_ids = torch.cat([start, target[:, :-1]], 1).clamp_min(0)  # an ABSENT target position predicts nothing that counts
        # audio: features of whole clips (padded with silence, as Whisper was trained), no mask
        source_inputs = {"input_features": source} if source.is_floating_point() else {"input_ids": source.clamp_min(0), "attention_mask": source >= 0}
        out = model(**source_inputs, decoder_input_ids=decoder_ids, output_hidden_states=layers, use_cache=False)
        states = (*out.encoder_hidden_states[1:], *out.decoder_hidden_states[1:]) if layers else ()  # [0]s: the embeddings
        return Outputs(out.logits, states)

    def predicted(self, logits: torch.Tensor, ids: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the tokens they predict): a decoder's next token of the window, an encoder-decoder's target
        token (ABSENT where a pair's target ended)."""
        if self.decoder_start is not None:
            return logits, self.split(ids)[1]
        assert isinstance(ids, torch.Tensor)  # a decoder's windows
        return logits[:, :-1], ids[:, 1:]

    def counted(self, ids: Batch) -> torch.Tensor | None:
        """Which logits positions the loss and scores count: an encoder-decoder's filled target positions; None: all."""
        return self.split(ids)[1] >= 0 if self.decoder_start is not None else None

    def __call__(self, student: Outputs, teacher: Outputs, ids: Batch) -> torch.Tensor:
        loss = self._final(student.final, teacher.final, ids)
        if self.hidden_weight > 0:
            loss = loss + self.hidden_weight * hidden_distance(student.layers, teacher.layers)
        if self.attention_weight > 0:
            loss = loss + self.attention_weight * hidden_distance(student.attention, teacher.attention)
        return loss

    def _final(self, student: torch.Tensor, teacher: torch.Tensor, ids: Batch) -> torch.Tensor:
        if self.encoder:
            return F.mse_loss(student.float(), teacher.float()) + embedding_distance(student, teacher).mean()
        t, mask = self.temperature, self.counted(ids)
        kept = lambda x: x if mask is None else x[mask]  # noqa: E731 - an encoder-decoder's filled target positions
        loss = DistillKL.apply(kept(student) / t, kept(teacher) / t) * t * t
        if self.loss == "kl+ce":
            logits, targets = self.predicted(student, ids)
            loss = loss + F.cross_entropy(kept(logits).flatten(0, -2).float(), kept(targets).flatten())
        return loss


@contextmanager
def _block_outputs(blocks: Sequence[torch.nn.Module]):
    """The outputs of `blocks` in the order they run, collected while the context is open (the hooks are
    gone before the backward pass, so recomputed layers add nothing)."""
    outputs: list[torch.Tensor] = []
    keep = lambda module, args, out: outputs.append(out[0] if isinstance(out, tuple) else out)  # noqa: E731
    hooks = [block.register_forward_hook(keep) for block in blocks]
    try:
        yield outputs
    finally:
        for hook in hooks:
            hook.remove()


def hidden_distance(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean over layers and windows of MSE(student, teacher) / the teacher's mean square, per window:
    every layer counts alike whatever the scale of its activations, and a batch's value is the mean of
    its windows', so data-parallel halves average to the whole batch's gradient. Its gradient is
    exactly zero where the two are equal."""

    def relative(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # [batch]
        s, t = s.float().flatten(1), t.float().flatten(1)
        return (s - t).square().mean(1) / t.square().mean(1).clamp_min(1e-12)

    return torch.stack([relative(s, t) for s, t in zip(student, teacher, strict=True)]).mean()


class DistillKL(torch.autograd.Function):
    """Mean per-token KL(teacher ‖ student) with its exact gradient, softmax(student) − softmax(teacher).

    Autograd's own backward through log_softmax leaves float rounding (~1e-8) where the two are
    equal, and Adam scales such noise up to full-size steps; this gradient is exactly zero there,
    so a student equal to its teacher stays bit for bit unchanged.
    """

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(student, teacher)
        return token_kl(student, teacher).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        student, teacher = ctx.saved_tensors
        positions = student.numel() // student.shape[-1]
        diff = torch.softmax(student.float(), -1) - torch.softmax(teacher.float(), -1)
        return (diff * (grad / positions)).to(student.dtype), None


def token_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) of each position's distribution, in nats: [batch, seq]."""
    s, t = F.log_softmax(student.float(), -1), F.log_softmax(teacher.float(), -1)
    return (t.exp() * (t - s)).sum(-1)


def embedding_distance(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """1 − cosine of the mean-pooled embeddings, computed as ½‖û − v̂‖² of the unit vectors: the same
    value, but its autograd gradient is exactly zero where the two are equal (1 − cos rounds to
    ±1e-7 there, and Adam turns that noise into full-size steps): [batch]."""
    u, v = (F.normalize(x.float().mean(1), dim=-1) for x in (student, teacher))
    return 0.5 * (u - v).square().sum(-1)


def embedding_cosine(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Cosine of the mean-pooled embeddings of each window: [batch]."""
    return F.cosine_similarity(student.float().mean(1), teacher.float().mean(1), dim=-1)


@torch.no_grad()
def evaluate(objective: Objective, student: torch.nn.Module, teacher: torch.nn.Module, batch: Batch, rows: int) -> dict[str, float]:
    """Held-out scores of the student against the teacher on `batch` windows, `rows` at a time.

    Decoders: mean per-token KL, both perplexities, the relative perplexity increase and top-1
    agreement; encoders: mean embedding cosine and hidden-state MSE.
    """
    sums: dict[str, float] = {}
    for ids in batch.split(rows):
        s, t = objective.outputs(student, ids, layers=False).final, objective.outputs(teacher, ids, layers=False).final
        for name, value in _scores(objective, s, t, ids).items():
            sums[name] = sums.get(name, 0.0) + value
    if objective.encoder:
        return {"cosine": sums["cosine"] / len(batch), "mse": sums["mse"] / len(batch)}
    n = sums["tokens"]
    ppl, teacher_ppl = math.exp(sums["nll"] / sums["predicted"]), math.exp(sums["teacher_nll"] / sums["predicted"])
    return {"kl": sums["kl"] / n, "ppl": ppl, "teacher_ppl": teacher_ppl, "ppl_increase": ppl / teacher_ppl - 1, "top1": sums["top1"] / n}


def _scores(objective: Objective, s: torch.Tensor, t: torch.Tensor, ids: Batch) -> dict[str, float]:
    """Sums over one batch of windows."""
    if objective.encoder:
        return {"cosine": float(embedding_cosine(s, t).sum()), "mse": float(((s.float() - t.float()) ** 2).mean((1, 2)).sum())}
    (s_logits, targets), (t_logits, _) = objective.predicted(s, ids), objective.predicted(t, ids)
    if (mask := objective.counted(ids)) is not None:  # an encoder-decoder's target: the positions a pair filled
        s, t, s_logits, t_logits, targets = s[mask], t[mask], s_logits[mask], t_logits[mask], targets[mask]
    s_logits, t_logits, targets = s_logits.flatten(0, -2), t_logits.flatten(0, -2), targets.flatten()
    return {
        "kl": float(token_kl(s, t).sum()),
        "tokens": s.shape[:-1].numel(),
        "top1": float((s.argmax(-1) == t.argmax(-1)).sum()),
        "nll": float(F.cross_entropy(s_logits.float(), targets, reduction="sum")),
        "teacher_nll": float(F.cross_entropy(t_logits.float(), targets, reduction="sum")),
        "predicted": targets.numel(),
    }
