"""Whisper's distillation data: clips read from WAV files, log-mel features, and a transcript per clip.

`--data` (and `--eval-data`) for an audio encoder-decoder is either
- a `.jsonl` file whose rows are {"audio": "clips/a.wav", "text": "its transcript"}, each path
  relative to the file's folder and resolving inside it; or
- a folder of `.wav` files (found recursively, in name order) without transcripts: the teacher's own
  greedy transcript of each clip (teacher.generate) is its target.
WAVs are read with the stdlib `wave` module: 16-bit PCM at the feature extractor's sampling rate, more
than one channel mixed down to their mean. Every clip's header is checked before anything runs, so
a bad file is one line and nothing is written. Features come from transformers' WhisperFeatureExtractor
(the checkpoint's preprocessor_config.json, or one built from config.json's num_mel_bins), each clip
cut or padded with silence to the encoder's frames. A window is one clip: its features and its
target's token ids, cut or filled with ABSENT to --seq-len.
"""

from __future__ import annotations

import hashlib
import random
import wave
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from transformers import WhisperFeatureExtractor

from headfold.converter.checkpoint import CheckpointFacts
from headfold.distillation.data import ABSENT, AUDIO_FIELD, TEXT_FIELD, Encoder, encoder_for, shuffled
from headfold.ground.errors import BadInput, first_line
from headfold.ground.inputs import check_links, contained, parse_json, read_json_object, shown

PREPROCESSOR = "preprocessor_config.json"
PCM_BYTES = 2  # 16-bit samples
PROMPT_TOKENS = 4  # the most tokens Whisper's generate puts before a transcript
TEACHER_TARGETS = "the teacher's greedy transcripts"
DATA_TARGETS = "the transcripts in the data"
FORMS = 'a .jsonl whose rows are {"audio": "relative/path.wav", "text": "transcript"}, or a folder of .wav files (the teacher transcribes them)'


def fix_wav(rate: int) -> str:
    return f"convert it to 16-bit PCM at {rate} Hz, e.g. ffmpeg -i in.wav -ac 1 -ar {rate} -c:a pcm_s16le out.wav"


# -- WAV files ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WavHeader:
    rate: int
    channels: int
    frames: int


def wav_header(path: Path, rate: int) -> WavHeader:
    """The header of a WAV that headfold reads; BadInput naming the file and the fix for anything else."""
    if not path.is_file():
        raise BadInput(f"audio {path} does not exist or is not a regular file; {FORMS}")
    if path.stat().st_size == 0:
        raise BadInput(f"audio {path} is empty; remove it or give it audio")
    try:
        with wave.open(str(path), "rb") as f:
            header, width = WavHeader(f.getframerate(), f.getnchannels(), f.getnframes()), f.getsampwidth()
    except (wave.Error, EOFError) as err:  # not RIFF/WAVE, truncated, or a format wave does not decode (float, μ-law)
        raise BadInput(f"audio {path} is not a PCM WAV file ({err or 'it ends early'}); {fix_wav(rate)}") from None
    if width != PCM_BYTES:
        raise BadInput(f"audio {path} is {8 * width}-bit PCM, and headfold reads 16-bit; {fix_wav(rate)}")
    if header.frames == 0:
        raise BadInput(f"audio {path} holds no samples; remove it or give it audio")
    if header.rate != rate:
        raise BadInput(
            f"audio {path} is sampled at {header.rate} Hz, and the feature extractor takes {rate} Hz; resample it, e.g. ffmpeg -i in.wav -ar {rate} out.wav"
        )
    return header


def read_wav(path: Path, rate: int, limit: int) -> np.ndarray:
    """Up to `limit` samples of a WAV as float32 in [-1, 1), channels mixed down (what is past `limit` the features cut anyway)."""
    header = wav_header(path, rate)
    with wave.open(str(path), "rb") as f:
        data = f.readframes(min(header.frames, limit))
    whole = len(data) // (PCM_BYTES * header.channels) * PCM_BYTES * header.channels  # a file cut mid-frame: its whole frames
    samples = np.frombuffer(data[:whole], dtype="<i2").astype(np.float32) / 32768.0
    return samples.reshape(-1, header.channels).mean(1)


