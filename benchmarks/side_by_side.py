"""Side by side in onnxruntime-genai: headfold's default folder against the model builder's, same checkpoint.

A random-weights Llama (hidden size ≠ vocabulary: the builder takes any Linear with out_features ==
vocab_size for the LM head) and its kv = h/4 conversion (mean pooling) become og folders twice per
--precision: `headfold export` (the default folder: GroupQueryAttention with a shared K/V buffer,
ORT's fusions; `--dtype int4` for int4) and `python -m onnxruntime_genai.models.builder -p
fp32|int4 -e cpu`. For each precision, model, --batch and --past, every folder generates
--new-tokens greedy tokens after a random prompt of `past` tokens, the two exporters back to back in
--rounds rounds (A B, then B A: load from other processes falls on both alike); each
generate_next_token after the prompt's is one decode step. Reported: the median step (ms) and
tokens/s (batch ÷ median step), the median CPU time the process spent per step (robust to waits on a
shared machine), headfold's tokens/s over the builder's (median of the rounds' ratios; also by CPU
time), and for headfold's folders the MHA → h/4 decode speed-up beside the ideal one, the ratio of
the bytes a step moves (weights read + the K/V cache read + the new K/V written; the embedding table
is only gathered from, so it is left out). --profile adds ONNX Runtime's profile of decode steps in
both fp32 h/4 folders and in headfold's standard-Attention graph (plain ORT, the cache carried as og
carries it: one shared buffer per layer, or present fed back as past): each op type's share of a step's
kernel time (per op type the median over the steps), and the op types of the graph ORT runs after its own
optimizer. Prints tables and writes JSON (benchmarks/results/side_by_side.json).

    python -m benchmarks.side_by_side [--layers 4] [--heads 16] [--head-dim 64] [--vocab 2048] [--precision fp32 int4]
        [--batch 1 8] [--past 512 2048] [--new-tokens 32] [--rounds 2] [--threads 2] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import onnxruntime_genai as og
import torch

from benchmarks.generate_throughput import _set_threads, random_llama
from headfold import convert
from headfold.graphs.export import export
from headfold.ground.cache_names import PAST, is_cache
from headfold.verification.decoding import past_from_present
from headfold.verification.runners import SharedKvCache

RESULTS = Path(__file__).parent / "results" / "side_by_side.json"
EXPORTERS = ("builder", "headfold")
STANDARD = "headfold --attention onnx"  # profiled beside them: the standard Attention graph, present fed back as past
FP32_BYTES = 4


def build_with_og(checkpoint: Path, out: Path, precision: str, cache: Path) -> Path:
    """og's own model builder, its defaults (int4: block 32, symmetric, accuracy level 4 on CPU)."""
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", checkpoint, "-o", out, "-p", precision, "-e", "cpu", "-c", cache]
    subprocess.run([str(c) for c in command], check=True, capture_output=True, text=True)
    return out


def make_folders(checkpoint: Path, root: Path, precision: str) -> dict[str, Path]:
    folders = {
        "builder": build_with_og(checkpoint, root / f"{checkpoint.name}-{precision}-builder", precision, root / "cache"),
        "headfold": root / f"{checkpoint.name}-{precision}-headfold",
    }
    export(checkpoint, folders["headfold"], dtype="int4" if precision == "int4" else "fp32", progress=False)
    return folders


def decode_steps(folder: Path, batch: int, past: int, new_tokens: int, vocab: int) -> dict:
    """og: a random prompt of `past` tokens per row, then `new_tokens` greedy steps, each timed."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    total = past + new_tokens
    params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=batch)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(np.random.default_rng(0).integers(3, vocab, (batch, past)).astype(np.int32))
    generator.generate_next_token()
    prompt_s, steps, cpu = time.perf_counter() - start, [], []
    while not generator.is_done():
        start, start_cpu = time.perf_counter(), time.process_time()
        generator.generate_next_token()
        steps.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    step = float(np.median(steps))
    return {
        "prompt_s": round(prompt_s, 3), "steps": len(steps), "step_ms": round(1e3 * step, 3), "tokens_per_s": round(batch / step, 1),
        "cpu_ms": round(1e3 * float(np.median(cpu)), 3),  # the process's CPU time per step: what a loaded machine's waits leave out
    }  # fmt: skip


def step_bytes(folder: Path, config: dict, batch: int, past: int, new_tokens: int) -> float:
    """Bytes one decode step moves: the weights it reads (the data file but the embedding table, which
    it only gathers from), the cache it reads (at the steps' mean length) and the K/V it writes."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * FP32_BYTES  # K and V, fp32 cache
    weights = (folder / "model.onnx.data").stat().st_size - config["vocab_size"] * config["hidden_size"] * FP32_BYTES
    return weights + batch * kv_per_token * (past + new_tokens / 2 + 1)


class ConcatCache:
    """The standard graph's cache, as og runs it: present fed back as the next step's past."""

    def __init__(self, session: ort.InferenceSession, batch: int) -> None:
        self.session, self.names = session, [o.name for o in session.get_outputs()]
        self.past = {i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32) for i in session.get_inputs() if is_cache(i.name, PAST)}

    def infer(self, feed: dict) -> dict:
        out = dict(zip(self.names, self.session.run(None, {**feed, **self.past}), strict=True))
        self.past = past_from_present(out)
        return out


