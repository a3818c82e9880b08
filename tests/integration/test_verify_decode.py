"""The KV-cache path in `headfold verify`: prompt + teacher-forced steps through the merged model.onnx
(the default folder's GroupQueryAttention writing into one shared past/present buffer per layer, as
onnxruntime-genai runs it; the standard graph's present K/V fed back as past), or through decode.onnx
for a split export.

Tiny llama (GQA, per-layer kv heads) and gpt2 exports pass within 1e-4, default, standard and split,
over many steps too; a graph wired to the wrong layer's cache fails (exit 1, naming the decode check's
metric) while its prompt logits pass, in either cache; --decode-steps 0 skips the path and says so;
encoders get no decode check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from polygraphy.backend.base import BaseRunner
from support.tiny_models import DECODER_CASES

from headfold import convert
from headfold.cli import main
from headfold.graphs.export import export
from headfold.verification import InputSpec, verify
from headfold.verification.budget import fidelity_budget
from headfold.verification.checks import CheckSpec, run_checks
from headfold.verification.decoding import SKIPPED_NOTE, KvCacheRunner, decoded_positions
from headfold.verification.inputs import make_inputs
from headfold.verification.runners import OnnxRuntimeRunner

SPEC = InputSpec(window=32, max_rows=12, batch_size=4)  # tiny models have 64 positions
SMALL = ["--window", "32", "--max-rows", "12", "--batch-size", "4"]
ATOL = 1e-4


class Exports(dict):
    """name → (checkpoint, export folder) of a byte-vocabulary tiny model, exported on first use."""

    def __init__(self, tiny_checkpoint, root: Path) -> None:
        super().__init__()
        self.tiny_checkpoint, self.root = tiny_checkpoint, root

    def __missing__(self, name: str) -> tuple[Path, Path]:
        """name: a model, with ":split" the split pair, with ":onnx" the standard merged graph (else the default folder)."""
        variant = next((v for v in (":split", ":onnx") if name.endswith(v)), None)
        if variant is not None:
            checkpoint, _ = self[name.removesuffix(variant)]
            onnx_dir = self.root / f"{checkpoint.name}-{variant[1:]}-export"
            export(checkpoint, onnx_dir, progress=False, **({"graphs": "split"} if variant == ":split" else {"attention": "onnx"}))
            self[name] = checkpoint, onnx_dir
            return self[name]
        llama = lambda: self.tiny_checkpoint("llama", vocab_size=256)  # noqa: E731
        make = {
            "llama-kv2": lambda: convert(llama(), self.root / name, 2, method="mean", progress=False),
            "llama-kv4,2": lambda: convert(llama(), self.root / "llama-kv4-2", (4, 2), method="mean", progress=False),
            "gpt2": lambda: self.tiny_checkpoint("gpt2", vocab_size=256),
            "bert": lambda: self.tiny_checkpoint("bert", vocab_size=256),
        }
        checkpoint = make[name]()
        onnx_dir = self.root / f"{checkpoint.name}-onnx"
        export(checkpoint, onnx_dir, progress=False)
        self[name] = checkpoint, onnx_dir
        return self[name]


@pytest.fixture(scope="module")
def exports(tiny_checkpoint, tmp_path_factory) -> Exports:
    return Exports(tiny_checkpoint, tmp_path_factory.mktemp("decode"))


def _expected_elements(checkpoint: Path, steps: int, spec: InputSpec = SPEC) -> int:
    """Decoded positions × vocabulary: each row's last `steps` tokens (all but its first if shorter)."""
    inputs = make_inputs(checkpoint, spec)
    rows = [int(n) for feed in inputs.feeds for n in feed["attention_mask"].sum(1)]
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    return sum(min(steps, n - 1) for n in rows) * vocab


# --- pieces ----------------------------------------------------------------------------------------


def test_decoded_positions_count_real_tokens_whatever_the_padding() -> None:
    mask = np.array([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]])
    expected = np.array([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1], [0, 1, 0, 0, 0, 0]], dtype=bool)
    np.testing.assert_array_equal(decoded_positions(mask, 2), expected)  # the short row keeps one token to prefill
    assert not decoded_positions(mask, 0).any()


