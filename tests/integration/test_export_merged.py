"""The merged decoder graph: the standard-Attention graph (--attention onnx) against torch for a prompt,
one token and chunked appends after a past, with left, right and gapped padding, per-layer kv heads;
the default folder's GroupQueryAttention nodes take past in every phase and equal the standard graph
on right-padded rows; --optimize ort equal to the unfused graph; bad option pairs refused; build
refuses a merged folder with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from support.ort_decoding import run_chunks
from support.tiny_models import HEADS, MERGED_CASES

from headfold import convert
from headfold.converter.modeling import load_model
from headfold.graphs.export import export, positions_from_mask
from headfold.ground.errors import BadInput

ATOL = 1e-4
LAYERS = 2
CHUNKS = (5, 6, 1, 3)  # a prompt, a multi-token append, one generated token, another append (15 tokens)

# (family, kv heads); the first two run by default, the rest are slow. gpt2 at kv 1 is written as gpt_bigcode.
CASES = [("llama", 2), ("gpt2", 1)] + [
    pytest.param(*case, marks=pytest.mark.slow) for case in [("qwen2", 4), ("phi3", 2), ("gpt_neox", 2), ("opt", 4), ("qwen3", (4, 2)), *MERGED_CASES]
]


@pytest.fixture(scope="module")
def merged(tiny_checkpoint, tiny_export, tmp_path_factory):
    """merged(family, kv, config={overrides}, **export options) → (checkpoint, export folder), cached
    (the session's, shared with other modules, for the family's own tiny model). The standard
    Attention graph unless `attention` says otherwise ("auto": the default folder)."""
    cache: dict[tuple, tuple[Path, Path]] = {}

    def get(family: str, kv, config: dict | None = None, **options) -> tuple[Path, Path]:
        options = {"attention": "onnx", **options}
        if options["attention"] == "auto":  # the export's default: the same folder as tiny_export's default
            del options["attention"]
        if not config:
            return tiny_export(family, None if kv == HEADS else kv, graphs="merged", **options)
        key = (family, kv, tuple(sorted((config or {}).items())), tuple(sorted(options.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"{family}-merged")
            source = tiny_checkpoint(family, **(config or {}))
            checkpoint = convert(source, folder / "checkpoint", kv, method="mean", progress=False) if kv != HEADS else source
            export(checkpoint, folder / "onnx", progress=False, **options)
            cache[key] = checkpoint, folder / "onnx"
        return cache[key]

    return get


def _padded_batch(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """3 rows of 15: unpadded, left-padded (3), right-padded (2) — and gapped once chunks follow."""
    ids = np.random.default_rng(0).integers(3, vocab, (3, sum(CHUNKS)))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    mask[2, 3:5] = 0  # pads inside the first chunk: later chunks come after them
    return ids, mask


def _torch_logits(checkpoint: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The whole sequence in one full forward, positions counted over real tokens like the graph."""
    model = load_model(checkpoint)
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.no_grad():
        return model(input_ids=ids_t, attention_mask=mask_t, position_ids=positions_from_mask(mask_t)).logits.numpy()


@pytest.mark.parametrize(("family", "kv"), CASES)
def test_prompt_steps_and_appends_match_torch(merged, family: str, kv) -> None:
    checkpoint, folder = merged(family, kv)
    summary = json.loads((folder / "export.json").read_text())
    assert list(summary["graphs"]) == ["model.onnx"] and summary["layout"] == "merged"
    kv_layers = list(kv) if isinstance(kv, tuple) else [kv] * LAYERS
    assert summary["graphs"]["model.onnx"]["attention_kv_heads"] == kv_layers  # one fused Attention per layer
    graph = onnx.load(folder / "model.onnx", load_external_data=False)
    past = {i.name: i.type.tensor_type.shape.dim[1].dim_value for i in graph.graph.input if i.name.startswith("past")}
    assert [past[f"past_key_values.{i}.value"] for i in range(LAYERS)] == kv_layers

    ids, mask = _padded_batch(json.loads((checkpoint / "config.json").read_text())["vocab_size"])
    expected, real = _torch_logits(checkpoint, ids, mask), mask.astype(bool)
    for chunks in ((sum(CHUNKS),), CHUNKS, (1,) * sum(CHUNKS)):  # prompt only; mixed appends; token by token
        got = run_chunks(folder / "model.onnx", ids, mask, chunks)
        error = np.abs(got - expected)[real].max()
        assert error <= ATOL, f"{family} chunks {chunks}: max abs error {error:.2e}"


