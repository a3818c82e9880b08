"""Sliding-window attention in the merged graph: each layer's window is in its Attention's mask
(the default GroupQueryAttention graph: its local_window_size) and the cache keeps every token.

Mistral and Phi-3 (one window in every layer: the template applies) and Qwen2 (full layers, then
sliding ones: traced whole, one mask per layer type), converted to 2 kv heads, on rows three times longer
than the window: ONNX Runtime equals torch with the cache fed back (the standard graph: the prompt
whole, in chunks and token by token; unpadded, left-padded and gapped rows), the default
GroupQueryAttention graph too (the prompt, then token by token; unpadded and right-padded rows);
onnxruntime-genai generates transformers' greedy tokens from both graphs; `headfold verify` passes; the
options whose graphs cannot hold a window are refused in one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from support.hostile import assert_one_line, cli
from support.ort_decoding import og_greedy, run_chunks

from headfold import convert
from headfold.converter.modeling import load_model
from headfold.graphs.export import export
from headfold.graphs.template import TRACED_LAYERS

WINDOW, LAYERS, KV, VOCAB = 4, 4, 2, 256  # a byte vocabulary: verify needs no tokenizer files
ATOL = 1e-4
CHUNKS = (5, 6, 1, 3)  # a prompt, a multi-token append, one generated token, another append (15 tokens)
MODELS = {
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},  # layer types full, full, sliding, sliding
    "phi3": {"sliding_window": WINDOW},
}
SLIDING = {"mistral": [True] * LAYERS, "qwen2": [False, False, True, True]}
FAMILIES = ["mistral", "qwen2", pytest.param("phi3", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def sliding(tiny_checkpoint, tmp_path_factory):
    """sliding(family, **export options) → (kv-2 checkpoint, export folder), made once per module."""
    cache: dict[tuple, tuple[Path, Path]] = {}

    def get(family: str, **options) -> tuple[Path, Path]:
        if family not in cache:
            source = tiny_checkpoint(family, num_hidden_layers=LAYERS, vocab_size=VOCAB, **MODELS[family])
            cache[family] = convert(source, tmp_path_factory.mktemp(family) / "kv2", KV, method="mean", progress=False), None
        key = (family, *sorted(options.items()))
        if key not in cache:
            checkpoint = cache[family][0]
            folder = tmp_path_factory.mktemp(f"{family}-onnx") / "onnx"
            export(checkpoint, folder, progress=False, **options)
            cache[key] = checkpoint, folder
        return cache[key]

    return get


def torch_rows(checkpoint: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """transformers' logits of each row run alone on its real tokens, at their columns (pads: 0)."""
    model, logits = load_model(checkpoint), np.zeros((*ids.shape, VOCAB), np.float32)
    for row, real in enumerate(mask.astype(bool)):
        with torch.no_grad():
            logits[row, real] = model(input_ids=torch.from_numpy(ids[row, real][None])).logits[0].numpy()
    return logits


