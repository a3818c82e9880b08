"""Which of the student's parameters train: `kv`, `attention`, `all`, or PEFT `lora` adapters.

The attention tensors come from the architecture spec (the same data `convert` pools), mapped to
the loaded model's parameter names. Everything else is frozen, so the optimizer keeps state only
for what trains. LoRA adapters sit on every attention projection and are merged into the weights
before the checkpoint is written, so the output is a plain checkpoint again.
"""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.spec import Role
from headfold.ground.errors import BadInput
from headfold.ground.lazy import lazy_import
from headfold.ground.settings import TRAIN_MODES

peft = lazy_import("peft")  # --train lora only

LORA_RANK = 16


def attention_parameters(ckpt: SourceCheckpoint, names: dict[str, str], roles: tuple[Role, ...] | None) -> set[str]:
    """Model parameter names of the attention tensors of `roles` (None: all of Q/K/V/O and fused QKV)."""
    spec = ckpt.spec
    if roles is None:
        suffixes = {s for layer in ckpt.attention.layers for s in layer}
    else:
        if spec.fused_qkv is not None:
            raise BadInput(f"{spec.family} keeps Q, K and V in one tensor, so K/V cannot train alone; use --train attention, all or lora")
        suffixes = {p for r in roles for p in (spec.projections[r].weight, spec.projections[r].bias) if p}
    return {names[t] for layer in ckpt.attention.layers for s, t in layer.items() if s in suffixes and t in names}


def attention_blocks(model: nn.Module, ckpt: SourceCheckpoint, names: dict[str, str]) -> list[nn.Module]:
    """The model's attention blocks in the checkpoint's layer order: the module each layer's spec prefix
    names (the owner of its attention tensors), found through one of its tensors' parameter name."""
    blocks = []
    for layer in ckpt.attention.layers:
        suffix, tensor = next((s, t) for s, t in layer.items() if t in names)
        blocks.append(model.get_submodule(names[tensor].removesuffix(suffix).rstrip(".")))
    return blocks


def select(model: nn.Module, ckpt: SourceCheckpoint, names: dict[str, str], mode: str) -> tuple[nn.Module, set[str]]:
    """Freeze all but `mode`'s parameters (wrapping in LoRA for `lora`); (model, checkpoint-visible names that change)."""
    if mode not in TRAIN_MODES:
        raise BadInput(f"--train {mode!r} is not one of {', '.join(TRAIN_MODES)}")
    if mode == "all":
        changed = set(names.values())
        return model, changed
    if mode == "lora":
        return _lora(model, attention_parameters(ckpt, names, None))
    changed = attention_parameters(ckpt, names, ("k", "v") if mode == "kv" else None)
    for name, param in model.named_parameters():
        param.requires_grad_(name in changed)
    return model, changed


def _lora(model: nn.Module, attention: set[str]) -> tuple[nn.Module, set[str]]:
    projections = (nn.Linear, Conv1D)  # what LoRA adapts: not the per-head norms (StableLM) among attention tensors
    weights = sorted(n for n in attention if n.endswith(".weight") and isinstance(model.get_submodule(n.removesuffix(".weight")), projections))
    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0, target_modules=[w.removesuffix(".weight") for w in weights])
    return peft.get_peft_model(model, config), set(weights)


def merged(model: nn.Module) -> nn.Module:
    """The plain model: LoRA adapters folded into their weights (a no-op for the other modes)."""
    merge = getattr(model, "merge_and_unload", None)  # a PEFT model's
    return merge() if merge is not None else model


def trainable_state(model: nn.Module) -> dict:
    """What a resumable checkpoint must keep of the model: the trainable tensors, by name."""
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
