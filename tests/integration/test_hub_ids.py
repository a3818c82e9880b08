"""Hub ids as checkpoints: every command that takes one reads ORG/NAME (or a canonical NAME) from the
Hugging Face cache (laid out in-process; HF_HUB_OFFLINE=1, no network), records repo and commit, and
says in one line what to do when the id is not there: one test per message. A path that does not
exist is no hub id, and the cache never leads outside itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects
from support.hub_cache import cache_entry

from headfold.cli import main
from headfold.converter import sources
from headfold.demo import default_model_path

REPO = "tiny-org/tiny-llama"
EMBEDDED_REPO = "headfold/default-model"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache that huggingface_hub (offline) reads in this process."""
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


@pytest.fixture
def llama(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", vocab_size=256)  # byte-level: calibration and verify read text without tokenizer files


def cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_convert_reads_a_hub_id_and_records_repo_and_commit(hub: Path, llama: Path, tmp_path: Path, capsys) -> None:
    snapshot = cache_entry(hub, REPO, llama)
    code, out, err = cli(capsys, "convert", REPO, tmp_path / "from-hub", "--kv-heads", "2", "--method", "mean", "-q")
    assert code == 0, err
    assert cli(capsys, "convert", llama, tmp_path / "from-folder", "--kv-heads", "2", "--method", "mean", "-q")[0] == 0
    assert (tmp_path / "from-hub/model.safetensors").read_bytes() == (tmp_path / "from-folder/model.safetensors").read_bytes()
    source = json.loads((tmp_path / "from-hub/headfold.json").read_text())["source"]
    assert (source["repo_id"], source["revision"], source["path"]) == (REPO, snapshot.name, str(snapshot))
    assert "repo_id" not in json.loads((tmp_path / "from-folder/headfold.json").read_text())["source"]


def test_revision_picks_a_branch_or_a_commit(hub: Path, llama: Path, tiny_checkpoint, tmp_path: Path, capsys) -> None:
    main_commit = cache_entry(hub, REPO, llama).name
    other = cache_entry(hub, REPO, tiny_checkpoint("llama", vocab_size=256, seed=7), ref="v2").name
    for revision, commit in (("v2", other), (main_commit, main_commit)):
        out = tmp_path / revision
        assert cli(capsys, "convert", REPO, out, "--kv-heads", "4", "--method", "mean", "--revision", revision, "-q")[0] == 0
        assert json.loads((out / "headfold.json").read_text())["source"]["revision"] == commit


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["convert", "nobody/nothing", "{o}", "--kv-heads", "2"],
            [
                "nobody/nothing is neither a local folder nor in the Hugging Face cache",
                "downloads are off because HF_HUB_OFFLINE is set",
                "hf download nobody/nothing",
            ],
        ),
        (["export", "nobody/nothing", "{o}"], ["nobody/nothing is neither a local folder"]),
        (["inspect", "nobody/nothing"], ["nobody/nothing is neither a local folder"]),
        (["verify", "nobody/nothing", "nobody/nothing"], ["nobody/nothing is neither a local folder"]),
        (["run", "nobody/nothing", "{o}", "--kv-heads", "2"], ["nobody/nothing is neither a local folder"]),
        (["distill", "nobody/nothing", "{o}", "{o}2"], ["nobody/nothing is neither a local folder"]),
        (["convert", REPO, "{o}", "--kv-heads", "2", "--revision", "v9"], [f"has {REPO} at main but not at v9", f"hf download {REPO} --revision v9"]),
        (["convert", "{src}", "{o}", "--kv-heads", "2", "--revision", "v2"], ["--revision v2 applies to hub ids (ORG/NAME) and none was given"]),
    ],
)
def test_an_id_not_in_the_offline_cache_is_one_line(args: list[str], words: list[str], hub: Path, llama: Path, tmp_path: Path, capsys) -> None:
    cache_entry(hub, REPO, llama)
    before = sorted(tmp_path.iterdir())
    code, out, err = cli(capsys, *(a.format(o=tmp_path / "out", src=llama) for a in args))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert all(w in err for w in words), err
    assert sorted(tmp_path.iterdir()) == before  # nothing written


def test_links_out_of_the_snapshot_other_than_to_its_blobs_are_refused(hub: Path, llama: Path, tmp_path: Path, capsys) -> None:
    snapshot = cache_entry(hub, REPO, llama)
    secret = tmp_path / "secret.txt"
    secret.write_text("not a checkpoint file")
    (snapshot / "tokenizer.json").symlink_to(secret)
    code, _, err = cli(capsys, "convert", REPO, tmp_path / "out", "--kv-heads", "2", "--method", "mean", "-q")
    assert code == 2 and "outside" in err and "tokenizer.json" in err
    assert not (tmp_path / "out").exists()


