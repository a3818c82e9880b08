"""Hostile and careless writes: nothing lost, one writer wins, no leaks, no stale skip (issue 10).

Every case asserts the exit code, one stderr line without a traceback, nothing at or beside OUT
(hidden folders included) and the source's hash unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import onnx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from support.hostile import World, assert_one_line, cli, entries, make_world

from headfold.cli import main
from headfold.demo import default_model_path
from headfold.ground.atomic import atomic_output, check_output, output_lock, scratch_dir
from headfold.ground.errors import BadInput, CheckFailed

HEADFOLD = Path(sys.executable).with_name("headfold")


def digest(folder: Path) -> str:
    """sha256 over every path under `folder` and every file's bytes (links not followed)."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(p.relative_to(folder).as_posix().encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def beside(folder: Path) -> list[str]:
    """Every entry of `folder`, hidden ones included."""
    return sorted(p.name for p in folder.iterdir())


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main([str(a) for a in args])
    err = capsys.readouterr().err.strip()
    return code, err


def one_line(err: str) -> None:
    assert err.startswith("headfold: error:") and "\n" not in err and "Traceback" not in err, err


@pytest.fixture
def src(tiny_checkpoint, tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    return folder


def wide_checkpoint(folder: Path, layers: int = 4, hidden: int = 1024, ffn: int = 4096, heads: int = 8) -> Path:
    """A 260 MB Llama-layout checkpoint, one shard per layer, so that a conversion is long enough
    to be caught mid-write (zeros: the content does not matter here)."""
    folder.mkdir(parents=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "vocab_size": 256,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    weight_map: dict[str, str] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        shard = {f"{p}self_attn.{n}_proj.weight": torch.zeros(hidden, hidden) for n in "qkvo"}
        shard |= {f"{p}mlp.{n}_proj.weight": torch.zeros(ffn, hidden) for n in ("gate", "up")}
        shard |= {f"{p}mlp.down_proj.weight": torch.zeros(hidden, ffn), f"{p}input_layernorm.weight": torch.ones(hidden)}
        shard |= {f"{p}post_attention_layernorm.weight": torch.ones(hidden)}
        if i == 0:
            shard |= {n: torch.zeros(256, hidden) for n in ("model.embed_tokens.weight", "lm_head.weight")} | {"model.norm.weight": torch.ones(hidden)}
        name = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, str]:
    folder = wide_checkpoint(tmp_path_factory.mktemp("wide") / "src")
    return folder, digest(folder)


# headfold in a child process that signals itself at an event of its own work, not at a moment a poller
# guesses: "bytes" N, at the shard writer's first store once N bytes are written (0: before any byte, the
# staging folder just made); "staged", as its first output's staging folder appears.
SIGNAL_AT = """
import os, sys
from contextlib import contextmanager
from headfold.cli import main
from headfold.converter import writer
from headfold.ground import atomic

event, value, signum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if event == "bytes":
    store, stored = writer.ShardedWriter._store, [0]
    def counted(self, shard, header, data, last):
        if stored[0] >= value:
            os.kill(os.getpid(), signum)
        store(self, shard, header, data, last)
        stored[0] += len(header or b"") + data.nbytes
    writer.ShardedWriter._store = counted
else:
    staging = atomic.staging_folder
    @contextmanager
    def signalled(*args, **kwargs):
        with staging(*args, **kwargs) as folder:
            os.kill(os.getpid(), signum)
            yield folder
    atomic.staging_folder = signalled
sys.exit(main(sys.argv[4:]))
"""


def signalled_at(event: str, value: int, signum: int, *args, **popen) -> subprocess.Popen:
    """headfold ARGS in a child that sends itself `signum` at `event` (SIGNAL_AT)."""
    command = [sys.executable, "-c", SIGNAL_AT, event, str(int(value)), str(int(signum)), *map(str, args)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)


def convert_args(src: Path, out: Path) -> list:
    return ["convert", src, out, "--kv-heads", "2", "--method", "mean", "-q"]


def open_files() -> list[str]:
    """What this process's file descriptors point at."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used
            pass
    return links


# -- 1. nothing lost -------------------------------------------------------------------------


def test_overwrite_never_deletes_a_shard_the_index_reads_from_outside(src: Path, tmp_path: Path, capsys) -> None:
    """An index entry `../other/…`: `convert SRC other --overwrite` must refuse, not delete."""
    other = tmp_path / "other"
    other.mkdir()
    shutil.move(src / "model.safetensors", other / "w.safetensors")
    with safe_open(other / "w.safetensors", "pt") as f:
        names = list(f.keys())
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, "../other/w.safetensors")}))
    before, theirs = digest(src), digest(other)
    with pytest.raises(BadInput, match=r"contains .*w\.safetensors, read through the index"):
        check_output(other, overwrite=True, sources=(src,))  # the write side holds whatever the reader accepts
    code, err = run_cli(["convert", src, other, "--kv-heads", "2", "--method", "mean", "--overwrite", "-q"], capsys)
    assert code == 2 and "w.safetensors" in err
    one_line(err)
    assert digest(other) == theirs and digest(src) == before and beside(tmp_path) == ["other", "src"]


def test_overwrite_never_deletes_a_symlinked_input(src: Path, tmp_path: Path, capsys) -> None:
    other = tmp_path / "other"
    other.mkdir()
    shutil.move(src / "model.safetensors", other / "model.safetensors")
    (src / "model.safetensors").symlink_to(other / "model.safetensors")
    before, theirs = digest(src), digest(other)
    with pytest.raises(BadInput, match="read through the link"):
        check_output(other, overwrite=True, sources=(src,))
    with pytest.raises(BadInput, match="read through the link"):
        check_output(tmp_path / "other" / "model.safetensors", overwrite=True, sources=(src,))
    code, err = run_cli(["convert", src, other, "--kv-heads", "2", "--method", "mean", "--overwrite", "-q"], capsys)
    assert code == 2
    one_line(err)
    assert digest(other) == theirs and digest(src) == before and beside(tmp_path) == ["other", "src"]


def test_overwrite_never_deletes_the_calibration_text(src: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "text.txt").write_text("calibration text " * 100)
    before = digest(out)
    code, err = run_cli(["convert", src, out, "--kv-heads", "2", "--method", "aligned", "--calibration", out / "text.txt", "--overwrite", "-q"], capsys)
    assert code == 2 and f"contains the source {out / 'text.txt'}" in err
    one_line(err)
    assert digest(out) == before and beside(tmp_path) == ["out", "src"]


def test_overwrite_replaces_only_what_headfold_wrote(src: Path, tmp_path: Path, capsys) -> None:
    """`--overwrite` with a folder of the user's as OUT (a typo, `~`): refused, untouched; an empty
    folder and headfold's own outputs (convert's, export's) are replaced."""
    mine = tmp_path / "mine"
    (mine / "photos").mkdir(parents=True)
    (mine / "photos" / "a.jpg").write_bytes(b"not a checkpoint")
    before = digest(mine)
    for command in (["convert", src, mine, "--kv-heads", "2", "--method", "mean"], ["export", src, mine]):
        code, err = run_cli([*command, "--overwrite", "-q"], capsys)
        assert code == 2 and "headfold did not write" in err and "--overwrite never replaces" in err, err
        one_line(err)
        assert digest(mine) == before and beside(tmp_path) == ["mine", "src"]
    with pytest.raises(BadInput, match="headfold did not write"):
        with atomic_output(mine, overwrite=True):  # one that appears while a command runs is refused too
            pass
    empty, converted = tmp_path / "empty", tmp_path / "converted"
    empty.mkdir()
    for out in (empty, converted, converted):  # empty; then new; then headfold's own convert output
        code, err = run_cli(["convert", src, out, "--kv-heads", "2", "--method", "mean", "--overwrite", "-q"], capsys)
        assert code == 0 and (out / "headfold.json").is_file(), err
    assert digest(mine) == before


def test_run_refuses_a_folder_it_did_not_make(tmp_path: Path, capsys) -> None:
    out = tmp_path / "mine"
    (out / "convert").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "convert" / "keep.txt").write_text("also mine")
    before = digest(out)
    code, err = run_cli(["run", default_model_path(), out, "--kv-heads", "4"], capsys)
    assert code == 2 and "not a headfold run folder" in err and "--overwrite" in err
    one_line(err)
    code, err = run_cli(["run", default_model_path(), out, "--kv-heads", "4", "--overwrite"], capsys)
    assert code == 2 and f"{out / 'convert'} exists but headfold run did not write it" in err
    one_line(err)
    assert digest(out) == before and beside(tmp_path) == ["mine"]


