"""A 7B-layout checkpoint converted and exported on this machine: CPU time and peak memory per stage,
and the export's prompt logits checked against torch on a truncated copy.

    python -m benchmarks.export_at_scale [--root DIR] [--layers 32] [--kv-heads 8] [--check-layers 3]

The checkpoint is generated (random bf16 weights in Llama-2-7B's layout: hidden 4096, 32 heads,
intermediate 11008, vocab 32000, 32 layers; all-MiniLM's tokenizer), converted to GQA with
`headfold convert --method mean` (the default method calibrates through the whole model: hours on
two cores, not what this measures) and exported with `headfold export` (the checkpoint's dtype,
bf16). Each stage runs in a fresh process; CPU seconds from os.wait4, peak RSS from its VmHWM. The full model
does not run in torch here: the converted checkpoint's first `--check-layers` layers (embeddings,
final norm and head included) are copied into their own checkpoint, exported in fp32 (ONNX Runtime on
CPU has no bf16 kernels) and its prompt logits compared with torch's. Writes
benchmarks/results/export_at_scale.json in the standard rows shape.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.export_throughput import _copy_tokenizer, measured, python  # noqa: E402
from tests.support.synthetic import llama_checkpoint  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "export_at_scale.json"
SHAPE = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, vocab_size=32000)
CONVERT = "import sys; from headfold.converter import convert; convert(sys.argv[1], sys.argv[2], int(sys.argv[3]), method='mean', progress=False)"
EXPORT = (
    "import sys; from headfold.graphs.export import export; export(sys.argv[1], sys.argv[2], progress=False, dtype=sys.argv[3] if len(sys.argv) > 3 else None)"
)


def truncated(folder: Path, out: Path, layers: int) -> Path:
    """`folder`'s first `layers` layers with its embeddings, final norm and head, one tensor at a time."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            keep = {n: f.get_tensor(n) for n in f.keys() if not (m := re.match(r"model\.layers\.(\d+)\.", n)) or int(m.group(1)) < layers}
        if keep:
            save_file(keep, out / file.name, metadata={"format": "pt"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    names = {
        n: f for n, f in index["weight_map"].items() if (out / f).is_file() and (not (m := re.match(r"model\.layers\.(\d+)\.", n)) or int(m.group(1)) < layers)
    }
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    _copy_tokenizer(out)
    return out


def prompt_check(checkpoint: Path, graph: Path) -> dict[str, float]:
    """The merged graph's logits for a 2-row prompt (one left-padded) against torch's (fp32)."""
    import onnxruntime as ort

    from headfold.converter.modeling import load_model
    from headfold.graphs.export import positions_from_mask

    model = load_model(checkpoint, dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits.numpy()
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    feeds |= {i.name: np.zeros((2, i.shape[1], 0, i.shape[3]), np.float32) for i in session.get_inputs() if i.name.startswith("past")}
    ours = session.run(None, feeds)[0]
    valid = mask.bool().numpy()
    return {
        "max_abs_error": float(np.abs(ours[valid] - expected[valid]).max()),
        "top1_agreement": float((ours[valid].argmax(-1) == expected[valid].argmax(-1)).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="where the checkpoints and outputs go (about 3 × 13.5 GB)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--check-layers", type=int, default=3)  # > 2: layer 2 is a copy of the traced layer 1 (graphs.template)
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="export-at-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    source, converted, exported = root / "source", root / "converted", root / "onnx"
    if not (root / "source.json").is_file():
        shutil.rmtree(source, ignore_errors=True)
        sizes = llama_checkpoint(source, dtype=torch.bfloat16, num_hidden_layers=args.layers, num_key_value_heads=SHAPE["num_attention_heads"], **SHAPE)
        _copy_tokenizer(source)
        (root / "source.json").write_text(json.dumps(sizes))
    sizes = json.loads((root / "source.json").read_text())
    shared = {"layers": args.layers, "kv_heads": args.kv_heads, "source_gb": round(sizes["total_bytes"] / 1e9, 2)}
    rows = []
    for stage, command, out in [
        ("convert (mean)", python(CONVERT, str(source), str(converted), str(args.kv_heads)), converted),
        ("export (bf16)", python(EXPORT, str(converted), str(exported)), exported),
    ]:
        shutil.rmtree(out, ignore_errors=True)
        row = {"stage": stage, **shared, **measured(command)}
        row["written_gb"] = round(sum(f.stat().st_size for f in out.iterdir() if f.is_file()) / 1e9, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    shutil.rmtree(exported)
    small = truncated(converted, root / f"converted-{args.check_layers}L", args.check_layers)
    check_out = root / "onnx-check"
    shutil.rmtree(check_out, ignore_errors=True)
    row = {"stage": f"export fp32, first {args.check_layers} layers", **shared, **measured(python(EXPORT, str(small), str(check_out), "fp32"))}
    row |= {k: round(v, 6) for k, v in prompt_check(small, check_out / "model.onnx").items()}
    rows.append(row)
    print(json.dumps(row), flush=True)
    what = (
        "a generated 7B-layout bf16 checkpoint (Llama-2-7B's shapes: hidden 4096, 32 heads, intermediate 11008, vocab 32000) "
        "converted to GQA (`--method mean`) and exported (bf16, merged graph) in fresh processes: cpu_s = user + system "
        "seconds (os.wait4), peak_rss_gb from the process's VmHWM; the last row exports the converted checkpoint's first layers in fp32 and "
        "compares its prompt logits (2 rows, one left-padded) with torch's; benchmarks/export_at_scale.py on "
        f"{platform.machine()}, {os.cpu_count()} cores"
    )
    RESULTS.write_text(json.dumps({"what": what, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
