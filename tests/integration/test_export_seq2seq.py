"""Encoder-decoder export (T5, BART, Whisper): encoder.onnx computes the cross-attention K/V once,
the merged decoder.onnx takes them with the self-attention past; ONNX Runtime equals torch for a
prompt and for teacher-forced steps after a past, converted (self + cross at h/2) and unconverted;
one fused Attention per attention block at its kv heads; options without a seq2seq graph refused;
a Whisper folder that onnxruntime-genai runs, logits equal to torch's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.ort_decoding import session
from support.tiny_models import HEADS, SEQ2SEQ, seq2seq_batch

from headfold import convert
from headfold.cli import main
from headfold.converter.modeling import load_model
from headfold.graphs import rewrite
from headfold.graphs.export import export
from headfold.ground.errors import BadInput, CheckFailed

ATOL = 1e-4
LAYERS = 2
STEPS = (2, 1, 3)  # teacher-forced target chunks: a prompt of 2, one token, an append of 3 (all 6)
KV = HEADS // 2


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory):
    """exported(family, kv) → (checkpoint, export folder); kv None: the source as it is (MHA)."""
    cache: dict[tuple[str, int | None], tuple[Path, Path]] = {}

    def get(family: str, kv: int | None) -> tuple[Path, Path]:
        if (family, kv) not in cache:
            folder = tmp_path_factory.mktemp(f"{family}-kv{kv or 'mha'}-seq2seq")
            checkpoint = tiny_checkpoint(family)
            if kv is not None:
                checkpoint = convert(checkpoint, folder / "checkpoint", kv, method="mean", progress=False)
            export(checkpoint, folder / "onnx", progress=False)
            cache[family, kv] = checkpoint, folder / "onnx"
        return cache[family, kv]

    return get


def run_steps(folder: Path, source: dict[str, np.ndarray], target: np.ndarray, steps) -> np.ndarray:
    """The encoder once, then the target chunk by chunk through decoder.onnx (the first with an empty
    self past), present fed back as past and the encoder's cross K/V fed every step."""
    encoder, decoder = session(folder / "encoder.onnx"), session(folder / "decoder.onnx")
    encoded = dict(zip([o.name for o in encoder.get_outputs()], encoder.run(None, source), strict=True))
    cross = {name.replace("present.", "past_key_values.", 1): v for name, v in encoded.items() if name.startswith("present.")}
    past = {
        i.name: np.zeros((len(target), i.shape[1], 0, i.shape[3]), np.float32)
        for i in decoder.get_inputs() if i.name.endswith(("decoder.key", "decoder.value"))
    }  # fmt: skip
    mask = {"encoder_attention_mask": source["attention_mask"]} if "attention_mask" in source else {}
    names, logits, start = [o.name for o in decoder.get_outputs()], [], 0
    for n in steps:
        out = dict(zip(names, decoder.run(None, {"input_ids": target[:, start : start + n], **mask, **past, **cross}), strict=True))
        logits.append(out.pop("logits"))
        past = {name.replace("present.", "past_key_values.", 1): v for name, v in out.items()}
        start += n
    return np.concatenate(logits, axis=1)


@pytest.mark.parametrize("kv", [KV, None], ids=["kv-h2", "mha"])
@pytest.mark.parametrize("family", SEQ2SEQ)
def test_onnx_runtime_equals_torch_for_prompt_and_steps(family: str, kv: int | None, exported) -> None:
    checkpoint, folder = exported(family, kv)
    model = load_model(checkpoint)
    batch = seq2seq_batch(model.config, batch=3, target=sum(STEPS))  # the T5/BART source's last row is padded
    with torch.no_grad():
        expected = model(**batch).logits.numpy()
    source = {k: v.numpy() for k, v in batch.items() if k != "decoder_input_ids"}
    target = batch["decoder_input_ids"].numpy()
    prompt = run_steps(folder, source, target, (sum(STEPS),))
    stepped = run_steps(folder, source, target, STEPS)
    assert np.abs(prompt - expected).max() < ATOL
    assert np.abs(stepped - expected).max() < ATOL


@pytest.mark.parametrize("family", SEQ2SEQ)
def test_one_fused_attention_per_block_at_its_kv_heads(family: str, exported) -> None:
    _, folder = exported(family, KV)
    summary = json.loads((folder / "export.json").read_text())
    assert summary["layout"] == "seq2seq"
    assert summary["kv_heads"] == [HEADS] * LAYERS + [KV] * 2 * LAYERS  # encoder self kept; decoder self + cross pooled
    assert summary["graphs"]["encoder.onnx"]["attention_kv_heads"] == [HEADS] * LAYERS
    assert summary["graphs"]["decoder.onnx"]["attention_kv_heads"] == [KV] * 2 * LAYERS
    decoder = session(folder / "decoder.onnx")
    cross = [i.shape for i in decoder.get_inputs() if i.name.endswith("encoder.key")]
    assert len(cross) == LAYERS and all(shape[1] == KV for shape in cross)
    encoder_outputs = [o.name for o in session(folder / "encoder.onnx").get_outputs()]
    assert encoder_outputs[0] == "encoder_hidden_states" and len(encoder_outputs) == 1 + 2 * LAYERS


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"graphs": "split"}, "export writes encoder.onnx and one merged decoder.onnx; drop --graphs split"),
        ({"attention": "ort-gqa"}, "--attention ort-gqa is for decoders"),
        ({"optimize": "ort"}, "--optimize ort is for decoders and encoders"),
        ({"position_ids": True}, "position_ids is an input of decoder graphs"),
        ({"trt_version": "10.14", "graphs": "split"}, "--trt-version targets headfold build"),  # the CLI's layout for a TensorRT target
    ],
)
def test_options_without_a_seq2seq_graph_are_refused(options: dict, message: str, tiny_checkpoint, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=message.replace("+", r"\+")):
        export(tiny_checkpoint("t5"), tmp_path / "onnx", progress=False, **options)
    assert not (tmp_path / "onnx").exists()


