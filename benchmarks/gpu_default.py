"""The default conversion on one CUDA GPU: a generated 7B layout end to end, and the same quality as on the CPU.

    python -m benchmarks.gpu_default [--root DIR] [--layers 32] [--kv-heads 8] [--models embedded]

Two parts, each in fresh processes, written to benchmarks/results/gpu_default.json (standard rows):

- **7B layout**: a generated bf16 checkpoint in Llama-2-7B's shapes (benchmarks/export_at_scale.py's:
  hidden 4096, 32 heads, intermediate 11008, vocab 32000; all-MiniLM's tokenizer, so the default
  calibrates on the built-in text) converted to `--kv-heads` with the default method and its default
  budget on `cuda` ($HEADFOLD_DEVICE): wall and CPU seconds, peak RSS, peak GPU memory (torch's
  max_memory_allocated) and the steps `local` took per layer (headfold.json).
- **Quality**: each of `--models` (benchmarks/method_parts.py's names; default the embedded decoder,
  which needs no training) converted to h/4 with the default on the CPU and on the GPU; the held-out
  KL of each, which should agree within `--tolerance` (relative): the fit's arithmetic differs (another
  summation order, no TF32: torch's default), not its maths.

Needs a CUDA GPU that torch sees (exit 2 otherwise) and about 3 × 13.5 GB of disk under --root.
Run it where a GPU is lent; docs/scaling.md says whether it has run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from benchmarks.export_at_scale import SHAPE  # noqa: E402
from benchmarks.export_throughput import _copy_tokenizer  # noqa: E402
from tests.support.synthetic import llama_checkpoint  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "gpu_default.json"
CONVERT = """
import json, re, sys, time
from pathlib import Path
import torch
from headfold import convert  # the API: calibrates on the built-in text, as the command does
start, cpu = time.perf_counter(), time.process_time()
out = convert(sys.argv[1], sys.argv[2], int(sys.argv[3]), progress=True)
wall, cpu = time.perf_counter() - start, time.process_time() - cpu
hwm_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
local = json.loads((out / "headfold.json").read_text())["conversion"]["calibration"]["local"]
steps = [layer["steps"] for layer in local["layers"].values()]
print(json.dumps({"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "peak_rss_gb": round(hwm_kb * 1024 / 1e9, 2),
                  "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2), "local_steps_mean": round(sum(steps) / len(steps), 1)}))
"""
QUALITY = """
import json, sys, tempfile
from pathlib import Path
from benchmarks import method_parts
from headfold.converter.recipes import DEFAULT_LOCAL_STEPS, DEFAULT_METHOD
with tempfile.TemporaryDirectory() as tmp:
    (row,) = method_parts.rows_for(method_parts.model(sys.argv[1]), [DEFAULT_METHOD], "h/4", DEFAULT_LOCAL_STEPS, Path(tmp))
print(json.dumps(row))
"""


def child(code: str, *args: str, device: str) -> dict:
    """The last line of a fresh Python running `code` on `device`, as JSON (its progress goes to our stderr)."""
    env = {**os.environ, "HEADFOLD_DEVICE": device, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)  # benchmarks importable
    if done.returncode:
        sys.exit(f"{code.strip().splitlines()[0]}… on {device} failed ({done.returncode}); its error is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="where the generated checkpoint and its conversion go")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--models", default="embedded", help="models whose CPU and GPU conversions are compared ('' for none)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="largest relative difference of the held-out KL, GPU against CPU")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "gpu_default.py: no CUDA GPU visible to torch: run it where a GPU is lent\n")
    rows, device = [], torch.cuda.get_device_name(0)
    for name in filter(None, args.models.split(",")):
        cpu, gpu = (child(QUALITY, name, device=d) for d in ("cpu", "cuda"))
        agree = abs(gpu["kl"] - cpu["kl"]) <= args.tolerance * cpu["kl"]
        rows.append({"part": "quality", "model": name, "kv_heads": cpu["kv_heads"], "kl_cpu": cpu["kl"], "kl_gpu": gpu["kl"], "agree": agree,
                     "convert_s_cpu": cpu["convert_s"], "convert_s_gpu": gpu["convert_s"]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    root = args.root or Path(tempfile.mkdtemp(prefix="gpu-default-"))
    source, converted = root / "source", root / "converted"
    if not (root / "source.json").is_file():
        shutil.rmtree(source, ignore_errors=True)
        sizes = llama_checkpoint(source, dtype=torch.bfloat16, num_hidden_layers=args.layers, num_key_value_heads=SHAPE["num_attention_heads"], **SHAPE)
        _copy_tokenizer(source)
        (root / "source.json").write_text(json.dumps(sizes))
    shutil.rmtree(converted, ignore_errors=True)
    measured = child(CONVERT, str(source), str(converted), str(args.kv_heads), device="cuda")
    rows.append({"part": "7B layout, default method", "layers": args.layers, "kv_heads": args.kv_heads, **measured})
    print(json.dumps(rows[-1]), flush=True)
    what = (
        "the default method on one CUDA GPU (benchmarks/gpu_default.py): a generated 7B-layout bf16 checkpoint converted end to end "
        "(wall and CPU seconds, peak RSS, peak GPU memory allocated by torch, mean local steps per layer), and trained models converted "
        f"to h/4 on the CPU and on the GPU (held-out KL of each; agree: within {args.tolerance:.0%}); {device}, "
        f"{platform.machine()} with {os.cpu_count()} cores"
    )
    RESULTS.write_text(json.dumps({"what": what, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
