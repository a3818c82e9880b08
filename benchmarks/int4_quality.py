"""What `--dtype int4` costs on trained decoders: headfold verify's quantization-loss check, fp32 export against int4 export.

Each trained checkpoint (default: the embedded model and its kv 4 and kv 2 `mean` conversions, and
every checkpoint folder in ~/.cache/headfold-zoo) is exported in fp32 and in int4 (block 32 symmetric,
the default, and block 32 asymmetric), and `headfold.verify(fp32 export, int4 export)` measures the
perplexity increase, KL(fp32 ‖ int4) and top-1 agreement on the built-in held-out text against the
default loss budgets. Writes benchmarks/results/int4_quality.json ({"what", "rows"}: docs/benchmarks.md
renders it as one table).

    python -m benchmarks.int4_quality [--models DIR …] [--window 256] [--max-rows 128]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from headfold import convert
from headfold.converter.checkpoint import CheckpointFacts
from headfold.demo import default_model_path
from headfold.graphs.export import export
from headfold.verification import InputSpec, verify

RESULTS = Path(__file__).parent / "results" / "int4_quality.json"
ZOO = Path.home() / ".cache" / "headfold-zoo"
SETTINGS = {"block 32, symmetric": {}, "block 32, asymmetric": {"int4_symmetric": False}}


def default_models(tmp: Path) -> dict[str, Path]:
    source = default_model_path()
    models = {"embedded (MHA)": source}
    models |= {f"embedded kv {kv} (mean)": convert(source, tmp / f"kv{kv}", kv, method="mean", progress=False) for kv in (4, 2)}
    models |= {folder.name: folder for folder in sorted(ZOO.glob("*")) if (folder / "config.json").is_file()}
    return models


def rows_for(name: str, checkpoint: Path, tmp: Path, spec: InputSpec) -> list[dict]:
    facts = CheckpointFacts.read(checkpoint)
    fp32 = tmp / f"{checkpoint.name}-fp32"
    export(checkpoint, fp32, dtype="fp32", progress=False)
    rows = []
    for setting, options in SETTINGS.items():
        int4 = tmp / f"{checkpoint.name}-int4-{len(rows)}"
        export(checkpoint, int4, dtype="int4", progress=False, **options)
        (check,) = verify(fp32, int4, inputs=spec).checks
        m = check.metrics
        rows.append(
            {
                "model": name,
                "layers": facts.layers,
                "hidden": facts.hidden,
                "kv_heads": facts.kv_heads[0],
                "int4": setting,
                "ppl_fp32": round(m["reference_ppl"], 4),
                "ppl_int4": round(m["candidate_ppl"], 4),
                "ppl_increase": f"{m['ppl_increase']:+.2%}",
                "kl": round(m["kl"], 4),
                "top1": f"{m['top1']:.1%}",
                "budget": "pass" if check.passed else "fail",
                "data_mb_fp32": round((fp32 / "model.onnx.data").stat().st_size / 2**20, 2),
                "data_mb_int4": round((int4 / "model.onnx.data").stat().st_size / 2**20, 2),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, nargs="*", help="checkpoint folders (default: the embedded model, its conversions and the zoo)")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--max-rows", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    spec = InputSpec(window=args.window, max_rows=args.max_rows)
    with tempfile.TemporaryDirectory() as tmp:
        models = {folder.name: folder for folder in args.models} if args.models else default_models(Path(tmp))
        rows = [row for name, checkpoint in models.items() for row in rows_for(name, checkpoint, Path(tmp), spec)]
    what = (
        "headfold verify's quantization-loss check of each trained decoder's int4 export against its fp32 export, on the built-in held-out "
        f"text (windows of {args.window}, {args.max_rows} rows) under the default loss budgets (perplexity +5 %, KL 0.05, top-1 90 %)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"what": what, "machine": f"{os.cpu_count()} CPUs", "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
