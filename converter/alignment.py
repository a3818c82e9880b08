"""Function-preserving head transforms: orthogonal alignment, permutation, least-squares refit.

Everything works on per-head activations A_j = X W_jᵀ + b_j ([tokens, head_dim]) of the K or
V projections, X being the layer's attention input on calibration text (or the identity when
there is none, which aligns the weights themselves).

A transform T of head j is folded so the model's function is unchanged:
- V side: V_j → V_j T and W_O[h] → T⁻¹ W_O[h] for the query heads h reading kv head j;
- K side: K_j → K_j T and Q_h → Q_h T⁻ᵀ, so every score Q_h K_jᵀ is unchanged. For orthogonal
  T both reduce to rotating the canonical weight rows by Tᵀ (methods.rotate).
- With RoPE, a K-side T must commute with the rotary rotation: on each rotary pair
  (i, i + r/2) only a rotation-and-scale (a complex number); the non-rotary dims are free.
"""

from __future__ import annotations

import torch


def _pairs(rotary: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (i, i + rotary/2) of RoPE's rotate_half pairs."""
    first = torch.arange(rotary // 2, device=device)
    return first, first + rotary // 2


def _complex(a: torch.Tensor, rotary: int) -> torch.Tensor:
    """[tokens, d] → [tokens, rotary/2] complex: each rotary pair as one complex number."""
    i, j = _pairs(rotary, a.device)
    return torch.complex(a[:, i].double(), a[:, j].double())


def _pair_blocks(c: torch.Tensor, rotary: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Complex scalars per pair → the [d, d] real matrix acting as `row @ M` (rows of activations)."""
    m = torch.zeros(d, d, dtype=torch.float64, device=c.device)
    i, j = _pairs(rotary, c.device)
    m[i, i], m[i, j] = c.real, c.imag
    m[j, i], m[j, j] = -c.imag, c.real
    return m.to(dtype)


def _polar(cross: torch.Tensor) -> torch.Tensor:
    """The orthogonal factor U Vᵀ of `cross` = aᵀb: the R maximising tr(Rᵀ aᵀ b)."""
    u, _, vt = torch.linalg.svd(cross)
    return u @ vt


def _unit(z: torch.Tensor) -> torch.Tensor:
    return z / z.abs().clamp_min(1e-30)


def _assemble(phases: torch.Tensor | None, rotation: torch.Tensor | None, rotary: int, d: int) -> torch.Tensor:
    given = phases if phases is not None else rotation
    assert given is not None  # phases when rotary > 0, a rotation when rotary < d: at least one for any d ≥ 1
    device = given.device
    r = torch.zeros(d, d, dtype=torch.float64, device=device)
    if phases is not None:
        r += _pair_blocks(phases, rotary, d, torch.float64)
    if rotation is not None:
        r[rotary:, rotary:] = rotation
    return r


def orthogonal_fit(a: torch.Tensor, b: torch.Tensor, rotary: int = 0) -> torch.Tensor:
    """Orthogonal R minimising ‖a R − b‖ (Procrustes); on rotary pairs only 2-D rotations."""
    d = a.shape[1]
    phases = _unit((_complex(a, rotary).conj() * _complex(b, rotary)).sum(0)) if rotary else None
    rotation = _polar(a[:, rotary:].double().T @ b[:, rotary:].double()) if rotary < d else None
    return _assemble(phases, rotation, rotary, d).to(a.dtype)


def linear_fit(a: torch.Tensor, b: torch.Tensor, rotary: int = 0, ridge: float = 1e-6) -> torch.Tensor:
    """Least-squares T minimising ‖a T − b‖; on rotary pairs only a complex scale per pair."""
    d = a.shape[1]
    t = torch.zeros(d, d, dtype=torch.float64, device=a.device)
    if rotary:
        za, zb = _complex(a, rotary), _complex(b, rotary)
        scale = (za.conj() * zb).sum(0) / ((za.abs() ** 2).sum(0) + ridge)
        t += _pair_blocks(scale, rotary, d, torch.float64)
    if rotary < d:
        x, y = a[:, rotary:].double(), b[:, rotary:].double()
        gram = x.T @ x
        gram += ridge * gram.diagonal().mean() * torch.eye(d - rotary, dtype=torch.float64, device=a.device)
        t[rotary:, rotary:] = torch.linalg.solve(gram, x.T @ y)
    return t.to(a.dtype)


def generalized_procrustes(acts: list[torch.Tensor], rotary: int = 0, iterations: int = 8) -> list[torch.Tensor]:
    """Rotations R_j bringing every head of a group towards their common mean (Gower 1975).

    Rotary pairs and the other dims decouple, and each iteration only needs the heads'
    cross-products, computed once: the loop never touches the [tokens, d] activations.
    """
    d = acts[0].shape[1]
    phases = _gpa_phases([_complex(a, rotary) for a in acts], iterations) if rotary else [None] * len(acts)
    rotations = _gpa_orthogonal([a[:, rotary:].double() for a in acts], iterations) if rotary < d else [None] * len(acts)
    return [_assemble(p, r, rotary, d).to(acts[0].dtype) for p, r in zip(phases, rotations, strict=True)]


def _gpa_orthogonal(acts: list[torch.Tensor], iterations: int) -> list[torch.Tensor]:
    cross = [[ai.T @ aj for aj in acts] for ai in acts]
    rotations = [_polar(cross[i][0]) for i in range(len(acts))]  # first target: head 0
    for _ in range(iterations):  # target = mean_j A_j R_j, so A_iᵀ target = mean_j cross_ij R_j
        rotations = [_polar(torch.stack([c @ r for c, r in zip(row, rotations, strict=True)]).mean(0)) for row in cross]
    return rotations


def _gpa_phases(zs: list[torch.Tensor], iterations: int) -> list[torch.Tensor]:
    """The same per rotary pair, where a rotation is a unit complex number."""
    cross = [[(zi.conj() * zj).sum(0) for zj in zs] for zi in zs]
    phases = [_unit(cross[i][0]) for i in range(len(zs))]
    for _ in range(iterations):
        phases = [_unit(torch.stack([c * p for c, p in zip(row, phases, strict=True)]).mean(0)) for row in cross]
    return phases


def alignment_similarities(acts: list[torch.Tensor], rotary: int = 0) -> torch.Tensor:
    """[n, n]: the cosine similarity of A_i R and A_j for every pair of heads, R the best allowed rotation
    (orthogonal_fit), from one product of all their activations: tr(Rᵀ A_iᵀ A_j) is the nuclear norm of
    A_iᵀ A_j (on each rotary pair, the modulus of its complex cross-product), so no pair's R is built."""
    a = torch.stack(acts).double()  # [n, tokens, d]
    n, tokens, d = a.shape
    agreement = torch.zeros(n, n, dtype=torch.float64, device=a.device)
    if rotary:
        z = torch.stack([_complex(x, rotary) for x in acts]).permute(2, 0, 1)  # [pairs, n, tokens]
        agreement += (z.conj() @ z.transpose(1, 2)).abs().sum(0)
    if rotary < d:
        rest = a[:, :, rotary:].permute(1, 0, 2).reshape(tokens, n * (d - rotary))
        cross = (rest.T @ rest).view(n, d - rotary, n, d - rotary).transpose(1, 2)  # [i, j] = A_iᵀ A_j
        agreement += torch.linalg.svdvals(cross).sum(-1)
    norms = a.flatten(1).norm(dim=1)
    return agreement / (norms[:, None] * norms[None]).clamp_min(1e-30)
