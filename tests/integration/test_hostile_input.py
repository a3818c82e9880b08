"""Hostile and careless input, the reading side (issue 10): nothing executed, nothing read outside
the source, validated not assumed, one line always.

Every refusal asserts the exit code, one stderr line without a traceback, nothing at or beside OUT
(hidden folders included) and the source unchanged; the code-execution cases also assert that the
marker file the checkpoint's own code would write does not exist.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.hostile import World, assert_one_line, entries, make_world
from support.tiny_models import make_checkpoint

import headfold.converter.conversion as conversion
from headfold import convert, corpus
from headfold.cli import main
from headfold.engines import env
from headfold.ground.errors import BadInput

LAYER0 = "model.layers.0.self_attn."
HEADFOLD = Path(sys.executable).with_name("headfold")


# ---- helpers ----------------------------------------------------------------------------------


def tree_digest(folder: Path) -> str:
    """Names, bytes and link targets of everything under `folder`."""
    digest = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        digest.update(p.relative_to(folder).as_posix().encode())
        if p.is_symlink():
            digest.update(os.readlink(p).encode())
        elif p.is_file():
            digest.update(p.read_bytes())
    return digest.hexdigest()


def run(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def assert_nothing_written(out: Path) -> None:
    """Neither OUT nor a hidden sibling of it (listing the parent: OUT's own name may be too long to stat)."""
    names = os.listdir(out.parent) if out.parent.is_dir() else []
    assert not [n for n in names if n == out.name or n.startswith(f".{out.name}")], names


def refused(capsys, src: Path, out: Path, args: list, *words: str) -> None:
    """Run headfold with `args`; assert exit 2, one line with `words`, nothing written, `src` unchanged."""
    before = tree_digest(src)
    code, err = run(capsys, *args)
    assert_one_line(code, err, 2, *words)
    assert_nothing_written(out)
    assert tree_digest(src) == before


@pytest.fixture
def src(tiny_checkpoint, tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    return folder


def edit_tensors(src: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


def edit_config(src: Path, **changes) -> None:
    path = src / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def ascii_text(path: Path) -> Path:
    path.write_text(" ".join(f"word{i % 97}." for i in range(1500)))
    return path


def add_gpt2_tokenizer(folder: Path, tokenizer_config: dict | None = None) -> None:
    """A byte-level BPE vocabulary (vocab.json + merges.txt, GPT-2's files) for printable ASCII, space and newline."""
    vocab = {chr(c): c - 33 for c in range(33, 127)} | {"Ġ": 94, "Ċ": 95}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def checkpoint_code(folder: Path, marker: Path) -> None:
    """Python a hostile checkpoint ships: loading it would write `marker`."""
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nfrom transformers import PreTrainedTokenizer as EvilTokenizer\n"
    )


# ---- 3. nothing executed ----------------------------------------------------------------------


@pytest.mark.parametrize("tokenizer_class, code", [("EvilTokenizer", 2), ("GPT2Tokenizer", 0)])
@pytest.mark.parametrize("command", ["calibration", "verify"])
def test_checkpoint_code_never_runs(command: str, tokenizer_class: str, code: int, src: Path, tmp_path: Path, capsys) -> None:
    """A tokenizer_config.json with auto_map: transformers' own class or a one-line refusal; never the code, never a prompt."""
    marker = tmp_path / "MARKER"
    add_gpt2_tokenizer(src, {"auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", None]}, "tokenizer_class": tokenizer_class})
    checkpoint_code(src, marker)
    text, out = ascii_text(tmp_path / "text.txt"), tmp_path / "out"
    if command == "calibration":
        args = ["convert", src, out, "--kv-heads", "2", "--method", "aligned", "--calibration", text, "--calibration-tokens", "256", "-q"]
    else:
        args = ["verify", src, src, "--text", text, "--max-rows", "2", "--window", "16", "--decode-steps", "0", "--report", out]
    before = tree_digest(src)
    exit_code, err = run(capsys, *args)
    assert exit_code == code, err
    if code == 2:
        assert_one_line(exit_code, err, 2, "never runs a checkpoint's code")
        assert_nothing_written(out)
    else:
        assert out.exists() and (command == "calibration" or json.loads(out.read_text())["inputs"]["tokenizer"] == "AutoTokenizer(GPT2Tokenizer)")
    assert not marker.exists()
    assert tree_digest(src) == before


def test_pickle_named_by_safetensors_index_is_never_loaded(src: Path, tmp_path: Path, capsys) -> None:
    """Whatever the index says, no torch.load without --allow-pickle: the pickle's payload would write a marker."""
    marker = tmp_path / "MARKER"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    names = list(load_file(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, "pytorch_model.bin")}))
    out = tmp_path / "out"
    refused(capsys, src, out, ["convert", src, out, "--kv-heads", "2", "--method", "mean", "-q"], "pytorch_model.bin", "not a .safetensors file")
    refused(capsys, src, out, ["verify", src, src, "--max-rows", "2", "--window", "8", "--report", out], "pytorch_model.bin")
    assert not marker.exists()


# ---- 3. nothing read outside SRC --------------------------------------------------------------


