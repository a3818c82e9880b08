"""TensorRT engines: a pure build plan (CPU), the build through Polygraphy's loaders, the sidecar.

Only `plan` is imported eagerly; `build` loads TensorRT on first use (ground/lazy.py), so
everything here imports on machines without TensorRT or a GPU.
"""

from __future__ import annotations

from headfold.engines.env import Target, engine_support
from headfold.engines.plan import BuildPlan, make_plan

__all__ = ["BuildPlan", "Target", "engine_support", "make_plan"]
