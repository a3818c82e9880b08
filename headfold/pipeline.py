"""`headfold run`: convert → export → build → verify, each stage in its own sub-folder of OUT_DIR.

OUT_DIR/stages.json, the ledger, records per stage its key (the sha256 of its inputs' content, its
options and the headfold version) and the sha256 of the folder it wrote. A stage is skipped only
when its key is unchanged and its folder still hashes to the recorded sha256, so a second run with
nothing changed skips every stage and reprints the stored report, and a corrupted artifact reruns
its stage. run writes only the stage folders its ledger records: OUT_DIR may hold the user's files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headfold import corpus
from headfold.converter import convert
from headfold.converter.checkpoint import CheckpointFacts, SourceCheckpoint
from headfold.converter.conversion import check_options as check_conversion
from headfold.converter.conversion import local_step_budget, method_for, target_shapes
from headfold.converter.modeling import check_loadable
from headfold.converter.recipes import DEFAULT_METHOD, get_method
from headfold.converter.sources import checkpoint_folder
from headfold.engines.build import build_export
from headfold.engines.env import engine_support
from headfold.engines.plan import Unparsable, parse_range, parse_workspace
from headfold.graphs.export import check_options as check_export
from headfold.graphs.export import export
from headfold.ground import VERSION
from headfold.ground.artifacts import LEDGER, REPORT
from headfold.ground.atomic import atomic_output, check_disjoint, output_lock, output_path, refuse_link
from headfold.ground.errors import BadInput
from headfold.ground.hashing import sha256_file
from headfold.ground.lazy import lazy_import
from headfold.ground.ledger import RunLedger, StageEntry
from headfold.ground.ledger import load as load_ledger
from headfold.ground.precision import Precision
from headfold.ground.settings import Calibration, ExportOptions, Profile
from headfold.verification.api import run_artifact_checks
from headfold.verification.artifacts import Artifact, resolve
from headfold.verification.budget import FidelityBudget, LossBudget, Thresholds
from headfold.verification.inputs import InputSpec, make_inputs, read_text
from headfold.verification.report import Report

if TYPE_CHECKING:
    from headfold.distillation.stage import DistillStage

tensorrt = lazy_import("tensorrt")  # the build stage's, where engine_support() finds it and a GPU
REPORT_FILES = {"json": REPORT, "markdown": "report.md", "junit": "junit.xml"}
log = logging.getLogger(__name__)


def tree_digest(folder: Path) -> str:
    """sha256 over every file's relative path and content."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + sha256_file(path).encode())
    return digest.hexdigest()


