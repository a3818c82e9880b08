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

    python benchmarks/method_parts.py [--models embedded,gptj] [--methods mean,local] [--kv h/2,h/4,1] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from headfold import corpus
from headfold.converter import conversion, convert, local
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.modeling import load_model
from headfold.demo import default_model_path
from headfold.verification.metrics import compare, log_probs, windows

METHODS = ("mean", "aligned+grouped+refit", "local", "aligned+grouped+refit+local")
TRAINED_HERE = ("gptj", "bloom", "stablelm")  # benchmarks/added_families.py's families
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
    """A small model of `family` by added_families.py's recipe (seeded), trained once into CACHE."""
    import added_families

    folder = CACHE / family
    if not (folder / "config.json").is_file():
        partial = CACHE / f".{family}-partial"
        shutil.rmtree(partial, ignore_errors=True)
        record = added_families.train(family, partial, steps=400)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # byte-level, as the embedded model's
            shutil.copy(default_model_path() / name, partial / name)
        (partial / "training.json").write_text(json.dumps({**record, "recipe": "benchmarks/added_families.py train(steps=400, seed=0)"}, indent=2) + "\n")
        partial.rename(folder)
    return Model(family, folder, windows(corpus.encode(corpus.heldout_text()), added_families.WINDOW), corpus.calibration_text())


def zoo(name: str) -> Model:
    """A quality-zoo member (benchmarks/zoo_models.py), trained by benchmarks/zoo.py."""
    import zoo_models

    folder = zoo_models.CACHE / name
    if not (folder / "training.json").is_file():
        sys.exit(f"{folder} is not trained yet: python benchmarks/zoo.py train --models {name}")
    text = zoo_models.stdlib_corpus()
    return Model(name, folder, zoo_models.spread_windows(text.ids("heldout")), text.train[:EXCERPT])


def model(name: str) -> Model:
    return embedded() if name == "embedded" else trained_here(name) if name in TRAINED_HERE else zoo(name)


def allowed(source: Path, method: str) -> bool:
    with SourceCheckpoint(source) as ckpt:
        return not set(method.split("+")) & set(conversion.refused_modifiers(ckpt))


def kv_counts(spec: str, heads: int) -> list[int]:
    """'h/2,h/4,1' → [heads // 2, heads // 4, 1]."""
    return [heads // int(part[2:]) if part.startswith("h/") else int(part) for part in spec.split(",")]


def rows_for(m: Model, methods: list[str], kv_spec: str, steps: int, tmp: Path) -> list[dict]:
    config = json.loads((m.folder / "config.json").read_text())
    with SourceCheckpoint(m.folder) as ckpt:
        heads, head_dim, family = ckpt.shape.heads, ckpt.shape.head_dim, ckpt.spec.family
    reference = log_probs(load_model(m.folder), m.heldout)
    rows = []
    for kv in kv_counts(kv_spec, heads):
        for method in (x for x in methods if allowed(m.folder, x)):
            fit = "local" in method.split("+")
            start, cpu = time.perf_counter(), time.process_time()
            out = convert(m.folder, tmp / f"{m.name}-{kv}-{method}", kv, method, progress=False, builtin_text=m.calibration, local_steps=steps if fit else None, overwrite=True)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
            report = compare(reference, log_probs(load_model(out), m.heldout), m.heldout)
            row = {
                "model": m.name, "family": family, "heads": heads, "head_dim": head_dim, "layers": config.get("num_hidden_layers", config.get("n_layer")),
                "kv_heads": kv, "method": method, "kl": report.kl, "ppl": report.candidate_ppl, "reference_ppl": report.reference_ppl, "top1": report.top1,
                "convert_s": round(seconds, 1), "convert_cpu_s": round(cpu_seconds, 1), "load_average_1min": round(os.getloadavg()[0], 2),
                **({"local_steps": steps, "local_rate": local.RATE, "local_sequential": local.SEQUENTIAL} if fit else {}),
            }  # fmt: skip
            rows.append(row)
            print(_line(row), flush=True)
            shutil.rmtree(out)
    return rows


def _line(row: dict) -> str:
    extra = f" steps {row['local_steps']} rate {row['local_rate']} {'sequential' if row['local_sequential'] else 'teacher'}" if "local_steps" in row else ""
    return (f"{row['model']:<11} kv={row['kv_heads']:<2} {row['method']:<30} KL {row['kl']:.4f}  ppl {row['ppl']:.3f} (orig {row['reference_ppl']:.3f})  "
            f"top-1 {row['top1']:.1%}  {row['convert_s']:.0f}s ({row['convert_cpu_s']:.0f} CPU s){extra}")  # fmt: skip


WHAT = (
    "Training-free conversion of several trained models (the embedded decoder, the quality zoo's, small ones of the added families "
    "trained by benchmarks/added_families.py's recipe): KL(original ‖ converted) per token, perplexity and top-1 on each model's held-out "
    "windows, at kv = h/2, h/4 and MQA, for mean pooling, the default and the parts `local` adds; convert seconds on a shared 2-core machine "
    "(CPU seconds are the robust figure)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="embedded," + ",".join(TRAINED_HERE))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--kv", default="h/2,h/4,1", help="kv-head counts: h/N or a number")
    parser.add_argument("--steps", type=int, default=conversion.DEFAULT_LOCAL_STEPS, help="--local-steps of the methods with local")
    parser.add_argument("--rate", type=float, default=local.RATE, help="ablation: local's Adam rate relative to each tensor's RMS")
    parser.add_argument("--sequential", action="store_true", help="ablation: local's layers read the converted earlier layers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fresh", action="store_true", help="drop the rows of earlier runs")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "method_parts.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    local.RATE, local.SEQUENTIAL = args.rate, args.sequential
    kept = [] if args.fresh or not args.json.is_file() else json.loads(args.json.read_text())["rows"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows = rows_for(model(name), args.methods.split(","), args.kv, args.steps, Path(tmp))
            kept += rows
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"what": WHAT, "rows": kept}, indent=1) + "\n")


if __name__ == "__main__":
    main()