# --- fidelity of the KV-cache path -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-kv2", "llama-kv4,2", "gpt2", "llama-kv2:onnx", "llama-kv2:split"])
def test_decode_fidelity_passes(exports, name: str) -> None:
    checkpoint, onnx_dir = exports[name]
    graphs = ("prefill.onnx", "decode.onnx") if name.endswith(":split") else ("model.onnx", "model.onnx")
    report = verify(checkpoint, onnx_dir, inputs=SPEC)
    assert [c.name for c in report.checks] == ["fidelity", "fidelity-decode"] and report.passed
    prefill, decode = report.checks
    assert decode.kind == "fidelity" and decode.budget == prefill.budget and decode.notes
    assert decode.metrics["max_abs_err"] <= ATOL and decode.metrics["top1"] == 1.0 and decode.metrics["mismatched"] == 0
    assert decode.metrics["elements"] == _expected_elements(checkpoint, 16)
    assert prefill.candidate["runner"] == f"onnxruntime:{graphs[0]}"
    assert decode.candidate["runner"] == f"onnxruntime:{graphs[1]}" and decode.candidate["decode_steps"] == 16
    assert {f"{graph}_sha256" for graph in graphs} <= set(decode.candidate)
    shared = ":" not in name  # the default folder: GroupQueryAttention, as onnxruntime-genai runs it
    assert decode.candidate["kv_cache"] == ("one shared past/present buffer per layer" if shared else "present fed back as past")
    print(f"{name}: decode max abs {decode.metrics['max_abs_err']:.3g}, prefill max abs {prefill.metrics['max_abs_err']:.3g}")


@pytest.mark.slow
@pytest.mark.parametrize(("family", "kv"), DECODER_CASES)
def test_every_family_verifies_against_its_default_folder(tiny_export, family: str, kv: int) -> None:
    """Prefill and KV-cache decode fidelity of each family's default folder (random ids: no tokenizer)."""
    checkpoint, onnx_dir = tiny_export(family, kv, graphs="merged")  # shared with the export and genai tests
    report = verify(checkpoint, onnx_dir, inputs=SPEC)
    assert [c.name for c in report.checks] == ["fidelity", "fidelity-decode"] and report.passed
    assert all(c.metrics["top1"] == 1.0 and c.metrics["max_abs_err"] <= ATOL for c in report.checks)


@pytest.mark.slow
def test_shared_buffer_over_many_steps(exports) -> None:
    """The shared-buffer path over 24 steps (rows of 32 tokens at most: most of each row goes through
    the cache, one token at a time) against torch's full forward."""
    checkpoint, onnx_dir = exports["llama-kv2"]
    spec = InputSpec(window=32, max_rows=8, batch_size=4, decode_steps=24)
    _, decode = verify(checkpoint, onnx_dir, inputs=spec).checks
    assert decode.passed and decode.candidate["kv_cache"] == "one shared past/present buffer per layer"
    assert decode.metrics["max_abs_err"] <= ATOL and decode.metrics["elements"] == _expected_elements(checkpoint, 24, spec)


@pytest.mark.slow
def test_export_as_reference_and_step_count(exports) -> None:
    """The KV-cache side may be the reference; --decode-steps sets how many tokens are decoded."""
    checkpoint, onnx_dir = exports["llama-kv2"]
    spec = InputSpec(window=32, max_rows=12, batch_size=4, decode_steps=5)
    _, decode = verify(onnx_dir, checkpoint, inputs=spec).checks
    assert decode.passed and decode.reference["runner"] == "onnxruntime:model.onnx"
    assert decode.metrics["elements"] == _expected_elements(checkpoint, 5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["merged", "split"])
def test_left_padded_rows_decode_like_the_prompt(exports, layout: str) -> None:
    """Left padding (as generate pads): the KV-cache path matches the prompt's logits, whose positions come from the mask."""
    checkpoint, onnx_dir = exports["llama-kv2:onnx" if layout == "merged" else "llama-kv2:split"]  # GroupQueryAttention takes right padding only
    inputs = make_inputs(checkpoint, SPEC)
    pads = [(feed["attention_mask"] == 0).sum(1) for feed in inputs.feeds]  # right padding → left padding
    inputs.feeds = [
        {k: np.stack([np.roll(row, n) for row, n in zip(v, p, strict=True)]) for k, v in f.items()} for f, p in zip(inputs.feeds, pads, strict=True)
    ]
    assert any((f["attention_mask"][:, 0] == 0).any() for f in inputs.feeds)
    if layout == "merged":  # one graph, one session: the prompt and every step
        prefill = OnnxRuntimeRunner(onnx_dir / "model.onnx")
        kv_cache = KvCacheRunner(prefill, prefill, steps=8)
    else:
        prefill = OnnxRuntimeRunner(onnx_dir / "prefill.onnx")
        kv_cache = KvCacheRunner(prefill, OnnxRuntimeRunner(onnx_dir / "decode.onnx"), steps=8)
    positions = lambda feed: decoded_positions(feed["attention_mask"], 8)  # noqa: E731
    (result,) = run_checks([CheckSpec("left", "fidelity", prefill, kv_cache, fidelity_budget("fp32"), positions=positions)], inputs)
    assert result.passed and result.metrics["max_abs_err"] <= ATOL


