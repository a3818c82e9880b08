"""The Python API: one documented function per command, top-level, taking the settings objects the
command builds, each default declared once; `import headfold` loads none of the heavy libraries."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import headfold
from headfold import Calibration, DistillOptions, ExportOptions, InputSpec, Profile
from headfold.ground.errors import BadOption

COMMANDS = ["convert", "inspect", "distill", "export", "build", "verify", "run", "load_model"]


def test_import_is_cheap_and_dir_shows_every_command() -> None:
    code = (
        "import sys, json, headfold; print(json.dumps([sorted(m for m in ('torch', 'transformers', 'onnx', 'numpy', 'polygraphy') if m in "
        "sys.modules), dir(headfold)]))"
    )
    heavy, names = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert heavy == []
    assert set(COMMANDS) <= set(names) and set(COMMANDS) <= set(headfold.__all__)


@pytest.mark.parametrize("name", COMMANDS)
def test_signature_is_spelled_out_and_documented(name: str) -> None:
    function = getattr(headfold, name)
    parameters = inspect.signature(function).parameters.values()
    assert not [p.name for p in parameters if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    doc = inspect.getdoc(function)
    assert doc and inspect.signature(function).return_annotation is not inspect.Signature.empty
    if len(parameters) > 1:  # every argument is explained under Args
        assert [p.name for p in parameters if p.name not in doc] == []


def test_the_api_takes_the_settings_objects_with_their_own_defaults() -> None:
    """Each command's settings are one object, defaulting to that object's defaults: no option is re-declared."""
    expected = {
        "convert": {"calibration": Calibration()}, "inspect": {"calibration": Calibration()}, "distill": {"options": DistillOptions()},
        "export": {"options": ExportOptions()}, "build": {"profile": Profile()}, "verify": {"inputs": InputSpec(), "thresholds": None},
        "run": {"calibration": Calibration(), "distill": None, "export": ExportOptions(), "profile": Profile(), "inputs": InputSpec(), "thresholds": None},
    }  # fmt: skip
    for name, objects in expected.items():
        given = defaults(getattr(headfold, name))
        assert {k: given[k] for k in objects} == objects, name
        assert not set(given) & {"opset", "dtype", "calibration_tokens", "seq_len", "window", "max_rows", "precision"}, name
    assert {c.__name__ for c in (Calibration, ExportOptions, Profile, DistillOptions, InputSpec)} <= set(headfold.__all__)
    assert headfold.Thresholds.__module__ == "headfold.verification.budget" and headfold.DistillStage.__module__ == "headfold.distillation.stage"


def test_defaults_are_declared_once() -> None:
    """The click options, the stages' keyword defaults and the objects agree, because the first two read the third."""
    from headfold.cli import cli
    from headfold.converter import convert
    from headfold.graphs.export import export
    from headfold.inspection import inspect_checkpoint

    def cli_defaults(command: str) -> dict:
        return {p.name: p.default for p in cli.commands[command].params if isinstance(p.default, (int, float, str, type(None)))}  # not a flag's unset

    fields = lambda cls: {f.name: f.default for f in dataclasses.fields(cls)}  # noqa: E731
    shared = lambda mine, theirs: {k: v for k, v in mine.items() if k in theirs} == {k: v for k, v in theirs.items() if k in mine}  # noqa: E731
    assert shared(cli_defaults("export"), fields(ExportOptions)) and shared(defaults(export), fields(ExportOptions))
    assert shared(cli_defaults("build"), fields(Profile))
    assert shared(cli_defaults("verify"), fields(InputSpec))
    assert shared(cli_defaults("distill"), fields(DistillOptions))
    calibration = {"calibration_tokens": Calibration.tokens, "seed": Calibration.seed}
    assert shared(cli_defaults("convert"), calibration) and shared(defaults(convert), calibration) and shared(defaults(inspect_checkpoint), calibration)


def defaults(function) -> dict:
    return {p.name: p.default for p in inspect.signature(function).parameters.values() if p.default is not inspect.Parameter.empty}


def test_a_path_stands_for_its_object() -> None:
    """A calibration text or a budget file alone, as the command line takes them."""
    from headfold.api import _calibration, _thresholds

    assert _calibration("weights") == Calibration(text="weights") and _calibration(None) == Calibration()
    assert _thresholds("budget.toml").file.name == "budget.toml" and _thresholds(None) == headfold.Thresholds()


def test_the_command_and_the_function_give_the_same_report(tiny_checkpoint, capsys) -> None:
    from headfold.cli import main

    src = tiny_checkpoint("llama", vocab_size=256)
    assert main(["verify", str(src), str(src), "--max-rows", "2", "--window", "16", "--json", "-"]) == 0
    cli_report = json.loads(capsys.readouterr().out)
    api_report = headfold.verify(src, src, inputs=InputSpec(max_rows=2, window=16)).to_dict()
    strip = lambda report: [{k: v for k, v in check.items() if k not in ("seconds",)} | {"reference": None, "candidate": None} for check in report["checks"]]  # noqa: E731
    assert strip(cli_report) == strip(api_report) and cli_report["inputs"] == api_report["inputs"]


def test_settings_objects_take_text_where_the_command_line_does(tmp_path: Path) -> None:
    """Paths and fractions as text, as a user writes them: parsed once, as the options parse them."""
    from headfold.ground.precision import Precision
    from headfold.verification.budget import Thresholds

    assert InputSpec(text="t.txt", token_ids="ids.jsonl").text == Path("t.txt")
    assert InputSpec(token_ids="ids.jsonl").token_ids == Path("ids.jsonl")
    assert Profile(precision="fp16", timing_cache="cache.bin") == Profile(precision=Precision.FP16, timing_cache=Path("cache.bin"))
    assert ExportOptions(dtype="int4").dtype is Precision.INT4
    assert DistillOptions(until_ppl_increase="2%").until_ppl_increase == pytest.approx(0.02)
    budget = tmp_path / "budget.toml"
    budget.write_text("[loss]\nmax_kl = 0.5\n")
    assert Thresholds(file=str(budget)).loss().max_kl == 0.5
    with pytest.raises(BadOption, match="--dtype 'fp64' is not one of fp32, fp16, bf16, int4"):
        ExportOptions(dtype="fp64")
    with pytest.raises(BadOption, match="--precision 'int4' is not one of fp32, fp16, bf16"):
        Profile(precision="int4")
