"""headfold distill for encoder-decoders beyond text pairs (those: test_seq2seq): Whisper on audio with
transcripts or with the teacher's own, exactness, bad audio; resume after kill -9 and two processes = one
for T5 and Whisper (the decoders' versions: test_distill)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from support.commands import FSDP2_CONFIG, distill_command, refused, run_distill, subprocess_env
from support.reading import distilled, read_tensors, relative_difference
from support.tiny_models import BYTES

from headfold import convert, corpus
from headfold.converter.modeling import load_model
from headfold.distillation import distill
from headfold.distillation.audio import DATA_TARGETS, TEACHER_TARGETS, transcript_encoder

RATE = 16_000  # WhisperFeatureExtractor's default rate, which the tiny Whisper's extractor keeps
AUDIO = dict(seq_len=16, batch_size=2, eval_windows=2, progress=False)  # targets of 16 tokens; the tiny decoder has 32 positions
CLIPS = 10


def write_wav(path: Path, seed: int, *, seconds: float = 0.25, rate: int = RATE, channels: int = 1, width: int = 2) -> Path:
    """A tone (its pitch set by `seed`) under a little noise, as `width`-byte PCM."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    wave_ = 0.3 * np.sin(2 * np.pi * (150 + 60 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    samples = np.repeat(wave_[:, None], channels, 1)
    data = (samples * 32767).astype("<i2").tobytes() if width == 2 else ((samples + 1) * 127.5).astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(data)
    return path


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def whisper(tiny_checkpoint) -> Path:
    return tiny_checkpoint("whisper", **BYTES)  # byte-level: transcripts need no tokenizer files


@pytest.fixture(scope="module")
def audio(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`transcribed`: a .jsonl of clips (mono and stereo) with transcripts; `clips`: a folder of WAVs without."""
    root = tmp_path_factory.mktemp("audio")
    words = corpus.train_text().split()
    rows = []
    for i in range(CLIPS):
        write_wav(root / "clips" / f"{i:02d}.wav", i, channels=1 + i % 2)
        rows.append({"audio": f"clips/{i:02d}.wav", "text": " ".join(words[3 * i : 3 * i + 3])})
    return {"transcribed": write_rows(root / "train.jsonl", rows), "clips": root / "clips"}


@pytest.fixture(scope="module")
def whisper_students(whisper: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("whisper-students")
    return {kv: convert(whisper, folder / f"kv{kv}", kv, method="mean", progress=False) for kv in (2, 8)}


@pytest.mark.parametrize("form, targets", [("transcribed", DATA_TARGETS), ("clips", TEACHER_TARGETS)])
def test_whisper_distill_lowers_the_decoder_kl(form: str, targets: str, whisper: Path, whisper_students, audio, tmp_path: Path) -> None:
    """Audio with transcripts, or a folder of WAVs the teacher transcribes: the teacher-forced KL of the
    decoder's logits drops, and the manifest says where the targets and features came from."""
    out = distill(whisper, whisper_students[2], tmp_path / "out", data=audio[form], steps=10, lr=1e-2, **AUDIO)
    first, final = distilled(out)["initial_eval"], distilled(out)["final_eval"]
    print(f"whisper kv 2, {form}: KL {first['kl']:.4g} -> {final['kl']:.4g}")
    assert first["kl"] > 0.1 and final["kl"] < 0.3 * first["kl"], f"{form}: KL {first['kl']:.4g} → {final['kl']:.4g}"
    data = distilled(out)["data"]
    assert data["targets"] == targets and data["train"] == str(audio[form])
    assert data["features"].startswith("built from config.json's num_mel_bins")
    kinds = json.loads((out / "config.json").read_text())["num_key_value_heads_per_attention"]
    assert kinds == {"encoder_self": 8, "decoder_self": 2, "decoder_cross": 2}
    load_model(out)


def test_whisper_student_equal_to_its_teacher_stays_unchanged(whisper: Path, whisper_students, audio, tmp_path: Path) -> None:
    same = whisper_students[8]
    for form in ("transcribed", "clips"):
        out = distill(whisper, same, tmp_path / form, data=audio[form], steps=2, **AUDIO)
        log = json.loads((out / "distill-log.json").read_text())
        assert max(r["loss"] for r in log["train"]) < 1e-6
        assert distilled(out)["final_eval"]["kl"] < 1e-6 and distilled(out)["final_eval"]["top1"] == 1.0
        before, after = read_tensors(same), read_tensors(out)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), form


