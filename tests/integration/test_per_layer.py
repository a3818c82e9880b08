"""Per-layer kv heads (`--kv-heads 4,2`): parsing, conversion, loading, KV-cache size, export, CLI errors.

The tiny models have 2 layers of 8 heads, so a per-layer list has two entries.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers
from support.checkpoint_edits import edit_attention, identical_heads
from support.ort_decoding import ort_greedy, session
from support.tiny_models import ENCODERS, HEADS, sample_batch

from headfold import Calibration, convert
from headfold.cli import main
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.modeling import load_model
from headfold.converter.per_layer import parse_kv_heads
from headfold.graphs.export import export, positions_from_mask
from headfold.graphs.onnx_convert import convert_onnx
from headfold.ground.errors import BadInput
from headfold.ground.precision import Precision
from headfold.verification.artifacts import attention_info

MIXED = (4, 2)
LOSSLESS_FAMILIES = ("llama", "qwen3", "phi3", "gpt2", "gpt_neox", "opt", "bert", "stablelm", "gptj", "bloom")
HEAD_DIM = 8  # tiny models: hidden 64 / 8 heads (qwen3: explicit head_dim 8)


def file_digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    with SourceCheckpoint(folder) as ckpt:
        return {name: ckpt.get(name).clone() for name in ckpt.tensors}


def outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def cache_heads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[int]:
    """K/V heads of each layer's DynamicCache entry after a forward."""
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(**batch, cache=cache, use_cache=True)
    return [layer.keys.shape[1] for layer in cache.layers]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err.strip()


# -- parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [("4", 4), ("8,4,4,2", (8, 4, 4, 2)), (" 4 , 2 ", (4, 2)), ("2,2", (2, 2))])
def test_parse_kv_heads(text: str, expected) -> None:
    assert parse_kv_heads(text) == expected


@pytest.mark.parametrize("text", ["", "4,,2", "4,a", "-1", "4.0", "4;2", "²", "4,٣"])
def test_parse_kv_heads_refuses(text: str) -> None:
    with pytest.raises(BadInput, match="is not a count; give one value"):
        parse_kv_heads(text)


