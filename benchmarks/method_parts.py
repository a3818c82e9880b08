"""Training-free method parts on several trained models: KL to the original at kv = h/2, h/4 and MQA.

Models (--models): `embedded` (the embedded decoder, held out: the corpus' held-out topics); the quality
zoo's members trained into ~/.cache/headfold-zoo (benchmarks/zoo_models.py: held out, the files of the
standard library its split keeps out; calibrated on a 512 KB excerpt of its training split); and
`gptj`, `bloom`, `stablelm`: small byte-level models trained here by benchmarks/added_families.py's
seeded recipe (cached in ~/.cache/headfold-method-parts, with the embedded tokenizer so they calibrate
on text; held out as the embedded model). Every method (--methods) the model's family allows, at each
kv count (--kv, fractions of the heads or counts), converted in this process: KL(original ‖ converted)
per token, perplexity and top-1 agreement on the held-out windows, convert wall and CPU seconds (the
machine is shared: compare CPU seconds). Ablations of `local` set its module constants: --rate, --sequential.
Prints one line per conversion and writes JSON (default benchmarks/results/method_parts.json), rows added
to those of earlier runs with other settings (--fresh starts over).

    python -m benchmarks.method_parts [--models embedded,gptj] [--methods mean,local] [--kv h/2,h/4,1] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import zoo_models
from headfold import corpus
from headfold.converter import conversion, convert
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.modeling import load_model
from headfold.demo import default_model_path
from headfold.ground.settings import LocalFit
from headfold.verification.metrics import compare, log_probs, windows

METHODS = ("mean", "aligned+grouped+refit", "aligned+scored+refit", "local", "aligned+grouped+refit+local", "aligned+scored+refit+local")
TRAINED_HERE = ("gptj", "bloom", "stablelm", "t5")  # benchmarks/added_families.py's families and seq2seq_recovery.py's T5
CACHE = Path.home() / ".cache" / "headfold-method-parts"
EXCERPT = 512 * 1024  # bytes of a zoo model's training split to calibrate on


@dataclass
class Model:
    name: str
    folder: Path
    heldout: torch.Tensor  # [windows, T] token ids
    calibration: str  # the text `convert` calibrates on


def embedded() -> Model:
    return Model("embedded", default_model_path(), windows(corpus.encode(corpus.heldout_text()), 256), corpus.calibration_text())


def trained_here(family: str) -> Model:
    """A small model of `family` by added_families.py's recipe (T5: seq2seq_recovery.py's), seeded, trained once into CACHE."""
    from benchmarks import added_families, seq2seq_recovery

    folder = CACHE / family
    if not (folder / "config.json").is_file():
        partial = CACHE / f".{family}-partial"
        shutil.rmtree(partial, ignore_errors=True)
        if family == "t5":
            record, recipe = seq2seq_recovery.train(partial, steps=800), "benchmarks/seq2seq_recovery.py train(steps=800, seed=0)"
        else:
            record, recipe = added_families.train(family, partial, steps=400), "benchmarks/added_families.py train(steps=400, seed=0)"
        for name in ("tokenizer.json", "tokenizer_config.json"):  # byte-level, as the embedded model's
            shutil.copy(default_model_path() / name, partial / name)
        (partial / "training.json").write_text(json.dumps({**record, "recipe": recipe}, indent=2) + "\n")
        partial.rename(folder)
    window = seq2seq_recovery.WINDOW if family == "t5" else added_families.WINDOW
    return Model(family, folder, windows(corpus.encode(corpus.heldout_text()), window), corpus.calibration_text())


def scored_log_probs(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probabilities and the ids they predict (as metrics.compare takes them): a decoder's over
    each window; an encoder-decoder's over each window's second half, read after its first half (teacher-forced)."""
    if not model.config.is_encoder_decoder:
        return log_probs(model, batch), batch
    half, start = batch.shape[1] // 2, model.config.decoder_start_token_id
    target = torch.cat([torch.full_like(batch[:, :1], start), batch[:, half:]], 1)  # [start, t_0, …]: position i predicts t_i
    with torch.no_grad():
        logits = [
            model(input_ids=s, decoder_input_ids=t[:, :-1], use_cache=False).logits.float().log_softmax(-1)
            for s, t in zip(batch[:, :half].split(16), target.split(16), strict=True)
        ]
    return torch.cat(logits), target