def _index_to(src: Path, entry: Callable[[Path], str]) -> None:
    """Move the weights out of SRC and point an index entry at them."""
    outside = src.parent / "other"
    outside.mkdir()
    names = list(load_file(src / "model.safetensors"))
    shutil.move(src / "model.safetensors", outside / "model.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, entry(outside))}))


def _link(name: str, target: Callable[[Path], Path]) -> Callable[[Path], None]:
    def make(src: Path) -> None:
        (src / name).symlink_to(target(src))

    return make


def _outside_file(src: Path) -> Path:
    secret = src.parent / "secret.txt"
    secret.write_text("host secret")
    return secret


def _linked_shard(src: Path) -> None:
    shutil.move(src / "model.safetensors", src.parent / "elsewhere.safetensors")
    (src / "model.safetensors").symlink_to(src.parent / "elsewhere.safetensors")


OUTSIDE: dict[str, tuple[Callable[[Path], None], str]] = {
    "index entry with ..": (lambda s: _index_to(s, lambda o: "../other/model.safetensors"), "'../other/model.safetensors'"),
    "absolute index entry": (lambda s: _index_to(s, lambda o: str(o / "model.safetensors")), "other/model.safetensors'"),
    "link to a host file": (_link("notes.txt", _outside_file), "notes.txt links to"),
    "link to /etc": (_link("etc", lambda s: Path("/etc")), "etc links to /etc"),
    "linked shard": (_linked_shard, "model.safetensors links to"),
    "linked tokenizer": (_link("tokenizer.json", _outside_file), "tokenizer.json links to"),
    "FIFO in the folder": (lambda s: os.mkfifo(s / "notes.txt"), "notes.txt is not a regular file"),  # reading it would block
}


@pytest.mark.parametrize("command", ["convert", "verify"])
@pytest.mark.parametrize("case", OUTSIDE)
def test_nothing_read_outside_the_source(case: str, command: str, src: Path, tmp_path: Path, capsys) -> None:
    make, words = OUTSIDE[case]
    make(src)
    out = tmp_path / "out"
    args = (
        ["convert", src, out, "--kv-heads", "2", "--method", "mean", "-q"]
        if command == "convert"
        else ["verify", src, src, "--max-rows", "2", "--window", "8", "--report", out]
    )
    refused(capsys, src, out, args, words)


def test_hugging_face_cache_snapshot_links_are_followed(src: Path, tmp_path: Path, capsys) -> None:
    """A hub cache snapshot links every file to ../../blobs/<hash>: that is still the checkpoint."""
    repo = tmp_path / "models--tiny--llama"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in src.iterdir():
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    assert run(capsys, "convert", src, tmp_path / "direct", "--kv-heads", "2", "--method", "mean", "-q")[0] == 0
    assert run(capsys, "convert", snapshot, tmp_path / "cached", "--kv-heads", "2", "--method", "mean", "-q")[0] == 0
    assert (tmp_path / "cached/model.safetensors").read_bytes() == (tmp_path / "direct/model.safetensors").read_bytes()


# ---- 4. validated, not assumed ----------------------------------------------------------------


def _set(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        tensors[name] = make(tensors[name]).contiguous()

    return edit


def _add(name: str, tensor: torch.Tensor, also: Callable[[dict], None] = lambda t: None) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        also(tensors)
        tensors[name] = tensor

    return edit


TENSORS: dict[str, tuple[Callable[[dict], None], tuple[str, ...]]] = {
    "K projection of the wrong input width": (_set(LAYER0 + "k_proj.weight", lambda t: torch.cat([t, t[:, :1]], 1)), ("k_proj.weight", "expected")),
    "1-D Q projection": (_set(LAYER0 + "q_proj.weight", lambda t: t.reshape(-1)), ("q_proj.weight", "expected")),
    "3-D V projection": (_set(LAYER0 + "v_proj.weight", lambda t: t[None]), ("v_proj.weight", "expected")),
    "integer K projection": (_set(LAYER0 + "k_proj.weight", lambda t: t.to(torch.int8)), ("k_proj.weight", "torch.int8", "floating point")),
    "bool O projection": (_set(LAYER0 + "o_proj.weight", lambda t: t > 0), ("o_proj.weight", "torch.bool")),
    "FP8 with weight_scale": (
        _add(LAYER0 + "k_proj.weight_scale", torch.ones(1), _set(LAYER0 + "k_proj.weight", lambda t: t.to(torch.float8_e4m3fn))),
        ("k_proj.weight_scale", "FP8", "dequantize first"),
    ),
    "FP8 without scales": (_set(LAYER0 + "k_proj.weight", lambda t: t.to(torch.float8_e4m3fn)), ("k_proj.weight", "float8", "dequantize first")),
    "GPTQ qweight": (_add(LAYER0 + "q_proj.qweight", torch.zeros(4, 4, dtype=torch.int32)), ("q_proj.qweight", "GPTQ/AWQ", "dequantize first")),
    "bitsandbytes SCB": (_add(LAYER0 + "q_proj.SCB", torch.ones(4)), ("q_proj.SCB", "bitsandbytes", "dequantize first")),
    "bitsandbytes 4-bit": (
        _add(LAYER0 + "q_proj.weight.quant_state.bitsandbytes__nf4", torch.zeros(8, dtype=torch.uint8)),
        ("quant_state", "dequantize first"),
    ),
    "0-size tensor": (_set("model.norm.weight", lambda t: t[:0]), ("model.norm.weight", "0-size")),
}


@pytest.mark.parametrize("case", TENSORS)
def test_attention_tensors_and_quantization_are_checked(case: str, src: Path, tmp_path: Path, capsys) -> None:
    edit, words = TENSORS[case]
    edit_tensors(src, edit)
    out = tmp_path / "out"
    refused(capsys, src, out, ["convert", src, out, "--kv-heads", "2", "--method", "mean", "-q"], *words)


CONFIGS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "0 hidden size": ({"hidden_size": 0}, ("'hidden_size' must be a positive integer",)),
    "0 heads": ({"num_attention_heads": 0}, ("'num_attention_heads' must be a positive integer",)),
    "0 MLP width": ({"intermediate_size": 0}, ("'intermediate_size'",)),
    "0 positions": ({"max_position_embeddings": 0}, ("'max_position_embeddings'",)),
    "rotary factor above 1": ({"partial_rotary_factor": 1.5}, ("partial_rotary_factor", "(0, 1]")),
    "rotary factor 0": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0}}, ("partial_rotary_factor",)),
    "string rope_parameters": ({"rope_parameters": "linear"}, ("'rope_parameters' must be an object",)),
    "malformed rope_scaling": ({"rope_scaling": {"rope_type": "linear", "factor": "two"}}, ("rope_scaling.factor must be a positive number",)),
    "absurd layer count": ({"num_hidden_layers": 10**9}, ("more than 10000",)),
    "layers not matching the weights": ({"num_hidden_layers": 3}, ("disagree",)),
    "quantization_config": ({"quantization_config": {"quant_method": "fp8"}}, ("quantization_config", "dequantize first")),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_config_values_are_checked_before_allocation(case: str, src: Path, tmp_path: Path, capsys) -> None:
    changes, words = CONFIGS[case]
    edit_config(src, **changes)
    out = tmp_path / "out"
    refused(capsys, src, out, ["convert", src, out, "--kv-heads", "2", "--method", "mean", "-q"], *words)


@pytest.mark.parametrize("case", ["absurd layer count", "string rope_parameters", "quantization_config"])
def test_config_values_are_checked_by_every_loader(case: str, src: Path, tmp_path: Path, capsys) -> None:
    """verify (and export, inspect: the same loader) refuse what convert refuses, before building a model."""
    changes, words = CONFIGS[case]
    edit_config(src, **changes)
    out = tmp_path / "report.json"
    refused(capsys, src, out, ["verify", src, src, "--max-rows", "2", "--window", "8", "--report", out], *words)


def test_absurd_sizes_are_refused_before_a_model_is_built(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    """A converted GPT-2 (headfold's own GQA module) whose config claims 10^10 tokens: refused by the
    reader, naming the key; one that claims 10^6: a shape mismatch against the weights, found on the
    meta device, naming the tensor and the key. Never a MemoryError."""
    converted = tmp_path / "gpt2-kv2"
    assert run(capsys, "convert", tiny_checkpoint("gpt2"), converted, "--kv-heads", "2", "--method", "mean", "-q")[0] == 0
    report = tmp_path / "report.json"
    edit_config(converted, vocab_size=10**10)
    refused(capsys, converted, report, ["verify", converted, converted, "--report", report], "'vocab_size' is 10000000000, more than")
    edit_config(converted, vocab_size=10**6)
    refused(capsys, converted, report, ["verify", converted, converted, "--report", report], "wte.weight", "(vocab_size=1000000) implies [1000000,")


# ---- 5. one line, always ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, words",
    [
        (["convert", "SRC"], ["Missing argument 'OUT'", "headfold convert --help"]),
        (["convert", "SRC", "OUT", "--kv-heads", "2", "--method", "mean", "--bogus"], ["No such option", "--help"]),
        (["export", "SRC", "OUT", "--dtype", "fp64"], ["'fp64' is not one of", "--help"]),
        (["nosuchcommand"], ["No such command", "headfold --help"]),
        (["build", "SRC", "OUT", "--dry-run", "--trt-version", "99.9"], ["known releases are 10.13, 10.14, 10.15, 11.0"]),
    ],
)
def test_usage_errors_fit_one_line(args: list[str], words: list[str], capsys) -> None:
    assert_one_line(*run(capsys, *args), 2, *words)


