"""TensorRT engine latency of the embedded default model: prefill per batch, decode step per batch × past.

Each variant (the original MHA model and its conversions to --kv-heads) is exported, built with
`headfold build`'s code (one profile covering the measured shapes) and run with headfold's
TensorRT runner: median of --runs CUDA-event-timed executions per shape. Prints a table and writes
JSON. Without TensorRT or a GPU it says why, writes {"skipped": reason} and exits 0.

    python -m benchmarks.engine_latency [--kv-heads 8 2 1] [--batch 1 8] [--past 128 480] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from headfold.engines.env import engine_support


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2, 1], help="8 = the original MHA model")
    parser.add_argument("--precision", choices=("fp32", "fp16"), default="fp16")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seq", type=int, default=256, help="prefill length")
    parser.add_argument("--past", type=int, nargs="+", default=[128, 480])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--json", type=Path, default=Path("engine_latency.json"))
    return parser.parse_args()


def build_variant(kv: int, folder: Path, args: argparse.Namespace) -> Path:
    """Convert (unless kv is the model's own head count), export, build; the engine folder."""
    from headfold import convert
    from headfold.demo import default_model_path
    from headfold.engines.build import build
    from headfold.engines.env import Target
    from headfold.engines.plan import make_plan
    from headfold.graphs.export import export

    source = default_model_path()
    heads = json.loads((source / "config.json").read_text())["num_attention_heads"]
    checkpoint = source if kv == heads else convert(source, folder / "checkpoint", kv, "mean", progress=False)
    export(checkpoint, folder / "onnx", dtype=args.precision, progress=False, graphs="split")  # TensorRT builds the split pair
    batch, past = f"1:{max(args.batch)}:{max(args.batch)}", f"0:{max(args.past)}:{max(args.past)}"
    plan = make_plan(folder / "onnx", folder / "engines", Target.installed(), batch=batch, seq=f"1:{args.seq}:{args.seq}", past=past)
    build(plan)
    return folder / "engines"


def _median_ms(engine: Path, feed: dict[str, np.ndarray], runs: int) -> float:
    from headfold.verification.tensorrt_runner import TensorRTRunner

    with TensorRTRunner(engine, timed_runs=runs) as runner:
        runner.infer(feed)
        return runner.latencies[-1]


def _kv_shape(engine: Path) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) from the decode engine's sidecar profile."""
    from headfold.engines.sidecar import load_sidecar

    profile = load_sidecar(engine).profiles[0]
    keys = [name for name in profile if name.endswith(".key")]
    _, kv, _, dim = profile[keys[0]][0]
    return len(keys), kv, dim


def measure(engines: Path, kv: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    dtype = np.float16 if args.precision == "fp16" else np.float32
    layers, kv_heads, dim = _kv_shape(engines / "decode.engine")
    rows = []
    for batch in args.batch:
        ids = rng.integers(0, 256, (batch, args.seq), dtype=np.int64)
        prefill = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        rows.append({"kv_heads": kv, "graph": "prefill", "batch": batch, "tokens": args.seq, "ms": _median_ms(engines / "prefill.engine", prefill, args.runs)})
        for past in args.past:
            cache = {
                f"past_key_values.{i}.{k}": rng.standard_normal((batch, kv_heads, past, dim)).astype(dtype) for i in range(layers) for k in ("key", "value")
            }
            step = {"input_ids": ids[:, :1], "attention_mask": np.ones((batch, past + 1), np.int64), **cache}
            rows.append({"kv_heads": kv, "graph": "decode", "batch": batch, "tokens": past, "ms": _median_ms(engines / "decode.engine", step, args.runs)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'kv heads':>8}  {'graph':<7}  {'batch':>5}  {'seq/past':>8}  {'median ms':>10}"]
    lines += [f"{r['kv_heads']:>8}  {r['graph']:<7}  {r['batch']:>5}  {r['tokens']:>8}  {r['ms']:>10.4f}" for r in rows]
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    why_not = engine_support()
    if why_not:
        print(f"engine_latency: skipped, {why_not}")
        args.json.write_text(json.dumps({"skipped": why_not}) + "\n")
        return 0
    import tensorrt
    import torch

    rows = []
    with tempfile.TemporaryDirectory(prefix="headfold-engine-latency-") as tmp:
        for kv in args.kv_heads:
            rows += measure(build_variant(kv, Path(tmp) / f"kv{kv}", args), kv, args)
    print(table(rows))
    info = {"tensorrt": tensorrt.__version__, "gpu": torch.cuda.get_device_name(), "precision": args.precision, "runs": args.runs}
    args.json.write_text(json.dumps({**info, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