def test_failed_first_run_leaves_nothing(tmp_path: Path, capsys) -> None:
    code, err = run_cli(["run", default_model_path(), tmp_path / "run", "--kv-heads", "3"], capsys)
    assert code == 2 and "--kv-heads 3 is impossible" in err
    one_line(err)
    assert beside(tmp_path) == []


@pytest.mark.slow
def test_run_keeps_user_files_and_reruns_a_corrupted_stage(tmp_path: Path, capsys) -> None:
    """--overwrite into a folder of the user's: the run adds its stage folders, the user's file
    stays; a stored artifact changed afterwards reruns its stage (saying why), never a stale PASS."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    small = ["--max-rows", "4", "--window", "64", "--decode-steps", "2"]
    loose = ["--max-kl", "10", "--max-ppl-increase", "10", "--min-top1", "0"]  # the gates are not the point here
    args = ["run", default_model_path(), out, "--kv-heads", "4", "--method", "mean", *small, *loose]
    assert main([str(a) for a in args + ["--overwrite"]]) == 0
    assert (out / "notes.txt").read_text() == "mine" and json.loads((out / "stages.json").read_text())["format"] == 1
    capsys.readouterr()

    assert main([str(a) for a in args]) == 0  # now its own run folder: no --overwrite needed
    skipped = [re.sub(r"^\[\d+/\d+\] ", "", line).split(":")[0] for line in capsys.readouterr().err.splitlines() if "unchanged, skipped" in line]
    assert skipped == ["convert", "export", "verify"]

    report = out / "verify" / "report.json"
    stored = json.loads(report.read_text())
    report.write_text(json.dumps({**stored, "checks": []}))  # a tampered report must not be reprinted
    shard = out / "convert" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main([str(a) for a in args]) == 0
    log = capsys.readouterr().err  # progress lines: stderr
    assert f"convert: its output {out / 'convert'} changed since it was written" in log
    assert f"verify: its output {out / 'verify'} changed since it was written" in log
    assert "export: unchanged, skipped" in log  # the reconverted checkpoint is byte-identical
    measured = [(c["name"], c["passed"], c["metrics"]) for c in json.loads(report.read_text())["checks"]]
    assert measured == [(c["name"], c["passed"], c["metrics"]) for c in stored["checks"]]  # measured again, the same
    assert (out / "notes.txt").read_text() == "mine"
    assert beside(tmp_path) == ["run"] and not [p for p in out.iterdir() if p.name.startswith(".")]


# -- 2. one writer wins ----------------------------------------------------------------------


def test_a_held_lock_names_its_writer(src: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    before = digest(src)
    with output_lock(out):  # another process's lock, as flock sees it: a second open file
        code, err = run_cli(["convert", src, out, "--kv-heads", "2", "--method", "mean", "-q"], capsys)
        assert code == 2 and f"being written by another headfold process (pid {os.getpid()})" in err
        one_line(err)
        code, err = run_cli(["run", src, out, "--kv-heads", "2"], capsys)
        assert code == 2 and f"(pid {os.getpid()})" in err
    assert beside(tmp_path) == ["src"] and digest(src) == before


def test_dead_writers_leftovers_are_removed_and_said(src: Path, tmp_path: Path, caplog) -> None:
    out = tmp_path / "out"
    for leftover in (".out.partial-999999", ".out.old-999998"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "junk").write_text("x")
    (tmp_path / ".out.lock").write_text("999999\n")  # kill -9 leaves the lock file; its flock died with it
    with caplog.at_level(logging.WARNING, logger="headfold"):
        assert main(["convert", str(src), str(out), "--kv-heads", "2", "--method", "mean", "-q"]) == 0
    removed = [r.getMessage() for r in caplog.records if "left by writer pid" in r.getMessage()]
    assert len(removed) == 2 and any(".out.partial-999999" in m for m in removed)
    assert beside(tmp_path) == ["out", "src"]


def test_final_rename_never_replaces_without_overwrite(tmp_path: Path) -> None:
    """Another writer that finished while this one worked: this one refuses, its temp vanishes."""
    out = tmp_path / "out"
    with pytest.raises(BadInput, match="appeared while this command ran; pass --overwrite"):
        with atomic_output(out) as tmp:
            (tmp / "a").write_text("late")
            out.mkdir()  # what a writer that skipped the lock would do meanwhile
            (out / "theirs").write_text("first")
    assert (out / "theirs").read_text() == "first" and beside(tmp_path) == ["out"]


def test_a_failed_write_leaves_no_parent_it_made(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), atomic_output(tmp_path / "a" / "b" / "out") as tmp:
        (tmp / "x").write_text("x")
        raise RuntimeError
    assert beside(tmp_path) == []


@pytest.mark.slow
def test_concurrent_writers_exactly_one_wins(wide, tmp_path: Path) -> None:
    src, before = wide
    out = tmp_path / "out"
    procs = [subprocess.Popen([HEADFOLD, *convert_args(src, out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [(p.pid, p.wait(), p.stderr.read().strip()) for p in procs]
    winners = [pid for pid, code, _ in results if code == 0]
    assert len(winners) == 1, results
    for pid, code, err in results:
        if pid != winners[0]:
            assert code == 2 and (f"being written by another headfold process (pid {winners[0]})" in err or "already exists" in err), err
            one_line(err)
    assert beside(tmp_path) == ["out"] and digest(src) == before


@pytest.mark.slow
def test_kill_9_mid_write_then_the_next_run_cleans_up(wide, tmp_path: Path, tmp_path_factory) -> None:
    """kill -9 as the hidden folder appears, after its first bytes, and half-way through; each next
    writer removes the dead one's folder and says so; the last convert succeeds with nothing left."""
    src, before = wide
    out = tmp_path / "out"
    total = sum(f.stat().st_size for f in src.glob("*.safetensors")) * 0.85  # kv heads halve K and V
    # the killed writers' scratch folders stay in a TMPDIR of their own, not where other tests' commands would report them
    own_tmp = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("killed-scratch"))}
    dead: list[int] = []
    for moment in (0, 1, total / 2):
        proc = signalled_at("bytes", moment, signal.SIGKILL, *convert_args(src, out), env=own_tmp)
        assert proc.wait() == -signal.SIGKILL, f"the conversion finished before {moment} bytes were written: make the checkpoint wider"
        if dead:
            assert f".out.partial-{dead[-1]}, left by writer pid {dead[-1]}" in proc.stderr.read()
        dead.append(proc.pid)
        assert beside(tmp_path) == [".out.lock", f".out.partial-{proc.pid}"]  # the lock file, its flock died with it
    again = subprocess.run([HEADFOLD, *convert_args(src, out)], capture_output=True, text=True, env=own_tmp)
    assert again.returncode == 0, again.stderr
    assert f".out.partial-{dead[-1]}, left by writer pid {dead[-1]}" in again.stderr
    assert beside(tmp_path) == ["out"] and digest(src) == before
    manifest = json.loads((out / "headfold.json").read_text())
    assert all(hashlib.sha256((out / name).read_bytes()).hexdigest() == sha for name, sha in manifest["files"].items())


