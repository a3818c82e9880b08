"""The GQA paper's shape on a tiny T5: MHA vs mean-pooled GQA h/2, h/4 and MQA, before and after distillation.

Trains a small byte-level T5 here (seeded; 8 heads of 16 dims, relative positions) on the offline
corpus' training split with a continuation objective: each 256-byte window's first half is the
source, its second half the target. Its pre-training tokens are steps × batch × window (source and
target). Then, for kv = h/2, h/4 and 1, `convert --method mean` with the default --pool (the
decoder's self- and cross-attention; the encoder keeps MHA) and one distillation from the original
on 5 % of the pre-training tokens, read before training, at 1 % on the way (one LR schedule over the
5 % run, as distill_recovery.py does) and at its end: KL(original ‖ converted) per target token,
perplexity of the target and top-1 agreement on held-out (source, target) windows, headfold's
distillation scores (the same split as `headfold verify`: first half → second half).
Last, each model's decoder.onnx (headfold.export) in ONNX Runtime on CPU: one decoder step at batch 8
with a 512-byte source and a short prompt in the self cache (median of steps, variants interleaved),
with the self- and cross-cache bytes per token (headfold.inspect). Prints the rows and writes
benchmarks/results/seq2seq_recovery.json.

    python -m benchmarks.seq2seq_recovery [--train-steps 800] [--budgets 0.01,0.05] [--eval-windows 64] [--runs 200]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

import headfold
from benchmarks.decode_latency import interleaved_medians, session
from headfold import corpus
from headfold.distillation import distill  # headfold.distill without eval_at: the scores on the way
from headfold.distillation.run import default_batch_size
from headfold.graphs.seq2seq import ENCODER_MASK, cross_names, self_names
from headfold.ground.cache_names import PAST, PRESENT

HEADS, WIDTH, HEAD_DIM, LAYERS, WINDOW, TRAIN_BATCH = 8, 128, 16, 4, 256, 16
CONFIG = dict(vocab_size=corpus.VOCAB_SIZE, d_model=WIDTH, d_kv=HEAD_DIM, d_ff=4 * WIDTH, num_layers=LAYERS, num_decoder_layers=LAYERS,
              num_heads=HEADS, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)  # fmt: skip  # bytes 0 and 1 never occur in the text
RESULTS = Path(__file__).parent / "results" / "seq2seq_recovery.json"


def train(folder: Path, steps: int, seed: int = 0) -> dict:
    """The tiny T5, AdamW on random training-split windows (source → continuation); saved to `folder`."""
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**CONFIG))
    data = torch.tensor(corpus.encode(corpus.train_text()))
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    start, half = time.perf_counter(), WINDOW // 2
    model.train()
    for _ in range(steps):
        batch = torch.stack([data[s : s + WINDOW] for s in (rng.randrange(len(data) - WINDOW) for _ in range(TRAIN_BATCH))])
        loss = model(input_ids=batch[:, :half], labels=batch[:, half:].contiguous()).loss  # labels shift right behind decoder_start_token_id
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad()
    model.eval().save_pretrained(folder)
    return {
        "pretraining_tokens": steps * TRAIN_BATCH * WINDOW,
        "train_steps": steps,
        "train_s": round(time.perf_counter() - start, 1),
        "final_train_loss": round(loss.item(), 4),
    }


def quality_rows(source: Path, kv: int, tmp: Path, text: dict[str, Path], pretraining: int, args) -> tuple[list[dict], Path]:
    """kv's mean-pooled conversion scored training-free and after each budget, from one distillation of the last."""
    student = headfold.convert(source, tmp / f"kv{kv}", kv, "mean", progress=False)
    batch = default_batch_size(round(args.budgets[-1] * pretraining), WINDOW)  # what `--tokens` of the largest budget gets
    steps = [round(b * pretraining / (batch * WINDOW)) for b in args.budgets]
    began = time.perf_counter()
    out = distill(
        source,
        student,
        tmp / f"kv{kv}-distilled",
        data=text["train"],
        eval_data=text["heldout"],
        steps=steps[-1],
        batch_size=batch,
        seq_len=WINDOW,
        eval_every=steps[-1],
        eval_at=tuple(steps[:-1]),
        eval_windows=args.eval_windows,
        progress=False,
    )
    seconds = round(time.perf_counter() - began, 1)
    evals = {e["step"]: e for e in json.loads((out / "distill-log.json").read_text())["eval"]}
    rows = []
    for budget, step in zip((0.0, *args.budgets), (0, *steps), strict=True):
        e = evals[step]
        rows.append(
            {
                "model": f"GQA-{kv}" if kv > 1 else "MQA",
                "kv_heads": kv,
                "distilled": f"{budget:.0%}",
                "distill_tokens": step * batch * WINDOW,
                "kl": e["kl"],
                "target_ppl": e["ppl"],
                "ppl_increase": e["ppl_increase"],
                "top1": e["top1"],
                "teacher_ppl": e["teacher_ppl"],
                **({"distill_s": seconds} if step == steps[-1] else {}),
            }
        )
    return rows, out