def zoo(name: str) -> Model:
    """A quality-zoo member (benchmarks/zoo_models.py), trained by benchmarks/zoo.py."""
    folder = zoo_models.CACHE / name
    if not (folder / "training.json").is_file():
        sys.exit(f"{folder} is not trained yet: python -m benchmarks.zoo train --models {name}")
    text = zoo_models.stdlib_corpus()
    return Model(name, folder, zoo_models.spread_windows(text.ids("heldout")), text.train[:EXCERPT])


def model(name: str) -> Model:
    return embedded() if name == "embedded" else trained_here(name) if name in TRAINED_HERE else zoo(name)


def rows_for(m: Model, methods: list[str], kv_spec: str, steps: int, tmp: Path, tokens: int | None = None, fit_settings: LocalFit = LocalFit()) -> list[dict]:
    """One row per method and kv count; `tokens`: --calibration-tokens (None: the default); `fit_settings`: local's fit."""
    config = json.loads((m.folder / "config.json").read_text())
    with SourceCheckpoint(m.folder) as ckpt:
        heads, head_dim, family = ckpt.shape.heads, ckpt.shape.head_dim, ckpt.spec.family
        runnable = {x: conversion.without_refused(ckpt, x) for x in methods}
    reference, ids = scored_log_probs(load_model(m.folder), m.heldout)
    rows = []
    for kv in zoo_models.kv_counts(kv_spec, heads).values():
        for label, method in runnable.items():
            if method is None:
                continue
            fit = "local" in method.split("+")
            start, cpu = time.perf_counter(), time.process_time()
            calibration = {} if tokens is None else {"calibration_tokens": tokens}
            out = convert(
                m.folder,
                tmp / f"{m.name}-{kv}-{method}",
                kv,
                method,
                progress=False,
                builtin_text=m.calibration,
                local_steps=steps if fit else None,
                overwrite=True,
                local_fit=fit_settings,
                **calibration,
            )
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
            report = compare(reference, scored_log_probs(load_model(out), m.heldout)[0], ids)
            row = {
                "model": m.name,
                "family": family,
                "heads": heads,
                "head_dim": head_dim,
                "layers": config.get("num_hidden_layers", config.get("n_layer", config.get("num_layers"))),
                "kv_heads": kv,
                "method": method,
                "label": label,
                "kl": report.kl,
                "ppl": report.candidate_ppl,
                "reference_ppl": report.reference_ppl,
                "top1": report.top1,
                "convert_s": round(seconds, 1),
                "convert_cpu_s": round(cpu_seconds, 1),
                "load_average_1min": round(os.getloadavg()[0], 2),
                **calibration,
                **({"local_steps": steps, "local_rate": fit_settings.rate, "local_sequential": fit_settings.sequential} if fit else {}),
            }
            rows.append(row)
            print(_line(row), flush=True)
            shutil.rmtree(out)
    return rows


def _line(row: dict) -> str:
    extra = f" steps {row['local_steps']} rate {row['local_rate']} {'sequential' if row['local_sequential'] else 'teacher'}" if "local_steps" in row else ""
    return (
        f"{row['model']:<11} kv={row['kv_heads']:<2} {row['method']:<30} KL {row['kl']:.4f}  ppl {row['ppl']:.3f} (orig {row['reference_ppl']:.3f})  "
        f"top-1 {row['top1']:.1%}  {row['convert_s']:.0f}s ({row['convert_cpu_s']:.0f} CPU s){extra}"
    )