def test_internal_error_is_one_line_exit_3_and_debug_shows_the_traceback(src: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(conversion, "write_config", bug)
    out = tmp_path / "out"
    code, err = run(capsys, "convert", src, out, "--kv-heads", "2", "--method", "mean", "-q")
    assert_one_line(code, err, 3, "internal error (ZeroDivisionError: a bug)", "rerun with --debug for the traceback")
    assert_nothing_written(out)
    code, err = run(capsys, "--debug", "convert", src, out, "--kv-heads", "2", "--method", "mean", "-q")
    assert code == 3 and "Traceback" in err and "ZeroDivisionError: a bug" in err
    assert_nothing_written(out)


@pytest.mark.parametrize(
    "error, code, words",
    [
        (MemoryError(), 2, "out of memory"),
        (BadInput("first\nsecond"), 2, "first second"),
        (OSError(28, "No space left on device"), 2, "no space left on the device"),
        (RecursionError(), 2, "nests deeper than Python's recursion limit"),
        (BadInput("tensor \x1b]0;pwned\x07 is odd"), 2, "tensor \\x1b]0;pwned\\x07 is odd"),
    ],
)
def test_other_failures_are_one_line(error: Exception, code: int, words: str, src: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Out of memory is the environment (2); a multi-line message still prints as one line; an OS
    error without a file name names the command's output."""

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(conversion, "write_config", fail)
    out = tmp_path / "out"
    assert_one_line(*run(capsys, "convert", src, out, "--kv-heads", "2", "--method", "mean", "-q"), code, words)
    assert_nothing_written(out)


@pytest.mark.parametrize("case", ["/dev/zero", "binary", "huge", "not UTF-8", "empty", "missing"])
@pytest.mark.parametrize("command", ["convert", "verify"])
def test_text_files_that_are_not_text(case: str, command: str, src: Path, tmp_path: Path, capsys) -> None:
    """--calibration (convert) and --text (verify): never read a device or a huge file into memory."""
    path = tmp_path / "text"
    if case == "/dev/zero":
        path = Path("/dev/zero")
    elif case == "binary":
        path.write_bytes(b"some text\x00\x01\x02 and a NUL")
    elif case == "huge":
        with path.open("wb") as f:
            f.truncate(65 << 20)  # sparse: no disk used
    elif case == "not UTF-8":
        path.write_bytes("caf\u00e9".encode("latin-1"))
    elif case == "empty":
        path.write_text("  \n")
    words = {"/dev/zero": "not a regular file", "binary": "binary", "huge": "MiB", "not UTF-8": "not UTF-8", "empty": "empty", "missing": "does not exist"}[
        case
    ]
    out = tmp_path / "out"
    option = "--calibration" if command == "convert" else "--text"
    args = ["convert", src, out, "--kv-heads", "2", "--method", "aligned", "-q"] if command == "convert" else ["verify", src, src, "--report", out]
    add_gpt2_tokenizer(src, {"tokenizer_class": "GPT2Tokenizer"})  # the text, not a missing tokenizer, is what is wrong
    refused(capsys, src, out, [*args, option, path], option, str(path), words)


def test_bad_output_paths(src: Path, tmp_path: Path, capsys) -> None:
    """A name too long for the file system; OUT below a file: one line naming the path, nothing written."""
    too_long = tmp_path / ("x" * 300)
    refused(capsys, src, too_long, ["convert", src, too_long, "--kv-heads", "2", "--method", "mean", "-q"], "too long")
    (tmp_path / "a-file").write_text("not a folder")
    below_file = tmp_path / "a-file" / "out"
    before = tree_digest(src)
    code, err = run(capsys, "convert", src, below_file, "--kv-heads", "2", "--method", "mean", "-q")
    assert_one_line(code, err, 2, "a-file")
    assert (tmp_path / "a-file").read_text() == "not a folder" and tree_digest(src) == before


def test_disk_full_and_read_only_destination(src: Path, tmpfs, capsys) -> None:
    full = tmpfs("size=200k")  # the tiny checkpoint's weights alone are 400 kB
    out = full / "out"
    refused(capsys, src, out, ["convert", src, out, "--kv-heads", "2", "--method", "mean", "-q"], "no space left", str(full))
    assert list(full.iterdir()) == []  # hidden temporary folders included
    read_only = tmpfs("size=1m,ro")
    out = read_only / "out"
    refused(capsys, src, out, ["convert", src, out, "--kv-heads", "2", "--method", "mean", "-q"], "read-only file system", str(read_only))


AS_NOBODY = """
import contextlib, io, json, sys
from headfold.cli import main
results = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv to run headfold as another user")
def test_permission_denied_is_named_as_such(tiny_checkpoint) -> None:
    """As user nobody: an unreadable config.json, shard or output folder is "permission denied",
    never "missing" or safetensors' "No such file"."""
    root = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(root, 0o755)
        cases, outputs = [], []
        for unreadable in ("config.json", "model.safetensors", "outputs"):
            src = shutil.copytree(tiny_checkpoint("llama"), root / f"src-{unreadable}")
            for p in [src, *src.iterdir()]:
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
            parent = root / f"out-{unreadable}"
            parent.mkdir()
            os.chmod(parent, 0o755 if unreadable == "outputs" else 0o777)  # 755 of root: nobody may not write
            if unreadable != "outputs":
                os.chmod(src / unreadable, 0)
            cases.append(["convert", str(src), str(parent / "out"), "--kv-heads", "2", "--method", "mean", "-q"])
            outputs.append(parent)
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", AS_NOBODY, json.dumps(cases)]
        result = subprocess.run(nobody, capture_output=True, text=True, env={**os.environ, "HOME": str(root), "HF_HOME": str(root / "hf")})
        assert result.returncode == 0, result.stderr
        for (code, err), unreadable, parent in zip(json.loads(result.stdout), ("config.json", "model.safetensors", "out-outputs"), outputs, strict=True):
            assert_one_line(code, err, 2, "permission denied", unreadable)
            assert list(parent.iterdir()) == []
    finally:
        shutil.rmtree(root)


def test_corrupt_manifests(src: Path, tmp_path: Path, capsys) -> None:
    """headfold.json of a candidate or a source, export.json of an export folder: one line, the fix."""
    converted = tmp_path / "kv2"
    assert run(capsys, "convert", src, converted, "--kv-heads", "2", "--method", "mean", "-q")[0] == 0
    (converted / "headfold.json").write_text('{"format": 1, "source": ')
    report = tmp_path / "report.json"
    refused(capsys, converted, report, ["verify", src, converted, "--report", report], "headfold.json is corrupt", "re-run headfold convert")
    out = tmp_path / "again"
    refused(capsys, converted, out, ["convert", converted, out, "--kv-heads", "1", "--method", "mean", "-q"], "headfold.json is corrupt")
    (src / "tokenizer.json").write_text('{"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vocab": 5, "merges": []}}')
    refused(capsys, src, report, ["verify", src, src, "--report", report], "cannot load the tokenizer", "restore its tokenizer files")
    export = tmp_path / "export"
    export.mkdir()
    (export / "export.json").write_text("[1, 2")
    (export / "model.onnx").write_bytes(b"")
    engines = tmp_path / "engines"
    refused(capsys, export, engines, ["build", export, engines, "--dry-run", "--trt-version", "10.15"], "export.json is corrupt", "re-run headfold export")


def test_truncated_onnx_data(src: Path, tmp_path: Path, capsys) -> None:
    """A graph whose external weights file was cut short: one line naming the graph, not ORT's traceback."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    table = numpy_helper.from_array(np.ones((160, 4), np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 4])],
        [table],
    )
    graph_file = tmp_path / "model.onnx"
    save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]),
        graph_file,
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    data = (tmp_path / "model.onnx.data").read_bytes()
    (tmp_path / "model.onnx.data").write_bytes(data[: len(data) // 2])
    report = tmp_path / "report.json"
    refused(
        capsys,
        src,
        report,
        ["verify", src, graph_file, "--max-rows", "2", "--window", "8", "--report", report],
        "model.onnx does not match its external data",
        "model.onnx.data",
        "re-export",
    )


# ---- 6. usability -----------------------------------------------------------------------------


def test_verify_without_tokenizer(src: Path, tmp_path: Path, capsys) -> None:
    """Fidelity runs on seeded random ids or --token-ids FILE; conversion loss needs text and says how to give it."""
    report = tmp_path / "report.json"
    code, err = run(capsys, "verify", src, src, "--max-rows", "4", "--window", "16", "--report", report)
    assert code == 0, err
    assert json.loads(report.read_text())["inputs"]["text"].startswith("random token ids (seed 0;")
    ids = tmp_path / "ids.txt"
    ids.write_text("5 6 7 8 9\n\n10 11 12\n")
    code, err = run(capsys, "verify", src, src, "--token-ids", ids, "--report", report, "--overwrite")  # replaces its own report
    assert code == 0, err
    inputs = json.loads(report.read_text())["inputs"]
    assert (inputs["text"], inputs["rows"], inputs["tokens"]) == (f"--token-ids {ids}", 2, 8)

    converted = tmp_path / "kv2"
    assert run(capsys, "convert", src, converted, "--kv-heads", "2", "--method", "mean", "-q")[0] == 0
    loss_report = tmp_path / "loss.json"
    refused(capsys, src, loss_report, ["verify", src, converted, "--report", loss_report], "conversion-loss check needs real text", "--token-ids FILE")
    code, err = run(capsys, "verify", src, converted, "--token-ids", ids, "--report", loss_report)
    assert code in (0, 1) and json.loads(loss_report.read_text())["checks"][0]["name"] == "conversion-loss"  # 1: pooling lost more than the budget

    ids.write_text("5 6 x\n")
    refused(capsys, src, report.with_name("r2.json"), ["verify", src, src, "--token-ids", ids, "--report", report.with_name("r2.json")], "line 1", "token ids")
    ids.write_text("5 6 999\n")
    refused(capsys, src, report.with_name("r2.json"), ["verify", src, src, "--token-ids", ids, "--report", report.with_name("r2.json")], "vocabulary [0, 160)")


@pytest.mark.skipif(not env._missing("tensorrt"), reason="the fallback where TensorRT is not installed")
def test_build_dry_run_without_tensorrt_plans_for_the_newest_release(tmp_path: Path, capsys) -> None:
    from onnx import TensorProto, helper, save

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), tmp_path / "m.onnx")
    code = main(["build", str(tmp_path / "m.onnx"), str(tmp_path / "m.engine"), "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and "TensorRT 11.0 (TensorRT is not installed: dry run for the newest release headfold knows, 11.0" in out
    assert not (tmp_path / "m.engine").exists()


def test_gpt2_tokenizer_files_in_calibration_and_verify_and_quiet(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    """A GPT-2 folder's vocab.json + merges.txt tokenize for calibration and verify alike; -q prints
    nothing but the result (no progress bars, no library warnings), also while calibrating."""
    src = shutil.copytree(tiny_checkpoint("gpt2", n_positions=512), tmp_path / "gpt2")  # calibration windows are 256 tokens
    add_gpt2_tokenizer(src)
    text = ascii_text(tmp_path / "text.txt")
    capsys.readouterr()  # building the tiny checkpoint printed transformers' own bar
    code, err = run(
        capsys, "convert", src, tmp_path / "out", "--kv-heads", "2", "--method", "aligned", "--calibration", text, "--calibration-tokens", "256", "-q"
    )
    assert (code, err) == (0, "")
    report = tmp_path / "report.json"
    code, err = run(capsys, "verify", src, src, "--text", text, "--max-rows", "2", "--window", "16", "--decode-steps", "0", "--report", report)
    assert code == 0, err
    assert json.loads(report.read_text())["inputs"]["tokenizer"] == "AutoTokenizer(GPT2Tokenizer)"


def test_quiet_silences_the_exporters_warnings() -> None:
    """What `export -q` does before exporting: the logger of torch.onnx's "torchvision is not
    installed" lines (and transformers') no longer passes warnings."""
    import logging

    from transformers.utils import logging as hf_logging

    from headfold.options import quiet_libraries

    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    try:
        quiet_libraries()
        assert not registration.isEnabledFor(logging.WARNING) and hf_logging.get_verbosity() == hf_logging.ERROR
    finally:
        logging.getLogger("torch.onnx").setLevel(logging.NOTSET)


def test_make_checkpoint_still_converts(tmp_path: Path, capsys) -> None:
    """The refusals above are not false alarms: every family's tiny checkpoint converts (exit 0)."""
    for family in ("gpt2", "gpt_neox", "phi3", "opt", "bert"):
        src = make_checkpoint(family, tmp_path / family)
        code, err = run(capsys, "convert", src, tmp_path / f"{family}-kv2", "--kv-heads", "2", "--method", "mean", "-q")
        assert code == 0, err


# ---- every command, every kind of input (issue 23) --------------------------------------------


@pytest.fixture(scope="module")
def world(tiny_checkpoint, tiny_export, tmp_path_factory) -> World:
    return make_world(tmp_path_factory.mktemp("world"), tiny_checkpoint, tiny_export)


SMALL = ["--max-rows", "2", "--window", "8", "--decode-steps", "0"]
# command → arguments reading the checkpoint SRC (and the world's other inputs), writing OUT
ON_CHECKPOINT: dict[str, Callable[[World, Path, Path], list]] = {
    "convert": lambda w, src, out: ["convert", src, out, "--kv-heads", "2", "--method", "mean", "-q"],
    "export": lambda w, src, out: ["export", src, out, "-q"],
    "verify": lambda w, src, out: ["verify", src, src, *SMALL, "--report", out],
    "inspect": lambda w, src, out: ["inspect", src, "--calibration", "weights", "--json", out, "-q"],
    "distill": lambda w, src, out: ["distill", src, w.student, out, "--data", w.text, "--seq-len", "32", "--steps", "1", "-q"],
    "run": lambda w, src, out: ["run", src, out, "--kv-heads", "2"],
}
MODEL_BUILDERS = ("export", "verify", "inspect", "run")  # what builds the torch model (convert pools bytes; distill checks the pair first)


def _config(**changes) -> Callable[[Path], None]:
    return lambda src: edit_config(src, **changes)


def _deep_json(name: str) -> Callable[[Path], None]:
    return lambda src: (src / name).write_text("[" * 100_000 + "]" * 100_000)


def _shards(src: Path, wrong_index: bool) -> None:
    """Shards a (all but the embedding) and b (the embedding, and model.norm.weight a second time);
    or an index that swaps where model.norm.weight and the embedding are."""
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    embedding = {"model.embed_tokens.weight": tensors.pop("model.embed_tokens.weight")}
    save_file(tensors, src / "a.safetensors", metadata={"format": "pt"})
    save_file(embedding if wrong_index else {**embedding, "model.norm.weight": tensors["model.norm.weight"]}, src / "b.safetensors", metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(tensors, "a.safetensors"), **dict.fromkeys(embedding, "b.safetensors")}
    if wrong_index:
        weight_map["model.norm.weight"], weight_map["model.embed_tokens.weight"] = "b.safetensors", "a.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _escape_in_index(src: Path) -> None:
    names = list(load_file(src / "model.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, "\x1b]0;pwned\x07\x1b[2J.safetensors")}))


# case → (how SRC is broken, the commands that read what is broken, words of the refusal)
HOSTILE_CHECKPOINTS: dict[str, tuple[Callable[[Path], None], tuple[str, ...], tuple[str, ...]]] = {
    "link out of the folder": (_link("notes.txt", _outside_file), tuple(ON_CHECKPOINT), ("links to",)),
    "config.json nested 100000 deep": (_deep_json("config.json"), tuple(ON_CHECKPOINT), ("config.json", "nested deeper")),
    "index nested 100000 deep": (_deep_json("model.safetensors.index.json"), tuple(ON_CHECKPOINT), ("index.json", "nested deeper")),
    "rope_theta a string": (_config(rope_theta="big"), tuple(ON_CHECKPOINT), ("rope_theta", "positive number")),
    "negative rope_theta": (_config(rope_theta=-10000.0), tuple(ON_CHECKPOINT), ("rope_theta",)),
    "pad_token_id outside the vocabulary": (_config(pad_token_id=10**6), tuple(ON_CHECKPOINT), ("pad_token_id", "[0, 256)")),
    "rms_norm_eps a string": (_config(rms_norm_eps="tiny"), tuple(ON_CHECKPOINT), ("rms_norm_eps",)),
    "a dtype torch does not have": (_config(dtype="float1024"), tuple(ON_CHECKPOINT), ("'dtype'", "float1024")),
    "tie_word_embeddings not a flag": (_config(tie_word_embeddings="yes"), tuple(ON_CHECKPOINT), ("tie_word_embeddings", "true or false")),
    "unknown hidden_act": (_config(hidden_act="nope"), MODEL_BUILDERS, ("hidden_act", "nope")),
    "1 position": (_config(max_position_embeddings=1), ("verify",), ("max_position_embeddings", "positions")),
    "corrupt generation_config.json": (
        lambda s: (s / "generation_config.json").write_text('{"max_length": "long"'),
        MODEL_BUILDERS,
        ("generation_config.json",),
    ),
    "a tensor in two shards": (lambda s: _shards(s, wrong_index=False), tuple(ON_CHECKPOINT), ("model.norm.weight", "a.safetensors", "b.safetensors")),
    "an index naming the wrong shard": (
        lambda s: _shards(s, wrong_index=True),
        tuple(ON_CHECKPOINT),
        ("model.embed_tokens.weight", "a.safetensors", "b.safetensors"),
    ),
    "escape sequences in an index entry": (_escape_in_index, tuple(ON_CHECKPOINT), ("\\x1b]0;pwned\\x07",)),
}
CHECKPOINT_CASES = [(case, command) for case, (_, commands, _) in HOSTILE_CHECKPOINTS.items() for command in commands]


@pytest.mark.parametrize("case, command", CHECKPOINT_CASES)
def test_every_command_refuses_a_hostile_checkpoint(case: str, command: str, world: World, tmp_path: Path, capsys) -> None:
    """Exit 2, one line naming the problem (escaped), nothing written, the checkpoint unchanged."""
    breaks, _, words = HOSTILE_CHECKPOINTS[case]
    src = Path(shutil.copytree(world.src, tmp_path / "src"))
    breaks(src)
    out = tmp_path / ("out.json" if command in ("verify", "inspect") else "out")
    before, inputs = tree_digest(src), world.digests()
    assert_one_line(*run(capsys, *ON_CHECKPOINT[command](world, src, out)), 2, *words)
    assert_nothing_written(out)
    assert tree_digest(src) == before and world.digests() == inputs


@pytest.fixture(scope="module")
def seq2seq_pairs(tiny_checkpoint, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family → (its tiny checkpoint, its kv-2 conversion): what the encoder-decoder cases break."""
    folder = tmp_path_factory.mktemp("seq2seq")
    return {
        family: (tiny_checkpoint(family), convert(tiny_checkpoint(family), folder / family, 2, method="mean", progress=False))
        for family in ("t5", "bart", "whisper")
    }


LOADERS = ("export", "verify", "run")  # what builds the model config.json describes and matches it to the weights
# case → (family, config.json changes, the commands that refuse it, words of the refusal)
SEQ2SEQ_CONFIGS: dict[str, tuple[str, dict, tuple[str, ...], tuple[str, ...]]] = {
    "negative max_source_positions": ("whisper", {"max_source_positions": -5}, (*ON_CHECKPOINT,), ("'max_source_positions'", "positive integer")),
    "absurd max_source_positions": ("whisper", {"max_source_positions": 10**12}, (*ON_CHECKPOINT,), ("'max_source_positions'", "more than")),
    "0 mel bins": ("whisper", {"num_mel_bins": 0}, (*ON_CHECKPOINT,), ("'num_mel_bins'", "positive integer")),
    "absurd mel bins": ("whisper", {"num_mel_bins": 10**9}, (*ON_CHECKPOINT,), ("'num_mel_bins'", "more than")),
    "mel bins not the weights'": ("whisper", {"num_mel_bins": 80}, LOADERS, ("num_mel_bins=80", "weights disagree")),
    "absurd max_target_positions": ("whisper", {"max_target_positions": 10**12}, (*ON_CHECKPOINT,), ("'max_target_positions'", "more than")),
    "negative d_kv": ("t5", {"d_kv": -8}, (*ON_CHECKPOINT,), ("'d_kv'", "positive integer")),
    "absurd d_kv": ("t5", {"d_kv": 10**9}, (*ON_CHECKPOINT,), ("'d_kv'", "more than")),
    "d_kv not the weights'": ("t5", {"d_kv": 16}, ("convert", "inspect", *LOADERS), ("d_kv 16", "disagree")),
    "negative decoder layer count": ("t5", {"num_decoder_layers": -1}, (*ON_CHECKPOINT,), ("'num_decoder_layers'", "positive integer")),
    "absurd decoder layer count": ("bart", {"decoder_layers": 10**9}, (*ON_CHECKPOINT,), ("'decoder_layers'", "more than 10000")),
    "absurd encoder layer count": ("whisper", {"encoder_layers": 10**6}, (*ON_CHECKPOINT,), ("'encoder_layers'", "more than 10000")),
    "a string MLP width": ("bart", {"encoder_ffn_dim": "96"}, (*ON_CHECKPOINT,), ("'encoder_ffn_dim'", "positive integer")),
    "absurd decoder heads": ("bart", {"decoder_attention_heads": 10**8}, (*ON_CHECKPOINT,), ("'decoder_attention_heads'", "more than")),
    "heads not dividing the width": ("bart", {"decoder_attention_heads": 7}, (*ON_CHECKPOINT,), ("d_model 64", "decoder_attention_heads 7")),
}


@pytest.mark.parametrize("case, command", [(case, command) for case, (_, _, commands, _) in SEQ2SEQ_CONFIGS.items() for command in commands])
def test_encoder_decoder_config_values_are_checked(case: str, command: str, seq2seq_pairs, world: World, tmp_path: Path, capsys) -> None:
    """Negative, absurd or weight-contradicting sizes of T5, BART and Whisper: one line naming the key,
    before anything is sized by it; convert copies none of them into an output. distill gets the value in
    its student (converted from a good teacher), the others in their source."""
    family, changes, _, words = SEQ2SEQ_CONFIGS[case]
    teacher, student = seq2seq_pairs[family]
    broken = Path(shutil.copytree(student if command == "distill" else teacher, tmp_path / "src"))
    edit_config(broken, **changes)
    out = tmp_path / ("out.json" if command in ("verify", "inspect") else "out")
    if command == "distill":
        args = ["distill", teacher, broken, out, "--data", world.text, "--seq-len", "32", "--steps", "1", "-q"]
    else:
        args = ON_CHECKPOINT[command](world, broken, out)
    refused(capsys, broken, out, args, *words)


def _graph_names(*names: str) -> Callable[[Path], None]:
    def edit(export: Path) -> None:
        summary = json.loads((export / "export.json").read_text())
        summary["graphs"] = {name: {} for name in names}
        (export / "export.json").write_text(json.dumps(summary))

    return edit


def _weights_outside(export: Path) -> None:
    model = onnx.load(export / "prefill.onnx", load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../prefill.onnx.data"
    onnx.save(model, export / "prefill.onnx")
    shutil.copy(export / "prefill.onnx.data", export.parent / "prefill.onnx.data")


def _weights_linked_out(export: Path) -> None:
    shutil.move(export / "prefill.onnx.data", export.parent / "elsewhere.data")
    (export / "prefill.onnx.data").symlink_to(export.parent / "elsewhere.data")


HOSTILE_EXPORTS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "a graph named ../x.onnx": (_graph_names("../x.onnx"), ("'../x.onnx'",)),
    "a graph named /etc/passwd": (_graph_names("/etc/passwd"), ("'/etc/passwd'",)),
    "a graph linked out of the folder": (
        lambda e: (shutil.move(e / "prefill.onnx", e.parent / "elsewhere.onnx"), (e / "prefill.onnx").symlink_to(e.parent / "elsewhere.onnx")),
        ("links to",),
    ),
    "an empty graph": (lambda e: (e / "prefill.onnx").write_bytes(b""), ("prefill.onnx", "empty")),
    "a graph of garbage": (lambda e: (e / "prefill.onnx").write_bytes(b"\x08\x07garbage" * 100), ("prefill.onnx", "not")),
    "weights outside the folder": (_weights_outside, ("../prefill.onnx.data", "escapes the folder")),
    "weights linked out of the folder": (_weights_linked_out, ("prefill.onnx.data", "symbolic link")),
    "export.json nested 100000 deep": (_deep_json("export.json"), ("export.json", "nested deeper")),
}
ON_EXPORT: dict[str, Callable[[Path, Path], list]] = {
    "build": lambda export, out: ["build", export, out, "--dry-run", "--trt-version", "10.15", "--json", out.with_suffix(".json")],
    "verify": lambda export, out: ["verify", export, export, *SMALL, "--report", out],
}


@pytest.mark.parametrize("command", ON_EXPORT)
@pytest.mark.parametrize("case", HOSTILE_EXPORTS)
def test_every_command_refuses_a_hostile_export(case: str, command: str, world: World, tmp_path: Path, capsys) -> None:
    breaks, words = HOSTILE_EXPORTS[case]
    export = Path(shutil.copytree(world.export, tmp_path / "export"))
    breaks(export)
    out = tmp_path / "out"
    before = tree_digest(export)
    assert_one_line(*run(capsys, *ON_EXPORT[command](export, out)), 2, *words)
    assert_nothing_written(out) or assert_nothing_written(out.with_suffix(".json"))
    assert tree_digest(export) == before and not (tmp_path / "x.onnx").exists()


# command → arguments reading the graph file GRAPH alone (no export folder around it), writing OUT
ON_GRAPH: dict[str, Callable[[World, Path, Path], list]] = {
    "verify": lambda w, graph, out: ["verify", w.export, graph, *SMALL, "--report", out],
    "build": lambda w, graph, out: ["build", graph, out.with_suffix(".engine"), "--dry-run", "--trt-version", "10.15", "--json", out],
    "convert": lambda w, graph, out: ["convert", graph, out.with_suffix(".onnx"), "--kv-heads", "2", "--json", out],
}


@pytest.mark.parametrize("how", ["escapes the folder", "symbolic link"])
@pytest.mark.parametrize("command", ON_GRAPH)
def test_external_data_out_of_a_graphs_folder_says_how(command: str, how: str, world: World, tmp_path: Path, capsys) -> None:
    """A graph given as a file whose external data lies outside its folder, named '../x' or behind a link:
    one line saying which ("escapes the folder", "symbolic link"), nothing read there, nothing written."""
    folder = tmp_path / "graph"
    folder.mkdir()
    graph = Path(shutil.copy(world.graph, folder / "prefill.onnx"))
    if how == "escapes the folder":
        shutil.copy(world.graph.with_name("prefill.onnx.data"), folder)
        _weights_outside(folder)
        (folder / "prefill.onnx.data").unlink()
    else:
        shutil.copy(world.graph.with_name("prefill.onnx.data"), tmp_path / "elsewhere.data")
        (folder / "prefill.onnx.data").symlink_to(tmp_path / "elsewhere.data")
    out = tmp_path / "out.json"
    before = tree_digest(tmp_path)
    assert_one_line(*run(capsys, *ON_GRAPH[command](world, graph, out)), 2, "prefill.onnx external data", how)
    assert tree_digest(tmp_path) == before


def _dataset(tmp_path: Path, state_entry: str | None = None, link_out: bool = False) -> Path:
    import datasets

    folder = tmp_path / "dataset"
    datasets.Dataset.from_dict({"text": [corpus.train_text()[:4000]] * 4}).save_to_disk(str(folder))
    arrow = next(folder.glob("*.arrow"))
    if link_out:
        shutil.move(arrow, tmp_path / "outside.arrow")
        arrow.symlink_to(tmp_path / "outside.arrow")
    if state_entry is not None:
        state = json.loads((folder / "state.json").read_text())
        shutil.move(arrow, tmp_path / "outside.arrow")
        state["_data_files"] = [{"filename": state_entry}]
        (folder / "state.json").write_text(json.dumps(state))
    return folder


def _file(name: str, content: bytes) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        (folder / name).write_bytes(content)
        return folder / name

    return make


HOSTILE_DATA: dict[str, tuple[Callable[[Path], Path], tuple[str, ...]]] = {
    "an arrow file linked out of the dataset": (lambda t: _dataset(t, link_out=True), ("links to",)),
    "a dataset naming ../outside.arrow": (lambda t: _dataset(t, state_entry="../outside.arrow"), ("'../outside.arrow'",)),
    "garbage parquet": (_file("d.parquet", b"PAR1" + b"\x00garbage" * 64 + b"PAR1"), ("d.parquet", "cannot be read")),
    "rows whose text is a number": (_file("d.jsonl", b'{"text": 5}\n' * 8), ("d.jsonl", "not a string")),
    "a data file that is the output": (lambda t: t / "out" / "corpus.txt", ("out",)),
}


@pytest.mark.parametrize("case", HOSTILE_DATA)
def test_distill_refuses_hostile_data(case: str, world: World, tmp_path: Path, capsys) -> None:
    make, words = HOSTILE_DATA[case]
    data = make(tmp_path)
    capsys.readouterr()  # datasets' own progress bar while the test saved one
    out = tmp_path / "out"
    if case == "a data file that is the output":
        out.mkdir()
        data.write_text(corpus.train_text()[:20_000])
    before = tree_digest(tmp_path)
    code, err = run(capsys, "distill", world.src, world.student, out, "--data", data, "--seq-len", "32", "--steps", "1", "--overwrite", "-q")
    assert_one_line(code, err, 2, *words)
    assert tree_digest(tmp_path) == before


YAML_BOMB = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


@pytest.mark.parametrize(
    "name, content, words",
    [
        ("budget.yaml", YAML_BOMB, ("aliases expand", "100000")),
        ("budget.json", "[" * 100_000 + "]" * 100_000, ("nested deeper",)),
        ("budget.toml", "a = " + "[" * 100_000 + "]" * 100_000, ("nested",)),
    ],
)
@pytest.mark.parametrize("command", ["verify", "run"])
def test_budget_files_are_read_with_limits(command: str, name: str, content: str, words: tuple[str, ...], world: World, tmp_path: Path, capsys) -> None:
    """A 330-byte YAML of nested aliases would expand to gigabytes (and a 39 MB error line): refused in one short line."""
    budget = tmp_path / name
    budget.write_text(content)
    out = tmp_path / "out"
    args = ["verify", world.src, world.src, *SMALL, "--report", out] if command == "verify" else ["run", world.src, out, "--kv-heads", "2"]
    code, err = run(capsys, *args, "--budget", budget)
    assert_one_line(code, err, 2, str(budget), *words)
    assert len(err) < 500
    assert_nothing_written(out)


def test_token_ids_beyond_int64_are_bad_input(world: World, tmp_path: Path, capsys) -> None:
    ids = tmp_path / "ids.txt"
    ids.write_text(f"5 6 {2**70}\n")
    out = tmp_path / "r.json"
    assert_one_line(*run(capsys, "verify", world.src, world.src, "--token-ids", ids, "--report", out), 2, "line 1", "vocabulary")
    assert_nothing_written(out)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--lr", "inf"], ("--lr", "finite")),
        (["--temperature", "nan"], ("--temperature", "finite")),
        (["--hidden-weight", "inf"], ("--hidden-weight", "finite")),
        (["--until-ppl-increase", "inf"], ("--until-ppl-increase", "finite")),
        (["--seed", "-1"], ("--seed", "range")),
    ],
)
def test_non_finite_options_are_refused(args: list[str], words: tuple[str, ...], world: World, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code, err = run(capsys, "distill", world.src, world.student, out, "--data", world.text, "--seq-len", "32", "--steps", "1", *args, "-q")
    assert_one_line(code, err, 2, *words)
    assert_nothing_written(out)


DISTILL_DOMAINS = [
    ("--seq-len", "1"),
    ("--seq-len", "4096"),
    ("--batch-size", "0"),
    ("--steps", "0"),
    ("--eval-every", "0"),
    ("--eval-windows", "0"),
    ("--tokens", "0"),
    ("--tokens", "5%"),
    ("--lr", "0"),
    ("--temperature", "-1"),
    ("--hidden-weight", "-1"),
]
# command → options outside their domain, each alone: what the command, its stages and the Python API refuse
OPTION_DOMAINS: dict[str, list[tuple[str, str]]] = {
    "distill": [*DISTILL_DOMAINS, ("--save-every", "0")],
    "run": [
        ("--window", "0"),
        ("--window", "1"),
        ("--batch-size", "0"),
        ("--max-rows", "-1"),
        ("--decode-steps", "-1"),
        *((f"--distill-{option[2:]}", value) for option, value in DISTILL_DOMAINS),
        ("--calibration-tokens", "0"),
        ("--shard-size", "0"),
        ("--opset", "22"),
        ("--trt-version", "9.0"),
        ("--batch", "0:1:2"),
        ("--workspace", "lots"),
    ],
    "verify": [("--window", "0"), ("--batch-size", "0"), ("--max-rows", "-1"), ("--decode-steps", "-1")],
    "convert": [("--calibration-tokens", "0"), ("--calibration-tokens", "-5"), ("--shard-size", "0")],
    "inspect": [("--calibration-tokens", "0")],
}
DOMAIN_ARGS: dict[str, Callable[[World, Path], list]] = {
    "distill": lambda w, out: ["distill", w.src, w.student, out, "--data", w.text, "--seq-len", "32", "--steps", "1", "-q"],
    "run": lambda w, out: ["run", w.src, out, "--kv-heads", "2", "--method", "mean"],
    "verify": lambda w, out: ["verify", w.src, w.src, "--report", out],
    "convert": lambda w, out: ["convert", w.src, out, "--kv-heads", "2", "--method", "aligned", "-q"],
    "inspect": lambda w, out: ["inspect", w.src, "--json", out, "-q"],
}


@pytest.mark.parametrize("command, option, value", [(command, *case) for command, cases in OPTION_DOMAINS.items() for case in cases])
def test_every_option_is_checked_before_the_first_write(command: str, option: str, value: str, world: World, tmp_path: Path, capsys) -> None:
    """An option outside its domain, in any stage `run` runs: exit 2 and one line naming the option as the
    command spells it, before anything is written (distill --seq-len 1 once divided by zero, run
    --window 0 once ran convert and export first)."""
    out = tmp_path / "out"
    code, err = run(capsys, *DOMAIN_ARGS[command](world, out), option, value)
    assert_one_line(code, err, 2, "TensorRT rule set for 9.0" if option == "--trt-version" else option)
    assert entries(tmp_path) == []


def test_the_python_api_checks_the_same_domains(world: World, tmp_path: Path) -> None:
    """The settings objects check themselves: the API refuses what the command line refuses."""
    import headfold
    from headfold.distillation.stage import DistillStage
    from headfold.verification.inputs import InputSpec

    with pytest.raises(BadInput, match="--seq-len must be a whole number of at least 2"):
        headfold.distill(world.src, world.student, tmp_path / "out", headfold.DistillOptions(seq_len=1), data=world.text)
    with pytest.raises(BadInput, match="--eval-every must be a whole number of at least 1, got 0"):
        DistillStage(world.text, {"eval_every": 0})
    with pytest.raises(BadInput, match=r"--window must be a whole number of at least 2 \(a token and the one it predicts\), got 0"):
        InputSpec(window=0)
    with pytest.raises(BadInput, match="--calibration-tokens must be a whole number of at least 1, got 0"):
        headfold.run(world.src, tmp_path / "run", 2, method="mean", calibration=headfold.Calibration(tokens=0))
    assert entries(tmp_path) == []


def _mixed_rows(kind: str) -> Callable[[Path], Path]:
    """Forty text rows, then one (source, target) pair: as a .jsonl, a .parquet or a datasets folder."""
    rows = [{"text": corpus.train_text()[i * 400 : (i + 1) * 400]} for i in range(40)] + [{"source": "a question", "target": "an answer"}]

    def make(folder: Path) -> Path:
        import datasets

        if kind == "jsonl":
            (folder / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
            return folder / "d.jsonl"
        table = datasets.Dataset.from_list([{"text": None, "source": None, "target": None} | row for row in rows])
        if kind == "parquet":
            table.to_parquet(str(folder / "d.parquet"))
            return folder / "d.parquet"
        table.save_to_disk(str(folder / "d"))
        return folder / "d"

    return make


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "dataset folder"])
@pytest.mark.parametrize("command", ["distill", "run"])
def test_every_data_row_is_checked(command: str, kind: str, world: World, tmp_path: Path, capsys) -> None:
    """A decoder's --data whose first rows are text and whose last is a (source, target) pair: refused
    like a file of pairs, naming the row, before anything is written (run: before its first stage)."""
    data = _mixed_rows(kind)(tmp_path)
    capsys.readouterr()  # datasets' own progress bar
    before, out = tree_digest(tmp_path), tmp_path / "out"
    if command == "distill":
        args = ["distill", world.src, world.student, out, "--data", data, "--seq-len", "32", "--steps", "1", "-q"]
    else:
        args = ["run", world.src, out, "--kv-heads", "2", "--method", "mean", "--distill-data", data, "--distill-seq-len", "32"]
    assert_one_line(*run(capsys, *args), 2, "row 41", "(source, target) pair", "encoder-decoder")
    assert tree_digest(tmp_path) == before and not out.exists()


def test_a_diverging_distillation_writes_nothing_and_says_lower_lr(world: World, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    args = [
        "distill",
        world.src,
        world.student,
        out,
        "--data",
        world.text,
        "--seq-len",
        "32",
        "--batch-size",
        "1",
        "--steps",
        "2",
        "--eval-every",
        "1",
        "--eval-windows",
        "1",
    ]
    code, err = run(capsys, *args, "--lr", "1e30", "--save-every", "1", "-q")
    assert_one_line(code, err, 2, "diverged", "lower --lr")
    assert entries(tmp_path) == []  # the checkpoints of --save-every went with it


def _panicking_tokenizer(folder: Path) -> None:
    """A tokenizer.json the tokenizers library loads, whose pre-tokenizer pattern backtracks without end on
    a run of words before punctuation: Oniguruma gives up ("retry-limit-in-match over") and its Rust
    binding panics, its hook printing the panic (and under RUST_BACKTRACE a backtrace) on stderr."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab={chr(c): c - 32 for c in range(32, 127)} | {"\n": 95}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"(\w+\s?)*$"), "isolated")
    tokenizer.save(str(folder / "tokenizer.json"))


# command → arguments that tokenize TEXT with the checkpoint's tokenizer (distill: the student's), writing OUT
TOKENIZING: dict[str, Callable[[World, Path, Path, Path, Path], list]] = {
    "verify": lambda w, src, student, text, out: ["verify", src, src, *SMALL, "--text", text, "--report", out],
    "convert": lambda w, src, student, text, out: [
        "convert",
        src,
        out,
        "--kv-heads",
        "2",
        "--method",
        "aligned",
        "--calibration",
        text,
        "--calibration-tokens",
        "256",
        "-q",
    ],
    "inspect": lambda w, src, student, text, out: ["inspect", src, "--calibration", text, "--calibration-tokens", "256", "--json", out, "-q"],
    "distill": lambda w, src, student, text, out: ["distill", w.src, student, out, "--data", text, "--seq-len", "32", "--steps", "1", "-q"],
}


@pytest.mark.parametrize("command", TOKENIZING)
def test_a_native_panic_is_one_line(command: str, world: World, tmp_path: Path, capfd, monkeypatch) -> None:
    """A real Rust panic in the tokenizer (pyo3's PanicException is a BaseException): named as the
    tokenizer's failure, exit 2, and one line on stderr, the file descriptor included, where the panic
    hook writes its message and backtrace before Python sees the panic."""
    monkeypatch.setenv("RUST_BACKTRACE", "1")
    src, student = (Path(shutil.copytree(folder, tmp_path / folder.name)) for folder in (world.src, world.student))
    _panicking_tokenizer(src)
    _panicking_tokenizer(student)
    text, out = tmp_path / "text.txt", tmp_path / "out"
    text.write_text(corpus.train_text()[:20_000])
    code = main([str(a) for a in TOKENIZING[command](world, src, student, text, out)])
    assert_one_line(code, capfd.readouterr().err, 2, "cannot run the tokenizer", "PanicException", "retry-limit-in-match over")
    assert_nothing_written(out)


def test_a_corrupt_resume_state_is_one_line(world: World, tmp_path: Path, capsys, monkeypatch) -> None:
    """--resume over a damaged checkpoint in .OUT.distill-state: one line, the state kept as it was."""
    from headfold.distillation import state

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
        "4",
        "--save-every",
        "1",
        "--eval-every",
        "100",
        "-q",
    ]
    save = state.save

    def save_then_stop(*a, **kw):
        save(*a, **kw)
        raise KeyboardInterrupt  # Ctrl-C right after the first checkpoint

    monkeypatch.setattr(state, "save", save_then_stop)
    assert run(capsys, *args)[0] == 130
    monkeypatch.undo()
    (step,) = (tmp_path / ".out.distill-state").glob("step-*")
    (step / "optimizer.pt").write_bytes(b"not a torch file")
    before = tree_digest(tmp_path)
    assert_one_line(*run(capsys, *args, "--resume"), 2, "resumable state", "corrupt", step.name)
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_windows_longer_than_a_position_table_are_refused(command: str, tiny_checkpoint, tmp_path: Path, capsys) -> None:
    """GPT-2's positions are a learned table (64 rows here): 256-token calibration windows would index past it."""
    src = tiny_checkpoint("gpt2", vocab_size=256)
    capsys.readouterr()  # transformers' own bar while the fixture saved it
    out = tmp_path / "out"
    args = ["convert", src, out, "--kv-heads", "2", "--method", "aligned", "-q"] if command == "convert" else ["inspect", src, "--json", out, "-q"]
    refused(capsys, src, out, args, "n_positions 64", "256")


def _wide_tokenizer(folder: Path) -> None:
    """A tokenizer.json whose ids run to 350: past the 256-token vocabulary of the world's models."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={chr(c): 250 + c - 32 for c in range(32, 127)} | {"\n": 349}, merges=[])).save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("command", TOKENIZING)
def test_token_ids_beyond_the_vocabulary_are_bad_input(command: str, world: World, tmp_path: Path, capsys) -> None:
    """Tokenizer files of another model give ids the embedding table has no row for: one line naming the
    tokenizer, exit 2 (distill once failed inside the model, exit 3)."""
    src, student = (Path(shutil.copytree(folder, tmp_path / folder.name)) for folder in (world.src, world.student))
    _wide_tokenizer(src)
    _wide_tokenizer(student)
    out = tmp_path / "out"
    refused(capsys, src, out, TOKENIZING[command](world, src, student, world.text, out), "gives token id", "outside the model's vocabulary of 256")


@pytest.mark.parametrize("logits", [["b", "s"], ["b", "s", 2, 256], ["b", "s", 7]])
@pytest.mark.parametrize("side", ["candidate", "reference"])
def test_a_graph_whose_logits_have_another_shape_is_bad_input(side: str, logits: list, world: World, tmp_path: Path, capsys) -> None:
    """A .onnx whose logits lack the vocabulary axis, have one too many or are too narrow: one line naming
    both shapes, exit 2 (once exit 3 from the meter)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    table = numpy_helper.from_array(np.ones((256, *[d for d in logits[2:]]), np.float32), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["logits"])],
        "g",
        [helper.make_tensor_value_info(name, TensorProto.INT64, ["b", "s"]) for name in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, logits)],
        [table],
    )
    save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), tmp_path / "odd.onnx")
    sides = [world.src, tmp_path / "odd.onnx"] if side == "candidate" else [tmp_path / "odd.onnx", world.src]
    out = tmp_path / "r.json"
    shape = [2, 8, *logits[2:]]
    assert_one_line(*run(capsys, "verify", *sides, *SMALL, "-q", "--report", out), 2, f"logits of shape {shape if side == 'candidate' else [2, 8, 256]}")
    assert_nothing_written(out)


def test_a_stray_rank_does_not_silence_a_single_process_distillation(world: World, tmp_path: Path, capsys, monkeypatch) -> None:
    """RANK=1 left in the environment of one process: Accelerate makes it the main process, which writes OUT;
    it reports it too (it once printed nothing, exit 0)."""
    monkeypatch.setenv("RANK", "1")
    out = tmp_path / "out"
    code = main(
        [str(a) for a in ("distill", world.src, world.student, out, "--data", world.text, "--seq-len", "32", "--batch-size", "1", "--steps", "1", "-q")]
    )
    captured = capsys.readouterr()
    assert code == 0 and f"wrote {out} (1 steps" in captured.out and (out / "headfold.json").is_file(), captured.err