def decoder_feeds(export: Path, kv: int, args) -> dict[str, np.ndarray]:
    """One decoder step's feed: batch rows of a `args.source`-byte held-out source through encoder.onnx
    (its cross K/V), then a `args.prompt`-token prompt through decoder.onnx (the self cache it appends to)."""
    ids = np.array(corpus.encode(corpus.heldout_text())[: args.batch * args.source], dtype=np.int64).reshape(args.batch, args.source)
    mask = np.ones_like(ids)
    encoder = session(export / "encoder.onnx", args.threads)
    cross = dict(zip(cross_names(PAST, LAYERS), encoder.run(cross_names(PRESENT, LAYERS), {"input_ids": ids, "attention_mask": mask}), strict=True))
    decoder = session(export / "decoder.onnx", args.threads)
    empty = {name: np.zeros((args.batch, kv, 0, HEAD_DIM), np.float32) for name in self_names(PAST, LAYERS)}
    prompt = np.concatenate([np.zeros((args.batch, 1), np.int64), ids[:, : args.prompt - 1]], 1)  # decoder_start_token_id, then text
    past = decoder.run(self_names(PRESENT, LAYERS), {"input_ids": prompt, ENCODER_MASK: mask, **empty, **cross})
    return {"input_ids": ids[:, args.prompt : args.prompt + 1], ENCODER_MASK: mask, **dict(zip(self_names(PAST, LAYERS), past, strict=True)), **cross}


def latency_rows(models: dict[int, Path], tmp: Path, args) -> dict[int, dict]:
    """Per kv: ms per decoder step of the exported decoder.onnx, the speed-up over MHA and the cache bytes per token."""
    sessions, feeds = {}, {}
    for kv, folder in models.items():
        export = tmp / f"onnx-kv{kv}"
        headfold.export(folder, export, progress=False)
        sessions[kv], feeds[kv] = session(export / "decoder.onnx", args.threads), decoder_feeds(export, kv, args)
    medians = interleaved_medians(sessions, feeds, args.warmup, args.runs)
    caches = headfold.inspect(models[HEADS], candidates=list(models), progress=False).cache_bytes_per_token
    return {
        kv: {
            "decoder_step_ms": round(step * 1e3, 3),
            "speedup_vs_mha": round(medians[HEADS] / step, 2),
            "self_cache_bytes_per_token": caches[kv]["self"]["after"],
            "cross_cache_bytes_per_token": caches[kv]["cross"]["after"],
        }
        for kv, step in medians.items()
    }


def what(args, training: dict) -> str:
    return (
        f"A byte-level T5 ({LAYERS}+{LAYERS} layers, d_model {WIDTH}, {HEADS} heads of {HEAD_DIM}) trained by this script on the offline corpus "
        f"({training['pretraining_tokens']} pre-training tokens: {training['train_steps']} steps of {TRAIN_BATCH} windows of {WINDOW} "
        "bytes, the first half the source, "
        f"the second the target), mean-pooled in the decoder's self- and cross-attention. KL, target perplexity and top-1 to the original on "
        f"{args.eval_windows} held-out windows, training-free and after distilling that share of the pre-training tokens (one run of the "
        "largest, read on the way); "
        f"decoder.onnx step at batch {args.batch}, {args.source}-byte source, {args.prompt}-token prompt in the self cache, ONNX Runtime CPU, "
        f"{args.threads} thread(s), median of {args.runs}; cache bytes per token (self: per target token, cross: per source token), fp32"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-steps", type=int, default=800)
    parser.add_argument("--budgets", type=lambda text: tuple(map(float, text.split(","))), default=(0.01, 0.05), help="fractions of the pre-training tokens")
    parser.add_argument("--kv", default=f"{HEADS // 2},{HEADS // 4},1")
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows of 256 bytes (the split has 167)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--source", type=int, default=512, help="source bytes in the latency measurement")
    parser.add_argument("--prompt", type=int, default=16, help="decoder tokens in the self cache before the timed step")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="training and distillation (more threads than free cores oversubscribe a shared machine and run far slower)",
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="seq2seq-recovery-") as name:
        tmp = Path(name)
        text = {"train": tmp / "train.txt", "heldout": tmp / "heldout.txt"}
        text["train"].write_text(corpus.train_text())
        text["heldout"].write_text(corpus.heldout_text())
        training = train(tmp / "mha", args.train_steps)
        print(f"trained: {training}", flush=True)
        rows, models = [], {HEADS: tmp / "mha"}
        for kv in map(int, args.kv.split(",")):
            kv_rows, models[kv] = quality_rows(tmp / "mha", kv, tmp, text, training["pretraining_tokens"], args)
            rows += kv_rows
            for r in kv_rows:
                print(
                    f"{r['model']:6} distilled {r['distilled']:>3}: KL {r['kl']:.4f}  target ppl {r['target_ppl']:.3f} (MHA "
                    f"{r['teacher_ppl']:.3f})  top-1 {r['top1']:.1%}",
                    flush=True,
                )
        mha = {"model": "MHA", "kv_heads": HEADS, "distilled": "", "kl": 0.0, "target_ppl": rows[0]["teacher_ppl"], "ppl_increase": 0.0, "top1": 1.0}
        latency = latency_rows(models, tmp, args)
    rows = [mha, *rows]
    for r in rows:
        r.pop("teacher_ppl", None)
        if r["distilled"] in ("", "0%"):  # latency and cache size: one per model, on its training-free row
            r.update(latency[r["kv_heads"]])
            print(
                f"{r['model']:6} decoder step {r['decoder_step_ms']:.3f} ms ({r['speedup_vs_mha']:.2f}×)  cache B/token self "
                f"{r['self_cache_bytes_per_token']}, cross {r['cross_cache_bytes_per_token']}"
            )
    machine = (
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; torch {args.torch_threads} thread(s); "
        f"training {training['train_s']} s, final train loss {training['final_train_loss']}"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"what": what(args, training), "machine": machine, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
