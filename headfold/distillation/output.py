"""The distilled checkpoint: the student's files with its trained tensors replaced, and a chained manifest.

Tensors keep the student's names, order, dtypes and shards (written by the converter's streaming
writer); tensors that did not train are copied byte for byte. config.json (per-layer kv heads and
all) and every other file are the student's. headfold.json is the student's manifest — same
`source` and `conversion`, so `verify` still measures against the teacher — with a `distillation`
entry that holds the student's own manifest, data hashes, options and the final held-out scores.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.conversion import copy_other_files, default_shard_bytes
from headfold.converter.writer import PlannedTensor, ShardedWriter
from headfold.ground.hashing import sha256_file, versions
from headfold.ground.lazy import lazy_import
from headfold.ground.manifest import Manifest

figure = lazy_import("matplotlib.figure")  # no pyplot: no global state, Agg canvas, safe in worker processes
ticker = lazy_import("matplotlib.ticker")

LOG_FILE, PLOT_FILE = "distill-log.json", "distill-curve.png"
PACKAGES = ("headfold", "torch", "transformers", "safetensors", "accelerate", "datasets", "peft")


def write_checkpoint(student: SourceCheckpoint, state: dict[str, torch.Tensor], folder: Path) -> dict[str, str]:
    """Weights (trained tensors from `state`, by checkpoint name; the rest copied), config and other files."""
    plan = [PlannedTensor(t.name, t.dtype, t.shape) for t in student.tensors.values()]
    with ShardedWriter(folder, plan, default_shard_bytes(student), metadata={"format": "pt"}) as writer:
        for t in plan:
            if t.name in state:
                writer.write(t.name, state[t.name].to(t.dtype).reshape(t.shape))
            elif source := student.byte_range(t.name):
                writer.copy(t.name, t.dtype, t.shape, source)
            else:
                writer.write(t.name, student.get(t.name))
        files = writer.finish()
    shutil.copyfile(student.folder / "config.json", folder / "config.json")
    files["config.json"] = sha256_file(folder / "config.json")
    copied, _ = copy_other_files(student, folder)
    return files | {k: v for k, v in copied.items() if k not in (LOG_FILE, PLOT_FILE)}


def write_manifest(folder: Path, student_manifest: dict[str, Any], distillation: dict[str, Any], files: dict[str, str]) -> None:
    for name in (LOG_FILE, PLOT_FILE):
        if (folder / name).is_file():
            files[name] = sha256_file(folder / name)
    student = Manifest.from_dict(student_manifest)
    replace(student, distillation=distillation, versions=versions(PACKAGES), files=dict(sorted(files.items()))).save_in(folder)


def write_log(folder: Path, log: dict[str, list], metric: str) -> None:
    """distill-log.json (every training step and evaluation) and distill-curve.png against tokens."""
    (folder / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n")
    curve_figure(log, metric).savefig(folder / PLOT_FILE, dpi=110)


def curve_figure(log: dict[str, list], metric: str):
    """Training loss and the held-out metric against training tokens."""
    fig = figure.Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    losses = [r["loss"] for r in log["train"]]
    left.plot([r["tokens"] for r in log["train"]], losses, lw=1)
    left.set(xlabel="training tokens", ylabel="training loss", yscale="log" if losses and min(losses) > 0 else "linear", title="distillation loss")
    right.plot([r["tokens"] for r in log["eval"]], [r[metric] for r in log["eval"]], marker="o")
    right.set(xlabel="training tokens", ylabel=f"held-out {metric}", title=f"held-out {metric}")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(ticker.MaxNLocator(nbins=6, integer=True))  # token counts run to millions:
        ax.xaxis.set_major_formatter(ticker.EngFormatter(sep=""))  # 200k, 1.5M, not 200000 running into its neighbour
    return fig