def test_the_teachers_transcripts_are_its_greedy_generation(whisper: Path, whisper_students, audio) -> None:
    """The folder form's targets are teacher.generate's greedy tokens after the start token, cut after end-of-text."""
    from headfold.converter.checkpoint import CheckpointFacts
    from headfold.distillation.audio import audio_plan

    facts = CheckpointFacts.read(whisper_students[2])
    config = facts.config
    plan = audio_plan(facts, 256, audio["clips"], None, 16, 2, 0)
    teacher = load_model(whisper)
    batch = plan.complete(plan.eval_batch(), teacher, rows=1)
    generated = teacher.generate(input_features=batch.features, max_new_tokens=16, do_sample=False, return_dict_in_generate=True).sequences
    assert generated[:, 0].tolist() == [config["decoder_start_token_id"]] * 2
    for row, ids in zip(generated[:, 1:].tolist(), batch.ids.tolist(), strict=True):
        end = row.index(config["eos_token_id"]) + 1 if config["eos_token_id"] in row else len(row)
        assert ids == row[:end] + [-1] * (16 - end)


def test_a_preprocessor_config_gives_the_features(whisper: Path, audio, tmp_path: Path, capsys) -> None:
    """The checkpoint's preprocessor_config.json is what the features come from; one of other mel bins is one line."""
    import shutil

    from transformers import WhisperFeatureExtractor

    teacher = Path(shutil.copytree(whisper, tmp_path / "teacher"))
    WhisperFeatureExtractor(feature_size=8).save_pretrained(teacher)
    student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
    out = distill(teacher, student, tmp_path / "out", data=audio["transcribed"], steps=1, **AUDIO)
    assert distilled(out)["data"]["features"] == f"preprocessor_config.json of {student}"
    WhisperFeatureExtractor(feature_size=4).save_pretrained(student)
    err = refused(
        ["distill", str(teacher), str(student), str(tmp_path / "bad"), "--data", str(audio["transcribed"]), "--seq-len", "16", "--steps", "1"], capsys
    )
    assert "gives 4 mel bins, config.json's num_mel_bins 8" in err and not (tmp_path / "bad").exists()
    (student / "preprocessor_config.json").write_text(json.dumps({"feature_size": 8, "hop_length": 0}))
    err = refused(
        ["distill", str(teacher), str(student), str(tmp_path / "bad"), "--data", str(audio["transcribed"]), "--seq-len", "16", "--steps", "1"], capsys
    )
    assert "is not a Whisper feature extractor's settings (ZeroDivisionError" in err and not (tmp_path / "bad").exists()


def test_transcripts_are_framed_without_the_start_token(whisper: Path) -> None:
    encoder = transcript_encoder(whisper, 256, start=1)
    assert encoder.wrap(encoder.encode("ab")) == [97, 98]  # byte-level: the text's bytes, nothing around them


def test_the_stage_key_covers_the_audio(whisper: Path, whisper_students, audio, tmp_path: Path) -> None:
    """`headfold run` re-runs Whisper's distill stage when a clip changes, as when its transcript does."""
    import shutil

    from headfold.distillation.stage import DistillStage

    data = Path(shutil.copytree(audio["transcribed"].parent, tmp_path / "audio")) / "train.jsonl"
    key = lambda: DistillStage(data, {"steps": 1, "seq_len": 16}).key(whisper, whisper_students[2])["data_sha256"]  # noqa: E731
    first = key()
    write_wav(data.parent / "clips" / "00.wav", seed=99)
    second = key()
    data.write_text(data.read_text().replace('"text": "', '"text": "x', 1))
    assert len({first, second, key()}) == 3


# -- bad audio: one line, exit 2, nothing written -------------------------------------------------