def padded_rows(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """3 rows of 15 columns: unpadded, left-padded (3), gapped (2 pads inside the first chunk)."""
    ids = np.random.default_rng(seed).integers(3, VOCAB, (3, sum(CHUNKS)))
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    mask[2, 3:5] = 0
    return ids, mask


def without_window(checkpoint: Path, family: str, folder: Path) -> Path:
    """The checkpoint with its sliding window taken out of config.json (the same weights)."""
    copy = Path(shutil.copytree(checkpoint, folder / "full"))
    config = json.loads((copy / "config.json").read_text())
    config |= {"sliding_window": None, "use_sliding_window": False} | ({"layer_types": ["full_attention"] * LAYERS} if "layer_types" in config else {})
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("family", FAMILIES)
def test_window_matches_torch_with_the_cache_fed_back(sliding, family: str, tmp_path: Path) -> None:
    checkpoint, folder = sliding(family, attention="onnx")
    summary = json.loads((folder / "export.json").read_text())["graphs"]["model.onnx"]
    if family != "qwen2":  # one window for all: the layers are alike, the template copies them
        assert summary["traced_layers"] == TRACED_LAYERS
    else:
        assert "traced_layers" not in summary and "layer_types" in summary["traced_whole"]
    ids, mask = padded_rows()
    expected, real = torch_rows(checkpoint, ids, mask), mask.astype(bool)
    unwindowed = torch_rows(without_window(checkpoint, family, tmp_path), ids, mask)
    assert np.abs(unwindowed - expected)[real].max() > 100 * ATOL, "the rows are no longer than the window"
    for chunks in ((sum(CHUNKS),), CHUNKS, (1,) * sum(CHUNKS)):  # prompt only; mixed appends; token by token
        error = np.abs(run_chunks(folder / "model.onnx", ids, mask, chunks) - expected)[real].max()
        assert error <= ATOL, f"{family} chunks {chunks}: max abs error {error:.2e}"


@pytest.mark.parametrize("family", SLIDING)
def test_group_query_attention_takes_the_window_as_local_window_size(sliding, family: str) -> None:
    checkpoint, folder = sliding(family)  # the default folder: GroupQueryAttention
    nodes = [n for n in onnx.load(folder / "model.onnx", load_external_data=False).graph.node if n.op_type == "GroupQueryAttention"]
    windows = [next((a.i for a in n.attribute if a.name == "local_window_size"), -1) for n in nodes]
    assert windows == [WINDOW if slides else -1 for slides in SLIDING[family]]
    ids = np.random.default_rng(1).integers(3, VOCAB, (2, 12))
    mask = np.ones_like(ids)
    expected = torch_rows(checkpoint, ids, mask)
    for chunks in ((12,), (8, 1, 1, 1, 1)):  # ORT's GroupQueryAttention takes one new token per row after a past
        error = np.abs(run_chunks(folder / "model.onnx", ids, mask, chunks) - expected).max()
        assert error <= ATOL, f"{family} ort-gqa chunks {chunks}: max abs error {error:.2e}"
    right = mask.copy()
    right[1, 9:] = 0  # a right-padded prompt
    error = np.abs(run_chunks(folder / "model.onnx", ids, right, (12,)) - torch_rows(checkpoint, ids, right))[right.astype(bool)].max()
    assert error <= ATOL, f"{family} ort-gqa right-padded: max abs error {error:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize(("family", "attention"), [("qwen2", "onnx"), ("qwen2", "auto"), ("mistral", "auto")])
def test_onnxruntime_genai_generates_transformers_tokens(sliding, family: str, attention: str) -> None:
    """Prompts longer than the window, alone and as a right-padded batch (og pads so): og's greedy
    tokens equal transformers' generate on each prompt alone, from the standard graph and from the
    default one (GroupQueryAttention's local_window_size, one shared K/V buffer); genai_config needs
    no window key."""
    pytest.importorskip("onnxruntime_genai")
    checkpoint, folder = sliding(family, **({"attention": attention} if attention != "auto" else {}))
    assert "sliding" not in (folder / "genai_config.json").read_text()
    model, prompts, new = load_model(checkpoint), [list(range(3, 12)), list(range(40, 53)), list(range(100, 106))], 12
    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=new, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    for batch in ([0], [0, 1, 2]):
        for row, got in zip(batch, og_greedy(folder, [prompts[i] for i in batch], new), strict=True):
            want = expected[row]
            assert got[: len(want)] == want, f"og {family} {attention} row {row}: {got} against {want}"


@pytest.mark.slow
def test_verify_passes_on_a_sliding_export(sliding, capsys) -> None:
    checkpoint, folder = sliding("mistral")
    code, err = cli(capsys, "verify", checkpoint, folder, "--window", "32", "--max-rows", "8", "--batch-size", "4")
    assert code == 0, err


@pytest.mark.parametrize(("options", "named"), [(["--graphs", "split"], "--graphs split"), (["--trt-version", "10.15"], "--trt-version")])
def test_graphs_that_cannot_hold_a_window_are_refused(tiny_checkpoint, tmp_path: Path, capsys, options: list[str], named: str) -> None:
    source = tiny_checkpoint("mistral", num_hidden_layers=LAYERS, vocab_size=VOCAB, **MODELS["mistral"])
    code, err = cli(capsys, "export", source, tmp_path / "out", *options)
    assert_one_line(code, err, 2, named, f"sliding_window={WINDOW}")
    assert not (tmp_path / "out").exists()
