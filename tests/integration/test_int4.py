"""`--dtype int4`: MatMul weights quantized by ONNX Runtime's MatMulNBits quantizer as they are streamed.

The int4 export equals the quantizer's own output for the fp32 export (every weight's bytes, and the
logits), for the default block 32 symmetric and a block 16 asymmetric setting, the tied GPT-2 head
included; it generates in onnxruntime-genai what that reference folder generates; verify gates its
loss (against the checkpoint or the fp32 export: the same numbers), refuses to compare it element by
element, and bad settings are one line each, nothing written.
"""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.ort_decoding import og_greedy, session
from support.tiny_models import VOCAB

from headfold import convert
from headfold.cli import main
from headfold.graphs.export import export
from headfold.ground.cache_names import PAST, is_cache
from headfold.ground.errors import BadInput
from headfold.verification import InputSpec, verify
from headfold.verification.decoding import past_from_present

DEFAULT = Path(__file__).resolve().parents[2] / "headfold" / "data" / "default_model"
SETTINGS = {"symmetric-32": {}, "asymmetric-16": {"int4_block_size": 16, "int4_symmetric": False}}


def quantizer_reference(fp32: Path, folder: Path, block_size: int = 32, symmetric: bool = True) -> Path:
    """The fp32 export folder with its model.onnx quantized by MatMulNBitsQuantizer itself (the builder's settings)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    shutil.copytree(fp32, folder, ignore=shutil.ignore_patterns("model.onnx*"))
    quantizer = MatMulNBitsQuantizer(onnx.load(fp32 / "model.onnx"), block_size=block_size, is_symmetric=symmetric, accuracy_level=4, bits=4)
    quantizer.process()
    onnx.save(quantizer.model.model, folder / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    return folder


def prompt_then_steps(graph: Path, steps: int = 4) -> np.ndarray:
    """Logits of a right-padded 2-row prompt, then `steps` greedy tokens, present fed back as past."""
    sess = session(graph)
    ids = np.random.default_rng(0).integers(3, VOCAB, (2, 7))
    mask = np.ones_like(ids)
    mask[1, 5:] = 0
    past = {i.name: np.zeros((2, i.shape[1], 0, i.shape[3]), np.float32) for i in sess.get_inputs() if is_cache(i.name, PAST)}
    names, logits = [o.name for o in sess.get_outputs()], []
    for _ in range(steps + 1):
        out = dict(zip(names, sess.run(None, {"input_ids": ids, "attention_mask": mask, **past}), strict=True))
        past = past_from_present(out)
        logits.append(out["logits"][:, -1])
        ids, mask = out["logits"][:, -1].argmax(-1)[:, None], np.concatenate([mask, np.ones_like(mask[:, :1])], axis=1)
    return np.stack(logits, axis=1)


@pytest.mark.parametrize(
    ("family", "kv", "setting"),
    [
        ("llama", 2, "symmetric-32"),
        pytest.param("llama", 2, "asymmetric-16", marks=pytest.mark.slow),
        pytest.param("gpt2", 1, "symmetric-32", marks=pytest.mark.slow),
    ],
)
def test_int4_export_equals_the_quantizers_own(tiny_export, tmp_path: Path, family: str, kv: int, setting: str) -> None:
    options = SETTINGS[setting]
    _, fp32 = tiny_export(family, kv, graphs="merged")
    _, int4 = tiny_export(family, kv, graphs="merged", dtype="int4", **options)
    reference = quantizer_reference(fp32, tmp_path / "reference", options.get("int4_block_size", 32), options.get("int4_symmetric", True))
    summary = json.loads((int4 / "export.json").read_text())
    assert summary["dtype"] == "int4" and summary["quantization"]["block_size"] == options.get("int4_block_size", 32)
    ours, theirs = onnx.load(int4 / "model.onnx"), onnx.load(reference / "model.onnx")
    count = lambda m: collections.Counter((n.domain, n.op_type) for n in m.graph.node)  # noqa: E731
    assert count(ours)[("com.microsoft", "MatMulNBits")] == sum(summary["graphs"]["model.onnx"]["int4"].values()) > 0
    if family != "gpt2":  # the quantizer leaves GPT-2's tied head (FusedMatMul x·Eᵀ) in fp32; headfold quantizes it too
        assert count(ours) == count(theirs)
        tensors = {t.name: onnx.numpy_helper.to_array(t) for t in theirs.graph.initializer}
        assert {t.name for t in ours.graph.initializer} == set(tensors)
        for tensor in ours.graph.initializer:
            assert np.array_equal(onnx.numpy_helper.to_array(tensor), tensors[tensor.name]), tensor.name
        np.testing.assert_array_equal(prompt_then_steps(int4 / "model.onnx"), prompt_then_steps(reference / "model.onnx"))
    else:
        assert summary["graphs"]["model.onnx"]["int4"]["FusedMatMulToMatMulNBits"] == 1
        assert not any(n.op_type == "FusedMatMul" for n in ours.graph.node)
        error = np.abs(prompt_then_steps(int4 / "model.onnx", 0) - prompt_then_steps(fp32 / "model.onnx", 0)).max()
        assert 0 < error < 0.5  # quantized, close to fp32
    share = 0.5 if family == "gpt2" else 0.35  # GPT-2's embedding tables (Gather: not quantized) are half its tiny weights
    assert (int4 / "model.onnx.data").stat().st_size < share * (fp32 / "model.onnx.data").stat().st_size


@pytest.mark.slow
def test_int4_folder_generates_in_onnxruntime_genai(tiny_export, tmp_path: Path) -> None:
    """og's greedy tokens from the int4 folder are the quantizer-reference folder's (batch 4, right-padded)."""
    _, fp32 = tiny_export("llama", 2, graphs="merged")
    _, int4 = tiny_export("llama", 2, graphs="merged", dtype="int4")
    reference = quantizer_reference(fp32, tmp_path / "reference")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 9, 2, 7)]
    assert og_greedy(int4, prompts, 16) == og_greedy(reference, prompts, 16)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory) -> dict[str, Path]:
    """The embedded trained model at kv 4: checkpoint, fp32 export and int4 export."""
    root = tmp_path_factory.mktemp("int4")
    checkpoint = convert(DEFAULT, root / "kv4", 4, method="mean", progress=False)
    export(checkpoint, root / "fp32", progress=False)
    export(checkpoint, root / "int4", dtype="int4", progress=False)
    return {"checkpoint": checkpoint, "fp32": root / "fp32", "int4": root / "int4"}


SPEC = InputSpec(window=128, max_rows=16, batch_size=8)


@pytest.mark.slow
def test_verify_gates_int4_by_its_loss(embedded, tmp_path: Path, capsys) -> None:
    """Checkpoint or fp32 export against the int4 export: a quantization-loss check (perplexity, KL,
    top-1 under the loss budgets), the same numbers from either reference (the fp32 export equals torch)."""
    by_torch, by_export = (verify(embedded[ref], embedded["int4"], inputs=SPEC).checks for ref in ("checkpoint", "fp32"))
    for (check,) in (by_torch, by_export):
        assert check.name == "quantization-loss" and check.kind == "loss" and check.budget["max_kl"] == 0.05
        assert 0 < check.metrics["kl"] < 0.1 and check.metrics["top1"] > 0.8, check.metrics
    assert by_torch[0].metrics["kl"] == pytest.approx(by_export[0].metrics["kl"], rel=1e-3)
    small = ["--window", "128", "--max-rows", "16", "--batch-size", "8"]
    capsys.readouterr()
    assert main(["verify", str(embedded["fp32"]), str(embedded["int4"]), *small, "--max-kl", "1e-5", "-q"]) == 1
    assert "quantization-loss: kl = " in capsys.readouterr().err
    assert main(["verify", str(embedded["checkpoint"]), str(embedded["int4"]), *small, "--check", "fidelity", "-q"]) == 2
    assert "compare them by their loss" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "int4", "int4_block_size": 48}, "--int4-block-size 48: MatMulNBits takes 16, 32, 64, 128, 256"),
        ({"int4_block_size": 32}, "set up --dtype int4; add it or drop them"),
        ({"dtype": "int4", "trt_version": "10.15", "graphs": "split"}, "MatMulNBits, which TensorRT cannot parse"),
    ],
)
def test_bad_int4_settings_are_refused(tiny_checkpoint, tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(BadInput, match=message):
        export(tiny_checkpoint("llama"), tmp_path / "out", progress=False, **options)
    with pytest.raises(BadInput, match="--dtype int4 is for decoders"):
        export(tiny_checkpoint("bert"), tmp_path / "out", dtype="int4", progress=False)
    assert not (tmp_path / "out").exists()


def test_run_refuses_int4_in_one_line(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    assert main(["run", str(tiny_checkpoint("llama")), str(tmp_path / "run"), "--kv-heads", "2", "--dtype", "int4", "-q"]) == 2
    assert "int4 weights are gated by their loss" in capsys.readouterr().err and not (tmp_path / "run").exists()
