"""Conversion exactness: identity is lossless, identical heads are lossless, pooled tensors
equal an independent per-layout reference, dtypes and sharding are preserved."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from support.checkpoint_edits import edit_attention, identical_heads
from support.reading import outputs, read_tensors
from support.tiny_models import ENCODERS, FAMILIES, HEADS, make_checkpoint

from headfold import convert
from headfold.ground.errors import BadInput

NATIVE_GQA = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi", "gemma", "olmo", "stablelm")


def with_identical_heads(src: Path, dst: Path, group: int) -> Path:
    """Copy of `src` whose K/V heads are identical inside each group of `group` heads."""
    return edit_attention(src, dst, identical_heads(group))


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_is_lossless(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint(family)
    out = convert(src, tmp_path / "out", kv_heads=HEADS, method="mean", progress=False)
    before, after = read_tensors(src), read_tensors(out)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(outputs(src), outputs(out))


@pytest.mark.parametrize("method", ["first", "aligned+grouped+refit", "grouped"])
def test_identity_is_byte_identical_whatever_the_method(method: str, tiny_checkpoint, tmp_path: Path) -> None:
    """kv heads = heads pools nothing: no method rotates, regroups or refits a layer it keeps."""
    src = tiny_checkpoint("llama")
    out = convert(src, tmp_path / "out", kv_heads=HEADS, method=method, progress=False)
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert "calibration" not in json.loads((out / "headfold.json").read_text())["conversion"]


@pytest.mark.parametrize("method", ["mean", "first"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_identical_heads_are_lossless(family: str, kv_heads: int, method: str, tiny_checkpoint, tmp_path: Path) -> None:
    src = with_identical_heads(tiny_checkpoint(family), tmp_path / "src", HEADS // kv_heads)
    out = convert(src, tmp_path / "out", kv_heads=kv_heads, method=method, progress=False)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == kv_heads
    diff = (outputs(src) - outputs(out)).abs().max().item()
    assert diff <= 1e-5, f"{family} kv={kv_heads} {method}: max abs diff {diff}"


# -- independent references: the pooled tensors, computed by explicit slicing per layout ----


def pool(heads: torch.Tensor, kv_heads: int, method: str) -> torch.Tensor:
    """[H, ...] → [kv_heads, ...] by the method's definition."""
    groups = heads.reshape(kv_heads, -1, *heads.shape[1:])
    return groups.mean(1) if method == "mean" else groups[:, 0]


def expected_separate(w: torch.Tensor, kv: int, method: str) -> torch.Tensor:
    """nn.Linear K or V: rows are heads × head_dim."""
    return pool(w.reshape(HEADS, -1, *w.shape[1:]), kv, method).reshape(-1, *w.shape[1:])


def expected_gpt2(w: torch.Tensor, kv: int, method: str) -> torch.Tensor:
    """Conv1D c_attn [in, 3·hidden] (bias [3·hidden]): columns [Q | K | V]."""
    q, k, v = w.chunk(3, dim=-1)
    per_head = lambda t: t.reshape(*t.shape[:-1], HEADS, -1).movedim(-2, 0)  # noqa: E731
    back = lambda t: t.movedim(0, -2).reshape(*t.shape[1:-1], -1)  # noqa: E731
    return torch.cat([q, back(pool(per_head(k), kv, method)), back(pool(per_head(v), kv, method))], dim=-1)


def expected_phi3(w: torch.Tensor, kv: int, method: str) -> torch.Tensor:
    """Linear qkv_proj rows [Q | K | V]."""
    q, k, v = w.chunk(3, dim=0)
    return torch.cat([q, expected_separate(k, kv, method), expected_separate(v, kv, method)])


