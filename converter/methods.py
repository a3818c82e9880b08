"""Pooling methods: how the K/V heads of a group become one.

A method maps one layer's canonical attention weights to ones with ``kv_heads`` K/V heads.
By default source kv head j joins group j // (source_kv // kv_heads): contiguous groups, as the
ONNX Attention op, TensorRT and torch's repeat_interleave expect. Methods are recipes:

- ``mean``    average the K and V projection heads and biases of a group (Ainslie et al. 2023)
- ``first``   keep the first head of each group (the paper's ablation)
- ``grouped`` choose which heads share a KV head by activation similarity, then permute heads
              (query heads and W_O rows with them) so the chosen groups are contiguous
- ``aligned`` rotate heads inside a group towards a common basis first (function-preserving:
              the rotation is folded into W_Q / W_O), pool, restore the norm lost to averaging
- ``scored``  choose the groups by the loss pooling each one predicts (scoring.py), then permute
              heads as ``grouped`` does
- ``refit``   after pooling, fit per head the linear map from the pooled K/V back to the head's
              own K/V (least squares on calibration activations) and fold it into W_Q / W_O
- ``local``   then fit the layer's attention output by gradient descent (local.py: it needs the
              layer's own attention block, so it runs while calibration holds the layer, not here)

Modifiers combine with ``+`` (``aligned+grouped+refit``); they pool with ``mean`` unless
``first`` is named. With RoPE, every K-side transform is restricted to what commutes with the
rotary rotation (see alignment.py); with a per-dimension norm on Q/K (Qwen3) K is left alone.
Data-aware recipes compute on the first CUDA GPU when torch sees one ($HEADFOLD_DEVICE overrides).
This is the torch path; a conversion runs mean/first of a safetensors checkpoint without torch
(converter/rawpool.py, the same bytes) and names the recipes through recipes.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

import torch

from headfold.converter import alignment, scoring
from headfold.converter.layout import AttentionWeights

# re-exported: the names live in recipes.py, which imports no torch
from headfold.converter.recipes import METHODS, LayerContext, Recipe, contiguous_groups, get_method  # noqa: F401
from headfold.ground.errors import BadInput

DEVICE_VARIABLE = "HEADFOLD_DEVICE"  # cpu, cuda or cuda:N; default: the first GPU when there is one


@dataclass(frozen=True)
class LayerResult:
    attn: AttentionWeights
    groups: list[list[int]]  # source kv heads pooled into each new kv head, in order


def convert_attention(recipe: Recipe, attn: AttentionWeights, kv_heads: int, ctx: LayerContext = LayerContext()) -> LayerResult:
    """Pool `attn` (canonical torch weights) to `kv_heads`; data-aware recipes compute on the GPU when there is one."""
    if recipe.local:
        raise BadInput(f"{recipe.name}: local fits a layer while calibration runs it (headfold convert), not one layer's weights alone; drop local here")
    device = compute_device() if recipe.data_aware else torch.device("cpu")
    if device.type == "cpu":
        return _convert(recipe, attn, kv_heads, ctx)
    inputs = None if ctx.inputs is None else ctx.inputs.to(device)
    result = _convert(recipe, moved(attn, device), kv_heads, replace(ctx, inputs=inputs))
    return replace(result, attn=moved(result.attn, torch.device("cpu")))


def _convert(recipe: Recipe, attn: AttentionWeights, kv_heads: int, ctx: LayerContext) -> LayerResult:
    groups = contiguous_groups(attn.kv_heads, kv_heads)
    if not recipe.data_aware:
        return LayerResult(_pool(attn, groups, recipe.pool), groups)
    if ctx.interleaved and ctx.rotary:  # the maths pairs (i, i + r/2): reorder Q/K dims there and back
        result = _convert(recipe, pairs_as_halves(attn, ctx.rotary), kv_heads, replace(ctx, interleaved=False))
        return replace(result, attn=pairs_as_halves(result.attn, ctx.rotary, inverse=True))
    keys, values = head_activations(attn.k, attn.k_bias, ctx), head_activations(attn.v, attn.v_bias, ctx)
    key_rotary = ctx.rotary if ctx.rotate_keys else None
    if recipe.grouped:
        groups = similar_groups(keys, values, kv_heads, key_rotary)
    elif recipe.scored:
        starts = [groups, similar_groups(keys, values, kv_heads, key_rotary)]
        groups = scoring.scored_groups(predicted_loss(attn, keys, values, ctx, key_rotary), starts)
    if recipe.aligned:
        attn = align(attn, groups, keys, values, key_rotary)
        keys, values = head_activations(attn.k, attn.k_bias, ctx), head_activations(attn.v, attn.v_bias, ctx)
    pooled = _pool(attn, groups, recipe.pool)
    if recipe.aligned:
        pooled = _restore_norms(pooled, groups, keys, values, ctx)
    if recipe.refit:
        pooled = refit(pooled, groups, keys, values, ctx, key_rotary)
    return LayerResult(_group_queries(pooled, attn, groups), groups)


def compute_device() -> torch.device:
    """Where the data-aware methods' activations, fits and solves run: $HEADFOLD_DEVICE, else
    the first CUDA GPU when torch sees one, else the CPU."""
    requested = os.environ.get(DEVICE_VARIABLE)
    if not requested:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise BadInput(f"{DEVICE_VARIABLE}={requested!r} is not a device headfold computes on; use cpu, cuda or cuda:N")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise BadInput(f"{DEVICE_VARIABLE}={requested} but torch sees {torch.cuda.device_count()} CUDA GPU(s); unset it or use cpu")
    return device


def pairs_as_halves(attn: AttentionWeights, rotary: int, inverse: bool = False) -> AttentionWeights:
    """Q/K head dims reordered so interleaved RoPE pairs (2i, 2i + 1) sit at (i, i + rotary/2)
    (`inverse`: back). Q and K move alike, so every score and the model are unchanged."""
    d = attn.q.shape[1]
    order = torch.cat([torch.arange(0, rotary, 2), torch.arange(1, rotary, 2), torch.arange(rotary, d)])
    if inverse:
        order = torch.argsort(order)

    def take(t: torch.Tensor) -> torch.Tensor:
        return t[:, order.to(t.device)]

    def present(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else take(t)

    return replace(
        attn,
        q=take(attn.q),
        k=take(attn.k),
        q_bias=present(attn.q_bias),
        k_bias=present(attn.k_bias),
        q_norm=present(attn.q_norm),
        k_norm=present(attn.k_norm),
    )


def moved(attn: AttentionWeights, device: torch.device) -> AttentionWeights:
    """Every tensor of `attn` on `device`."""
    return replace(attn, **{f.name: t.to(device) for f in fields(attn) if (t := getattr(attn, f.name)) is not None})


# -- activations ------------------------------------------------------------------------


def head_activations(w: torch.Tensor, bias: torch.Tensor | None, ctx: LayerContext) -> list[torch.Tensor]:
    """Per source kv head [tokens, d]: X W_jᵀ + b_j, or the weights themselves (with the bias as
    one more row) when there is no calibration input."""
    if ctx.inputs is None:
        acts = w.transpose(1, 2)
        if bias is not None:
            acts = torch.cat([acts, bias[:, None]], dim=1)
    else:
        acts = torch.einsum("tD,ndD->ntd", ctx.inputs, w)
        if bias is not None:
            acts = acts + bias[:, None]
    return list(acts)


# -- grouping ---------------------------------------------------------------------------


def aligned_similarity(keys: list[torch.Tensor], values: list[torch.Tensor], key_rotary: int | None) -> torch.Tensor:
    """[n, n] mean of the K and V cosine similarities of two heads after the best allowed rotation
    (K unrotated when key_rotary is None); 1 on the diagonal."""
    k = alignment.alignment_similarities(keys, key_rotary) if key_rotary is not None else _cosines(keys)
    sim = ((k + alignment.alignment_similarities(values)) / 2).cpu()
    return sim.fill_diagonal_(1.0)


def similar_groups(keys: list[torch.Tensor], values: list[torch.Tensor], kv_heads: int, key_rotary: int | None) -> list[list[int]]:
    """Equal-size groups of heads with high aligned K and V similarity: greedy, then pair swaps."""
    sim = aligned_similarity(keys, values, key_rotary)
    groups = _greedy_groups(sim, len(keys) // kv_heads)
    _improve_by_swaps(groups, sim)
    return sorted(sorted(g) for g in groups)


def predicted_loss(
    attn: AttentionWeights, keys: list[torch.Tensor], values: list[torch.Tensor], ctx: LayerContext, key_rotary: int | None
) -> scoring.PredictedLoss:
    """The layer's predicted loss of pooling a group (scoring.py), weighted by each kv head's query heads and W_O rows."""
    queries = head_activations(attn.q, attn.q_bias, ctx)
    per_kv = len(queries) // len(keys)
    grouped = [torch.stack(queries[j * per_kv : (j + 1) * per_kv], 1) for j in range(len(keys))]
    readers = [attn.o[j * per_kv : (j + 1) * per_kv] for j in range(len(keys))]
    return scoring.PredictedLoss(keys, values, grouped, readers, key_rotary)


def _cosines(acts: list[torch.Tensor]) -> torch.Tensor:
    """[n, n] cosine similarity of every pair of heads' activations, unrotated."""
    flat = torch.stack(acts).double().flatten(1)
    unit = flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return unit @ unit.T


