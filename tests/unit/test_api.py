"""The Python API: one documented function per command, top-level, with real signatures and the
stages' own defaults; `import headfold` loads none of the heavy libraries."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys

import pytest

import headfold

COMMANDS = ["convert", "inspect", "distill", "export", "build", "verify", "run", "load_model"]


def test_import_is_cheap_and_dir_shows_every_command() -> None:
    code = "import sys, json, headfold; print(json.dumps([sorted(m for m in ('torch', 'transformers', 'onnx', 'numpy', 'polygraphy') if m in sys.modules), dir(headfold)]))"
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
    if len(parameters) > 1:  # every argument is explained under Args (a group such as "text … rtol" counts)
        undocumented = [p.name for p in parameters if p.name not in doc and not ("text … rtol" in doc and p.name in VERIFY_INPUTS_AND_BUDGETS)]
        assert undocumented == []


VERIFY_INPUTS_AND_BUDGETS = {"text", "window", "max_rows", "batch_size", "seed", "decode_steps", "budget", "max_ppl_increase", "max_kl", "min_top1", "min_cosine", "atol", "rtol"}


def defaults(function) -> dict:
    return {p.name: p.default for p in inspect.signature(function).parameters.values() if p.default is not inspect.Parameter.empty}


def test_defaults_are_the_stages_own() -> None:
    from headfold.converter import convert
    from headfold.distillation import DistillOptions
    from headfold.graphs.export import export
    from headfold.inspection import inspect_checkpoint
    from headfold.pipeline import run
    from headfold.verification import InputSpec

    api = {name: defaults(getattr(headfold, name)) for name in COMMANDS}
    shared = lambda mine, theirs: {k: v for k, v in mine.items() if k in theirs} == {k: v for k, v in theirs.items() if k in mine}  # noqa: E731
    assert shared(api["convert"], defaults(convert))
    assert shared(api["inspect"], defaults(inspect_checkpoint))
    assert shared(api["export"], {**defaults(export), "position_ids": defaults(export)["explicit_positions"]})
    assert shared(api["run"], defaults(run))
    options = {f.name: f.default for f in dataclasses.fields(DistillOptions)}
    assert set(options) - {"eval_at"} <= set(api["distill"])  # eval_at: the benchmarks' fixed evaluation points
    assert shared(api["distill"], options)
    inputs = {f.name: f.default for f in dataclasses.fields(InputSpec)}
    assert shared(api["verify"], inputs) and shared(api["run"], {k: v for k, v in inputs.items() if k != "token_ids"})


def test_budgets_take_percentages_and_bad_ones_are_bad_input() -> None:
    from headfold.api import _thresholds
    from headfold.ground.errors import BadInput

    thresholds = _thresholds(None, "5%", 0.1, "90%", None, None, None)
    assert (thresholds.max_ppl_increase, thresholds.max_kl, thresholds.min_top1) == (0.05, 0.1, 0.9)
    with pytest.raises(BadInput, match="max_kl"):
        _thresholds(None, None, "lots", None, None, None, None)


def test_the_command_and_the_function_give_the_same_report(tiny_checkpoint, capsys) -> None:
    from headfold.cli import main

    src = tiny_checkpoint("llama", vocab_size=256)
    assert main(["verify", str(src), str(src), "--max-rows", "2", "--window", "16", "--json", "-"]) == 0
    cli_report = json.loads(capsys.readouterr().out)
    api_report = headfold.verify(src, src, max_rows=2, window=16).to_dict()
    strip = lambda report: [{k: v for k, v in check.items() if k not in ("seconds",)} | {"reference": None, "candidate": None} for check in report["checks"]]  # noqa: E731
    assert strip(cli_report) == strip(api_report) and cli_report["inputs"] == api_report["inputs"]
