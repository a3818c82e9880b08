"""A checkpoint's config.json as the stages after conversion read it (verify's inputs, build's
profiles): plainly, without the validation `checkpoint.read_config` applies before converting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from headfold.ground.errors import BadInput

# Leave room for position offsets such as RoBERTa's padding_idx + 1.
SPARE_POSITIONS = 2


def read_config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadInput(f"cannot read {folder / 'config.json'}: {str(err).splitlines()[0]}") from None


def position_limit(config: dict[str, Any]) -> int | None:
    """The longest sequence the model takes, less SPARE_POSITIONS (None when the config has no limit)."""
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    return limit - SPARE_POSITIONS if limit else None
