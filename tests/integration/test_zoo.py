"""The quality zoo's scripts at a toy size (benchmarks/zoo.py, zoo_models.py; the full zoo is a
benchmark): narrow copies of two members train for a few steps into a temporary cache, deterministically,
and the quality harness scores a conversion of each on its held-out text, rows rendered as docs show them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import render, zoo_models
from benchmarks import zoo as zoo_harness


@pytest.fixture(scope="module")
def zoo():
    return zoo_harness, zoo_models, render


@pytest.fixture(scope="module")
def cache(zoo, tmp_path_factory) -> Path:
    _, models, _ = zoo
    cache = tmp_path_factory.mktemp("zoo")
    for name in ("llama-16h", "t5"):
        models.ensure(models.toy(models.MEMBERS[name]), cache, log=lambda _: None)
    return cache


def test_a_member_is_written_whole_with_its_record(zoo, cache: Path) -> None:
    _, models, _ = zoo
    record = json.loads((cache / "llama-16h" / "training.json").read_text())
    assert sorted(p.name for p in (cache / "llama-16h").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "training.json",
    ]
    assert record["weights_sha256"] == models.sha256(cache / "llama-16h" / "model.safetensors")
    assert (record["heads"], record["head_dim"], record["layers"]) == (16, 8, 2)
    assert record["pretraining_tokens"] == 3 * 2 * 256 == record["recipe"]["steps"] * record["recipe"]["batch_size"] * record["recipe"]["seq_len"]
    assert record["corpus"]["train_bytes"] > 5_000_000 and record["corpus"]["heldout_files"] > 0 and len(record["corpus"]["sha256"]) == 64
    assert not list(cache.glob(".*partial*"))
    index = (cache / "INDEX.md").read_text()
    assert "| llama-16h | RoPE Llama, 16 heads | 16 | 8 | 2 | 1536 |" in index and "| t5 | T5, " in index


def test_training_is_deterministic(zoo, cache: Path, tmp_path: Path) -> None:
    _, models, _ = zoo
    again = models.ensure(models.toy(models.MEMBERS["llama-16h"]), tmp_path, log=lambda _: None)
    assert models.sha256(again / "model.safetensors") == json.loads((cache / "llama-16h" / "training.json").read_text())["weights_sha256"]


def test_quality_rows_score_each_conversion_on_held_out_text(zoo, cache: Path, tmp_path: Path) -> None:
    harness, _, render = zoo
    results, entries, rows = tmp_path / "zoo_quality.json", [], []
    for name in ("llama-16h", "t5"):
        model = harness.subject(name, cache, log=lambda _: None)
        entries.append(harness.model_entry(model, (0.0, 0.0)))
        rows += harness.quality_rows(model, ["mean"], "h/4", tmp_path, log=lambda _: None)
    assert [(r["model"], r["kv"], r["kv_heads"], r["method"], r["calibration"]) for r in rows] == [
        ("llama-16h", "h/4", 4, "mean", "built-in"),
        ("t5", "h/4", 2, "mean", "built-in"),
    ]
    for row, entry in zip(rows, entries, strict=True):
        assert set(row) == {"model", "kv", "kv_heads", "method", "calibration", "kl", "ppl", "reference_ppl", "ppl_increase", "top1", "convert_s"}
        assert row["kl"] > 0 and 0 <= row["top1"] <= 1 and row["convert_s"] > 0
        assert row["reference_ppl"] == pytest.approx(entry["heldout_perplexity"], rel=1e-3)  # the original scored as training.json scored it
    harness.merge(results, entries, rows, "test")
    page = render.zoo_quality(json.loads(results.read_text()))
    assert "| llama-16h | h/4 (4) |" in page and "| t5 | h/4 (2) |" in page


def test_kv_counts_name_distinct_divisors(zoo) -> None:
    harness, _, _ = zoo
    assert harness.zoo_models.kv_counts("h/2,h/4,1", 8) == {"h/2": 4, "h/4": 2, "MQA": 1}
    assert harness.zoo_models.kv_counts("h/2,h/4,1", 12) == {"h/2": 6, "h/4": 3, "MQA": 1}
    assert harness.zoo_models.kv_counts("h/2,h/4,1", 4) == {"h/2": 2, "MQA": 1}  # h/4 is MQA: counted once


def test_the_default_is_chosen_by_mean_rank(zoo) -> None:
    """Each method measured on every model is ranked per model by its loss (ties share a rank; an encoder's
    loss is 1 − cosine); a method missing on one model is not ranked; equal mean ranks go to the method
    closest to the best on its worst model."""
    _, _, render = zoo
    row = lambda model, method, loss: {"model": model, "kv": "h/4", "method": method, "calibration": "built-in", **loss}  # noqa: E731
    rows = [row("a", "mean", {"kl": 2.0}), row("a", "x", {"kl": 0.5}), row("a", "y", {"kl": 0.55}), row("a", "z", {"kl": 0.1}),
            row("b", "mean", {"kl": 1.0}), row("b", "x", {"kl": 0.3}), row("b", "y", {"kl": 0.2}),
            row("enc", "mean", {"cosine": 0.5}), row("enc", "x", {"cosine": 0.9}), row("enc", "y", {"cosine": 0.9})]  # fmt: skip
    data = {"models": [{"model": m} for m in ("a", "b", "enc")], "rows": rows, "default_method": "mean"}
    assert render.zoo_ranks(data) == {
        "y": ((2 + 1 + 1.5) / 3, pytest.approx(1.1)),
        "x": ((1 + 2 + 1.5) / 3, pytest.approx(1.5)),
        "mean": (3.0, pytest.approx(5.0)),
    }
    assert list(render.zoo_ranks(data)) == ["y", "x", "mean"]  # x and y tie on mean rank: y stays within 10 % of the best, x within 50 %
    assert "Chosen: `y`; the default is `mean`." in render.zoo_choice(data)


def test_the_layout_costs_child_process_reports_its_cost(tiny_checkpoint, tmp_path: Path) -> None:
    """method_parts.py --layout times each conversion in a fresh process running CHILD: it converts and prints its cost."""
    import subprocess
    import sys

    from benchmarks import method_parts

    src = tiny_checkpoint("llama")
    done = subprocess.run([sys.executable, "-c", method_parts.CHILD, str(src), str(tmp_path / "out"), "mean", "0"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    cost = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(cost) == {"convert_s", "convert_cpu_s", "local_fit_cpu_s", "peak_rss_mb"} and cost["local_fit_cpu_s"] == 0 and cost["peak_rss_mb"] > 0


@pytest.mark.slow
def test_the_rate_benchmark_runs_at_toy_size(tmp_path: Path) -> None:
    """benchmarks/distill_rate.py on the embedded model from `mean`, one tiny budget, a fixed rate and the chosen one:
    each row holds its scores, and the chosen row its probe."""
    from benchmarks import distill_rate, method_parts

    rows = distill_rate.rows_for(method_parts.model("embedded"), ["mean"], [0.0005], [1e-3, None], tmp_path)
    assert [r["lr"] for r in rows] == [1e-3, "chosen"] and all(r["kl"] < r["start_kl"] for r in rows)
    assert rows[1]["chosen_lr"] == rows[1]["probe"]["lr"] and rows[1]["probe"]["steps"] >= 1
