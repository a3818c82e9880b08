"""headfold.engines on CPU: build plans for every family, profile options, precision decisions per
TensorRT release, lint refusals, the dry-run CLI, the engine sidecar and engine-support reasons.

Nothing here runs TensorRT (it is not installable on CPU machines): engines are built and run only
in tests/integration/test_gpu_engines.py. Where a test touches the build code, its name says it checks the
arguments handed to Polygraphy, not an engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from headfold import convert
from headfold.cli import main
from headfold.engines import env
from headfold.engines.build import attention_verdict, config_arguments
from headfold.engines.env import Target, engine_support, target_for
from headfold.engines.plan import (
    Range,
    Unparsable,
    decide_precision,
    derived_ranges,
    make_plan,
    parse_range,
    sidecar_path,
)
from headfold.engines.sidecar import KEYS, load_sidecar, make_sidecar, save_sidecar, source_onnx
from headfold.graphs.export import export
from headfold.graphs.trt_lint import lint_export
from headfold.ground.errors import BadInput
from headfold.verification.artifacts import check_kind, resolve
from headfold.verification.tensorrt_runner import pick_profile

pytestmark = pytest.mark.slow  # exports a tiny model per family

FAMILIES = ("llama", "phi3", "gpt2", "gpt_neox", "opt", "bert")
DECODE_INPUTS = ["input_ids", "attention_mask", "past_key_values.0.key"]
KV, HEAD_DIM, LIMIT = 2, 8, 62  # tiny models: 8 heads of 8 → kv 2; 64 positions less 2 spare


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory):
    """exported(family, dtype="fp32") → (checkpoint, export folder) of the family converted to 2 kv heads; cached."""
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(family: str, dtype: str = "fp32") -> tuple[Path, Path]:
        if (family, dtype) not in cache:
            folder = tmp_path_factory.mktemp(f"{family}-{dtype}")
            checkpoint = (
                cache[(family, "fp32")][0] if (family, "fp32") in cache else convert(tiny_checkpoint(family), folder / "kv2", KV, method="mean", progress=False)
            )
            export(checkpoint, folder / "onnx", dtype=dtype, progress=False, graphs="split")  # TensorRT builds the split pair
            cache[(family, dtype)] = checkpoint, folder / "onnx"
        return cache[(family, dtype)]

    return get


def _plan(source: Path, out: Path, version: str = "11.0", **options):
    return make_plan(source, out, Target.assumed(version), **options)


# ---- plans for every family -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_per_family(exported, tmp_path: Path, family: str) -> None:
    _, onnx_dir = exported(family)
    plan = _plan(onnx_dir, tmp_path / "engines")
    decoder = family != "bert"
    assert plan.layout == "folder" and plan.precision.strongly_typed and plan.precision.builder_flags == ()
    assert [g.engine.name for g in plan.graphs] == (["prefill.engine", "decode.engine"] if decoder else ["model.engine"])
    assert list(plan.ranges) == (["batch", "seq", "past"] if decoder else ["batch", "seq"])
    assert plan.ranges["seq"] == Range(1, LIMIT // 2, LIMIT, f"position limit {LIMIT} (config)")
    first = plan.graphs[0]
    assert first.profile["input_ids"] == [[1, 1], [4, LIMIT // 2], [8, LIMIT]]
    assert first.attention_nodes == 2 and first.plugins == [] and len(first.sha256) == 64
    if decoder:
        decode = plan.graphs[1].profile
        assert list(decode)[:3] == DECODE_INPUTS
        assert decode["past_key_values.0.key"] == [[1, KV, 0, HEAD_DIM], [4, KV, 31, HEAD_DIM], [8, KV, LIMIT - 1, HEAD_DIM]]
        assert decode["attention_mask"] == [[1, 1], [4, 32], [8, LIMIT]]  # "past_sequence + 1"
    # the plan's verdict is the export lint's, graph by graph
    lints = lint_export(onnx_dir, "11.0")
    assert [g.lint.parsable for g in plan.graphs] == [r.parsable for r in lints.values()]
    assert bool(plan.refusals) == (not all(r.parsable for r in lints.values()))
    assert json.loads(plan.to_json())["graphs"][0]["profile"] == first.profile


def test_single_onnx_gives_one_engine_file(exported, tmp_path: Path) -> None:
    _, onnx_dir = exported("llama")
    plan = _plan(onnx_dir / "decode.onnx", tmp_path / "decode.engine")
    assert plan.layout == "file" and [g.engine for g in plan.graphs] == [tmp_path / "decode.engine"]
    assert list(plan.ranges) == ["batch", "past"]  # only the dimensions the graph has
    with pytest.raises(BadInput, match="must end with .engine"):
        _plan(onnx_dir / "decode.onnx", tmp_path / "decode")


def test_graph_holding_plugin_nodes_plans_them(exported, tmp_path: Path) -> None:
    """A decode graph emitted for 10.13's parser (every Attention → the plugin), planned for 10.15:
    the build must register the plugin although no rule fires any more, and the lint passes with it."""
    import onnx_ir as ir

    from headfold import plugins

    _, onnx_dir = exported("llama")
    model = ir.load(onnx_dir / "decode.onnx")
    ir.external_data.load_to_model(model)
    model, names = plugins.emit(model, "10.13")
    ir.save(model, tmp_path / "decode.onnx", external_data="decode.onnx.data")
    plan = _plan(tmp_path / "decode.onnx", tmp_path / "plugin.engine", "10.15")
    assert names == ["headfold::GQADecodeAttention"] and plan.plugins == names and not plan.refusals


def test_checkpoint_folder_is_refused(exported, tmp_path: Path) -> None:
    checkpoint, _ = exported("llama")
    with pytest.raises(BadInput, match="export it first"):
        _plan(checkpoint, tmp_path / "engines")


# ---- profile options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, option, expected", [("1:4:8", "batch", Range(1, 4, 8)), ("16", "seq", Range(16, 16, 16)), ("0:512:2048", "past", Range(0, 512, 2048))]
)
def test_parse_range(text: str, option: str, expected: Range) -> None:
    assert parse_range(text, option) == expected


@pytest.mark.parametrize("text, option", [("0:4:8", "batch"), ("8:4:1", "seq"), ("1:2", "batch"), ("a:b:c", "past"), ("0", "past"), ("-1:0:4", "past")])
def test_bad_ranges_are_refused(text: str, option: str) -> None:
    with pytest.raises(BadInput, match=f"--{option}"):
        parse_range(text, option)


def test_derived_ranges() -> None:
    assert derived_ranges(510) == {
        "batch": Range(1, 4, 8, "default"),
        "seq": Range(1, 255, 510, "position limit 510 (config)"),
        "past": Range(0, 255, 509, "position limit 510 (config)"),
    }
    assert derived_ranges(8192)["seq"].opt == 512  # opt is capped
    assert derived_ranges(None)["past"] == Range(0, 512, 2047, "default (no config: limit 2048)")
    assert derived_ranges(510, batch=Range(2, 2, 2))["batch"] == Range(2, 2, 2)


def test_options_shape_the_profiles_and_notes(exported, tmp_path: Path) -> None:
    _, onnx_dir = exported("gpt2")
    plan = _plan(onnx_dir, tmp_path / "e", batch="2:2:4", seq="1:16:100", workspace="1GiB", timing_cache=tmp_path / "tc")
    assert plan.graphs[0].profile["input_ids"] == [[2, 1], [2, 16], [4, 100]]
    assert plan.workspace_bytes == 2**30 and plan.ranges["batch"].source == "option"
    assert plan.notes == [f"--seq max 100 exceeds the model's position limit {LIMIT}"]
    assert "workspace:   1 GiB" in plan.describe() and "tc (loaded if present" in plan.describe()
    with pytest.raises(BadInput, match="--workspace"):
        _plan(onnx_dir, tmp_path / "e", workspace="lots")


# ---- precision per TensorRT release -----------------------------------------------------------

TRT10, TRT11 = Target.assumed("10.15"), Target.assumed("11.0")


@pytest.mark.parametrize(
    "requested, graph, target, strongly_typed, flags",
    [
        (None, "fp32", TRT10, False, ()),
        ("fp16", "fp32", TRT10, False, ("FP16",)),
        ("bf16", "fp32", TRT10, False, ("BF16",)),
        (None, "fp16", TRT10, True, ()),
        ("fp16", "fp16", TRT10, True, ()),
        (None, "fp32", TRT11, True, ()),
        ("fp16", "fp16", TRT11, True, ()),
        ("bf16", "bf16", TRT11, True, ()),
    ],
)
def test_precision_decisions(requested, graph, target, strongly_typed, flags) -> None:
    decision = decide_precision(requested, graph, target)
    assert (decision.name, decision.strongly_typed, decision.builder_flags) == (requested or graph, strongly_typed, flags)


@pytest.mark.parametrize("requested, graph, target", [("fp16", "fp32", TRT11), ("fp32", "fp16", TRT11), ("fp32", "fp16", TRT10), ("bf16", "fp16", TRT10)])
def test_precision_the_graph_cannot_give_is_refused(requested, graph, target) -> None:
    with pytest.raises(BadInput, match=f"re-export with headfold export --dtype {requested}$"):
        decide_precision(requested, graph, target)


def test_fp16_export_builds_strongly_typed(exported, tmp_path: Path) -> None:
    _, onnx_dir = exported("llama", "fp16")
    for version in ("10.15", "11.0"):
        plan = _plan(onnx_dir, tmp_path / "e", version)
        assert (plan.precision.name, plan.precision.graph, plan.precision.strongly_typed) == ("fp16", "fp16", True)
    with pytest.raises(BadInput, match="the graph is fp16"):
        _plan(onnx_dir, tmp_path / "e", "10.15", precision="fp32")


def test_targets() -> None:
    assert (TRT10.strongly_typed, TRT10.precision_flags, TRT10.detected) == (True, True, False)
    assert (TRT11.strongly_typed, TRT11.precision_flags) == (True, False)
    with pytest.raises(BadInput, match="no TensorRT rule set"):
        Target.assumed("10.12")


# ---- lint refusals ----------------------------------------------------------------------------


def test_trt_10_13_is_refused_with_the_release_that_parses_it(exported, tmp_path: Path) -> None:
    _, onnx_dir = exported("llama")
    plan = _plan(onnx_dir, tmp_path / "e", "10.13")
    prefill = plan.graphs[0].lint
    assert not prefill.parsable and {"Attention", "RMSNormalization"} <= {e.op for e in prefill.errors}
    assert {e.since for e in prefill.errors if e.op == "RMSNormalization"} == {"10.15"}
    assert plan.refusals[0].startswith("TensorRT 10.13 cannot parse prefill.onnx: RMSNormalization has no importer")
    assert "use TensorRT 10.15 or newer" in plan.refusals[0] and "at node node_RMSNormalization" in plan.refusals[0]
    with pytest.raises(Unparsable) as err:
        plan.check()
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
    assert _plan(onnx_dir, tmp_path / "e", "10.15").refusals == []


# ---- the CLI (dry runs) -----------------------------------------------------------------------


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.skipif(not env._missing("tensorrt"), reason="checks the message shown where TensorRT is not installed")
def test_cli_without_tensorrt(exported, tmp_path: Path, capsys) -> None:
    _, onnx_dir = exported("llama")
    capsys.readouterr()  # building the fixture may have printed transformers' own bars
    code, _, err = _cli(["build", str(onnx_dir), str(tmp_path / "e")], capsys)
    assert code == 2 and err.count("\n") == 1 and "TensorRT is not installed" in err and "--dry-run" in err
    code, out, _ = _cli(["build", str(onnx_dir), str(tmp_path / "e"), "--dry-run"], capsys)
    assert code == 0 and "TensorRT 11.0 (TensorRT is not installed: dry run for the newest release headfold knows, 11.0;" in out
    assert not (tmp_path / "e").exists()


def test_cli_dry_run(exported, tmp_path: Path, capsys) -> None:
    _, onnx_dir = exported("llama")
    code, out, _ = _cli(["build", str(onnx_dir), str(tmp_path / "e"), "--dry-run", "--trt-version", "10.15", "--precision", "fp16", "--batch", "1:2:4"], capsys)
    assert code == 0
    assert "precision:   fp16 (fp32 graph with BuilderFlag.FP16" in out and "--batch 1:2:4 [option]" in out
    assert "prefill.onnx -> " in out and "decode.onnx -> " in out and "lint (rule set 10.15): parsable" in out
    code, out, _ = _cli(["build", str(onnx_dir), str(tmp_path / "e"), "--dry-run", "--trt-version", "11.0", "--json"], capsys)
    assert code == 0 and json.loads(out)["precision"]["strongly_typed"] is True
    code, out, err = _cli(["build", str(onnx_dir), str(tmp_path / "e"), "--dry-run", "--trt-version", "10.13"], capsys)
    assert code == 2 and "refused: TensorRT 10.13" in out and err.startswith("headfold: error: TensorRT 10.13 cannot parse")
    code, _, err = _cli(["build", str(onnx_dir), str(tmp_path / "e"), "--dry-run", "--trt-version", "11.0", "--precision", "fp16"], capsys)
    assert code == 2 and "re-export with headfold export --dtype fp16" in err
    code, _, err = _cli(["build", str(onnx_dir), str(tmp_path / "e"), "--dry-run", "--trt-version", "11.0", "--seq", "9:1:2"], capsys)
    assert code == 2 and "--seq '9:1:2'" in err
    assert not (tmp_path / "e").exists()


# ---- sidecar, verify resolution, inspection verdicts ------------------------------------------


def test_sidecar_schema_and_verify_resolution(exported, tmp_path: Path) -> None:
    """A sidecar from make_sidecar next to a placeholder file (not an engine): resolve() follows it
    to the checkpoint, so `headfold verify CHECKPOINT X.engine` picks fidelity; running it needs TensorRT."""
    checkpoint, onnx_dir = exported("llama")
    plan = _plan(onnx_dir, tmp_path / "engines", "10.15")
    graph = plan.graphs[0]
    sidecar = make_sidecar(plan, graph, gpu={"name": "test", "compute_capability": "9.0"}, attention=attention_verdict([]), seconds=1.234)
    written = sidecar.to_dict()
    assert tuple(written) == KEYS and written["source"]["sha256"] == graph.sha256 and written["build_seconds"] == 1.23
    assert written["precision"] == {"name": "fp32", "graph": "fp32", "strongly_typed": False, "builder_flags": []}
    graph.engine.parent.mkdir()
    graph.engine.write_bytes(b"placeholder")
    save_sidecar(graph.engine, sidecar)
    assert json.loads(sidecar_path(graph.engine).read_text()) == written and load_sidecar(graph.engine) == sidecar
    assert source_onnx(graph.engine, load_sidecar(graph.engine)) == onnx_dir / "prefill.onnx"
    for path in (graph.engine, graph.engine.parent):  # the engine or the build folder
        artifact = resolve(path)
        assert (artifact.kind, artifact.model, artifact.precision) == ("engine", checkpoint, "fp32")
    assert check_kind(resolve(checkpoint), resolve(graph.engine)) == "fidelity"
    assert resolve(graph.engine).describe()["engine"]["source_sha256"] == graph.sha256
    assert resolve(graph.engine).decode is None  # no decode.engine beside it: no KV-cache check
    (graph.engine.parent / "decode.engine").write_bytes(b"placeholder")
    assert resolve(graph.engine.parent).decode == graph.engine.parent / "decode.engine"
    if env._missing("tensorrt"):
        with pytest.raises(BadInput, match="TensorRT is not installed"), resolve(graph.engine).runner():
            pass


def test_engine_without_sidecar_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m.engine").write_bytes(b"x")
    with pytest.raises(BadInput, match="no sidecar m.engine.json; rebuild it with headfold build"):
        resolve(tmp_path / "m.engine")


@pytest.mark.parametrize(
    "layers, verdict",
    [
        ([{"Name": "node_Attention_12", "LayerType": "Attention", "TacticName": "fmha_v2"}], "fused"),
        # a Myelin kernel as in NVIDIA/TensorRT#4397: its Metadata names the Softmax it swallowed
        ([{"Name": "_gemm_mha_v2_myl0_59", "LayerType": "kgen", "TacticName": "_gemm_mha_v2_0x8a", "Metadata": "[ONNX Layer: /mha_prob/Softmax]"}], "fused"),
        ([{"Name": "node_Attention_12_qk", "LayerType": "MatrixMultiply"}, {"Name": "node_softmax", "LayerType": "Softmax"}], "unfused"),
        ([{"Name": "node_GQADecodeAttention_3", "LayerType": "PluginV3"}], "plugin"),
        (["node_Attention_12"], "unknown"),  # below DETAILED only names: an ONNX node name proves nothing
        ([{"Name": "gemm", "LayerType": "MatrixMultiply"}], "unknown"),
        ([], "unknown"),
    ],
)
def test_attention_verdict_on_hand_written_layer_lists(layers, verdict: str) -> None:
    assert attention_verdict(layers)["verdict"] == verdict


def test_config_arguments_handed_to_polygraphy_follow_the_plan(exported, tmp_path: Path) -> None:
    """Checks the keyword arguments for Polygraphy's CreateConfig (with stand-in enum values), not an engine."""
    _, onnx_dir = exported("llama")
    plan = _plan(onnx_dir, tmp_path / "e", "10.15", precision="fp16", workspace="2GiB", timing_cache=tmp_path / "cache")
    trt = SimpleNamespace(ProfilingVerbosity=SimpleNamespace(DETAILED="DETAILED"), MemoryPoolType=SimpleNamespace(WORKSPACE="WORKSPACE"))
    arguments = config_arguments(plan, plan.graphs[1], trt)
    (profile,) = arguments.pop("profiles")
    assert {name: [list(s) for s in shapes] for name, shapes in profile.items()} == plan.graphs[1].profile
    assert arguments == {
        "tf32": False, "fp16": True, "bf16": None, "profiling_verbosity": "DETAILED",
        "memory_pool_limits": {"WORKSPACE": 2 * 2**30}, "load_timing_cache": str(tmp_path / "cache"),
    }  # fmt: skip


def test_pick_profile() -> None:
    profiles = [{"x": ((1, 1), (4, 64))}, {"x": ((1, 65), (8, 512))}]
    assert pick_profile({"x": (2, 10)}, profiles) == 0
    assert pick_profile({"x": (8, 300)}, profiles) == 1
    assert pick_profile({"x": (9, 10)}, profiles) is None and pick_profile({"x": (1, 2, 3)}, profiles) is None


# ---- where engines can be built ---------------------------------------------------------------


def test_engine_support_reasons(monkeypatch) -> None:
    import torch

    missing: set[str] = {"tensorrt"}
    monkeypatch.setattr(env, "_missing", lambda module: module in missing)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_support() == "TensorRT is not installed"
    missing = {"polygraphy"}
    assert engine_support().startswith("Polygraphy is not installed")
    missing = set()
    assert engine_support().startswith("no NVIDIA GPU is visible")
    with pytest.raises(BadInput, match=r"no NVIDIA GPU is visible .*: cannot build an engine here; use --dry-run"):
        target_for(None, dry_run=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_support() is None
