"""Reading what a command wrote: tensors, a model's outputs, the manifest's distillation record."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from headfold.converter.modeling import load_model
from support.tiny_models import sample_batch


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's safetensors files."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def outputs(folder: Path, model: torch.nn.Module | None = None) -> torch.Tensor:
    """Logits (decoders) or last hidden state (encoders) on a padded batch."""
    model = model or load_model(folder)
    batch = sample_batch(model.config, batch=3, seq=9)
    with torch.no_grad():
        out = model(**batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def distilled(out: Path) -> dict:
    """The distillation record of headfold.json."""
    return json.loads((out / "headfold.json").read_text())["distillation"]


def relative_difference(one: dict[str, torch.Tensor], two: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """‖one − two‖ / ‖one − start‖ over all weights: how far two runs from `start` part, as a share of how far one moved.

    Two processes with half the batch each sum their gradients in another order than one process's mean: float
    rounding, which Adam's normalised steps amplify on the odd weight whose gradient is near zero (one such weight
    moved 4.9e-4 on another CPU while the rest agreed to 1e-6). A norm over all weights keeps that apart from a wrong
    split of the batch: the tiny Llama's runs parted by 6.5e-7, one process on half the batch by 0.94.
    """
    difference = sum(float((one[k] - two[k]).double().square().sum()) for k in one)
    moved = sum(float((one[k] - start[k]).double().square().sum()) for k in one)
    return (difference / moved) ** 0.5