def test_default_folder_takes_past_in_every_phase(merged) -> None:
    """The default folder's GroupQueryAttention nodes read past K/V and write present (shared buffers);
    right-padded prompts then one-token steps equal the standard graph."""
    checkpoint, standard = merged("llama", 2)
    _, gqa = merged("llama", 2, attention="auto")
    graph = onnx.load(gqa / "model.onnx", load_external_data=False)
    nodes = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
    outputs = {o.name for o in graph.graph.output}
    assert len(nodes) == LAYERS and all(n.input[3].startswith("past_key_values.") and n.output[1] in outputs for n in nodes)
    assert json.loads((gqa / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is True

    ids = np.random.default_rng(1).integers(3, 160, (2, 12))
    mask = np.ones_like(ids)
    mask[1, 6:8] = 0  # right-padded prompt of 6 + 2 pads; generated tokens follow the pads
    chunks = (8, 1, 1, 1, 1)
    want, got = (run_chunks(f / "model.onnx", ids, mask, chunks) for f in (standard, gqa))
    error = np.abs(got - want)[mask.astype(bool)].max()
    assert error <= ATOL, f"ort-gqa vs standard: max abs error {error:.2e}"


def test_optimize_ort_counts_fusions_and_keeps_numbers(merged) -> None:
    checkpoint, plain = merged("llama", 2)
    _, fused = merged("llama", 2, optimize="ort")
    counts = json.loads((fused / "export.json").read_text())["graphs"]["model.onnx"]["ort_fusions"]
    assert counts["SkipSimplifiedLayerNormalization"] == 2 * LAYERS  # before attention and MLP, after each residual Add
    assert counts["FusedMatMul"] >= 0 and counts["merged_duplicate_nodes"] > 0  # the per-layer rotary tables
    ops = {n.op_type for n in onnx.load(fused / "model.onnx", load_external_data=False).graph.node}
    assert "SkipSimplifiedLayerNormalization" in ops and "Attention" in ops
    ids, mask = _padded_batch(160)
    for chunks in ((sum(CHUNKS),), CHUNKS):
        want, got = run_chunks(plain / "model.onnx", ids, mask, chunks), run_chunks(fused / "model.onnx", ids, mask, chunks)
        assert np.abs(got - want)[mask.astype(bool)].max() <= 1e-5


# (family, kv, config overrides, rules that must fire per layer): rotary goes into
# GroupQueryAttention where it is full-width on heads of a multiple of 16 (ORT's CPU kernel), so
# head_dim 16; not the tiny models' head_dim 8, gpt_neox's half-width rotary or GPT-2's absolute
# positions. Q/K/V are packed where they are three Linears (with biases: qwen2), not GPT-2's c_attn.
WIDE = {"head_dim": 16}
GQA_FUSIONS = [
    ("llama", 2, WIDE, {"RotaryIntoGroupQueryAttention": 1, "PackedQKV": 1}),
    ("gpt2", 1, None, {"RotaryIntoGroupQueryAttention": 0, "PackedQKV": 0}),
] + [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in [
        ("qwen2", 4, WIDE, {"RotaryIntoGroupQueryAttention": 1, "PackedQKVWithBias": 1}),
        ("llama", 2, None, {"RotaryIntoGroupQueryAttention": 0, "PackedQKV": 0}),  # head_dim 8: nothing fires
        ("gpt_neox", 2, None, {"RotaryIntoGroupQueryAttention": 0}),
    ]
]


@pytest.mark.parametrize(("family", "kv", "config", "fired"), GQA_FUSIONS)
def test_optimize_ort_on_gqa_folds_rotary_and_packs_qkv_exactly(merged, family: str, kv, config, fired: dict) -> None:
    """The default folder (GroupQueryAttention, --optimize ort): rotary inside and packed QKV where
    valid, counted, and equal to the unfused ort-gqa graph (right-padded prompt, then steps)."""
    checkpoint, unfused = merged(family, kv, config, attention="ort-gqa", optimize="none")
    _, fused = merged(family, kv, config, attention="auto")
    counts = json.loads((fused / "export.json").read_text())["graphs"]["model.onnx"]["ort_fusions"]
    assert {rule: counts[rule] for rule in fired} == {rule: n * LAYERS for rule, n in fired.items()}
    graph = onnx.load(fused / "model.onnx", load_external_data=False).graph
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    rotary = {a.name: a.i for n in gqa for a in n.attribute if a.name == "do_rotary"}
    assert len(gqa) == LAYERS and rotary.get("do_rotary", 0) == fired.get("RotaryIntoGroupQueryAttention", 0)
    assert not any(n.op_type == "RotaryEmbedding" for n in graph.node) or not rotary
    ids = np.random.default_rng(1).integers(3, 160, (2, 12))
    mask = np.ones_like(ids)
    mask[1, 6:8] = 0
    chunks = (8, 1, 1, 1, 1)
    want, got = (run_chunks(f / "model.onnx", ids, mask, chunks) for f in (unfused, fused))
    error = np.abs(got - want)[mask.astype(bool)].max()
    assert error <= ATOL, f"{family} fused vs unfused ort-gqa: max abs error {error:.2e}"


def test_explicit_position_ids_equal_the_mask_derived_ones(merged) -> None:
    """position_ids: a position_ids input, named in genai_config; fed the positions the mask
    gives (left, right and gapped padding, prompt and appends) it yields the same logits."""
    _, plain = merged("llama", 2)
    _, explicit = merged("llama", 2, position_ids=True)
    graph = onnx.load(explicit / "model.onnx", load_external_data=False).graph
    assert [i.name for i in graph.input][:3] == ["input_ids", "attention_mask", "position_ids"]
    inputs = [json.loads((f / "genai_config.json").read_text())["model"]["decoder"]["inputs"] for f in (plain, explicit)]
    assert "position_ids" not in inputs[0] and inputs[1]["position_ids"] == "position_ids"
    ids, mask = _padded_batch(160)
    for chunks in ((sum(CHUNKS),), CHUNKS):
        want, got = run_chunks(plain / "model.onnx", ids, mask, chunks), run_chunks(explicit / "model.onnx", ids, mask, chunks)
        assert np.abs(got - want)[mask.astype(bool)].max() <= 1e-6


def test_bad_layouts_and_option_clashes(tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama")
    with pytest.raises(BadInput, match="--graphs merged or --graphs split"):
        export(src, tmp_path / "a", graphs="both", progress=False)
    with pytest.raises(BadInput, match="TensorRT cannot parse"):
        export(src, tmp_path / "b", optimize="ort", trt_version="10.15", progress=False)
    with pytest.raises(BadInput, match="GroupQueryAttention, which TensorRT cannot parse"):
        export(src, tmp_path / "c", attention="ort-gqa", trt_version="10.15", progress=False)
    with pytest.raises(BadInput, match="bloom adds ALiBi position biases.*; drop --attention"):
        export(tiny_checkpoint("bloom"), tmp_path / "d", attention="ort-gqa", progress=False)
    with pytest.raises(BadInput, match="unknown attention kind 'gqa'"):
        export(src, tmp_path / "e", attention="gqa", progress=False)
    assert not any(tmp_path.iterdir())


def test_build_refuses_the_merged_graph_with_the_fix(merged, tmp_path: Path) -> None:
    from headfold.engines.env import target_for
    from headfold.engines.plan import make_plan

    _, folder = merged("llama", 2)
    with pytest.raises(BadInput, match="--graphs split"):
        make_plan(folder, tmp_path / "engines", target_for("10.15", dry_run=True))


def test_explicit_position_ids_on_fused_ort_gqa(merged) -> None:
    """The default folder with --position-ids: GroupQueryAttention still takes the rotary (its
    positions come from the past length and the mask, which the fed mask-derived position_ids
    equal), and the graph gives the implicit-positions graph's logits (right-padded prompt, steps)."""
    _, implicit = merged("llama", 2, WIDE, attention="auto")
    _, explicit = merged("llama", 2, WIDE, attention="auto", position_ids=True)
    graph = onnx.load(explicit / "model.onnx", load_external_data=False).graph
    assert [i.name for i in graph.input][:3] == ["input_ids", "attention_mask", "position_ids"]
    counts = json.loads((explicit / "export.json").read_text())["graphs"]["model.onnx"]["ort_fusions"]
    assert counts["RotaryIntoGroupQueryAttention"] == LAYERS
    ids = np.random.default_rng(1).integers(3, 160, (2, 12))
    mask = np.ones_like(ids)
    mask[1, 6:8] = 0
    chunks = (8, 1, 1, 1, 1)
    want, got = (run_chunks(f / "model.onnx", ids, mask, chunks) for f in (implicit, explicit))
    assert np.abs(got - want)[mask.astype(bool)].max() <= 1e-5
