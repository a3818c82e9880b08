"""Layer-wise reconstruction, the `local` part of a method: each pooled layer's attention weights fitted
by gradient descent so that its attention block reproduces the original block's output.

Calibration runs the source one layer at a time (layerwise.layer_runs); while a layer is loaded, hooks
on its attention block keep what the block was called with (its input hidden states and whatever the
layer hands it: rotary cos/sin, masks, ALiBi) and what it returned, the target. The method's other
parts pool the layer first (the start); then the block itself runs with candidate weights
(torch.func.functional_call: the family's own projections, rotary, masking and scaling, never a
re-implementation). A GQA layer runs at its GQA shape, as the converted model's block (modeling.at_kv_heads),
where that block returns the MHA form's output; elsewhere as the MHA block it equals (each pooled kv head
repeated for the source heads of its group). Adam minimises the squared error of the block's output over the tensors `free`
names (LocalFit, ground/settings.py: every tunable of the fit): every attention tensor the GQA layer has
("all": the pooled K/V projections, the per-query-head Q and O, their biases and per-head norms), or the pooled K/V tensors and one head_dim × head_dim map per
query head on Q and on O ("maps", identity at the start). "maps" frees 2·kv_heads·head_dim + 2·head_dim
parameters per calibration target whatever the width, "all" about 2·hidden more: at 7B's width "all" is
under-determined by any calibration a CPU can afford. The calibration windows are split, seeded, into a fitted part and a held-out
`validation` share; each step takes a minibatch of `batch` fitted windows, so its cost does not grow with the
tokens. Each tensor's step starts at a fixed fraction (`rate`) of its own RMS and shrinks (cosine) over the
budget. Every `every` steps the held-out windows are scored: the kept iterate is the best there (the start
included, so a layer that validation does not improve keeps its start), the fit stops after `patience` scores
without a new best, and a score that runs away (`runaway` × the best) sends the weights back to the best at
half the rate.
A start that already reproduces the block (kv = heads, identical heads) is returned untouched.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace

import torch
from torch.func import functional_call
from tqdm.auto import tqdm

from headfold.converter import calibration, layerwise
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.layout import AttentionCodec, AttentionWeights, HeadShape
from headfold.converter.methods import convert_attention, expand_kv, moved
from headfold.converter.modeling import at_kv_heads
from headfold.converter.recipes import LayerContext, Recipe
from headfold.converter.seq2seq import SynthesizedAudio
from headfold.ground.settings import LocalFit

EXACT = 1e-12  # a start whose squared error is below this fraction of the target's already reproduces the block
KV_FIELDS = ("k", "v", "k_bias", "v_bias", "k_norm")


@dataclass(frozen=True)
class Errors:
    """A block's output error, relative to the target's squared norm, on each part of the calibration windows."""

    fit: float  # the windows the steps fit
    validation: float | None  # the held-out windows (None: too few windows to hold any out)
    whole: float  # every window

    @property
    def selecting(self) -> float:
        """What picks the kept iterate: the held-out error, or the fitted one where nothing is held out."""
        return self.fit if self.validation is None else self.validation


@dataclass(frozen=True)
class FittedLayer:
    tensors: dict[str, torch.Tensor]  # tensor name → converted tensor, rounded to its source dtype
    groups: list[list[int]]  # source kv heads pooled into each new kv head
    start: Errors  # the block's output error at the start
    end: Errors  # the same for the kept iterate (its validation error ≤ the start's)
    steps: int  # steps taken (≤ the budget: the fit stops when validation stops improving)
    free: str = "all"  # what the fit changed: "all" or "maps" (LocalFit.free, resolved)


@dataclass(frozen=True)
class Fit:
    attn: AttentionWeights
    start: Errors
    end: Errors
    steps: int
    free: str = "all"


def split(count: int, seed: int, share: float = LocalFit.validation) -> tuple[list[int], list[int]]:
    """The indices of a run's calls (one window each) that the fit steps on and those held out for validation:
    a seeded `share`, at least one call, none where there are fewer than two (or the share is 0)."""
    held = max(1, round(count * share)) if count >= 2 and share > 0 else 0
    validation = set(random.Random(seed).sample(range(count), held))
    return [i for i in range(count) if i not in validation], sorted(validation)


def batches(calls: list[int], seed: int, size: int) -> Iterator[list[int]]:
    """`size` calls a step, every call once per pass, in a seeded order shuffled each pass."""
    rng = random.Random(seed)
    order: list[int] = []
    while True:
        if len(order) < min(size, len(calls)):
            rng.shuffle(shuffled := list(calls))
            order += shuffled
        yield order[:size]
        del order[:size]


def fit(
    run: layerwise.LayerRun,
    start: AttentionWeights,
    block_tensors: Callable[[AttentionWeights], dict[str, torch.Tensor]],
    steps: int,
    bar=None,
    seed: int = 0,
    settings: LocalFit = LocalFit(),
) -> Fit:
    """`start` (canonical, on the block's device) fitted for at most `steps` Adam steps to `run`'s block outputs
    on the fit windows; the kept iterate is the best on the held-out windows (the start included), and the fit
    stops after `settings.patience` validations without a new best. `block_tensors` maps canonical weights to
    the block's parameters by name."""
    fitted, held = split(len(run.calls), seed, settings.validation)
    norms = [float(out.double().square().sum()) for out in run.outputs]
    first = errors(run, lambda: block_tensors(start), fitted, held, norms)
    if first.whole <= EXACT:  # nothing to fit: the start, untouched
        return Fit(start, first, first, 0)
    kind = free_kind(start, sum(run.outputs[i].numel() for i in fitted), settings)
    free = free_tensors(start, kind)
    scale = _scales(free)
    for t in free.values():
        t.requires_grad_(True)
    optimizer = torch.optim.Adam([{"params": [t], "lr": settings.rate * scale[name]} for name, t in free.items()])
    rates = [group["lr"] for group in optimizer.param_groups]
    candidate = lambda: block_tensors(applied(start, free))  # noqa: E731
    best, best_error, stale, taken = None, first.selecting, 0, 0  # best: the free tensors of the best iterate (None: the start)
    floor = settings.floor
    for taken, batch in enumerate(batches(fitted, seed + 1, settings.batch), 1):
        optimizer.zero_grad()
        squared_error(run, candidate, batch, backward=True)
        for group, rate in zip(optimizer.param_groups, rates, strict=True):  # cosine from the rate down to `floor` of it
            group["lr"] = rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (taken - 1) / steps)))
        optimizer.step()
        if bar is not None:
            bar.update()
            bar.set_postfix(layer=run.index, error=f"{first.selecting:.3g}→{best_error:.3g}")
        if taken % settings.every == 0 or taken == steps:
            now = squared_error(run, candidate, held or fitted) / sum(norms[i] for i in held or fitted)
            if now < best_error:
                best, best_error, stale = {name: t.detach().clone() for name, t in free.items()}, now, 0
            else:
                stale += 1
                if not now <= settings.runaway * best_error:  # diverging (or NaN): back to the best weights at half the rate
                    with torch.no_grad():
                        for name, t in (best or free_tensors(start, kind)).items():
                            free[name].copy_(t)
                    optimizer.state.clear()
                    rates = [rate / 2 for rate in rates]
        if stale >= settings.patience or taken >= steps:
            break
    if bar is not None:
        bar.update(steps - taken)
    if best is None:
        return Fit(start, first, first, taken, kind)
    kept = applied(start, best)
    return Fit(kept, first, errors(run, lambda: block_tensors(kept), fitted, held, norms), taken, kind)


