"""What every runner is fed: token ids from a text, cut into seeded rows, in right-padded batches.

Rows are consecutive segments of the text whose lengths are drawn (fixed seed) between half a
window and a window, so every batch is padded and no text is lost between rows. Right padding
keeps positions 0..n-1 for real tokens in every backend (ONNX derives positions from the mask,
transformers from the order), and a causal model's real tokens never see a pad.

Without text: rows of given token ids (`--token-ids FILE`: one row per line, whitespace-separated
ids), or for a model without a tokenizer seeded random ids, like Polygraphy's default data loader:
enough for fidelity (one model, two backends), meaningless for conversion loss.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from headfold import corpus
from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.tokens import TOKENIZER_FILES, find_tokenizer
from headfold.converter.tokens import read_text as read_text_file
from headfold.ground.errors import BadInput
from headfold.ground.settings import DEFAULT_DECODE_STEPS, InputSpec
from headfold.ground.units import whole_number
from headfold.verification.seq2seq import pair_feeds

BUILTIN_TEXT = "builtin:heldout"  # headfold.corpus.heldout_text(): never seen in the embedded model's training
RANDOM_IDS = "random token ids"


@dataclass
class Inputs:
    feeds: list[dict[str, np.ndarray]]
    info: dict[str, Any] = field(default_factory=dict)
    decode_steps: int = DEFAULT_DECODE_STEPS


def read_text(path: Path | None) -> tuple[str, str]:
    """(text, label); BadInput for a missing, non-UTF-8 or empty file."""
    if path is None:
        return corpus.heldout_text(), BUILTIN_TEXT
    return read_text_file(path, "--text"), str(path)


def read_token_ids(path: Path, vocab_size: int) -> list[np.ndarray]:
    """`--token-ids FILE`: one row per non-blank line, whitespace-separated ids in [0, vocab_size)."""
    rows = []
    for number, line in enumerate(read_text_file(path, "--token-ids").splitlines(), 1):
        try:
            row = np.array([_token_id(word) for word in line.split()], dtype=np.int64)
        except (ValueError, OverflowError):  # OverflowError: an id beyond int64
            raise BadInput(
                f"--token-ids {path} line {number} is not whitespace-separated token ids (the digits 0-9) in the vocabulary [0, {vocab_size}); "
                "write one row of token ids per line"
            ) from None
        if row.size == 1 or (row.size and (row.min() < 0 or row.max() >= vocab_size)):
            raise BadInput(f"--token-ids {path} line {number} needs at least 2 ids, each in the vocabulary [0, {vocab_size})")
        if row.size:
            rows.append(row)
    if not rows:
        raise BadInput(f"--token-ids {path} has no rows; write one row of token ids per line")
    return rows


def _token_id(word: str) -> int:
    if (number := whole_number(word)) is None or number < 0:
        raise ValueError(word)
    return number


def random_rows(vocab_size: int, window: int, rows: int, seed: int) -> list[np.ndarray]:
    """Seeded uniform random ids, rows of seeded lengths in [window // 2, window] (Polygraphy's default data, for fidelity)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(2, window // 2), window + 1, size=rows)
    return [rng.integers(0, vocab_size, size=int(n), dtype=np.int64) for n in lengths]


def choose_rows(facts: CheckpointFacts, spec: InputSpec, window: int, need_text: bool) -> tuple[list[np.ndarray], dict[str, Any]]:
    """The rows to feed and where they came from: --token-ids, else text through the model's tokenizer,
    else (no tokenizer, fidelity only) random ids."""
    checkpoint, vocab_size = facts.folder, facts.vocab_size
    if spec.token_ids is not None:
        if spec.text is not None:
            raise BadInput("pass either --text or --token-ids, not both")
        rows = [r[:window] for r in read_token_ids(spec.token_ids, _known_vocab(facts, "--token-ids"))]  # longer rows are cut to the window
        return _subset(rows, spec.max_rows, spec.seed), {"text": f"--token-ids {spec.token_ids}", "tokenizer": "none"}
    text, label = read_text(spec.text)  # first: a bad --text is named as such
    tokenizer = find_tokenizer(checkpoint, vocab_size)
    if tokenizer is None and (spec.text is not None or need_text):
        why = "the conversion-loss check needs real text" if need_text else f"--text {spec.text} cannot be tokenized"
        raise BadInput(
            f"{why}, but {checkpoint} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); add the tokenizer to the "
            "folder, or pass --token-ids FILE (one row of token ids per line)"
        )
    if tokenizer is None:
        rows = random_rows(_known_vocab(facts, "the random token ids"), window, spec.max_rows or 128, spec.seed)
        return rows, {"text": f"{RANDOM_IDS} (seed {spec.seed}; {checkpoint} has no tokenizer)", "tokenizer": "none"}
    rows = cut_rows(tokenizer.encode(text), window, spec.max_rows, spec.seed)
    return rows, {"text": label, "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "tokenizer": tokenizer.name}


def _known_vocab(facts: CheckpointFacts, use: str) -> int:
    """config.json's vocab_size, which bounds --token-ids and random ids; BadInput without one."""
    if facts.vocab_size is None:
        raise BadInput(f"{facts.folder}/config.json has no vocab_size to bound {use}; add it to config.json")
    return facts.vocab_size


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
    return _subset(rows, max_rows, seed, rng)


def _subset(rows: list[np.ndarray], max_rows: int | None, seed: int, rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """A seeded subset of `max_rows` rows, in their order, when there are more."""
    if max_rows is None or len(rows) <= max_rows:
        return rows
    keep = np.sort((rng or np.random.default_rng(seed)).choice(len(rows), size=max_rows, replace=False))
    return [rows[i] for i in keep]


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


def make_inputs(checkpoint: Path, spec: InputSpec, allow_random: bool = False) -> Inputs:
    """Feeds for the model in `checkpoint` (its tokenizer and limits) from `spec`; `allow_random`
    (fidelity only): random ids when the model has no tokenizer and no --token-ids are given."""
    facts = CheckpointFacts.read(checkpoint)
    facts.require_positions(2, "verify (a row of at least 2 tokens)")
    limit = facts.position_limit
    window = min(spec.window, limit) if limit else spec.window
    rows, source = choose_rows(facts, spec, window, need_text=not allow_random)
    if facts.kind == "seq2seq":  # (source, target) pairs: verification.seq2seq
        feeds, pairs = pair_feeds(facts, rows, spec.batch_size, spec.seed)
        source |= pairs
    else:
        pad_id = facts.config.get("pad_token_id") or 0
        types = wants_token_type_ids(facts.config)
        feeds = [pad_batch(rows[i : i + spec.batch_size], pad_id, types) for i in range(0, len(rows), spec.batch_size)]
    ids_hash = hashlib.sha256(b"".join(r.tobytes() for r in rows)).hexdigest()
    info = {
        **source,
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
