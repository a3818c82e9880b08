"""CLI surface of verify/run/demo: commands, shared options, the CI example parses."""

from __future__ import annotations

from pathlib import Path

import yaml
from click.testing import CliRunner

from headfold.cli import cli

ROOT = Path(__file__).resolve().parents[2]


def test_commands_share_option_groups() -> None:
    runner = CliRunner()
    for command in ("verify", "run", "demo"):
        result = runner.invoke(cli, [command, "--help"])
        assert result.exit_code == 0
        for option in ("--budget", "--max-ppl-increase", "--max-kl", "--min-top1", "--min-cosine", "--atol", "--rtol"):
            assert option in result.output, (command, option)
    for command in ("verify", "run"):
        assert "--text" in runner.invoke(cli, [command, "--help"]).output
    assert "--junit" in runner.invoke(cli, ["verify", "--help"]).output


def test_run_refuses_an_output_inside_the_source(tmp_path: Path) -> None:
    from headfold.cli import main

    (tmp_path / "config.json").write_text("{}")
    assert main(["run", str(tmp_path), str(tmp_path / "out"), "--kv-heads", "1"]) == 2
    assert not (tmp_path / "out").exists()


def test_ci_example_gates_on_reports() -> None:
    workflow = yaml.safe_load((ROOT / "examples/accuracy-gate.yml").read_text())
    steps = workflow["jobs"]["gate"]["steps"]
    commands = "\n".join(s.get("run", "") for s in steps)
    assert "headfold convert" in commands and "--junit" in commands and "--report" in commands
    assert "jq -e '.passed'" in commands
    assert (ROOT / "examples/budget.toml").is_file()


def test_run_with_bad_input_writes_nothing(tmp_path: Path) -> None:
    from headfold.cli import main
    from headfold.demo import default_model_path

    for extra in (["--kv-heads", "3"], ["--kv-heads", "4", "--method", "bogus"], ["--kv-heads", "4", "--budget", str(tmp_path / "no.toml")]):
        assert main(["run", str(default_model_path()), str(tmp_path / "out"), *extra]) == 2
        assert not (tmp_path / "out").exists()
