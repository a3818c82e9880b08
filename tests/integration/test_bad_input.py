"""Every bad input: one-line error naming problem and fix, exit 2, nothing written, source untouched."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.tiny_models import make_checkpoint

import headfold.converter.conversion as convert_module
from headfold.cli import main


def tree_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        digest.update(p.relative_to(folder).as_posix().encode())
        if p.is_file():
            digest.update(p.read_bytes())
    return digest.hexdigest()


@pytest.fixture
def src(tiny_checkpoint, tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    return folder


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["convert", *args, "--quiet"])
    return code, capsys.readouterr().err.strip()


def break_config(src: Path) -> None:
    (src / "config.json").write_text("{not json")


def drop_config(src: Path) -> None:
    (src / "config.json").unlink()


def drop_weights(src: Path) -> None:
    (src / "model.safetensors").unlink()


def truncate_weights(src: Path) -> None:
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])


def garbage_weights(src: Path) -> None:
    (src / "model.safetensors").write_bytes(b"\x00" * 64)


def unknown_architecture(src: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))


def wrong_head_count(src: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))


def pickle_only(src: Path) -> None:
    from safetensors.torch import load_file

    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()


BROKEN: dict[str, tuple[Callable[[Path], None], list[str], str]] = {
    # case: (how the source is broken, extra args, words the message must contain)
    "missing config": (drop_config, [], "config.json is missing"),
    "corrupt config": (break_config, [], "is corrupt (not JSON"),
    "missing weights": (drop_weights, [], "no weights"),
    "truncated safetensors": (truncate_weights, [], "truncated"),
    "garbage safetensors": (garbage_weights, [], "truncated"),
    "unknown architecture": (unknown_architecture, [], "it converts bart, bert, bloom, gemma, gpt2"),
    "config disagrees with weights": (wrong_head_count, [], "disagree"),
    "pickle without flag": (pickle_only, [], "--allow-pickle"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_broken_source(case: str, src: Path, tmp_path: Path, capsys) -> None:
    breaks, extra, words = BROKEN[case]
    breaks(src)
    before = tree_digest(src)
    code, err = run_cli([str(src), str(tmp_path / "out"), "--kv-heads", "2", *extra], capsys)
    assert code == 2
    assert words in err and err.startswith("headfold: error:") and "\n" not in err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no temporary sibling left
    assert tree_digest(src) == before


@pytest.mark.parametrize("kv_heads, words", [("3", "choose one of: 1, 2, 4, 8"), ("16", "choose one of"), ("0", "impossible")])
def test_impossible_head_counts(kv_heads: str, words: str, src: Path, tmp_path: Path, capsys) -> None:
    code, err = run_cli([str(src), str(tmp_path / "out"), "--kv-heads", kv_heads], capsys)
    assert (code, words in err) == (2, True)
    assert not (tmp_path / "out").exists()


def test_gqa_source_allows_only_divisors_of_its_kv_heads(tmp_path: Path, capsys) -> None:
    src = make_checkpoint("llama", tmp_path / "src", num_key_value_heads=4)
    code, err = run_cli([str(src), str(tmp_path / "out"), "--kv-heads", "8"], capsys)
    assert code == 2 and "and 4 kv heads; choose one of: 1, 2, 4" in err


def test_existing_output_needs_overwrite(src: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = run_cli([str(src), str(out), "--kv-heads", "2"], capsys)
    assert code == 2 and "--overwrite" in err and (out / "keep.txt").read_text() == "mine"
    code, err = run_cli([str(src), str(out), "--kv-heads", "2", "--overwrite"], capsys)  # not headfold's folder
    assert code == 2 and "headfold did not write" in err and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    assert run_cli([str(src), str(out), "--kv-heads", "2", "--overwrite"], capsys)[0] == 0  # empty: replaced
    assert run_cli([str(src), str(out), "--kv-heads", "2", "--overwrite"], capsys)[0] == 0  # headfold's own: replaced
    assert (out / "headfold.json").is_file()


@pytest.mark.parametrize("where", ["inside", "same", "parent"])
def test_output_overlapping_source(where: str, src: Path, capsys) -> None:
    out = {"inside": src / "gqa", "same": src, "parent": src.parent}[where]
    before = tree_digest(src)
    code, err = run_cli([str(src), str(out), "--kv-heads", "2", "--overwrite"], capsys)
    assert code == 2 and "source" in err
    assert tree_digest(src) == before


def test_pickle_with_flag_loads_weights_only(src: Path, tmp_path: Path, capsys) -> None:
    reference = tmp_path / "reference"
    assert run_cli([str(src), str(reference), "--kv-heads", "2"], capsys)[0] == 0
    pickle_only(src)
    code, _ = run_cli([str(src), str(tmp_path / "out"), "--kv-heads", "2", "--allow-pickle"], capsys)
    assert code == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


def test_failure_midway_leaves_nothing(src: Path, tmp_path: Path, monkeypatch) -> None:
    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(convert_module, "convert_layer", explode)  # the torch path
    if hasattr(convert_module, "rawpool"):  # mean and first without torch
        monkeypatch.setattr(convert_module.rawpool, "convert_layer", explode)
    with pytest.raises(OSError):
        convert_module.convert(src, tmp_path / "out", 2, method="mean", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_console_script_exit_codes(src: Path, tmp_path: Path) -> None:
    """The installed `headfold` entry point, as a user runs it."""
    exe = Path(sys.executable).with_name("headfold")
    bad = subprocess.run([exe, "convert", src, tmp_path / "o", "--kv-heads", "5", "--method", "mean"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    usage = subprocess.run([exe, "convert", src], capture_output=True, text=True)
    assert usage.returncode == 2
    ok = subprocess.run([exe, "convert", src, tmp_path / "o", "--kv-heads", "4", "--method", "mean", "-q"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
