"""The merged export folder in the real onnxruntime-genai client (CPU): greedy tokens equal torch's.

Batch 1 and batch 4 with prompts of different lengths (right-padded, as og.Tokenizer pads and as og
feeds them: its own input log shows it), for the default folder (GroupQueryAttention with shared K/V
buffers) of the embedded model at kv 4 (rotary inside the op, packed Q/K/V), a per-layer plan
(4,2,1,1) and every tiny decoder family fed token ids directly (BLOOM keeps the standard Attention);
the standard-Attention folder too. A multi-turn conversation (tokens appended after
a past) equals torch on the concatenated turns; og's own shape log shows the default graph writing
into one shared max-length K/V buffer. The embedded model's tokenizer files encode every text to its
UTF-8 bytes in transformers and og.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from support.ort_decoding import og_greedy
from support.tiny_models import DECODER_CASES, VOCAB

from headfold import convert, corpus
from headfold.converter.modeling import load_model
from headfold.graphs.export import export
from headfold.ground.artifacts import GENAI_CONFIG as CONFIG_FILE

og = pytest.importorskip("onnxruntime_genai")

DEFAULT = Path(__file__).resolve().parents[2] / "headfold" / "data" / "default_model"
NEW_TOKENS = 16
TEXT_PROMPTS = ['The "while" statement', "def f(x):\n    return", "A", "Lists are mutable sequences, typically"]


@pytest.fixture(scope="module")
def folders(tiny_checkpoint, tmp_path_factory):
    """folders(name, attention="auto") → (checkpoint, export folder), converted and exported once per module."""
    root = tmp_path_factory.mktemp("genai")
    sources = {
        "default-kv4": lambda: convert(DEFAULT, root / "default-kv4", 4, method="mean", progress=False),
        "default-4,2,1,1": lambda: convert(DEFAULT, root / "default-plan", (4, 2, 1, 1), method="mean", progress=False),
    }
    cache: dict[str, tuple[Path, Path]] = {}

    def get(name: str, attention: str = "auto") -> tuple[Path, Path]:
        """attention: "auto" (the default folder), or "onnx" (the standard Attention graph)."""
        if name not in cache:
            cache[name] = sources[name](), None
        key = f"{name}/{attention}"
        if key not in cache:
            checkpoint, folder = cache[name][0], root / f"{name}-{attention}-onnx".replace(",", "_")
            export(checkpoint, folder, attention=attention, progress=False)
            cache[key] = checkpoint, folder
        return cache[key]

    return get


def torch_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy generate on one unpadded prompt; stops at the model's EOS like og."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _assert_same_tokens(checkpoint: Path, folder: Path, prompts: list[list[int]]) -> None:
    model = load_model(checkpoint)
    expected = [torch_greedy(model, p, NEW_TOKENS) for p in prompts]
    for batch in ([prompts[0]], prompts):
        got = og_greedy(folder, batch, NEW_TOKENS)
        for want, row in zip(expected[: len(batch)], got, strict=True):
            assert len(want) > 0 and row[: len(want)] == want  # torch stops at EOS; og pads after it


def _tiny_prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, n).tolist() for n in (5, 9, 2, 7)]  # clear of pad/bos/eos (0, 1, 2)


# --- the model folder ------------------------------------------------------------------------------


def test_embedded_tokenizer_is_bytes_in_transformers_and_og(folders) -> None:
    from transformers import AutoTokenizer

    _, folder = folders("default-kv4")
    texts = [corpus.heldout_text(), corpus.train_text(), "héllo wörld ✓ 日本\n\t  x", " leading space", "Ā"]
    hf, og_tokenizer = AutoTokenizer.from_pretrained(DEFAULT, local_files_only=True), og.Tokenizer(og.Model(str(folder)))
    for text in texts:
        ids = list(text.encode("utf-8"))
        assert hf.encode(text, add_special_tokens=False) == ids and hf.decode(ids) == text
        assert list(og_tokenizer.encode(text)) == ids and og_tokenizer.decode(np.array(ids, dtype=np.int32)) == text


def test_model_folder_contents(folders) -> None:
    checkpoint, folder = folders("default-4,2,1,1")
    config = json.loads((folder / CONFIG_FILE).read_text())
    decoder = config["model"]["decoder"]
    assert decoder["filename"] == "model.onnx" and (decoder["num_attention_heads"], decoder["num_key_value_heads"]) == (8, 4)
    assert (decoder["head_size"], decoder["hidden_size"], decoder["num_hidden_layers"]) == (32, 256, 4)
    assert decoder["inputs"]["past_key_names"] == "past_key_values.%d.key" and decoder["outputs"]["present_value_names"] == "present.%d.value"
    assert {k: config["model"][k] for k in ("eos_token_id", "pad_token_id", "context_length")} == {"eos_token_id": 0, "pad_token_id": 0, "context_length": 512}
    assert config["search"]["past_present_share_buffer"] is True and config["search"]["do_sample"] is False
    summary = json.loads((folder / "export.json").read_text())
    assert summary["attention"] == summary["graphs"]["model.onnx"]["attention"] == "ort-gqa" and summary["optimize"] == "ort"
    assert summary["graphs"]["model.onnx"]["attention_kv_heads"] == [4, 2, 1, 1]
    assert (folder / "tokenizer.json").read_bytes() == (DEFAULT / "tokenizer.json").read_bytes()
    graph = onnx.load(folder / "model.onnx", load_external_data=False)
    past = {i.name: i.type.tensor_type.shape.dim[1].dim_value for i in graph.graph.input if i.name.startswith("past")}
    assert [past[f"past_key_values.{i}.key"] for i in range(4)] == [4, 2, 1, 1]  # og reads each layer's count here
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["export.json", CONFIG_FILE, "model.onnx", "model.onnx.data", "tokenizer.json", "tokenizer_config.json"]
    )


# --- greedy generation equals torch ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["auto", "onnx"])
def test_embedded_kv4_generates_torch_tokens(folders, attention: str) -> None:
    checkpoint, folder = folders("default-kv4", attention)
    share = json.loads((folder / CONFIG_FILE).read_text())["search"]["past_present_share_buffer"]
    assert share is (attention == "auto")
    if attention == "auto":  # head_dim 32: rotary inside GroupQueryAttention, Q/K/V packed
        fused = json.loads((folder / "export.json").read_text())["graphs"]["model.onnx"]["ort_fusions"]
        assert fused["RotaryIntoGroupQueryAttention"] == fused["PackedQKV"] == 4
    _assert_same_tokens(checkpoint, folder, [list(p.encode()) for p in TEXT_PROMPTS])


@pytest.mark.slow
def test_per_layer_plan_generates_torch_tokens(folders) -> None:
    checkpoint, folder = folders("default-4,2,1,1")
    _assert_same_tokens(checkpoint, folder, [list(p.encode()) for p in TEXT_PROMPTS])


@pytest.mark.slow
@pytest.mark.parametrize(("family", "kv"), DECODER_CASES)
def test_every_family_generates_torch_tokens(tiny_export, family: str, kv: int) -> None:
    """og runs the default folder (model type "decoder") of every decoder family: batch 1 and a
    right-padded batch 4, generated tokens after the pads. GroupQueryAttention with a shared buffer
    but for BLOOM, whose ALiBi keeps the standard Attention (ALiBi positions count real tokens only)."""
    checkpoint, folder = tiny_export(family, kv, graphs="merged")
    summary = json.loads((folder / "export.json").read_text())
    assert summary["attention"] == ("onnx" if family == "bloom" else "ort-gqa"), summary["graphs"]["model.onnx"]["attention_reason"]
    share = json.loads((folder / CONFIG_FILE).read_text())["search"]["past_present_share_buffer"]
    assert share is (summary["attention"] == "ort-gqa")
    _assert_same_tokens(checkpoint, folder, _tiny_prompts(VOCAB))


@pytest.mark.slow
def test_multi_turn_append_equals_torch(folders) -> None:
    """Turn 2 is appended after turn 1 and its answer (several new tokens after a past), in the
    shared K/V buffer of the ort-gqa graph (with --optimize ort: rotary inside GroupQueryAttention).

    og leaves the last generated token pending (in the sequence, not yet run); append_tokens feeds
    only the new tokens, so the pending one is rewound and fed first. With separate past/present
    buffers (the standard-Attention graph) og 0.18 can neither rewind nor append after generating:
    it sizes present by the mask, which counts the pending token (docs/deploying.md).
    """
    checkpoint, folder = folders("default-kv4")
    turns = [list(b'Q: what does "pass" do?\nA:'), list(b"\nQ: and a while loop?\nA:")]
    model = load_model(checkpoint)
    first = torch_greedy(model, turns[0], NEW_TOKENS)
    second = torch_greedy(model, turns[0] + first + turns[1], NEW_TOKENS)

    og_model = og.Model(str(folder))
    params = og.GeneratorParams(og_model)
    params.set_search_options(max_length=sum(map(len, turns)) + 2 * NEW_TOKENS, do_sample=False)
    generator = og.Generator(og_model, params)
    answers: list[list[int]] = []
    for turn in turns:
        if answers:  # the pending token, rewound and fed again with the new turn
            generator.rewind_to(len(generator.get_sequence(0)) - 1)
            turn = answers[-1][-1:] + turn
        generator.append_tokens(np.array([turn], dtype=np.int32))
        answer = []
        for _ in range(NEW_TOKENS):
            generator.generate_next_token()
            answer.append(int(generator.get_next_tokens()[0]))
        answers.append(answer)
    assert answers == [first, second]


def og_log(folder: Path, prompts: list[list[int]], max_length: int, capfd, **logged: bool) -> str:
    """og's own log (`logged`: og.set_log_options flags) of the prompt's run and two steps, colours stripped."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    og.set_log_options(enabled=True, **logged)
    try:
        generator.append_tokens(np.array(prompts, dtype=np.int32))
        generator.generate_next_token()
        generator.generate_next_token()
    finally:
        og.set_log_options(enabled=False, **dict.fromkeys(logged, False))
    captured = capfd.readouterr()
    return re.sub(r"\x1b\[[0-9;]*m", "", captured.out + captured.err)


