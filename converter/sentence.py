"""A converted sentence-transformers checkpoint (BERT family) as a `SentenceTransformer`.

Conversion copies modules.json and the module folders (pooling, normalize, dense …) as they are;
only the transformer's K/V projections change, which plain transformers cannot load (it has no GQA
for BERT). `sentence_transformer` lets sentence-transformers build every module from the folder as
usual and hands its transformer module the model `headfold.load_model` builds. Module classes
outside sentence_transformers stay behind sentence-transformers' own `trust_remote_code` gate.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

from headfold.converter.modeling import load_model
from headfold.ground.errors import BadInput
from headfold.ground.lazy import lazy_import

# an optional library (the range pyproject pins; its Transformer module is where 6.2 put it)
sentence_transformers = lazy_import("sentence_transformers")
transformer = lazy_import("sentence_transformers.base.modules.transformer")

__all__ = ["sentence_transformer"]

MODULES = "modules.json"


def _headfold_transformer(base: type) -> type:
    """`base` (a sentence-transformers Transformer module) whose torch model comes from headfold.load_model."""

    class HeadfoldTransformer(base):
        def _load_model(self, model_name_or_path: str, transformer_task: str, config: Any, backend: str, is_peft_model: bool, **model_kwargs: Any):
            if backend != "torch" or is_peft_model or transformer_task != "feature-extraction":
                return super()._load_model(model_name_or_path, transformer_task, config, backend, is_peft_model, **model_kwargs)
            return load_model(model_name_or_path, dtype=model_kwargs.get("dtype"))

    HeadfoldTransformer.__qualname__ = HeadfoldTransformer.__name__ = f"Headfold{base.__name__}"
    return HeadfoldTransformer


def _module_types(folder: Path) -> list[str]:
    try:
        entries = json.loads((folder / MODULES).read_text())
        return [entry["type"] for entry in entries]
    except FileNotFoundError:
        raise BadInput(f"{folder} has no {MODULES}, so it is no sentence-transformers model; load it with headfold.load_model") from None
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError) as err:
        raise BadInput(f"{folder / MODULES} is corrupt ({type(err).__name__}); restore it from the original model") from None


def _sentence_transformers_class(ref: str) -> type | None:
    """The class a modules.json type names, when it is sentence-transformers' own (never a checkpoint's code)."""
    module, _, name = ref.rpartition(".")
    if not module.startswith("sentence_transformers"):
        return None
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def sentence_transformer(path: str | os.PathLike, **options: Any):
    """`SentenceTransformer` for the checkpoint folder at `path` (converted or not): its modules as saved,
    the transformer's weights loaded by `headfold.load_model`. `options` go to SentenceTransformer
    (device, model_kwargs={"dtype": ...}, ...); loading stays local and runs no checkpoint code."""
    base = transformer.Transformer

    folder = Path(path)
    if not folder.is_dir():
        raise BadInput(f"{folder} is not a folder; pass a sentence-transformers checkpoint folder")
    known = {ref: _sentence_transformers_class(ref) for ref in _module_types(folder)}
    classes = {ref: _headfold_transformer(cls) for ref, cls in known.items() if isinstance(cls, type) and issubclass(cls, base)}
    if not classes:
        raise BadInput(f"{folder / MODULES} lists no sentence-transformers Transformer module; load the model with headfold.load_model")
    options = {"local_files_only": True, "trust_remote_code": False, **options}
    return sentence_transformers.SentenceTransformer._load_with_module_classes(str(folder), classes, **options)
