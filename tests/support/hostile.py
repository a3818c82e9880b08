"""The hostile-input tests' shared world and checks (tests/integration/test_hostile_*.py).

One tiny byte-level Llama (so verify and distill need no tokenizer files), its kv-2 conversion,
the session's split ONNX export of the tiny Llama and a text: an input of every kind a command
reads, copied into one folder per test module so that a refusal that fails overwrites nothing
another test shares.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from headfold import convert, corpus
from headfold.cli import main

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # what a terminal would act on; \t and \n are checked apart


@dataclass(frozen=True)
class World:
    root: Path
    src: Path  # the checkpoint (vocab 256)
    student: Path  # its kv-2 conversion
    export: Path  # a split export (of tiny_export's Llama): prefill.onnx + decode.onnx, export.json
    text: Path  # training / evaluation text

    @property
    def graph(self) -> Path:
        return self.export / "prefill.onnx"

    @property
    def inputs(self) -> list[Path]:
        return [self.src, self.student, self.export, self.text]

    def digests(self) -> dict[Path, str]:
        return {path: digest(path) for path in self.inputs}


def make_world(root: Path, tiny_checkpoint, tiny_export) -> World:
    """The world under `root`, from the session's tiny checkpoint and export (copied, never shared)."""
    src = Path(shutil.copytree(tiny_checkpoint("llama", vocab_size=256), root / "src"))
    _, onnx_dir = tiny_export("llama")
    export = Path(shutil.copytree(onnx_dir, root / "export"))
    student = convert(src, root / "student", 2, method="mean", progress=False)
    text = root / "text.txt"
    text.write_text(corpus.train_text()[:20_000])
    return World(root, src, student, export, text)


def digest(path: Path) -> str:
    """sha256 over a file, or over every path and file of a folder (link targets, not their content)."""
    h = hashlib.sha256()
    paths = sorted(path.rglob("*")) if path.is_dir() and not path.is_symlink() else [path]
    for p in paths:
        h.update(str(p.relative_to(path) if p != path else p.name).encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def entries(folder: Path) -> list[str]:
    """Every name in `folder`, hidden ones included."""
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def cli(capsys, *args) -> tuple[int, str]:
    """headfold in this process: (exit code, stderr)."""
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, expected: int, *words: str) -> None:
    """Exit `expected`, one stderr line naming `words`, no traceback, no control character echoed."""
    lines = err.strip().splitlines()
    assert code == expected, err
    assert len(lines) == 1 and lines[0].startswith("headfold: error:") and "Traceback" not in err, err
    assert not CONTROL.search(lines[0].replace("\x1b[31m", "").replace("\x1b[0m", "")), repr(err)
    for word in words:
        assert word.lower() in err.lower(), err
