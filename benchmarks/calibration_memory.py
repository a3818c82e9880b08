"""Peak memory and time of a data-aware conversion: layer-by-layer calibration vs the whole model.

Converts a generated Llama-layout checkpoint (see convert_throughput.py; default the 1.29 GB fp16
one of issue 14: hidden 2048, 16 heads, 10 layers, vocab 32000) with `aligned+grouped+refit` on
4096 calibration tokens, in a fresh process per run, and reports wall time split into
calibration and the rest, CPU seconds (all threads, imports included; robust on a shared
machine where wall time is not), the process's peak RSS and the bound
"2 × largest fp32 layer + calibration activations + 500 MB". `--whole-model` also runs the
previous path (the whole fp32 model loaded, hooks on every layer) for comparison; `--baseline
TREE` also converts with an older headfold source tree (e.g. `git archive REV | tar -x -C TREE`)
for before/after figures. The load average is recorded: on a shared machine compare CPU seconds.
Prints a table and writes JSON (default benchmarks/results/calibration_memory.json).

    python -m benchmarks.calibration_memory [--layers 10] [--tokens 4096] [--whole-model] [--baseline TREE] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import torch

from benchmarks.convert_throughput import MB, checkpoint

CHILD = """
import json, re, sys, time
from pathlib import Path
import torch
from headfold import Calibration, convert
from headfold.converter import calibration, conversion

src, out, tokens, whole = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "whole"
spent = {}

