"""Grouping scored by the loss it predicts (`scored`): equal-size groups of kv heads chosen to minimise the
predicted error of pooling each group, not the heads' similarity.

The predicted loss of a group is what remains of its heads' K and V activations after the best pooled head
and each head's refit, weighted by what reads them, computed from the heads' cross-products on the
calibration activations (once per layer; a group's loss then never touches the tokens):

- V: refit maps the pooled V to each head through a full d×d map folded into W_O, so the best pooled head
  spans the top-d principal subspace of the group's activations weighted by W_O (each head's V_j L_j with
  L_j L_jᵀ = the W_O rows of its query heads, W_O W_Oᵀ): the loss is the rest of the spectrum of that
  [G·d, G·d] Gram matrix (the covariance-weighted SVD of CARE, per group).
- K under RoPE: per rotary pair only a complex scale per head can be folded into W_Q, so the best pooled pair
  is the top eigenvector of the group's [G, G] complex Gram matrix of that pair, each head weighted by its
  query heads' energy in the pair; the loss is the rest of that spectrum. Dims outside the rotary part (and
  every dim without RoPE) are weighted like V, by the query heads' covariance.
- K that may not be transformed (a per-dimension norm follows W_K): mean pooling's own residual.

Both are made relative to the layer's weighted K and V energies and added. Search: from the similarity
groups (`grouped`) and the contiguous ones, whichever predicts less, swap heads between two groups while a
swap lowers the predicted loss (every swap of a pair of groups scored in one batched eigendecomposition).
"""

from __future__ import annotations

from itertools import combinations

import torch

from headfold.converter import alignment


def _root_factor(gram: torch.Tensor) -> torch.Tensor:
    """A square-root factor L of a positive semi-definite [.., d, d] matrix, L Lᵀ = gram: its eigenvectors
    scaled by the roots of its eigenvalues, VΛ^½ (not the symmetric root VΛ^½Vᵀ; any factor serves)."""
    values, vectors = torch.linalg.eigh(gram)
    return vectors * values.clamp_min(0).sqrt().unsqueeze(-2)