BAD_AUDIO = {  # case → (the clip's file or None, the row's audio entry, what the line says)
    "not-a-wav": ("clip.wav", "clip.wav", "is not a PCM WAV file (file does not start with RIFF id)"),
    "empty": ("clip.wav", "clip.wav", "is empty"),
    "no-samples": ("clip.wav", "clip.wav", "holds no samples"),
    "8-bit": ("clip.wav", "clip.wav", "is 8-bit PCM, and headfold reads 16-bit"),
    "rate": ("clip.wav", "clip.wav", "is sampled at 8000 Hz, and the feature extractor takes 16000 Hz; resample it, e.g. ffmpeg -i in.wav -ar 16000 out.wav"),
    "missing": (None, "gone.wav", "does not exist"),
    "escaping": (None, "../outside.wav", "entry '../outside.wav' escapes the folder"),
    "absolute": (None, "/etc/hostname", "entry '/etc/hostname' escapes the folder"),
    "link-outside": ("link.wav", "link.wav", "entry 'link.wav' leads out of the folder"),
    "no-text": ("clip.wav", "clip.wav", "line 1 is {'audio': 'clip.wav'}; give every line an object"),
    "text-file": (None, None, "Whisper distills on audio; pass a .jsonl whose rows are"),
    "few-clips": ("clip.wav", "clip.wav", "has only 3 clip(s), all needed as the 32 held-out ones"),
    "empty-folder": (None, None, "holds no .wav files"),
}


def make_bad_data(case: str, folder: Path) -> Path:
    clip, entry, _ = BAD_AUDIO[case]
    folder.mkdir()
    if case == "text-file":
        return write_rows(folder / "train.txt", [])
    if case == "empty-folder":
        (folder / "clips").mkdir()
        return folder / "clips"
    if case == "link-outside":
        (folder / clip).symlink_to(write_wav(folder.parent / "elsewhere.wav", 0))
    elif case == "not-a-wav":
        (folder / clip).write_text("not audio")
    elif case == "empty":
        (folder / clip).write_bytes(b"")
    elif case == "no-samples":
        write_wav(folder / clip, 0, seconds=0)
    elif clip is not None:
        write_wav(folder / clip, 0, **({"width": 1} if case == "8-bit" else {"rate": 8000} if case == "rate" else {}))
    if case == "escaping":
        write_wav(folder.parent / "outside.wav", 0)  # it exists: only its place is wrong
    row = {"audio": entry} if case == "no-text" else {"audio": entry, "text": "a transcript"}
    return write_rows(folder / "train.jsonl", [row] * 3)


@pytest.mark.parametrize("case", sorted(BAD_AUDIO))
def test_bad_audio_is_one_line_exit_2_nothing_written(case: str, whisper: Path, whisper_students, tmp_path: Path, capsys) -> None:
    data = make_bad_data(case, tmp_path / "data")
    before = sorted(p.name for p in tmp_path.iterdir())
    err = refused(["distill", str(whisper), str(whisper_students[2]), str(tmp_path / "out"), "--data", str(data), "--seq-len", "16", "--steps", "1"], capsys)
    assert BAD_AUDIO[case][2] in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_whisper_seq_len_beyond_its_decoder_and_audio_rows_for_a_text_model(
    whisper: Path, whisper_students, audio, tiny_checkpoint, tmp_path: Path, capsys
) -> None:
    err = refused(["distill", str(whisper), str(whisper_students[2]), str(tmp_path / "out"), "--data", str(audio["transcribed"]), "--seq-len", "64"], capsys)
    assert "--seq-len 64 exceeds the decoder's 32 positions (max_target_positions)" in err
    t5 = tiny_checkpoint("t5", **BYTES)
    student = convert(t5, tmp_path / "t5-kv2", 2, method="mean", progress=False)
    err = refused(["distill", str(t5), str(student), str(tmp_path / "out"), "--data", str(audio["transcribed"]), "--seq-len", "32"], capsys)
    assert "row 1 names audio, which only Whisper reads" in err
    assert not (tmp_path / "out").exists()


# -- resume after kill -9, two processes = one (the decoders' tests in test_distill) ---------------


@pytest.fixture(scope="module")
def t5(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("t5-distill")
    teacher = tiny_checkpoint("t5", **BYTES)
    (text := folder / "train.txt").write_text(corpus.train_text()[:60_000])
    return {"teacher": teacher, "text": text, "kv2": convert(teacher, folder / "kv2", 2, method="mean", progress=False),
            "kv8": convert(teacher, folder / "kv8", 8, method="mean", progress=False)}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["t5", "whisper"])