# One conversion in a fresh process: the wall and CPU seconds of the convert call, the CPU seconds of
# local's fits within it (so one run splits the cost into the fixed part and the steps, under the same
# load), and the peak RSS (VmHWM).
CHILD = """
import json, re, sys, time
from pathlib import Path
from headfold import convert
from headfold.converter import local
fitting = [0.0]
def timed(*args, _fit=local.fit, **kwargs):
    began = time.process_time()
    try:
        return _fit(*args, **kwargs)
    finally:
        fitting[0] += time.process_time() - began
local.fit = timed
start, cpu = time.perf_counter(), time.process_time()
steps = int(sys.argv[4]) or None
convert(sys.argv[1], sys.argv[2], 4, sys.argv[3], local_steps=steps, progress=False)
hwm_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
cost = {"convert_s": time.perf_counter() - start, "convert_cpu_s": time.process_time() - cpu, "local_fit_cpu_s": fitting[0], "peak_rss_mb": hwm_kb * 1024 / 1e6}
print(json.dumps(cost))
"""


def layout_rows(methods: list[str], steps: list[int], threads: int, keep: Path | None, fit: str | None = None) -> list[dict]:
    """The generated 1.29 GB fp16 Llama layout (convert_throughput.py: 10 layers of hidden 2048, 16 heads of 128)
    converted to 4 kv heads on 4096 calibration tokens of the built-in text, one fresh process per method (and
    per --local-steps of a method with local): what each part costs where a model runs layer by layer."""
    from benchmarks.convert_throughput import checkpoint

    rows = []
    with tempfile.TemporaryDirectory(dir=keep) as tmp:
        src, sizes = checkpoint(keep or Path(tmp), 10, "float16", 1000)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        for method in methods:
            for count in steps if "local" in method.split("+") else [0]:
                done = subprocess.run([sys.executable, "-c", CHILD, src, Path(tmp) / "out", method, str(count)], capture_output=True, text=True, env=env)
                if done.returncode:
                    sys.exit(done.stderr[-3000:])
                shutil.rmtree(Path(tmp) / "out")
                result = {k: round(v, 1) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
                rows.append(
                    {
                        "layout": f"Llama {sizes['total_bytes'] / 1e9:.2f} GB fp16, 10 layers, 16 heads of 128",
                        "kv_heads": 4,
                        "method": method,
                        **({"local_steps": count} if count else {}),
                        **result,
                        **({"fit": fit} if fit and count else {}),
                        "threads": threads,
                        "load_average_1min": round(os.getloadavg()[0], 2),
                    }
                )
                print("  ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    return rows


def scored_rows(threads: int, heads: int = 32, head_dim: int = 128, hidden: int = 4096, tokens: int = 4096) -> list[dict]:
    """scored's own work on one 7B-shaped layer (Llama-2-7B: 32 heads of 128, hidden 4096, RoPE on every dim) at h/2
    and h/4: the predicted loss's cross-products and the swap search from the contiguous and similarity groups, on
    seeded random weights and inputs (a trained model's heads differ: the search may take more or fewer swaps)."""
    from headfold.converter.layout import AttentionWeights
    from headfold.converter.methods import LayerContext, head_activations, predicted_loss, similar_groups
    from headfold.converter.recipes import contiguous_groups
    from headfold.converter.scoring import scored_groups

    gen = torch.Generator().manual_seed(0)
    weight = lambda: torch.randn(heads, head_dim, hidden, generator=gen) / hidden**0.5  # noqa: E731
    attn = AttentionWeights(weight(), weight(), weight(), weight())
    ctx = LayerContext(torch.randn(tokens, hidden, generator=gen), rotary=head_dim)
    keys, values = head_activations(attn.k, None, ctx), head_activations(attn.v, None, ctx)
    rows = []
    for kv in (heads // 2, heads // 4):
        start, cpu = time.perf_counter(), time.process_time()
        similar = similar_groups(keys, values, kv, head_dim)
        similar_s = time.process_time() - cpu
        loss = predicted_loss(attn, keys, values, ctx, head_dim)
        groups = scored_groups(loss, [contiguous_groups(heads, kv), similar])
        rows.append(
            {
                "layout": f"one layer: {heads} heads of {head_dim}, hidden {hidden}, {tokens} tokens (random)",
                "kv_heads": kv,
                "method": "scored (grouping alone)",
                "convert_s": round(time.perf_counter() - start, 1),
                "convert_cpu_s": round(time.process_time() - cpu, 1),
                "similarity_cpu_s": round(similar_s, 1),
                "predicted_drop": round(1 - loss.total(groups) / loss.total(similar), 3),
                "threads": threads,
                "load_average_1min": round(os.getloadavg()[0], 2),
            }
        )
        print("  ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
    return rows


WHAT = (
    "Training-free conversion of several trained models (the embedded decoder, the quality zoo's, small ones of the added families "
    "trained by benchmarks/added_families.py's recipe): KL(original ‖ converted) per token, perplexity and top-1 on each model's held-out "
    "windows, at kv = h/2, h/4 and MQA, for mean pooling and combinations of the method parts, `local` among them (each as the family allows "
    "it); convert seconds on a shared 2-core machine "
    "(CPU seconds are the robust figure)"
)


DEFAULT_JSON = Path(__file__).parent / "results" / "method_parts.json"
COST = (
    "What each method costs on the generated 1.29 GB fp16 Llama layout (benchmarks/convert_throughput.py: 10 layers, hidden 2048, 16 heads "
    "of 128, random weights) converted to 4 kv heads on 4096 calibration tokens, one fresh process per row on a shared 2-core machine: "
    "wall and CPU seconds of the convert call (headfold imported, torch not yet), peak RSS; local at two step budgets, so that one step's cost is "
    "their difference; and (unless --no-scored-layer) scored's grouping alone on one 7B-shaped layer"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="embedded," + ",".join(TRAINED_HERE))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--kv", default="h/2,h/4,1", help="kv-head counts: h/N or a number")
    parser.add_argument("--steps", type=int, default=conversion.DEFAULT_LOCAL_STEPS, help="--local-steps of the methods with local")
    parser.add_argument("--rate", type=float, default=LocalFit.rate, help="ablation: local's Adam rate relative to each tensor's RMS")
    parser.add_argument("--sequential", action="store_true", help="ablation: local's layers read the converted earlier layers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fresh", action="store_true", help="drop the rows of earlier runs")
    parser.add_argument("--layout", action="store_true", help="cost on the generated 1.29 GB Llama layout instead (default JSON method_parts_cost.json)")
    parser.add_argument("--layout-steps", default="1,3", help="--local-steps the layout's methods with local run at (the cost per step is their difference)")
    parser.add_argument("--keep", type=Path, help="make the layout once in this folder and reuse it")
    parser.add_argument("--no-scored-layer", action="store_true", help="--layout: leave out scored's grouping on the 7B-shaped layer")
    parser.add_argument("--fit-note", help="--layout: the fit the rows with local ran (recorded as their `fit`: measured at the default budget)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fit_settings = LocalFit(rate=args.rate, sequential=args.sequential)
    if args.layout:
        path = args.json if args.json != DEFAULT_JSON else DEFAULT_JSON.with_name("method_parts_cost.json")
        rows = ([] if args.no_scored_layer else scored_rows(args.threads)) + layout_rows(
            args.methods.split(","), [int(x) for x in args.layout_steps.split(",")], args.threads, args.keep, args.fit_note
        )
        again = {(r.get("layout"), r.get("method"), r.get("local_steps")) for r in rows}  # measured again: the new row replaces the old
        kept = (
            []
            if args.fresh or not path.is_file()
            else [r for r in json.loads(path.read_text())["rows"] if (r.get("layout"), r.get("method"), r.get("local_steps")) not in again]
        )
        path.write_text(json.dumps({"what": COST, "default_local_steps": conversion.DEFAULT_LOCAL_STEPS, "rows": kept + rows}, indent=1) + "\n")
        return
    kept = [] if args.fresh or not args.json.is_file() else json.loads(args.json.read_text())["rows"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows = rows_for(model(name), args.methods.split(","), args.kv, args.steps, Path(tmp), fit_settings=fit_settings)
            kept += rows
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"what": WHAT, "rows": kept}, indent=1) + "\n")


if __name__ == "__main__":
    main()
