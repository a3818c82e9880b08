"""`headfold inspect`: per-layer head similarity and the predicted loss of each kv-head count.

The source model is loaded once. For each (layer, candidate) the conversion method runs on
that layer alone; its pooled K/V heads are then repeated back to the source's kv-head count
(a GQA layer *is* an MHA layer whose K/V heads are duplicated inside each group, with query
heads and W_O rows as the method permuted them), written into the live model, and the model
runs on evaluation windows against the original outputs; then the original tensors go back.
Nothing is resized and no checkpoint is written. Predicted losses feed the budget planner.

Loss: decoders, mean per-token KL(original ‖ converted) of the next-token distributions
(nats); encoders, 1 − cosine of the mean-pooled last hidden states (the embedding that
`headfold verify` checks).

Encoder-decoders (T5, BART, Whisper) get no loss prediction yet: their report is the decoder's self-
and cross-cache bytes per token, as they are and with the decoder pooled to each candidate (`convert`'s
default --pool), the numbers a conversion's headfold.json records.
"""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from headfold import corpus
from headfold.converter import seq2seq
from headfold.converter.calibration import WINDOW, calibrate, check_settings, sample_windows, token_ids, window_starts
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.conversion import calibration_text, layer_contexts, method_for, target_shapes
from headfold.converter.layout import AttentionCodec, AttentionWeights
from headfold.converter.methods import LayerContext, Recipe, aligned_similarity, convert_attention, expand_kv, get_method, head_activations
from headfold.converter.modeling import load_model, parameter_names
from headfold.converter.planning import LayerOptions, Plan, best_plan, best_uniform, budget_total, parse_candidates
from headfold.converter.recipes import DEFAULT_METHOD
from headfold.converter.sources import checkpoint_folder
from headfold.ground import VERSION
from headfold.ground.artifacts import CREATED_BY, MARK, created_by
from headfold.ground.atomic import atomic_outputs, check_outputs
from headfold.ground.errors import BadInput
from headfold.ground.lazy import lazy_import
from headfold.ground.settings import Calibration
from headfold.verification.metrics import log_probs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

figure = lazy_import("matplotlib.figure")  # the heatmap only; no pyplot: no global state, Agg canvas
colors = lazy_import("matplotlib.colors")
patches = lazy_import("matplotlib.patches")
ticker = lazy_import("matplotlib.ticker")

METRICS = {
    "decoder": "KL(original ‖ converted) of next-token distributions, nats per token",
    "encoder": "1 − cosine of mean-pooled last hidden states, mean over windows",
}
EVAL_CHUNK = 8  # windows per forward pass


# -- windows ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Windows:
    fit: torch.Tensor | None  # [count, WINDOW] token ids the method calibrates on; None: weights only
    eval: torch.Tensor  # [count, WINDOW] token ids the loss is measured on
    held_out: bool  # the eval windows overlap no fit window


def held_out_starts(length: int, count: int, taken: list[int], seed: int) -> list[int]:
    """Up to `count` seeded non-overlapping windows that overlap none of the `taken` ones."""
    free = [s for s in range(0, length - WINDOW + 1, WINDOW) if all(abs(s - t) >= WINDOW for t in taken)]
    return sorted(random.Random(seed).sample(free, min(count, len(free))))


def choose_windows(ids: list[int], tokens: int, seed: int, fit: bool) -> Windows:
    """Fit windows exactly as `headfold convert` samples them; eval windows elsewhere in the text
    (the fit windows themselves only when the text is too short to hold any out)."""
    fit_windows = sample_windows(ids, tokens, seed)  # also rejects a text shorter than a window
    taken = window_starts(len(ids), tokens, seed) if fit else []
    starts = held_out_starts(len(ids), len(fit_windows), taken, seed)
    if not starts:
        return Windows(fit_windows, fit_windows, held_out=False)
    return Windows(fit_windows if fit else None, torch.tensor([ids[s : s + WINDOW] for s in starts]), held_out=True)


# -- measurement -----------------------------------------------------------------------------


