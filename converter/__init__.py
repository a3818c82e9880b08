"""Checkpoint conversion: MHA → GQA/MQA by pooling K/V heads, streamed and atomic.

`convert` and `supported_model_types` load on first use, so `headfold.converter.recipes` (method
names and the default) is importable without numpy or safetensors, and `import headfold` stays cheap.
"""

from __future__ import annotations

from typing import Any

from headfold.converter.recipes import METHODS

__all__ = ["convert", "METHODS", "supported_model_types"]


def __getattr__(name: str) -> Any:
    if name == "convert":
        from headfold.converter.conversion import convert

        return convert
    if name == "supported_model_types":
        from headfold.converter.spec import supported_model_types

        return supported_model_types
    raise AttributeError(f"module 'headfold.converter' has no attribute {name!r}")