def test_only_the_files_a_stage_reads_are_fetched() -> None:
    """The patterns, as huggingface_hub itself matches them against a repo's file list."""
    repo = ["config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
            "consolidated.safetensors", "pytorch_model.bin", "tf_model.h5", "flax_model.msgpack", "onnx/model.onnx", "README.md",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json", "1_Pooling/config.json",
            "sentence_bert_config.json", "preprocessor_config.json", "original/params.json"]  # fmt: skip
    first = set(filter_repo_objects(repo, allow_patterns=[*sources.CONFIGS, *sources.TOKENIZERS, *sources.SENTENCE_TRANSFORMERS, *sources.SAFETENSORS]))
    assert first == {"config.json", "generation_config.json", "model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "modules.json", "1_Pooling/config.json",
                     "sentence_bert_config.json", "preprocessor_config.json"}  # fmt: skip
    assert set(filter_repo_objects(repo, allow_patterns=sources.PICKLES)) == {"pytorch_model.bin"}


def test_a_local_folder_named_like_an_id_wins(tmp_path: Path, llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").symlink_to(llama)
    assert not sources.is_hub_id("org/model") and not sources.is_hub_id("org/elsewhere")  # ./org is a folder here: both are paths
    assert sources.is_hub_id("other/model") and sources.is_hub_id("gpt2")
    assert sources.checkpoint_folder("org/model") == Path("org/model")


def test_a_canonical_id_without_an_organisation_is_an_id(hub: Path, llama: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    snapshot = cache_entry(hub, "gpt2", llama)
    code, _, err = cli(capsys, "convert", "gpt2", tmp_path / "out", "--kv-heads", "2", "--method", "mean", "-q")
    assert code == 0, err
    source = json.loads((tmp_path / "out/headfold.json").read_text())["source"]
    assert (source["repo_id"], source["revision"]) == ("gpt2", snapshot.name)


def test_a_bare_word_that_is_neither_names_both_readings(hub: Path, llama: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo of a folder here reads as a canonical id: the line says it is neither, and which folder is near."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-llama").symlink_to(llama)
    code, _, err = cli(capsys, "inspect", "my-lama", "-q")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "my-lama is neither a local folder (did you mean my-llama?) nor in the Hugging Face cache" in err and "HF_HUB_OFFLINE is set" in err


def test_an_unreachable_hub_is_not_called_offline(hub: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE unset and nothing answering at the hub's address: the line names the network."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: refused at once
    code, _, err = cli(capsys, "inspect", "nobody/nothing", "-q")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "nobody/nothing is neither a local folder nor in the Hugging Face cache" in err
    assert "the Hugging Face hub cannot be reached (" in err and "HF_HUB_OFFLINE" not in err


CHECKPOINT_COMMANDS = {  # the commands that read a checkpoint argument: SRC filled in
    "convert": ["{src}", "{o}", "--kv-heads", "2"],
    "inspect": ["{src}"],
    "distill": ["{src}", "{src}", "{o}"],
    "export": ["{src}", "{o}"],
    "verify": ["{src}", "{src}"],
    "run": ["{src}", "{o}", "--kv-heads", "2"],
}


@pytest.mark.parametrize("command", CHECKPOINT_COMMANDS)
@pytest.mark.parametrize("arg", ["out/nonexistent", "models/llama--gqa", "./missing", "../missing", "{tmp}/missing", "~/headfold-missing", "a/b/c", "missing/"])
def test_a_path_that_does_not_exist_is_no_such_folder(command: str, arg: str, hub: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    for folder in ("out", "models"):
        (work / folder).mkdir(parents=True)
    monkeypatch.chdir(work)
    arg = arg.format(tmp=tmp_path)
    code, _, err = cli(capsys, command, *(a.format(src=arg, o=tmp_path / "o") for a in CHECKPOINT_COMMANDS[command]))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"no such file or folder: {arg}" in err and "hf download" not in err and "Hugging Face" not in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "arg", ["org/a..b", "org/model.git", "org/name-", "org/" + "x" * 120, "models/llama--gqa"], ids=["dots", "git", "dash", "120-chars", "double-dash"]
)
def test_an_org_name_that_is_no_valid_id_is_one_line(arg: str, hub: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no ./org nor ./models here: ORG/NAME reads as an id
    before = sorted(tmp_path.iterdir())
    for command, args in CHECKPOINT_COMMANDS.items():
        code, _, err = cli(capsys, command, *(a.format(src=arg, o=tmp_path / "o") for a in args))
        assert code == 2 and len(err.strip().splitlines()) == 1, (command, err)
        assert f"{arg} is neither a local folder nor a valid hub id (" in err, (command, err)
    assert sorted(tmp_path.iterdir()) == before  # nothing written


def _outside_copy(llama: Path, tmp_path: Path) -> Path:
    """A complete checkpoint outside the cache: were it read, convert would succeed."""
    outside = tmp_path / "outside"
    shutil.copytree(llama, outside)
    return outside


def _ref_naming_a_path(snapshot: Path, outside: Path, absolute: bool) -> list[str]:
    (snapshot.parents[1] / "refs" / "main").write_text(str(outside) if absolute else os.path.relpath(outside, snapshot.parent))
    return []


def _ref_that_is_a_link_out(snapshot: Path, outside: Path) -> list[str]:
    ref = snapshot.parents[1] / "refs" / "main"
    (outside / "ref").write_text(snapshot.name)
    ref.unlink()
    ref.symlink_to(outside / "ref")
    return []


def _snapshot_that_is_a_link_out(snapshot: Path, outside: Path) -> list[str]:
    shutil.rmtree(snapshot)
    snapshot.symlink_to(outside, target_is_directory=True)
    return []


def _revision_that_is_a_path(snapshot: Path, outside: Path, absolute: bool) -> list[str]:
    (outside / "ref").write_text(snapshot.name)  # a ref huggingface_hub would follow, were the revision taken as a path
    target = outside / "ref"
    return ["--revision", str(target) if absolute else os.path.relpath(target, snapshot.parents[1] / "refs")]


@pytest.mark.parametrize(
    "lay_out, words",
    [
        (lambda s, o: _ref_naming_a_path(s, o, absolute=False), ["refs/main names '../../", "not a commit"]),
        (lambda s, o: _ref_naming_a_path(s, o, absolute=True), ["refs/main names '/", "not a commit"]),
        (_ref_that_is_a_link_out, ["refs/main is not a plain file inside the Hugging Face cache"]),
        (_snapshot_that_is_a_link_out, ["leads outside the Hugging Face cache", "outside"]),
        (lambda s, o: _revision_that_is_a_path(s, o, absolute=False), ["--revision ../", "is a path, not a branch, tag or commit"]),
        (lambda s, o: _revision_that_is_a_path(s, o, absolute=True), ["--revision /", "is a path, not a branch, tag or commit"]),
    ],
    ids=["ref-relative-path", "ref-absolute-path", "ref-link", "snapshot-link", "revision-relative-path", "revision-absolute-path"],
)
def test_the_cache_never_leads_outside_itself(lay_out, words: list[str], hub: Path, llama: Path, tmp_path: Path, capsys) -> None:
    snapshot = cache_entry(hub, REPO, llama)
    extra = lay_out(snapshot, _outside_copy(llama, tmp_path))
    code, _, err = cli(capsys, "convert", REPO, tmp_path / "out", "--kv-heads", "2", "--method", "mean", "-q", *extra)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_inspect_distill_export_verify_and_run_take_a_hub_id(hub: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model, served from the cache: every other command that takes a checkpoint."""
    monkeypatch.chdir(tmp_path)  # not the repository root, whose headfold/ folder would make the id a path
    cache_entry(hub, EMBEDDED_REPO, default_model_path())
    rows = ["--max-rows", "2", "--window", "32", "--decode-steps", "2"]
    code, out, err = cli(capsys, "inspect", EMBEDDED_REPO, "--candidates", "4", "--calibration-tokens", "256", "--json", "-q")
    assert code == 0, err
    assert set(json.loads(out)["per_layer"][0]["loss"]) == {"4"}
    student = tmp_path / "student"
    assert cli(capsys, "convert", EMBEDDED_REPO, student, "--kv-heads", "4", "--method", "mean", "-q")[0] == 0
    code, out, err = cli(
        capsys,
        "distill",
        EMBEDDED_REPO,
        student,
        tmp_path / "distilled",
        "--steps",
        "1",
        "--seq-len",
        "32",
        "--batch-size",
        "1",
        "--eval-windows",
        "2",
        "--json",
        "-",
        "-q",
    )
    assert code == 0, err
    assert json.loads(out)["steps"] == 1
    assert cli(capsys, "export", EMBEDDED_REPO, tmp_path / "onnx", "-q")[0] == 0
    code, out, err = cli(capsys, "verify", EMBEDDED_REPO, student, *rows, "--max-kl", "5", "--max-ppl-increase", "500%", "--min-top1", "0", "--json", "-q")
    assert code == 0, err
    assert "models--headfold--default-model/snapshots/" in json.loads(out)["checks"][0]["reference"]["path"]
    code, out, err = cli(
        capsys,
        "run",
        EMBEDDED_REPO,
        tmp_path / "run",
        "--kv-heads",
        "4",
        "--method",
        "mean",
        *rows,
        "--max-kl",
        "5",
        "--max-ppl-increase",
        "500%",
        "--min-top1",
        "0",
        "-q",
    )
    assert code == 0, err
    assert json.loads((tmp_path / "run/convert/headfold.json").read_text())["source"]["repo_id"] == EMBEDDED_REPO


def test_the_command_reads_hf_home_and_hf_hub_offline_from_its_environment(llama: Path, tmp_path: Path) -> None:
    """The user's path: the environment alone points headfold at the cache (a fresh process)."""
    cache_entry(tmp_path / "home" / "hub", REPO, llama)
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run(
        [sys.executable, "-m", "headfold", "convert", REPO, tmp_path / "out", "--kv-heads", "2", "--method", "mean", "-q"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "out/headfold.json").read_text())["source"]["repo_id"] == REPO