def profile(folder: Path, batch: int, past: int, steps: int, vocab: int, threads: int) -> dict[str, float]:
    """Each op type's share of the kernel time of a decode step (ORT's profiler; per op type the median
    over `steps` steps, the prompt left out); the K/V cache carried as genai_config.json tells og to
    (one shared buffer, or present → past)."""
    options = ort.SessionOptions()
    options.enable_profiling, options.intra_op_num_threads = True, threads
    options.profile_file_prefix = str(folder / "profile")
    session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    genai = json.loads((folder / "genai_config.json").read_text())
    if genai["search"]["past_present_share_buffer"]:
        cache = SharedKvCache(session, batch, past + steps, genai["model"]["decoder"]["head_size"])
    else:
        cache = ConcatCache(session, batch)
    ids = np.random.default_rng(0).integers(3, vocab, (batch, past))
    logits = cache.infer({"input_ids": ids, "attention_mask": np.ones_like(ids)})["logits"]
    for step in range(steps):
        mask = np.ones((batch, past + step + 1), dtype=np.int64)
        logits = cache.infer({"input_ids": logits[:, -1].argmax(-1)[:, None].astype(np.int64), "attention_mask": mask})["logits"]
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[1:]  # the prompt's run left out
    per_step = [collections.Counter() for _ in runs]
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            step = next((i for i, (start, end) in enumerate(runs) if start <= event["ts"] <= end), None)
            if step is not None:
                per_step[step][event["args"]["op_name"]] += event["dur"]
    # the median step's time per op type: a step the machine's load stretched counts once, not in full
    median = {op: float(np.median([step[op] for step in per_step])) for op in set().union(*per_step)}
    total = sum(median.values())
    shares = {op: round(us / total, 4) for op, us in sorted(median.items(), key=lambda item: -item[1])}
    return shares | {"kernel_us_per_step": round(total, 1)}


def optimized_ops(folder: Path) -> dict[str, int]:
    """The op types of the graph ONNX Runtime runs (after its own optimizer, CPU): what a step executes, free of timing noise."""
    import onnx

    options = ort.SessionOptions()
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.onnx.data")
    options.log_severity_level = 3
    ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    nodes = onnx.load(folder / "optimized.onnx", load_external_data=False).graph.node
    return dict(collections.Counter(n.op_type for n in nodes).most_common()) | {"nodes": len(nodes)}


def median_ratio(values: list[float]) -> float:
    return round(float(np.median(values)), 3)


def summarize(rows: list[dict]) -> list[dict]:
    """Per (precision, model, batch, past): each exporter's median step and tokens/s, headfold's over the builder's."""
    cells = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        cells[r["precision"], r["model"], r["batch"], r["past"]][r["exporter"], r["round"]] = r
    summary = []
    for (precision, model, batch, past), cell in cells.items():
        rounds = sorted({rnd for _, rnd in cell})
        entry = {"precision": precision, "model": model, "batch": batch, "past": past, "rounds": len(rounds)}
        for exporter in EXPORTERS:
            for metric in ("step_ms", "tokens_per_s", "cpu_ms"):
                entry[f"{exporter}_{metric}"] = median_ratio([cell[exporter, rnd][metric] for rnd in rounds])
        ratios = [cell["headfold", rnd]["tokens_per_s"] / cell["builder", rnd]["tokens_per_s"] for rnd in rounds]
        cpu = [cell["builder", rnd]["cpu_ms"] / cell["headfold", rnd]["cpu_ms"] for rnd in rounds]
        entry |= {
            "headfold_vs_builder": median_ratio(ratios),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "headfold_vs_builder_cpu": median_ratio(cpu),
        }
        summary.append(entry)
    return summary


