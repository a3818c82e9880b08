"""Encoder-decoders (T5, BART, Whisper): conversion exactness per attention kind, loading with GQA
self- and cross-attention, generate() with the EncoderDecoderCache, the manifest's cache bytes, and
one-line refusals (export: test_export_seq2seq; verify and run: test_verify_seq2seq)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.checkpoint_edits import edit_attention, identical_heads
from support.commands import refused
from support.reading import distilled, read_tensors
from support.tiny_models import BYTES, HEADS, SEQ2SEQ, seq2seq_batch

from headfold import Calibration, convert
from headfold.cli import main
from headfold.converter.modeling import load_model
from headfold.converter.seq2seq import POOL_CHOICES
from headfold.ground.errors import BadInput

KIND_PATHS = {  # family → attention kind → a module path piece only that kind's tensors have
    "t5": {"encoder_self": "encoder.block", "decoder_self": "layer.0.SelfAttention", "decoder_cross": "EncDecAttention"},
    "bart": {"encoder_self": "encoder.layers", "decoder_self": "decoder.layers.{}.self_attn", "decoder_cross": "encoder_attn"},
    "whisper": {"encoder_self": "encoder.layers", "decoder_self": "decoder.layers.{}.self_attn", "decoder_cross": "encoder_attn"},
}
KV_SUFFIXES = (".k.weight", ".v.weight", "k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")


def kind_of(family: str, name: str) -> str | None:
    """The attention kind a tensor belongs to (None: not an attention tensor)."""
    if "attn" not in name.lower() and "Attention" not in name:
        return None
    if name.startswith(("encoder.", "model.encoder.")):
        return "encoder_self"
    return "decoder_cross" if KIND_PATHS[family]["decoder_cross"] in name else "decoder_self"


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(**seq2seq_batch(model.config, batch=3)).logits


FAST = dict(seq_len=32, batch_size=2, eval_windows=2, progress=False)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from headfold import corpus

    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(corpus.train_text()[:60_000])
    return path


@pytest.fixture(scope="module")
def identical(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """identical(family, group) → a copy of the tiny model whose K/V heads are equal inside each group of `group`, in every attention."""
    cache: dict[tuple[str, int], Path] = {}

    def get(family: str, group: int) -> Path:
        if (family, group) not in cache:
            cache[family, group] = edit_attention(tiny_checkpoint(family), tmp_path_factory.mktemp(f"{family}-same{group}") / "src", identical_heads(group))
        return cache[family, group]

    return get


@pytest.mark.parametrize("family", SEQ2SEQ)
def test_identity_is_byte_identical(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint(family)
    out = convert(src, tmp_path / "out", kv_heads=HEADS, method="aligned+refit", pool="all", progress=False)
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert torch.equal(logits(load_model(src)), logits(load_model(out)))


@pytest.mark.parametrize("pool", ["decoder", "self", "cross", "all"])
@pytest.mark.parametrize("family", SEQ2SEQ)
def test_identical_heads_are_lossless(family: str, pool: str, identical, tmp_path: Path) -> None:
    src = identical(family, 4)
    out = convert(src, tmp_path / "out", kv_heads=2, method="mean", pool=pool, progress=False)
    kinds = json.loads((out / "config.json").read_text())["num_key_value_heads_per_attention"]
    assert kinds == {kind: 2 if kind in POOL_CHOICES[pool] else HEADS for kind in kinds}
    diff = (logits(load_model(src)) - logits(load_model(out))).abs().max().item()
    assert diff <= 1e-5, f"{family} --pool {pool}: max abs diff {diff}"


@pytest.mark.parametrize("family", SEQ2SEQ)
def test_only_the_pooled_kinds_change(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    """--pool cross: the cross-attention K/V are the mean of each group; every other tensor is byte-identical."""
    src = tiny_checkpoint(family)
    out = convert(src, tmp_path / "out", kv_heads=2, method="mean", pool="cross", progress=False)
    before, after = read_tensors(src), read_tensors(out)
    changed = [n for n in before if kind_of(family, n) == "decoder_cross" and n.endswith(KV_SUFFIXES)]
    assert len(changed) == 2 * (3 if family == "whisper" else 4 if family == "bart" else 2)  # two layers; Whisper's K has no bias, T5 none
    for name, tensor in before.items():
        expected = tensor.reshape(2, HEADS // 2, -1, *tensor.shape[1:]).mean(1).reshape(-1, *tensor.shape[1:]) if name in changed else tensor
        torch.testing.assert_close(after[name], expected, rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("family", SEQ2SEQ)
def test_data_aware_default_on_the_weights_is_lossless_on_identical_heads(family: str, identical, tmp_path: Path) -> None:
    """On the weights alone; T5 leaves out grouped (its position bias is per query head)."""
    src = identical(family, 2)
    out = convert(src, tmp_path / "out", kv_heads=4, calibration="weights", progress=False)
    conversion = json.loads((out / "headfold.json").read_text())["conversion"]
    assert conversion["method"] == ("aligned+refit" if family == "t5" else "aligned+scored+refit")  # the default without local: no text
    assert conversion["calibration"]["text"] == "weights"
    diff = (logits(load_model(src)) - logits(load_model(out))).abs().max().item()
    assert diff <= 1e-4, f"{family}: max abs diff {diff}"


@pytest.mark.parametrize("family", SEQ2SEQ)
def test_calibration_runs_encoder_and_decoder(family: str, tiny_checkpoint, text_file: Path, tmp_path: Path) -> None:
    """T5 and BART calibrate on text (prefix → continuation), Whisper on synthesized log-mel features: the fits
    see every attention's K/V input, and identical heads stay lossless."""
    src = edit_attention(tiny_checkpoint(family, **({} if family == "whisper" else BYTES)), tmp_path / "src", identical_heads(2))
    calibration = None if family == "whisper" else text_file
    # the default method; its fit (local) for two steps only: this test is about what calibration reads
    out = convert(src, tmp_path / "out", kv_heads=4, calibration=Calibration(calibration, tokens=512), pool="all", local_steps=2, progress=False)
    recorded = json.loads((out / "headfold.json").read_text())["conversion"]["calibration"]["text"]
    assert recorded == ("synthesized log-mel features" if family == "whisper" else str(text_file))
    weights_only = convert(src, tmp_path / "weights", kv_heads=4, calibration="weights", pool="all", progress=False)
    assert (out / "model.safetensors").read_bytes() != (weights_only / "model.safetensors").read_bytes()  # the activations moved the fits
    diff = (logits(load_model(src)) - logits(load_model(out))).abs().max().item()
    assert diff <= 1e-4, f"{family}: max abs diff {diff}"