# -- conversion -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_uniform_list_is_the_single_count(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint(family)
    single = convert(src, tmp_path / "int", 2, method="mean", progress=False)
    listed = convert(src, tmp_path / "list", [2, 2], method="mean", progress=False)
    assert file_digests(single) == file_digests(listed)  # weights, config.json and headfold.json
    config = json.loads((listed / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and "num_key_value_heads_per_layer" not in config


@pytest.mark.parametrize("family", LOSSLESS_FAMILIES)
def test_mixed_list_with_identical_heads_is_lossless(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    src = edit_attention(tiny_checkpoint(family), tmp_path / "src", identical_heads(HEADS // min(MIXED)))
    out = convert(src, tmp_path / "out", MIXED, method="mean", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert (config["num_key_value_heads"], config["num_key_value_heads_per_layer"]) == (4, [4, 2])
    conversion = json.loads((out / "headfold.json").read_text())["conversion"]
    assert (conversion["kv_heads"], conversion["group_size"]) == ([4, 2], [2, 4])
    assert conversion["kv_head_of_query_head"] == [[h // 2 for h in range(HEADS)], [h // 4 for h in range(HEADS)]]

    original, converted = load_model(src), load_model(out)
    batch = sample_batch(original.config, batch=3, seq=9)
    diff = (outputs(original, batch) - outputs(converted, batch)).abs().max().item()
    assert diff <= 1e-5, f"{family} {MIXED}: max abs diff {diff}"
    if family not in ENCODERS:
        assert cache_heads(converted, batch) == list(MIXED)


@pytest.mark.parametrize("method", ["mean", "first"])
@pytest.mark.parametrize("family", ["llama", "phi3", "gpt2", "gpt_neox"])  # separate, fused blocks, grouped layouts
def test_mixed_list_equals_per_layer_single_counts(family: str, method: str, tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint(family)
    mixed = read_tensors(convert(src, tmp_path / "mixed", MIXED, method, progress=False))
    single = {kv: read_tensors(convert(src, tmp_path / f"kv{kv}", kv, method, progress=False)) for kv in set(MIXED)}
    with SourceCheckpoint(tmp_path / "mixed") as ckpt:
        owner = ckpt.attention.owner()
    assert mixed.keys() == single[4].keys()
    for name, tensor in mixed.items():
        expected = single[MIXED[owner[name]]][name] if name in owner else single[4][name]
        assert torch.equal(tensor, expected), name


def test_kv_cache_shrinks_as_predicted(tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama")
    out = convert(src, tmp_path / "out", MIXED, method="mean", progress=False)
    before, after = attention_info(src, Precision.FP32), attention_info(out, Precision.FP32)
    assert before == {"heads": 8, "kv_heads": 8, "kv_cache_bytes_per_token": 2 * 2 * 8 * HEAD_DIM * 4}  # 1024
    assert after == {"heads": 8, "kv_heads": [4, 2], "kv_cache_bytes_per_token": 2 * (4 + 2) * HEAD_DIM * 4}  # 384
    model = load_model(out)
    batch = sample_batch(model.config, batch=1, seq=5)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(**batch, cache=cache, use_cache=True)
    cached = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert cached == 5 * after["kv_cache_bytes_per_token"]  # 5 tokens: 1920 bytes


def test_plain_transformers_refuses_the_smaller_layers(tiny_checkpoint, tmp_path: Path) -> None:
    out = convert(tiny_checkpoint("llama"), tmp_path / "out", MIXED, method="mean", progress=False)
    manifest = json.loads((out / "headfold.json").read_text())
    assert manifest["loader"] == "headfold.load_model"
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        transformers.AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize(
    "per_layer, words",
    [([4], "must list one positive count per layer (2)"), ([4, 3], "entry 3 does not divide 8 heads"),
     ([2, 2], "num_key_value_heads=4 must be the largest"), ([4, 4], "k_proj.weight has shape [16, 64]")],
)  # fmt: skip
def test_loader_checks_the_per_layer_list(per_layer: list[int], words: str, tiny_checkpoint, tmp_path: Path) -> None:
    out = convert(tiny_checkpoint("llama"), tmp_path / "out", MIXED, method="mean", progress=False)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"num_key_value_heads_per_layer": per_layer}))
    with pytest.raises(BadInput, match=words.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as err:
        load_model(out)
    assert "\n" not in str(err.value)


def test_chained_per_layer_conversion(tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("gpt_neox")
    mid = convert(src, tmp_path / "mid", MIXED, method="mean", progress=False)
    chained = convert(mid, tmp_path / "chained", (2, 1), method="mean", progress=False)
    direct = convert(src, tmp_path / "direct", (2, 1), method="mean", progress=False)
    a, b = read_tensors(chained), read_tensors(direct)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-6, f"mean of means vs mean: {worst}"  # contiguous equal groups: the same pooling
    manifest = json.loads((chained / "headfold.json").read_text())
    assert manifest["source"]["kv_heads"] == [4, 2] and manifest["source"]["manifest"]["conversion"]["kv_heads"] == [4, 2]
    uniform = json.loads((convert(mid, tmp_path / "uniform", 2, method="mean", progress=False) / "config.json").read_text())
    assert uniform["num_key_value_heads"] == 2 and "num_key_value_heads_per_layer" not in uniform
    with pytest.raises(BadInput, match="--kv-heads 4 for layer 1 is impossible .* and 2 kv heads; choose one of: 1, 2"):
        convert(mid, tmp_path / "bad", 4, method="mean", progress=False)
    assert not (tmp_path / "bad").exists()


# -- command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kv_heads, words",
    [("4,2,2", "--kv-heads lists 3 values but the model has 2 layers; give one per layer or a single value"),
     ("4,3", "--kv-heads 3 for layer 1 is impossible for a model with 8 attention heads; choose one of: 1, 2, 4, 8"),
     ("4,x", "--kv-heads '4,x' is not a count"), ("4,0", "--kv-heads 0 for layer 1 is impossible")],
)  # fmt: skip
@pytest.mark.parametrize("command", ["convert", "run"])
def test_cli_refuses_bad_lists(command: str, kv_heads: str, words: str, tiny_checkpoint, tmp_path: Path, capsys) -> None:
    src = tiny_checkpoint("llama")
    code, err = run_cli([command, str(src), str(tmp_path / "out"), "--kv-heads", kv_heads], capsys)
    assert code == 2 and words in err, err
    assert err.startswith("headfold: error:") and "\n" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary sibling


def test_cli_converts_a_list(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    code = main(["convert", str(tiny_checkpoint("llama")), str(tmp_path / "out"), "--kv-heads", "4,2", "--method", "mean", "-q"])
    assert code == 0 and "(4,2 kv heads, method mean)" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads_per_layer"] == [4, 2]


# -- export -----------------------------------------------------------------------------------


@torch.no_grad()
def torch_greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> np.ndarray:
    """Greedy tokens recomputing the whole sequence each step (no cache on the torch side)."""
    for _ in range(steps):
        token = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits[:, -1:].argmax(-1)
        ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    return ids[:, -steps:].numpy()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_export_mixed_matches_torch(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    checkpoint = convert(tiny_checkpoint(family), tmp_path / "checkpoint", MIXED, method="mean", progress=False)
    summary = export(checkpoint, tmp_path / "onnx", progress=False, graphs="split")
    assert summary["kv_heads"] == [4, 2]
    assert all(graph["attention_kv_heads"] == [4, 2] for graph in summary["graphs"].values())
    decode = onnx.load(tmp_path / "onnx" / "decode.onnx", load_external_data=False)
    past_heads = {i.name: i.type.tensor_type.shape.dim[1].dim_value for i in decode.graph.input if i.name.startswith("past")}
    assert past_heads == {f"past_key_values.{i}.{kind}": MIXED[i] for i in range(2) for kind in ("key", "value")}

    model = load_model(checkpoint)
    batch = sample_batch(model.config, batch=3, seq=9)  # last row left-padded
    ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    logits, *present = session(tmp_path / "onnx" / "prefill.onnx").run(None, {"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        expected = model(**batch, position_ids=positions_from_mask(batch["attention_mask"])).logits.numpy()
    error = float(np.abs(logits - expected)[mask.astype(bool)].max())
    assert error <= 1e-4, f"{family} prefill: max abs error {error:.2e}"
    assert [p.shape[1] for p in present] == [4, 4, 2, 2]

    tokens, present = ort_greedy(tmp_path / "onnx", ids, mask, layers=2, new_tokens=8)
    assert np.array_equal(tokens, torch_greedy(model, batch["input_ids"], batch["attention_mask"], 8))
    assert [p.shape[1] for p in present] == [4, 4, 2, 2]


@pytest.mark.slow
def test_export_mixed_ort_gqa_sets_kv_num_heads_per_node(tiny_checkpoint, tmp_path: Path) -> None:
    checkpoint = convert(tiny_checkpoint("llama"), tmp_path / "checkpoint", MIXED, method="mean", progress=False)
    export(checkpoint, tmp_path / "onnx", attention="ort-gqa", progress=False, graphs="split")
    for name in ("prefill.onnx", "decode.onnx"):
        graph = onnx.load(tmp_path / "onnx" / name, load_external_data=False).graph
        nodes = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
        assert [next(a.i for a in n.attribute if a.name == "kv_num_heads") for n in nodes] == [4, 2]
    model = load_model(checkpoint)
    ids = sample_batch(model.config, batch=2, seq=9)["input_ids"][:1]  # ort-gqa: unpadded (or right-padded) rows
    mask = torch.ones_like(ids)
    tokens, _ = ort_greedy(tmp_path / "onnx", ids.numpy(), mask.numpy(), layers=2, new_tokens=8)
    assert np.array_equal(tokens, torch_greedy(model, ids, mask, 8))


@pytest.mark.slow
def test_onnx_convert_takes_a_list(tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("llama")
    export(src, tmp_path / "mha", progress=False, graphs="split")
    summary = convert_onnx(tmp_path / "mha" / "prefill.onnx", tmp_path / "gqa.onnx", MIXED)
    assert (summary["kv_heads"], summary["source_kv_heads"]) == ([4, 2], [HEADS])
    model = load_model(convert(src, tmp_path / "checkpoint", MIXED, method="mean", progress=False))
    batch = sample_batch(model.config, batch=3, seq=9)
    logits, *present = session(tmp_path / "gqa.onnx").run(None, {k: v.numpy() for k, v in batch.items()})
    with torch.no_grad():
        expected = model(**batch, position_ids=positions_from_mask(batch["attention_mask"])).logits.numpy()
    mask = batch["attention_mask"].numpy().astype(bool)
    assert float(np.abs(logits - expected)[mask].max()) <= 1e-4
    assert [p.shape[1] for p in present] == [4, 4, 2, 2]
    with pytest.raises(BadInput, match="lists 3 values but the model has 2 layers"):
        convert_onnx(tmp_path / "mha" / "prefill.onnx", tmp_path / "bad.onnx", (4, 2, 2))
    assert not (tmp_path / "bad.onnx").exists()


# -- data-aware methods on the embedded (byte-level) model ------------------------------------


def test_calibrated_methods_chain_through_a_per_layer_source(tmp_path: Path) -> None:
    """Calibration runs the source model: on a per-layer source that is headfold's loader."""
    from headfold.demo import default_model_path

    src = default_model_path()
    if not (src / "config.json").is_file():
        pytest.skip(f"embedded default model not present at {src}")
    mid = convert(src, tmp_path / "mid", (8, 4, 4, 2), "aligned+grouped", Calibration(tokens=512), progress=False)
    out = convert(mid, tmp_path / "out", (4, 2, 1, 1), "grouped+refit", Calibration(tokens=512), progress=False)
    conversion = json.loads((out / "headfold.json").read_text())["conversion"]
    assert conversion["kv_heads"] == [4, 2, 1, 1]
    assert [len(groups) for groups in conversion["source_kv_heads_of_kv_head"]] == [4, 2, 1, 1]
    pooled = [sorted(head for group in groups for head in group) for groups in conversion["source_kv_heads_of_kv_head"]]
    assert pooled == [list(range(n)) for n in (8, 4, 4, 2)]  # every source kv head pooled exactly once
    model = load_model(out)
    ids = torch.tensor([list(b"def main():\n    return 0\n")])
    assert cache_heads(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}) == [4, 2, 1, 1]
