"""ORT CPU decode-step latency of exported decode graphs: MHA vs GQA (kv = h/2, h/4) vs MQA.

For the embedded default model (when present) and a wider synthetic Llama (random weights, built
in-process): each variant is converted with headfold.converter.convert, its decode graph exported
with headfold.graphs.export (torch.onnx + rewrite passes, both timed), then one decode step is
timed at each past length: median of --runs after --warmup, variants interleaved, --threads
intra-op threads. Reports
latency per token, speed-up over MHA, KV-cache bytes per token, and the rewrite-pass time as a
share of torch's export time. Prints a table and writes JSON.

    python -m benchmarks.decode_latency [--past 128 512 2048] [--batch 1 8] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import transformers

from headfold import convert
from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.modeling import load_model
from headfold.demo import default_model_path
from headfold.graphs.export import decoder_graphs, export_graph


def synthetic_checkpoint(folder: Path, layers: int, heads: int, head_dim: int, vocab: int) -> Path:
    """A Llama of random weights (N(0, 0.02)): hidden = heads × head_dim, MLP 2.6875 × hidden (Llama-7B's ratio)."""
    hidden = heads * head_dim
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim, max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)  # HF init: N(0, initializer_range=0.02)
    return folder


def export_decode(checkpoint: Path, folder: Path) -> dict:
    """Export only the decode graph (the prefill graph is not timed); return export_graph's summary."""
    facts = CheckpointFacts.read(checkpoint)
    model, layers, kv_heads = load_model(facts), facts.layers, facts.kv_heads
    folder.mkdir(parents=True)
    decode = next(spec for spec in decoder_graphs(model, layers, "split") if spec.file == "decode.onnx")
    return export_graph(decode, folder, opset=23, kv_heads=kv_heads, layers=layers)


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def step_feeds(config: transformers.PretrainedConfig, batch: int, past: int) -> dict[str, np.ndarray]:
    """One new token per row after `past` cached positions (random K/V: latency does not depend on values)."""
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    rng = np.random.default_rng(0)
    feeds = {
        "input_ids": rng.integers(3, config.vocab_size, (batch, 1), dtype=np.int64),
        "attention_mask": np.ones((batch, past + 1), dtype=np.int64),
    }
    for i in range(config.num_hidden_layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = rng.standard_normal((batch, kv_heads, past, head_dim), dtype=np.float32)
    return feeds


def interleaved_medians(sessions: dict[int, ort.InferenceSession], feeds: dict[int, dict], warmup: int, runs: int) -> dict[int, float]:
    """Median step seconds per variant, timing the variants round-robin so that load from other
    processes on a shared CPU falls on all of them alike."""
    for kv, sess in sessions.items():
        for _ in range(warmup):
            sess.run(None, feeds[kv])
    times: dict[int, list[float]] = {kv: [] for kv in sessions}
    for _ in range(runs):
        for kv, sess in sessions.items():
            start = time.perf_counter()
            sess.run(None, feeds[kv])
            times[kv].append(time.perf_counter() - start)
    return {kv: statistics.median(t) for kv, t in times.items()}


def variants(src: Path, heads: int, folder: Path) -> dict[int, Path]:
    """kv-heads → checkpoint: the MHA source and its h/2, h/4 and MQA conversions."""
    targets = sorted({heads // 2, heads // 4, 1} - {0}, reverse=True)
    return {heads: src, **{kv: convert(src, folder / f"kv{kv}", kv, progress=False) for kv in targets}}


def bench_model(name: str, src: Path, folder: Path, args: argparse.Namespace) -> list[dict]:
    heads = transformers.AutoConfig.from_pretrained(src).num_attention_heads
    configs, sessions, exports = {}, {}, {}
    for kv, checkpoint in variants(src, heads, folder).items():
        exports[kv] = export_decode(checkpoint, folder / f"onnx-kv{kv}")
        configs[kv] = transformers.AutoConfig.from_pretrained(checkpoint)
        sessions[kv] = session(folder / f"onnx-kv{kv}" / "decode.onnx", args.threads)
    rows = []
    for batch in args.batch:
        for past in args.past:
            feeds = {kv: step_feeds(config, batch, past) for kv, config in configs.items()}
            medians = interleaved_medians(sessions, feeds, args.warmup, args.runs)
            for kv, step in medians.items():
                config = configs[kv]
                rows.append({
                    "model": name, "heads": heads, "kv_heads": kv, "batch": batch, "past": past,
                    "step_ms": round(step * 1e3, 3), "ms_per_token": round(step * 1e3 / batch, 3),
                    "kv_bytes_per_token": 2 * config.num_hidden_layers * kv * config.head_dim * 4,
                    "torch_export_s": exports[kv]["torch_export_s"], "rewrite_s": exports[kv]["rewrite_s"],
                })  # fmt: skip
    return _with_ratios(rows)


def _with_ratios(rows: list[dict]) -> list[dict]:
    """Speed-up of each row over the MHA row of the same model, batch and past length."""
    mha = {(r["model"], r["batch"], r["past"]): r["step_ms"] for r in rows if r["kv_heads"] == r["heads"]}
    for r in rows:
        r["speedup_vs_mha"] = round(mha[r["model"], r["batch"], r["past"]] / r["step_ms"], 2)
        r["rewrite_overhead_pct"] = round(100 * r["rewrite_s"] / r["torch_export_s"], 1)
    return rows


COLUMNS = ("model", "kv_heads", "batch", "past", "ms_per_token", "speedup_vs_mha", "kv_bytes_per_token", "torch_export_s", "rewrite_s", "rewrite_overhead_pct")


def format_table(rows: list[dict]) -> str:
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS}
    lines = ["  ".join(f"{c:>{widths[c]}}" for c in COLUMNS)]
    lines += ["  ".join(f"{str(r[c]):>{widths[c]}}" for c in COLUMNS) for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--past", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=2, help="synthetic model layers")
    parser.add_argument("--heads", type=int, default=32, help="synthetic model heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "decode_latency.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if (default_model_path() / "config.json").is_file():
            rows += bench_model("default", default_model_path(), Path(tmp) / "default", args)
        else:
            print(f"embedded default model not found at {default_model_path()}; synthetic model only")
        src = synthetic_checkpoint(Path(tmp) / "synthetic" / "src", args.layers, args.heads, args.head_dim, args.vocab)
        rows += bench_model(f"synthetic-{args.layers}L-{args.heads}x{args.head_dim}", src, Path(tmp) / "synthetic", args)
    result = {
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    print(format_table(rows))
    print(f"load average before {load_before[0]:.2f}, after {result['load_avg_after'][0]:.2f} ({os.cpu_count()} CPUs)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