def whole_model(ckpt, batch, progress=True):  # the path before layer-by-layer calibration
    from headfold.converter.modeling import load_model
    model = load_model(ckpt.folder, dtype=torch.float32)
    captured = [[] for _ in range(ckpt.layers)]
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.q_proj.register_forward_hook(lambda m, a, o, i=i: captured[i].append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for rows in batch.split(8):
            model(input_ids=rows)
    return [torch.cat(c) for c in captured]

def timed_inputs(*args, **kwargs):
    start, cpu = time.perf_counter(), time.process_time()
    inputs = real(*args, **kwargs)
    spent["calibration_s"], spent["calibration_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
    return inputs

real = calibration.attention_inputs
for module in (calibration, conversion):  # conversion imported it by name in older trees
    if hasattr(module, "attention_inputs"):
        module.attention_inputs = timed_inputs
if whole:
    calibration.calibrate = whole_model
start = time.perf_counter()
convert(src, out, 4, method="aligned+grouped+refit", calibration=Calibration(tokens=tokens), progress=False)
spent["total_s"] = time.perf_counter() - start
hwm_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
print(json.dumps({**spent, "cpu_s": time.process_time(), "peak_rss_mb": hwm_kb * 1024 / 1e6}))
"""


def laid_out(tree: Path, folder: Path) -> Path:
    """A folder whose headfold/ package is `tree` as its pyproject.toml's package-dir lays it out
    (links), to put first on PYTHONPATH so that `import headfold` finds that tree."""
    package_dir = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = folder / "headfold"
    root.mkdir(parents=True)
    for entry in (tree / package_dir["headfold"]).iterdir():
        (root / entry.name).symlink_to(entry.resolve())
    for name, path in package_dir.items():
        if name != "headfold":
            (root / name.removeprefix("headfold.")).symlink_to((tree / path).resolve())
    return folder


def run(src: Path, out: Path, tokens: int, whole: bool, tree: Path | None = None) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree else None
    argv = [sys.executable, "-c", CHILD, str(src), str(out), str(tokens), "whole" if whole else "layerwise"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(done.stderr)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["conversion_s"] = result["total_s"] - result["calibration_s"]
    return {k: round(v, 2 if k.endswith("_s") else 1) for k, v in result.items()}


# Llama layouts with MHA K/V (the converter's input): layers, hidden, MLP width, vocabulary.
LAYOUTS = {"7B": (32, 4096, 11008, 32000), "70B": (80, 8192, 28672, 32000), "405B": (126, 16384, 53248, 128256)}
GPU_FLOPS = 30e12  # assumed sustained fp32 matmul rate of one H100-class GPU (TF32 off): not measured here
DISK_BYTES_PER_S = 2e9  # assumed NVMe read rate for loading each layer: not measured here
HASH_BYTES_PER_S = 1.43e9  # sha256 on one core of the measuring machine (SHA-NI), measured
KV_WIDTH = 8 * 128  # the pooled K/V width of local's fitted layers: 8 kv heads of 128
STORE_RAM = 2 * 2**30  # $HEADFOLD_CALIBRATION_RAM's default: what a store keeps in RAM before it maps files


def scaling_plan(cpu_flops: float, conversion_s_per_layer: float, tokens: int) -> list[dict[str, object]]:
    """Extrapolated from the measured per-layer figures (docs/scaling.md states the formulas)."""
    rows = []
    for name, (layers, hidden, mlp, vocab) in LAYOUTS.items():
        params = 4 * hidden * hidden + 3 * hidden * mlp  # one layer's matmul weights
        flops = 2 * params * tokens  # one layer's forward over the calibration tokens
        convert_s = conversion_s_per_layer * (hidden / 2048) ** 2 * tokens / 4096
        activations = (layers + 1) * tokens * hidden * 4
        in_ram = min(activations, STORE_RAM)
        fitted = layers * 2 * (2 * hidden * hidden + 2 * hidden * KV_WIDTH)  # local's Q, O, K, V per layer in bf16, kept until written
        checkpoint = 2 * (layers * params + 2 * vocab * hidden)  # bf16
        rows.append({
            "model": name, "checkpoint_gb": round(checkpoint / 1e9),
            "mean_s": round(checkpoint / HASH_BYTES_PER_S), "mean_rss_gb": round((2 * 2 * params + 5e8) / 1e9, 1),
            "calibration_cpu_s": round(layers * flops / cpu_flops), "conversion_cpu_s": round(layers * convert_s),
            "calibration_gpu_s": round(layers * (flops / GPU_FLOPS + 2 * params / DISK_BYTES_PER_S)),
            "conversion_gpu_s": round(layers * convert_s * cpu_flops / GPU_FLOPS),
            "rss_gb": round((2 * 4 * params + in_ram + 5e8) / 1e9, 1), "disk_gb": round((activations - in_ram) / 1e9, 1),
            "local_disk_gb": round(max(fitted - STORE_RAM, 0) / 1e9, 1),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--dtype", default="float16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--whole-model", action="store_true", help="also run the previous whole-model calibration")
    parser.add_argument("--baseline", type=Path, help="also convert with this older headfold source tree")
    parser.add_argument("--keep", type=Path, help="make the checkpoint once in this folder and reuse it (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "calibration_memory.json")
    parser.add_argument("--replan", action="store_true", help="measure nothing: recompute the plan of the --json file from its own measurement")
    args = parser.parse_args()
    if args.replan:
        result = json.loads(args.json.read_text())
        result["scaling_plan"] = scaling_plan(result["cpu_flops"], result["conversion_s_per_layer"], result["tokens"])
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        return
    with tempfile.TemporaryDirectory(dir=args.keep or Path.cwd()) as tmp:
        src, sizes = checkpoint(args.keep or Path(tmp), args.layers, args.dtype, 1000)
        runs = {"layerwise": run(src, Path(tmp) / "layerwise", args.tokens, whole=False)}
        if args.whole_model:
            runs["whole_model"] = run(src, Path(tmp) / "whole", args.tokens, whole=True)
        if args.baseline:
            runs["baseline"] = run(src, Path(tmp) / "baseline", args.tokens, whole=False, tree=laid_out(args.baseline, Path(tmp) / "tree"))
    hidden = 2048
    fp32_layer = sizes["layer_bytes"] / getattr(torch, args.dtype).itemsize * 4
    activations = (args.layers + 1) * args.tokens * hidden * 4  # every layer's attention input + the hidden states
    result = {
        "checkpoint_gb": round(sizes["total_bytes"] / 1e9, 3), "layers": args.layers, "tokens": args.tokens,
        "largest_fp32_layer_mb": round(fp32_layer / MB, 1), "activations_mb": round(activations / MB, 1),
        "rss_bound_mb": round((2 * fp32_layer + activations) / MB + 500, 1),
        "load_average_1min": round(os.getloadavg()[0], 2), "cores": os.cpu_count(),
        **{f"{label}_{k}": v for label, r in runs.items() for k, v in r.items()},
    }  # fmt: skip
    layerwise = runs["layerwise"]
    params = 4 * hidden * hidden + 3 * hidden * 5632
    # per CPU-second: robust on a shared machine; an idle n-core machine's wall time is about CPU seconds / n
    result["cpu_flops"] = round(2 * params * args.tokens * args.layers / layerwise["calibration_cpu_s"])
    result["conversion_s_per_layer"] = round((layerwise["cpu_s"] - layerwise["calibration_cpu_s"]) / args.layers, 2)
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    plan = scaling_plan(result["cpu_flops"], result["conversion_s_per_layer"], args.tokens)
    for row in plan:
        print("  ".join(f"{k} {v}" for k, v in row.items()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({**result, "scaling_plan": plan}, indent=2) + "\n")


if __name__ == "__main__":
    main()