def _greedy_groups(sim: torch.Tensor, size: int) -> list[list[int]]:
    free = list(range(sim.shape[0]))
    groups = []
    while free:
        group = [free[0]]  # swaps below repair a poor seed
        while len(group) < size:
            group.append(max((j for j in free if j not in group), key=lambda j: float(sim[j, group].sum())))
        groups.append(group)
        free = [i for i in free if i not in group]
    return groups


def _within(groups: list[list[int]], sim: torch.Tensor) -> float:
    return sum(float(sim[g][:, g].sum()) for g in groups)


def _improve_by_swaps(groups: list[list[int]], sim: torch.Tensor) -> None:
    """Swap heads between groups while the total within-group similarity grows."""
    improved = True
    while improved:
        improved = False
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                for i in range(len(groups[a])):
                    for j in range(len(groups[b])):
                        before = _within([groups[a], groups[b]], sim)
                        groups[a][i], groups[b][j] = groups[b][j], groups[a][i]
                        if _within([groups[a], groups[b]], sim) > before + 1e-12:
                            improved = True
                        else:
                            groups[a][i], groups[b][j] = groups[b][j], groups[a][i]


# -- function-preserving transforms --------------------------------------------------------


def _query_heads(attn: AttentionWeights, j: int) -> slice:
    per_kv = attn.q.shape[0] // attn.kv_heads
    return slice(j * per_kv, (j + 1) * per_kv)