def free_kind(start: AttentionWeights, targets: int, settings: LocalFit = LocalFit()) -> str:
    """`settings.free`, with "auto" resolved: "all" while every attention tensor's parameters per fitted target stay
    at most `settings.determined`, else "maps"."""
    if settings.free != "auto":
        return settings.free
    parameters = sum(t.numel() for f in fields(start) if (t := getattr(start, f.name)) is not None)
    return "all" if parameters <= settings.determined * targets else "maps"


def free_tensors(start: AttentionWeights, kind: str) -> dict[str, torch.Tensor]:
    """What the fit changes, at the start (copies): every attention tensor (`kind` "all"), or ("maps") the pooled
    K/V tensors and, per query head, a head_dim × head_dim map on Q's rows and one on O's columns."""
    names = [f.name for f in fields(start)] if kind == "all" else KV_FIELDS
    free = {name: t.detach().clone(memory_format=torch.contiguous_format) for name in names if (t := getattr(start, name)) is not None}
    if kind == "all":
        return free
    heads, dim = start.q.shape[:2]
    identity = torch.eye(dim, dtype=start.q.dtype, device=start.q.device).expand(heads, dim, dim)
    return free | {"q_map": identity.clone(), "o_map": identity.clone()}


def applied(start: AttentionWeights, free: dict[str, torch.Tensor]) -> AttentionWeights:
    """`start` with the fit's free tensors in place (the maps multiplied into Q, its bias and O)."""
    if "q_map" not in free:
        return replace(start, **free)
    q_map, o_map = free["q_map"], free["o_map"]
    mapped = {"q": torch.einsum("hij,hjd->hid", q_map, start.q), "o": torch.einsum("hij,hjd->hid", o_map, start.o)}
    if start.q_bias is not None:
        mapped["q_bias"] = torch.einsum("hij,hj->hi", q_map, start.q_bias)
    return replace(start, **{name: t for name, t in free.items() if name in KV_FIELDS}, **mapped)