class PredictedLoss:
    """The predicted loss of pooling any group of a layer's kv heads (module doc)."""

    def __init__(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], queries: list[torch.Tensor], readers: list[torch.Tensor], key_rotary: int | None
    ) -> None:
        """keys, values: per kv head [tokens, d] activations; queries: per kv head its query heads'
        activations [tokens, G_q, d]; readers: per kv head the W_O rows of its query heads [G_q, d, hidden]."""
        d = keys[0].shape[1]
        self.rotary = key_rotary or 0
        self.fixed_keys = key_rotary is None
        v_weights = torch.stack([_root_factor(torch.einsum("gdh,geh->de", r.double(), r.double())) for r in readers])  # [n, d, d]
        self.values = self._blocks([v.double() @ w for v, w in zip(values, v_weights, strict=True)])
        self.value_energy = float(torch.diagonal(self.values, dim1=-2, dim2=-1).sum(-1).diagonal().sum())
        k = [a.double() for a in keys]
        if self.fixed_keys:  # mean pooling's residual: the plain Gram blocks
            self.keys = self._blocks(k)
            self.key_energy = float(torch.diagonal(self.keys, dim1=-2, dim2=-1).sum(-1).diagonal().sum())
            return
        self.pairs = self.plain = None
        energy = 0.0
        if self.rotary:
            z = torch.stack([alignment._complex(a, self.rotary) for a in k])  # [n, tokens, r/2]
            w = torch.stack([alignment._complex(q.flatten(0, 1), self.rotary).abs().square().sum(0) for q in queries])  # [n, r/2]
            z = z * w.sqrt().unsqueeze(1)
            self.pairs = torch.einsum("atp,btp->pab", z.conj(), z)  # [r/2, n, n] Hermitian per pair
            energy += float(self.pairs.diagonal(dim1=-2, dim2=-1).real.sum())
        if self.rotary < d:
            q_weights = [_root_factor(q[..., self.rotary :].double().flatten(0, 1).T @ q[..., self.rotary :].double().flatten(0, 1)) for q in queries]
            self.plain = self._blocks([a[:, self.rotary :] @ w for a, w in zip(k, q_weights, strict=True)])
            energy += float(torch.diagonal(self.plain, dim1=-2, dim2=-1).sum(-1).diagonal().sum())
        self.key_energy = energy

    @staticmethod
    def _blocks(acts: list[torch.Tensor]) -> torch.Tensor:
        """[n, n, d, d]: A_aᵀ A_b for every pair of heads."""
        flat = torch.cat(acts, 1)
        d = acts[0].shape[1]
        return (flat.T @ flat).unflatten(0, (len(acts), d)).unflatten(2, (len(acts), d)).transpose(1, 2)

    @staticmethod
    def _beyond(blocks: torch.Tensor, groups: torch.Tensor, keep: int) -> torch.Tensor:
        """Per group [B, G] of heads: the spectrum of its [G·d, G·d] Gram matrix past the top `keep` values."""
        g = groups.shape[1]
        m = blocks[groups[:, :, None], groups[:, None, :]]  # [B, G, G, d, d]
        d = m.shape[-1]
        m = m.transpose(2, 3).reshape(len(groups), g * d, g * d)
        values = torch.linalg.eigvalsh(m)
        return values[:, : g * d - keep].clamp_min(0).sum(-1)

    def _mean_residual(self, groups: torch.Tensor) -> torch.Tensor:
        """Σ_j ‖A_j − mean‖² from the Gram blocks: Σ_j tr C_jj − (1/G) Σ_ab tr C_ab."""
        traces = torch.diagonal(self.keys, dim1=-2, dim2=-1).sum(-1)  # [n, n]
        t = traces[groups[:, :, None], groups[:, None, :]]  # [B, G, G]
        return t.diagonal(dim1=-2, dim2=-1).sum(-1) - t.sum((-2, -1)) / groups.shape[1]

    def __call__(self, groups: torch.Tensor) -> torch.Tensor:
        """[B] predicted loss of each group of `groups` [B, G] (source kv head indices)."""
        value_dims = self.values.shape[-1]
        loss = self._beyond(self.values, groups, value_dims) / max(self.value_energy, 1e-30)
        if self.fixed_keys:
            return loss + self._mean_residual(groups) / max(self.key_energy, 1e-30)
        keys = torch.zeros_like(loss)
        if self.pairs is not None:
            m = self.pairs[:, groups[:, :, None], groups[:, None, :]]  # [r/2, B, G, G]
            values = torch.linalg.eigvalsh(m)
            keys = keys + values[..., :-1].clamp_min(0).sum((0, -1))
        if self.plain is not None:
            keys = keys + self._beyond(self.plain, groups, self.plain.shape[-1])
        return loss + keys / max(self.key_energy, 1e-30)

    def total(self, groups: list[list[int]]) -> float:
        return float(self(torch.tensor(groups)).sum())


def scored_groups(loss: PredictedLoss, starts: list[list[list[int]]]) -> list[list[int]]:
    """The start that predicts the least loss, improved by swapping heads between two groups while the
    best swap of a pair of groups lowers the pair's predicted loss."""
    groups = [list(g) for g in min(starts, key=loss.total)]
    if len(groups) == 1:
        return [sorted(groups[0])]
    size, improved = len(groups[0]), True
    while improved:
        improved = False
        for a, b in combinations(range(len(groups)), 2):
            pair = torch.tensor([groups[a], groups[b]])
            before = float(loss(pair).sum())
            swaps = [(i, j) for i in range(size) for j in range(size)]
            candidates = pair.repeat(len(swaps), 1, 1)
            for s, (i, j) in enumerate(swaps):
                candidates[s, 0, i], candidates[s, 1, j] = pair[1, j], pair[0, i]
            after = loss(candidates.flatten(0, 1)).view(len(swaps), 2).sum(1)
            best = int(after.argmin())
            if float(after[best]) < before * (1 - 1e-9):
                groups[a], groups[b] = candidates[best, 0].tolist(), candidates[best, 1].tolist()
                improved = True
    return sorted(sorted(g) for g in groups)
