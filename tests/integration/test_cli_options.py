"""The CLI's option groups: one meaning per flag, headed help, options that do not apply refused,
logging with -v/-q, and a start without torch."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from headfold.cli import cli, main

HEAVY = ("torch", "transformers", "onnx", "onnxruntime")


def test_each_flag_has_one_meaning_across_commands() -> None:
    helps: dict[str, set[str]] = defaultdict(set)
    for command in cli.commands.values():
        for param in command.params:
            if isinstance(param, click.Option):
                helps[param.opts[0]].add(param.help)
    assert {flag: texts for flag, texts in helps.items() if len(texts) > 1} == {}
    for shared in ("--method", "--seed", "--overwrite", "--json", "--trt-version", "--dtype", "--opset", "--batch-size"):
        assert len([c for c in cli.commands.values() if any(shared in p.opts for p in c.params)]) >= 2, shared


@pytest.mark.parametrize(
    "command, headings",
    [
        ("verify", ["Options:", "Input options:", "Thresholds:", "Output:"]),
        ("run", ["Conversion options:", "Distill stage:", "Export options:", "Input options:", "Thresholds:", "Output:"]),
        ("convert", ["Conversion options:", "Calibration (data-aware methods):", "Output:"]),
        ("build", ["TensorRT options:", "Output:"]),
        ("inspect", ["Inspection options:", "Calibration (data-aware methods):", "Output:"]),
    ],
)
def test_help_has_a_heading_per_group(command: str, headings: list[str]) -> None:
    result = CliRunner().invoke(cli, [command, "-h"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert [h for h in lines if h in headings] == headings  # each once, in this order


def test_groups_build_the_objects_their_commands_take() -> None:
    """verify gets one InputSpec and one Thresholds, not their fifteen values."""
    from headfold.options import input_options, threshold_options
    from headfold.verification.budget import Thresholds
    from headfold.verification.inputs import InputSpec

    seen = {}

    def spy(**values):
        seen.update(values)

    decorated = input_options(token_ids=True)(threshold_options(spy))
    probe = click.Command("probe", callback=decorated, params=list(reversed(decorated.__click_params__)))
    probe.main(["--window", "64", "--max-rows", "0", "--seed", "3", "--max-kl", "0.05"], standalone_mode=False)
    assert seen["inputs"] == InputSpec(window=64, max_rows=None, seed=3)
    assert isinstance(seen["thresholds"], Thresholds) and seen["thresholds"].max_kl == 0.05


@pytest.mark.parametrize(
    "args, words",
    [
        (["convert", "{d}/m.onnx", "{d}/o.onnx", "--kv-heads", "2", "--calibration-tokens", "64"], "--calibration-tokens does not apply to an ONNX source"),
        (["convert", "{d}/m.onnx", "{d}/o.onnx", "--kv-heads", "2", "--shard-size", "1GB"], "--shard-size does not apply to an ONNX source"),
        (["convert", "{d}/m.onnx", "{d}/o.onnx", "--kv-heads", "2", "--allow-pickle"], "--allow-pickle does not apply to an ONNX source"),
        (
            ["convert", "{d}/m.onnx", "{d}/o.onnx", "--kv-heads", "2", "--calibration", "{d}/t.txt", "--seed", "1"],
            "--calibration and --seed do not apply to an ONNX source",
        ),
        (
            ["convert", "{d}/src", "{d}/out", "--kv-heads", "2", "--method", "mean", "--calibration", "{d}/t.txt"],
            "--calibration does not apply to --method mean",
        ),
        (["convert", "{d}/src", "{d}/out", "--kv-heads", "2", "--method", "first", "--seed", "3"], "--seed does not apply to --method first"),
        (["inspect", "{d}/src", "--overwrite"], "--overwrite does not apply without --heatmap or --json FILE"),
        (["demo", "--no-distill", "--distill-tokens", "1000"], "--distill-tokens does not apply with --no-distill"),
        (["demo", "--method", "mean", "--local-steps", "3"], "--local-steps applies to methods with local, not to mean"),
        (["verify", "{d}/src", "{d}/src", "--text", "{d}/t.txt", "--token-ids", "{d}/ids.txt"], "--text and --token-ids both name the inputs"),
        (["export", "{d}/src", "{d}/out", "--graphs", "split", "--position-ids"], "position_ids is an input of the merged graph only"),
    ],
)
def test_an_option_that_does_not_apply_is_an_error(args: list[str], words: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "t.txt").write_text("some text")
    (tmp_path / "ids.txt").write_text("1 2 3\n")
    (tmp_path / "src").mkdir()  # a folder, empty: the option is refused before anything reads it (a missing one is "no such folder")
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main([a.format(d=tmp_path) for a in args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err, err
    assert err.startswith("headfold: error:") and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_data_aware_convert_still_takes_calibration(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    args = [
        "convert",
        str(tiny_checkpoint("llama")),
        str(tmp_path / "out"),
        "--kv-heads",
        "2",
        "--method",
        "aligned",
        "--calibration",
        "weights",
        "--calibration-tokens",
        "256",
        "--seed",
        "2",
        "-q",
    ]
    assert main(args) == 0
    assert json.loads((tmp_path / "out" / "headfold.json").read_text())["conversion"]["method"] == "aligned"


@pytest.mark.slow
def test_build_dry_run_json_to_a_file_or_stdout(exported_llama, tmp_path: Path, capsys) -> None:
    capsys.readouterr()
    plan = tmp_path / "plan.json"
    assert main(["build", str(exported_llama), str(tmp_path / "e"), "--dry-run", "--trt-version", "11.0", "--json", str(plan)]) == 0
    out = capsys.readouterr().out
    assert f"wrote JSON {plan}" in out and json.loads(plan.read_text())["target"]
    assert main(["build", str(exported_llama), str(tmp_path / "e"), "--dry-run", "--trt-version", "11.0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(plan.read_text())


@pytest.fixture
def exported_llama(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "onnx"
    assert main(["export", str(tiny_checkpoint("llama")), str(out), "--graphs", "split", "-q"]) == 0
    return out


# -- logging ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags, level", [([], logging.INFO), (["-q"], logging.WARNING), (["-v"], logging.DEBUG)])
def test_group_verbosity_sets_the_headfold_logger(flags: list[str], level: int, tmp_path: Path, capsys) -> None:
    assert main([*flags, "build", str(tmp_path / "m.onnx"), str(tmp_path / "e"), "--json"]) == 2  # fails before any work
    assert logging.getLogger("headfold").level == level
    capsys.readouterr()
    logging.getLogger("headfold.pipeline").info("convert: done")
    logging.getLogger("headfold.ground").warning("headfold: removed a leftover")
    out, err = capsys.readouterr()
    assert out == ""  # stdout carries results only
    assert err == ("" if level == logging.WARNING else "convert: done\n") + "headfold: removed a leftover\n"  # progress and warnings: stderr
    main(["build", str(tmp_path / "m.onnx"), str(tmp_path / "e"), "--json"])  # back to the default for other tests


def test_verbose_shows_what_the_options_became(capsys) -> None:
    assert main(["-v", "demo", "--no-distill", "--distill-tokens", "9", "--max-kl", "0.5"]) == 2  # refused after the groups ran
    out, err = capsys.readouterr()
    assert "thresholds: Thresholds(" in err and "max_kl=0.5" in err and out == ""  # debug lines: stderr
    assert main(["demo", "--no-distill", "--distill-tokens", "9"]) == 2 and "thresholds:" not in capsys.readouterr().err


def test_command_quiet_is_the_group_quiet(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    assert main(["convert", str(tiny_checkpoint("llama")), str(tmp_path / "out"), "--kv-heads", "2", "--method", "mean", "-q"]) == 0
    assert logging.getLogger("headfold").level == logging.WARNING
    assert "wrote" in capsys.readouterr().out  # the result still prints
    main(["build", str(tmp_path / "m.onnx"), str(tmp_path / "e"), "--json"])


# -- fast start ---------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["convert", "-h"], ["verify", "-h"]])
def test_help_starts_without_heavy_libraries(argv: list[str]) -> None:
    probe = f"import sys; from headfold.cli import main; main({argv!r}); print('LOADED', [m for m in {HEAVY!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "LOADED []"


def test_python_dash_m_headfold_is_the_command() -> None:
    result = subprocess.run([sys.executable, "-m", "headfold", "convert", "-h"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "Conversion options:" in result.stdout


def test_mean_conversion_runs_without_torch(tiny_checkpoint, tmp_path: Path) -> None:
    argv = ["convert", str(tiny_checkpoint("llama")), str(tmp_path / "out"), "--kv-heads", "2", "--method", "mean", "-q"]
    probe = f"import sys; from headfold.cli import main; code = main({argv!r}); print('LOADED', code, [m for m in {HEAVY!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines()[-1] == "LOADED 0 []", result.stderr


# -- one set of output options ------------------------------------------------------------------

WRITES = {"convert", "export", "build", "verify", "run", "distill", "inspect", "demo"}  # demo: with --keep; verify: its reports


@pytest.mark.parametrize("command", sorted(cli.commands))
def test_every_command_takes_the_same_output_options(command: str) -> None:
    help_text = CliRunner().invoke(cli, [command, "-h"]).output
    for flag in ("-q, --quiet", "-v, --verbose", "--json [FILE]" if command != "verify" else "--json, --report [FILE]"):
        assert flag in help_text, (command, flag)
    assert ("--overwrite" in help_text) == (command in WRITES)
    assert ("--revision REV" in help_text) == (command in {"convert", "export", "verify", "run", "distill", "inspect"})


def test_run_takes_the_options_of_every_stage_it_runs() -> None:
    help_text = CliRunner().invoke(cli, ["run", "-h"]).output
    for flag in ("--calibration", "--shard-size", "--attention", "--optimize", "--graphs", "--position-ids", "--precision", "--timing-cache",
                 "--distill-data", "--distill-lr", "--distill-train", "--distill-until-kl", "--text", "--budget"):  # fmt: skip
        assert f"{flag} " in help_text, flag


def test_run_takes_the_conversion_options_convert_takes() -> None:
    flags = {name: {opt for p in cli.commands[name].params if isinstance(p, click.Option) for opt in p.opts} for name in ("convert", "run")}
    assert flags["convert"] - flags["run"] == set()


@pytest.mark.parametrize(
    "args, words",
    [
        (["--method", "mean", "--local-steps", "3"], "--local-steps applies to methods with local, not to mean"),
        (["--local-steps", "0"], "--local-steps 0 is not a positive number of steps"),
        (["--pool", "self"], "llama is a decoder with self-attention only: drop --pool"),
    ],
)
def test_run_refuses_a_conversion_option_before_any_stage_writes(args: list[str], words: str, byte_llama: Path, tmp_path: Path, capsys) -> None:
    assert main(["run", str(byte_llama), str(tmp_path / "run"), "--kv-heads", "2", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()


def test_one_default_method_everywhere() -> None:
    import inspect

    import headfold
    from headfold.converter import convert as converter_convert
    from headfold.converter.recipes import DEFAULT_METHOD, get_method
    from headfold.demo import demo
    from headfold.inspection import inspect_checkpoint
    from headfold.pipeline import run

    for command in ("convert", "inspect", "run", "demo"):
        assert f"[default: {DEFAULT_METHOD}]" in " ".join(CliRunner().invoke(cli, [command, "-h"]).output.split()), command
    for function in (headfold.convert, converter_convert, inspect_checkpoint, run, demo):
        assert inspect.signature(function).parameters["method"].default == DEFAULT_METHOD, function
    assert get_method(DEFAULT_METHOD).name == DEFAULT_METHOD == "aligned+scored+refit+local"  # named back as it is written


def test_the_default_calibrates_on_the_weights_when_there_is_no_tokenizer(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    assert main(["convert", str(tiny_checkpoint("llama")), str(tmp_path / "out"), "--kv-heads", "2", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)  # --json -: stdout is the JSON alone
    assert result["conversion"]["method"] == "aligned+scored+refit" and result["conversion"]["calibration"]["text"] == "weights"
    assert "no tokenizer files" in err and "--calibration TEXT_FILE" in err and "the default method is aligned+scored+refit here, without local" in err
    assert main(["convert", str(tiny_checkpoint("llama")), str(tmp_path / "again"), "--kv-heads", "2"]) == 0
    assert capsys.readouterr().out.strip().endswith("(2 kv heads, method aligned+scored+refit)")  # what ran, not what was asked


@pytest.fixture(scope="module")
def byte_llama(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", vocab_size=256)


def test_verify_json_dash_is_the_report_alone(byte_llama: Path, tmp_path: Path, capsys) -> None:
    args = ["verify", str(byte_llama), str(byte_llama), "--max-rows", "2", "--window", "16"]
    assert main([*args, "--json", "-"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["passed"] and report["checks"][0]["name"] == "fidelity" and "all checks passed" in err
    assert main([*args, "--report", str(tmp_path / "r.json"), "--junit", str(tmp_path / "j.xml")]) == 0  # --report: the contract's name
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["checks"][0]["metrics"] == report["checks"][0]["metrics"]
    assert "PASS fidelity" in out and "\x1b[" not in out


@pytest.mark.parametrize("no_color", [False, True])
def test_colours_only_on_a_terminal_and_never_with_no_color(no_color: bool, byte_llama: Path) -> None:
    env = {"NO_COLOR": "1"} if no_color else {}
    result = CliRunner().invoke(cli, ["verify", str(byte_llama), str(byte_llama), "--max-rows", "2", "--window", "16"], color=True, env=env)
    assert result.exit_code == 0, result.output
    assert ("\x1b[" in result.output) == (not no_color)


def test_the_python_api_report_has_no_colours(byte_llama: Path) -> None:
    from headfold.verification import InputSpec, verify

    report = verify(byte_llama, byte_llama, inputs=InputSpec(max_rows=2, window=16))
    assert "\x1b[" not in report.table() and "\x1b[" not in report.markdown()


def test_a_kl_budget_is_in_nats_not_a_percentage(capsys) -> None:
    assert main(["verify", "a", "b", "--max-kl", "5%"]) == 2
    assert "a KL divergence is in nats, not a percentage" in capsys.readouterr().err
    assert "--max-kl NATS" in CliRunner().invoke(cli, ["verify", "-h"]).output


# -- progress and quiet -------------------------------------------------------------------------


def test_verify_shows_its_progress_unless_quiet(byte_llama: Path, capsys) -> None:
    args = ["verify", str(byte_llama), str(byte_llama), "--max-rows", "4", "--window", "16", "--batch-size", "2"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "verify: 100%" in err and "4/4" in err and "verify:" not in out  # rows done, on stderr
    assert main([*args, "-q"]) == 0
    assert "verify:" not in capsys.readouterr().err


@pytest.mark.slow
def test_quiet_export_in_a_fresh_process_prints_nothing(tiny_checkpoint, tmp_path: Path) -> None:
    """The user's path: torch is imported after -q took effect, and resets its own loggers then."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_LOGS"}  # an earlier in-process -q set it in this process
    done = subprocess.run(
        [sys.executable, "-m", "headfold", "export", tiny_checkpoint("llama"), tmp_path / "onnx", "-q"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr  # no "torchvision is not installed" lines
    assert done.stdout.startswith("wrote ") and ": 2 com.microsoft.GroupQueryAttention nodes," in done.stdout  # the op in the graph


# -- demo takes run's options -------------------------------------------------------------------


def test_demo_takes_the_options_run_takes_where_they_apply() -> None:
    flags = {name: {opt for p in cli.commands[name].params if isinstance(p, click.Option) for opt in p.opts} for name in ("run", "demo")}
    assert flags["run"] - flags["demo"] == {
        "--shard-size",
        "--allow-pickle",
        "--revision",
        "--pool",
    }  # the embedded model: a decoder in one small safetensors file, no hub id
    assert flags["demo"] - flags["run"] == {"--keep", "--no-distill"}


@pytest.mark.slow
def test_demo_runs_with_runs_options(tmp_path: Path, capsys) -> None:
    loose = ["--max-kl", "5", "--max-ppl-increase", "500%", "--min-top1", "0"]  # over the reference budget, which --no-distill fails
    args = ["demo", "--no-distill", "--method", "mean", "--max-rows", "2", "--window", "32", "--decode-steps", "2", "--opset", "24", *loose]
    assert main([*args, "--keep", str(tmp_path / "demo"), "--json", "-", "-q"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["inputs"]["rows"], report["inputs"]["window"], report["inputs"]["decode_steps"]) == (2, 32, 2)
    assert json.loads((tmp_path / "demo/export/export.json").read_text())["opset"] == 24
