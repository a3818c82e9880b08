"""Distillation data: text documents from local files or 🤗 datasets, tokenized and packed into windows.

`--data` is a text file (one example per line, line breaks kept), a `.jsonl` / `.json` or
`.parquet` file with a `text` field, or a folder written by 🤗 datasets' `save_to_disk`. For an
encoder-decoder, rows may instead hold (source, target) pairs (`source` and `target` fields): each
is one window, its first half the source and the rest the target, cut or filled with ABSENT. Files
stream through `datasets` (never loaded whole, never the network); windows are cut from the
concatenated token stream, documents separated by the tokenizer's EOS token (or a blank line).
The held-out windows are the first `eval_windows` of the stream unless `--eval-data` is given;
training windows come after them, shuffled in a seeded buffer, epoch after epoch.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TypeVar

import torch

from headfold import corpus
from headfold.converter.checkpoint import tokenizer_location
from headfold.converter.tokens import TOKENIZER_FILES, auto_tokenizer, check_text_file, in_vocabulary, tokenizer_errors
from headfold.ground.errors import BadInput, BadOption, HeadfoldError, first_line
from headfold.ground.inputs import check_links, contained, read_json_object
from headfold.ground.lazy import lazy_import

datasets = lazy_import("datasets")  # by a data file or folder; the built-in text needs none

TEXT_FIELD = "text"
AUDIO_FIELD = "audio"  # Whisper's rows (audio.py): refused here, so their transcripts never pass for text
PAIR_FIELDS = ("source", "target")  # an encoder-decoder's (source, target) rows
ABSENT = -1  # a window position a pair does not fill: masked out of the model's inputs and the loss
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # anything else is read as text
SHUFFLE_WINDOWS = 1024  # training windows shuffled together: neighbours in the text rarely share a batch
Item = TypeVar("Item")  # a window's ids, or a clip and its target ids (audio.py)


@dataclass(frozen=True)
class TextSource:
    """Where documents come from: `docs()` streams them again on every call."""

    name: str
    sha256: str
    docs: Callable[[], Iterator[str | tuple[str, str]]]


@dataclass(frozen=True)
class Encoder:
    """Token ids of a text, the ids between two documents, and the ids wrapped around each window."""

    encode: Callable[[str], list[int]]
    separator: list[int]
    wrap: Callable[[list[int]], list[int]]
    overhead: int  # special tokens `wrap` adds
    name: str


def _digest(paths: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def builtin_source(text: str, name: str) -> TextSource:
    """The embedded corpus (or any in-memory text) as one document."""
    return TextSource(name, hashlib.sha256(text.encode()).hexdigest(), lambda: iter([text]))


def file_source(path: Path, option: str = "--data", pairs: bool = False) -> TextSource:
    """A text / jsonl / parquet file or a save_to_disk folder; BadInput when it cannot be one, and while
    its documents are read, at a row that is not text or (with `pairs`: an encoder-decoder) a pair."""
    if not path.exists():
        raise BadInput(f"{option} {path} does not exist; pass a text, .jsonl or .parquet file or a datasets save_to_disk folder")
    if path.is_dir():
        return _disk_source(path, option, pairs)
    if not path.is_file():
        raise BadInput(f"{option} {path} is not a regular file; pass a text, .jsonl or .parquet file or a datasets save_to_disk folder")
    if path.stat().st_size == 0:
        raise BadInput(f"{option} {path} is empty; pass a file with text in it")
    builder = BUILDERS.get(path.suffix.lower(), "text")
    if builder == "text":
        digest = hashlib.sha256()
        check_text_file(path, option, digest)  # the rule --calibration and --text follow, hashing the file as it reads it
        sha256 = digest.hexdigest()
    else:
        sha256 = _digest([path])
    options = {"keep_linebreaks": True} if builder == "text" else {}

    def docs() -> Iterator[str | tuple[str, str]]:
        with _read_errors(path, option, f"cannot be read as {builder}"):
            stream = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **options)
            yield from _texts(stream, path, option, pairs)

    return TextSource(str(path), sha256, docs)


@contextmanager
def _read_errors(path: Path, option: str, problem: str) -> Iterator[None]:
    """datasets / pyarrow / codecs each raise their own types for a bad file: one BadInput naming it
    (datasets' own logged error would be a second line)."""
    library = datasets.logging.get_logger("datasets")  # imports datasets first: its import resets this level
    level = library.level
    library.setLevel(logging.CRITICAL + 1)
    try:
        yield
    except HeadfoldError:
        raise
    except Exception as err:
        raise BadInput(
            f"{option} {path} {problem} ({type(err).__name__}: {first_line(err)}); pass UTF-8 text, JSON lines, parquet with a '{TEXT_FIELD}' "
            "field (or source/target pairs), or a datasets save_to_disk folder"
        ) from None
    finally:
        library.setLevel(level)


def _check_dataset_folder(folder: Path, option: str) -> None:
    """Every file a save_to_disk folder names (its splits, each split's arrow files) lies inside it."""
    check_links(folder, "dataset folder")
    fix = "save the dataset again with save_to_disk"
    if (listing := folder / "dataset_dict.json").is_file():
        for split in read_json_object(listing, fix).get("splits", []):
            _check_dataset_folder(contained(folder, split, listing, fix), option)
    if (state := folder / "state.json").is_file():
        files = read_json_object(state, fix).get("_data_files", [])
        for entry in files if isinstance(files, list) else [files]:
            contained(folder, entry.get("filename") if isinstance(entry, dict) else entry, state, fix)


def _disk_source(folder: Path, option: str, pairs: bool) -> TextSource:
    _check_dataset_folder(folder, option)
    with _read_errors(folder, option, "is not a datasets save_to_disk folder"):
        loaded = datasets.load_from_disk(str(folder))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded and len(loaded) != 1:
            raise BadInput(f"{option} {folder} has splits {sorted(loaded)} but no 'train'; save the split to use on its own")
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    if loaded.num_rows == 0:
        raise BadInput(f"{option} {folder} holds no rows; pass a dataset with text in it")
    files = sorted(p for p in folder.rglob("*") if p.is_file())

    def docs() -> Iterator[str | tuple[str, str]]:
        with _read_errors(folder, option, "cannot be read"):
            yield from _texts(loaded.to_iterable_dataset(), folder, option, pairs)

    return TextSource(str(folder), _digest(files), docs)


def _texts(stream, path: Path, option: str, pairs: bool) -> Iterator[str | tuple[str, str]]:
    """Each row's text, or (`pairs`) its (source, target) pair; rows whose values are all null are skipped.
    A file mixing both kinds streams every column in every row, null where a row lacks it: a row is
    what its values say, not its keys."""
    for number, row in enumerate(stream, 1):
        where = f"{option} {path} row {number}"
        if AUDIO_FIELD in row:
            raise BadInput(f"{where} names audio, which only Whisper reads; give text with a '{TEXT_FIELD}' field")
        pair = tuple(row.get(field) for field in PAIR_FIELDS)
        if any(part is not None for part in pair):
            if row.get(TEXT_FIELD) is not None:
                raise BadInput(f"{where} holds both '{TEXT_FIELD}' and 'source'/'target'; give each row one of them")
            if not pairs:
                raise BadInput(
                    f"{where} is a (source, target) pair, which only an encoder-decoder (T5, BART) reads; give every row text in a '{TEXT_FIELD}' field"
                )
            if not all(isinstance(part, str) or part is None for part in pair):
                raise BadInput(f"{where}: 'source' and 'target' must be strings; give every row text (or null)")
            if all(pair):
                yield pair
            continue
        if TEXT_FIELD not in row:
            raise BadInput(f"{option} {path} has no '{TEXT_FIELD}' field (it has {', '.join(sorted(map(str, row)))}); name the text column '{TEXT_FIELD}'")
        text = row[TEXT_FIELD]
        if text is not None and not isinstance(text, str):
            raise BadInput(f"{where}: '{TEXT_FIELD}' is {type(text).__name__}, not a string; give every row text (or null)")
        if text and "\0" in text:
            raise BadInput(f"{where}: '{TEXT_FIELD}' holds NUL characters, which text does not; give every row UTF-8 text")
        if text:
            yield text


def encoder_for(folder: Path, vocab_size: int, encoder_model: bool) -> Encoder:
    """The checkpoint's own tokenizer (offline, no remote code); bytes for a 256-token vocabulary without one."""
    if tokenizer_location(folder) is None:
        if vocab_size != corpus.VOCAB_SIZE:
            raise BadInput(f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}) and is not byte-level; add its tokenizer to the folder")
        return Encoder(corpus.encode, corpus.encode(corpus.SEPARATOR), list, 0, "bytes")
    tok = auto_tokenizer(folder)
    with tokenizer_errors(folder, "run"):
        separator = [tok.eos_token_id] if tok.eos_token_id is not None and not encoder_model else tok.encode("\n\n", add_special_tokens=False)
        # encoders see every window framed as in training ([CLS] … [SEP]); decoders a plain slice of the stream
        prefix, suffix = _special_frame(tok) if encoder_model else ([], [])
    in_vocabulary([*separator, *prefix, *suffix], vocab_size, folder)

    def encode(text: str) -> list[int]:
        with tokenizer_errors(folder, "run"):
            ids = tok.encode(text, add_special_tokens=False, verbose=False)
        return in_vocabulary(ids, vocab_size, folder)  # an id past the embedding table would fail inside the model

    return Encoder(encode, separator, lambda ids: prefix + ids + suffix, len(prefix) + len(suffix), type(tok).__name__)