class Reference:
    """The source model's outputs on the eval windows, and the loss of the (edited) model against them."""

    def __init__(self, model: torch.nn.Module, batch: torch.Tensor, kind: str) -> None:
        self.model, self.batch, self.kind = model, batch, kind
        self.outputs = self._outputs()

    @torch.no_grad()
    def _outputs(self) -> torch.Tensor:
        if self.kind == "decoder":
            return log_probs(self.model, self.batch, EVAL_CHUNK)
        hidden = [self.model(input_ids=part, output_hidden_states=True).hidden_states[-1] for part in self.batch.split(EVAL_CHUNK)]
        return torch.cat(hidden).mean(1)

    def loss(self) -> float:
        """The metric of METRICS[kind] for the model as it is now."""
        candidate = self._outputs()
        if self.kind == "decoder":
            kl = F.kl_div(candidate.double(), self.outputs.double(), log_target=True, reduction="sum")
            return float(kl) / (self.outputs.shape[0] * self.outputs.shape[1])
        return float((1 - F.cosine_similarity(candidate.double(), self.outputs.double(), dim=-1)).mean())


class LiveAttention:
    """Writes converted attention tensors into the loaded model's parameters, then puts the originals back."""

    def __init__(self, model: PreTrainedModel, ckpt: SourceCheckpoint) -> None:
        names, state = parameter_names(model, ckpt.facts), model.state_dict()  # state shares the parameters' storage
        unmapped = [n for layer in ckpt.attention.layers for n in layer.values() if n not in names]
        if unmapped:
            raise BadInput(f"tensor {unmapped[0]} is merged or split when {type(model).__name__} loads; inspect cannot edit it in place")
        self.layers = [{suffix: state[names[name]] for suffix, name in layer.items()} for layer in ckpt.attention.layers]

    @contextmanager
    def replaced(self, tensors: dict[int, dict[str, torch.Tensor]]) -> Iterator[None]:
        """Inside the block, layer i's attention tensors are `tensors[i]` (suffix → tensor)."""
        saved = {i: {s: self.layers[i][s].clone() for s in layer} for i, layer in tensors.items()}
        try:
            for i, layer in tensors.items():
                for suffix, t in layer.items():
                    self.layers[i][suffix].copy_(t)
            yield
        finally:
            for i, layer in saved.items():
                for suffix, t in layer.items():
                    self.layers[i][suffix].copy_(t)


class LayerConverter:
    """One layer converted with a recipe, as source-shaped tensors rounded to the source dtype
    (what `headfold convert` would write, re-expanded to the source's kv heads)."""

    def __init__(self, ckpt: SourceCheckpoint, recipe: Recipe, contexts: list[LayerContext]) -> None:
        self.ckpt, self.recipe, self.contexts = ckpt, recipe, contexts
        self.codec = AttentionCodec(ckpt.spec, ckpt.shape)

    def decode(self, index: int) -> AttentionWeights:
        return self.codec.decode({s: self.ckpt.get(n).float() for s, n in self.ckpt.attention.layers[index].items()})

    def convert(self, index: int, kv_heads: int, source: AttentionWeights | None = None) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
        result = convert_attention(self.recipe, source if source is not None else self.decode(index), kv_heads, self.contexts[index])
        names = self.ckpt.attention.layers[index]
        encoded = self.codec.encode(expand_kv(result.attn, self.ckpt.shape.kv_heads))
        return {s: t.to(self.ckpt.tensors[names[s]].dtype).float() for s, t in encoded.items()}, result.groups


# -- similarity ------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadSimilarity:
    keys: torch.Tensor  # [n, n] cosine of the flattened per-head K activations, as they are
    values: torch.Tensor  # [n, n] the same for V
    # [n, n] mean K/V cosine after the best function-preserving rotation (what `grouped` and
    # `aligned` see): raw cosines of RoPE heads are ~0 because each head has its own basis
    aligned: torch.Tensor

    @property
    def nearest(self) -> torch.Tensor:
        """Per head: its aligned similarity to the most similar other head (1 = a duplicate)."""
        off = self.aligned.clone().fill_diagonal_(-torch.inf)
        return off.max(1).values if len(off) > 1 else torch.ones(1, dtype=off.dtype)

    @property
    def mean(self) -> float:
        """Mean aligned similarity over distinct head pairs."""
        n = len(self.aligned)
        return float((self.aligned.sum() - self.aligned.trace()) / (n * (n - 1))) if n > 1 else 1.0


