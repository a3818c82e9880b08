"""Running headfold's commands from tests: in this process, or in a subprocess as one or two processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import pytest

from headfold.cli import main

# What `accelerate config` writes for FSDP2 on 2 CPU processes (the student sharded layer by layer).
FSDP2_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: 'no'
dynamo_backend: 'NO'
main_process_port: 29533
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
"""


def distill_command(*args: str) -> list[str]:
    """`headfold distill ARGS --quiet` as a subprocess's argv (a launcher takes it without its first item)."""
    return [sys.executable, "-m", "headfold.cli", "distill", *args, "--quiet"]


def subprocess_env() -> dict[str, str]:
    """One intra-op thread, no hub, transformers quiet."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


def run_distill(*args: str, launcher: Sequence[str] = ()) -> None:
    """`headfold distill ARGS --quiet` in a subprocess, under `launcher` (torchrun, accelerate launch) where one is given."""
    command = distill_command(*args)
    subprocess.run([*launcher, *command[1:]] if launcher else command, check=True, env=subprocess_env())


def refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """headfold ARGS in this process exits 2 with one error line: that line."""
    capsys.readouterr()  # what building the fixtures printed
    assert main([*args, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("headfold: error: ")
    return err
