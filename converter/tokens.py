"""Text and token ids for calibration and verify: one loader, the same rules for both.

A checkpoint's tokenizer is loaded through transformers' own classes only: never the
checkpoint's code (`trust_remote_code=False`, so an `auto_map` neither runs nor prompts), never
the network (`local_files_only=True`), never a file linked from outside the folder. A model
without tokenizer files whose vocabulary is 256 is byte-level (token = UTF-8 byte).
"""

from __future__ import annotations

import codecs
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headfold.converter.checkpoint import TOKENIZER_FILES, CheckpointFacts, check_links, tokenizer_location
from headfold.ground.errors import BadInput, first_line, is_panic, quiet_panics
from headfold.ground.lazy import lazy_import

transformers = lazy_import("transformers")  # where a tokenizer is read: a mean conversion never loads it

BYTE_VOCAB = 256  # a byte-level model: token = UTF-8 byte
MAX_TEXT_BYTES = 64 << 20  # far more text than any check or calibration uses; /dev/zero is not text


@dataclass(frozen=True)
class Tokenizer:
    encode: Callable[[str], list[int]]  # no special tokens: rows and windows are cut later
    name: str  # for reports: "bytes" or "AutoTokenizer(GPT2Tokenizer)"


def encode_bytes(text: str) -> list[int]:
    """Byte-level tokenization: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def can_tokenize(facts: CheckpointFacts) -> bool:
    """The checkpoint has tokenizer files, or is byte-level: text can become its token ids."""
    return facts.tokenizer is not None or facts.vocab_size == BYTE_VOCAB


def find_tokenizer(folder: Path, vocab_size: int | None) -> Tokenizer | None:
    """The checkpoint's own tokenizer, bytes for a byte-level model, None when it has neither."""
    if (location := tokenizer_location(folder)) is not None:
        return _transformers_tokenizer(location, vocab_size)
    if vocab_size == BYTE_VOCAB:
        return Tokenizer(encode_bytes, "bytes")
    return None


def load_tokenizer(folder: Path, vocab_size: int | None, fix: str = "add its tokenizer files to the folder") -> Tokenizer:
    """find_tokenizer, or BadInput saying which files are missing and `fix`."""
    tokenizer = find_tokenizer(folder, vocab_size)
    if tokenizer is None:
        raise BadInput(f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) and is not byte-level ({BYTE_VOCAB} tokens); {fix}")
    return tokenizer


@contextmanager
def tokenizer_errors(folder: Path, doing: str = "load") -> Iterator[None]:
    """What the tokenizer library raises for a bad tokenizer file (a bare Exception, or a Rust
    panic, which is a BaseException) as one BadInput naming the folder."""
    try:
        with quiet_panics():  # the Rust panic hook's lines on stderr would precede the one line
            yield
    except BadInput:
        raise
    except BaseException as err:
        if not (isinstance(err, Exception) or is_panic(err)):
            raise  # KeyboardInterrupt, SIGTERM: not the tokenizer's fault
        raise BadInput(
            f"cannot {doing} the tokenizer in {folder} ({type(err).__name__}: {first_line(err)}); restore its tokenizer files from the original "
            "checkpoint (headfold loads transformers' own tokenizer classes only and never runs a checkpoint's code)"
        ) from None


def auto_tokenizer(folder: Path) -> Any:
    """transformers' AutoTokenizer for the tokenizer files in `folder`: offline, none of the folder's
    code, no file linked from outside it; BadInput for files the tokenizer library cannot load."""
    check_links(folder)
    with tokenizer_errors(folder):
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)


def _transformers_tokenizer(folder: Path, vocab_size: int | None) -> Tokenizer:
    tok = auto_tokenizer(folder)

    def encode(text: str) -> list[int]:
        with tokenizer_errors(folder, "run"):
            ids = tok.encode(text, add_special_tokens=False, verbose=False)
        return in_vocabulary(ids, vocab_size, folder)

    return Tokenizer(encode, f"AutoTokenizer({type(tok).__name__})")


def in_vocabulary(ids: list[int], vocab_size: int | None, folder: Path) -> list[int]:
    """`ids`, or BadInput when one would index past the model's embedding table."""
    if vocab_size and ids and max(ids) >= vocab_size:
        raise BadInput(
            f"the tokenizer in {folder} gives token id {max(ids)}, outside the model's vocabulary of {vocab_size}; its tokenizer files belong to another model"
        )
    return ids


def read_text(path: Path, option: str) -> str:
    """The UTF-8 text file given to `option`; BadInput for a missing, special, huge, binary or empty file."""
    return "".join(_text_pieces(path, option, most=MAX_TEXT_BYTES))


def check_text_file(path: Path, option: str, digest: Any = None) -> None:
    """The one rule for a text file, in every command (read_text's), on a file of any size: read once, in
    chunks, each also fed to `digest` (a hashlib object; distill hashes its --data as it checks it)."""
    for _ in _text_pieces(path, option, digest=digest):
        pass


def _text_pieces(path: Path, option: str, most: int | None = None, digest: Any = None, chunk: int = 1 << 20) -> Iterator[str]:
    """The file's text, chunk by chunk; BadInput (naming the file and, for a NUL or an invalid byte, its offset)
    unless it is a regular file of UTF-8 text without NUL bytes, not blank, of at most `most` bytes."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise BadInput(f"{option} {path} does not exist; pass a UTF-8 text file") from None
    if not stat.S_ISREG(info.st_mode):
        raise BadInput(f"{option} {path} is not a regular file; pass a UTF-8 text file")
    if most is not None and info.st_size > most:
        raise BadInput(f"{option} {path} has {info.st_size / 2**20:.0f} MiB, more than the {most >> 20} MiB headfold reads; pass an excerpt")
    decoder, blank, offset = codecs.getincrementaldecoder("utf-8")(), True, 0
    with path.open("rb") as f:
        while data := f.read(chunk):
            if digest is not None:
                digest.update(data)
            if (nul := data.find(b"\0")) >= 0:
                raise BadInput(f"{option} {path} is binary (a NUL byte at offset {offset + nul}); pass a UTF-8 text file")
            try:
                piece = decoder.decode(data)
            except UnicodeDecodeError as err:
                raise BadInput(f"{option} {path} is not UTF-8 text (invalid byte at offset {offset + err.start}); pass a UTF-8 text file") from None
            blank = blank and not piece.strip()
            offset += len(data)
            yield piece
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise BadInput(f"{option} {path} is not UTF-8 text (it ends inside a character); pass a UTF-8 text file") from None
    if blank:
        raise BadInput(f"{option} {path} is empty; pass a UTF-8 text file")
