"""Budgets: the thresholds each check is gated on, from defaults, a TOML/YAML file and options.

Precedence, lowest first: built-in defaults for the precision → the file's `[fidelity]` /
`[loss]` tables → their per-precision sub-tables (`[fidelity.fp16]`) → command-line options.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from headfold.ground.errors import BadInput
from headfold.ground.inputs import read_config_file, shown
from headfold.ground.precision import Precision
from headfold.ground.settings import as_paths
from headfold.ground.units import parse_fraction

# atol/rtol follow Polygraphy: an element fails only when it exceeds both. The fp32 numbers
# leave about two orders of magnitude over what ONNX Runtime and torch differ by on CPU (the export
# tests' bounds); the half-precision ones follow NVIDIA's fp16 transformer recipe, bf16 has 3 fewer bits.
_FIDELITY_DEFAULTS: dict[Precision, dict[str, float]] = {
    Precision.FP32: {"atol": 1e-4, "rtol": 1e-3, "min_top1": 0.999, "min_cosine": 0.99999},
    Precision.FP16: {"atol": 1e-2, "rtol": 1e-2, "min_top1": 0.99, "min_cosine": 0.999},
    Precision.BF16: {"atol": 5e-2, "rtol": 5e-2, "min_top1": 0.98, "min_cosine": 0.995},
}
# A deployment gate, not a description of what pooling without uptraining achieves: GQA/MQA
# of a small model usually fails it; relax it per model in a budget file.
_LOSS_DEFAULTS: dict[str, float] = {"max_ppl_increase": 0.05, "max_kl": 0.05, "min_top1": 0.90, "min_cosine": 0.99}


@dataclass(frozen=True)
class FidelityBudget:
    """Same model, two backends: per-element atol/rtol, and top-1 / cosine floors."""

    atol: float
    rtol: float
    min_top1: float
    min_cosine: float


@dataclass(frozen=True)
class LossBudget:
    """Original vs converted: perplexity increase (fraction), KL in nats, top-1 / cosine floors."""

    max_ppl_increase: float
    max_kl: float
    min_top1: float
    min_cosine: float


def _apply(budget, table: dict[str, Any], where: str):
    """Override `budget`'s fields from `table` (unknown keys are an error, sub-tables skipped)."""
    names = {f.name for f in fields(budget)}
    values = {}
    for key, value in table.items():
        if isinstance(value, dict) and key in tuple(Precision):  # a per-precision sub-table ([loss.int4]: int4 exports are gated by their loss)
            continue
        if key not in names:
            raise BadInput(f"unknown budget key {shown(key)} in {where}; known keys: {', '.join(sorted(names))}")
        if value is not None:
            values[key] = parse_fraction(value, f"{where}.{key}")
    return replace(budget, **values)


def load_budget_file(path: Path) -> dict[str, Any]:
    """Read a .toml, .yaml/.yml or .json budget file into {"fidelity": {...}, "loss": {...}}."""
    if not path.exists():
        raise BadInput(f"budget file {path} does not exist")
    data = read_config_file(path, "budget file")
    if not isinstance(data, dict) or set(data) - {"fidelity", "loss"}:
        raise BadInput(f"budget file {path} must hold only [fidelity] and [loss] tables")
    if not all(isinstance(t, dict) for t in data.values()):
        raise BadInput(f"budget file {path}: [fidelity] and [loss] must be tables")
    return data


def fidelity_budget(precision: Precision | str, file: dict[str, Any] | None = None, **options: float | None) -> FidelityBudget:
    precision = Precision.parse(precision, "precision", Precision.floats())  # int4 has no element-wise budget: it is gated by its loss
    return _resolve(FidelityBudget(**_FIDELITY_DEFAULTS[precision]), "fidelity", precision, file, options)


def loss_budget(precision: Precision | str = Precision.FP32, file: dict[str, Any] | None = None, **options: float | None) -> LossBudget:
    return _resolve(LossBudget(**_LOSS_DEFAULTS), "loss", precision, file, options)


def _resolve(budget, kind: str, precision: Precision | str, file: dict[str, Any] | None, options: dict[str, float | None]):
    table = (file or {}).get(kind, {})
    budget = _apply(budget, table, kind)
    budget = _apply(budget, table.get(precision, {}), f"{kind}.{precision}")
    return _apply(budget, options, "options")


@dataclass(frozen=True)
class Thresholds:
    """What the user asked for: a budget file and option overrides (None = file or default).

    min_top1 / min_cosine gate the loss check, and a fidelity check only with `floors=True`
    (headfold verify, where one check runs; headfold run applies them to the loss check).
    """

    file: Path | None = None
    atol: float | None = None
    rtol: float | None = None
    max_ppl_increase: float | None = None
    max_kl: float | None = None
    min_top1: float | None = None
    min_cosine: float | None = None

    def __post_init__(self) -> None:
        as_paths(self, "file")

    def _file(self) -> dict[str, Any] | None:
        return load_budget_file(self.file) if self.file else None

    def fidelity(self, precision: Precision | str, floors: bool = False) -> FidelityBudget:
        extra = {"min_top1": self.min_top1, "min_cosine": self.min_cosine} if floors else {}
        return fidelity_budget(precision, self._file(), atol=self.atol, rtol=self.rtol, **extra)

    def loss(self, precision: Precision | str = Precision.FP32) -> LossBudget:
        return loss_budget(
            precision, self._file(), max_ppl_increase=self.max_ppl_increase, max_kl=self.max_kl,
            min_top1=self.min_top1, min_cosine=self.min_cosine,
        )  # fmt: skip
