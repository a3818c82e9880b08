"""The quality zoo's models: the offline corpus they learn from and a seeded recipe per model.

Corpus: the Python standard library's own sources and docstrings (`sysconfig.get_paths()["stdlib"]`,
every `*.py` outside tests, bundled wheels, codec tables and lib2to3; `pydoc_data/topics.py` is one
of them), one file after another in sorted path order, byte-level tokens (vocabulary 256, like the
embedded model). A file is held out when `zlib.crc32(its relative path) % 10 == 0`. Its size and
sha256 go into every model's training.json: they are the same wherever the same Python version is.

A model is a checkpoint folder under the zoo cache ($HEADFOLD_ZOO, default ~/.cache/headfold-zoo/NAME):
config.json, model.safetensors, the embedded model's byte-level tokenizer files (so `headfold convert`
calibrates on text) and training.json (recipe, corpus, pre-training tokens, held-out perplexity,
weights sha256). It is trained in a temporary folder beside it and renamed into place when complete.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import shutil
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from headfold import corpus
from headfold.converter.checkpoint import CheckpointFacts
from headfold.demo import default_model_path

CACHE = Path(os.environ.get("HEADFOLD_ZOO", Path.home() / ".cache" / "headfold-zoo"))
SKIPPED = frozenset({"test", "tests", "idle_test", "site-packages", "encodings", "ensurepip", "lib2to3", "__pycache__"})
SEPARATOR = "\n\n"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
EVAL_WINDOWS, EVAL_WINDOW = 128, 256  # held-out windows spread evenly over the held-out split


# -- the corpus ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    train: str
    heldout: str
    facts: dict

    def ids(self, split: str) -> torch.Tensor:
        """The split's byte-level token ids (as corpus.encode, without a 10-million-item list)."""
        return torch.frombuffer(bytearray(getattr(self, split).encode()), dtype=torch.uint8).long()


