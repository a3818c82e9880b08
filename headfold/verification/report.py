"""The verification report: JSON (everything), Markdown (a PR comment), JUnit XML (CI), terminal table."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from headfold.ground.artifacts import CREATED_BY, created_by, mark_comment
from headfold.ground.atomic import atomic_outputs
from headfold.ground.errors import CheckFailed
from headfold.ground.hashing import versions
from headfold.ground.inputs import read_json_object
from headfold.verification.checks import CheckResult

_PACKAGES = ("headfold", "torch", "transformers", "onnx", "onnxruntime", "numpy", "tensorrt")
_PERCENT = ("top1", "ppl_increase", "mismatched_fraction", "max_ppl_increase", "min_top1")


def _finite(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _percent(metric: str) -> bool:
    return metric.split(".")[-1] in _PERCENT


def fmt(metric: str, value: Any) -> str:
    if isinstance(value, (int, str)) or value is None:
        return str(value)
    if _percent(metric):
        return f"{value:.2%}"
    return f"{value:.4g}"


@dataclass
class Report:
    checks: list[CheckResult]
    inputs: dict[str, Any]
    versions: dict[str, str] = field(default_factory=lambda: versions(_PACKAGES))
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    stages: dict[str, Any] = field(default_factory=dict)  # `headfold run`: what each stage did

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def failure_message(self) -> str:
        failed = [f"{c.name}: {g.message()}" for c in self.checks for g in c.failures]
        return "verification failed: " + "; ".join(failed)

    def raise_for_failures(self) -> None:
        """CheckFailed (exit 1) naming every failed metric, its value and its budget."""
        if not self.passed:
            raise CheckFailed(self.failure_message())

    def to_dict(self) -> dict[str, Any]:
        return _finite(
            {
                CREATED_BY: created_by(),  # headfold's mark: --overwrite replaces only marked files
                "passed": self.passed,
                "created": self.created,
                "inputs": self.inputs,
                "versions": self.versions,
                "stages": self.stages,
                "checks": [c.to_dict() for c in self.checks],
            }
        )

    def write(
        self,
        json_path: Path | None = None,
        markdown_path: Path | None = None,
        junit_path: Path | None = None,
        *,
        overwrite: bool = False,
        sources: Iterable[Path] = (),
    ) -> None:
        """The reports asked for, all appearing together or none (ground.atomic: never over a file
        of `sources`, an existing one only with `overwrite` and only when headfold wrote it)."""
        texts = [(path, text) for path, text in ((json_path, self.to_json), (markdown_path, self.markdown), (junit_path, self.junit)) if path is not None]
        with atomic_outputs([(path, False) for path, _ in texts], overwrite=overwrite, sources=sources) as staged:
            for path, text in texts:
                staged[path].write_text(text())

    @classmethod
    def load(cls, path: Path) -> Report:
        data = read_json_object(path, "remove it to verify again")
        checks = [CheckResult.from_dict(c) for c in data["checks"]]
        return cls(checks, data["inputs"], data["versions"], data["created"], data["stages"])

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def rows(self, check: CheckResult) -> list[tuple[str, str, str, str]]:
        """(metric, value, budget, PASS/FAIL/"") per metric; gated metrics carry their budget."""
        gates = {g.metric: g for g in check.gates}
        rows = []
        for metric, value in check.metrics.items():
            if metric == "output":
                continue
            gate = gates.get(metric)
            if gate is None:
                rows.append((metric, fmt(metric, value), "", ""))
                continue
            shown, budget = gate.shown(percent=_percent(metric))
            rows.append((metric, shown, f"{gate.op} {budget}", "PASS" if gate.passed else "FAIL"))
        return rows

    def _title(self, check: CheckResult) -> str:
        title = f"{check.name}: {check.reference['runner']} vs {check.candidate['runner']}"
        timed = [f"{side['runner']} {side['latency_ms']:.3g} ms" for side in (check.reference, check.candidate) if "latency_ms" in side]
        return title + (f" (median per batch: {', '.join(timed)})" if timed else "")

    def markdown(self) -> str:
        verdict = "✅ passed" if self.passed else "❌ failed"
        lines = [
            mark_comment(),
            f"## headfold verify: {verdict}",
            "",
            f"Text: `{self.inputs['text']}`, {self.inputs['tokens']} tokens in {self.inputs['rows']} rows (seed {self.inputs['seed']}).",
            "",
        ]
        for check in self.checks:
            lines += [f"### {'✅' if check.passed else '❌'} {self._title(check)}", "", "| metric | value | budget | result |", "|---|---:|---|---|"]
            lines += [f"| {m} | {v} | {b} | {r} |" for m, v, b, r in self.rows(check)]
            lines += ["", *(f"_Note: {note}._" for note in check.notes)] if check.notes else []
            lines.append("")
        return "\n".join(lines)

    def junit(self) -> str:
        """JUnit XML: one testsuite, one testcase per check, a <failure> naming every failed gate."""
        failures = sum(not c.passed for c in self.checks)
        seconds = f"{sum(c.seconds for c in self.checks):.3f}"
        root = ET.Element("testsuites", name="headfold", tests=str(len(self.checks)), failures=str(failures), errors="0", time=seconds)
        suite = ET.SubElement(
            root, "testsuite", name="headfold.verify", tests=str(len(self.checks)), failures=str(failures),
            errors="0", skipped="0", time=seconds, timestamp=self.created,
        )  # fmt: skip
        props = ET.SubElement(suite, "properties")
        for key in ("text", "text_sha256", "input_ids_sha256", "tokens"):
            if key in self.inputs:  # random ids and --token-ids have no text hash
                ET.SubElement(props, "property", name=key, value=str(self.inputs[key]))
        for check in self.checks:
            case = ET.SubElement(suite, "testcase", classname=f"headfold.verification.{check.kind}", name=check.name, time=f"{check.seconds:.3f}")
            if not check.passed:
                message = "; ".join(g.message() for g in check.failures)
                ET.SubElement(case, "failure", message=message, type="ThresholdExceeded").text = message
            rows = [f"{m} = {v} {b} {r}".rstrip() for m, v, b, r in self.rows(check)]
            ET.SubElement(case, "system-out").text = "\n".join(rows + [f"note: {n}" for n in check.notes])
        ET.indent(root)
        return f'<?xml version="1.0" encoding="UTF-8"?>\n{mark_comment()}\n' + ET.tostring(root, encoding="unicode") + "\n"

    def table(self, color: bool = False) -> str:
        """The terminal summary: one block per check; with `color`, verdicts in green and red (the CLI
        asks for them; click drops them off a terminal and with NO_COLOR)."""
        colours = {"PASS": "green", "FAIL": "red"}

        def paint(verdict: str, bold: bool = False) -> str:
            return click.style(verdict, fg=colours[verdict], bold=bold) if color and verdict else verdict

        lines = []
        for check in self.checks:
            status = paint("PASS" if check.passed else "FAIL", bold=True)
            lines += [f"{status} {self._title(check)}  [{check.seconds:.1f} s]", f"  {'metric':<22} {'value':>12}  {'budget':<12} result"]
            for metric, value, budget, verdict in self.rows(check):
                mark = paint(verdict)
                lines.append(f"  {metric:<22} {value:>12}  {budget:<12} {mark}".rstrip())
            lines += [f"  note: {note}" for note in check.notes]
        return "\n".join(lines)