@pytest.fixture(scope="module")
def whisper_30s(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Whisper of 1500 encoder positions (onnxruntime-genai's 3000 frames), self + cross at h/2, exported."""
    folder = tmp_path_factory.mktemp("whisper-30s")
    checkpoint = convert(tiny_checkpoint("whisper", max_source_positions=1500), folder / "checkpoint", KV, method="mean", progress=False)
    export(checkpoint, folder / "onnx", progress=False)
    return checkpoint, folder / "onnx"


def test_whisper_generates_in_onnxruntime_genai(whisper_30s) -> None:
    """og.Model runs the folder: its logits at every greedy step equal torch's, teacher-forced on og's tokens."""
    og = pytest.importorskip("onnxruntime_genai")
    checkpoint, folder = whisper_30s
    summary = json.loads((folder / "export.json").read_text())
    assert summary["genai"]["config"] == "genai_config.json"
    model = load_model(checkpoint)
    start = model.config.decoder_start_token_id
    features = torch.randn(1, model.config.num_mel_bins, 3000, generator=torch.Generator().manual_seed(0)) * 0.5
    runtime = og.Model(str(folder))
    generator = og.Generator(runtime, og.GeneratorParams(runtime))
    inputs = og.NamedTensors()
    inputs["input_features"] = features.numpy()
    generator.set_inputs(inputs)
    generator.append_tokens(np.array([[start]], dtype=np.int32))
    tokens, logits = [], []
    for _ in range(8):
        logits.append(np.array(generator.get_logits()).reshape(-1))  # what the next token is chosen from
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    with torch.no_grad():
        expected = model(input_features=features, decoder_input_ids=torch.tensor([[start, *tokens[:-1]]])).logits[0].numpy()
    assert np.abs(np.stack(logits) - expected).max() < ATOL
    assert tokens == expected.argmax(-1).tolist()


def test_genai_config_only_where_onnxruntime_genai_runs_it(exported) -> None:
    for family, why in [("whisper", "takes 3000 log-mel frames only"), ("t5", "runs Whisper among headfold's encoder-decoders only")]:
        _, folder = exported(family, KV)
        assert why in json.loads((folder / "export.json").read_text())["genai"]["not_written"]
        assert not (folder / "genai_config.json").exists()


def test_build_refuses_the_folder_in_one_line(exported, tmp_path: Path, capsys) -> None:
    _, folder = exported("bart", KV)
    capsys.readouterr()
    assert main(["build", str(folder), str(tmp_path / "engines"), "--dry-run", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds an encoder-decoder's graphs, which headfold builds no engines of" in err


@pytest.mark.parametrize(("family", "pool"), [("bart", "self"), ("t5", "cross")])
def test_self_and_cross_at_different_kv_heads(family: str, pool: str, tiny_checkpoint, tmp_path: Path) -> None:
    """Only one of the decoder's attentions pooled (to 2): each node is checked at its own block's count."""
    checkpoint = convert(tiny_checkpoint(family), tmp_path / "checkpoint", 2, method="mean", pool=pool, progress=False)
    export(checkpoint, tmp_path / "onnx", progress=False)
    decoder = session(tmp_path / "onnx" / "decoder.onnx")
    heads = {half: {i.shape[1] for i in decoder.get_inputs() if f".{half}.key" in i.name} for half in ("decoder", "encoder")}
    assert heads == ({"decoder": {2}, "encoder": {HEADS}} if pool == "self" else {"decoder": {HEADS}, "encoder": {2}})
    summary = json.loads((tmp_path / "onnx" / "export.json").read_text())
    assert sorted(summary["graphs"]["decoder.onnx"]["attention_kv_heads"]) == [2, 2, HEADS, HEADS]
    model = load_model(checkpoint)
    batch = seq2seq_batch(model.config, batch=3, target=sum(STEPS))
    with torch.no_grad():
        expected = model(**batch).logits.numpy()
    source = {k: v.numpy() for k, v in batch.items() if k != "decoder_input_ids"}
    assert np.abs(run_steps(tmp_path / "onnx", source, batch["decoder_input_ids"].numpy(), STEPS) - expected).max() < ATOL


def test_a_missing_fusion_names_the_attention_blocks(exported, monkeypatch, tmp_path: Path) -> None:
    """Without the repeat_kv rule the decoder's nodes keep MHA-shaped K/V: exit-1 error naming each block, no output."""
    checkpoint, _ = exported("t5", KV)
    monkeypatch.setattr(rewrite, "RULES", ())
    expected = (
        r"decoder.onnx \(decoder_self 0, decoder_self 1, decoder_cross 0, decoder_cross 1 in check order\): K/V heads ≠ 4 in layer\(s\) 0 \(8\), 2 "
        r"\(8\), 1 \(8\), 3 \(8\)"
    )
    with pytest.raises(CheckFailed, match=expected):
        export(checkpoint, tmp_path / "onnx", progress=False)
    assert not (tmp_path / "onnx").exists()