def _cosines(acts: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.stack([a.flatten() for a in acts]).double()
    flat = flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return (flat @ flat.T).clamp(-1, 1)


def head_similarity(attn: AttentionWeights, ctx: LayerContext) -> HeadSimilarity:
    """On calibration activations (on the weights under --calibration weights): raw and aligned."""
    keys, values = head_activations(attn.k, attn.k_bias, ctx), head_activations(attn.v, attn.v_bias, ctx)
    aligned = aligned_similarity(keys, values, ctx.rotary if ctx.rotate_keys else None)
    return HeadSimilarity(_cosines(keys), _cosines(values), aligned)


# -- the report ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerReport:
    similarity: HeadSimilarity
    loss: LayerOptions  # candidate kv heads -> predicted loss of converting this layer alone
    groups: dict[int, list[list[int]]]  # candidate kv heads -> source kv heads pooled per new kv head


@dataclass(frozen=True)
class PlanReport:
    plan: Plan
    measured: float  # the loss with every layer of the plan converted at once
    source_total: int  # the source's kv heads summed over layers

    @property
    def fraction(self) -> float:
        return self.plan.total / self.source_total

    def to_json(self) -> dict[str, Any]:
        return {
            "kv_heads": list(self.plan.kv_heads),
            "argument": self.plan.argument,
            "predicted": self.plan.loss,
            "measured": self.measured,
            "kv_heads_total": self.plan.total,
            "cache_fraction": self.fraction,
        }

    def line(self, metric: str) -> str:
        return (
            f"{self.plan.argument}  predicted {metric} {self.plan.loss:.4g} (sum of layers), measured {self.measured:.4g} (all at once), cache "
            f"{self.fraction:.1%} of the source"
        )


@dataclass(frozen=True)
class Inspection:
    source: Path
    family: str
    kind: str
    heads: int
    kv_heads: int
    head_dim: int
    method: str
    candidates: list[int]
    calibration: dict[str, Any]
    layers: list[LayerReport]
    budget: int | None = None  # most kv heads summed over layers
    plan: PlanReport | None = None
    uniform: PlanReport | None = None

    @property
    def metric(self) -> str:
        return "KL" if self.kind == "decoder" else "1-cos"

    def to_json(self) -> dict[str, Any]:
        matrix = lambda t: [[float(x) for x in row] for row in t]  # noqa: E731
        return {
            CREATED_BY: created_by(),  # headfold's mark: --overwrite replaces only marked files
            "source": str(self.source),
            "family": self.family,
            "kind": self.kind,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "layers": len(self.layers),
            "method": self.method,
            "metric": METRICS[self.kind],
            "candidates": self.candidates,
            "calibration": self.calibration,
            "per_layer": [
                {
                    "layer": i,
                    "similarity": {
                        "keys": matrix(r.similarity.keys),
                        "values": matrix(r.similarity.values),
                        "aligned": matrix(r.similarity.aligned),
                        "nearest": [float(x) for x in r.similarity.nearest],
                        "mean": r.similarity.mean,
                    },
                    "loss": {str(k): v for k, v in r.loss.items()},
                    "groups": {str(k): g for k, g in r.groups.items()},
                }
                for i, r in enumerate(self.layers)
            ],
            "budget": None if self.budget is None else {"kv_heads_total": self.budget, "source_kv_heads_total": self.source_total},
            "plan": self.plan and self.plan.to_json(),
            "uniform": self.uniform and self.uniform.to_json(),
        }

    @property
    def source_total(self) -> int:
        return self.kv_heads * len(self.layers)

    def table(self) -> str:
        c = self.calibration
        where = f"windows of {c['eval_text']} not used for fitting" if c["eval_held_out"] else "the fit windows (the text is too short to hold any out)"
        lines = [
            f"{self.source}: {self.family} {self.kind}, {len(self.layers)} layers, {self.heads} heads, {self.kv_heads} kv heads, head_dim {self.head_dim}",
            f"method {self.method}, "
            + (f"fit on {c['text']} ({c['fit_windows']} windows × {WINDOW} tokens, seed {c['seed']})" if c["fit_windows"] else "fit on the weights alone"),
            f"predicted loss = {METRICS[self.kind]}, one layer converted, on {c['eval_windows']} {where}",
            "similarity = mean K/V cosine of two heads after the best function-preserving rotation (mean over pairs, max for the closest pair)",
            "",
            f"{'layer':>5}  {'sim mean':>8}  {'sim max':>7}" + "".join(f"  {self.metric + '@' + str(k):>10}" for k in self.candidates),
        ]
        for i, r in enumerate(self.layers):
            row = f"{i:>5}  {r.similarity.mean:>8.3f}  {float(r.similarity.nearest.max()):>7.3f}"
            lines.append(row + "".join(f"  {r.loss[k]:>10.4g}" for k in self.candidates))
        if self.plan is not None:
            lines += ["", f"budget {self.budget} of {self.source_total} kv heads (layers × kv heads)", f"plan     {self.plan.line(self.metric)}"]
            lines.append(f"uniform  {self.uniform.line(self.metric)}" if self.uniform else "uniform  none fits the budget")
        return "\n".join(lines)


# -- running it ------------------------------------------------------------------------------


def inspect_checkpoint(
    source: str | os.PathLike,  # a folder or hub id, as checkpoint_folder takes it
    *,
    candidates: str | None = None,
    method: str = DEFAULT_METHOD,
    calibration: str | Path | None = None,
    calibration_tokens: int = Calibration.tokens,
    seed: int = Calibration.seed,
    kv_budget: float | int | None = None,
    heatmap: Path | None = None,
    json_path: Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
    revision: str | None = None,
) -> Inspection | CacheInspection:
    """Measure SOURCE (see the module doc), plan for `kv_budget` (a fraction of the source cache, or
    a total of kv heads), write the heatmap / JSON atomically. BadInput before any work for bad requests."""
    source = checkpoint_folder(source, revision=revision)
    get_method(method)  # an unknown method is bad input before any work
    check_settings()  # $HEADFOLD_DEVICE, $HEADFOLD_CALIBRATION_RAM
    outputs = [(p, False) for p in (heatmap, json_path) if p is not None]
    report: Inspection | CacheInspection
    with SourceCheckpoint(source) as ckpt:
        if ckpt.spec.encoder_decoder:
            report = cache_inspection(ckpt, candidates, kv_budget, heatmap)
            check_outputs(outputs, overwrite=overwrite, sources=(source,))
        else:
            report = _inspect(ckpt, candidates, method, calibration, calibration_tokens, seed, kv_budget, outputs, overwrite, progress)
    reads = (source, *(() if calibration is None or str(calibration) == "weights" else (Path(calibration),)))
    with atomic_outputs(outputs, overwrite=overwrite, sources=reads) as staged:  # both appear, or neither
        if heatmap is not None:
            assert isinstance(report, Inspection)  # cache_inspection refuses --heatmap
            staged[heatmap].write_bytes(heatmap_png(report))
        if json_path is not None:
            staged[json_path].write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return report


def _inspect(
    ckpt: SourceCheckpoint,
    candidates: str | None,
    method: str,
    calibration: str | Path | None,
    calibration_tokens: int,
    seed: int,
    kv_budget: float | int | None,
    outputs: list[tuple[Path, bool]],
    overwrite: bool,
    progress: bool,
) -> Inspection:
    """A decoder's or an encoder's report (the module doc)."""
    source = ckpt.folder
    if len(set(ckpt.layer_shapes)) > 1:
        raise BadInput(f"{source} already has per-layer kv heads; inspect the checkpoint it was converted from")
    ckpt.facts.require_positions(WINDOW, f"inspect (it measures the loss on windows of {WINDOW} tokens)", "inspect a model that takes them", table_only=True)
    recipe = method_for(ckpt, method)  # ALiBi refuses grouped, clip_qkv rotations: as convert does
    if recipe.local and method == DEFAULT_METHOD:  # the default's pooling: its local part fits while convert runs the layers
        recipe = replace(recipe, local=False)
    elif recipe.local:
        raise BadInput(
            f"inspect predicts each layer's loss without fitting it; inspect {replace(recipe, local=False).name} (local fits while convert runs the layers)"
        )
    cands = parse_candidates(candidates, ckpt.shape.kv_heads)
    if ckpt.spec.mqa_only:  # gpt_bigcode: 1 kv head in every layer, or none pooled
        if kv_budget is not None:
            raise BadInput(f"{ckpt.spec.family} has multi-query attention in every layer or none, so no per-layer plan; drop --kv-budget")
        cands = [1]
    budget = None if kv_budget is None else budget_total(kv_budget, ckpt.shape.kv_heads * ckpt.layers)
    if budget is not None:  # infeasible budgets fail before the slow part
        best_plan([dict.fromkeys([*cands, ckpt.shape.kv_heads], 0.0)] * ckpt.layers, budget)
    text_file = () if calibration is None or str(calibration) == "weights" else (Path(calibration),)
    reads = (source, *text_file)
    check_outputs(outputs, overwrite=overwrite, sources=reads)  # never over an input: before the slow part
    return _measure(ckpt, recipe, cands, calibration, calibration_tokens, seed, budget, progress)


@dataclass(frozen=True)
class CacheInspection:
    """An encoder-decoder's report: its attention kinds and the decoder's cache bytes per token per candidate."""

    source: Path
    family: str
    attentions: dict[str, dict[str, Any]]  # kind → heads, kv_heads, head_dim, layers
    candidates: list[int]
    cache_bytes_per_token: dict[int, dict[str, dict[str, int]]]  # candidate → self/cross → before/after

    def to_json(self) -> dict[str, Any]:
        return {
            CREATED_BY: created_by(),
            "source": str(self.source),
            "family": self.family,
            "kind": "seq2seq",
            "attentions": self.attentions,
            "pool": seq2seq.DEFAULT_POOL,
            "candidates": self.candidates,
            "cache_bytes_per_token": {str(k): v for k, v in self.cache_bytes_per_token.items()},
        }

    def table(self) -> str:
        kinds = ", ".join(f"{seq2seq.KIND_NAMES[k]} {a['layers']} layers × {a['heads']} heads ({a['kv_heads']} kv)" for k, a in self.attentions.items())
        lines = [
            f"{self.source}: {self.family} encoder-decoder: {kinds}",
            "decoder cache bytes per token (self: per target token, cross: per source token), with the decoder's self- and cross-attention pooled",
            "(no loss prediction for encoder-decoders yet)",
            "",
            f"{'kv heads':>8}  {'self before':>11}  {'self after':>10}  {'cross before':>12}  {'cross after':>11}",
        ]
        for k, caches in self.cache_bytes_per_token.items():
            lines.append(
                f"{k:>8}  {caches['self']['before']:>11}  {caches['self']['after']:>10}  {caches['cross']['before']:>12}  {caches['cross']['after']:>11}"
            )
        return "\n".join(lines)


def cache_inspection(ckpt: SourceCheckpoint, candidates: str | None, kv_budget: float | int | None, heatmap: Path | None) -> CacheInspection:
    """An encoder-decoder's cache bytes per token for each candidate (BadInput for the options that measure loss)."""
    if kv_budget is not None or heatmap is not None:
        raise BadInput(f"--kv-budget and --heatmap need the loss prediction, which encoder-decoders ({ckpt.spec.family}) do not have yet; drop them")
    blocks = ckpt.facts.blocks
    attentions: dict[str, dict[str, Any]] = {}
    for block in blocks:
        entry = attentions.setdefault(block.kind, {"heads": block.shape.heads, "kv_heads": [], "head_dim": block.shape.head_dim, "layers": 0})
        entry["kv_heads"].append(block.shape.kv_heads)
        entry["layers"] += 1
    for entry in attentions.values():
        entry["kv_heads"] = max(entry["kv_heads"]) if len(set(entry["kv_heads"])) == 1 else entry["kv_heads"]
    decoder_kv = max(b.shape.kv_heads for b in blocks if b.kind in seq2seq.POOL_CHOICES[seq2seq.DEFAULT_POOL])
    cands = parse_candidates(candidates, decoder_kv)
    caches = {k: seq2seq.cache_bytes(ckpt, target_shapes(ckpt, k)) for k in cands}
    return CacheInspection(ckpt.folder, ckpt.spec.family, attentions, cands, caches)


@torch.no_grad()
def _measure(
    ckpt: SourceCheckpoint, recipe: Recipe, candidates: list[int], calibration: str | Path | None, tokens: int, seed: int, budget: int | None, progress: bool
) -> Inspection:
    model = load_model(ckpt.facts, dtype=torch.float32)  # the facts and tensor index convert read
    fit_text = calibration_text(calibration, corpus.calibration_text())  # None under --calibration weights: methods see weights only
    ids = token_ids(ckpt.folder, fit_text if fit_text is not None else corpus.calibration_text(), ckpt.facts.vocab_size)
    windows = choose_windows(ids, tokens, seed, fit=fit_text is not None)
    contexts = layer_contexts(ckpt, None, 0, seed, False)  # RoPE dims and K rules, no inputs yet
    if windows.fit is not None:
        contexts = [replace(ctx, inputs=x) for ctx, x in zip(contexts, calibrate(ckpt, windows.fit, progress), strict=True)]
    reference, live = Reference(model, windows.eval, ckpt.facts.kind), LiveAttention(model, ckpt)
    converter = LayerConverter(ckpt, recipe, contexts)
    layers = _layer_reports(converter, live, reference, candidates, progress)
    plan: PlanReport | None = None
    uniform: PlanReport | None = None
    if budget is not None:
        options = [{**r.loss, ckpt.shape.kv_heads: 0.0} for r in layers]  # keeping a layer as it is costs nothing
        plan = _plan_report(best_plan(options, budget), converter, live, reference)
        chosen = best_uniform(options, budget)
        uniform = None if chosen is None else _plan_report(chosen, converter, live, reference)
    used = "weights" if fit_text is None else str(calibration or "built-in text")
    info = {
        "text": used,
        "eval_text": "built-in text" if fit_text is None else used,
        "tokens": tokens,
        "seed": seed,
        "fit_windows": 0 if windows.fit is None else len(windows.fit),
        "eval_windows": len(windows.eval),
        "eval_held_out": windows.held_out,
        "window": WINDOW,
    }
    s = ckpt.shape
    return Inspection(
        ckpt.folder, ckpt.spec.family, ckpt.facts.kind, s.heads, s.kv_heads, s.head_dim, recipe.name, candidates, info, layers, budget, plan, uniform
    )


def _layer_reports(converter: LayerConverter, live: LiveAttention, reference: Reference, candidates: list[int], progress: bool) -> list[LayerReport]:
    layers = converter.ckpt.layers
    reports = []
    with tqdm(total=layers * len(candidates), desc="inspect", unit="eval", disable=not progress) as bar:
        for i in range(layers):
            attn = converter.decode(i)
            loss, groups = {}, {}
            for k in candidates:
                tensors, groups[k] = converter.convert(i, k, attn)
                with live.replaced({i: tensors}):
                    loss[k] = reference.loss()
                bar.update()
            reports.append(LayerReport(head_similarity(attn, converter.contexts[i]), loss, groups))
    return reports


def _plan_report(plan: Plan, converter: LayerConverter, live: LiveAttention, reference: Reference) -> PlanReport:
    """Measure a plan with all its layers converted at once (layers kept at full kv heads stay untouched)."""
    kv_heads = converter.ckpt.shape.kv_heads
    tensors = {i: converter.convert(i, k)[0] for i, k in enumerate(plan.kv_heads) if k != kv_heads}
    with live.replaced(tensors):
        measured = reference.loss()
    return PlanReport(plan, measured, kv_heads * converter.ckpt.layers)


# -- the heatmap -----------------------------------------------------------------------------


def heatmap_png(report: Inspection) -> bytes:
    """The heatmap (heatmap_figure) as PNG bytes."""
    buffer = io.BytesIO()
    heatmap_figure(report).savefig(buffer, format="png", dpi=110, metadata={"Software": f"{MARK} {VERSION}"})  # headfold's mark
    return buffer.getvalue()


def heatmap_figure(report: Inspection):
    """Two panels, layers down: nearest-head similarity per kv head, predicted loss per candidate.

    The plan's choice is outlined in every layer; a layer it keeps whole gets a column of its own
    ("kept", no loss). Colour bars sit under their panels, so no label reaches the next panel."""
    columns = _loss_columns(report)
    sim = np.array([r.similarity.nearest.numpy() for r in report.layers])
    widths = [sim.shape[1], 1.5 * max(len(columns), 3)]  # loss cells carry numbers: wider than similarity cells
    fig = figure.Figure(figsize=(2 + 0.45 * sum(widths), 2.6 + 0.4 * len(report.layers)), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=widths)
    image = left.imshow(sim, cmap="viridis", vmin=min(0.0, float(sim.min())), vmax=1.0, aspect="auto")
    fig.colorbar(image, ax=left, location="bottom", shrink=0.8, label="similarity to the nearest other head")
    left.set(title="K/V head similarity (aligned)", xlabel="kv head", ylabel="layer", yticks=range(len(report.layers)))
    _loss_panel(fig, right, report, columns)
    return fig


def _loss_panel(fig, axes, report: Inspection, columns: list[int]) -> None:
    """Predicted loss per layer and kv-head count on a log scale, the values written in, the plan outlined."""
    loss = np.array([[r.loss.get(k, 0.0) for k in columns] for r in report.layers])
    positive = loss[loss > 0]
    floor = positive.min() if positive.size else 1e-12
    norm = colors.LogNorm(floor, max(floor * 10, float(loss.max())))
    image = axes.imshow(np.maximum(loss, floor), cmap="magma_r", norm=norm, aspect="auto")
    bar = fig.colorbar(image, ax=axes, location="bottom", shrink=0.8, label=f"predicted {report.metric}, one layer converted")
    ticks = np.geomspace(norm.vmin, norm.vmax, 4)  # a log bar labels its minor ticks too, into each other
    bar.set_ticks(ticks, labels=[f"{t:.2g}" for t in ticks])
    bar.ax.xaxis.set_minor_formatter(ticker.NullFormatter())
    labels = [f"{k} (kept)" if k == report.kv_heads else str(k) for k in columns]
    axes.set(title=f"predicted loss\n{report.method}", xlabel="kv heads", xticks=range(len(columns)), xticklabels=labels, yticks=range(len(report.layers)))
    for (y, x), value in np.ndenumerate(loss):
        dark = norm(max(value, floor)) > 0.6  # magma_r: high values are dark
        axes.text(x, y, f"{value:.2g}", ha="center", va="center", fontsize=7, color="white" if dark else "black")
    if report.plan is not None:
        for i, k in enumerate(report.plan.plan.kv_heads):
            axes.add_patch(_outline(columns.index(k), i))


def _loss_columns(report: Inspection) -> list[int]:
    """The candidates, and the source's own count where the plan keeps a layer whole (a choice of no loss)."""
    kept = report.plan is not None and report.kv_heads in report.plan.plan.kv_heads
    return [report.kv_heads, *report.candidates] if kept and report.kv_heads not in report.candidates else report.candidates


def _outline(x: int, y: int):
    return patches.Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="deepskyblue", linewidth=3)  # visible on light and dark cells alike
