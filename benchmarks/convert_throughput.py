"""Conversion throughput and peak memory on a generated ~1 GB Llama-layout checkpoint.

Compares `headfold convert` with a plain copy of the same files (both with a warm page
cache), and reports the converter's peak RSS against the bound "2 × largest layer + 500 MB".
Prints a table and writes JSON (default benchmarks/results/convert_throughput.json).

    python benchmarks/convert_throughput.py [--layers 8] [--kv-heads 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
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


def make_checkpoint(folder: Path, layers: int, dtype: torch.dtype, shard_bytes: int) -> dict[str, int]:
    """A Llama-layout checkpoint of random weights (hidden 2048, 16 heads, vocab 16000)."""
    config = transformers.LlamaConfig(
        vocab_size=16000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=16, tie_word_embeddings=False,
    )  # fmt: skip
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
    return {"layer_bytes": layer_bytes, "total_bytes": sum(torch.Size(s).numel() for s in shapes.values()) * dtype.itemsize}


def _save(shards: list[dict[str, torch.Tensor]], folder: Path, last: bool = False) -> None:
    save_file(shards[-1], folder / f"part-{len(shards):05d}.safetensors", metadata={"format": "pt"})
    shards[-1] = {name: None for name in shards[-1]}  # keep names, free tensors
    if last:
        files = sorted(folder.glob("part-*.safetensors"))
        names = [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
        weight_map = {}
        for part, name in zip(files, names):
            part.rename(folder / name)
        for shard, name in zip(shards, names):
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
print(json.dumps({"seconds": seconds, "peak_rss_mb": hwm_kb * 1024 / 1e6}))
"""


def drop_page_cache() -> bool:
    """Cold-cache runs need root; without it only warm-cache numbers are reported."""
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed_copy(src: Path, dst: Path) -> float:
    start = time.perf_counter()
    shutil.copytree(src, dst)
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start


def timed_convert(src: Path, dst: Path, kv_heads: int) -> dict[str, float]:
    """Seconds of convert() (interpreter start-up and imports excluded) and the process's peak RSS."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst), str(kv_heads)], check=True, capture_output=True, text=True)
    start = time.perf_counter()
    subprocess.run(["sync"], check=True)  # the copy is timed up to its data reaching disk too
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds_with_sync"] = result["seconds"] + time.perf_counter() - start
    return result


def measure(root: Path, kv_heads: int, cold: bool) -> dict[str, float]:
    """Copy and convert the same source, each after the same cache preparation."""
    runs = {}
    for label, action in (("copy", lambda: timed_copy(root / "src", root / "copy")), ("convert", lambda: timed_convert(root / "src", root / "out", kv_heads))):
        if cold:
            drop_page_cache()
        else:
            timed_copy(root / "src", root / "warmup")
            shutil.rmtree(root / "warmup")
        runs[label] = action()
    shutil.rmtree(root / "copy")
    shutil.rmtree(root / "out")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--shard-mb", type=int, default=400)
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "convert_throughput.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:
        root = Path(tmp)
        sizes = make_checkpoint(root / "src", args.layers, getattr(torch, args.dtype), args.shard_mb * 1_000_000)
        caches = ["warm"] + (["cold"] if drop_page_cache() else [])
        runs = {cache: measure(root, args.kv_heads, cache == "cold") for cache in caches}
    gb = sizes["total_bytes"] / 1e9
    result = {
        "checkpoint_gb": round(gb, 3), "dtype": args.dtype, "layers": args.layers, "kv_heads": args.kv_heads,
        "largest_layer_mb": round(sizes["layer_bytes"] / MB, 1),
        "peak_rss_mb": round(max(r["convert"]["peak_rss_mb"] for r in runs.values()), 1),
        "rss_bound_mb": round(2 * sizes["layer_bytes"] / MB + 500, 1),
    }  # fmt: skip
    for cache, r in runs.items():
        convert_s = r["convert"]["seconds_with_sync"]
        result[f"{cache}_copy_s"] = round(r["copy"], 2)
        result[f"{cache}_convert_s"] = round(convert_s, 2)
        result[f"{cache}_convert_gb_per_s"] = round(gb / convert_s, 3)
        result[f"{cache}_speed_vs_copy"] = round(r["copy"] / convert_s, 3)
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