def _special_frame(tok) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text, read off one encoded word."""
    inner, full = tok.encode("a", add_special_tokens=False), tok.encode("a", add_special_tokens=True)
    start = next(i for i in range(len(full)) if full[i : i + len(inner)] == inner)
    return full[:start], full[start + len(inner) :]


def windows(source: TextSource, encoder: Encoder, seq_len: int) -> Iterator[list[int]]:
    """Consecutive windows of exactly `seq_len` tokens from the source's token stream (the tail is
    dropped); a (source, target) pair is a window of its own (pair_window)."""
    body = seq_len - encoder.overhead
    buffer: list[int] = []
    for i, doc in enumerate(source.docs()):
        if isinstance(doc, tuple):
            yield pair_window(doc, encoder, seq_len)
            continue
        buffer += (encoder.separator if i else []) + encoder.encode(doc)
        while len(buffer) >= body:
            yield encoder.wrap(buffer[:body])
            del buffer[:body]


def pair_window(pair: tuple[str, str], encoder: Encoder, seq_len: int) -> list[int]:
    """[source ids | target ids], each cut or filled with ABSENT to its half of `seq_len`."""
    half = seq_len // 2
    parts = [encoder.encode(text)[:size] for text, size in zip(pair, (half, seq_len - half), strict=True)]
    return [*parts[0], *[ABSENT] * (half - len(parts[0])), *parts[1], *[ABSENT] * (seq_len - half - len(parts[1]))]


def shuffled(items: Iterator[Item], rng: random.Random, size: int = SHUFFLE_WINDOWS) -> Iterator[Item]:
    """Fill a buffer of `size`, then emit a random element for each new one (like datasets' shuffle)."""
    buffer = list(islice(items, size))
    for item in items:
        i = rng.randrange(len(buffer))
        yield buffer[i]
        buffer[i] = item
    rng.shuffle(buffer)
    yield from buffer


@dataclass(frozen=True)
class WindowPlan:
    """Which windows train and which evaluate; checked before anything runs."""

    train: TextSource
    heldout: TextSource | None  # None: the first `eval_windows` windows of `train` are held out
    encoder: Encoder
    seq_len: int
    eval_windows: int
    seed: int

    @property
    def skip(self) -> int:
        return self.eval_windows if self.heldout is None else 0

    @property
    def notes(self) -> dict[str, str]:
        """What the manifest's data entry adds (audio.AudioPlan: where targets and features come from)."""
        return {}

    def collate(self, rows: list[list[int]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long)

    def batch(self, rows: list[list[int]], device: torch.device, teacher: torch.nn.Module, per_pass: int) -> torch.Tensor:
        """Rows of the stream as the objective's input on `device`: a window holds its own targets (audio.AudioPlan's
        clips may need the teacher's, which `teacher` transcribes `per_pass` at a time)."""
        return self.collate(rows).to(device)

    def held_out(self, count: int, device: torch.device, teacher: torch.nn.Module, per_pass: int) -> torch.Tensor:
        """The first `count` held-out windows as `batch` gives rows."""
        return self.eval_batch()[:count].to(device)

    def eval_batch(self) -> torch.Tensor:
        """The held-out windows, [count, seq_len]; never trained on."""
        return self.collate(list(islice(windows(self.heldout or self.train, self.encoder, self.seq_len), self.eval_windows)))

    def train_windows(self, skip: int = 0) -> Iterator[list[int]]:
        """Training windows forever (a new seeded shuffle per epoch), after dropping the first `skip` (resume)."""

        def epochs() -> Iterator[list[int]]:
            for epoch in range(1 << 62):
                rng = random.Random(f"{self.seed}:{epoch}")
                yield from shuffled(islice(windows(self.train, self.encoder, self.seq_len), self.skip, None), rng)

        return islice(epochs(), skip, None)

    def repeated(self, needed: int) -> int | None:
        """How many training windows the data holds when `needed` windows would repeat them (None:
        it holds more; at most `needed` + 1 are read to tell)."""
        available = sum(1 for _ in islice(windows(self.train, self.encoder, self.seq_len), self.skip, self.skip + needed + 1))
        return available if available <= needed else None

    def check(self) -> None:
        """BadInput when a row is bad (every row is read: not only the first, so none is refused at some
        step of the run), or the data gives no window, or no training window after the held-out ones."""
        if self.seq_len <= self.encoder.overhead:
            least = self.encoder.overhead + 1
            raise BadOption(
                "--seq-len", f"{self.seq_len} leaves no token inside the {self.encoder.overhead} special tokens of each window; choose at least {least}"
            )
        for source in (self.train, self.heldout):
            for _ in source.docs() if source is not None else ():
                pass
        first = list(islice(windows(self.train, self.encoder, self.seq_len), self.skip + 1))
        if not first:
            raise BadInput(f"--data {self.train.name} is shorter than one window of {self.seq_len} tokens; give more text or a smaller --seq-len")
        if len(first) <= self.skip:
            raise BadInput(
                f"--data {self.train.name} has only {len(first)} window(s) of {self.seq_len} tokens, all needed as the "
                f"{self.eval_windows} held-out windows; give more text, a smaller --eval-windows, or --eval-data"
            )
        if self.heldout is not None and not next(windows(self.heldout, self.encoder, self.seq_len), None):
            raise BadInput(f"--eval-data {self.heldout.name} is shorter than one window of {self.seq_len} tokens; give more text or a smaller --seq-len")
