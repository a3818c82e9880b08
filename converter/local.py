"""Layer-wise reconstruction, the `local` part of a method: each pooled layer's attention weights fitted
by gradient descent so that its attention block reproduces the original block's output.

Calibration runs the source one layer at a time (layerwise.layer_runs); while a layer is loaded, hooks
on its attention block keep what the block was called with (its input hidden states and whatever the
layer hands it: rotary cos/sin, masks, ALiBi) and what it returned, the target. The method's other
parts pool the layer first (the start); then the block itself runs with candidate weights
(torch.func.functional_call: the family's own projections, rotary, masking and scaling, never a
re-implementation), a GQA layer run as the MHA block it equals (each pooled kv head repeated for the
source heads of its group). Adam minimises the squared error of the block's output over every attention
tensor the GQA layer has: the pooled K/V projections, the per-query-head Q and O, their biases and
per-head norms, on every calibration token at each step. Each tensor's step is a fixed fraction of its own
RMS; an error that runs away (RUNAWAY × the best so far) sends the weights back to the best iterate at
half the rate. The best iterate (the start included) is kept, so a layer never ends worse on its
calibration data than it started; a start that already reproduces the block (kv = heads, identical heads)
is returned untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
from torch.func import functional_call
from tqdm.auto import tqdm

from headfold.converter import calibration, layerwise
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.layout import AttentionCodec, AttentionWeights, HeadShape
from headfold.converter.methods import convert_attention, expand_kv, moved
from headfold.converter.recipes import LayerContext, Recipe

RATE = 0.05  # Adam's step, as a fraction of each tensor's RMS
RUNAWAY = 2.0  # an error this many times the best so far: back to the best weights, at half the rate
SEQUENTIAL = False  # each layer reads the source model's hidden states (teacher-forced); see docs/methods.md
EXACT = 1e-12  # a start whose squared error is below this fraction of the target's already reproduces the block


@dataclass(frozen=True)
class FittedLayer:
    tensors: dict[str, torch.Tensor]  # tensor name → converted tensor, rounded to the source dtype
    groups: list[list[int]]  # source kv heads pooled into each new kv head
    start: float  # the block's output error at the start, relative to the output's squared norm
    end: float  # the same after the fit (≤ start)


@dataclass(frozen=True)
class Fit:
    attn: AttentionWeights
    start: float  # squared error of the block's output at the start, relative to the target's squared norm
    end: float  # the same for the kept iterate (≤ start)


def fit(run: layerwise.LayerRun, start: AttentionWeights, block_tensors: Callable[[AttentionWeights], dict[str, torch.Tensor]], steps: int, bar=None) -> Fit:
    """`start` (canonical, on the block's device) fitted for `steps` Adam steps to `run`'s block outputs;
    `block_tensors` maps canonical weights to the block's parameters by name."""
    target = sum(float(out.double().square().sum()) for out in run.outputs)
    trainable = {f.name: t.detach().clone(memory_format=torch.contiguous_format) for f in fields(start) if (t := getattr(start, f.name)) is not None}
    scale = _scales(trainable)
    for t in trainable.values():
        t.requires_grad_(True)
    optimizer = torch.optim.Adam([{"params": [t], "lr": RATE * scale[name]} for name, t in trainable.items()])
    best, first, best_error = start, math.inf, math.inf
    for step in range(steps + 1):  # the error of step s is that of the weights after s updates
        optimizer.zero_grad()
        now = error(run, lambda: block_tensors(replace(start, **trainable)), backward=step < steps) / target
        if step == 0:
            first = now
            if now <= EXACT:  # nothing to fit: the start, untouched
                break
        if now < best_error:
            best, best_error = replace(start, **{name: t.detach().clone() for name, t in trainable.items()}), now
        runaway = now > RUNAWAY * best_error
        if runaway:  # back to the best weights at half the rate (that gradient was taken elsewhere: no step with it)
            with torch.no_grad():
                for name, t in trainable.items():
                    t.copy_(getattr(best, name))
            optimizer.state.clear()
            for group in optimizer.param_groups:
                group["lr"] /= 2
        if step < steps:
            if not runaway:
                optimizer.step()
            if bar is not None:
                bar.update()
                bar.set_postfix(layer=run.index, error=f"{first:.3g}→{best_error:.3g}")
    if bar is not None:
        bar.update(steps - min(step, steps))
    return Fit(start if step == 0 else best, first, min(first, best_error))


def error(run: layerwise.LayerRun, tensors: Callable[[], dict[str, torch.Tensor]], backward: bool = False) -> float:
    """Squared error of the block's output with `tensors()` (by parameter name) against the original output,
    summed over the chunks; with `backward`, its gradient accumulates chunk by chunk (one chunk's graph at a time)."""
    total = 0.0
    with torch.set_grad_enabled(backward):
        for (args, kwargs), target in zip(run.calls, run.outputs):
            out = functional_call(run.block, tensors(), args, kwargs)
            loss = ((out[0] if isinstance(out, tuple) else out) - target).square().sum()
            if backward:
                loss.backward()
            total += float(loss.detach())
    return total


def _scales(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's RMS; a tensor of zeros (an unused bias) takes the mean RMS of the others."""
    rms = {name: float(t.double().square().mean().sqrt()) for name, t in tensors.items()}
    nonzero = [r for r in rms.values() if r > 0] or [1.0]
    return {name: r if r > 0 else sum(nonzero) / len(nonzero) for name, r in rms.items()}


class LayerFitter:
    """Converts each layer of `ckpt` that `targets` pools: the recipe's other parts, then the fit."""

    def __init__(self, ckpt: SourceCheckpoint, targets: list[HeadShape], recipe: Recipe, contexts: list[LayerContext], steps: int) -> None:
        self.ckpt, self.targets, self.contexts, self.steps = ckpt, targets, contexts, steps
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

        def block_tensors(attn: AttentionWeights) -> dict[str, torch.Tensor]:
            encoded = codec.encode(expand_kv(attn, ckpt.layer_shapes[i].kv_heads))
            return {run.names[names[suffix]]: t for suffix, t in encoded.items()}

        result = fit(run, moved(start.attn, device), block_tensors, self.steps, bar)
        dtype = ckpt.tensors[next(iter(names.values()))].dtype  # a layer's attention tensors share one dtype
        written = replace(result.attn, **{f.name: t.to(dtype) for f in fields(result.attn) if (t := getattr(result.attn, f.name)) is not None})
        if SEQUENTIAL:  # the next layer reads this one as it will be written
            with torch.no_grad():
                for name, t in block_tensors(written).items():
                    run.block.get_parameter(name).copy_(t.float())
        encoded = {names[s]: t.cpu() for s, t in codec.encode(written).items()}
        return FittedLayer(encoded, start.groups, result.start, result.end)


def fitted_layers(
    ckpt: SourceCheckpoint, targets: list[HeadShape], recipe: Recipe, text: str, tokens: int, seed: int, contexts: list[LayerContext], steps: int, progress: bool,
) -> dict[int, FittedLayer]:
    """Every pooled layer converted with `recipe`, its `local` part fitted on `tokens` tokens of `text` (windows
    as calibration samples them), one layer loaded at a time; the converted tensors are kept like
    activations (in RAM up to $HEADFOLD_CALIBRATION_RAM, then memory-mapped)."""
    fitter = LayerFitter(ckpt, targets, recipe, contexts, steps)
    store = layerwise.ActivationStore(layerwise.ram_limit())
    done: dict[int, FittedLayer] = {}
    total = steps * sum(fitter.pooled(i) for i in range(len(targets)))  # layers, or an encoder-decoder's attention blocks
    with tqdm(total=total, desc="local", unit="step", disable=not progress) as bar:
        for run in calibration.local_runs(ckpt, text, tokens, seed, SEQUENTIAL, progress):
            if fitter.pooled(run.index):
                layer = fitter.convert(run, bar)
                done[run.index] = replace(layer, tensors={name: store.keep(t) for name, t in layer.tensors.items()})
    return done