def stage_key(stage: str, inputs: dict[str, Any]) -> str:
    blob = json.dumps({"stage": stage, "headfold": VERSION, **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class Ledger:
    """OUT_DIR/stages.json: per stage its key, inputs, output sha256 and timing; rewritten atomically.

    Its presence makes OUT_DIR a run folder; a stage folder it does not name is the user's."""

    def __init__(self, out: Path, *, overwrite: bool) -> None:
        self.path = out / LEDGER
        self.stages: dict[str, StageEntry] = load_ledger(self.path).stages if self.path.is_file() else {}
        if not self.path.is_file() and out.is_dir() and any(out.iterdir()) and not overwrite:
            raise BadInput(
                f"{out} exists and is not a headfold run folder (no {LEDGER}); "
                "pass --overwrite to add the run's stage folders to it (your files stay) or choose another OUT_DIR"
            )
        if out.exists() and not out.is_dir():
            raise BadInput(f"{out} is a file, and headfold run writes a folder there; choose another OUT_DIR")

    def claim(self, stage: str, output: Path) -> None:
        """Record `stage` as run's own before it writes `output`; refuse an `output` it never wrote."""
        if stage not in self.stages and (output.exists() or output.is_symlink()):
            raise BadInput(f"{output} exists but headfold run did not write it (not in {self.path}); move it away or choose another OUT_DIR")
        entry = self.stages.get(stage)
        self.record(stage, replace(entry, key=None, output=output.name) if entry else StageEntry(key=None, output=output.name))

    def unchanged(self, stage: str, key: str, output: Path) -> tuple[str | None, str]:
        """(the recorded output sha256, "") when `stage` can be skipped, else (None, why it runs)."""
        entry = self.stages.get(stage)
        if entry is None or entry.key != key:
            return None, ""
        if not output.is_dir():
            return None, f"its output {output} is missing"
        digest = tree_digest(output)
        if digest != entry.sha256:
            return None, f"its output {output} changed since it was written (sha256 {digest[:12]}, recorded {str(entry.sha256)[:12]})"
        return digest, ""

    def record(self, stage: str, entry: StageEntry) -> None:
        self.stages[stage] = entry
        with atomic_output(self.path, is_dir=False, overwrite=True, ours=True) as tmp:  # its presence makes the folder a run folder
            tmp.write_text(RunLedger(stages=self.stages).to_json())


def _stage(ledger: Ledger, name: str, inputs: dict[str, Any], output: Path, work: Callable[[], Any], step: str = "") -> tuple[str, Any]:
    """Run `work` unless the key matches and the output is intact; (the output's sha256, the
    result or None when skipped). Downstream stages key on that sha256: content, not history.
    Progress lines start with `step` ("[2/4] ")."""
    key = stage_key(name, inputs)
    digest, why = ledger.unchanged(name, key, output)
    if digest is not None:
        log.info(f"{step}{name}: unchanged, skipped ({output})")
        return digest, None
    if why:
        log.info(f"{step}{name}: {why}; running it again")
    ledger.claim(name, output)  # the last refusal a stage can meet: its line follows it
    log.info(f"{step}{name} → {output}")
    start = time.perf_counter()
    result = work()
    seconds = round(time.perf_counter() - start, 2)
    digest = tree_digest(output)
    ledger.record(name, StageEntry(key=key, inputs=inputs, output=output.name, sha256=digest, seconds=seconds))
    log.info(f"{step}{name}: done in {seconds:.1f} s")
    return digest, result


def _verify(
    src: Path, converted: Path, onnx_dir: Path, spec: InputSpec, thresholds: Thresholds, dtype: Precision, engines: Path | None = None, progress: bool = False
) -> Report:
    original, conversion, graph = resolve(src), resolve(converted), resolve(onnx_dir)
    inputs = make_inputs(src, spec)
    checks: list[tuple[str, str, Artifact, Artifact, FidelityBudget | LossBudget]] = [
        ("conversion-loss", "loss", original, conversion, thresholds.loss(dtype)),
        ("fidelity-onnx", "fidelity", conversion, graph, thresholds.fidelity(dtype)),
    ]
    if engines is not None:  # the prefill engine against the converted checkpoint, like the ONNX graph
        checks.append(("fidelity-tensorrt", "fidelity", conversion, resolve(engines), thresholds.fidelity(dtype)))
    return Report(run_artifact_checks(checks, inputs, progress=progress), inputs.info)


def _write_report(report: Report, folder: Path) -> None:
    with atomic_output(folder, overwrite=True) as tmp:  # the ledger says it is run's own
        report.write(*(tmp / REPORT_FILES[k] for k in ("json", "markdown", "junit")))


def run(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    kv_heads: int | Sequence[int],
    *,
    method: str = DEFAULT_METHOD,
    revision: str | None = None,
    max_shard_size: str | int | None = None,
    allow_pickle: bool = False,
    calibration: Calibration = Calibration(),
    pool: str | None = None,
    local_steps: int | None = None,
    distill: DistillStage | None = None,
    export: ExportOptions = ExportOptions(),
    build: Profile = Profile(),
    inputs: InputSpec = InputSpec(),
    thresholds: Thresholds = Thresholds(),
    overwrite: bool = False,
    progress: bool = False,
) -> Report:
    """The whole pipeline on the checkpoint `src` (a folder or hub id ORG/NAME at `revision`); outputs
    under `out_dir`; the verify report.

    Each stage takes its command's settings: `max_shard_size`, `allow_pickle`, `calibration`, `pool` and
    `local_steps` as convert takes them, `distill` (None: no distill stage), `export` as headfold export's (graphs
    None: split where TensorRT builds, else merged; dtype None: the checkpoint's own, fp32 for bf16),
    `build` as the TensorRT profile, `inputs` and `thresholds` as verify's. `out_dir` must be new, empty or a
    run folder (its ledger); `overwrite` also accepts a folder of other files, which stay: run only
    ever replaces the stage folders its ledger records. `progress` shows each stage's own progress."""
    src = checkpoint_folder(src, revision=revision, allow_pickle=allow_pickle).resolve()
    out = output_path(Path(out_dir))
    refuse_link(out)
    if resolve(src).kind != "checkpoint":
        raise BadInput(f"{src} is not a checkpoint folder (config.json); headfold run starts from one")
    check_convertible(src, kv_heads, method, allow_pickle, pool, local_steps)
    check_loadable(src)  # what the export and verify stages would refuse, before the first stage writes
    export = replace(export, dtype=export.dtype or verifiable_dtype(src))  # ExportOptions and Profile parsed their own text
    if export.dtype == Precision.INT4:  # its verify stage gates the export by fidelity, which int4 weights do not keep
        raise BadInput(
            "headfold run checks its export's fidelity to the checkpoint; int4 weights are gated by their loss: run without --dtype int4, then "
            "headfold export --dtype int4 and headfold verify CHECKPOINT EXPORT"
        )
    settings = Settings(kv_heads, method, max_shard_size, allow_pickle, calibration, pool, local_steps, distill, export, build, inputs, thresholds, progress)
    check_disjoint(out, settings.reads(src))  # the run folder holds none of its inputs, nor lies inside one
    settings.check(src)
    budgets = settings.budgets()  # bad budgets fail first
    text, _ = read_text(inputs.text)
    with output_lock(out):  # one run per OUT_DIR
        created = not out.exists()
        ledger = Ledger(out, overwrite=overwrite)
        try:
            return _run_stages(src, out, ledger, settings, budgets, text)
        except BaseException:
            if created and not any(entry.key for entry in ledger.stages.values()):
                shutil.rmtree(out, ignore_errors=True)  # no stage finished: a failed first run leaves nothing
            raise


def verifiable_dtype(src: Path) -> Precision:
    """The export dtype run picks: the checkpoint's own, except bf16, which the verify stage's ONNX
    Runtime (CPU) has no kernels for: then fp32, said in a line."""
    dtype = CheckpointFacts.read(src).precision
    if dtype == Precision.BF16:
        log.info(
            "the checkpoint is bf16: run exports fp32, which its verify stage runs in ONNX Runtime on CPU (no bf16 kernels there); pass "
            "--dtype bf16 for bf16 weights"
        )
        return Precision.FP32
    return dtype


def check_convertible(src: Path, kv_heads: int | Sequence[int], method: str, allow_pickle: bool, pool: str | None, local_steps: int | None) -> None:
    """What the convert stage would refuse (method, its step budget, weights and their index, kv heads and the
    attentions pooled), before any stage writes."""
    local_step_budget(get_method(method), local_steps)
    with SourceCheckpoint(src, allow_pickle=allow_pickle) as ckpt:
        target_shapes(ckpt, kv_heads, pool)
        method_for(ckpt, method)


@dataclass(frozen=True)
class Settings:
    """What run was asked for, stage by stage."""

    kv_heads: int | Sequence[int]
    method: str
    shard_size: str | int | None
    allow_pickle: bool
    calibration: Calibration
    pool: str | None
    local_steps: int | None
    distill: DistillStage | None
    export: ExportOptions
    build: Profile
    inputs: InputSpec
    thresholds: Thresholds
    progress: bool

    @property
    def dtype(self) -> Precision:
        assert self.export.dtype is not None  # run resolves it (verifiable_dtype)
        return self.export.dtype

    def reads(self, src: Path) -> list[Path]:
        """Every input the stages read: the source, texts, budget, distill data, timing cache."""
        calibration = self.calibration.text
        distill = self.distill or None
        given = (self.inputs.text, self.inputs.token_ids, self.thresholds.file, self.build.timing_cache,
                 distill and distill.data, distill and distill.eval_data, None if str(calibration) == "weights" else calibration)  # fmt: skip
        return [src, *(Path(p) for p in given if p is not None)]

    def check(self, src: Path) -> None:
        """What each stage would refuse in its options (the distill stage: in its data too), before the
        first one writes. The inputs and thresholds check themselves as they are built."""
        check_conversion(self.shard_size, self.calibration.tokens)
        if self.distill is not None:
            self.distill.check(src)
        check_export(**self.exporting(src))
        for name, value in (("batch", self.build.batch), ("seq", self.build.seq), ("past", self.build.past)):
            if value is not None:
                parse_range(value, name)
        parse_workspace(self.build.workspace)

    def exporting(self, src: Path) -> dict[str, Any]:
        """The export stage's keywords: the options given, and the layout (TensorRT builds the split pair,
        onnxruntime-genai runs merged; an encoder-decoder's graphs run in ONNX Runtime)."""
        seq2seq = CheckpointFacts.read(src).kind == "seq2seq"
        layout = "split" if engine_support() is None and not seq2seq else "merged"
        return {"graphs": layout, **{k: v for k, v in self.export.kwargs().items() if v is not None}}

    def budgets(self) -> dict[str, Any]:
        """The gates as run applies them (a bad budget file fails before any stage runs)."""
        return {"loss": asdict(self.thresholds.loss(self.dtype)), "fidelity": asdict(self.thresholds.fidelity(self.dtype))}


def _run_stages(src: Path, out: Path, ledger: Ledger, settings: Settings, budgets: dict[str, Any], text: str) -> Report:
    stages: dict[str, str] = {}
    total = 4 + (settings.distill is not None)

    def step() -> str:
        return f"[{len(stages) + 1}/{total}] "

    def stage(name: str, inputs: dict[str, Any], output: Path, work: Callable[[], Any]) -> tuple[str, Any]:
        digest, done = _stage(ledger, name, inputs, output, work, step())
        stages[name] = _status(done)
        return digest, done

    converted, onnx_dir, engines, verified = (out / s for s in ("convert", "export", "build", "verify"))
    conversion = {
        "kv_heads": settings.kv_heads, "method": settings.method, "max_shard_size": settings.shard_size, "allow_pickle": settings.allow_pickle,
        "pool": settings.pool, "local_steps": settings.local_steps, **settings.calibration.kwargs(),
    }  # fmt: skip
    conv_digest, _ = stage(
        "convert", {"source": tree_digest(src), **conversion}, converted,
        lambda: convert(src, converted, overwrite=True, progress=settings.progress, builtin_text=corpus.calibration_text(), **conversion),
    )  # fmt: skip
    if settings.distill is not None:  # the distilled checkpoint replaces the converted one downstream
        student, converted, distill = converted, out / "distill", settings.distill
        conv_digest, _ = stage(
            "distill", {"checkpoint": conv_digest, **distill.key(src, student)}, converted, lambda: distill(src, student, converted, progress=settings.progress)
        )
    seq2seq = CheckpointFacts.read(src).kind == "seq2seq"  # encoder.onnx + one merged decoder.onnx, in ONNX Runtime
    exporting = settings.exporting(src)
    exp_digest, _ = stage(
        "export", {"checkpoint": conv_digest, **exporting}, onnx_dir,
        lambda: export(converted, onnx_dir, overwrite=True, progress=settings.progress, **exporting),
    )  # fmt: skip
    build_digest, stages["build"] = _build_stage(ledger, exp_digest, onnx_dir, engines, settings.build.kwargs(), step(), seq2seq)

    verify_inputs = {
        "export": exp_digest,
        "build": build_digest,
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "inputs": {k: v for k, v in asdict(settings.inputs).items() if k != "text"},
        "budgets": budgets,
    }

    def verify_stage() -> Report:
        report = _verify(src, converted, onnx_dir, settings.inputs, settings.thresholds, settings.dtype, engines if build_digest else None, settings.progress)
        report.stages = {**stages, "verify": "ran"}
        _write_report(report, verified)
        return report

    _, report = stage("verify", verify_inputs, verified, verify_stage)
    if report is None:  # skipped: the stored report is intact and still current
        report = Report.load(verified / REPORT_FILES["json"])
        report.stages = {**stages}
    return report


def _build_stage(
    ledger: Ledger, exp_digest: str, onnx_dir: Path, engines: Path, profile: dict[str, Any], step: str, seq2seq: bool = False
) -> tuple[str | None, str]:
    """(engines' sha256, status) when the engines are current, else (None, "skipped: why they were not built")."""
    why_not = "headfold build takes decoder and encoder exports; an encoder-decoder's graphs run in ONNX Runtime" if seq2seq else engine_support()
    if why_not is None:
        inputs = {"export": exp_digest, "tensorrt": tensorrt.__version__, "gpu": _gpu_name(), **{k: v for k, v in profile.items() if v is not None}}
        try:
            digest, done = _stage(ledger, "build", inputs, engines, lambda: build_export(onnx_dir, engines, **profile), step)
            return digest, _status(done)
        except Unparsable as err:  # this TensorRT is too old for the graph: like no TensorRT at all
            why_not = str(err)
    log.info(f"{step}build: skipped, {why_not}; no engine in {engines}")
    return None, f"skipped: {why_not}"


def _gpu_name() -> str:
    return torch.cuda.get_device_name()


def _status(result: Any) -> str:
    return "skipped" if result is None else "ran"
