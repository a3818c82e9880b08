"""How many tokens to distill on: `--tokens 200000`, `200k`, `1.5M`, or `5%` of the teacher's pre-training tokens.

A percentage needs the teacher's pre-training token count, which headfold knows only for its
embedded model (headfold/data/default_model/training.json: steps × batch × sequence length); for
any other teacher `5%` is bad input, not a guess.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from headfold.ground.errors import BadOption
from headfold.ground.hashing import sha256_file
from headfold.ground.units import parse_count, parse_fraction

EXAMPLES = "e.g. 200000, 200k, 1.5M, or 5% (of the pre-training tokens, embedded model only)"


def embedded_model() -> Path:
    return Path(str(resources.files("headfold") / "data" / "default_model"))


def is_embedded(teacher: Path) -> bool:
    embedded = embedded_model()
    weights = teacher / "model.safetensors"
    return teacher.resolve() == embedded.resolve() or (weights.is_file() and sha256_file(weights) == sha256_file(embedded / "model.safetensors"))


def pretraining_tokens(teacher: Path) -> int | None:
    """The teacher's pre-training tokens where headfold knows them (the embedded model: 3 276 800), else None."""
    if not is_embedded(teacher):
        return None
    recipe = json.loads((embedded_model() / "training.json").read_text())["recipe"]
    return recipe["steps"] * recipe["batch_size"] * recipe["seq_len"]


def parse_tokens(value: str | int, pretraining: int | None) -> int:
    """A --tokens value as a token count; BadInput for anything else (zero, negative, unknown suffix,
    a percentage without a known pre-training count)."""
    text = str(value).strip()
    if not text.endswith("%"):
        return parse_count(value, "--tokens", "token", EXAMPLES)
    if pretraining is None:
        raise BadOption(
            "--tokens", f"{value}: a percentage needs the teacher's pre-training token count, known only for the embedded model; give a count, {EXAMPLES}"
        )
    return parse_count(parse_fraction(text, "--tokens") * pretraining, "--tokens", "token", EXAMPLES)