# -- features -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Features:
    """Log-mel features of clips, each cut or padded to the encoder's frames."""

    extractor: WhisperFeatureExtractor
    samples: int  # audio samples the encoder's frames cover
    described: str

    @property
    def rate(self) -> int:
        return self.extractor.sampling_rate

    def __call__(self, paths: list[Path]) -> torch.Tensor:
        """[clips, mel bins, frames]."""
        waves = [read_wav(p, self.rate, self.samples) for p in paths]
        encoded = self.extractor(waves, sampling_rate=self.rate, max_length=self.samples, truncation=True, padding="max_length", return_tensors="pt")
        return encoded.input_features


def features_for(facts: CheckpointFacts) -> Features:
    """The checkpoint's WhisperFeatureExtractor (its preprocessor_config.json), or one built from num_mel_bins."""
    folder, bins = facts.folder, facts.mel_bins
    fix = f"restore {PREPROCESSOR} from the original checkpoint"
    if (path := folder / PREPROCESSOR).is_file():
        try:
            loaded = WhisperFeatureExtractor.from_dict(read_json_object(path, fix))
            assert isinstance(loaded, WhisperFeatureExtractor)  # from_dict returns the extractor alone unless asked for the unused keys
            extractor = loaded
        except (TypeError, ValueError, ZeroDivisionError) as err:  # values of the wrong type or size
            raise BadInput(f"{path} is not a Whisper feature extractor's settings ({type(err).__name__}: {first_line(err)}); {fix}") from None
        described = f"{path.name} of {folder}"
    else:
        extractor = WhisperFeatureExtractor(feature_size=bins)
        described = f"built from config.json's num_mel_bins ({folder} has no {PREPROCESSOR})"
    if extractor.feature_size != bins:
        raise BadInput(f"{path} gives {extractor.feature_size} mel bins, config.json's num_mel_bins {bins}; {fix}")
    return Features(extractor, facts.audio_frames * extractor.hop_length, described)


# -- clips and their sources --------------------------------------------------------------------


@dataclass(frozen=True)
class AudioSource:
    """Clips and their transcripts (None: the teacher transcribes the clip)."""

    name: str
    sha256: str
    clips: tuple[tuple[Path, str | None], ...]

    @property
    def teacher_targets(self) -> bool:
        return any(text is None for _, text in self.clips)


def _digest(folder: Path, paths: list[Path], listing: Path | None = None) -> str:
    """sha256 of the listing (a .jsonl) and of each clip's name and bytes: a resumed run's data must be the same."""
    digest = hashlib.sha256()
    for path, named in ([(listing, False)] if listing else []) + [(p, True) for p in paths]:
        if named:
            digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def audio_source(path: Path, option: str, rate: int) -> AudioSource:
    """A transcript .jsonl or a folder of WAVs, every clip's header checked; BadInput for anything else."""
    if not path.exists():
        raise BadInput(f"{option} {path} does not exist; pass {FORMS}")
    if path.is_dir():
        return _wav_folder(path, option, rate)
    if path.suffix.lower() != ".jsonl" or not path.is_file():
        raise BadInput(f"{option} {path}: Whisper distills on audio; pass {FORMS}")
    clips = tuple(_transcribed_clips(path, option, rate))
    return AudioSource(str(path), _digest(path.parent, [c for c, _ in clips], path), clips)


def _wav_folder(folder: Path, option: str, rate: int) -> AudioSource:
    check_links(folder, "audio folder")
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() == ".wav" and p.is_file())
    if not paths:
        raise BadInput(f"{option} {folder} holds no .wav files; pass {FORMS}")
    for clip in paths:
        wav_header(clip, rate)
    return AudioSource(str(folder), _digest(folder, paths), tuple((p, None) for p in paths))


