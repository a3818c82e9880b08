"""Bounded-memory export (graphs.weights): the hollow trace with streamed weights gives the graphs of an
export from a loaded model, bit for bit, for every family (encoder-decoders' encoder.onnx and
decoder.onnx included) and option; the default dtype is the checkpoint's; peak memory stays under
2 × the largest layer + 1 GB on a mid-size checkpoint, decoder and encoder-decoder."""

from __future__ import annotations

import collections
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers
from onnx import numpy_helper
from safetensors.torch import save_file
from support.ort_decoding import session
from support.synthetic import llama_checkpoint
from support.tiny_models import ENCODERS, HEADS, MERGED_CASES, SEQ2SEQ, sample_batch, seq2seq_batch, tiny_config

from headfold.cli import main
from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.modeling import load_model
from headfold.graphs import weights
from headfold.graphs.export import decoder_graphs, encoder_decoder_graphs, encoder_graphs, export, export_graph, positions_from_mask

ATOL = 1e-4  # as the export tests: ORT against torch in fp32
GB = 1 << 30
WIDE = {"head_dim": 16}  # ORT's GroupQueryAttention takes the rotary (and then packed QKV) on heads of 16

# gpt2, t5: tied embeddings; llama with --attention onnx: the standard merged graph (the default is GroupQueryAttention)
FAST = [("llama", 2, {}), ("llama", 2, {"attention": "onnx"}), ("gpt2", 1, {}), ("bert", 4, {}), ("t5", HEADS // 2, {})]
SLOW = [
    *[(family, kv, {}) for family, kv in [("mistral", 4), ("qwen2", 1), ("qwen3", 2), ("phi3", 2), ("gpt_neox", 2), ("opt", 2), ("roberta", 1), *MERGED_CASES]],
    ("llama", 2, {"graphs": "split"}),
    ("gpt2", 1, {"graphs": "split"}),
    ("llama", 2, {"attention": "onnx", "optimize": "ort"}),
    ("llama", 2, {"checkpoint": WIDE}),  # GroupQueryAttention with the rotary inside and packed QKV
    ("llama", 2, {"trt_version": "10.14", "graphs": "split"}),
    *[(family, kv, {}) for family in SEQ2SEQ for kv in (HEADS // 2, None) if (family, kv) != ("t5", HEADS // 2)],
]


def case_id(family: str, kv: int | None, options: dict) -> str:
    return "-".join([f"{family}-kv{kv or 'mha'}", *(str(v) for k, v in options.items() if k != "checkpoint")])


CASES = [pytest.param(*case, id=case_id(*case)) for case in FAST] + [pytest.param(*case, id=case_id(*case), marks=pytest.mark.slow) for case in SLOW]


def reference_export(
    checkpoint: Path, folder: Path, graphs: str = "merged", attention: str = "onnx", optimize: str | None = None, trt_version: str | None = None
) -> Path:
    """The graphs exported from the model loaded with its weights (the export before streaming);
    `attention` and `optimize` as the streamed export resolved them (its export.json)."""
    facts = CheckpointFacts.read(checkpoint)
    model = load_model(facts, dtype=facts.precision.torch_dtype)
    if facts.kind == "seq2seq":
        specs = encoder_decoder_graphs(model, facts)
    else:
        specs = decoder_graphs(model, facts.layers, graphs) if model.can_generate() else encoder_graphs(model)
    folder.mkdir()
    for spec in specs:
        export_graph(
            spec, folder, opset=23, kv_heads=facts.kv_heads, layers=facts.layers, attention=attention, trt_version=trt_version,
            ort_fusions=optimize == "ort", positions=facts.positions,
        )  # fmt: skip
    return folder


def graph_contents(path: Path) -> tuple[collections.Counter, dict[str, np.ndarray]]:
    """The graph's op types (counted) and its initializers by name."""
    model = onnx.load(path)
    return collections.Counter((n.domain, n.op_type) for n in model.graph.node), {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def assert_same_graphs(expected: Path, found: Path) -> None:
    names = sorted(p.name for p in expected.glob("*.onnx"))
    assert names == sorted(p.name for p in found.glob("*.onnx"))
    for name in names:
        (ops, tensors), (found_ops, found_tensors) = graph_contents(expected / name), graph_contents(found / name)
        assert found_ops == ops, f"{name}: op types differ"
        assert found_tensors.keys() == tensors.keys(), f"{name}: initializers differ"
        for key, value in tensors.items():
            assert found_tensors[key].dtype == value.dtype and np.array_equal(found_tensors[key], value), f"{name}: {key} differs"


def prompt_error(checkpoint: Path, graph: Path, padded: bool = True) -> float:
    """Max abs difference of the graph's prompt outputs (empty past) from torch's, over real tokens
    (`padded`: the last row padded)."""
    model = load_model(checkpoint)
    inputs = sample_batch(model.config, 3, 9, seed=9)
    if not padded:  # ort-gqa graphs take unpadded or right-padded rows only
        inputs = {"input_ids": inputs["input_ids"][:-1], "attention_mask": inputs["attention_mask"][:-1]}
    rows = len(inputs["input_ids"])
    feeds = {k: v.numpy() for k, v in inputs.items()}
    runner = session(graph)
    for i in runner.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((rows, i.shape[1], 0, i.shape[3]), np.float32)
        elif i.name == "token_type_ids":
            feeds[i.name] = np.zeros_like(feeds["input_ids"])
    ours = runner.run(None, feeds)[0]
    with torch.no_grad():
        if model.config.model_type in ENCODERS:
            expected = model(**inputs).last_hidden_state
        else:
            expected = model(**inputs, position_ids=positions_from_mask(inputs["attention_mask"])).logits
    valid = inputs["attention_mask"].bool().numpy()
    return float(np.abs(ours[valid] - expected.numpy()[valid]).max())


def seq2seq_error(checkpoint: Path, folder: Path) -> float:
    """Max abs difference from torch of encoder.onnx's hidden states and of decoder.onnx's prompt logits
    (empty self past, the encoder's cross K/V); the T5/BART source's last row is right-padded."""
    model = load_model(checkpoint)
    batch = seq2seq_batch(model.config, batch=3, target=6)
    source = {k: v.numpy() for k, v in batch.items() if k != "decoder_input_ids"}
    encoder, decoder = session(folder / "encoder.onnx"), session(folder / "decoder.onnx")
    hidden, *cross = encoder.run(None, source)
    feeds = {"input_ids": batch["decoder_input_ids"].numpy()}
    feeds |= {"encoder_attention_mask": source["attention_mask"]} if "attention_mask" in source else {}
    feeds |= dict(zip([o.name.replace("present.", "past_key_values.", 1) for o in encoder.get_outputs()[1:]], cross, strict=True))
    feeds |= {i.name: np.zeros((3, i.shape[1], 0, i.shape[3]), np.float32) for i in decoder.get_inputs() if ".decoder." in i.name}
    logits = decoder.run(["logits"], feeds)[0]
    with torch.no_grad():
        expected = model(**batch)
    hidden_error = np.abs(hidden - expected.encoder_last_hidden_state.numpy()).max()
    return float(max(hidden_error, np.abs(logits - expected.logits.numpy()).max()))


@pytest.mark.parametrize(("family", "kv", "options"), CASES)
def test_streamed_export_equals_the_loaded_models(tiny_export, tmp_path: Path, family: str, kv: int, options: dict) -> None:
    options = {"graphs": "merged", **options}
    checkpoint, folder = tiny_export(family, kv, **options)
    options.pop("checkpoint", None)
    summary = json.loads((folder / "export.json").read_text())
    resolved = {**options, "attention": summary["attention"], "optimize": summary["optimize"]}
    assert_same_graphs(reference_export(checkpoint, tmp_path / "reference", **resolved), folder)
    if family in SEQ2SEQ:
        assert seq2seq_error(checkpoint, folder) <= ATOL
        return
    graph = "model.onnx" if options["graphs"] == "merged" or family in ENCODERS else "prefill.onnx"
    if "trt_version" not in options:  # decomposed ops run in ORT too, but test_decompose covers them
        assert prompt_error(checkpoint, folder / graph, padded=summary["attention"] != "ort-gqa") <= ATOL


@pytest.mark.slow
def test_every_weight_streamed_keeps_the_numbers(tiny_export, tmp_path: Path, monkeypatch) -> None:
    """With every weight lazy (none small enough to read early), transposes and ORT's packed QKV are
    made at save time: same outputs as the export that folds small weights in memory."""
    options = {"graphs": "merged"}  # the default folder: GroupQueryAttention, ORT's fusions
    checkpoint, folder = tiny_export("llama", 2, checkpoint=WIDE, **options)
    monkeypatch.setattr(weights, "EAGER_ELEMENTS", 0)
    export(checkpoint, tmp_path / "lazy", progress=False, **options)
    summary = json.loads((tmp_path / "lazy" / "export.json").read_text())
    assert summary["graphs"]["model.onnx"]["ort_fusions"]["PackedQKV"] == 2  # per layer, from lazy Q, K and V
    ids = np.random.default_rng(0).integers(3, 160, (1, 9))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    runs = []
    for graph in (folder / "model.onnx", tmp_path / "lazy" / "model.onnx"):
        runner = session(graph)
        past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in runner.get_inputs() if i.name.startswith("past")}
        runs.append(runner.run(None, feeds | past)[0])
    np.testing.assert_allclose(runs[1], runs[0], atol=1e-6)


@pytest.mark.parametrize(("dtype", "code"), [(torch.float16, onnx.TensorProto.FLOAT16), (torch.bfloat16, onnx.TensorProto.BFLOAT16)])
def test_default_dtype_is_the_checkpoints(tiny_checkpoint, tmp_path: Path, dtype: torch.dtype, code: int) -> None:
    checkpoint = tiny_checkpoint("llama", dtype=dtype)
    summary = export(checkpoint, tmp_path / "onnx", attention="onnx", progress=False)  # the standard graph keeps RMSNormalization
    assert summary["dtype"] == {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    graph = onnx.load(tmp_path / "onnx" / "model.onnx", load_external_data=False).graph
    floats = {t.data_type for t in graph.initializer} - {onnx.TensorProto.INT64, onnx.TensorProto.BOOL}
    assert floats == {code, onnx.TensorProto.FLOAT}  # the rotary frequencies stay fp32, as transformers keeps them
    assert {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT} == {"model.model.rotary_emb.inv_freq"}
    norms = [n for n in graph.node if n.op_type == "RMSNormalization"]
    assert norms and all(onnx.helper.get_attribute_value(a) == 1 for n in norms for a in n.attribute if a.name == "stash_type")


# Not here: T5 in fp16, which from_pretrained loads with its `wo` weights fp32 (_keep_in_fp32_modules) and
# headfold's GQA-built models (the hollow one too) do not: the exports differ there, and ONNX Runtime cannot
# load the mixed one (a fused RMSNormalization of an fp32 input with an fp16 scale). BART in fp16, whose
# encoder layers branch on their activations being finite: torch.export cannot trace it, loaded or hollow.
@pytest.mark.parametrize(
    ("family", "dtype", "code"),
    [
        ("t5", torch.bfloat16, onnx.TensorProto.BFLOAT16),
        pytest.param("bart", torch.bfloat16, onnx.TensorProto.BFLOAT16, marks=pytest.mark.slow),
        pytest.param("whisper", torch.float16, onnx.TensorProto.FLOAT16, marks=pytest.mark.slow),
    ],
)
def test_seq2seq_default_dtype_is_the_checkpoints(tiny_checkpoint, tmp_path: Path, family: str, dtype: torch.dtype, code: int) -> None:
    """Both graphs' weights in the checkpoint's dtype (fp32 only for scalar constants), equal to the
    export of the model loaded in that dtype."""
    checkpoint = tiny_checkpoint(family, dtype=dtype)
    summary = export(checkpoint, tmp_path / "onnx", progress=False)
    assert summary["dtype"] == {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    for name in ("encoder.onnx", "decoder.onnx"):
        graph = onnx.load(tmp_path / "onnx" / name, load_external_data=False).graph
        tensors = {t.data_type for t in graph.initializer if len(t.dims) > 0} - {onnx.TensorProto.INT64, onnx.TensorProto.BOOL}
        assert tensors == {code}, name
    assert_same_graphs(reference_export(checkpoint, tmp_path / "reference"), tmp_path / "onnx")


def test_an_untraceable_dtype_is_refused_in_one_line(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    """fp16 BART: its encoder layers branch on their activations being finite, found while the hollow
    model runs for the example shapes; exit 2, the fix named, nothing written."""
    checkpoint = tiny_checkpoint("bart", dtype=torch.float16)
    capsys.readouterr()
    assert main(["export", str(checkpoint), str(tmp_path / "onnx"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "bart code branches on its activations' values in float16" in err and "another --dtype" in err
    assert not (tmp_path / "onnx").exists()


def test_dtype_option_overrides_the_checkpoints(tiny_checkpoint, tmp_path: Path) -> None:
    summary = export(tiny_checkpoint("llama", dtype=torch.float16), tmp_path / "onnx", dtype="fp32", progress=False)
    graph = onnx.load(tmp_path / "onnx" / "model.onnx", load_external_data=False).graph
    assert summary["dtype"] == "fp32" and {t.data_type for t in graph.initializer if t.name.endswith("weight")} == {onnx.TensorProto.FLOAT}


# The child's own peak from VmHWM: its ru_maxrss (resource, or the parent's RUSAGE_CHILDREN) starts
# from the forking parent's, and pytest's holds whatever the session built.
CHILD = """
import json, re, sys
from pathlib import Path
from headfold.graphs.export import export
export(sys.argv[1], sys.argv[2], progress=False, **({"dtype": sys.argv[3]} if len(sys.argv) > 3 else {}))
peak_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
print(json.dumps({"peak_rss_bytes": peak_kb * 1024}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [None, "int4"])
def test_peak_memory_is_bounded_by_the_largest_layer(tmp_path: Path, dtype: str | None) -> None:
    """A ~0.5 GB fp16 Llama layout (GQA) exported in a fresh process: peak RSS ≤ 2 × its largest
    tensor group (the embeddings, here) + 1 GB, the bound that holds whatever the model's size; in
    int4 too (each weight read in fp32, quantized and written, one at a time)."""
    sizes = llama_checkpoint(
        tmp_path / "checkpoint", hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000,
    )  # fmt: skip
    assert sizes["total_bytes"] > 0.45 * GB
    command = [sys.executable, "-c", CHILD, tmp_path / "checkpoint", tmp_path / "onnx", *([dtype] if dtype else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
    print(f"peak RSS {peak / GB:.2f} GB ({dtype or 'fp16'})")
    assert peak <= 2 * sizes["largest_group_bytes"] + GB, f"peak RSS {peak / GB:.2f} GB"
    data = (tmp_path / "onnx" / "model.onnx.data").stat().st_size
    if dtype is None:
        assert data >= sizes["total_bytes"]  # every weight, in fp16 (the source's dtype)
    else:  # 4 bits per MatMul weight (with a scale per 32) and the fp32 embeddings
        assert data < 0.6 * sizes["total_bytes"]


def synthetic_checkpoint(folder: Path, family: str, dtype: torch.dtype = torch.float16, **sizes) -> dict[str, int]:
    """A checkpoint of `family` (tiny_config with `sizes`) of random weights, written one shard per layer
    (and one for the rest) without ever building the model in memory; its total and largest shard's bytes."""
    config = tiny_config(family, **sizes)
    config.dtype = dtype
    with torch.device("meta"):
        shapes = getattr(transformers, config.architectures[0])(config)
    tied = set(shapes.all_tied_weights_keys)  # stored once, under their source's name
    groups: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, tensor in shapes.state_dict().items():
        if name not in tied:
            layer = re.match(r"(.*?\.\d+)\.", name)  # e.g. model.encoder.layers.3
            groups.setdefault(layer.group(1) if layer else "rest", {})[name] = tuple(tensor.shape)
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    generator, weight_map, group_bytes = torch.Generator().manual_seed(0), {}, []
    for i, group in enumerate(groups.values()):
        tensors = {n: (torch.randn(shape, generator=generator) * 0.02).to(dtype) for n, shape in group.items()}
        save_file(tensors, folder / f"model-{i:05d}.safetensors", metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, f"model-{i:05d}.safetensors")
        group_bytes.append(sum(t.nbytes for t in tensors.values()))
    index = {"metadata": {"total_size": sum(group_bytes)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return {"total_bytes": sum(group_bytes), "largest_group_bytes": max(group_bytes)}


@pytest.mark.slow
def test_seq2seq_peak_memory_is_bounded_by_the_largest_layer(tmp_path: Path) -> None:
    """A ~0.75 GB bf16 BART layout (bf16: fp16 BART does not trace, see above) exported to encoder.onnx and
    decoder.onnx in a fresh process: peak RSS ≤ 2 × its largest tensor group (the shared embeddings with
    the rest, here) + 1 GB. Large enough that the export of the loaded model would exceed it."""
    sizes = synthetic_checkpoint(
        tmp_path / "checkpoint", "bart", torch.bfloat16, vocab_size=32000, d_model=1024, encoder_layers=12, decoder_layers=12,
        encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096, max_position_embeddings=1024,
    )  # fmt: skip
    assert sizes["total_bytes"] > 0.7 * GB
    done = subprocess.run([sys.executable, "-c", CHILD, tmp_path / "checkpoint", tmp_path / "onnx"], capture_output=True, text=True, check=True)
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
    assert peak <= 2 * sizes["largest_group_bytes"] + GB, f"peak RSS {peak / GB:.2f} GB"
    data = sum((tmp_path / "onnx" / f"{name}.onnx.data").stat().st_size for name in ("encoder", "decoder"))
    assert data >= sizes["total_bytes"]  # every weight, in bf16 (the source's dtype); the embeddings in both


def test_run_exports_a_bf16_checkpoint_in_fp32_for_its_cpu_verify(tiny_checkpoint, caplog) -> None:
    from headfold.pipeline import verifiable_dtype

    with caplog.at_level("INFO", logger="headfold"):  # an earlier CLI run in this worker may have set it to -q's WARNING
        assert verifiable_dtype(tiny_checkpoint("llama", dtype=torch.bfloat16)) == "fp32"
    assert "the checkpoint is bf16: run exports fp32" in caplog.text
    assert verifiable_dtype(tiny_checkpoint("llama", dtype=torch.float16)) == "fp16"
