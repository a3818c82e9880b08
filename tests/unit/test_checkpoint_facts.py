"""CheckpointFacts: the one reader of a checkpoint's config and tensor headers.

Every fact equals what transformers and safetensors themselves read from the same folder, for
every family; the same fault gives the same message through every stage that reads a checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from support.tiny_models import FAMILIES, make_checkpoint

from headfold.converter.checkpoint import CheckpointFacts, SourceCheckpoint
from headfold.converter.modeling import load_model
from headfold.ground.errors import BadInput
from headfold.ground.precision import Precision


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _copy(tiny_checkpoint, family: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint(family), tmp_path / family))


@pytest.mark.parametrize("family", FAMILIES)
def test_facts_equal_what_transformers_reads(family: str, tiny_checkpoint) -> None:
    folder = tiny_checkpoint(family)
    facts = CheckpointFacts.read(folder)
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    heads = config.num_attention_heads
    assert facts.spec is not None and family in facts.spec.model_types
    assert (facts.layers, facts.heads, facts.hidden) == (config.num_hidden_layers, heads, config.hidden_size)
    assert facts.kv_heads == ((getattr(config, "num_key_value_heads", None) or heads),) * config.num_hidden_layers
    assert facts.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // heads)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)  # bloom (ALiBi): none
    assert facts.positions == positions
    assert facts.position_limit == (positions - 2 if positions else None)
    assert facts.vocab_size == config.vocab_size
    assert facts.dtype == torch.float32 and facts.tokenizer is None


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_tensor_index_offsets_read_the_stored_tensors(family: str, tiny_checkpoint) -> None:
    """The index's dtype, shape and byte offset give back every tensor bit for bit."""
    facts = CheckpointFacts.read(tiny_checkpoint(family))
    index = facts.tensor_index()
    assert index is facts.tensor_index()  # read once
    stored = load_file(index.files[0])
    with safe_open(index.files[0], framework="pt") as f:
        assert set(index.tensors) == set(f.keys())
    for name, info in index.tensors.items():
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            raw = bytearray(f.read(info.nbytes))
        tensor = torch.frombuffer(raw, dtype=info.dtype).reshape(info.shape)
        assert torch.equal(tensor, stored[name]), name


@pytest.mark.parametrize(
    "family, dims, fraction",
    [("llama", 8, 1.0), ("qwen3", 8, 1.0), ("gpt_neox", 4, 0.5), ("gpt2", 0, 0.0), ("bert", 0, 0.0), ("phi", 4, 0.5), ("gptj", 4, 0.5), ("bloom", 0, 0.0)],
)
def test_rotary_dims_and_fraction(family: str, dims: int, fraction: float, tiny_checkpoint) -> None:
    rotary = CheckpointFacts.read(tiny_checkpoint(family)).rotary
    assert (rotary.dims, rotary.fraction) == (dims, fraction)


def test_rope_theta_from_either_place(tiny_checkpoint, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint, "llama", tmp_path)
    _edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, rope_theta=None)
    assert CheckpointFacts.read(folder).rotary.theta == 5000.0
    _edit_config(folder, rope_parameters=None, rope_scaling=None, rope_theta=123.0)
    assert CheckpointFacts.read(folder).rotary.theta == 123.0


def test_per_layer_kv_heads(tiny_checkpoint, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint, "llama", tmp_path)
    _edit_config(folder, num_key_value_heads=4, num_key_value_heads_per_layer=[4, 2])
    facts = CheckpointFacts.read(folder)
    assert facts.kv_heads == (4, 2)
    assert [s.kv_heads for s in facts.layer_shapes] == [4, 2] and facts.shape.kv_heads == 4


def test_dtype_and_tokenizer_location(tmp_path: Path) -> None:
    folder = make_checkpoint("gpt2", tmp_path / "gpt2", dtype=torch.bfloat16)
    assert CheckpointFacts.read(folder).dtype == torch.bfloat16
    (folder / "vocab.json").write_text("{}")  # a GPT-2 tokenizer: vocab.json + merges.txt
    (folder / "merges.txt").write_text("#version: 0.2\n")
    assert CheckpointFacts.read(folder).tokenizer == folder


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16, torch.float64))
def test_precision_is_the_dtype_from_pretrained_loads(dtype: torch.dtype, tmp_path: Path) -> None:
    """config.json's dtype, else the weights' own (as dtype="auto"); fp64 weights are fp32 to headfold."""
    folder = make_checkpoint("gpt2", tmp_path / "gpt2", dtype=dtype)
    loaded = load_model(folder).dtype
    expected = Precision.of(loaded) or Precision.FP32
    assert CheckpointFacts.read(folder).precision is expected
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config))
    assert load_model(folder).dtype == loaded and CheckpointFacts.read(folder).precision is expected


READERS = {
    "facts": CheckpointFacts.read,
    "tensor index": lambda folder: CheckpointFacts.read(folder).tensor_index(),
    "convert": SourceCheckpoint,
    "load_model": load_model,
}


def _messages(folder: Path, readers: tuple[str, ...] = tuple(READERS)) -> set[str]:
    """The message each stage's reader gives for the same checkpoint fault."""
    found = set()
    for name in readers:
        with pytest.raises(BadInput) as err:
            READERS[name](folder)
        found.add(str(err.value))
    return found


def test_one_message_for_impossible_kv_heads(tiny_checkpoint, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint, "bert", tmp_path)
    _edit_config(folder, num_key_value_heads=3)
    assert _messages(folder) == {"config.json: num_key_value_heads=3 must divide num_attention_heads=8; fix config.json"}


@pytest.mark.parametrize("fault, words", [("truncated", "truncated"), ("missing", "no model.safetensors")])
def test_one_message_for_broken_weights(fault: str, words: str, tiny_checkpoint, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint, "opt", tmp_path)
    weights = folder / "model.safetensors"
    if fault == "truncated":
        weights.write_bytes(weights.read_bytes()[:-7])
    else:
        weights.unlink()
    CheckpointFacts.read(folder)  # the config's facts need no weights
    (message,) = _messages(folder, ("tensor index", "convert", "load_model"))
    assert words in message


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_load_model_takes_the_facts_a_stage_holds(family: str, tiny_checkpoint) -> None:
    """convert's facts (and their tensor index) serve load_model: the same model as from the folder."""
    folder = tiny_checkpoint(family)
    facts = SourceCheckpoint(folder).facts
    from_facts, from_folder = load_model(facts).state_dict(), load_model(folder).state_dict()
    assert from_facts.keys() == from_folder.keys()
    assert all(torch.equal(from_facts[name], from_folder[name]) for name in from_folder)


def _cache_bytes(cache) -> int:
    """Bytes a transformers cache holds (keys and values of every layer)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_cache_bytes_per_token_are_what_transformers_caches(family: str, tiny_checkpoint) -> None:
    """A decoder's cache after 3 tokens holds 3 × "self"; an encoder-decoder's self cache 3 target tokens
    × "self" and its cross cache 5 source tokens × "cross"."""
    folder = tiny_checkpoint(family)
    facts, model = CheckpointFacts.read(folder), load_model(folder)
    per_token = facts.cache_bytes_per_token(facts.precision.itemsize)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        if family == "t5":
            cache = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), decoder_input_ids=ids, use_cache=True).past_key_values
            assert (_cache_bytes(cache.self_attention_cache), _cache_bytes(cache.cross_attention_cache)) == (3 * per_token["self"], 5 * per_token["cross"])
        else:
            assert _cache_bytes(model(input_ids=ids, use_cache=True).past_key_values) == 3 * per_token["self"]
            assert per_token.keys() == {"self"}