def _transcribed_clips(path: Path, option: str, rate: int) -> Iterator[tuple[Path, str]]:
    fix = f'give every line an object {{"{AUDIO_FIELD}": "relative/path.wav", "{TEXT_FIELD}": "transcript"}}'
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = parse_json(line, f"{option} {path} line {number}", fix)
            audio, text = (row.get(AUDIO_FIELD), row.get(TEXT_FIELD)) if isinstance(row, dict) else (None, None)
            if not isinstance(audio, str) or not isinstance(text, str) or not text:
                raise BadInput(f"{option} {path} line {number} is {shown(row)}; {fix}")
            clip = contained(path.parent, audio, f"{path.name} line {number}", "keep the audio inside the folder of the .jsonl, named relative to it")
            wav_header(clip, rate)
            yield clip, text


# -- windows and batches ------------------------------------------------------------------------


@dataclass(frozen=True)
class AudioBatch:
    """Clips' features [clips, mel bins, frames] and their targets' ids [clips, seq_len] (None: not transcribed yet)."""

    features: torch.Tensor
    ids: torch.Tensor | None

    def to(self, device) -> AudioBatch:
        return AudioBatch(self.features.to(device), None if self.ids is None else self.ids.to(device))

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, clips: slice) -> AudioBatch:
        return AudioBatch(self.features[clips], None if self.ids is None else self.ids[clips])

    def split(self, rows: int) -> Iterator[AudioBatch]:
        for start in range(0, len(self), rows):
            yield AudioBatch(self.features[start : start + rows], None if self.ids is None else self.ids[start : start + rows])


Batch = torch.Tensor | AudioBatch  # what the objective runs on: windows of token ids [rows, seq_len], or clips


def transcript_encoder(folder: Path, vocab_size: int, start: int) -> Encoder:
    """A transcript's target ids as the tokenizer frames a text (Whisper's: <|startoftranscript|>, the
    language/task/no-timestamps tokens it is set to, the text, <|endoftext|>), less the start token that
    teacher forcing puts first; byte-level checkpoints without a tokenizer: the text's bytes."""
    framed = encoder_for(folder, vocab_size, encoder_model=True)  # encoder_model: framed by the special tokens

    def wrap(ids: list[int]) -> list[int]:
        ids = framed.wrap(ids)
        return ids[1:] if ids[:1] == [start] else ids

    return replace(framed, wrap=wrap)


def filled(ids: list[int], seq_len: int) -> list[int]:
    ids = ids[:seq_len]
    return ids + [ABSENT] * (seq_len - len(ids))


@torch.no_grad()
def teacher_transcripts(teacher: torch.nn.Module, features: torch.Tensor, seq_len: int, rows: int) -> torch.Tensor:
    """The teacher's greedy transcripts of `features` as targets [clips, seq_len]: what follows its start
    token up to and with its end-of-text token, filled with ABSENT."""
    from transformers import WhisperForConditionalGeneration  # the one audio family: imported where it runs

    assert isinstance(teacher, WhisperForConditionalGeneration)
    eos, targets = teacher.generation_config.eos_token_id, []
    eos = set(eos if isinstance(eos, list) else [eos])
    # Whisper's generate refuses new tokens past max_target_positions less its prompt (start, language, task, no-timestamps)
    new = min(seq_len, teacher.config.max_target_positions - PROMPT_TOKENS)
    for chunk in features.split(rows):
        out = teacher.generate(input_features=chunk, max_new_tokens=new, do_sample=False, num_beams=1, return_dict_in_generate=True)
        for sequence in out.sequences[:, 1:].tolist():  # [0]: the decoder's start token
            end = next((i + 1 for i, token in enumerate(sequence) if token in eos), len(sequence))
            targets.append(filled(sequence[:end], seq_len))
    return torch.tensor(targets, dtype=torch.long, device=features.device)