def expected_neox(w: torch.Tensor, kv: int, method: str) -> torch.Tensor:
    """Linear query_key_value rows per head [q_h, k_h, v_h] → per kv group [q heads…, k_g, v_g]."""
    per_head = w.reshape(HEADS, 3, -1, *w.shape[1:])
    q, k, v = per_head[:, 0], pool(per_head[:, 1], kv, method), pool(per_head[:, 2], kv, method)
    groups = torch.cat([q.reshape(kv, -1, *q.shape[1:]), k[:, None], v[:, None]], dim=1)
    return groups.reshape(-1, *w.shape[1:])


POOLED = {  # family → (tensor-name suffixes that change, reference)
    "llama": (("k_proj.weight", "v_proj.weight"), expected_separate),
    "qwen2": (("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"), expected_separate),
    "opt": (("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"), expected_separate),
    "bert": (("self.key.weight", "self.value.weight", "self.key.bias", "self.value.bias"), expected_separate),
    "gpt2": (("c_attn.weight", "c_attn.bias"), expected_gpt2),
    "phi3": (("qkv_proj.weight",), expected_phi3),
    "gpt_neox": (("query_key_value.weight", "query_key_value.bias"), expected_neox),
    "bloom": (("query_key_value.weight", "query_key_value.bias"), expected_neox),  # the same per-head interleave
    "gptj": (("attn.k_proj.weight", "attn.v_proj.weight"), expected_separate),
}


