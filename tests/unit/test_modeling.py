"""headfold.converter.modeling.load_model: parity with transformers, exact GQA for identical heads, errors."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from support.tiny_models import ENCODERS, FAMILIES, HEADS, make_checkpoint, sample_batch

from headfold.converter.modeling import load_model
from headfold.ground.errors import BadInput

NON_NATIVE = ("gpt2", "gpt_neox", "opt", "bert", "roberta", "gptj", "bloom")
# phi3 (fused qkv_proj) and stablelm (one norm per kv head) are covered by test_convert's identical heads
NATIVE = ("llama", "mistral", "qwen2", "qwen3", "phi", "gemma", "olmo")
DECODERS = ("gpt2", "gpt_neox", "opt", "gptj", "bloom", "llama")  # llama: native-GQA control


def _output(model: transformers.PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**batch)
    return out.last_hidden_state if "last_hidden_state" in out else out.logits


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference over all positions, padded ones included."""
    return (a.double() - b.double()).abs().max().item()


def _hf_model(folder: Path) -> transformers.PreTrainedModel:
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    return getattr(transformers, architecture).from_pretrained(folder).eval()


# --- reference pooling: identical K/V heads inside each group, then the compact contract layout ---


def _tie(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    """Copy head g*G over the other heads of its group along head axis `dim`."""
    return x.index_select(dim, torch.arange(x.shape[dim]) // groups * groups)


def _pick(x: torch.Tensor, groups: int, dim: int) -> torch.Tensor:
    """Keep head g*G of each group along head axis `dim`."""
    return x.index_select(dim, torch.arange(0, x.shape[dim], groups))


def _separate(t: torch.Tensor, groups: int, d: int, compact: bool) -> torch.Tensor:
    """k_proj / key style: rows are H heads of d."""
    x = t.unflatten(0, (HEADS, d))
    return (_pick if compact else _tie)(x, groups, 0).flatten(0, 1)


def _gpt2(t: torch.Tensor, groups: int, d: int, compact: bool) -> torch.Tensor:
    """Conv1D c_attn: last dim is [Q | K | V], H heads of d each."""
    q, k, v = t.split(HEADS * d, dim=-1)
    op = _pick if compact else _tie
    k, v = (op(x.unflatten(-1, (HEADS, d)), groups, -2).flatten(-2) for x in (k, v))
    return torch.cat([q, k, v], dim=-1)


def _neox(t: torch.Tensor, groups: int, d: int, compact: bool) -> torch.Tensor:
    """query_key_value: rows are per head [q_h | k_h | v_h]; compact is per kv group [G q | k | v]."""
    x = t.unflatten(0, (HEADS, 3, d))
    q, k, v = x[:, 0], _tie(x[:, 1], groups, 0), _tie(x[:, 2], groups, 0)
    if not compact:
        return torch.stack([q, k, v], dim=1).flatten(0, 2)
    blocks = []
    for g in range(0, HEADS, groups):
        blocks += [q[g : g + groups].flatten(0, 1), k[g], v[g]]
    return torch.cat(blocks, dim=0)


# family -> (regex of K/V-carrying tensors, rewrite(tensor, G, head_dim, compact))
_KV_TENSORS: dict[str, tuple[str, Callable[..., torch.Tensor]]] = {
    "gpt2": (r"\.attn\.c_attn\.(weight|bias)$", _gpt2),
    "gpt_neox": (r"\.attention\.query_key_value\.(weight|bias)$", _neox),
    "opt": (r"\.self_attn\.[kv]_proj\.(weight|bias)$", _separate),
    **dict.fromkeys(NATIVE, (r"\.self_attn\.[kv]_proj\.(weight|bias)$", _separate)),
    "bert": (r"\.attention\.self\.(key|value)\.(weight|bias)$", _separate),
    "roberta": (r"\.attention\.self\.(key|value)\.(weight|bias)$", _separate),
    "gptj": (r"\.attn\.[kv]_proj\.weight$", _separate),
    "bloom": (r"\.self_attention\.query_key_value\.(weight|bias)$", _neox),  # the same per-head interleave
}


def _rewrite(tensors: dict[str, torch.Tensor], family: str, groups: int, compact: bool) -> int:
    """Rewrite the K/V tensors in place; return how many were rewritten."""
    pattern, fn = _KV_TENSORS[family]
    names = [n for n in tensors if re.search(pattern, n)]
    for name in names:
        tensors[name] = fn(tensors[name], groups, 64 // HEADS, compact)
    return len(names)


def _write_gqa(src: Path, dst: Path, n_kv: int, *, shards: int = 1) -> None:
    """Copy checkpoint `src` to `dst` with compact K/V tensors and num_key_value_heads = n_kv."""
    config = json.loads((src / "config.json").read_text())
    family, tensors = config["model_type"], load_file(src / "model.safetensors")
    assert _rewrite(tensors, family, HEADS // n_kv, compact=True) >= 4  # 2 layers x (weight, bias) or (k, v)
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps({**config, "num_key_value_heads": n_kv}))
    if shards == 1:
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        return
    names, weight_map = sorted(tensors), {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _gqa_pair(family: str, n_kv: int, root: Path, *, shards: int = 1, dtype: torch.dtype = torch.float32) -> tuple[transformers.PreTrainedModel, Path]:
    """(MHA model whose K/V heads are identical within groups, folder of its GQA checkpoint)."""
    make_checkpoint(family, root / "src", dtype=dtype)
    tensors = load_file(root / "src" / "model.safetensors")
    assert _rewrite(tensors, family, HEADS // n_kv, compact=False) >= 4
    save_file(tensors, root / "src" / "model.safetensors", metadata={"format": "pt"})
    _write_gqa(root / "src", root / "gqa", n_kv, shards=shards)
    return _hf_model(root / "src"), root / "gqa"


# --- tests ---


@pytest.mark.parametrize("family", FAMILIES)
def test_source_checkpoint_matches_from_pretrained(tmp_path: Path, family: str) -> None:
    folder = make_checkpoint(family, tmp_path)
    model = load_model(folder)
    batch = sample_batch(model.config)
    # bloom's mask code is eager's; its swapped-in attention runs SDPA (modeling.BloomGQAAttention)
    assert not model.training and model.config._attn_implementation == ("eager" if family == "bloom" else "sdpa")
    diff = _max_diff(_output(model, batch), _output(_hf_model(folder), batch))
    assert diff <= 1e-6


@pytest.mark.parametrize(
    ("family", "n_kv"),
    [(f, n) for f in NON_NATIVE for n in (4, 2, 1)] + [(f, 2) for f in NATIVE],
)
def test_gqa_equals_identical_heads(tmp_path: Path, family: str, n_kv: int) -> None:
    mha, folder = _gqa_pair(family, n_kv, tmp_path)
    gqa = load_model(folder)
    batch = sample_batch(gqa.config)
    assert _max_diff(_output(gqa, batch), _output(mha, batch)) <= 1e-5
    if gqa.config.tie_word_embeddings and family not in ENCODERS:
        assert gqa.get_output_embeddings().weight is gqa.get_input_embeddings().weight


@pytest.mark.parametrize("family", DECODERS)
def test_greedy_generate_with_cache_matches(tmp_path: Path, family: str) -> None:
    mha, folder = _gqa_pair(family, 2, tmp_path)
    gqa = load_model(folder)
    batch = sample_batch(gqa.config)
    with torch.no_grad():
        out = gqa(**batch, use_cache=True)
        assert out.past_key_values.layers[0].keys.shape[1] == 2  # the cache holds N heads, not H
        kwargs = dict(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        tokens = gqa.generate(**batch, **kwargs)
        expected = mha.generate(**batch, **kwargs)
    assert tokens.shape == (2, 7 + 8)
    assert torch.equal(tokens, expected)


@pytest.mark.parametrize(
    ("family", "old", "new"),
    [("gpt2", "transformer.", ""), ("bert", "LayerNorm.weight", "LayerNorm.gamma")],
)
def test_legacy_tensor_names(tmp_path: Path, family: str, old: str, new: str) -> None:
    """Hub GPT-2 has no base-model prefix; old BERTs use gamma/beta. transformers renames both."""
    mha, folder = _gqa_pair(family, 2, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    save_file({k.replace(old, new): v for k, v in tensors.items()}, folder / "model.safetensors")
    gqa = load_model(folder)
    batch = sample_batch(gqa.config)
    assert _max_diff(_output(gqa, batch), _output(mha, batch)) <= 1e-5


def test_sharded_gqa_checkpoint(tmp_path: Path) -> None:
    mha, folder = _gqa_pair("gpt_neox", 2, tmp_path, shards=3)
    gqa = load_model(folder)
    batch = sample_batch(gqa.config)
    assert _max_diff(_output(gqa, batch), _output(mha, batch)) <= 1e-5


def test_sharded_source_checkpoint(tmp_path: Path) -> None:
    folder = make_checkpoint("llama", tmp_path, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    model = load_model(folder)
    batch = sample_batch(model.config)
    assert _max_diff(_output(model, batch), _output(_hf_model(folder), batch)) <= 1e-6


def test_dtype_follows_checkpoint_unless_given(tmp_path: Path) -> None:
    _, folder = _gqa_pair("opt", 2, tmp_path, dtype=torch.bfloat16)
    assert load_model(folder).dtype == torch.bfloat16
    assert load_model(folder, dtype=torch.float32).dtype == torch.float32


def _bad_input(folder: Path, match: str) -> None:
    with pytest.raises(BadInput, match=match) as err:
        load_model(folder)
    assert "\n" not in str(err.value)


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_missing_config(tmp_path: Path) -> None:
    _bad_input(tmp_path, "config.json is missing")


@pytest.mark.parametrize("architecture", ["NotAModel", "MyRemoteCodeForCausalLM", "load_model", "PreTrainedModel"])
def test_unknown_architecture(tmp_path: Path, architecture: str) -> None:
    folder = make_checkpoint("llama", tmp_path)
    _edit_config(folder, architectures=[architecture], auto_map={"AutoModelForCausalLM": "x.Y"})
    _bad_input(folder, "unknown architecture")


def test_architecture_of_another_family(tmp_path: Path) -> None:
    _edit_config(make_checkpoint("gpt2", tmp_path), architectures=["LlamaForCausalLM"])
    _bad_input(tmp_path, "does not match model_type")


def test_unknown_model_type(tmp_path: Path) -> None:
    _edit_config(make_checkpoint("llama", tmp_path), model_type="surely_not_a_model")
    _bad_input(tmp_path, "does not convert model_type 'surely_not_a_model'.*transformers has no built-in model_type")


@pytest.mark.parametrize("family", ("gpt2", "gpt_neox", "bert", "llama"))
def test_kv_shapes_disagree_with_config(tmp_path: Path, family: str) -> None:
    _, folder = _gqa_pair(family, 2, tmp_path)
    _edit_config(folder, num_key_value_heads=4)
    _bad_input(folder, r"has shape .* num_key_value_heads")


def test_mha_tensors_with_gqa_config(tmp_path: Path) -> None:
    _edit_config(make_checkpoint("opt", tmp_path), num_key_value_heads=2)
    _bad_input(tmp_path, r"k_proj\.(weight|bias) has shape")


def test_kv_heads_must_divide_heads(tmp_path: Path) -> None:
    _edit_config(make_checkpoint("bert", tmp_path), num_key_value_heads=3)
    _bad_input(tmp_path, "must divide")


def _drop_and_add(folder: Path, drop: str | None = None, add: str | None = None) -> None:
    tensors = load_file(folder / "model.safetensors")
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(3)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("n_kv", (8, 2))  # source path (from_pretrained) and GQA loader
def test_missing_tensor(tmp_path: Path, n_kv: int) -> None:
    _, folder = _gqa_pair("gpt2", n_kv, tmp_path)
    _drop_and_add(folder, drop="transformer.h.1.attn.c_attn.bias")
    _bad_input(folder, "missing from the checkpoint, e.g. 'transformer.h.1.attn.c_attn.bias'")


@pytest.mark.parametrize("n_kv", (8, 2))
def test_unexpected_tensor(tmp_path: Path, n_kv: int) -> None:
    _, folder = _gqa_pair("gpt2", n_kv, tmp_path)
    _drop_and_add(folder, add="transformer.h.0.attn.q_attn.weight")
    _bad_input(folder, "unknown to GPT2LMHeadModel, e.g. 'transformer.h.0.attn.q_attn.weight'")


def test_stale_buffers_are_ignored(tmp_path: Path) -> None:
    _, folder = _gqa_pair("gpt2", 2, tmp_path)
    _drop_and_add(folder, add="transformer.h.0.attn.bias")  # causal-mask buffer of old GPT-2 checkpoints
    load_model(folder)


def test_no_safetensors(tmp_path: Path) -> None:
    folder = make_checkpoint("bert", tmp_path)
    (folder / "model.safetensors").unlink()
    _bad_input(folder, "no model.safetensors")


def test_corrupt_safetensors(tmp_path: Path) -> None:
    folder = make_checkpoint("opt", tmp_path)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    _bad_input(folder, "cannot read .*model.safetensors")