@pytest.mark.parametrize("family", SEQ2SEQ)
def test_generate_with_the_cache_equals_the_original(family: str, identical, tmp_path: Path) -> None:
    """Greedy generate() keeps the EncoderDecoderCache, its self and cross halves at kv heads, and the tokens of the original."""
    src = identical(family, 4)
    out = convert(src, tmp_path / "out", kv_heads=2, method="mean", progress=False)
    original, converted = load_model(src), load_model(out)
    batch = {k: v for k, v in seq2seq_batch(original.config).items() if k != "decoder_input_ids"}
    options = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    with torch.no_grad():
        expected, result = original.generate(**batch, **options), converted.generate(**batch, **options)
    assert torch.equal(expected.sequences, result.sequences)
    cache = result.past_key_values
    assert type(cache).__name__ == "EncoderDecoderCache"
    assert cache.self_attention_cache.layers[0].keys.shape[1] == 2
    assert cache.cross_attention_cache.layers[0].keys.shape[1] == 2
    assert expected.past_key_values.cross_attention_cache.layers[0].keys.shape[1] == HEADS


def test_manifest_reports_kinds_and_cache_bytes(tiny_checkpoint, tmp_path: Path) -> None:
    out = convert(tiny_checkpoint("bart"), tmp_path / "out", kv_heads=[2, 4], method="mean", pool="self", progress=False)
    conversion = json.loads((out / "headfold.json").read_text())["conversion"]
    assert conversion["attentions"] == {
        "encoder_self": {"heads": HEADS, "kv_heads": HEADS, "pooled": False},
        "decoder_self": {"heads": HEADS, "kv_heads": [2, 4], "pooled": True},
        "decoder_cross": {"heads": HEADS, "kv_heads": HEADS, "pooled": False},
    }
    per_head = 2 * 8 * 4  # K and V, head_dim 8, fp32
    assert conversion["cache_bytes_per_token"] == {
        "self": {"before": 2 * HEADS * per_head, "after": (2 + 4) * per_head},
        "cross": {"before": 2 * HEADS * per_head, "after": 2 * HEADS * per_head},
    }
    assert json.loads((out / "headfold.json").read_text())["loader"] == "headfold.load_model"


# -- refusals: one line, exit 2, nothing written -------------------------------------------------