def test_resume_after_kill_9_equals_an_uninterrupted_run(family: str, t5: dict[str, Path], whisper: Path, whisper_students, audio, tmp_path: Path) -> None:
    """T5 on text; Whisper on a folder of WAVs, so the resumed run's targets are the teacher's transcripts again."""
    teacher, student, data = (t5["teacher"], t5["kv2"], t5["text"]) if family == "t5" else (whisper, whisper_students[2], audio["clips"])
    seq_len = "32" if family == "t5" else "16"
    options = ["--data", str(data), "--steps", "40", "--seq-len", seq_len, "--batch-size", "2", "--eval-windows", "2", "--save-every", "4"]
    run_distill(str(teacher), str(student), str(tmp_path / "whole"), *options)
    out, state = tmp_path / "resumed", tmp_path / ".resumed.distill-state"
    killed_env = {**subprocess_env(), "TMPDIR": str(tmp_path)}  # a killed run's scratch folder stays here, not where other tests' commands would report it
    proc = subprocess.Popen(distill_command(str(teacher), str(student), str(out), *options), env=killed_env)
    deadline = time.monotonic() + 120
    while not any(state.glob("step-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL and not out.exists() and any(state.glob("step-*"))
    subprocess.run(distill_command(str(teacher), str(student), str(out), *options, "--resume"), check=True, env=killed_env)
    whole, resumed = read_tensors(tmp_path / "whole"), read_tensors(out)
    assert any(not torch.equal(whole[k], read_tensors(student)[k]) for k in whole)  # training moved something
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert distilled(out)["final_eval"] == distilled(tmp_path / "whole")["final_eval"] and not state.exists()


@pytest.mark.slow
def test_whisper_two_processes_give_the_single_process_result(whisper: Path, whisper_students, audio, tmp_path: Path) -> None:
    """On a folder of WAVs, under torchrun and FSDP2: each process transcribes its own half of every batch with the teacher."""
    options = ["--data", str(audio["clips"]), "--steps", "4", "--seq-len", "16", "--eval-windows", "2", "--lr", "1e-2"]
    teacher, student = str(whisper), str(whisper_students[2])
    run_distill(teacher, student, str(tmp_path / "one"), *options, "--batch-size", "4")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29544"]
    (config := tmp_path / "fsdp.yaml").write_text(FSDP2_CONFIG.replace("29533", "29545"))
    fsdp = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    one = read_tensors(tmp_path / "one")
    assert max(float((one[k] - read_tensors(whisper_students[2])[k]).abs().max()) for k in one) > 1e-3  # training did something
    for name, launcher in (("torchrun", torchrun), ("fsdp", fsdp)):
        run_distill(teacher, student, str(tmp_path / name), *options, "--batch-size", "2", launcher=launcher)
        two = read_tensors(tmp_path / name)
        assert relative_difference(one, two, read_tensors(whisper_students[2])) < 1e-3, name
        assert distilled(tmp_path / name)["processes"] == 2 and distilled(tmp_path / name)["data"]["targets"] == TEACHER_TARGETS


@pytest.mark.slow
def test_t5_two_processes_give_the_single_process_result(t5: dict[str, Path], tmp_path: Path) -> None:
    """torchrun, accelerate launch and accelerate launch with an FSDP2 config: 2 CPU processes (gloo) with half
    the batch each = 1 process with the whole batch; under FSDP a kv = heads student stays bit-identical."""
    teacher, student = str(t5["teacher"]), str(t5["kv2"])
    options = ["--data", str(t5["text"]), "--steps", "4", "--seq-len", "32", "--eval-windows", "2", "--lr", "1e-2"]
    run_distill(teacher, student, str(tmp_path / "one"), *options, "--batch-size", "4")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29541"]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29542"]  # fmt: skip
    (config := tmp_path / "fsdp.yaml").write_text(FSDP2_CONFIG.replace("29533", "29543"))
    fsdp = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    one = read_tensors(tmp_path / "one")
    assert max(float((one[k] - read_tensors(t5["kv2"])[k]).abs().max()) for k in one) > 1e-3  # training did something
    for name, launcher in (("torchrun", torchrun), ("accelerate", accelerate), ("fsdp", fsdp)):
        run_distill(teacher, student, str(tmp_path / name), *options, "--batch-size", "2", launcher=launcher)
        two = read_tensors(tmp_path / name)
        assert relative_difference(one, two, read_tensors(t5["kv2"])) < 1e-3, name
        assert distilled(tmp_path / name)["processes"] == 2 and distilled(tmp_path / name)["tokens"] == distilled(tmp_path / "one")["tokens"]
        assert distilled(tmp_path / name)["fsdp"] is (name == "fsdp")
    run_distill(teacher, str(t5["kv8"]), str(tmp_path / "fsdp-kv8"), *options, "--batch-size", "2", launcher=fsdp)
    before, after = read_tensors(t5["kv8"]), read_tensors(tmp_path / "fsdp-kv8")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
