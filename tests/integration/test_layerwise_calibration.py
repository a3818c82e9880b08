"""Layer-by-layer calibration equals running the whole model (the previous calibration path, kept
here as the oracle) for every family, per-layer kv sources, encoders, partial rotary and the
memory-mapped activation store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.reading import read_tensors
from support.tiny_models import FAMILIES, VOCAB

from headfold import Calibration, convert
from headfold.converter import calibration, layerwise
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.modeling import load_model
from headfold.ground.errors import BadInput


def whole_model_inputs(folder: Path, batch: torch.Tensor) -> list[torch.Tensor]:
    """The oracle: the whole model loaded, hooks on every layer's Q (or fused QKV) projection."""
    with SourceCheckpoint(folder) as ckpt:
        spec, layers = ckpt.spec, ckpt.layers
    model = load_model(folder, dtype=torch.float32)
    projection = (spec.fused_qkv or spec.projections["q"]).weight.removesuffix(".weight")
    modules = dict(model.named_modules())
    captured: list[list[torch.Tensor]] = [[] for _ in range(layers)]
    for i in range(layers):
        name = next(n for n in modules if n.endswith(spec.layer_prefix.format(layer=i) + projection))
        modules[name].register_forward_hook(lambda m, args, out, i=i: captured[i].append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        for rows in batch.split(8):
            model(input_ids=rows)
    return [torch.cat(c) for c in captured]


def windows(count: int = 19, length: int = 16) -> torch.Tensor:
    """Three chunks of 8 windows, the last one short."""
    return torch.randint(3, VOCAB, (count, length), generator=torch.Generator().manual_seed(0))


def layerwise_inputs(folder: Path, batch: torch.Tensor) -> list[torch.Tensor]:
    with SourceCheckpoint(folder) as ckpt:
        return calibration.calibrate(ckpt, batch, progress=False)


def assert_equal_inputs(folder: Path) -> None:
    batch = windows()
    expected, got = whole_model_inputs(folder, batch), layerwise_inputs(folder, batch)
    assert len(got) == len(expected) == 2
    for layer, (x, y) in enumerate(zip(got, expected, strict=True)):
        assert x.shape == y.shape == (batch.numel(), y.shape[1])
        assert y.abs().max() > 0.1  # a real activation, not zeros
        diff = (x - y).abs().max().item()
        assert diff <= 1e-5, f"{folder.name} layer {layer}: {diff}"


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEADFOLD_DEVICE", "cpu")


@pytest.mark.parametrize("family", FAMILIES)
def test_equals_whole_model(family: str, tiny_checkpoint) -> None:
    assert_equal_inputs(tiny_checkpoint(family))


def test_partial_rotary(tiny_checkpoint) -> None:
    """phi3 with partial_rotary_factor (gpt_neox's rotary_pct = 0.5 is in the family test)."""
    assert_equal_inputs(tiny_checkpoint("phi3", partial_rotary_factor=0.5))


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_per_layer_kv_source(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    """A per-layer conversion, calibrated again (a chained conversion): each layer at its own kv heads."""
    source = convert(tiny_checkpoint(family), tmp_path / "per-layer", kv_heads=(4, 2), method="mean", progress=False)
    assert_equal_inputs(source)


def test_memory_mapped_store(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past HEADFOLD_CALIBRATION_RAM activations (and fitted tensors, in their dtype) live in unlinked memory-mapped
    files; same numbers."""
    monkeypatch.setenv(layerwise.RAM_VARIABLE, "1KB")
    store = layerwise.ActivationStore(layerwise.ram_limit())
    mapped = store.empty(300, 64)
    maps = Path("/proc/self/maps").read_text()
    assert store.in_ram == 0 and "headfold-calibration-" in maps and "(deleted)" in maps
    mapped[:] = 1.5
    assert mapped.sum().item() == 1.5 * 300 * 64
    weights = torch.randn(300, 64).to(torch.bfloat16)
    kept = store.keep(weights)  # local's fitted tensors wait in their own dtype: bf16 at half fp32's bytes
    assert kept.dtype == torch.bfloat16 and torch.equal(kept, weights) and store.in_ram == 0
    assert_equal_inputs(tiny_checkpoint("gpt_neox"))


def test_bad_ram_limit_is_one_line(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(layerwise.RAM_VARIABLE, "lots")
    with pytest.raises(BadInput, match="HEADFOLD_CALIBRATION_RAM='lots' is not a size"):
        convert(tiny_checkpoint("llama"), tmp_path / "out", kv_heads=2, method="aligned", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "bert"])
def test_conversion_equals_whole_model_calibration(family: str, tiny_checkpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """aligned+grouped+refit written from layer-by-layer calibration equals the same conversion
    calibrated on the whole model."""
    src = tiny_checkpoint(family, **({"max_position_embeddings": 256} if family == "bert" else {}))  # windows of 256 tokens
    text = "".join(chr(32 + i % 90) for i in range(4000))  # byte-level text: tiny models have no tokenizer
    (tmp_path / "calibration.txt").write_text(text)
    monkeypatch.setattr(calibration, "token_ids", lambda folder, text, vocab: [b % VOCAB for b in text.encode()])
    args = dict(kv_heads=2, method="aligned+grouped+refit", calibration=Calibration(tmp_path / "calibration.txt", tokens=512), progress=False)
    layer_by_layer = read_tensors(convert(src, tmp_path / "layerwise", **args))
    monkeypatch.setattr(calibration, "calibrate", lambda ckpt, batch, progress=True: whole_model_inputs(ckpt.folder, batch))
    whole = read_tensors(convert(src, tmp_path / "whole", **args))
    assert whole.keys() == layer_by_layer.keys()
    diff = max((whole[n].float() - layer_by_layer[n].float()).abs().max().item() for n in whole)
    assert diff <= 1e-5, f"{family}: {diff}"


def test_calibration_does_not_import_graphs() -> None:
    """weights → torch module sits below ONNX: calibrating never imports headfold.graphs (issue 11)."""
    code = "import sys, headfold.converter.calibration, headfold.converter.layerwise; print(sorted(m for m in sys.modules if m.startswith('headfold.graphs')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_on_the_gpu_equals_whole_model(family: str, tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer moved to the GPU, run there and freed: the same inputs as the CPU oracle, back on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch: layer-by-layer calibration on the GPU is not exercised")
    monkeypatch.setenv("HEADFOLD_DEVICE", "cuda")
    folder, batch = tiny_checkpoint(family), windows()
    expected, got = whole_model_inputs(folder, batch), layerwise_inputs(folder, batch)
    for layer, (x, y) in enumerate(zip(got, expected, strict=True)):
        assert x.device.type == "cpu" and x.shape == y.shape
        assert (x - y).abs().max().item() <= 1e-4, f"{family} layer {layer}"  # fp32 GEMMs, another summation order