def test_kv_count_that_does_not_divide_the_cross_attention(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    err = refused(["convert", str(tiny_checkpoint("t5")), str(tmp_path / "out"), "--kv-heads", "3", "--pool", "cross"], capsys)
    assert "--kv-heads 3 for decoder cross-attention is impossible" in err and "1, 2, 4, 8" in err
    assert not (tmp_path / "out").exists()


def test_an_encoder_given_to_the_seq2seq_path(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    err = refused(["convert", str(tiny_checkpoint("bert")), str(tmp_path / "out"), "--kv-heads", "2", "--pool", "cross"], capsys)
    assert "bert is an encoder" in err and "drop --pool" in err
    assert not (tmp_path / "out").exists()


def test_text_calibration_of_whisper_and_grouped_t5_are_refused(tiny_checkpoint, text_file: Path, tmp_path: Path, capsys) -> None:
    err = refused(["convert", str(tiny_checkpoint("whisper")), str(tmp_path / "out"), "--kv-heads", "2", "--calibration", str(text_file)], capsys)
    assert "calibrates on synthesized log-mel features, not on text" in err
    err = refused(["convert", str(tiny_checkpoint("t5")), str(tmp_path / "out"), "--kv-heads", "2", "--method", "grouped"], capsys)
    assert "relative attention bias belongs to each query head" in err
    assert not (tmp_path / "out").exists()


def test_inspect_reports_self_and_cross_cache_bytes(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    """inspect on an encoder-decoder: the decoder's cache bytes per token as it is and pooled to each candidate."""
    from headfold.inspection import inspect_checkpoint

    report = inspect_checkpoint(tiny_checkpoint("t5"), candidates="4,1", json_path=tmp_path / "report.json", progress=False)
    per_head = 2 * 2 * 8 * 4  # two decoder layers, K and V, d_kv 8, fp32
    assert report.cache_bytes_per_token == {
        4: {"self": {"before": HEADS * per_head, "after": 4 * per_head}, "cross": {"before": HEADS * per_head, "after": 4 * per_head}},
        1: {"self": {"before": HEADS * per_head, "after": per_head}, "cross": {"before": HEADS * per_head, "after": per_head}},
    }
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["cache_bytes_per_token"]["1"]["cross"]["after"] == per_head and written["attentions"]["decoder_cross"]["kv_heads"] == HEADS
    assert "no loss prediction for encoder-decoders yet" in report.table()
    assert "need the loss prediction" in refused(["inspect", str(tiny_checkpoint("t5")), "--kv-budget", "0.5"], capsys)


# -- distill: token-level KL of the decoder's logits, teacher-forced on prefix → continuation ------


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_distill_lowers_the_decoder_kl(family: str, tiny_checkpoint, text_file: Path, tmp_path: Path) -> None:
    from headfold.distillation import distill

    teacher = tiny_checkpoint(family, **BYTES)
    same = convert(teacher, tmp_path / "kv8", HEADS, method="mean", progress=False)
    out = distill(teacher, same, tmp_path / "same-out", data=text_file, steps=2, **FAST)
    assert distilled(out)["final_eval"]["kl"] < 1e-6 and distilled(out)["final_eval"]["top1"] == 1.0  # equal to its teacher: stays so
    assert read_tensors(out).keys() == read_tensors(same).keys() and all(torch.equal(read_tensors(same)[k], t) for k, t in read_tensors(out).items())
    student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
    out = distill(teacher, student, tmp_path / "out", data=text_file, steps=10, lr=1e-2, **FAST)
    first, final = distilled(out)["initial_eval"], distilled(out)["final_eval"]
    assert first["kl"] > 0 and final["kl"] < 0.7 * first["kl"], f"{family}: KL {first['kl']:.4g} → {final['kl']:.4g}"
    kinds = json.loads((out / "config.json").read_text())["num_key_value_heads_per_attention"]
    assert kinds == {"encoder_self": HEADS, "decoder_self": 2, "decoder_cross": 2}
    load_model(out)  # still a GQA encoder-decoder that headfold loads


@pytest.mark.parametrize("stated", [{"decoder_cross": 3}, {"decoder_cross": [4]}, {"cross": 4}, [4, 4]])
def test_bad_kv_heads_per_attention_in_config(stated, tiny_checkpoint, tmp_path: Path, capsys) -> None:
    """A converted config whose per-attention kv heads do not fit its heads or layers: one line before anything loads."""
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(convert(tiny_checkpoint("t5"), tmp_path / "out", kv_heads=4, method="mean", progress=False), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_key_value_heads_per_attention": stated}))
    with pytest.raises(BadInput, match="num_key_value_heads_per_attention"):
        load_model(folder)
    assert "num_key_value_heads_per_attention" in refused(["convert", str(folder), str(tmp_path / "again"), "--kv-heads", "2"], capsys)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """(source, target) rows of varied lengths: each paragraph of the corpus cut at a seeded point."""
    import random

    from headfold import corpus

    rng = random.Random(0)
    paragraphs = [p for p in corpus.train_text()[:60_000].split("\n") if len(p) > 8]
    rows = [(p[: (cut := rng.randrange(2, len(p) - 2))], p[cut:]) for p in paragraphs]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"source": s, "target": t}) + "\n" for s, t in rows))
    return path


