"""mean and first over raw safetensors bytes (converter/rawpool.py, numpy) write exactly the
bytes of the torch path, for every dtype numpy cannot hold natively too (bf16), every fused
layout, biases and per-layer kv lists; and they run without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from headfold import convert
from headfold.converter import rawpool
from headfold.converter.checkpoint import SourceCheckpoint

# plain, q/k/v biases, fused blocks with biases (Conv1D: head axis 1), fused per-head groups
# with biases and partial rotary, fused blocks without biases, encoder with biases, biases
FAMILIES = ("llama", "qwen2", "gpt2", "gpt_neox", "phi3", "bert", "opt")
DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def both_paths(src: Path, tmp_path: Path, monkeypatch, **kwargs) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The output of a raw conversion and of the same conversion forced through torch."""
    raw = convert(src, tmp_path / "raw", progress=False, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(rawpool, "readable", lambda ckpt: False)
        torch_path = convert(src, tmp_path / "torch", progress=False, **kwargs)
    return folder_bytes(raw), folder_bytes(torch_path)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_mean_bytes_equal_the_torch_path(family: str, dtype: str, tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    src = tiny_checkpoint(family, dtype=DTYPES[dtype])
    raw, reference = both_paths(src, tmp_path, monkeypatch, kv_heads=2)
    assert raw == reference


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "bert"])
def test_first_bytes_equal_the_torch_path(family: str, tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    src = tiny_checkpoint(family, dtype=torch.bfloat16)
    raw, reference = both_paths(src, tmp_path, monkeypatch, kv_heads=4, method="first")
    assert raw == reference


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_per_layer_kv_lists_and_their_reconversion(family: str, tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    src = tiny_checkpoint(family, dtype=torch.bfloat16)
    raw, reference = both_paths(src, tmp_path / "a", monkeypatch, kv_heads=[2, 4])
    assert raw == reference
    per_layer = tmp_path / "a" / "raw"  # a source with per-layer kv heads (2 and 4), pooled again
    raw, reference = both_paths(per_layer, tmp_path / "b", monkeypatch, kv_heads=[1, 1])
    assert raw == reference


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_path_decodes_no_tensor(dtype: str, tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    """K/V are read as numpy arrays, everything else is a byte range the writer copies: the torch
    reader is never asked (so the tests above did compare the raw path with the torch one)."""

    def refuse(self, name):
        raise AssertionError(f"{name} was decoded")

    monkeypatch.setattr(SourceCheckpoint, "get", refuse)
    convert(tiny_checkpoint("gpt2", dtype=DTYPES[dtype]), tmp_path / "out", kv_heads=2, method="mean", progress=False)


def test_bf16_rounding_matches_torch_bit_for_bit() -> None:
    """Random fp32 bit patterns (all exponents, subnormals, ±inf, ties) → bf16 as torch casts."""
    gen = np.random.default_rng(0)
    bits = gen.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    bits[:4] = [0x7F800000, 0xFF800000, 0x3F808000, 0x3F818000]  # ±inf and two ties (round to even: down, up)
    values = bits.view(np.float32)
    values = values[~np.isnan(values)]
    expected = torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(rawpool.narrow(values, "BF16"), expected)
    assert np.array_equal(rawpool.widen(expected, "BF16"), torch.from_numpy(expected.view(np.int16)).view(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [2, 3, 8])
def test_group_means_match_torch(dtype: str, group: int) -> None:
    """Wide-ranging magnitudes, so any other order of additions would round differently."""
    gen = torch.Generator().manual_seed(group)
    heads = (torch.randn(4 * group, 8, 64, generator=gen) * torch.logspace(-6, 4, 64)).to(DTYPES[dtype])
    expected = heads.unflatten(0, (4, -1)).mean(1, dtype=torch.float32).to(DTYPES[dtype])
    as_bytes = lambda t: t.view(torch.int16).numpy().view(np.uint16) if dtype == "BF16" else t.numpy()  # noqa: E731
    assert rawpool.pool_heads(as_bytes(heads), 4, "mean", dtype).tobytes() == as_bytes(expected).tobytes()


def test_mean_conversion_imports_no_torch(tiny_checkpoint, tmp_path: Path) -> None:
    src, out = tiny_checkpoint("llama", dtype=torch.bfloat16), tmp_path / "out"
    code = (
        "import sys\n"
        "from headfold.converter import convert\n"
        f"convert({str(src)!r}, {str(out)!r}, kv_heads=2, method='mean', progress=False)\n"
        "loaded = [m for m in ('torch', 'transformers', 'onnx') if m in sys.modules]\n"
        "assert not loaded, f'a mean conversion imported {loaded}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (out / "model.safetensors").is_file()
