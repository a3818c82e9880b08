"""Export from a traced template (graphs.template): a model whose layers are alike is traced with
three layers and the others are copies of layer 1; its graphs compute what the export that traces
every layer computes, for every family and option. A model whose layers differ is traced whole and
says why, and equals torch: every family with a scaling computed from the layer index in its
attention's forward (the traced layer 2 differs from layer 1), some with a per-layer attribute set
at construction (module state), a per-layer config list, and GPT-2's scale_attn_by_inverse_layer_idx."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from support.ort_decoding import run_chunks, session
from support.tiny_models import ENCODERS, FAMILIES

from headfold import convert
from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.modeling import hollow_model, load_model
from headfold.graphs import export as export_module
from headfold.graphs.export import export
from headfold.graphs.template import TRACED_LAYERS, LayerTemplate

LAYERS = 5  # three traced, two copies (one chained after the other)
WIDE = {"head_dim": 16}  # ORT's GroupQueryAttention takes the rotary (and then packed QKV) on heads of 16
FAST = {"llama", "gpt2", "bert"}  # rotary + RMSNorm; tied Conv1D with biases; an encoder, whose last layer is the output
OPTIONS = [  # the families' own cases export the default folder: GroupQueryAttention (standard Attention for encoders and BLOOM)
    {"graphs": "split"},
    {"attention": "onnx"},
    {"attention": "onnx", "optimize": "ort"},
    {"checkpoint": WIDE},  # the rotary inside GroupQueryAttention, packed QKV
    {"trt_version": "10.14", "graphs": "split"},
    {"position_ids": True},
]
CASES = [pytest.param(family, {}, id=family, marks=() if family in FAST else pytest.mark.slow) for family in FAMILIES] + [
    pytest.param("llama", options, id="llama-" + "-".join(f"{k}={v}" for k, v in options.items() if k != "checkpoint"), marks=pytest.mark.slow)
    for options in OPTIONS
]


@pytest.fixture(scope="module")
def four_layers(tiny_checkpoint, tmp_path_factory):
    """family, checkpoint options → a LAYERS-layer tiny checkpoint converted to 2 kv heads (encoders:
    as is; gpt_bigcode: GPT-2 converted to 1, which headfold writes as gpt_bigcode), made once."""
    cache: dict[str, Path] = {}

    def get(family: str, checkpoint: dict) -> Path:
        key = f"{family} {sorted(checkpoint.items())}"
        if key not in cache:
            source = tiny_checkpoint("gpt2" if family == "gpt_bigcode" else family, num_hidden_layers=LAYERS, **checkpoint)
            kv = 1 if family == "gpt_bigcode" else 2
            cache[key] = (
                source if family in ENCODERS else convert(source, tmp_path_factory.mktemp(f"{family}-{LAYERS}L") / "gqa", kv, method="mean", progress=False)
            )
        return cache[key]

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
        past = 0 if copied["attention"] == "ort-gqa" else 3  # ORT's GQA takes a past with one new token per row only
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


# --- a per-layer difference the old two-layer template copied ------------------------------------

GAINS = {  # injected into every attention module's forward: its output times a gain that differs per layer
    "layer index": lambda module: 1 + module.layer_idx / 8,  # computed from the index: the witness sees it
    "module state": lambda module: module.headfold_gain,  # set at construction: the state check sees it
    "config list": lambda module: module.config.headfold_gains[module.layer_idx],  # config.json: the per-layer list check sees it
}
WHY = {"layer index": "layer 2's traced graph is not layer 1's renamed", "module state": "headfold_gain", "config list": "config.headfold_gains"}
INJECTED = [
    pytest.param(family, "layer index", id=f"{family}-layer-index", marks=() if family in FAST else pytest.mark.slow) for family in (*FAMILIES, "gpt_bigcode")
] + [
    pytest.param("llama", "module state", id="llama-module-state"),
    pytest.param("gpt2", "module state", id="gpt2-module-state", marks=pytest.mark.slow),
    pytest.param("bert", "module state", id="bert-module-state", marks=pytest.mark.slow),
    pytest.param("llama", "config list", id="llama-config-list", marks=pytest.mark.slow),
]


def inject(monkeypatch, model: torch.nn.Module, how: str) -> None:
    """Scale the output of every module that knows its layer index (the attention modules) by the
    per-layer gain `how` names, in torch and in whatever headfold builds while the test runs.
    "module state" gives the last layer gain 2 in the constructor, every other layer 1."""
    gain = GAINS[how]
    for cls in {type(m) for m in model.modules() if type(getattr(m, "layer_idx", None)) is int}:

        def scaled(self, *args, _forward=cls.forward, **kwargs):
            out = _forward(self, *args, **kwargs)
            return (out[0] * gain(self), *out[1:]) if isinstance(out, tuple) else out * gain(self)

        monkeypatch.setattr(cls, "forward", functools.wraps(cls.forward)(scaled))  # the same signature (modeling checks it)
        if how != "module state":
            continue
        built = getattr(cls, "base", cls)  # headfold's GQA classes are transformers' own, adopted after construction

        def constructed(self, *args, _init=built.__init__, **kwargs):
            _init(self, *args, **kwargs)
            self.headfold_gain = 2.0 if self.layer_idx == LAYERS - 1 else 1.0

        monkeypatch.setattr(built, "__init__", functools.wraps(built.__init__)(constructed))


def assert_matches_torch(checkpoint: Path, folder: Path) -> None:
    """The export's model.onnx equals the torch model: a decoder on a prompt, a token and an append
    after it (its cache fed back), an encoder on a padded batch."""
    model, rng = load_model(checkpoint), np.random.default_rng(0)
    ids, mask = rng.integers(3, 150, (2, 9)), np.ones((2, 9), np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    if json.loads((folder / "export.json").read_text())["layout"] == "merged":
        got, want = run_chunks(folder / "model.onnx", ids, mask, (5, 1, 3)), out.logits.numpy()
    else:
        runner = session(folder / "model.onnx")
        feeds = {"input_ids": ids, "attention_mask": mask} | ({"token_type_ids": np.zeros_like(ids)} if len(runner.get_inputs()) == 3 else {})
        got, want = runner.run(None, feeds)[0], out.last_hidden_state.numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("family", "how"), INJECTED)
def test_a_per_layer_difference_is_traced_whole_and_equals_torch(four_layers, tmp_path: Path, monkeypatch, family: str, how: str) -> None:
    checkpoint = four_layers(family, {})
    if how == "config list":  # one gain per layer in config.json, the last differing
        checkpoint = Path(shutil.copytree(checkpoint, tmp_path / "gains"))
        config = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps(config | {"headfold_gains": [1.0] * (LAYERS - 1) + [2.0]}))
    inject(monkeypatch, load_model(checkpoint), how)
    # the standard graph: assert_matches_torch feeds a batch of 2 in chunks after a past, which GroupQueryAttention refuses
    summary = export(checkpoint, tmp_path / "onnx", attention="onnx", progress=False)["graphs"]["model.onnx"]
    assert "traced_layers" not in summary and WHY[how] in summary["traced_whole"], summary.get("traced_whole")
    assert len(summary["attention_kv_heads"]) == LAYERS
    assert_matches_torch(checkpoint, tmp_path / "onnx")


def test_gpt2_scaled_by_the_inverse_layer_index_is_traced_whole(tiny_checkpoint, tmp_path: Path, caplog) -> None:
    """Issue 33's case: GPT-2's attention scaled by 1 / (layer index + 1) (its scaling attribute)."""
    checkpoint = tiny_checkpoint("gpt2", num_hidden_layers=LAYERS, scale_attn_by_inverse_layer_idx=True)
    with caplog.at_level("DEBUG", logger="headfold.graphs.export"):
        export(checkpoint, tmp_path / "onnx", attention="onnx", progress=False)  # the standard graph, as above
    why = json.loads((tmp_path / "onnx" / "export.json").read_text())["graphs"]["model.onnx"]["traced_whole"]
    said = [r for r in caplog.records if r.getMessage() == f"tracing every layer: {why}"]
    assert "layer 2's attn.scaling" in why and [r.levelname for r in said] == ["DEBUG"]  # an internal line: -v only
    assert_matches_torch(checkpoint, tmp_path / "onnx")