class _Probe(BaseRunner):
    """A Polygraphy runner that only counts its activations."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.activations = 0

    def activate_impl(self) -> None:
        self.activations += 1


def test_kv_cache_runner_activates_only_what_is_not_active(capsys) -> None:
    """A prefill runner shared with a check stays with it; a merged graph's one runner is entered once."""
    prefill, decode, merged = _Probe("prefill"), _Probe("decode"), _Probe("merged")
    with prefill:
        with KvCacheRunner(prefill, decode, steps=2):
            assert prefill.is_active and decode.is_active
        assert prefill.is_active and not decode.is_active
    with KvCacheRunner(merged, merged, steps=2):
        assert merged.is_active
    assert not merged.is_active and (prefill.activations, decode.activations, merged.activations) == (1, 1, 1)
    assert "Already active" not in capsys.readouterr().out  # Polygraphy warns when a runner is activated twice


# --- failures, skipping, encoders ------------------------------------------------------------------


def _swap_past_inputs(onnx_dir: Path, folder: Path, graph: str = "model.onnx") -> Path:
    """A copy of the export whose graph feeds layer 0's past key to layer 1 and back (at the
    prompt both pasts are empty, so only the cache steps can notice)."""
    shutil.copytree(onnx_dir, folder)
    model = ir.load(onnx_dir / graph)
    inputs = {v.name: v for v in model.graph.inputs}
    first, second = inputs["past_key_values.0.key"], inputs["past_key_values.1.key"]
    first.name, second.name = "swapping", first.name
    first.name = "past_key_values.1.key"  # via a free name: value names stay unique
    (folder / graph).unlink()
    (folder / f"{graph}.data").unlink()
    ir.save(model, folder / graph, external_data=f"{graph}.data")
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-kv2", "llama-kv2:onnx"])
def test_broken_decode_graph_exits_1_naming_the_decode_metric(exports, tmp_path: Path, capsys, name: str) -> None:
    checkpoint, onnx_dir = exports[name]
    broken = _swap_past_inputs(onnx_dir, tmp_path / "broken")
    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    assert main(["verify", str(checkpoint), str(broken), *SMALL, "--report", str(report), "--junit", str(junit)]) == 1
    err = capsys.readouterr().err
    assert "fidelity-decode: mismatched = " in err and "> budget 0" in err and "fidelity: " not in err
    data = json.loads(report.read_text())
    prefill, decode = data["checks"]
    assert prefill["passed"] and not decode["passed"] and decode["metrics"]["max_abs_err"] > ATOL
    assert 'name="fidelity-decode"' in junit.read_text() and "ThresholdExceeded" in junit.read_text()

    # --decode-steps 0: the broken decode graph goes unchecked, and the report says so
    markdown = tmp_path / "r.md"
    assert (
        main(["verify", str(checkpoint), str(broken), *SMALL, "--decode-steps", "0", "--report", str(report), "--markdown", str(markdown), "--overwrite"]) == 0
    )
    data = json.loads(report.read_text())
    (check,) = data["checks"]
    assert check["notes"] == [SKIPPED_NOTE] and data["inputs"]["decode_steps"] == 0
    assert SKIPPED_NOTE in markdown.read_text() and SKIPPED_NOTE in capsys.readouterr().out


@pytest.mark.slow
def test_encoders_get_no_decode_check(exports) -> None:
    checkpoint, onnx_dir = exports["bert"]
    report = verify(checkpoint, onnx_dir, inputs=SPEC)
    (check,) = report.checks
    assert check.name == "fidelity" and check.passed and not check.notes


def test_decode_steps_option(tiny_checkpoint, capsys) -> None:
    for command in ("verify", "run"):
        assert main([command, "--help"]) == 0 and "--decode-steps" in capsys.readouterr().out
    src = tiny_checkpoint("llama", vocab_size=256)
    assert main(["verify", str(src), str(src), *SMALL, "--decode-steps", "-1"]) == 2
