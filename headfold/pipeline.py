"""`headfold run`: convert → export → build → verify, each stage in its own sub-folder of OUT_DIR.

A stage runs only when its key — the sha256 of its inputs' content, its options and the headfold
version — differs from the one recorded in OUT_DIR/stages.json, or its output is missing; so a
second run with nothing changed skips every stage and reprints the stored report.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import headfold
from headfold.atomic import atomic_output, check_output
from headfold.engines.env import engine_support
from headfold.errors import BadInput
from headfold.verification.artifacts import resolve, sha256_file
from headfold.verification.budget import Thresholds
from headfold.verification.inputs import InputSpec, make_inputs, read_text
from headfold.verification.report import Report

LEDGER = "stages.json"
REPORT_FILES = {"json": "report.json", "markdown": "report.md", "junit": "junit.xml"}
Log = Callable[[str], None]


def tree_digest(folder: Path) -> str:
    """sha256 over every file's relative path and content."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + sha256_file(path).encode())
    return digest.hexdigest()


def stage_key(stage: str, inputs: dict[str, Any]) -> str:
    blob = json.dumps({"stage": stage, "headfold": headfold.__version__, **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class Ledger:
    """OUT_DIR/stages.json: per stage its key, inputs and timing; rewritten atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stages: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def is_current(self, stage: str, key: str, output: Path) -> bool:
        return self.stages.get(stage, {}).get("key") == key and output.exists()

    def record(self, stage: str, **entry: Any) -> None:
        self.stages[stage] = entry
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(self.stages, indent=2, default=str) + "\n")
        tmp.replace(self.path)


def _stage(ledger: Ledger, name: str, inputs: dict[str, Any], output: Path, work: Callable[[], Any], log: Log) -> tuple[str, Any]:
    """Run `work` unless the recorded key matches; return (key, its result or None when skipped)."""
    key = stage_key(name, inputs)
    if ledger.is_current(name, key, output):
        log(f"{name}: unchanged, skipped ({output})")
        return key, None
    start = time.perf_counter()
    result = work()
    seconds = round(time.perf_counter() - start, 2)
    ledger.record(name, key=key, inputs=inputs, output=str(output), seconds=seconds)
    log(f"{name}: done in {seconds:.1f} s ({output})")
    return key, result


def _verify(src: Path, converted: Path, onnx_dir: Path, spec: InputSpec, thresholds: Thresholds, dtype: str, engines: Path | None = None) -> Report:
    from headfold.verification.api import run_artifact_checks

    original, conversion, graph = resolve(src), resolve(converted), resolve(onnx_dir)
    inputs = make_inputs(src, spec)
    checks = [
        ("conversion-loss", "loss", original, conversion, thresholds.loss(dtype)),
        ("fidelity-onnx", "fidelity", conversion, graph, thresholds.fidelity(dtype)),
    ]
    if engines is not None:  # the prefill engine against the converted checkpoint, like the ONNX graph
        checks.append(("fidelity-tensorrt", "fidelity", conversion, resolve(engines), thresholds.fidelity(dtype)))
    return Report(run_artifact_checks(checks, inputs), inputs.info)


def _write_report(report: Report, folder: Path) -> None:
    with atomic_output(folder) as tmp:
        report.write(*(tmp / REPORT_FILES[k] for k in ("json", "markdown", "junit")))


def run(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    kv_heads: int | Sequence[int],
    *,
    method: str = "mean",
    opset: int = 23,
    dtype: str = "fp32",
    inputs: InputSpec = InputSpec(),
    thresholds: Thresholds = Thresholds(),
    log: Log = print,
) -> Report:
    """The whole pipeline on the checkpoint folder `src`; outputs under `out_dir`; the verify report."""
    from headfold.converter import convert
    from headfold.graphs.export import check_opset, export

    src, out = Path(src).resolve(), Path(out_dir).resolve()
    if resolve(src).kind != "checkpoint":
        raise BadInput(f"{src} is not a checkpoint folder (config.json); headfold run starts from one")
    check_output(out, overwrite=True, sources=(src,))
    check_opset(opset)
    budgets = {"loss": asdict(thresholds.loss(dtype)), "fidelity": asdict(thresholds.fidelity(dtype))}  # bad budgets fail first
    text, _ = read_text(inputs.text)
    ledger = Ledger(out / LEDGER)  # OUT_DIR appears with the first stage: bad input leaves nothing
    converted, onnx_dir, engines, verified = (out / s for s in ("convert", "export", "build", "verify"))

    conv_inputs = {"source": tree_digest(src), "kv_heads": kv_heads, "method": method}
    conv_key, done = _stage(
        ledger, "convert", conv_inputs, converted, lambda: convert(src, converted, kv_heads, method, overwrite=True, progress=False), log
    )
    stages = {"convert": _status(done)}
    exp_inputs = {"checkpoint": conv_key, "opset": opset, "dtype": dtype}
    exp_key, done = _stage(
        ledger, "export", exp_inputs, onnx_dir, lambda: export(converted, onnx_dir, opset=opset, dtype=dtype, overwrite=True, progress=False), log
    )
    stages["export"] = _status(done)
    build_key, stages["build"] = _build_stage(ledger, exp_key, onnx_dir, engines, log)

    verify_inputs = {
        "export": exp_key,
        "build": build_key,
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "inputs": {k: v for k, v in asdict(inputs).items() if k != "text"},
        "budgets": budgets,
    }

    def verify_stage() -> Report:
        report = _verify(src, converted, onnx_dir, inputs, thresholds, dtype, engines if build_key else None)
        report.stages = {**stages, "verify": "ran"}
        _write_report(report, verified)
        return report

    _, report = _stage(ledger, "verify", verify_inputs, verified, verify_stage, log)
    if report is None:  # skipped: the stored report is still current
        report = Report.load(verified / REPORT_FILES["json"])
        report.stages = {**stages, "verify": "skipped"}
    return report


def _build_stage(ledger: Ledger, exp_key: str, onnx_dir: Path, engines: Path, log: Log) -> tuple[str | None, str]:
    """(build key, status) when the engines are current, else (None, "skipped: why they were not built")."""
    from headfold.engines.build import build_export
    from headfold.engines.plan import Unparsable

    why_not = engine_support()
    if why_not is None:
        import tensorrt

        inputs = {"export": exp_key, "tensorrt": tensorrt.__version__, "gpu": _gpu_name()}
        try:
            key, done = _stage(ledger, "build", inputs, engines, lambda: build_export(onnx_dir, engines, log=log), log)
            return key, _status(done)
        except Unparsable as err:  # this TensorRT is too old for the graph: like no TensorRT at all
            why_not = str(err)
    log(f"build: skipped, {why_not}; no engine in {engines}")
    return None, f"skipped: {why_not}"


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()


def _status(result: Any) -> str:
    return "skipped" if result is None else "ran"
