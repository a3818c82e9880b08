"""Metrics, accumulated batch by batch over real (unpadded) positions.

Conversion loss (original vs converted causal LM): perplexity of both, mean per-token
KL(original ‖ converted), top-1 agreement; for encoders, cosine of mean-pooled embeddings.
Fidelity (same model, two backends): per output max/mean abs error, relative error, cosine,
top-1 agreement, and the count of elements outside atol *and* rtol (Polygraphy's rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


def windows(ids: list[int], length: int) -> torch.Tensor:
    """Non-overlapping windows of `length` tokens (the tail that does not fill one is dropped)."""
    count = len(ids) // length
    if count == 0:
        raise ValueError(f"text of {len(ids)} tokens is shorter than one window of {length}")
    return torch.tensor(ids[: count * length]).reshape(count, length)


@torch.no_grad()
def log_probs(model: torch.nn.Module, batch: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """Next-token log-probabilities [windows, length - 1, vocab] in fp32, `chunk` windows at a time."""
    out = [model(input_ids=part).logits[:, :-1].float().log_softmax(-1) for part in batch.split(chunk)]
    return torch.cat(out)


@dataclass(frozen=True)
class LossReport:
    reference_ppl: float
    candidate_ppl: float
    kl: float  # mean per-token KL(reference ‖ candidate), nats
    top1: float  # fraction of positions where both predict the same next token

    @property
    def ppl_increase(self) -> float:
        return self.candidate_ppl / self.reference_ppl - 1


def perplexity(logp: torch.Tensor, batch: torch.Tensor) -> float:
    targets = batch[:, 1:]
    nll = -logp.gather(-1, targets[..., None]).squeeze(-1)
    return float(nll.mean().exp())


def compare(reference: torch.Tensor, candidate: torch.Tensor, batch: torch.Tensor) -> LossReport:
    """Both arguments are `log_probs` outputs on the same (unpadded) `batch`."""
    meter = LossMeter()
    meter.add_tokens(reference.flatten(0, 1), candidate.flatten(0, 1), batch[:, 1:].flatten())
    return meter.report()


class LossMeter:
    """Sums over predicted tokens of a causal LM, original (reference) vs converted (candidate)."""

    def __init__(self) -> None:
        self.tokens = 0
        self.nll_reference = self.nll_candidate = self.kl = self.agree = 0.0

    def add_tokens(self, reference: torch.Tensor, candidate: torch.Tensor, targets: torch.Tensor) -> None:
        """Log-probabilities (or logits) [tokens, vocab] and the next tokens [tokens]."""
        ref, cand = reference.double().log_softmax(-1), candidate.double().log_softmax(-1)
        self.tokens += len(targets)
        self.nll_reference -= float(ref.gather(-1, targets[:, None]).sum())
        self.nll_candidate -= float(cand.gather(-1, targets[:, None]).sum())
        self.kl += float(F.kl_div(cand, ref, log_target=True, reduction="sum"))
        self.agree += float((ref.argmax(-1) == cand.argmax(-1)).sum())

    def add(self, reference: np.ndarray, candidate: np.ndarray, feed: dict[str, np.ndarray]) -> None:
        """Logits [B, S, V] of a right-padded batch: position t predicts token t + 1 when both are real."""
        mask = torch.from_numpy(feed["attention_mask"]).bool()
        valid = mask[:, :-1] & mask[:, 1:]
        targets = torch.from_numpy(feed["input_ids"])[:, 1:][valid]
        self.add_tokens(torch.from_numpy(reference)[:, :-1][valid], torch.from_numpy(candidate)[:, :-1][valid], targets)

    def report(self) -> LossReport:
        n = self.tokens
        return LossReport(math.exp(self.nll_reference / n), math.exp(self.nll_candidate / n), self.kl / n, self.agree / n)

    def metrics(self) -> dict[str, float]:
        r = self.report()
        return {
            "reference_ppl": r.reference_ppl,
            "candidate_ppl": r.candidate_ppl,
            "ppl_increase": r.ppl_increase,
            "kl": r.kl,
            "top1": r.top1,
            "tokens": self.tokens,
        }


def _cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows (last axis), in float64; 1 for two zero rows."""
    dot = (a * b).sum(-1)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    same = np.all(a == b, axis=-1)
    return np.where(same, 1.0, dot / np.where(norms == 0, 1.0, norms))


class EmbeddingMeter:
    """Encoders, original vs converted: cosine of mask-mean-pooled embeddings, one per row."""

    def __init__(self) -> None:
        self.cosines: list[np.ndarray] = []

    def add(self, reference: np.ndarray, candidate: np.ndarray, feed: dict[str, np.ndarray]) -> None:
        mask = feed["attention_mask"][..., None].astype(np.float64)
        pool = lambda h: (h.astype(np.float64) * mask).sum(1) / mask.sum(1)  # noqa: E731
        self.cosines.append(_cosine_rows(pool(reference), pool(candidate)))

    def metrics(self) -> dict[str, float]:
        cos = np.concatenate(self.cosines)
        return {"embedding_cosine": float(cos.mean()), "min_embedding_cosine": float(cos.min()), "rows": len(cos)}


class FidelityMeter:
    """One output of one model on two backends, over real positions; atol/rtol count mismatches."""

    def __init__(self, atol: float, rtol: float, top1: bool) -> None:
        self.atol, self.rtol, self.top1 = atol, rtol, top1
        self.elements = self.mismatched = self.vectors = 0
        self.max_abs = self.sum_abs = self.max_rel = self.sum_sq_diff = self.sum_sq_ref = 0.0
        self.sum_cos, self.min_cos, self.agree = 0.0, 1.0, 0

    def add(self, reference: np.ndarray, candidate: np.ndarray, feed: dict[str, np.ndarray]) -> None:
        if reference.shape != candidate.shape:
            raise ValueError(f"shapes differ: reference {reference.shape}, candidate {candidate.shape}")
        valid = feed["attention_mask"].astype(bool)
        ref, cand = reference[valid].astype(np.float64), candidate[valid].astype(np.float64)
        diff = np.abs(cand - ref)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(diff == 0, 0.0, diff / np.abs(ref))  # inf where the reference is 0
        self.elements += diff.size
        self.mismatched += int(((diff > self.atol) & (rel > self.rtol)).sum())
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.sum_abs += float(diff.sum())
        self.max_rel = max(self.max_rel, float(rel.max()))
        self.sum_sq_diff += float((diff**2).sum())
        self.sum_sq_ref += float((ref**2).sum())
        cos = _cosine_rows(ref, cand)
        self.vectors += len(cos)
        self.sum_cos += float(cos.sum())
        self.min_cos = min(self.min_cos, float(cos.min()))
        if self.top1:
            self.agree += int((ref.argmax(-1) == cand.argmax(-1)).sum())

    def metrics(self) -> dict[str, float]:
        out = {
            "max_abs_err": self.max_abs,
            "mean_abs_err": self.sum_abs / self.elements,
            "max_rel_err": self.max_rel,
            "rel_l2_err": math.sqrt(self.sum_sq_diff / self.sum_sq_ref) if self.sum_sq_ref else 0.0,
            "cosine": self.sum_cos / self.vectors,
            "min_cosine": self.min_cos,
            "mismatched": self.mismatched,
            "mismatched_fraction": self.mismatched / self.elements,
            "elements": self.elements,
        }
        if self.top1:
            out["top1"] = self.agree / self.vectors
        return out