@pytest.mark.parametrize("method", ["mean", "first"])
@pytest.mark.parametrize("family", POOLED)
def test_pooled_tensors_match_reference(family: str, method: str, tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint(family)
    out = convert(src, tmp_path / "out", kv_heads=2, method=method, progress=False)
    before, after = read_tensors(src), read_tensors(out)
    suffixes, reference = POOLED[family]
    changed = [k for k in before if k.endswith(suffixes)]
    assert len(changed) == 2 * len(suffixes)  # two layers
    for name in before:
        expected = reference(before[name], 2, method) if name in changed else before[name]
        torch.testing.assert_close(after[name], expected, rtol=0, atol=1e-7, msg=name)


def test_sharded_bf16_stays_sharded_bf16(tmp_path: Path) -> None:
    src = make_checkpoint("llama", tmp_path / "src", dtype=torch.bfloat16, max_shard_size="40KB")
    assert len(list(src.glob("*.safetensors"))) > 1
    out = convert(src, tmp_path / "out", kv_heads=2, method="mean", progress=False)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = read_tensors(out)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    limit = max(f.stat().st_size for f in src.glob("*.safetensors"))
    assert all(f.stat().st_size <= limit + 4096 for f in shards)  # mirrors the source shard size


def test_explicit_shard_size_and_single_file(tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint("gpt2")
    single = convert(src, tmp_path / "one", kv_heads=4, method="mean", progress=False)
    assert [f.name for f in single.glob("*.safetensors")] == ["model.safetensors"]
    many = convert(src, tmp_path / "many", kv_heads=4, max_shard_size="30KB", method="mean", progress=False)
    assert len(list(many.glob("*.safetensors"))) > 2
    assert torch.equal(outputs(single), outputs(many))


@pytest.mark.parametrize("family", NATIVE_GQA)
def test_llama_family_loads_in_plain_transformers(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    out = convert(tiny_checkpoint(family), tmp_path / "out", kv_heads=2, method="mean", progress=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.num_key_value_heads == 2
    assert model.model.layers[0].self_attn.config.num_key_value_heads == 2
    assert json.loads((out / "headfold.json").read_text())["loader"] == "transformers"
    logits = outputs(out, model)
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, outputs(out))


def test_phi_with_qk_layernorm_keeps_keys_unrotated(tiny_checkpoint, tmp_path: Path) -> None:
    """Phi's optional q/k LayerNorm is shared by all heads: identical heads pool losslessly, and the
    data-aware methods leave K unrotated (a LayerNorm is no rotation invariant), lossless at identity."""
    src = tiny_checkpoint("phi", qk_layernorm=True)
    same = with_identical_heads(src, tmp_path / "same", 4)
    assert (outputs(same) - outputs(convert(same, tmp_path / "mean", kv_heads=2, progress=False))).abs().max().item() <= 1e-5
    best = convert(src, tmp_path / "best", kv_heads=HEADS, method="aligned+grouped+refit", calibration="weights", progress=False)
    assert (outputs(src) - outputs(best)).abs().max().item() <= 1e-4


def test_stablelm_pools_one_norm_per_kv_head(tiny_checkpoint, tmp_path: Path) -> None:
    """qk_layernorm: 8 query-head norms stay, the 8 kv-head norms become 2, pooled like their K heads."""
    src = tiny_checkpoint("stablelm")
    for method in ("mean", "first"):
        out = convert(src, tmp_path / method, kv_heads=2, method=method, progress=False)
        before, after = read_tensors(src), read_tensors(out)
        for layer in range(2):
            norm = lambda i, layer=layer: f"model.layers.{layer}.self_attn.k_layernorm.norms.{i}.weight"  # noqa: E731
            expected = pool(torch.stack([before[norm(i)] for i in range(HEADS)]), 2, method)
            assert [torch.equal(after[norm(i)], expected[i]) for i in range(2)] == [True, True]
            assert norm(2) not in after and f"model.layers.{layer}.self_attn.q_layernorm.norms.7.weight" in after
        assert len(after) == len(before) - 2 * (HEADS - 2)


def test_gpt2_mqa_is_written_as_gpt_bigcode(tiny_checkpoint, tmp_path: Path) -> None:
    """kv 1: GPTBigCode (multi_query, nn.Linear weights) that plain transformers loads; logits equal
    headfold.load_model's of the same folder and, with identical heads, the source's."""
    src = with_identical_heads(tiny_checkpoint("gpt2"), tmp_path / "same", HEADS)
    out = convert(src, tmp_path / "mqa", kv_heads=1, method="mean", progress=False)
    config, manifest = (json.loads((out / name).read_text()) for name in ("config.json", "headfold.json"))
    assert (config["model_type"], config["architectures"], config["multi_query"]) == ("gpt_bigcode", ["GPTBigCodeForCausalLM"], True)
    assert (manifest["loader"], manifest["source"]["model_type"]) == ("transformers", "gpt2")
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "GPTBigCodeForCausalLM"
    assert torch.equal(outputs(out, model), outputs(out))
    assert (outputs(src) - outputs(out)).abs().max().item() <= 1e-5
    before, after = read_tensors(src), read_tensors(out)
    assert torch.equal(after["transformer.h.0.mlp.c_fc.weight"], before["transformer.h.0.mlp.c_fc.weight"].T)
    per_layer = convert(src, tmp_path / "plan", kv_heads=[1, 2], method="mean", progress=False)  # bigcode's multi_query is all layers or none
    assert json.loads((per_layer / "config.json").read_text())["model_type"] == "gpt2"


def test_gpt_bigcode_converts_to_mqa_only(tiny_checkpoint, tmp_path: Path) -> None:
    """An MHA gpt_bigcode (multi_query false) converts natively to MQA; 2 kv heads are refused."""
    mqa = convert(tiny_checkpoint("gpt2"), tmp_path / "mqa", kv_heads=1, method="mean", progress=False)
    mha = tmp_path / "mha"
    mha.mkdir()
    config = json.loads((mqa / "config.json").read_text())
    tensors = read_tensors(mqa)  # MQA rows [Q | k | v] → MHA per-head rows [q_h | k | v], K/V repeated
    for name, t in tensors.items():
        if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            q, k, v = t.split([HEADS * 8, 8, 8])
            tensors[name] = torch.cat([torch.cat([q_h, k, v]) for q_h in q.split(8)])
    save_file(tensors, mha / "model.safetensors", metadata={"format": "pt"})
    (mha / "config.json").write_text(json.dumps({**config, "multi_query": False, "num_key_value_heads": HEADS}))
    assert (outputs(mha) - outputs(mqa)).abs().max().item() <= 1e-5  # the MHA twin computes the same
    again = convert(mha, tmp_path / "again", kv_heads=1, method="mean", progress=False)
    assert json.loads((again / "config.json").read_text())["multi_query"] is True
    assert (outputs(again) - outputs(mqa)).abs().max().item() <= 1e-5
    with pytest.raises(BadInput, match="multi-query attention .* or none"):
        convert(mha, tmp_path / "two", kv_heads=2, method="mean", progress=False)


def test_already_gqa_source_converts_further(tmp_path: Path) -> None:
    src = make_checkpoint("llama", tmp_path / "src", num_key_value_heads=4)
    src = with_identical_heads(src, tmp_path / "same", 2)
    out = convert(src, tmp_path / "out", kv_heads=2, method="mean", progress=False)
    manifest = json.loads((out / "headfold.json").read_text())
    assert manifest["conversion"]["source_kv_heads_of_kv_head"] == [[0, 1], [2, 3]]
    assert (outputs(src) - outputs(out)).abs().max().item() <= 1e-5


def test_manifest_and_copied_files(tiny_checkpoint, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    original = tiny_checkpoint("gpt2")
    for f in original.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "tokenizer.json").write_text('{"tokenizer": true}')
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text("{}")
    (src / "pytorch_model.bin").write_bytes(b"stale MHA pickle")
    out = convert(src, tmp_path / "out", kv_heads=2, method="mean", progress=False)
    manifest = json.loads((out / "headfold.json").read_text())
    assert (out / "tokenizer.json").read_text() == '{"tokenizer": true}'
    assert (out / "1_Pooling" / "config.json").is_file()
    assert not (out / "pytorch_model.bin").exists()
    assert manifest["skipped_weight_files"] == ["pytorch_model.bin"]
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"headfold.json"}
    assert set(manifest["files"]) == written
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    conversion = manifest["conversion"]
    assert conversion["kv_head_of_query_head"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (conversion["method"], conversion["kv_heads"], conversion["group_size"]) == ("mean", 2, 4)
    assert manifest["source"]["family"] == "gpt2" and manifest["loader"] == "headfold.load_model"
    assert {"torch", "transformers", "safetensors", "python"} <= set(manifest["versions"])


def test_chained_conversion_records_its_parent(tiny_checkpoint, tmp_path: Path) -> None:
    first = convert(tiny_checkpoint("llama"), tmp_path / "four", kv_heads=4, method="mean", progress=False)
    second = convert(first, tmp_path / "one", kv_heads=1, method="mean", progress=False)
    manifest = json.loads((second / "headfold.json").read_text())
    assert manifest["source"]["kv_heads"] == 4
    assert manifest["source"]["manifest"]["conversion"]["kv_heads"] == 4


@pytest.mark.parametrize("family", sorted(ENCODERS))
def test_encoder_output_shape(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    out = convert(tiny_checkpoint(family), tmp_path / "out", kv_heads=1, method="mean", progress=False)
    assert outputs(out).shape == outputs(tiny_checkpoint(family)).shape


def test_convert_says_what_loads_the_output(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    """The last line names the loader when plain transformers cannot load the output (nothing more otherwise)."""
    from headfold.cli import main

    cases = [
        ("gpt2", "2", "transformers has no grouped-query gpt2"),
        ("llama", "4,2", "its layers have different kv-head counts"),
        ("llama", "2", None),
        ("gpt2", "1", None),  # written as gpt_bigcode
    ]
    for family, kv, why in cases:
        out = tmp_path / f"{family}-{kv}"
        assert main(["convert", str(tiny_checkpoint(family)), str(out), "--kv-heads", kv, "-q"]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        expected = f"plain transformers cannot load {out} ({why}): load it with headfold.load_model" if why else f"wrote {out} ("
        assert last.startswith(expected), last
