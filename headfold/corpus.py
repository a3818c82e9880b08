"""Offline text corpus and byte-level tokenizer for the embedded default model.

The text is the Python reference documentation shipped in the stdlib module
``pydoc_data.topics`` (79 topics, ~465 KB), so training, calibration and
evaluation need no network.  Topics are split by a stable hash of their key:
``zlib.crc32(key) % 10 == 0`` is held out (5 topics, ~9% of the bytes), the rest
is the training split.  Token ids are UTF-8 byte values (vocabulary 256).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from pydoc_data import topics

VOCAB_SIZE = 256
SEPARATOR = "\n\n"  # between topics, so a window never glues two words together


def _is_heldout(key: str) -> bool:
    """Stable across processes and Python versions, unlike the salted ``hash()``."""
    return zlib.crc32(key.encode("utf-8")) % 10 == 0


def _join(heldout: bool) -> str:
    """Concatenate the topics of one split in sorted-key order."""
    keys = sorted(k for k in topics.topics if _is_heldout(k) == heldout)
    return SEPARATOR.join(topics.topics[k] for k in keys)


def train_text() -> str:
    """Training split: ~91% of the bytes."""
    return _join(heldout=False)


def heldout_text() -> str:
    """Held-out split: ~9% of the bytes, never seen in training or calibration."""
    return _join(heldout=True)


def calibration_text() -> str:
    """Text for calibration; the training split, so held-out numbers stay unbiased."""
    return train_text()


def encode(text: str) -> list[int]:
    """Byte-level tokenization: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    """Inverse of :func:`encode`; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")