def errors(run: layerwise.LayerRun, tensors: Callable[[], dict[str, torch.Tensor]], fitted: list[int], held: list[int], norms: list[float]) -> Errors:
    """The block's output error with `tensors()` on the fit windows, the held-out ones and all of them."""
    on_fit, on_held = squared_error(run, tensors, fitted), squared_error(run, tensors, held)
    fit_norm, held_norm = sum(norms[i] for i in fitted), sum(norms[i] for i in held)
    return Errors(on_fit / fit_norm, on_held / held_norm if held else None, (on_fit + on_held) / (fit_norm + held_norm))


def squared_error(run: layerwise.LayerRun, tensors: Callable[[], dict[str, torch.Tensor]], calls: list[int], backward: bool = False) -> float:
    """Squared error of the block's output with `tensors()` (by parameter name) against the original output,
    summed over `calls`; with `backward`, its gradient accumulates call by call (one call's graph at a time).
    `tensors()` is built once for all the calls (the maps multiplied in, K/V expanded): each call backpropagates
    to the built tensors only, and one backward at the end carries their summed gradient to the free tensors."""
    total = 0.0
    with torch.set_grad_enabled(backward):
        built = tensors()
        inputs = {name: t.detach().requires_grad_(t.requires_grad) for name, t in built.items()} if backward else built
        for i in calls:
            loss = (block_output(run, inputs, i) - run.outputs[i]).square().sum()
            if backward:
                loss.backward()
            total += float(loss.detach())
    if backward and (reached := [name for name, t in inputs.items() if t.grad is not None]):
        torch.autograd.backward([built[name] for name in reached], [inputs[name].grad for name in reached])
    return total


def block_output(run: layerwise.LayerRun, tensors: dict[str, torch.Tensor], call: int) -> torch.Tensor:
    """The block's output on `run`'s call `call` with `tensors` (by parameter name) in place of its own."""
    args, kwargs = run.calls[call]
    out = functional_call(run.block, tensors, args, kwargs)
    return out[0] if isinstance(out, tuple) else out