def _weights(m: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A head-space map applied to canonical weights [(heads,) d, hidden]: m @ w."""
    return m @ w


def _biases(m: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same map applied to biases [(heads,) d]."""
    return b @ m.T


def rotate(attn: AttentionWeights, key_maps: list[torch.Tensor | None], value_maps: list[torch.Tensor]) -> AttentionWeights:
    """Fold per-kv-head maps (activations A_j → A_j M_j) into K/V and, inversely, into Q/O."""
    q, k, v, o = attn.q.clone(), attn.k.clone(), attn.v.clone(), attn.o.clone()
    qb, kb, vb = (None if t is None else t.clone() for t in (attn.q_bias, attn.k_bias, attn.v_bias))
    for j, (mk, mv) in enumerate(zip(key_maps, value_maps, strict=True)):
        heads = _query_heads(attn, j)
        if mk is not None:  # scores (q R)·(k R) = q·k for orthogonal R: Q and K rows both rotate
            k[j], q[heads] = _weights(mk.T, k[j]), _weights(mk.T, q[heads])
            if kb is not None:
                kb[j] = _biases(mk.T, kb[j])
            if qb is not None:
                qb[heads] = _biases(mk.T, qb[heads])
        v[j], o[heads] = _weights(mv.T, v[j]), _weights(mv.T, o[heads])  # (v R) Rᵀ W_O = v W_O
        if vb is not None:
            vb[j] = _biases(mv.T, vb[j])
    return replace(attn, q=q, k=k, v=v, o=o, q_bias=qb, k_bias=kb, v_bias=vb)


def align(attn: AttentionWeights, groups: list[list[int]], keys, values, key_rotary: int | None) -> AttentionWeights:
    """Generalized Procrustes inside each group; K only where rotations are allowed."""
    n = attn.kv_heads
    key_maps: list[torch.Tensor | None] = [None] * n
    value_maps: list[torch.Tensor] = [torch.eye(attn.v.shape[1], device=attn.v.device)] * n
    for group in groups:
        for j, r in zip(group, alignment.generalized_procrustes([values[j] for j in group]), strict=True):
            value_maps[j] = r
        if key_rotary is not None:
            for j, r in zip(group, alignment.generalized_procrustes([keys[j] for j in group], key_rotary), strict=True):
                key_maps[j] = r
    return rotate(attn, key_maps, value_maps)


def _queries_of(attn: AttentionWeights, order: list[int]) -> list[int]:
    """Query heads in the order of their kv heads in `order`."""
    per_kv = attn.q.shape[0] // attn.kv_heads
    return [h for j in order for h in range(j * per_kv, (j + 1) * per_kv)]


def _take(t: torch.Tensor | None, index: list[int]) -> torch.Tensor | None:
    return None if t is None else t[index]


def permute(attn: AttentionWeights, order: list[int]) -> AttentionWeights:
    """Reorder kv heads, their query heads and O rows with them: the function is unchanged."""
    queries = _queries_of(attn, order)
    return replace(
        attn, q=attn.q[queries], o=attn.o[queries], q_bias=_take(attn.q_bias, queries), q_norm=_take(attn.q_norm, queries),
    ).map_kv(lambda t: t[order])  # fmt: skip


def expand_kv(attn: AttentionWeights, kv_heads: int) -> AttentionWeights:
    """The same layer with `kv_heads` K/V heads: each pooled head repeated for the source heads of its
    group. A GQA layer is the MHA layer whose K/V heads repeat within each group; the method already made
    its groups contiguous (query heads and W_O rows moved with them), so query head h reads kv head h // G."""
    return attn.map_kv(lambda t: t.repeat_interleave(kv_heads // attn.kv_heads, 0))


def _group_queries(pooled: AttentionWeights, source: AttentionWeights, groups: list[list[int]]) -> AttentionWeights:
    """Query heads (and O rows) follow their source kv head into its group: groups become contiguous."""
    order = [j for g in groups for j in g]
    if order == sorted(order):  # already contiguous: nothing moves
        return pooled
    queries = _queries_of(source, order)
    return replace(pooled, q=pooled.q[queries], o=pooled.o[queries], q_bias=_take(pooled.q_bias, queries), q_norm=_take(pooled.q_norm, queries))


# -- pooling and what follows it --------------------------------------------------------------


def _pool(attn: AttentionWeights, groups: list[list[int]], how: str) -> AttentionWeights:
    """One reduction per tensor, at memory bandwidth: heads in group order, viewed [groups, G, ...]
    (no copy when the groups are contiguous), averaged over G in fp32."""
    order = [j for g in groups for j in g]
    index = None if order == list(range(len(order))) else torch.tensor(order)

    def pool(t: torch.Tensor) -> torch.Tensor:  # map_kv passes the tensors that exist
        grouped = (t if index is None else t[index.to(t.device)]).unflatten(0, (len(groups), -1))
        return grouped.mean(1, dtype=torch.float32) if how == "mean" else grouped[:, 0]

    return attn.map_kv(pool)


def _restore_norms(pooled: AttentionWeights, groups, keys, values, ctx: LayerContext) -> AttentionWeights:
    """Averaging unrelated directions shrinks activations (~1/√group): scale them back."""
    pooled_keys = head_activations(pooled.k, pooled.k_bias, ctx)
    pooled_values = head_activations(pooled.v, pooled.v_bias, ctx)
    scale = lambda acts, pooled_acts, g: torch.stack([acts[j].norm() for j in groups[g]]).mean() / pooled_acts[g].norm().clamp_min(1e-30)  # noqa: E731
    ks = torch.stack([scale(keys, pooled_keys, g) for g in range(len(groups))])
    vs = torch.stack([scale(values, pooled_values, g) for g in range(len(groups))])

    def mul(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return t * s.view(-1, *[1] * (t.ndim - 1))

    def present(t: torch.Tensor | None, s: torch.Tensor) -> torch.Tensor | None:
        return None if t is None else mul(t, s)

    return pooled.with_kv(mul(pooled.k, ks), mul(pooled.v, vs), present(pooled.k_bias, ks), present(pooled.v_bias, vs))


def refit(pooled: AttentionWeights, groups, keys, values, ctx: LayerContext, key_rotary: int | None) -> AttentionWeights:
    """Per source head j: T_j = argmin ‖Ā T − A_j‖ from the pooled activations Ā to the head's own,
    folded into W_Q (scores use Q T_jᵀ · Ā) and W_O (outputs use Ā T_j W_O)."""
    pooled_keys = head_activations(pooled.k, pooled.k_bias, ctx)
    pooled_values = head_activations(pooled.v, pooled.v_bias, ctx)
    q, o = pooled.q.clone(), pooled.o.clone()
    qb = None if pooled.q_bias is None else pooled.q_bias.clone()
    per_kv = q.shape[0] // len(keys)
    for g, group in enumerate(groups):
        for j in group:
            heads = slice(j * per_kv, (j + 1) * per_kv)
            if key_rotary is not None:
                t = alignment.linear_fit(pooled_keys[g], keys[j], key_rotary)
                q[heads] = _weights(t, q[heads])
                if qb is not None:
                    qb[heads] = _biases(t, qb[heads])
            o[heads] = _weights(alignment.linear_fit(pooled_values[g], values[j]), o[heads])
    return replace(pooled, q=q, o=o, q_bias=qb)
