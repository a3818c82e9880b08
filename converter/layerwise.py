"""Layer-by-layer calibration: the source model run one layer at a time, never whole.

The model is built on the meta device, where it holds no memory. Its embedding stage runs once
over the calibration windows with the first layer replaced by a catcher, which keeps the hidden
states and every other argument the model hands its layers (masks, rotary cos/sin, ...) and stops
the forward: whatever a family computes before its layers is computed by its own code. Then each
layer alone is loaded from the checkpoint onto the compute device, run over the kept hidden states
(overwriting them with its outputs, the next layer's inputs) with a hook on its Q (or fused QKV)
projection keeping the attention input, and freed. The last layer stops at that hook.

Peak memory: one layer, the embedding stage, and the activations. These live in RAM while they fit
$HEADFOLD_CALIBRATION_RAM (default 2GiB), past it in memory-mapped temporary files (under $TMPDIR).
"""

from __future__ import annotations

import ctypes
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_map_only  # torch's own nested-container map (export and compile use it)
from tqdm.auto import tqdm

from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.modeling import empty_model
from headfold.ground.errors import BadInput
from headfold.ground.units import parse_size

RAM_VARIABLE = "HEADFOLD_CALIBRATION_RAM"
DEFAULT_RAM = "2GiB"
CHUNK = 8  # windows per forward pass