@dataclass(frozen=True)
class AudioPlan:
    """WindowPlan's counterpart for audio: which clips train and which evaluate; checked before anything runs."""

    train: AudioSource
    heldout: AudioSource | None  # None: the first `eval_windows` clips of `train` are held out
    encoder: Encoder
    features: Features
    seq_len: int
    eval_windows: int
    seed: int

    @property
    def skip(self) -> int:
        return self.eval_windows if self.heldout is None else 0

    @property
    def notes(self) -> dict[str, str]:
        """What the manifest's data entry adds: where the targets and the features come from."""
        teacher = self.train.teacher_targets or (self.heldout is not None and self.heldout.teacher_targets)
        return {"targets": TEACHER_TARGETS if teacher else DATA_TARGETS, "features": self.features.described}

    def _example(self, clip: tuple[Path, str | None]) -> tuple[Path, list[int] | None]:
        path, text = clip
        return path, None if text is None else filled(self.encoder.wrap(self.encoder.encode(text)), self.seq_len)

    def collate(self, examples: list[tuple[Path, list[int] | None]]) -> AudioBatch:
        targets = [ids for _, ids in examples]
        ids = None if any(t is None for t in targets) else torch.tensor(targets, dtype=torch.long)
        return AudioBatch(self.features([path for path, _ in examples]), ids)

    def complete(self, batch: AudioBatch, teacher: torch.nn.Module, rows: int) -> AudioBatch:
        """The batch with targets: the teacher's transcripts where the data has none."""
        return batch if batch.ids is not None else AudioBatch(batch.features, teacher_transcripts(teacher, batch.features, self.seq_len, rows))

    def batch(self, rows: list[tuple[Path, list[int] | None]], device: torch.device, teacher: torch.nn.Module, per_pass: int) -> AudioBatch:
        """Clips of the stream as the objective's input on `device`, with targets (WindowPlan.batch)."""
        return self.complete(self.collate(rows).to(device), teacher, per_pass)

    def held_out(self, count: int, device: torch.device, teacher: torch.nn.Module, per_pass: int) -> AudioBatch:
        """The first `count` held-out clips as `batch` gives clips."""
        return self.complete(self.eval_batch()[:count].to(device), teacher, per_pass)

    def eval_batch(self) -> AudioBatch:
        clips = (self.heldout or self.train).clips[: self.eval_windows]
        return self.collate([self._example(c) for c in clips])

    def train_windows(self, skip: int = 0) -> Iterator[tuple[Path, list[int] | None]]:
        """Training clips forever (a new seeded shuffle per epoch), after dropping the first `skip` (resume)."""

        def epochs() -> Iterator[tuple[Path, list[int] | None]]:
            for epoch in range(1 << 62):
                rng = random.Random(f"{self.seed}:{epoch}")
                yield from shuffled(map(self._example, self.train.clips[self.skip :]), rng)

        return islice(epochs(), skip, None)

    def repeated(self, needed: int) -> int | None:
        available = len(self.train.clips) - self.skip
        return available if available <= needed else None

    def check(self) -> None:
        """BadInput when no clip is left to train on after the held-out ones (every clip's header is checked already)."""
        if len(self.train.clips) <= self.skip:
            raise BadInput(
                f"--data {self.train.name} has only {len(self.train.clips)} clip(s), all needed as the {self.eval_windows} held-out ones; "
                "give more clips, a smaller --eval-windows, or --eval-data"
            )


def audio_sha256(student: CheckpointFacts, data: Path, option: str) -> str:
    """The sha256 a run records for audio `data` (what `headfold run` keys its distill stage on)."""
    return audio_source(Path(data), option, features_for(student).rate).sha256


def audio_plan(student: CheckpointFacts, vocab_size: int, data: Path | None, eval_data: Path | None, seq_len: int, eval_windows: int, seed: int) -> AudioPlan:
    """Training and held-out clips for an audio encoder-decoder (there is no built-in audio)."""
    if data is None:
        raise BadInput(f"--data is required: Whisper distills on audio, {FORMS}")
    limit = student.config.get("max_target_positions")
    if limit and seq_len > limit:
        raise BadInput(f"--seq-len {seq_len} exceeds the decoder's {limit} positions (max_target_positions); choose at most {limit}")
    features = features_for(student)
    train = audio_source(Path(data), "--data", features.rate)
    heldout = audio_source(Path(eval_data), "--eval-data", features.rate) if eval_data is not None else None
    encoder = transcript_encoder(student.folder, vocab_size, student.config["decoder_start_token_id"])
    return AudioPlan(train, heldout, encoder, features, seq_len, eval_windows, seed)