def _heldout(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % 10 == 0


@functools.cache
def stdlib_corpus(root: str | None = None) -> Corpus:
    """The standard library's sources, split by file; deterministic for one Python version."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p.relative_to(base).as_posix() for p in base.rglob("*.py") if not SKIPPED & set(p.relative_to(base).parts[:-1]))
    text = {f: (base / f).read_bytes().decode("utf-8", errors="replace") for f in files}
    train = SEPARATOR.join(text[f] for f in files if not _heldout(f))
    heldout = SEPARATOR.join(text[f] for f in files if _heldout(f))
    facts = {
        "source": f"Python {platform.python_version()} standard library *.py (sysconfig stdlib), outside {', '.join(sorted(SKIPPED))}",
        "split": "held out: zlib.crc32(relative path) % 10 == 0; files joined in sorted path order with a blank line",
        "tokenizer": "byte-level, token id = UTF-8 byte (vocab 256)",
        "files": len(files),
        "heldout_files": sum(map(_heldout, files)),
        "train_bytes": len(train.encode()),
        "heldout_bytes": len(heldout.encode()),
        "sha256": hashlib.sha256((train + "\0" + heldout).encode()).hexdigest(),
    }
    return Corpus(train, heldout, facts)


def spread_windows(ids: torch.Tensor, window: int = EVAL_WINDOW, count: int = EVAL_WINDOWS) -> torch.Tensor:
    """`count` non-overlapping windows evenly spaced over `ids` (all of them when it holds fewer): [count, window]."""
    count = min(count, len(ids) // window)
    if count == 0:
        raise ValueError(f"text of {len(ids)} tokens is shorter than one window of {window}")
    step = (len(ids) - window) // max(1, count - 1) if count > 1 else 0
    return torch.stack([ids[i * step : i * step + window] for i in range(count)])


# -- the members --------------------------------------------------------------------------------------

BYTES = dict(vocab_size=corpus.VOCAB_SIZE, bos_token_id=None, eos_token_id=None, pad_token_id=None)
T5_BYTES = dict(vocab_size=corpus.VOCAB_SIZE, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)  # bytes 0 and 1 never occur in the text


@dataclass(frozen=True)
class Member:
    """One zoo model: a transformers class, its config and the recipe that trains it."""

    name: str
    family: str  # what it is there for, in a few words
    model_class: str
    config_class: str
    config: dict
    steps: int
    batch_size: int = 8
    seq_len: int = 256  # tokens per training window (an encoder-decoder: source half, target half)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 2
    seq2seq: bool = False
    log_every: int = 25
    eval_windows: int = EVAL_WINDOWS  # held-out windows scored (training.json's perplexity and zoo.py quality)
    extra: dict = field(default_factory=dict)  # anything else the recipe records

    @property
    def pretraining_tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len

    def build(self) -> transformers.PreTrainedModel:
        config = getattr(transformers, self.config_class)(**self.config)
        return getattr(transformers, self.model_class)(config).float()


def _llama(name: str, family: str, heads: int, hidden: int, **more) -> Member:
    config = dict(BYTES, hidden_size=hidden, intermediate_size=512, num_hidden_layers=4, num_attention_heads=heads, num_key_value_heads=heads,
                  max_position_embeddings=512, tie_word_embeddings=True, **more)  # fmt: skip
    return Member(name, family, "LlamaForCausalLM", "LlamaConfig", config, steps=512)


# Widths: heads of a meaningful size at about a million tokens each, small enough that the zoo trains
# on a shared 2-core machine (the cost goes with the parameters: the two 512-wide Llamas are the largest).
MEMBERS: dict[str, Member] = {
    m.name: m
    for m in (
        _llama("llama-16h", "RoPE Llama, 16 heads", heads=16, hidden=512),
        _llama("llama-hd64", "RoPE Llama, head_dim 64", heads=8, hidden=512),
        Member("gpt2", "GPT-2, learned positions, fused c_attn", "GPT2LMHeadModel", "GPT2Config",
               dict(BYTES, n_embd=384, n_inner=512, n_layer=4, n_head=12, n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
               steps=512, lr=1.5e-3),
        Member("neox", "GPT-NeoX, partial rotary (25 %), interleaved fused QKV", "GPTNeoXForCausalLM", "GPTNeoXConfig",
               dict(BYTES, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, rotary_pct=0.25,
                    max_position_embeddings=512, hidden_dropout=0.0, attention_dropout=0.0), steps=512, lr=1.5e-3),
        Member("bloom", "BLOOM, ALiBi", "BloomForCausalLM", "BloomConfig",
               dict(BYTES, hidden_size=256, n_layer=4, n_head=8, hidden_dropout=0.0, attention_dropout=0.0), steps=512, lr=1.5e-3),
        Member("t5", "T5, decoder self- and cross-attention (relative position bias)", "T5ForConditionalGeneration", "T5Config",
               dict(T5_BYTES, d_model=256, d_kv=32, d_ff=512, num_layers=4, num_decoder_layers=4, num_heads=8, dropout_rate=0.0),
               steps=512, lr=1.5e-3, seq2seq=True, extra={"objective": "each window's first half is the source, its second half the target"}),
    )
}  # fmt: skip


# -- training -----------------------------------------------------------------------------------------


def lr_factor(step: int, m: Member) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` (as examples/train_default_model.py)."""
    if step < m.warmup_steps:
        return (step + 1) / m.warmup_steps
    progress = (step - m.warmup_steps) / max(1, m.steps - m.warmup_steps)
    return m.min_lr_ratio + (1 - m.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def loss_of(model: torch.nn.Module, windows: torch.Tensor, seq2seq: bool) -> torch.Tensor:
    """Mean next-token cross-entropy (nats/byte): a decoder's over each window; an encoder-decoder's
    over the target half, read after the source half (labels shift right behind decoder_start_token_id)."""
    if seq2seq:
        half = windows.shape[1] // 2
        return model(input_ids=windows[:, :half], labels=windows[:, half:].contiguous(), use_cache=False).loss
    logits = model(input_ids=windows[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, batch: torch.Tensor, seq2seq: bool, chunk: int = 16) -> float:
    model.eval()
    return sum(loss_of(model, part, seq2seq).item() * len(part) for part in batch.split(chunk)) / len(batch)


def train(m: Member, folder: Path, text: Corpus, log=print) -> dict:
    """Train `m` on the corpus' training split and save it to `folder`; its training.json record."""
    torch.manual_seed(m.seed)
    torch.set_num_threads(m.threads)
    torch.use_deterministic_algorithms(True)
    model = m.build()
    data = text.ids("train")
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": m.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=m.lr, betas=m.betas)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, m))
    gen = torch.Generator().manual_seed(m.seed)
    span = m.seq_len if m.seq2seq else m.seq_len + 1  # a decoder's window predicts seq_len tokens
    recent: list[float] = []
    start, cpu, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    model.train()
    for step in range(m.steps):
        starts = torch.randint(0, len(data) - span, (m.batch_size,), generator=gen).tolist()
        loss = loss_of(model, torch.stack([data[s : s + span] for s in starts]), m.seq2seq)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), m.grad_clip)
        optimizer.step()
        schedule.step()
        recent = (recent + [loss.item()])[-m.log_every :]
        if (step + 1) % m.log_every == 0 or step + 1 == m.steps:
            elapsed = time.perf_counter() - start
            eta = elapsed / (step + 1) * (m.steps - step - 1)
            log(f"{m.name}: step {step + 1}/{m.steps}  loss {sum(recent) / len(recent):.4f}  {elapsed:.0f}s, eta {eta:.0f}s")
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    load = (load, os.getloadavg()[0])
    heldout = heldout_loss(model, spread_windows(text.ids("heldout"), count=m.eval_windows), m.seq2seq)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copyfile(default_model_path() / name, folder / name)
    facts = CheckpointFacts.read(folder)
    recipe = {k: v for k, v in asdict(m).items() if k not in ("config", "extra")} | m.extra
    return {
        "name": m.name,
        "family": m.family,
        "model_class": m.model_class,
        "heads": facts.heads,
        "head_dim": facts.head_dim,
        "layers": f"{m.config['num_layers']}+{m.config['num_decoder_layers']}" if m.seq2seq else facts.layers,
        "hidden": facts.hidden,
        "parameters": sum(p.numel() for p in model.parameters()),
        "recipe": recipe,
        "pretraining_tokens": m.pretraining_tokens,
        "corpus": text.facts,
        "train_epochs": round(m.pretraining_tokens / len(data), 3),
        "train_wall_seconds": round(seconds, 1),
        "train_cpu_seconds": round(cpu, 1),  # on a shared machine the robust figure: an idle machine's wall time is about this / threads
        "load_average": f"{load[0]:.1f} before, {load[1]:.1f} after, {os.cpu_count()} CPUs",
        "torch_threads": m.threads,
        "final_train_loss_nats_per_byte": round(sum(recent) / len(recent), 4),
        "heldout_cross_entropy_nats_per_byte": round(heldout, 4),
        "heldout_perplexity": round(math.exp(heldout), 4),
        "heldout_windows": m.eval_windows,
        "heldout_eval": f"{m.eval_windows} windows of {EVAL_WINDOW} bytes spread evenly over the held-out split"
        + (", each: first half the source, second half the target" if m.seq2seq else ""),
        "weights_sha256": sha256(folder / "model.safetensors"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
    }


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ready(name: str, cache: Path = CACHE) -> Path | None:
    """The model's folder when it is complete (training.json is written last, before the rename)."""
    folder = cache / name
    return folder if (folder / "training.json").is_file() else None


def ensure(m: Member, cache: Path = CACHE, log=print) -> Path:
    """The model's folder, trained first when it is missing; written into a temporary folder and renamed into place."""
    if found := ready(m.name, cache):
        return found
    cache.mkdir(parents=True, exist_ok=True)
    scratch = cache / f".{m.name}.partial-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    record = train(m, scratch, stdlib_corpus(), log)
    (scratch / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    if found := ready(m.name, cache):  # another process finished it meanwhile (same seed, same weights): keep theirs
        shutil.rmtree(scratch)
        return found
    os.replace(scratch, cache / m.name)
    log(f"{m.name}: ready, held-out perplexity {record['heldout_perplexity']}, {record['train_wall_seconds']} s, sha256 {record['weights_sha256'][:16]}…")
    write_index(cache)
    return cache / m.name


def write_index(cache: Path = CACHE) -> None:
    """INDEX.md: one line per ready model."""
    header = ["name", "family", "heads", "head_dim", "layers", "tokens", "held-out ppl", "train wall s", "train CPU s", "sha256"]
    lines = ["# headfold quality zoo (benchmarks/zoo.py train)", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for folder in sorted(p for p in cache.iterdir() if (p / "training.json").is_file()):
        r = json.loads((folder / "training.json").read_text())
        cells = [r["name"], r["family"], r["heads"], r["head_dim"], r["layers"], r["pretraining_tokens"], r["heldout_perplexity"], r["train_wall_seconds"],
                 r["train_cpu_seconds"], r["weights_sha256"][:16] + "…"]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    scratch = cache / f".INDEX.md.{os.getpid()}"
    scratch.write_text("\n".join(lines) + "\n")
    os.replace(scratch, cache / "INDEX.md")


def toy(m: Member, steps: int = 3) -> Member:
    """A few steps of a narrow copy of `m` (tests): same family and head count, head_dim 8, 2 layers."""
    heads = next(m.config[k] for k in ("num_attention_heads", "n_head", "num_heads") if k in m.config)
    narrow = {"hidden_size": 8 * heads, "n_embd": 8 * heads, "d_model": 8 * heads, "d_kv": 8, "intermediate_size": 16 * heads, "n_inner": 16 * heads,
              "d_ff": 16 * heads, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "num_decoder_layers": 2}  # fmt: skip
    return replace(m, config={k: narrow.get(k, v) for k, v in m.config.items()}, steps=steps, batch_size=2, warmup_steps=1, threads=1, eval_windows=8)


def kv_counts(spec: str, heads: int) -> dict[str, int]:
    """'h/2,h/4,1' → {'h/2': heads // 2, 'h/4': heads // 4, 'MQA': 1}, leaving out counts that do not
    divide the heads or repeat an earlier one (the zoo's and method_parts' kv counts)."""
    out: dict[str, int] = {}
    for part in spec.split(","):
        kv = heads // int(part[2:]) if part.startswith("h/") else int(part)
        label = "MQA" if kv == 1 else part
        if kv >= 1 and heads % kv == 0 and kv not in out.values():
            out[label] = kv
    return out