@pytest.mark.slow
@pytest.mark.parametrize("command", ["convert", "export"])
def test_sigterm_cleans_up_and_exits_143(command: str, wide, tiny_checkpoint, tmp_path: Path) -> None:
    src = wide[0] if command == "convert" else tiny_checkpoint("llama")
    before = digest(src)
    out = tmp_path / "out"
    extra = ["--kv-heads", "2", "--method", "mean"] if command == "convert" else []
    proc = signalled_at("staged", 0, signal.SIGTERM, command, src, out, "-q", *extra)
    assert proc.wait() == 143
    assert proc.stderr.read().strip() == "headfold: terminated (SIGTERM); removing partial outputs"
    assert beside(tmp_path) == [] and digest(src) == before


@pytest.mark.slow
def test_demo_leaves_no_temp_folder_on_sigterm(tmp_path: Path) -> None:
    proc = signalled_at("staged", 0, signal.SIGTERM, "demo", env={**os.environ, "TMPDIR": str(tmp_path)})  # as its convert stage stages OUT
    assert proc.wait() == 143
    assert "terminated (SIGTERM)" in proc.stderr.read()
    # onnxruntime 1.32 writes its telemetry session id to $TMPDIR/.ses at its first session: not ours
    assert not list(tmp_path.glob("headfold-*")) and [p.name for p in tmp_path.glob(".*")] in ([], [".ses"])