def gqa_speedups(summary: list[dict], bytes_moved: dict) -> list[dict]:
    """headfold's MHA → h/4 decode speed-up per (precision, batch, past) beside the ideal bytes ratio, and
    the builder's folders' own (the same kernels: what the runtime gives, whoever wrote the graph)."""
    step = {(s["precision"], s["model"], s["batch"], s["past"]): s for s in summary}
    out = []
    for (precision, batch, past), moved in bytes_moved.items():
        mha, gqa = step[precision, "MHA", batch, past], step[precision, "GQA h/4", batch, past]
        measured, cpu = mha["headfold_step_ms"] / gqa["headfold_step_ms"], mha["headfold_cpu_ms"] / gqa["headfold_cpu_ms"]
        builder, ideal = mha["builder_step_ms"] / gqa["builder_step_ms"], moved["MHA"] / moved["GQA h/4"]
        out.append({"precision": precision, "batch": batch, "past": past, "speedup": round(measured, 3), "speedup_cpu": round(cpu, 3),
                    "ideal_bytes_ratio": round(ideal, 3), "of_ideal": round(measured / ideal, 3),
                    "builder_speedup": round(builder, 3), "builder_of_ideal": round(builder / ideal, 3)})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--precision", nargs="+", default=["fp32", "int4"], choices=["fp32", "int4"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--past", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="the two exporters back to back per round, who goes first alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="ORT's per-op profile of both fp32 h/4 folders")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    rows, bytes_moved, profiles = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        positions = 2 * (max(args.past) + args.new_tokens)
        mha = random_llama(root / "MHA", args.layers, args.heads, args.head_dim, args.vocab, positions)
        models = {"MHA": mha, "GQA h/4": convert(mha, root / "GQA-h4", args.heads // 4, method="mean", progress=False)}
        for precision in args.precision:
            for model, checkpoint in models.items():
                folders = make_folders(checkpoint, root, precision)
                config = json.loads((checkpoint / "config.json").read_text())
                for folder in folders.values():
                    _set_threads(folder, args.threads)
                for batch in args.batch:
                    for past in args.past:
                        bytes_moved.setdefault((precision, batch, past), {})[model] = step_bytes(folders["headfold"], config, batch, past, args.new_tokens)
                        for round_ in range(args.rounds):
                            order = EXPORTERS if round_ % 2 == 0 else EXPORTERS[::-1]
                            for exporter in order:
                                result = decode_steps(folders[exporter], batch, past, args.new_tokens, args.vocab)
                                rows.append({"precision": precision, "model": model, "exporter": exporter, "batch": batch, "past": past, "round": round_,
                                             **result, "load_1min": round(os.getloadavg()[0], 1)})  # fmt: skip
                                print(json.dumps(rows[-1]), flush=True)
                if args.profile and precision == "fp32" and model == "GQA h/4":  # and the standard graph beside them
                    folders[STANDARD] = root / "standard"
                    export(checkpoint, folders[STANDARD], attention="onnx", progress=False)
                    past = min(args.past)
                    profiles = {exporter: profile(folder, 1, past, args.new_tokens, args.vocab, args.threads) for exporter, folder in folders.items()}
                    profiles["setup"] = f"fp32, GQA h/4, batch 1, {past} past tokens, {args.new_tokens} decode steps"
                    profiles["optimized_ops"] = {exporter: optimized_ops(folder) for exporter, folder in folders.items()}
    summary = summarize(rows)
    speedups = gqa_speedups(summary, bytes_moved)
    print(f"\n{'precision':9} {'model':8} {'batch':>5} {'past':>5} {'builder tok/s':>13} {'headfold tok/s':>14} {'ratio':>6}")
    for s in summary:
        print(
            f"{s['precision']:9} {s['model']:8} {s['batch']:>5} {s['past']:>5} {s['builder_tokens_per_s']:>13} {s['headfold_tokens_per_s']:>14} "
            f"{s['headfold_vs_builder']:>6}"
        )
    for s in speedups:
        print(f"{s['precision']} batch {s['batch']} past {s['past']}: MHA → h/4 {s['speedup']}× of ideal {s['ideal_bytes_ratio']}× ({s['of_ideal']:.0%})")
    machine = f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), onnxruntime {ort.__version__}, onnxruntime-genai {og.__version__}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine, "args": {**vars(args), "out": str(args.out)}, "rows": rows, "summary": summary, "gqa_speedup": speedups, "profile": profiles}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
