"""`headfold inspect`: exact planner, exact predictions (identity, identical heads, equal to a real
conversion), outputs written atomically, bad input refused with exit 2 and nothing written."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from support.checkpoint_edits import edit_attention, identical_heads
from support.tiny_models import HEADS

from headfold.cli import main
from headfold.converter.planning import best_plan, best_uniform, budget_total
from headfold.demo import default_model_path
from headfold.ground.errors import BadInput
from headfold.inspection import Reference, choose_windows, inspect_checkpoint

FAST = {"calibration_tokens": 512, "progress": False}  # 2 fit + 2 eval windows of 256 tokens
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def byte_level(tiny_checkpoint, family: str) -> Path:
    """A tiny checkpoint that reads the built-in text as bytes, with room for 256-token windows."""
    positions = {"gpt2": {"n_positions": 256}, "bert": {"max_position_embeddings": 256}}.get(family, {})
    return tiny_checkpoint(family, vocab_size=256, **positions)


# -- planner -----------------------------------------------------------------------------------


def brute_force(layers: list[dict[int, float]], budget: int) -> float | None:
    totals = [sum(o[k] for o, k in zip(layers, picks, strict=True)) for picks in itertools.product(*layers) if sum(picks) <= budget]
    return min(totals, default=None)


def test_planner_equals_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(300):
        heads = rng.choice([4, 6, 8])
        options = [k for k in range(1, heads + 1) if heads % k == 0]
        layers = [{k: (0.0 if k == heads else rng.random() / k) for k in options} for _ in range(rng.randint(1, 4))]
        budget = rng.randint(1, heads * len(layers))
        expected = brute_force(layers, budget)
        if expected is None:
            with pytest.raises(BadInput, match="kv-budget"):
                best_plan(layers, budget)
            continue
        plan = best_plan(layers, budget)
        assert plan.total <= budget and len(plan.kv_heads) == len(layers)
        assert plan.loss == pytest.approx(expected, abs=1e-12)
        assert plan.loss == pytest.approx(sum(o[k] for o, k in zip(layers, plan.kv_heads, strict=True)), abs=1e-12)
        uniform = best_uniform(layers, budget)
        assert uniform is None or (uniform.total <= budget and uniform.loss >= plan.loss - 1e-12)


def test_plan_argument_and_budget() -> None:
    plan = best_plan([{8: 0.0, 4: 0.1, 2: 0.3}, {8: 0.0, 4: 0.5, 2: 0.6}], 10)
    assert plan.kv_heads == (2, 8) and plan.argument == "--kv-heads 2,8"
    assert best_uniform([{8: 0.0, 4: 0.1}, {8: 0.0, 4: 0.5}], 8).argument == "--kv-heads 4"
    assert budget_total(0.25, 32) == 8 and budget_total(0.3, 40) == 12 and budget_total(7, 32) == 7
    for bad in (0.0, 1.5, 0):
        with pytest.raises(BadInput, match="kv-budget"):
            budget_total(bad, 32)


# -- exactness ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_all_heads_predicts_no_loss(family: str, tiny_checkpoint) -> None:
    report = inspect_checkpoint(byte_level(tiny_checkpoint, family), candidates=f"{HEADS},2", kv_budget=1.0, **FAST)
    assert all(abs(layer.loss[HEADS]) <= 1e-6 and layer.loss[2] > 1e-4 for layer in report.layers)
    assert report.plan.plan.kv_heads == (HEADS,) * 2 and abs(report.plan.measured) <= 1e-12  # untouched model
    assert report.kind == ("encoder" if family == "bert" else "decoder")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mean", "aligned+grouped+refit"])
def test_identical_heads_predict_no_loss(method: str, tiny_checkpoint, tmp_path: Path) -> None:
    src = edit_attention(byte_level(tiny_checkpoint, "llama"), tmp_path / "twins", identical_heads(2))
    report = inspect_checkpoint(src, candidates="4,2", method=method, **FAST)
    for layer in report.layers:
        assert layer.loss[4] <= 1e-6 < layer.loss[2]
        assert torch.allclose(layer.similarity.nearest, torch.ones(HEADS, dtype=torch.float64), atol=1e-5)  # aligned: an SVD in fp32 activations


@pytest.mark.slow
def test_prediction_equals_a_real_conversion(tmp_path: Path) -> None:
    """The plan measured with every layer swapped in equals `convert` then loading the GQA model."""
    from headfold import Calibration, convert, corpus
    from headfold.converter.calibration import token_ids
    from headfold.converter.modeling import load_model

    src = default_model_path()
    report = inspect_checkpoint(src, candidates="4", method="aligned+grouped+refit", kv_budget=16, calibration_tokens=1024, progress=False)
    assert report.uniform.plan.kv_heads == (4,) * 4
    out = convert(src, tmp_path / "kv4", 4, "aligned+grouped+refit", Calibration(tokens=1024), progress=False)
    windows = choose_windows(token_ids(src, corpus.calibration_text(), 256), 1024, 0, fit=True)
    reference = Reference(load_model(src, dtype=torch.float32), windows.eval, "decoder")
    reference.model = load_model(out, dtype=torch.float32)
    assert reference.loss() == pytest.approx(report.uniform.measured, rel=1e-4)


# -- the embedded model, through the CLI -------------------------------------------------------


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, Path]:
    out = tmp_path_factory.mktemp("inspect")
    args = [
        "inspect",
        str(default_model_path()),
        "--kv-budget",
        "0.25",
        "--calibration-tokens",
        "2048",
        "--heatmap",
        str(out / "h.png"),
        "--json",
        str(out / "r.json"),
        "-q",
    ]
    return main(args), out / "h.png", out / "r.json"


@pytest.mark.slow
def test_embedded_model_losses_and_plan(embedded) -> None:
    code, _, json_path = embedded
    assert code == 0
    data = json.loads(json_path.read_text())
    assert data["candidates"] == [4, 2, 1] and len(data["per_layer"]) == 4
    for layer in data["per_layer"]:
        assert layer["loss"]["1"] > layer["loss"]["4"] > 0
    plan, uniform = data["plan"], data["uniform"]
    assert sum(plan["kv_heads"]) <= 8 and plan["cache_fraction"] <= 0.25
    assert uniform["kv_heads"] == [2] * 4 and plan["predicted"] <= uniform["predicted"]
    assert plan["argument"] == "--kv-heads " + ",".join(map(str, plan["kv_heads"]))
    assert data["calibration"]["eval_held_out"] and data["calibration"]["fit_windows"] == 8


@pytest.mark.slow
def test_embedded_outputs_hold_every_number(embedded) -> None:
    from matplotlib.image import imread

    _, png, json_path = embedded
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = imread(png).shape
    assert height > 200 and width > 400
    data = json.loads(json_path.read_text())
    for layer in data["per_layer"]:
        for matrix in (layer["similarity"]["keys"], layer["similarity"]["values"]):
            assert len(matrix) == 8 and all(len(row) == 8 and row[i] == pytest.approx(1.0) for i, row in enumerate(matrix))
        assert len(layer["similarity"]["nearest"]) == 8 and set(layer["loss"]) == set(layer["groups"]) == {"4", "2", "1"}
    assert {"predicted", "measured", "cache_fraction", "kv_heads"} <= set(data["plan"])


# -- determinism and bad input ------------------------------------------------------------------


@pytest.mark.slow
def test_deterministic_for_a_seed(tiny_checkpoint) -> None:
    src = byte_level(tiny_checkpoint, "llama")
    runs = [inspect_checkpoint(src, seed=seed, kv_budget=0.5, **FAST).to_json() for seed in (3, 3, 4)]
    assert runs[0] == runs[1]
    assert runs[0]["per_layer"][0]["loss"] != runs[2]["per_layer"][0]["loss"]


def run_inspect(src: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()  # drop what building the tiny checkpoint printed
    code = main(["inspect", str(src), *args, "-q"])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--candidates", "3"], "does not divide"),
        (["--candidates", "4,x"], "comma-separated"),
        (["--kv-budget", "1"], "smallest plan needs 2"),
        (["--kv-budget", "2", "--candidates", "4"], "smallest plan needs"),
        (["--kv-budget", "150%"], "fraction"),
        (["--method", "median"], "unknown method"),
    ],
)
def test_bad_requests_exit_2_and_write_nothing(args: list[str], message: str, tiny_checkpoint, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code, err = run_inspect(byte_level(tiny_checkpoint, "llama"), *args, "--json", str(out / "r.json"), "--heatmap", str(out / "h.png"), capsys=capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_existing_output_is_refused(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    existing = tmp_path / "r.json"
    existing.write_text("keep")
    code, err = run_inspect(byte_level(tiny_checkpoint, "llama"), "--heatmap", str(tmp_path / "h.png"), "--json", str(existing), capsys=capsys)
    assert code == 2 and "--overwrite" in err
    assert existing.read_text() == "keep" and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_same_path_for_both_outputs_is_refused(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    code, err = run_inspect(byte_level(tiny_checkpoint, "llama"), "--heatmap", str(tmp_path / "x"), "--json", str(tmp_path / "x"), capsys=capsys)
    assert code == 2 and "same path" in err and not any(tmp_path.iterdir())


@pytest.mark.slow
def test_overwrite_replaces_outputs(tiny_checkpoint, tmp_path: Path) -> None:
    existing = tmp_path / "r.json"
    existing.write_text('{"created_by": "headfold 0.1.0"}')  # an earlier inspect's: --overwrite replaces only headfold's files
    inspect_checkpoint(byte_level(tiny_checkpoint, "llama"), candidates="2", json_path=existing, overwrite=True, **FAST)
    assert json.loads(existing.read_text())["candidates"] == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary left behind


def test_per_layer_source_is_refused(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    from headfold import convert

    mixed = convert(byte_level(tiny_checkpoint, "llama"), tmp_path / "mixed", (4, 2), method="mean", progress=False)
    code, err = run_inspect(mixed, capsys=capsys)
    assert code == 2 and "already has per-layer kv heads" in err


def test_folder_as_output_is_refused(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "results"
    (folder / "keep").mkdir(parents=True)
    code, err = run_inspect(byte_level(tiny_checkpoint, "llama"), "--json", str(folder), "--overwrite", capsys=capsys)
    assert code == 2 and "is a folder" in err and (folder / "keep").is_dir()
