"""What TensorRT can do here: installed or not, GPU or not, and the features a build depends on.

Features are detected on the installed module (`hasattr` on its flag enums), never inferred from
the version string alone; a dry run for a TensorRT that is not installed assumes the documented
behaviour of that release (TensorRT 11 removed BuilderFlag.FP16/BF16).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from headfold.graphs.trt_lint import RULE_SETS, rule_set
from headfold.ground.errors import BadInput
from headfold.ground.lazy import lazy_import

trt = lazy_import("tensorrt")
torch = lazy_import("torch")  # only where TensorRT is installed: a dry run plans without it

ASSUMED = "dry run: features assumed for this release"


@dataclass(frozen=True)
class Target:
    """The TensorRT an engine is planned for."""

    version: str  # e.g. "10.15.1"
    strongly_typed: bool  # NetworkDefinitionCreationFlag.STRONGLY_TYPED exists
    precision_flags: bool  # BuilderFlag.FP16/BF16 exist (TensorRT < 11)
    detected: bool  # True: features read from the installed module; False: assumed for a dry run
    how: str = "features detected on the installed module"  # for the plan's first line

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @classmethod
    def assumed(cls, version: str, how: str = ASSUMED) -> Target:
        """A dry run for `version`: every release headfold lints (10.13+) has STRONGLY_TYPED."""
        rule_set(version)  # BadInput for versions headfold has no parser data for
        precision_flags = int(str(version).split(".")[0]) < 11
        return cls(str(version), strongly_typed=True, precision_flags=precision_flags, detected=False, how=how)

    @classmethod
    def installed(cls) -> Target:
        """The installed TensorRT's features (imports tensorrt; needs no GPU)."""
        return cls(
            trt.__version__,
            strongly_typed=hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"),
            precision_flags=hasattr(trt.BuilderFlag, "FP16"),
            detected=True,
        )


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # a broken namespace package
        return True


def engine_support() -> str | None:
    """None when engines can be built and run here, else why not (one phrase)."""
    if _missing("tensorrt"):
        return "TensorRT is not installed"
    if _missing("polygraphy"):
        return "Polygraphy is not installed (a headfold dependency: pip install polygraphy)"
    if not torch.cuda.is_available():
        return "no NVIDIA GPU is visible (torch.cuda.is_available() is False)"
    return None


def target_for(trt_version: str | None, *, dry_run: bool) -> Target:
    """The TensorRT to plan for: the installed one, or for a dry run the release `trt_version` names.

    BadInput (one line) when a real build is impossible here or `trt_version` contradicts the
    installed TensorRT.
    """
    if not dry_run:
        why_not = engine_support()
        if why_not:
            raise BadInput(f"{why_not}: cannot build an engine here; use --dry-run [--trt-version X.Y] to see the plan")
    if _missing("tensorrt"):
        if trt_version is None:
            newest = RULE_SETS[-1].name
            return Target.assumed(
                newest, f"TensorRT is not installed: dry run for the newest release headfold knows, {newest}; --trt-version X.Y plans for another"
            )
        return Target.assumed(trt_version)
    target = Target.installed()
    if trt_version is None or rule_set(trt_version).version == rule_set(target.version).version:
        return target
    if not dry_run:
        raise BadInput(f"--trt-version {trt_version} differs from the installed TensorRT {target.version}; it is for --dry-run only")
    return Target.assumed(trt_version)
