"""The artifact contracts (ground/artifacts.py and the records built on it): every record round-trips
through its JSON unchanged, files written before a `format` key existed still load, keys a newer
writer added survive a read and a write, and a corrupt file is one BadInput line naming the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headfold.ground import export_summary, ledger, manifest
from headfold.ground.artifacts import EXPORT_SUMMARY, LEDGER, MANIFEST, Malformed, created_by
from headfold.ground.errors import BadInput

# export.json as headfold wrote it before `format` (and before attention/optimize/layout) existed
OLD_EXPORT = {
    "source": "ckpt",
    "model_type": "llama",
    "opset": 23,
    "dtype": "fp16",
    "layers": 2,
    "heads": 4,
    "kv_heads": [2, 1],
    "graphs": {"prefill.onnx": {"attention_nodes": 2}, "decode.onnx": {"attention_nodes": 2}},
}
EXPORT = {  # as headfold export writes it now, keys in its order
    "format": 1, "created_by": created_by(), **{k: OLD_EXPORT[k] for k in ("source", "model_type", "opset", "dtype")}, "attention": "onnx",
    **{k: OLD_EXPORT[k] for k in ("layers", "heads", "kv_heads")}, "optimize": None, "layout": "split", "graphs": OLD_EXPORT["graphs"],
}  # fmt: skip
MANIFEST_DATA = {
    "format": 1,
    "created_by": created_by(),
    "source": {
        "path": "/models/llama",
        "model_type": "llama",
        "family": "llama",
        "heads": 4,
        "kv_heads": 4,
        "head_dim": 8,
        "config_sha256": "ab" * 32,
        "manifest": None,
    },
    "conversion": {
        "method": "aligned",
        "kv_heads": 2,
        "group_size": 2,
        "kv_head_of_query_head": [0, 0, 1, 1],
        "source_kv_heads_of_kv_head": [[0, 1], [2, 3]],
        "calibration": {"text": "built-in", "tokens": 4096, "seed": 0},
    },
    "loader": "transformers",
    "versions": {"python": "3.11.9", "headfold": "0.1.0"},
    "files": {"model.safetensors": "cd" * 32},
    "skipped_weight_files": [],
}
# stages.json before format 1: the stages alone
OLD_LEDGER = {
    "convert": {"key": "k1", "inputs": {"kv_heads": 2}, "output": "convert", "sha256": "s1", "seconds": 1.5},
    "export": {"key": None, "output": "export"},
}


def _write(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record, data",
    [
        (export_summary.ExportSummary, EXPORT),
        (manifest.Manifest, MANIFEST_DATA),
        (ledger.RunLedger, {"format": 1, "created_by": created_by(), "stages": OLD_LEDGER}),
    ],
)
def test_round_trip_keeps_every_key_and_value_in_order(record, data: dict) -> None:
    loaded = record.from_dict(json.loads(json.dumps(data)))
    assert json.dumps(loaded.to_dict()) == json.dumps(data)  # same keys, same order, same values
    assert record.from_dict(loaded.to_dict()) == loaded


def test_typed_access_and_save_load(tmp_path: Path) -> None:
    summary = export_summary.ExportSummary.from_dict(EXPORT)
    summary.save_in(tmp_path)
    assert export_summary.load(tmp_path) == summary and json.loads((tmp_path / EXPORT_SUMMARY).read_text()) == EXPORT
    assert (summary.layout, summary.kv_heads, list(summary.graphs)) == ("split", [2, 1], ["prefill.onnx", "decode.onnx"])
    made = manifest.Manifest.from_dict(MANIFEST_DATA)
    made.save_in(tmp_path)
    assert manifest.load(tmp_path) == made and made.source.config_sha256 == "ab" * 32 and made.conversion.calibration["seed"] == 0
    assert not list(tmp_path.glob(".*partial*"))  # the temporary file was renamed into place


def test_optional_sections_are_left_out_when_absent() -> None:
    mean = json.loads(json.dumps(MANIFEST_DATA))
    del mean["conversion"]["calibration"]
    loaded = manifest.Manifest.from_dict(mean)
    assert loaded.conversion.calibration is None and loaded.distillation is None
    assert "calibration" not in loaded.to_dict()["conversion"] and "distillation" not in loaded.to_dict()
    assert loaded.to_dict()["source"]["manifest"] is None  # written as null, as convert always did


def test_keys_of_a_newer_writer_survive(tmp_path: Path) -> None:
    newer = {**EXPORT, "future": {"x": 1}, "graphs": {"model.onnx": {"new_fact": 2}}}
    summary = export_summary.ExportSummary.from_dict(newer)
    assert summary.extra == {"future": {"x": 1}} and summary.to_dict() == newer


# ---- older files ------------------------------------------------------------------------------


def test_old_export_summary_without_format_loads(tmp_path: Path) -> None:
    _write(tmp_path / EXPORT_SUMMARY, OLD_EXPORT)
    summary = export_summary.load(tmp_path)
    assert (summary.format, summary.layout, summary.attention, summary.dtype) == (1, None, None, "fp16")
    assert export_summary.graph_source(tmp_path / "prefill.onnx") is None  # the checkpoint "ckpt" is gone


def test_graph_source_finds_the_checkpoint_relative_to_the_export(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    _write(tmp_path / "ckpt" / "config.json", {})
    (tmp_path / "onnx").mkdir()
    _write(tmp_path / "onnx" / EXPORT_SUMMARY, OLD_EXPORT)
    assert export_summary.graph_source(tmp_path / "onnx" / "prefill.onnx") == (tmp_path / "ckpt").resolve()


def test_old_ledger_of_stages_alone_loads(tmp_path: Path) -> None:
    loaded = ledger.load(_write(tmp_path / LEDGER, OLD_LEDGER))
    assert loaded.format == 1 and loaded.stages["convert"].sha256 == "s1" and loaded.stages["export"].key is None
    assert loaded.to_dict() == {"format": 1, "created_by": created_by(), "stages": OLD_LEDGER}  # written back in format 1, marked, nothing lost


# ---- corrupt files: one line, the fix -----------------------------------------------------------


@pytest.mark.parametrize(
    "content, why",
    [
        ("[1, 2", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        (json.dumps({**EXPORT, "graphs": []}), "'graphs' is a list"),
        (json.dumps({k: v for k, v in EXPORT.items() if k != "source"}), "no 'source'"),
        (json.dumps({**EXPORT, "format": 2}), "format 2 is newer"),
        (json.dumps({**EXPORT, "dtype": "fp64"}), "'dtype' is 'fp64', not one of fp32, fp16, bf16, int4"),
    ],
)
def test_corrupt_export_summary(tmp_path: Path, content: str, why: str) -> None:
    _write(tmp_path / EXPORT_SUMMARY, content)
    with pytest.raises(BadInput, match="re-run headfold export into") as err:
        export_summary.load(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / EXPORT_SUMMARY} is corrupt (") and why in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda m: m.pop("source"), "no 'source'"),
        (lambda m: m["conversion"].update(kv_heads="two"), "'kv_heads' is a string"),
        (lambda m: m["source"].update(config_sha256=None), "'config_sha256' is null"),
        (lambda m: m.update(conversion=[1]), "'conversion' is a list"),
        (lambda m: m.update(format=2), "format 2 is newer than this headfold's 1"),
    ],
)
def test_corrupt_manifest(tmp_path: Path, edit, why: str) -> None:
    data = json.loads(json.dumps(MANIFEST_DATA))
    edit(data)
    _write(tmp_path / MANIFEST, data)
    with pytest.raises(BadInput, match="re-run headfold convert") as err:
        manifest.load(tmp_path)
    assert f"{MANIFEST} is corrupt (" in str(err.value) and why in str(err.value)


@pytest.mark.parametrize(
    "content",
    ["{", "[]", json.dumps({"convert": {"key": 1, "output": "convert"}}), json.dumps({"format": 1, "stages": []}), json.dumps({"format": 2, "stages": {}})],
)
def test_corrupt_ledger(tmp_path: Path, content: str) -> None:
    path = _write(tmp_path / LEDGER, content)
    with pytest.raises(BadInput) as err:
        ledger.load(path)
    assert str(err.value) == f"{path} is corrupt; remove {tmp_path} (or choose another OUT_DIR) to run every stage again"


def test_bools_are_not_numbers() -> None:
    with pytest.raises(Malformed, match="'opset' is a boolean"):
        export_summary.ExportSummary.from_dict({**EXPORT, "opset": True})


# ---- lint findings ----------------------------------------------------------------------------


def test_lint_report_round_trip_and_typed_findings() -> None:
    from headfold.graphs.trt_lint import Finding, LintReport

    report = LintReport(
        trt_version="10.13.2",
        rules="10.13",
        findings=[
            Finding(
                "n1", "op-unsupported", "Attention has no importer in TensorRT 10.13 (parsed from TensorRT 10.14 on)", "error", op="Attention", since="10.14"
            ),
            Finding("<model>", "opset-range", "opset 25 is outside …", "warning"),
        ],
    )
    data = json.loads(report.to_json())
    assert data["format"] == 1 and data["findings"][0]["since"] == "10.14" and "op" not in data["findings"][1]
    assert LintReport.from_dict(data) == report and report.errors == report.findings[:1]
    with pytest.raises(Malformed, match="'severity' is a string"):
        Finding.from_dict({**data["findings"][0], "severity": "fatal"})


# ---- the run ledger as headfold run uses it ----------------------------------------------------


def test_run_ledger_claims_records_and_skips(tmp_path: Path) -> None:
    from headfold.pipeline import Ledger, tree_digest

    out = tmp_path / "run"
    out.mkdir()
    _write(out / LEDGER, OLD_LEDGER)  # a run folder from before format 1
    run = Ledger(out, overwrite=False)
    (out / "convert").mkdir()
    (out / "convert" / "w").write_text("weights")
    assert run.unchanged("convert", "k1", out / "convert")[1].startswith(f"its output {out / 'convert'} changed")
    run.claim("convert", out / "convert")  # keeps what it knew, forgets the key until the stage finishes
    assert json.loads((out / LEDGER).read_text())["stages"]["convert"] == {**OLD_LEDGER["convert"], "key": None}
    digest = tree_digest(out / "convert")
    run.record("convert", ledger.StageEntry(key="k2", inputs={"source": Path("/m")}, output="convert", sha256=digest, seconds=2.0))
    again = Ledger(out, overwrite=False)
    assert again.unchanged("convert", "k2", out / "convert") == (digest, "") and again.stages["convert"].inputs == {"source": "/m"}
    assert again.unchanged("convert", "k3", out / "convert") == (None, "")
    with pytest.raises(BadInput, match="exists but headfold run did not write it"):
        again.claim("verify", _mkdir(out / "verify"))


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def test_corrupt_run_ledger_is_one_line(tmp_path: Path) -> None:
    from headfold.pipeline import Ledger

    _write(tmp_path / LEDGER, {"format": 1, "stages": {"convert": {"output": "convert"}}})  # no key
    with pytest.raises(BadInput, match=r"stages.json is corrupt; remove .* to run every stage again$"):
        Ledger(tmp_path, overwrite=False)


def test_convert_writes_exactly_what_the_manifest_record_reads(tiny_checkpoint, tmp_path: Path) -> None:
    """convert and a chained convert: the file is the record's JSON byte for byte, the parent nested whole."""
    from headfold import convert

    first = convert(tiny_checkpoint("llama"), tmp_path / "kv2", 2, method="mean", progress=False)
    second = convert(first, tmp_path / "kv1", 1, method="mean", progress=False)
    for folder in (first, second):
        assert manifest.load(folder).to_json() == (folder / MANIFEST).read_text()
    chained = manifest.load(second)
    assert chained.source.manifest == json.loads((first / MANIFEST).read_text()) and chained.conversion.kv_heads == 1