def test_scratch_folders_of_dead_processes_are_removed(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    (tmp_path / "headfold-demo-999999-0").mkdir()
    (tmp_path / f"headfold-demo-{os.getpid()}-99").mkdir()  # a live process's: kept
    with caplog.at_level(logging.WARNING, logger="headfold"):
        with pytest.raises(RuntimeError), scratch_dir("headfold-demo") as tmp:
            (tmp / "x").write_text("x")
            raise RuntimeError
    assert beside(tmp_path) == [f"headfold-demo-{os.getpid()}-99"]
    assert "left by pid 999999, which no longer runs" in caplog.text


# -- the disk and the mount table --------------------------------------------------------------


def test_disk_full_is_one_line_and_leaves_nothing(wide, tmpfs, capsys) -> None:
    src, before = wide
    disk = tmpfs("size=8m")
    code, err = run_cli(["convert", src, disk / "out", "--kv-heads", "2", "--method", "mean", "-q"], capsys)
    assert code == 2 and "no space left on the device while writing" in err
    one_line(err)
    assert beside(disk) == [] and digest(src) == before
    assert not [f for f in open_files() if f.startswith(str(disk))]  # a deleted file held open still fills the disk


def test_failing_final_rename_is_one_line_and_leaves_nothing(src: Path, tmp_path: Path, tmpfs, capsys) -> None:
    out = tmpfs("size=1m", tmp_path / "out")  # a mount point cannot be renamed away: EBUSY
    (out / "headfold.json").write_text('{"created_by": "headfold 0.1.0"}')  # an earlier output of headfold's, which --overwrite may replace
    before = digest(src)
    code, err = run_cli(["convert", src, out, "--kv-heads", "2", "--method", "mean", "--overwrite", "-q"], capsys)
    assert code == 2 and "cannot move the finished output into place" in err and "mount point" in err
    one_line(err)
    assert beside(tmp_path) == ["out", "src"] and beside(out) == ["headfold.json"] and digest(src) == before


# -- every command's outputs (issue 23): one policy, whatever the command -----------------------


@pytest.fixture(scope="module")
def world(tiny_checkpoint, tiny_export, tmp_path_factory) -> World:
    return make_world(tmp_path_factory.mktemp("world"), tiny_checkpoint, tiny_export)


SMALL_VERIFY = ["--max-rows", "2", "--window", "8", "--decode-steps", "0"]
# command → (arguments writing to OUT, whether OUT is a folder, the input file OUT must never replace)
WRITERS: dict[str, tuple] = {
    "convert": (lambda w, out: ["convert", w.src, out, "--kv-heads", "2", "--method", "mean", "-q"], True, lambda w: w.src / "config.json"),
    "convert-onnx": (lambda w, out: ["convert", w.graph, out, "--kv-heads", "2"], False, lambda w: w.graph),
    "export": (lambda w, out: ["export", w.src, out, "-q"], True, lambda w: w.src / "model.safetensors"),
    "build --json": (lambda w, out: ["build", w.export, w.root / "engines", "--dry-run", "--trt-version", "10.15", "--json", out], False, lambda w: w.graph),
    "verify --report": (lambda w, out: ["verify", w.src, w.src, *SMALL_VERIFY, "--report", out], False, lambda w: w.src / "config.json"),
    "verify --markdown": (
        lambda w, out: ["verify", w.export, w.export, *SMALL_VERIFY, "--markdown", out],
        False,
        lambda w: w.graph.with_name("prefill.onnx.data"),
    ),
    "inspect --heatmap": (lambda w, out: ["inspect", w.src, "--calibration", "weights", "--heatmap", out, "-q"], False, lambda w: w.src / "model.safetensors"),
    "distill": (
        lambda w, out: ["distill", w.src, w.student, out, "--data", w.text, "--seq-len", "32", "--batch-size", "1", "--steps", "1", "-q"],
        True,
        lambda w: w.text,
    ),
    "run": (lambda w, out: ["run", w.src, out, "--kv-heads", "2"], True, lambda w: w.src / "config.json"),
}


def _plant(kind: str, w: World, out: Path, is_dir: bool, victim: Path) -> tuple[Path, list[str], tuple[str, ...]]:
    """Set the scene at OUT for `kind`; (the OUT to pass, extra options, words the refusal names)."""
    if kind == "an input":
        return victim, ["--overwrite"], ("source",)
    if kind == "a dangling link":
        out.symlink_to(w.root / "elsewhere")
        return out, ["--overwrite"], ("symbolic link",)
    if kind == "a link to an input":
        out.symlink_to(victim)
        return out, ["--overwrite"], ("symbolic link",)
    if kind == "the user's, with --overwrite":
        (out.mkdir() or (out / "notes.txt").write_text("mine")) if is_dir else out.write_text("mine")
        return out, ["--overwrite"], ("did not write",)
    if kind == "existing, without --overwrite":
        (out.mkdir() or (out / "notes.txt").write_text("mine")) if is_dir else out.write_text("mine")
        return out, [], ("exists", "--overwrite")
    if kind == "the other kind":
        out.write_text("a file") if is_dir else out.mkdir()
        return out, ["--overwrite"], ("is a file" if is_dir else "is a folder",)
    if kind == "a planted lock link":
        out.with_name(f".{out.name}.lock").symlink_to(victim)
        return out, [], ("lock", "symbolic link")
    raise AssertionError(kind)


OUTPUT_KINDS = (
    "an input",
    "a dangling link",
    "a link to an input",
    "the user's, with --overwrite",
    "existing, without --overwrite",
    "the other kind",
    "a planted lock link",
)


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
@pytest.mark.parametrize("command", WRITERS)
def test_every_output_keeps_the_contract(command: str, kind: str, world: World, tmp_path: Path, capsys) -> None:
    """Exit 2, one line naming why, nothing written at or beside OUT, no input changed."""
    make_args, is_dir, victim_of = WRITERS[command]
    if command == "run" and kind == "the user's, with --overwrite":
        pytest.skip("run adds its stage folders to a folder of the user's (test_run_keeps_user_files_…)")
    name = "out.onnx" if command == "convert-onnx" else "out.json" if not is_dir else "out"
    out, extra, words = _plant(kind, world, tmp_path / name, is_dir, victim_of(world))
    before, inputs, scene = entries(out.parent), world.digests(), digest(out) if out.exists() and not out.is_symlink() else None
    code, err = cli(capsys, *make_args(world, out), *extra)
    assert_one_line(code, err, 2, *words)
    assert entries(out.parent) == before and world.digests() == inputs
    assert scene is None or digest(out) == scene
    assert not (world.root / "elsewhere").exists()


@pytest.mark.parametrize("record", ["headfold.json", "export.json", "stages.json", "report.json", "model.engine.json"])
@pytest.mark.parametrize("marked", [False, True])
def test_a_folder_is_headfolds_by_its_records_mark_not_their_names(record: str, marked: bool, world: World, tmp_path: Path, capsys) -> None:
    """A folder holding a file named like one of headfold's records is the user's unless the record carries
    headfold's mark: --overwrite refuses it, untouched; with the mark it is replaced."""
    out = tmp_path / "out"
    out.mkdir()
    (out / record).write_text(json.dumps({"created_by": "headfold 0.1.0"} if marked else {"checks": [], "format": 1}))
    (out / "notes.txt").write_text("mine")
    before = digest(out)
    code, err = cli(capsys, "convert", world.src, out, "--kv-heads", "2", "--method", "mean", "--overwrite", "-q")
    if marked:
        assert code == 0 and (out / "headfold.json").is_file() and not (out / "notes.txt").exists(), err
    else:
        assert_one_line(code, err, 2, "headfold did not write", "mark")
        assert digest(out) == before and entries(tmp_path) == ["out"]


DANGLING: dict[str, Callable[[World, Path], list]] = {  # the other output options, beside WRITERS' OUTs: each writes `link`
    "convert --json": lambda w, link: ["convert", w.src, link.with_name("out"), "--kv-heads", "2", "--method", "mean", "-q", "--json", link],
    "inspect --json": lambda w, link: ["inspect", w.src, "--calibration", "weights", "--json", link, "-q"],
    "verify --junit": lambda w, link: ["verify", w.src, w.src, *SMALL_VERIFY, "--junit", link],
    "demo --keep": lambda w, link: ["demo", "--no-distill", "--keep", link],
    "distill's state": lambda w, link: ["distill", w.src, w.student, link.with_name("out"), "--data", w.text, "--seq-len", "32", "--steps", "1", "-q"],
}


@pytest.mark.parametrize("command", DANGLING)
def test_a_dangling_link_is_refused_and_left_as_it_was(command: str, world: World, tmp_path: Path, capsys) -> None:
    """An output path that is a dangling link: the user's, so refused and kept (headfold deletes nothing it
    did not write), and nothing of headfold's beside it (lock, partial folder, the command's OUT)."""
    link = tmp_path / (".out.distill-state" if command == "distill's state" else "link")
    link.symlink_to(tmp_path / "nowhere" / "x")
    code, err = cli(capsys, *DANGLING[command](world, link))
    assert_one_line(code, err, 2, "symbolic link")
    assert entries(tmp_path) == [link.name] and os.readlink(link) == str(tmp_path / "nowhere" / "x")


SMALL_RUN = ["--max-rows", "2", "--window", "8", "--decode-steps", "0"]
# command → (its arguments writing OUT under the test's folder, the paths a --json FILE must not take: OUT, a path inside it, its other files)
JSON_CLASHES: dict[str, tuple[Callable[[World, Path], list], Callable[[Path], list[Path]]]] = {
    "convert": (lambda w, d: ["convert", w.src, d / "out", "--kv-heads", "2", "--method", "mean", "-q"], lambda d: [d / "out", d / "out" / "r.json"]),
    "convert-onnx": (lambda w, d: ["convert", w.graph, d / "out.onnx", "--kv-heads", "2"], lambda d: [d / "out.onnx", d / "out.onnx.data"]),
    "export": (lambda w, d: ["export", w.src, d / "out", "-q"], lambda d: [d / "out", d / "out" / "r.json"]),
    "build a folder": (
        lambda w, d: ["build", w.export, d / "out", "--dry-run", "--trt-version", "10.15"],
        lambda d: [d / "out", d / "out" / "prefill.engine.json"],
    ),
    "build one engine": (
        lambda w, d: ["build", w.graph, d / "out.engine", "--dry-run", "--trt-version", "10.15"],
        lambda d: [d / "out.engine", d / "out.engine.json"],
    ),
    "distill": (
        lambda w, d: ["distill", w.src, w.student, d / "out", "--data", w.text, "--seq-len", "32", "--batch-size", "1", "--steps", "1", "-q"],
        lambda d: [d / "out", d / "out" / "r.json", d / ".out.distill-state" / "r.json"],
    ),
    "run": (
        lambda w, d: ["run", w.src, d / "out", "--kv-heads", "2", "--method", "mean", *SMALL_RUN],
        lambda d: [d / "out", d / "out" / "r.json", d / "out" / "verify" / "r.json"],
    ),
    "demo --keep": (lambda w, d: ["demo", "--no-distill", "--keep", d / "out"], lambda d: [d / "out", d / "out" / "r.json"]),
    "inspect --heatmap": (lambda w, d: ["inspect", w.src, "--calibration", "weights", "--heatmap", d / "out.png", "-q"], lambda d: [d / "out.png"]),
    "verify --markdown": (lambda w, d: ["verify", w.src, w.src, *SMALL_RUN, "--markdown", d / "out.md"], lambda d: [d / "out.md"]),
}


@pytest.mark.parametrize("command, clash", [(command, i) for command, (_, clashes) in JSON_CLASHES.items() for i in range(len(clashes(Path())))])
def test_json_file_never_names_the_commands_own_output(command: str, clash: int, world: World, tmp_path: Path, capsys) -> None:
    """--json FILE that is OUT, lies inside it or is another file of the command's: refused before any
    work, in one line, nothing written (neither OUT nor the JSON), no input changed."""
    make_args, clashes = JSON_CLASHES[command]
    inputs = world.digests()
    code, err = cli(capsys, *make_args(world, tmp_path), "--json", clashes(tmp_path)[clash])
    assert_one_line(code, err, 2, "same path" if clash == 0 or command in ("convert-onnx", "build one engine") else "lies inside")
    assert entries(tmp_path) == [] and world.digests() == inputs


def test_convert_onnx_never_replaces_the_sources_external_data(world: World, tmp_path: Path, capsys) -> None:
    """convert X.onnx Y.onnx where Y.onnx.data is X's own weights file: refused, even with --overwrite."""
    graph = tmp_path / "x.onnx"
    shutil.copy(world.graph, graph)
    shutil.copy(world.graph.with_name("prefill.onnx.data"), tmp_path / "y.onnx.data")
    model = onnx.load(graph, load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "y.onnx.data"
    onnx.save(model, graph)
    before = digest(tmp_path)
    for extra in ([], ["--overwrite"]):
        code, err = cli(capsys, "convert", graph, tmp_path / "y.onnx", "--kv-heads", "2", *extra)
        assert_one_line(code, err, 2, "y.onnx.data")
        assert digest(tmp_path) == before


def test_all_reports_appear_together_or_none(world: World, tmp_path: Path, capsys, monkeypatch) -> None:
    """verify's --report, --markdown and --junit: a failure while writing the last leaves none of them;
    again with --overwrite replaces headfold's own reports (their mark, not their names, says so)."""
    from headfold.verification.report import Report

    reports = {"--report": tmp_path / "r.json", "--markdown": tmp_path / "r.md", "--junit": tmp_path / "j.xml"}
    args = [
        "verify",
        world.src,
        world.src,
        *SMALL_VERIFY,
        "-q",
        *(a for option, path in reports.items() for a in (option, path)),
    ]  # -q: no progress bar before the line
    monkeypatch.setattr(Report, "junit", lambda self: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    code, err = cli(capsys, *args)
    assert_one_line(code, err, 2, "no space left")
    assert entries(tmp_path) == []
    monkeypatch.undo()
    assert cli(capsys, *args)[0] == 0 and entries(tmp_path) == ["j.xml", "r.json", "r.md"]
    first = {p: p.read_bytes() for p in reports.values()}
    assert cli(capsys, *args, "--overwrite")[0] == 0 and entries(tmp_path) == ["j.xml", "r.json", "r.md"]
    assert all(p.read_bytes() != b"" for p in first)
    reports["--markdown"].write_text("## my notes, written by hand\n")  # the user's now: --overwrite refuses all three
    code, err = cli(capsys, *args, "--overwrite")
    assert_one_line(code, err, 2, "r.md", "did not write")
    assert reports["--markdown"].read_text() == "## my notes, written by hand\n"


def test_a_stale_distill_state_never_blocks_a_fresh_run(tmp_path: Path, caplog) -> None:
    """Found under its lock, a state folder's writer is gone: without --resume it is removed, and said."""
    from headfold.distillation import state

    folder = tmp_path / ".out.distill-state"
    (folder / "step-000004").mkdir(parents=True)
    (folder / "run.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="headfold"), state.claimed(folder, resume=False, keep=False):
        assert not folder.exists()
    assert f"removed {folder}, the state of an earlier run that stopped at step-000004" in caplog.text
    assert entries(tmp_path) == []


def test_names_from_paths_are_printed_escaped(world: World, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out\x1b]0;pwned\x07\x1b[2J"
    assert main(["convert", str(world.src), str(out), "--kv-heads", "2", "--method", "mean", "-q"]) == 0
    printed = capsys.readouterr().out
    assert "out\\x1b]0;pwned\\x07\\x1b[2J" in printed and "\x1b" not in printed and "\x07" not in printed


def test_a_lock_that_is_a_hard_link_is_refused(world: World, tmp_path: Path, capsys) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.link(victim, tmp_path / ".out.lock")
    code, err = cli(capsys, "convert", world.src, tmp_path / "out", "--kv-heads", "2", "--method", "mean", "-q")
    assert_one_line(code, err, 2, "lock", "hard link")
    assert victim.read_text() == "precious" and entries(tmp_path) == [".out.lock", "victim.txt"]


# -- pipes and signals (issue 23) --------------------------------------------------------------

CLOSED_STDOUT = """
import json, os, sys
from headfold.cli import main
results = []
for args in json.loads(sys.argv[1]):
    read, write = os.pipe()
    os.close(read)  # the reader left: `headfold … | head` after head exited
    os.dup2(write, 1)
    os.close(write)
    err = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    saved = os.dup(2)
    os.dup2(err, 2)
    code = main(args)
    sys.stderr.flush()
    os.dup2(saved, 2)
    results.append([code, open(sys.argv[2]).read()])
devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(devnull, 1)
sys.stderr.write(json.dumps(results))
"""


@pytest.mark.slow
def test_a_closed_stdout_is_not_a_failure(world: World, tiny_checkpoint, tiny_export, tmp_path: Path) -> None:
    """Every command with its stdout closed (`| head`, `| true`): its own verdict stands (0 done, 1 a
    gate failed, 2 bad input), no traceback, no extra line."""
    checkpoint, export = tiny_export("llama")
    small = ["--max-rows", "2", "--window", "8", "--decode-steps", "0"]
    cases = [
        (["--help"], 0),
        (["--version"], 0),
        (["convert", "--help"], 0),
        (["convert", world.src, tmp_path / "c", "--kv-heads", "2", "--method", "mean"], 0),
        (["export", tiny_checkpoint("bert"), tmp_path / "e"], 0),  # an encoder: one graph, the fastest export
        # (`run` is left out: its work is convert → export → verify, its printing verify's)
        (["build", export, tmp_path / "engines", "--dry-run", "--trt-version", "10.15"], 0),
        (["verify", world.src, world.src, *small], 0),
        (["verify", checkpoint, export, *small, "--atol", "0", "--rtol", "0"], 1),  # torch vs ONNX Runtime: not bit-equal
        (["inspect", world.src, "--calibration", "weights"], 0),
        (["distill", world.src, world.student, tmp_path / "d", "--data", world.text, "--seq-len", "32", "--batch-size", "1", "--steps", "1"], 0),
        (["convert", world.src, tmp_path / "c", "--kv-heads", "2", "--method", "mean"], 2),
    ]
    argv = [[str(a) for a in args] for args, _ in cases]
    done = subprocess.run([sys.executable, "-c", CLOSED_STDOUT, json.dumps(argv), str(tmp_path / "stderr")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    for (args, expected), (code, err) in zip(cases, json.loads(done.stderr), strict=True):
        assert code == expected, (args, err)
        assert "Traceback" not in err and "Exception ignored" not in err and (expected != 0 or "error" not in err), (args, err)
        assert expected != 2 or len(err.strip().splitlines()) == 1, (args, err)


@pytest.fixture(autouse=True)
def ctrl_c_as_in_a_terminal() -> Iterator[None]:
    """Ctrl-C handled as Python handles it in a terminal, also where the suite was started with SIGINT
    ignored (a background job of a non-interactive shell; the processes a test starts inherit the
    disposition): the signal tests below, in this process and in the ones they start, rely on it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


SIGNALS = """
import json, os, signal, sys
from pathlib import Path
from headfold.cli import main
from headfold.distillation import state, trainer

def once(owner, name, signum):
    # signal this process as owner.name first returns: an event of the run, not a moment
    real = getattr(owner, name)
    def signalled(*args, **kwargs):
        setattr(owner, name, real)
        value = real(*args, **kwargs)
        os.kill(os.getpid(), signum)
        return value
    setattr(owner, name, signalled)

args, folder = json.loads(sys.argv[1]), Path(sys.argv[2])
results = []
once(trainer.Trainer, "step", signal.SIGTERM)  # training: after its first step
try:
    main([*args, "--steps", "100000"])
except SystemExit as stop:
    results.append([stop.code, sorted(os.listdir(folder))])
once(state, "save", signal.SIGINT)  # as its first checkpoint is saved
results.append([main([*args, "--steps", "100000", "--save-every", "1"]), sorted(os.listdir(folder))])
results.append([main([*args, "--steps", "2"]), sorted(os.listdir(folder))])
print(json.dumps(results))
"""


@pytest.mark.slow
def test_distill_stopped_by_a_signal_then_a_fresh_run(world: World, tmp_path: Path) -> None:
    """SIGTERM without --save-every: exit 143, nothing left. SIGINT with --save-every: exit 130, the
    checkpoint kept for --resume. Then a fresh run (no --resume) removes that stale state, says so,
    and writes OUT; nothing else stays beside it. (One process, signalling itself, for speed.)"""
    # --lr: without it a 100000-step run would first spend 10 % of its compute choosing one (headfold/distillation/rate.py)
    args = ["distill", world.src, world.student, tmp_path / "out", "--data", world.text, "--seq-len", "32", "--batch-size", "1", "--lr", "1e-3", "-q"]
    done = subprocess.run(  # a signal that did not stop the command fails the test here rather than hanging the suite
        [sys.executable, "-c", SIGNALS, json.dumps([str(a) for a in args]), str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (terminated, after_term), (interrupted, after_int), (fresh, after_fresh) = json.loads(done.stdout.splitlines()[-1])
    assert (terminated, after_term) == (143, [])
    assert (interrupted, after_int) == (130, [".out.distill-state"])
    assert (fresh, after_fresh) == (0, ["out"]) and (tmp_path / "out" / "headfold.json").is_file()
    assert "headfold: terminated (SIGTERM); removing partial outputs" in done.stderr and "headfold: aborted" in done.stderr
    assert f"removed {tmp_path / '.out.distill-state'}, the state of an earlier run that stopped at step-" in done.stderr


def test_build_places_engines_sidecars_and_timing_cache_by_the_policy(world: World, tmp_path: Path, monkeypatch) -> None:
    """headfold's placement around TensorRT, with TensorRT's part replaced by bytes (what TensorRT builds
    is tested on a GPU in test_gpu_engines.py): an engine and its sidecar appear together or not at
    all, the timing cache is replaced after a build, never when the build fails."""
    from headfold.engines import build as builder
    from headfold.engines.env import Target
    from headfold.engines.plan import make_plan
    from headfold.engines.sidecar import load_sidecar, make_sidecar

    def fake_build(plan, graph, dest, *, require_fused):
        dest.write_bytes(b"engine of " + graph.onnx.name.encode())
        if plan.timing_cache is not None:
            plan.timing_cache.write_bytes(b"tactics")
        if require_fused:
            raise CheckFailed("attention is unfused")
        return make_sidecar(plan, graph, gpu={"name": "none"}, attention={"verdict": "fused"}, seconds=0.0)

    monkeypatch.setattr(builder, "build_graph", fake_build)
    monkeypatch.setattr(builder, "_quiet_polygraphy", lambda: None)
    cache, engine = tmp_path / "timing.cache", tmp_path / "prefill.engine"
    cache.write_bytes(b"old tactics")
    plan = make_plan(world.graph, engine, Target.assumed("10.15"), timing_cache=cache)
    with pytest.raises(CheckFailed):
        builder.build(plan, require_fused_attention=True)
    assert entries(tmp_path) == ["timing.cache"] and cache.read_bytes() == b"old tactics"
    builder.build(plan)
    assert entries(tmp_path) == ["prefill.engine", "prefill.engine.json", "timing.cache"] and cache.read_bytes() == b"tactics"
    assert load_sidecar(engine).timing_cache == str(cache)
    with pytest.raises(BadInput, match="already exists"):
        builder.build(plan)
    builder.build(plan, overwrite=True)  # its own engine and sidecar: replaced
    folder = make_plan(world.export, tmp_path / "engines", Target.assumed("10.15"))
    builder.build(folder)
    assert entries(tmp_path / "engines") == ["decode.engine", "decode.engine.json", "prefill.engine", "prefill.engine.json"]


class _SwallowsASignal:
    """A library object whose __del__ a signal lands in: Python prints and drops an exception raised there
    ("Exception ignored in …"), so the handler's KeyboardInterrupt or Terminated never unwinds anything."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)  # the handler runs before kill returns to this frame


@pytest.mark.parametrize(
    "signal_name, lands, save_every",
    [
        ("SIGINT", "in a library's __del__", ["--save-every", "1"]),
        ("SIGTERM", "in a library's __del__", []),
        ("SIGINT", "where it unwinds", []),
        ("SIGTERM", "where it unwinds", ["--save-every", "1"]),
    ],
)
def test_a_signal_while_the_models_load(signal_name: str, lands: str, save_every: list, world: World, tmp_path: Path, monkeypatch, capsys) -> None:
    """Ctrl-C or SIGTERM before the first training step: exit 130 / 143 and nothing left (no OUT, no state
    without a checkpoint, no lock), also when the signal's exception lands where Python drops it (it once
    ran on to exit 0 with OUT written, the state left); then a fresh run, without --resume, succeeds."""
    from headfold.distillation import trainer

    signum = getattr(signal, signal_name)
    original = trainer.Trainer.__init__

    def loading(self, *args, **kwargs):
        if lands == "where it unwinds":
            os.kill(os.getpid(), signum)
        else:
            _SwallowsASignal(signum)  # collected at once: the signal lands in its __del__
        original(self, *args, **kwargs)

    args = [
        "distill",
        world.src,
        world.student,
        tmp_path / "out",
        "--data",
        world.text,
        "--seq-len",
        "32",
        "--batch-size",
        "1",
        "--steps",
        "2",
        *save_every,
        "-q",
    ]
    monkeypatch.setattr(trainer.Trainer, "__init__", loading)
    if signal_name == "SIGINT":
        assert cli(capsys, *args)[0] == 130
    else:
        with pytest.raises(SystemExit) as stopped:
            cli(capsys, *args)
        assert stopped.value.code == 143
    assert entries(tmp_path) == [] and "Exception ignored" not in capsys.readouterr().err
    monkeypatch.setattr(trainer.Trainer, "__init__", original)
    code, err = cli(capsys, *args)
    assert code == 0 and entries(tmp_path) == ["out"], err