@pytest.mark.slow
def test_ort_gqa_writes_into_one_shared_buffer(folders, capfd) -> None:
    """og's own log of output shapes: with past_present_share_buffer every present.{i} is the
    max_length buffer from the prompt on, i.e. GroupQueryAttention wrote in place (no Concat copy)."""
    _, folder = folders("default-kv4")
    log = og_log(folder, [list(b"def f(x):")], 40, capfd, model_output_shapes=True)
    shapes = re.findall(r"present\.0\.key ShapeDims\[ 4\]Shape\[ ([\d ]+) \]", log)
    assert len(shapes) == 2 and all(shape.split() == ["1", "4", "40", "32"] for shape in shapes)


def test_og_feeds_right_padded_prompts(folders, capfd) -> None:
    """What og feeds the graph (its own input log): a batch of prompts of different lengths right-padded
    with the pad id and masked, then each step's token with a one appended to the mask — the padding
    GroupQueryAttention's row lengths describe (ort_gqa)."""
    _, folder = folders("default-kv4")
    log = og_log(folder, [list(b"abcde"), list(b"abc") + [0, 0]], 12, capfd, model_input_values=True)
    masks = re.findall(r"Name: attention_mask ShapeDims\[ 2\]Shape\[ ([\d ]+) \].*?\nValues\[ ([\d .]+) \]", log)
    assert [(shape.split(), values.split()) for shape, values in masks] == [
        (["2", "5"], "1 1 1 1 1 1 1 1 0 0".split()),
        (["2", "6"], "1 1 1 1 1 ... 1 1 0 0 1".split()),  # og elides the middle of longer tensors
    ]
