"""Resumable distillation state, beside the output: `.OUT.distill-state/`.

    run.json                 what the run is (inputs' hashes and options); --resume refuses another
    step-000040/             the latest checkpoint, written atomically (older ones are removed)
        trainable.safetensors   the trainable tensors (fp32)
        optimizer.pt            optimizer and LR-schedule state, torch RNG state (read weights_only)
        progress.json           step, tokens, windows consumed, the log so far

The folder exists only with --save-every (or --resume): a run without them leaves nothing when it
stops, fails or is killed. A run killed at any moment leaves either the previous or the new
checkpoint whole. The main process holds the folder's lock for the whole run, so a folder found
under the lock was left by a writer that is gone: a fresh run (no --resume) removes it and says so.
The folder is removed once OUT is written.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from headfold.ground.artifacts import hidden_sibling
from headfold.ground.atomic import atomic_output, output_lock, refuse_link
from headfold.ground.errors import BadInput, first_line
from headfold.ground.inputs import read_json_object

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
CHECKPOINT = re.compile(r"step-(\d+)")


def state_folder(out: Path) -> Path:
    return hidden_sibling(out, "distill-state")


@dataclass
class Progress:
    step: int = 0
    tokens: int = 0
    windows: int = 0  # global training windows consumed: where the data stream resumes
    log: dict[str, list] = field(default_factory=lambda: {"train": [], "eval": []})


def latest(folder: Path) -> Path | None:
    found = [(int(m.group(1)), p) for p in folder.glob("step-*") if (m := CHECKPOINT.fullmatch(p.name)) and p.is_dir()]
    return max(found)[1] if found else None


class Diverged(BadInput):
    """Training produced a non-finite loss or weight: nothing is written, the state is dropped."""


@contextmanager
def claimed(folder: Path, *, resume: bool, keep: bool) -> Iterator[None]:
    """The main process's hold on the state folder for the whole run. Without `resume`, a folder found
    under the lock is a stopped run's leftover: removed, and said. On failure or a signal the folder
    is removed unless `keep` (--save-every / --resume) and it holds a checkpoint a resume can use
    (never after Diverged)."""
    refuse_link(folder)  # a link planted at the state's name would have run.json written through it
    with output_lock(folder):
        if folder.exists() and not resume:
            step = latest(folder)
            shutil.rmtree(folder, ignore_errors=True)
            log.warning(
                f"headfold: removed {folder}, the state of an earlier run that stopped"
                + (f" at {step.name}" if step else "")
                + "; pass --resume to continue such a run instead"
            )
        try:
            yield
        except BaseException as err:
            if not keep or isinstance(err, Diverged) or latest(folder) is None:  # nothing a resume could use
                finish(folder)
            raise


def open_run(folder: Path, identity: dict[str, Any], resume: bool) -> Path | None:
    """The checkpoint to resume from (None: start fresh); BadInput for the state of another run."""
    previous = folder / RUN_FILE
    if not resume or not previous.is_file():
        return None
    fix = "delete the folder to start over"
    recorded = read_json_object(previous, fix)
    if differs := sorted(k for k in identity.keys() | recorded.keys() if identity.get(k) != recorded.get(k)):
        raise BadInput(f"{folder} is the state of a run with other {', '.join(differs)}; repeat that run's options, or {fix}")
    return latest(folder)


def begin(folder: Path, identity: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(identity, indent=2, default=str) + "\n")
    tmp.replace(folder / RUN_FILE)


def save(folder: Path, progress: Progress, tensors: dict[str, torch.Tensor], optimizer: dict, schedule: dict) -> Path:
    """Write checkpoint `step-N` whole (or not at all), then drop the older ones."""
    target = folder / f"step-{progress.step:06d}"
    with atomic_output(target, overwrite=True, ours=True) as tmp:  # a resumed run may pass the same step again
        save_file(tensors, str(tmp / "trainable.safetensors"))
        torch.save({"optimizer": optimizer, "schedule": schedule, "rng": torch.get_rng_state()}, tmp / "optimizer.pt")
        (tmp / "progress.json").write_text(json.dumps(progress.__dict__) + "\n")
    for old in folder.glob("step-*"):
        if old != target and CHECKPOINT.fullmatch(old.name):
            shutil.rmtree(old, ignore_errors=True)
    return target


def load(checkpoint: Path) -> tuple[Progress, dict[str, torch.Tensor], dict[str, Any]]:
    """(progress, trainable tensors, optimizer/schedule/rng states) of a checkpoint `save` wrote;
    BadInput when any of its files is damaged."""
    fix = f"delete {checkpoint.parent} to start over (or restore it)"
    try:
        states = torch.load(checkpoint / "optimizer.pt", weights_only=True)  # our own file, still no code in it
        progress = Progress(**read_json_object(checkpoint / "progress.json", fix))
        tensors = load_file(str(checkpoint / "trainable.safetensors"))
    except BadInput:
        raise
    except Exception as err:  # torch.load, safetensors and a wrong progress.json each raise their own
        raise BadInput(f"the resumable state {checkpoint} is corrupt ({type(err).__name__}: {first_line(err)}); {fix}") from None
    if not isinstance(states, dict) or not {"optimizer", "schedule", "rng"} <= states.keys():
        raise BadInput(f"the resumable state {checkpoint} is corrupt (optimizer.pt lacks its states); {fix}")
    return progress, tensors, states


def finish(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
