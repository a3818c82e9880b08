"""The Python API, step for step like the CLI: convert, export, verify, gate.

    python examples/python_api.py [SRC] [OUT_DIR] [--kv-heads 4]

SRC defaults to headfold's embedded model. Equivalent commands:

    headfold convert SRC OUT_DIR/gqa --kv-heads 4
    headfold export OUT_DIR/gqa OUT_DIR/onnx
    headfold verify SRC OUT_DIR/gqa --max-ppl-increase 5% --report OUT_DIR/loss.json
    headfold verify OUT_DIR/gqa OUT_DIR/onnx --junit OUT_DIR/fidelity.xml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import headfold
from headfold.demo import default_model_path
from headfold.graphs.export import export
from headfold.verification import InputSpec, Thresholds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", nargs="?", type=Path, default=default_model_path())
    parser.add_argument("out", nargs="?", type=Path, default=Path("headfold-example"))
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--max-rows", type=int, default=64, help="rows of the built-in held-out text to compare on")
    args = parser.parse_args()

    gqa = headfold.convert(args.src, args.out / "gqa", kv_heads=args.kv_heads, overwrite=True, progress=False)
    export(gqa, args.out / "onnx", overwrite=True, progress=False)

    inputs = InputSpec(max_rows=args.max_rows)  # the built-in held-out text; pass text=Path(...) for your own
    loss = headfold.verify(args.src, gqa, inputs=inputs, thresholds=Thresholds(max_ppl_increase=0.05))
    fidelity = headfold.verify(gqa, args.out / "onnx", inputs=inputs)  # defaults for the export's precision
    loss.write(json_path=args.out / "loss.json")
    fidelity.write(junit_path=args.out / "fidelity.xml")

    for report in (loss, fidelity):
        print(report.table())
        if not report.passed:
            print(report.failure_message(), file=sys.stderr)
    return 0 if loss.passed and fidelity.passed else 1


if __name__ == "__main__":
    sys.exit(main())