def test_distill_on_source_target_pairs(tiny_checkpoint, pairs_file: Path, tmp_path: Path, capsys) -> None:
    """jsonl pairs: a window per pair, unfilled positions masked out of the encoder and the loss; the KL drops.
    A decoder given pairs is one line."""
    from headfold.distillation import distill
    from headfold.distillation.data import ABSENT, encoder_for, pair_window

    encoder = encoder_for(tiny_checkpoint("bart", **BYTES), 256, encoder_model=False)
    assert pair_window(("ab", "cde"), encoder, 8) == [97, 98, ABSENT, ABSENT, 99, 100, 101, ABSENT]
    assert pair_window(("abcdef", "ghijkl"), encoder, 6) == [97, 98, 99, 103, 104, 105]
    teacher = tiny_checkpoint("bart", **BYTES)
    student = convert(teacher, tmp_path / "kv2", 2, method="mean", progress=False)
    out = distill(teacher, student, tmp_path / "out", data=pairs_file, steps=10, lr=1e-2, **FAST)
    first, final = distilled(out)["initial_eval"], distilled(out)["final_eval"]
    assert first["kl"] > 0 and final["kl"] < 0.7 * first["kl"], f"KL {first['kl']:.4g} → {final['kl']:.4g}"
    assert distilled(out)["data"]["train"] == str(pairs_file)
    decoder = tiny_checkpoint("llama", **BYTES)
    decoder_student = convert(decoder, tmp_path / "llama-kv2", 2, method="mean", progress=False)
    err = refused(
        ["distill", str(decoder), str(decoder_student), str(tmp_path / "llama-out"), "--data", str(pairs_file), "--steps", "1", "--seq-len", "32"], capsys
    )
    assert "row 1 is a (source, target) pair, which only an encoder-decoder (T5, BART) reads" in err


def test_decoder_heads_other_than_the_encoders(tiny_checkpoint, tmp_path: Path) -> None:
    """BART with 8 encoder and 4 decoder heads (head dims 8 and 16): each attention converts, records and loads at its own shape."""
    src = tiny_checkpoint("bart", decoder_attention_heads=4)
    out = convert(src, tmp_path / "out", kv_heads=2, method="mean", progress=False)
    conversion = json.loads((out / "headfold.json").read_text())["conversion"]
    assert {k: (a["heads"], a["kv_heads"]) for k, a in conversion["attentions"].items()} == {
        "encoder_self": (8, 8),
        "decoder_self": (4, 2),
        "decoder_cross": (4, 2),
    }
    assert conversion["kv_head_of_query_head"][-1] == [0, 0, 1, 1]
    assert conversion["cache_bytes_per_token"]["cross"] == {"before": 2 * 2 * 4 * 16 * 4, "after": 2 * 2 * 2 * 16 * 4}
    original, converted = load_model(src), load_model(out)
    assert converted.model.decoder.layers[0].encoder_attn.k_proj.out_features == 2 * 16
    batch = {k: v for k, v in seq2seq_batch(original.config).items() if k != "decoder_input_ids"}
    assert converted.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False).shape == (2, 5)
    identity = convert(src, tmp_path / "identity", kv_heads=4, method="mean", progress=False)
    assert (identity / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert torch.equal(logits(original), logits(load_model(identity)))


@pytest.mark.parametrize("family", SEQ2SEQ)
def test_calibration_keeps_every_attentions_key_input(family: str, tiny_checkpoint, text_file: Path) -> None:
    """Rows per attention block: source tokens for the encoder and the cross-attention (the encoder output),
    target tokens for the decoder's self-attention; the cross-attention reads the encoder's last output."""
    from headfold import corpus
    from headfold.converter.calibration import seq2seq_inputs
    from headfold.converter.checkpoint import SourceCheckpoint

    with SourceCheckpoint(tiny_checkpoint(family, **({} if family == "whisper" else BYTES))) as ckpt:
        inputs = seq2seq_inputs(ckpt, corpus.train_text()[:60_000], 512, 0, progress=False)
        source, target = {"t5": (2 * 128, 2 * 128), "bart": (4 * 62, 4 * 62), "whisper": (10 * 16, 10 * 31)}[family]  # windows × tokens
        assert [len(x) for x in inputs] == [source, source, target, target, source, source]
        assert torch.equal(inputs[4], inputs[5])  # both cross-attentions read the same encoder output
        assert not torch.equal(inputs[0], inputs[4])


def test_convert_says_which_attentions_it_pooled(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    assert main(["convert", str(tiny_checkpoint("t5")), str(tmp_path / "out"), "--kv-heads", "2", "--method", "mean", "--pool", "cross", "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"wrote {tmp_path / 'out'} (2 kv heads in decoder cross-attention, method mean)",
        f"plain transformers cannot load {tmp_path / 'out'} (transformers has no grouped-query t5): load it with headfold.load_model",
    ]
