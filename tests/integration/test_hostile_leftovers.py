"""Issue 43's leftovers of the hostile rounds: a signal before training, messages that name the wrong
problem, one rule for text and for numbers, long output names, and what a new user saw at first.

Every refusal asserts the exit code, one stderr line naming the problem, and nothing at or beside OUT.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.hostile import World, assert_one_line, cli, entries, make_world

import headfold.converter.conversion as conversion
import headfold.distillation.run as distill_run
from headfold import convert
from headfold.ground.errors import BadInput

HEADFOLD = Path(sys.executable).with_name("headfold")
SMALL_VERIFY = ["--max-rows", "2", "--window", "8", "--decode-steps", "0"]


@pytest.fixture(scope="module")
def world(tiny_checkpoint, tiny_export, tmp_path_factory) -> World:
    return make_world(tmp_path_factory.mktemp("world"), tiny_checkpoint, tiny_export)


def nothing_beside(out: Path) -> None:
    """Neither OUT nor a hidden sibling of it."""
    assert not [n for n in entries(out.parent) if n == out.name or n.startswith(f".{out.name}")], entries(out.parent)


# -- 1. a signal before the first training step ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, line, flags",
    [
        (signal.SIGTERM, "distill: tokenising", []),  # the request checked, the data being read
        (signal.SIGINT, "distill: tokenising", []),
        (signal.SIGTERM, "distill: 4 steps", ["--save-every", "2"]),  # data tokenised, no step taken: nothing a resume could use
    ],
)
def test_a_signal_before_training_exits_128_plus_it_and_leaves_nothing(signum: int, line: str, flags: list[str], world: World, tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [HEADFOLD, "distill", world.src, world.student, out, "--data", world.text, "--seq-len", "32", "--steps", "4", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env) as process:
        said = []
        for said_line in process.stderr:  # synchronised on the line the command prints, not on time
            said.append(said_line)
            if said_line.startswith(line):
                process.send_signal(signum)
                break
        rest = process.stderr.read()
        code = process.wait()
    assert code == 128 + signum, "".join(said) + rest
    nothing_beside(out)
    again = subprocess.run(args, capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "removed" not in again.stderr, again.stderr  # the next run starts clean, nothing to clear


# -- 2. a config.json dtype torch does not have -------------------------------------------------


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_an_unknown_config_dtype_is_named(key: str, world: World, tmp_path: Path, capsys) -> None:
    src = Path(shutil.copytree(world.src, tmp_path / "src"))
    config = json.loads((src / "config.json").read_text())
    config.pop("dtype", None)
    (src / "config.json").write_text(json.dumps({**config, key: "float1024"}))
    for command in (
        ["convert", src, tmp_path / "out", "--kv-heads", "2", "-q"],
        ["convert", src, tmp_path / "out", "--kv-heads", "2", "--method", "mean", "-q"],
    ):
        code, err = cli(capsys, *command)
        assert_one_line(code, err, 2, f"'{key}'", "float1024", "config.json")
        nothing_beside(tmp_path / "out")


# -- 3. an ONNX graph whose external data is not its own -----------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_external_data_that_does_not_match_the_graph_is_named(damage: str, world: World, tmp_path: Path, capsys) -> None:
    export = Path(shutil.copytree(world.export, tmp_path / "export"))
    data = export / "prefill.onnx.data"
    if damage == "truncated":
        os.truncate(data, 1000)
    else:
        data.unlink()
    out = tmp_path / "out.onnx"
    code, err = cli(capsys, "convert", export / "prefill.onnx", out, "--kv-heads", "2", "-q")
    assert_one_line(code, err, 2, "prefill.onnx", str(data), "does not match" if damage == "truncated" else "does not exist")
    nothing_beside(out)


# -- 4, 5, 8. output paths ----------------------------------------------------------------------


def test_a_report_below_a_file_says_the_parent_is_a_file(world: World, tmp_path: Path, capsys) -> None:
    (tmp_path / "afile").write_text("mine")
    code, err = cli(capsys, "verify", world.src, world.student, "--report", tmp_path / "afile" / "x.xml", *SMALL_VERIFY, "-q")
    assert_one_line(code, err, 2, f"{tmp_path / 'afile'} is a file, not a folder")
    assert (tmp_path / "afile").read_text() == "mine"


def test_an_onnx_output_ending_in_a_slash_is_a_folder(world: World, tmp_path: Path, capsys) -> None:
    code, _ = cli(capsys, "convert", world.graph, f"{tmp_path / 'newdir'}{os.sep}", "--kv-heads", "2", "-q")
    assert code == 0
    assert sorted(entries(tmp_path)) == ["newdir"] and entries(tmp_path / "newdir") == ["prefill.onnx", "prefill.onnx.data"]


def test_an_output_name_at_the_file_systems_limit_is_written(world: World, tmp_path: Path, capsys) -> None:
    out = tmp_path / ("o" * 250)  # valid (NAME_MAX 255); ".NAME.lock" and ".NAME.partial-PID" would not be
    code, err = cli(capsys, "convert", world.src, out, "--kv-heads", "2", "--method", "mean", "-q")
    assert code == 0, err
    assert entries(tmp_path) == [out.name] and (out / "headfold.json").is_file()  # no lock or staging folder left
    assert convert(world.src, out, 2, method="mean", overwrite=True, progress=False) == out  # again, over it


# -- 6. one rule for text -----------------------------------------------------------------------


@pytest.mark.parametrize("command", ["distill", "distill --eval-data", "convert", "verify"])
def test_nul_bytes_are_binary_in_every_command(command: str, world: World, tmp_path: Path, capsys) -> None:
    binary = tmp_path / "zeros.txt"
    binary.write_bytes(b"\0" * 100_000)
    out = tmp_path / "out"
    args = {
        "distill": ["distill", world.src, world.student, out, "--data", binary, "--seq-len", "32", "--steps", "1"],
        "distill --eval-data": ["distill", world.src, world.student, out, "--data", world.text, "--eval-data", binary, "--seq-len", "32", "--steps", "1"],
        "convert": ["convert", world.src, out, "--kv-heads", "2", "--method", "aligned", "--calibration", binary],
        "verify": ["verify", world.src, world.student, "--text", binary, "--report", out, *SMALL_VERIFY],
    }[command]
    code, err = cli(capsys, *args, "-q")
    assert_one_line(code, err, 2, str(binary), "binary", "NUL")
    nothing_beside(out)


def test_nul_characters_in_a_jsonl_row_are_not_text(world: World, tmp_path: Path, capsys) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "fine"}\n{"text": "a\\u0000b"}\n')
    out = tmp_path / "out"
    code, err = cli(capsys, "distill", world.src, world.student, out, "--data", data, "--seq-len", "32", "--steps", "1", "-q")
    assert_one_line(code, err, 2, "row 2", "NUL")
    nothing_beside(out)


# -- 7. numbers in ASCII digits -----------------------------------------------------------------


@pytest.mark.parametrize("word", ["5_0", "+9", "\u0665\u0660", "\uff15"])  # an underscore, a plus sign, Arabic-Indic and full-width digits
def test_token_ids_and_counts_are_ascii_digits(word: str, world: World, tmp_path: Path, capsys) -> None:
    ids = tmp_path / "ids.txt"
    ids.write_text(f"1 {word} 3\n")
    report = tmp_path / "report.json"
    code, err = cli(capsys, "verify", world.src, world.src, "--token-ids", ids, "--report", report, "--decode-steps", "0", "-q")
    assert_one_line(code, err, 2, "line 1", "digits 0-9")
    out = tmp_path / "out"
    for args in (["--calibration-tokens", word], ["--seed", word], ["--kv-heads", word]):
        code, err = cli(capsys, "convert", world.src, out, "--method", "aligned", *(["--kv-heads", "2"] if args[0] != "--kv-heads" else []), *args, "-q")
        assert_one_line(code, err, 2, args[0])
    nothing_beside(report)
    nothing_beside(out)


# -- 12, 14. what is said, and when -------------------------------------------------------------


def test_convert_and_distill_say_what_they_do_before_the_slow_part(world: World, tmp_path: Path, capsys, monkeypatch) -> None:
    """Once the request is valid, a line says what the seconds before the first bar are: a stand-in for the slow
    part (imports, the tokenizer, tokenising) stops the command there, the line already out."""

    def stop(*args, **kwargs):
        raise BadInput("stopped at the slow part")

    monkeypatch.setattr(conversion, "calibration_text", stop)
    monkeypatch.setattr(distill_run, "window_plan", stop)
    code, err = cli(capsys, "convert", world.src, tmp_path / "out", "--kv-heads", "2")
    assert code == 2 and err.splitlines()[0].startswith("convert: loading torch, transformers, the tokenizer and 16384 tokens"), err
    code, err = cli(capsys, "distill", world.src, world.student, tmp_path / "out", "--data", world.text, "--seq-len", "32")
    assert code == 2 and err.splitlines()[0] == f"distill: tokenising {world.text} with {world.src}'s tokenizer", err
    code, err = cli(capsys, "convert", world.src, tmp_path / "out", "--kv-heads", "3")
    assert_one_line(code, err, 2, "--kv-heads 3")  # a bad request: its one line alone, before any


def test_the_python_api_prints_what_the_command_prints(world: World, tmp_path: Path, capsys) -> None:
    """progress=True: the command's default lines, none of the libraries'; False: -q; the caller's logging as it was."""
    import logging

    before = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers)) for name in ("headfold", "torch.onnx")}
    convert(world.src, tmp_path / "a", 2, method="aligned")
    assert capsys.readouterr().err.startswith("convert: loading torch, transformers")
    convert(world.src, tmp_path / "b", 2, method="mean", progress=False)
    assert capsys.readouterr().err == ""
    assert {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers)) for name in before} == before