def _scales(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's RMS; a tensor of zeros (an unused bias) takes the mean RMS of the others."""
    rms = {name: float(t.double().square().mean().sqrt()) for name, t in tensors.items()}
    nonzero = [r for r in rms.values() if r > 0] or [1.0]
    return {name: r if r > 0 else sum(nonzero) / len(nonzero) for name, r in rms.items()}


class LayerFitter:
    """Converts each layer of `ckpt` that `targets` pools: the recipe's other parts, then the fit."""

    def __init__(
        self,
        ckpt: SourceCheckpoint,
        targets: list[HeadShape],
        recipe: Recipe,
        contexts: list[LayerContext],
        steps: int,
        seed: int = 0,
        settings: LocalFit = LocalFit(),
    ) -> None:
        self.ckpt, self.targets, self.contexts, self.steps, self.seed, self.settings = ckpt, targets, contexts, steps, seed, settings
        self.start = replace(recipe, local=False)

    def pooled(self, index: int) -> bool:
        return self.targets[index] != self.ckpt.layer_shapes[index]

    def convert(self, run: layerwise.LayerRun, bar=None) -> FittedLayer:
        """Layer `run.index` converted, its tensors on the CPU."""
        ckpt, i = self.ckpt, run.index
        names, codec = ckpt.attention.layers[i], AttentionCodec(ckpt.spec, ckpt.layer_shapes[i])
        source = codec.decode({suffix: ckpt.get(name).float() for suffix, name in names.items()})
        start = convert_attention(self.start, source, self.targets[i].kv_heads, replace(self.contexts[i], inputs=run.inputs))
        device = run.outputs[0].device

        def block_tensors(attn: AttentionWeights) -> dict[str, torch.Tensor]:  # the MHA block the GQA layer equals
            encoded = codec.encode(expand_kv(attn, ckpt.layer_shapes[i].kv_heads))
            return {run.names[names[suffix]]: t for suffix, t in encoded.items()}

        attn = moved(start.attn, device)
        fitted_run, tensors = self.gqa_form(run, attn, block_tensors)
        result = fit(fitted_run, attn, tensors, self.steps, bar, self.seed, self.settings)
        written = {s: t.to(ckpt.tensors[names[s]].dtype) for s, t in codec.encode(result.attn).items()}  # each in its own source dtype
        if self.settings.sequential:  # the next layer reads this one as it will be written
            with torch.no_grad():
                rounded = AttentionCodec(ckpt.spec, self.targets[i]).decode({s: t.float() for s, t in written.items()})
                for name, t in block_tensors(rounded).items():
                    run.block.get_parameter(name).copy_(t)
        return FittedLayer({names[s]: t.cpu() for s, t in written.items()}, start.groups, result.start, result.end, result.steps, result.free)

    def gqa_form(
        self, run: layerwise.LayerRun, start: AttentionWeights, mha_tensors: Callable[[AttentionWeights], dict[str, torch.Tensor]]
    ) -> tuple[layerwise.LayerRun, Callable[[AttentionWeights], dict[str, torch.Tensor]]]:
        """The run and its tensors at the GQA shape (K/V projected once per kv head, not repeated per query head:
        at h/4 three eighths of the block's projections go) where the family's block takes that shape and returns
        the MHA form's output on the first call; else the MHA form."""
        target, names = self.targets[run.index], self.ckpt.attention.layers[run.index]
        block = at_kv_heads(run.block, self.ckpt.facts.config.get("model_type", ""), self.ckpt.layer_shapes[run.index], target.kv_heads)
        codec = AttentionCodec(self.ckpt.spec, target)
        if block is None or not run.calls:
            return run, mha_tensors

        def tensors(attn: AttentionWeights) -> dict[str, torch.Tensor]:
            return {run.names[names[suffix]]: t for suffix, t in codec.encode(attn).items()}

        grouped = replace(run, block=block)
        with torch.no_grad():
            expected = block_output(run, mha_tensors(start), 0)
            try:
                got = block_output(grouped, tensors(start), 0)
            except (RuntimeError, ValueError):  # the block reads its head count from elsewhere too
                return run, mha_tensors
        scale = float(expected.abs().max())
        return (grouped, tensors) if got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * scale) else (run, mha_tensors)


def fitted_layers(
    ckpt: SourceCheckpoint,
    targets: list[HeadShape],
    recipe: Recipe,
    text: str | SynthesizedAudio,
    tokens: int,
    seed: int,
    contexts: list[LayerContext],
    steps: int,
    progress: bool,
    settings: LocalFit = LocalFit(),
) -> dict[int, FittedLayer]:
    """Every pooled layer converted with `recipe`, its `local` part fitted on `tokens` tokens of `text` (windows
    as calibration samples them), one layer loaded at a time; the converted tensors are kept like
    activations (in RAM up to $HEADFOLD_CALIBRATION_RAM, then memory-mapped)."""
    fitter = LayerFitter(ckpt, targets, recipe, contexts, steps, seed, settings)
    store = layerwise.ActivationStore(layerwise.ram_limit())
    done: dict[int, FittedLayer] = {}
    total = steps * sum(fitter.pooled(i) for i in range(len(targets)))  # layers, or an encoder-decoder's attention blocks
    with tqdm(total=total, desc="local", unit="step", disable=not progress) as bar:
        for run in calibration.local_runs(ckpt, text, tokens, seed, settings.sequential, progress):
            if fitter.pooled(run.index):
                layer = fitter.convert(run, bar)
                done[run.index] = replace(layer, tensors={name: store.keep(t) for name, t in layer.tensors.items()})
    return done
