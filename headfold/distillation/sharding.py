"""FSDP for `headfold distill`, turned on the way Accelerate turns it on, on GPUs and on CPU processes.

`accelerate launch --use_fsdp --fsdp_version 2 …`, or a config file with `distributed_type: FSDP`
and `fsdp_version: 2`, sets ACCELERATE_USE_FSDP and FSDP_*. Accelerate 1.15 honours them only on
accelerator devices: the switch to DistributedType.FSDP sits in AcceleratorState.__init__'s branch
for MULTI_GPU/NPU/XPU/… (accelerate/state.py:1010), so CPU processes (MULTI_CPU, gloo) silently run
DDP instead. `shard_cpu_processes` makes that same switch for them, with the plugin Accelerate
itself builds from FSDP_*, so Accelerate's own FSDP2 preparation (torch `fully_shard`) runs there too.

FSDP1 (Accelerate's default) is refused: on CPU Accelerate itself fails building its plugin
(utils/dataclasses.py:2014, "There are currently no available devices found, must be one of 'XPU',
'CUDA', …"), and forced past that, torch does (fsdp/_init_utils.py:1102, "Inconsistent compute device
and `device_id` on rank 0: cpu vs cpu:0"), so it cannot be tested here. `--save-every` and
`--resume` are refused under FSDP: a checkpoint holds whole tensors and optimizer state, which FSDP
keeps sharded.
"""

from __future__ import annotations

import os

from headfold.ground.errors import BadInput
from headfold.ground.lazy import lazy_import

accelerate = lazy_import("accelerate")


def main_process() -> bool:
    """Whether this process wrote the output and reports it, as Accelerate decided (the launcher's
    process group): a stray RANK=1 in a single process is still the main one."""
    return accelerate.PartialState().is_main_process


def check_request(save_every: int | None, resume: bool) -> None:
    """Before Accelerator() reads it: BadInput for an FSDP request headfold does not run (FSDP1, checkpoints)."""
    if not accelerate.utils.parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return
    if os.environ.get("FSDP_VERSION", "1") != "2":  # Accelerate's own default is 1
        raise BadInput(
            "headfold distill shards with FSDP2 only (FSDP1 cannot run on CPU, so it is untested); pass --fsdp_version 2 to accelerate launch "
            "(or fsdp_version: 2 in its config)"
        )
    if save_every or resume:
        raise BadInput(
            "--save-every and --resume are not supported under FSDP (its tensors and optimizer state are sharded); drop them, or run "
            "data-parallel without --use_fsdp"
        )


def shard_cpu_processes(accelerator) -> None:
    """Give CPU processes the FSDP their launcher asked for (Accelerate does so only on GPUs and the like)."""
    utils = accelerate.utils
    if accelerator.distributed_type == utils.DistributedType.MULTI_CPU and utils.parse_flag_from_env("ACCELERATE_USE_FSDP"):
        accelerator.state.fsdp_plugin = utils.FullyShardedDataParallelPlugin()  # from FSDP_*, as Accelerator() builds it
        # both states, as AcceleratorState.__init__ ends on GPUs (every later AcceleratorState() copies PartialState's)
        accelerator.state.distributed_type = accelerate.PartialState().distributed_type = utils.DistributedType.FSDP


def one_module_per_tied_embedding(model) -> None:
    """Make every embedding module that holds the input embedding's own weight (T5's encoder and decoder
    embed_tokens, tied to `shared`) that very module, where it is of the same class and settings.

    Accelerate's FSDP2 preparation puts the input embedding (with the output one it is tied to) into an
    FSDP group of its own; a second module holding the same weight stays in the root group, and torch
    refuses a parameter two groups manage ("Parameter 'shared.weight' is shared with a parameter already
    managed by another FSDP group"). One module object is one group, and it computes the same.
    """
    embedding = model.get_input_embeddings()

    def settings(module) -> dict:
        return {k: v for k, v in vars(module).items() if not k.startswith("_")}

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            same = child is not embedding and type(child) is type(embedding) and getattr(child, "weight", None) is embedding.weight
            if same and settings(child) == settings(embedding):
                setattr(parent, name, embedding)
