"""What every runner is fed: token ids from a text, cut into seeded rows, in right-padded batches.

Rows are consecutive segments of the text whose lengths are drawn (fixed seed) between half a
window and a window, so every batch is padded and no text is lost between rows. Right padding
keeps positions 0..n-1 for real tokens in every backend (ONNX derives positions from the mask,
transformers from the order), and a causal model's real tokens never see a pad.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from headfold import corpus
from headfold.errors import BadInput

BUILTIN_TEXT = "builtin:heldout"  # headfold.corpus.heldout_text(): never seen in the embedded model's training
BYTE_VOCAB = 256  # headfold's byte-level convention: no tokenizer files, ids are UTF-8 bytes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json")
# Leave room for position offsets such as RoBERTa's padding_idx + 1.
_SPARE_POSITIONS = 2
DEFAULT_DECODE_STEPS = 16  # KV-cache steps per row through a decoder export's decode graph


@dataclass(frozen=True)
class InputSpec:
    """How to turn a text into feeds; recorded in every report."""

    text: Path | None = None  # None: the built-in held-out text
    window: int = 256  # longest row, in tokens
    max_rows: int | None = 128  # seeded subset of rows when the text has more; None = all
    batch_size: int = 8
    seed: int = 0
    decode_steps: int = DEFAULT_DECODE_STEPS  # the last tokens of each row fed one by one; 0 = none


@dataclass
class Inputs:
    feeds: list[dict[str, np.ndarray]]
    info: dict[str, Any] = field(default_factory=dict)
    decode_steps: int = DEFAULT_DECODE_STEPS


def read_text(path: Path | None) -> tuple[str, str]:
    """(text, label); BadInput for a missing, non-UTF-8 or empty file."""
    if path is None:
        return corpus.heldout_text(), BUILTIN_TEXT
    if not path.is_file():
        raise BadInput(f"text file {path} does not exist; pass --text with a UTF-8 text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"text file {path} is not UTF-8 text") from None
    if not text.strip():
        raise BadInput(f"text file {path} is empty")
    return text, str(path)


def read_config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise BadInput(f"cannot read {folder / 'config.json'}: {str(err).splitlines()[0]}") from None


def tokenizer_for(folder: Path, config: dict[str, Any]) -> tuple[Callable[[str], list[int]], str]:
    """The checkpoint's own tokenizer (offline, no remote code), else bytes for a 256-token vocabulary."""
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        return (lambda text: tok.encode(text, add_special_tokens=False)), f"AutoTokenizer({type(tok).__name__})"
    if config.get("vocab_size") == BYTE_VOCAB:
        return corpus.encode, "bytes"
    raise BadInput(
        f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) and its vocabulary is not "
        f"{BYTE_VOCAB} bytes; add the tokenizer to the checkpoint folder"
    )


def position_limit(config: dict[str, Any]) -> int | None:
    limit = config.get("max_position_embeddings") or config.get("n_positions")
    return limit - _SPARE_POSITIONS if limit else None


def cut_rows(ids: list[int], window: int, max_rows: int | None, seed: int) -> list[np.ndarray]:
    """Consecutive segments of seeded length in [window // 2, window]; a seeded subset if too many."""
    rng = np.random.default_rng(seed)
    rows, start = [], 0
    while len(ids) - start >= 2:  # a row needs one prediction at least
        length = int(rng.integers(max(2, window // 2), window + 1))
        rows.append(np.asarray(ids[start : start + length], dtype=np.int64))
        start += length
    if not rows:
        raise BadInput(f"the text has {len(ids)} tokens; it needs at least 2")
    if max_rows is not None and len(rows) > max_rows:
        keep = np.sort(rng.choice(len(rows), size=max_rows, replace=False))
        rows = [rows[i] for i in keep]
    return rows


def pad_batch(rows: list[np.ndarray], pad_id: int, token_type_ids: bool) -> dict[str, np.ndarray]:
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    feed = {"input_ids": ids, "attention_mask": mask}
    if token_type_ids:
        feed["token_type_ids"] = np.zeros_like(ids)
    return feed


def wants_token_type_ids(config: dict[str, Any]) -> bool:
    """Exactly the rule graphs.export applies: trained segment embeddings become a graph input."""
    return config.get("type_vocab_size", 0) > 1


def make_inputs(checkpoint: Path, spec: InputSpec) -> Inputs:
    """Feeds for the model in `checkpoint` (its tokenizer and limits) from `spec`."""
    if spec.window < 2 or spec.batch_size < 1 or (spec.max_rows is not None and spec.max_rows < 1):
        raise BadInput("--window must be at least 2, --batch-size and --max-rows at least 1")
    if spec.decode_steps < 0:
        raise BadInput("--decode-steps must be 0 (no KV-cache check) or more")
    config = read_config(checkpoint)
    text, label = read_text(spec.text)
    encode, tokenizer = tokenizer_for(checkpoint, config)
    limit = position_limit(config)
    window = min(spec.window, limit) if limit else spec.window
    rows = cut_rows(encode(text), window, spec.max_rows, spec.seed)
    pad_id = config.get("pad_token_id") or 0
    types = wants_token_type_ids(config)
    feeds = [pad_batch(rows[i : i + spec.batch_size], pad_id, types) for i in range(0, len(rows), spec.batch_size)]
    ids_hash = hashlib.sha256(b"".join(r.tobytes() for r in rows)).hexdigest()
    info = {
        "text": label,
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "tokenizer": tokenizer,
        "input_ids_sha256": ids_hash,
        "tokens": int(sum(len(r) for r in rows)),
        "rows": len(rows),
        "window": window,
        "max_rows": spec.max_rows,
        "batch_size": spec.batch_size,
        "seed": spec.seed,
        "padding": "right",
        "decode_steps": spec.decode_steps,
    }
    return Inputs(feeds, info, spec.decode_steps)
