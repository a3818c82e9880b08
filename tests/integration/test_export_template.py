"""Export from a traced template (graphs.template): a model whose layers are alike is traced with
two layers and the others are copies of layer 1; its graphs compute what the export that traces every
layer computes, for every family and option, and models whose layers differ are traced whole."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.ort_decoding import session
from support.tiny_models import ENCODERS, FAMILIES

from headfold import convert
from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.modeling import hollow_model
from headfold.graphs import export as export_module
from headfold.graphs.export import export
from headfold.graphs.template import TRACED_LAYERS, LayerTemplate

LAYERS = 5  # three traced, two copies (one chained after the other)
WIDE = {"head_dim": 16}  # ORT's GroupQueryAttention takes the rotary (and then packed QKV) on heads of 16
FAST = {"llama", "gpt2", "bert"}  # rotary + RMSNorm; tied Conv1D with biases; an encoder, whose last layer is the output
OPTIONS = [
    {"graphs": "split"},
    {"optimize": "ort"},
    {"attention": "ort-gqa", "optimize": "ort", "checkpoint": WIDE},
    {"trt_version": "10.14", "graphs": "split"},
    {"explicit_positions": True},
]
CASES = [pytest.param(family, {}, id=family, marks=() if family in FAST else pytest.mark.slow) for family in FAMILIES] + [
    pytest.param("llama", options, id="llama-" + "-".join(f"{k}={v}" for k, v in options.items() if k != "checkpoint"), marks=pytest.mark.slow)
    for options in OPTIONS
]


@pytest.fixture(scope="module")
def four_layers(tiny_checkpoint, tmp_path_factory):
    """family, checkpoint options → a 4-layer tiny checkpoint converted to 2 kv heads (encoders: as is)."""

    def get(family: str, checkpoint: dict) -> Path:
        source = tiny_checkpoint(family, num_hidden_layers=LAYERS, **checkpoint)
        if family in ENCODERS:
            return source
        return convert(source, tmp_path_factory.mktemp(f"{family}-4L") / "gqa", 2, method="mean", progress=False)

    return get


def traced_whole(monkeypatch) -> None:
    monkeypatch.setattr(export_module.LayerTemplate, "of", classmethod(lambda cls, *args: None))


def outputs(folder: Path, graph: str, past: int = 3) -> list[np.ndarray]:
    """The graph's outputs on a seeded batch: 2 rows of new tokens (5, or 1 for decode.onnx) after
    `past` random cached ones where the graph takes a past."""
    runner, rng = session(folder / graph), np.random.default_rng(0)
    inputs = runner.get_inputs()
    new = 1 if graph == "decode.onnx" else 5
    past = past if any(i.name.startswith("past_key_values.") for i in inputs) else 0
    feeds = {"input_ids": rng.integers(3, 150, (2, new)), "attention_mask": np.ones((2, past + new), np.int64)}
    for i in inputs:
        if i.name == "token_type_ids":
            feeds[i.name] = np.zeros((2, new), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.tile(np.arange(past, past + new), (2, 1))
        elif i.name.startswith("past_key_values."):
            feeds[i.name] = rng.standard_normal((2, i.shape[1], past, i.shape[3])).astype(np.float32)
    return runner.run(None, feeds)


@pytest.mark.parametrize(("family", "options"), CASES)
def test_template_export_computes_what_tracing_every_layer_does(four_layers, tmp_path: Path, monkeypatch, family: str, options: dict) -> None:
    options = dict(options)
    checkpoint = four_layers(family, options.pop("checkpoint", {}))
    copied = export(checkpoint, tmp_path / "template", progress=False, **options)
    traced_whole(monkeypatch)
    whole = export(checkpoint, tmp_path / "whole", progress=False, **options)
    assert copied["graphs"].keys() == whole["graphs"].keys()
    for graph, summary in copied["graphs"].items():
        assert summary["traced_layers"] == TRACED_LAYERS, "the template was not used"
        assert "traced_layers" not in whole["graphs"][graph]
        assert (summary["inputs"], summary["outputs"]) == (whole["graphs"][graph]["inputs"], whole["graphs"][graph]["outputs"])
        assert summary["attention_kv_heads"] == whole["graphs"][graph]["attention_kv_heads"] == [copied["kv_heads"]] * LAYERS
        assert summary.get("ort_fusions") == whole["graphs"][graph].get("ort_fusions")
        assert summary.get("decomposed_for_tensorrt") == whole["graphs"][graph].get("decomposed_for_tensorrt")
        past = 0 if options.get("attention") == "ort-gqa" else 3  # ORT's GQA takes a past with one new token per row only
        for ours, theirs in zip(outputs(tmp_path / "template", graph, past), outputs(tmp_path / "whole", graph, past), strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


def test_layers_that_differ_are_traced_whole(tiny_checkpoint, tmp_path: Path) -> None:
    """Per-layer kv heads make the layers' shapes differ: no template, every layer traced."""
    checkpoint = convert(tiny_checkpoint("llama", num_hidden_layers=LAYERS), tmp_path / "gqa", [4, 2, 2, 2, 2], method="mean", progress=False)
    summary = export(checkpoint, tmp_path / "onnx", progress=False)
    assert "traced_layers" not in summary["graphs"]["model.onnx"]
    assert summary["graphs"]["model.onnx"]["attention_kv_heads"] == [4, 2, 2, 2, 2]
    assert json.loads((tmp_path / "onnx" / "export.json").read_text())["graphs"]["model.onnx"]["attention_kv_heads"] == [4, 2, 2, 2, 2]


def test_two_layers_need_no_template(tiny_checkpoint) -> None:
    facts = CheckpointFacts.read(tiny_checkpoint("llama"))
    model, _ = hollow_model(facts, torch.float32)
    assert facts.layers < TRACED_LAYERS and LayerTemplate.of(model, facts.layers, "model") is None
