"""headfold verify on encoder-decoders (T5, BART, Whisper): fidelity of the export (encoder.onnx +
decoder.onnx, the target's last tokens through the self-attention cache) against torch, and
conversion loss of a pooled checkpoint on (source, target) pairs; mixed kinds refused in one line;
headfold run (convert → export → verify, no TensorRT build) on T5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.tiny_models import SEQ2SEQ

from headfold import convert
from headfold.cli import main
from headfold.graphs.export import export
from headfold.pipeline import run
from headfold.verification import InputSpec, Thresholds

SMALL = ["--window", "24", "--max-rows", "8", "--batch-size", "4"]
BYTES = {"vocab_size": 256}  # the byte tokenizer: the held-out text feeds the loss check
KV = 4


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """tiny(family) → {"src", "kv8" (identity), "kv4", "onnx" (kv4's export)}, built once per module."""
    cache: dict[str, dict[str, Path]] = {}

    def get(family: str) -> dict[str, Path]:
        if family not in cache:
            root, src = tmp_path_factory.mktemp(f"verify-{family}"), tiny_checkpoint(family, **BYTES)
            paths = {"src": src, **{f"kv{kv}": convert(src, root / f"kv{kv}", kv, method="mean", progress=False) for kv in (8, KV)}}
            export(paths[f"kv{KV}"], root / "onnx", progress=False)
            cache[family] = {**paths, "onnx": root / "onnx"}
        return cache[family]

    return get


def report(argv: list[str], path: Path) -> tuple[int, dict]:
    code = main([*argv, *SMALL, "--report", str(path), "--quiet"])
    return code, json.loads(path.read_text())


@pytest.mark.parametrize("family", SEQ2SEQ)
def test_fidelity_of_the_export_with_cache_steps(family: str, tiny, tmp_path: Path) -> None:
    paths = tiny(family)
    code, result = report(["verify", str(paths[f"kv{KV}"]), str(paths["onnx"])], tmp_path / "r.json")
    (check,) = result["checks"]
    assert code == 0 and check["kind"] == "fidelity" and check["passed"]
    assert check["metrics"]["mismatched"] == 0 and check["metrics"]["top1"] == 1.0
    assert check["metrics"]["max_abs_err"] < 1e-4
    assert check["candidate"]["decode_steps"] == "16" and "decoder.onnx_sha256" in check["candidate"]
    per_token = 2 * KV * 8 * 4 * 2  # K and V, kv heads × head dim 8 × fp32, 2 decoder layers
    assert check["candidate"]["kv_cache_bytes_per_token"] == check["candidate"]["cross_cache_bytes_per_source_token"] == per_token
    assert result["inputs"]["pairs"] and result["inputs"]["target_tokens"] > 0


def test_identity_conversion_loses_nothing(tiny, tmp_path: Path) -> None:
    paths = tiny("t5")
    argv = ["verify", str(paths["src"]), str(paths["kv8"]), "--max-ppl-increase", "0%", "--max-kl", "0", "--min-top1", "100%"]
    code, result = report(argv, tmp_path / "r.json")
    (check,) = result["checks"]
    assert code == 0 and check["kind"] == "loss"
    assert check["metrics"]["kl"] == 0 and check["metrics"]["ppl_increase"] == 0 and check["metrics"]["top1"] == 1
    assert check["metrics"]["tokens"] == result["inputs"]["target_tokens"]  # every target token predicted, no source token


def test_pooled_t5_passes_loose_budgets_and_fails_tight_ones(tiny, tmp_path: Path) -> None:
    paths = tiny("t5")
    loose = ["--max-ppl-increase", "50%", "--max-kl", "1", "--min-top1", "10%"]
    code, result = report(["verify", str(paths["src"]), str(paths[f"kv{KV}"]), *loose], tmp_path / "loose.json")
    metrics = result["checks"][0]["metrics"]
    assert code == 0 and result["passed"]
    assert 0 < metrics["kl"] < 1 and metrics["top1"] < 1
    code, result = report(["verify", str(paths["src"]), str(paths[f"kv{KV}"]), "--max-kl", "0"], tmp_path / "tight.json")
    assert code == 1 and not result["passed"]


def test_a_decoder_export_against_t5_is_refused(tiny, tiny_export, tmp_path: Path, capsys) -> None:
    _, decoder_onnx = tiny_export("llama", 2)
    capsys.readouterr()
    assert main(["verify", str(tiny("t5")["src"]), str(decoder_onnx), "--check", "fidelity", "--quiet", "--report", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds an encoder-decoder but" in err and "holds a decoder" in err
    assert not (tmp_path / "r.json").exists()


def test_run_converts_exports_and_verifies_t5(tiny, tmp_path: Path) -> None:
    """The default method on T5's decoder self- and cross-attention; build is skipped with its reason."""
    loose = Thresholds(max_ppl_increase=0.5, max_kl=1.0, min_top1=0.1)
    report = run(tiny("t5")["src"], tmp_path / "run", KV, inputs=InputSpec(window=24, max_rows=8, batch_size=4), thresholds=loose)
    assert [c.name for c in report.checks] == ["conversion-loss", "fidelity-onnx"] and report.passed
    loss, fidelity = report.checks
    assert 0 < loss.metrics["kl"] < 1 and fidelity.metrics["mismatched"] == 0 and fidelity.metrics["max_abs_err"] < 1e-4
    assert loss.candidate["cross_cache_bytes_per_source_token"] * 2 == loss.reference["cross_cache_bytes_per_source_token"]
    assert report.stages["build"].startswith("skipped: headfold build takes decoder and encoder exports")
    assert (tmp_path / "run/export/decoder.onnx").is_file() and (tmp_path / "run/verify/report.json").is_file()


def test_fp16_whisper_export_passes_its_fp16_budget(tiny, tmp_path: Path) -> None:
    """Features are fed in fp32 and cast to the graph's fp16; the self past is built in fp16."""
    paths = tiny("whisper")
    export(paths[f"kv{KV}"], tmp_path / "fp16", dtype="fp16", progress=False)
    code, result = report(["verify", str(paths[f"kv{KV}"]), str(tmp_path / "fp16")], tmp_path / "r.json")
    (check,) = result["checks"]
    assert code == 0 and check["candidate"]["precision"] == "fp16" and check["metrics"]["mismatched"] == 0
    assert 0 < check["metrics"]["max_abs_err"] < 0.05