class ActivationStore:
    """Tensors (fp32 unless asked) in RAM while their total stays under `limit` bytes, past it in memory-mapped files.

    A file is unlinked as soon as it is mapped: the mapping alone keeps it, and the space is
    returned when the tensor is freed or the process ends, however it ends.
    """

    def __init__(self, limit: int) -> None:
        self.limit, self.in_ram = limit, 0

    def empty(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        nbytes = dtype.itemsize * math.prod(shape)
        if self.in_ram + nbytes <= self.limit:
            self.in_ram += nbytes
            return torch.empty(shape, dtype=dtype)
        with tempfile.NamedTemporaryFile(prefix="headfold-calibration-") as f:
            f.truncate(max(nbytes, 1))  # numpy maps no empty file
            mapped = torch.from_numpy(np.memmap(f.name, np.uint8, "r+", shape=(max(nbytes, 1),)))
            return mapped[:nbytes].view(dtype).view(shape)  # bytes seen as `dtype`: numpy has no bf16

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` in its own dtype in the store, on the CPU."""
        kept = self.empty(*t.shape, dtype=t.dtype)
        kept.copy_(t)
        return kept


def return_freed_memory() -> None:
    """Map every allocation of 8 MiB or more on its own, so freeing it returns it to the OS at once.

    glibc raises its mmap threshold after the first large free and then serves the activation
    blocks from a heap it rarely shrinks, so calibration's peak memory grew by about the
    activations again. Smaller blocks (the methods' per-head maths) stay on the heap: mapping
    those too made the conversion maths several times slower.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 8 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: its allocator is left as it is
        pass


def ram_limit() -> int:
    """Bytes of activations kept in RAM: $HEADFOLD_CALIBRATION_RAM (e.g. 8GiB), else 2 GiB."""
    value = os.environ.get(RAM_VARIABLE) or DEFAULT_RAM
    try:
        return parse_size(value)
    except BadInput:
        raise BadInput(f"{RAM_VARIABLE}={value!r} is not a size; write e.g. 2GiB (activations past it go to memory-mapped files)") from None


class _Stop(Exception):
    """Ends a forward pass once what it was run for has been kept."""


class _Catcher(nn.Module):
    """Stands in for the first layer: keeps the arguments the model calls it with, then stops."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple, dict[str, Any]]] = []

    def forward(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))
        raise _Stop


class LayerwiseModel:
    """A checkpoint's model whose parts hold weights only while they run."""

    def __init__(self, ckpt: SourceCheckpoint, device: torch.device) -> None:
        self.ckpt, self.device = ckpt, device
        self.model, self.sources = empty_model(ckpt.facts, {n: t.shape for n, t in ckpt.tensors.items()})
        self.names = {m: name for name, m in self.model.named_modules()}
        self.layers = self._layer_list()

    def _layer_list(self) -> nn.ModuleList:
        """The ModuleList that the spec's layer prefix ("layers.{layer}.self_attn.") indexes."""
        path = self.ckpt.spec.layer_prefix.split("{layer}")[0].rstrip(".")
        for name, module in self.model.named_modules():
            if isinstance(module, nn.ModuleList) and (name == path or name.endswith("." + path)) and len(module) == self.ckpt.layers:
                return module
        raise BadInput(f"cannot find the {self.ckpt.layers} layers '{path}' in {type(self.model).__name__} to calibrate")

    def load(self, module: nn.Module, recurse: bool = True) -> None:
        """Give `module` (and its children) real tensors on the device: the checkpoint's, and the
        non-persistent buffers (RoPE frequencies, position ids) computed as from_pretrained does."""
        module.to_empty(device=self.device, recurse=recurse)
        for m in module.modules() if recurse else [module]:
            if m._non_persistent_buffers_set:
                self.model._init_weights(m)
            prefix = self.names[m] + "." if self.names[m] else ""
            for name, t in chain(m.named_parameters(recurse=False), m.named_buffers(recurse=False)):
                if prefix + name in self.sources:
                    t.copy_(self.ckpt.get(self.sources[prefix + name]))

    def projection(self, layer: int) -> nn.Module:
        """The module whose input is layer `layer`'s attention input: its Q or fused QKV projection."""
        spec = self.ckpt.spec
        suffix = (spec.fused_qkv or spec.projections["q"]).weight.removesuffix(".weight")
        return self.block(layer).get_submodule(suffix)

    def block(self, layer: int) -> nn.Module:
        """Layer `layer`'s attention block: the module the spec's layer prefix names (its tensors' owner)."""
        inner = self.ckpt.spec.layer_prefix.split("{layer}.")[1].rstrip(".")
        return self.model.get_submodule(self.names[self.layers[layer]] + "." + inner)

    def block_names(self, layer: int) -> dict[str, str]:
        """Checkpoint tensor name → parameter name inside layer `layer`'s attention block."""
        prefix = self.names[self.block(layer)] + "."
        return {source: name.removeprefix(prefix) for name, source in self.sources.items() if name.startswith(prefix)}

    def embed(self, batch: torch.Tensor, store: ActivationStore, chunk: int = CHUNK) -> tuple[torch.Tensor, list[tuple[tuple, dict[str, Any]]]]:
        """The hidden states entering the first layer [windows, T, hidden] and, per chunk of `chunk` windows,
        the other arguments the model passes its layers; only modules the embedding stage calls are loaded."""
        catcher, first = _Catcher(), self.layers[0]
        self.layers[0] = catcher
        loaded: list[nn.Module] = []
        hooks = [m.register_forward_pre_hook(self._loader(loaded)) for m in self._outside_layers()]
        hidden: torch.Tensor | None = None
        calls: list[tuple[tuple, dict[str, Any]]] = []
        try:
            for c, rows in enumerate(batch.split(chunk)):
                try:
                    self.model(input_ids=rows.to(self.device), use_cache=False)
                except _Stop:
                    pass
                (states, *args), kwargs = catcher.calls.pop()
                if hidden is None:
                    hidden = store.empty(len(batch), *states.shape[1:])
                hidden[c * chunk : c * chunk + len(rows)] = states
                calls.append((tuple(args), kwargs))
        finally:
            self.layers[0] = first
            for h in hooks:
                h.remove()
            for m in loaded:
                m.to("meta")
        assert hidden is not None  # batch holds at least one window (sample_windows cuts one or more)
        return hidden, calls

    def _outside_layers(self) -> Iterator[nn.Module]:
        inside = set(self.layers.modules())
        return (m for m in self.model.modules() if m not in inside and next(chain(m.parameters(False), m.buffers(False)), None) is not None)

    def _loader(self, loaded: list[nn.Module]) -> Callable:
        def load_once(module: nn.Module, args: Any) -> None:
            if module not in loaded:
                self.load(module, recurse=False)
                loaded.append(module)

        return load_once


def _moved(obj: Any, device: torch.device) -> Any:
    """Tensors inside nested tuples / lists / dicts, on `device`."""
    return tree_map_only(torch.Tensor, lambda t: t.to(device), obj)


@torch.no_grad()
def attention_inputs(ckpt: SourceCheckpoint, batch: torch.Tensor, device: torch.device, progress: bool = True) -> list[torch.Tensor]:
    """Per layer [tokens, hidden]: what the attention projections of the source read on `batch`
    ([windows, T] token ids), computed one layer at a time (see the module doc)."""
    return_freed_memory()
    store = ActivationStore(ram_limit())
    runner = LayerwiseModel(ckpt, device)
    hidden, calls = runner.embed(batch, store)
    calls = [_moved(call, device) for call in calls]
    inputs = []
    for i in tqdm(range(ckpt.layers), desc="calibrate", unit="layer", disable=not progress):
        inputs.append(store.empty(hidden.shape[0] * hidden.shape[1], hidden.shape[2]))
        runner.load(runner.layers[i])
        try:
            _run_layer(runner, i, hidden, calls, inputs[-1], last=i == ckpt.layers - 1)
        finally:
            runner.layers[i].to("meta")
    return inputs


def _run_layer(runner: LayerwiseModel, i: int, hidden: torch.Tensor, calls: list, inputs: torch.Tensor | None, last: bool, chunk: int = CHUNK) -> None:
    """Layer i (loaded) over every chunk of `chunk` windows (as embed cut them): its attention input into
    `inputs` (when given), its output over `hidden` (not for the `last`, which stops at its attention
    input, nor for a chunk a hook stopped)."""
    layer, rows = runner.layers[i], chunk * hidden.shape[1]
    offset = [0]

    handle = None
    if inputs is not None:

        def keep(module: nn.Module, args: tuple) -> None:
            x = args[0].reshape(-1, args[0].shape[-1])
            inputs[offset[0] : offset[0] + len(x)].copy_(x)
            if last:
                raise _Stop

        handle = runner.projection(i).register_forward_pre_hook(keep)
    try:
        for c, (args, kwargs) in enumerate(calls):
            offset[0] = c * rows
            part = hidden[c * chunk : (c + 1) * chunk]
            try:
                out = layer(part.to(runner.device), *args, **kwargs)
            except _Stop:
                continue
            part.copy_(out[0] if isinstance(out, tuple) else out)
    finally:
        if handle is not None:
            handle.remove()


@dataclass
class LayerRun:
    """One layer while it is loaded: what its attention block read and returned on every chunk of windows."""

    index: int
    inputs: torch.Tensor  # [tokens, hidden]: the attention input (what the Q or fused QKV projection reads)
    block: nn.Module  # the attention block, holding the checkpoint's weights
    names: dict[str, str]  # checkpoint tensor name → parameter name inside `block`
    calls: list[tuple[tuple, dict[str, Any]]]  # the block's arguments, per chunk
    outputs: list[torch.Tensor]  # the block's output per chunk [windows, T, hidden]: the original attention output


@torch.no_grad()
def layer_runs(
    ckpt: SourceCheckpoint, batch: torch.Tensor, device: torch.device, sequential: bool, progress: bool = True, chunk: int = CHUNK
) -> Iterator[LayerRun]:
    """Each layer in turn, loaded, run over `batch` ([windows, T] token ids) up to its attention block's output,
    `chunk` windows per call (the run's calls and outputs: the units the consumer may split).

    The consumer may change the block's weights while it holds the run. Teacher-forced (`sequential`
    False), every layer reads the source model's hidden states; `sequential`, the layer then runs again
    with the weights the consumer left in its block, so each layer reads the output of the layers as
    they were changed (GPTQ's order). Memory: one layer, plus its block's arguments and outputs.
    """
    return_freed_memory()
    store = ActivationStore(ram_limit())
    runner = LayerwiseModel(ckpt, device)
    hidden, calls = runner.embed(batch, store, chunk)
    calls = [_moved(call, device) for call in calls]
    for i in tqdm(range(ckpt.layers), desc="calibrate", unit="layer", disable=not progress):
        stop = sequential or i == ckpt.layers - 1  # the layer's output is not the next layer's input yet, or never
        inputs = torch.empty(hidden.shape[0] * hidden.shape[1], hidden.shape[2])  # one layer's: freed with the run
        layer, block = runner.layers[i], runner.block(i)
        calls_in: list[tuple[tuple, dict[str, Any]]] = []
        outputs: list[torch.Tensor] = []
        runner.load(layer)
        hooks = record_block(block, calls_in, outputs, stop)
        try:
            try:
                _run_layer(runner, i, hidden, calls, inputs, last=False, chunk=chunk)
            finally:
                for hook in hooks:
                    hook.remove()
            yield LayerRun(i, inputs, block, runner.block_names(i), calls_in, outputs)
            del calls_in, outputs, inputs  # the consumer's copies may go
            if sequential and i < ckpt.layers - 1:
                _run_layer(runner, i, hidden, calls, None, last=False, chunk=chunk)  # with the weights the consumer left in the block
        finally:
            layer.to("meta")


def record_block(block: nn.Module, calls: list, outputs: list, stop: bool) -> list:
    """Hooks keeping what `block` is called with (copies) and what it returns; with `stop`, the forward ends
    there. Their handles, to remove."""

    def keep_output(module: nn.Module, args: tuple, out: Any) -> None:
        outputs.append(out[0] if isinstance(out, tuple) else out)
        if stop:
            raise _Stop

    return [
        block.register_forward_pre_hook(lambda module, args, kwargs: calls.append(_copied((args, kwargs))), with_kwargs=True),
        block.register_forward_hook(keep_output),
    ]


def _copied(obj: Any) -> Any:
    """Tensors inside nested tuples / lists / dicts, copied: a block's input may be a view of the hidden
    states that the layer's output then overwrites (BERT, BLOOM's residual)."""
    return tree_map_only(torch.Tensor, torch.clone, obj)
