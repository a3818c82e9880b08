"""Method names and what each one needs, without the maths: torch-free, so a mean or first
conversion (which never calls the torch maths) starts without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headfold.ground.errors import BadInput

POOLS = ("mean", "first")
MODIFIERS = ("aligned", "grouped", "scored", "refit", "local")  # a method's name lists them in this order
METHODS = (
    "mean", "first", "aligned", "grouped", "scored", "refit", "local", "aligned+grouped", "aligned+grouped+refit", "aligned+scored+refit",
    "aligned+grouped+refit+local", "aligned+scored+refit+local",
)  # fmt: skip
# The one default of every command and of the Python API: the lowest mean rank of KL at h/4 over the
# quality zoo (benchmarks/results/zoo_quality.json; docs/methods.md has the rule and the ranks). It
# calibrates on the built-in text; a checkpoint without tokenizer files (or --calibration weights) gets
# it without local, which fits on text (conversion.without_local).
DEFAULT_METHOD = "aligned+scored+refit+local"
DEFAULT_LOCAL_STEPS = 100  # Adam steps per layer of `local` (--local-steps; converter/local.py, docs/methods.md)


@dataclass(frozen=True)
class LayerContext:
    inputs: Any = None  # torch.Tensor [tokens, hidden]: this layer's attention input on calibration text
    rotary: int = 0  # leading head dims that RoPE rotates in (i, i + rotary/2) pairs; 0 = no RoPE
    rotate_keys: bool = True  # False when a per-dimension norm follows W_Q / W_K
    interleaved: bool = False  # RoPE pairs dims (2i, 2i + 1) (GPT-J) instead of (i, i + rotary/2)


@dataclass(frozen=True)
class Recipe:
    pool: str = "mean"
    grouped: bool = False
    scored: bool = False  # groups by the loss they predict (converter/scoring.py) instead of by similarity
    aligned: bool = False
    refit: bool = False
    local: bool = False  # fit each layer's attention output after pooling (converter/local.py)

    @property
    def name(self) -> str:
        parts = [m for m in MODIFIERS if getattr(self, m)]
        return "+".join(parts + ([self.pool] if self.pool != "mean" or not parts else []))

    @property
    def data_aware(self) -> bool:
        """Whether the method calibrates: every modifier reads activations (MODIFIERS), mean and first do not."""
        return any(getattr(self, m) for m in MODIFIERS)


def contiguous_groups(kv_heads: int, target: int) -> list[list[int]]:
    """Source kv heads j pooled into new head j // (kv_heads // target): the default grouping."""
    return [list(range(g * kv_heads // target, (g + 1) * kv_heads // target)) for g in range(target)]


def get_method(name: str) -> Recipe:
    """'mean', 'first', or modifiers joined by '+', e.g. 'aligned+grouped+refit'."""
    parts = name.split("+")
    unknown = [p for p in parts if p not in POOLS + MODIFIERS]
    pools = [p for p in parts if p in POOLS]
    if unknown or len(pools) > 1 or len(set(parts)) != len(parts):
        raise BadInput(f"unknown method {name!r}; use mean or first, or combine {', '.join(MODIFIERS)} with '+' (e.g. aligned+grouped)")
    if {"grouped", "scored"} <= set(parts):
        raise BadInput(f"method {name!r} names grouped and scored, which both choose the groups; keep one")
    return Recipe(pool=pools[0] if pools else "mean", **{m: m in parts for m in MODIFIERS})
