"""Streamed weights (graphs.weights): the bytes StreamedWeight.tofile writes into .onnx.data are, bit for
bit, those of the tensor read, cast (Tensor.to) and permuted in memory, whichever way it goes (the kernel
copy, the reused buffers, a file object without a descriptor), and joined parts (packed QKV) are the
concatenation of the parts."""

from __future__ import annotations

import io
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
import torch
from safetensors.torch import save_file

from headfold.converter.checkpoint import read_tensor_index
from headfold.graphs.weights import StreamedWeight, joined, reused_buffers
from headfold.ground.errors import BadInput

IR_DTYPES = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16, torch.bfloat16: ir.DataType.BFLOAT16}
# (source dtype, shape, export dtype, permutation): a copy in the kernel, transposes (written in bands of
# rows, filled in tiles: one band, several, partial tiles), casts down and up with and without one, and a
# permutation of three axes.
CASES = [
    (torch.float16, (24, 40), torch.float16, None),
    (torch.float16, (24, 40), torch.float16, (1, 0)),
    (torch.float16, (300, 1000), torch.float16, (1, 0)),
    (torch.float32, (5000, 100), torch.float32, (1, 0)),
    (torch.bfloat16, (70, 130), torch.bfloat16, (1, 0)),
    (torch.float32, (40, 24), torch.float16, (1, 0)),
    (torch.bfloat16, (16, 8), torch.float32, (1, 0)),
    (torch.float32, (64,), torch.bfloat16, None),
    (torch.float32, (3, 4, 5), torch.float32, (2, 0, 1)),
]


def awkward(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values with the ones rounding and copying can get wrong: NaN, ±inf, -0, subnormals, huge."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).reshape(-1)
    values[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-41, 7e4])
    return values.reshape(shape).to(dtype)


def expected(tensor: torch.Tensor, dtype: torch.dtype, perm: tuple[int, ...] | None) -> bytes:
    cast = tensor.to(dtype)
    return (cast if perm is None else cast.permute(perm).contiguous()).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def checkpoint(tmp_path: Path):
    tensors = {f"t{i}": awkward(shape, source, seed=i) for i, (source, shape, *_) in enumerate(CASES)}
    tensors["q"], tensors["k"], tensors["v"] = (awkward((n, 8), torch.float16, seed=10 + n) for n in (12, 4, 4))
    save_file(tensors, tmp_path / "model.safetensors")
    return tensors, read_tensor_index(tmp_path, allow_pickle=False).tensors


def test_written_bytes_are_the_cast_and_permuted_values(checkpoint, tmp_path: Path) -> None:
    tensors, infos = checkpoint
    weights = [StreamedWeight([infos[f"t{i}"]], IR_DTYPES[dtype], perm, name=f"t{i}") for i, (_, _, dtype, perm) in enumerate(CASES)]
    order = [*weights, *reversed(weights)]  # larger weights before smaller ones: the reused buffers are sliced
    with open(tmp_path / "data", "wb") as f, reused_buffers():
        for weight in order:
            weight.tofile(f)
    written, start = (tmp_path / "data").read_bytes(), 0
    for weight in order:
        i = int(weight.name[1:])
        want = expected(tensors[weight.name], CASES[i][2], CASES[i][3])
        assert written[start : start + len(want)] == want, weight.name
        assert weight.numpy().tobytes() == want, weight.name  # read into new memory, as any lazy tensor
        start += len(want)
    assert start == len(written)


@pytest.mark.parametrize("reused", [True, False])
def test_a_file_object_without_a_descriptor_gets_the_same_bytes(checkpoint, reused: bool) -> None:
    tensors, infos = checkpoint
    for i, (_, _, dtype, perm) in enumerate(CASES):
        out = io.BytesIO()
        with reused_buffers() if reused else nullcontext():
            StreamedWeight([infos[f"t{i}"]], IR_DTYPES[dtype], perm, name=None).tofile(out)
        assert out.getvalue() == expected(tensors[f"t{i}"], dtype, perm)


def test_joined_parts_are_their_concatenation(checkpoint, tmp_path: Path) -> None:
    """Packed QKV: MatMul weights Wqᵀ | Wkᵀ | Wvᵀ side by side, read as the checkpoint's Q, K and V rows."""
    tensors, infos = checkpoint
    parts = [StreamedWeight([infos[n]], ir.DataType.FLOAT16, (1, 0), name=n) for n in "qkv"]
    packed = joined(parts, axis=1)
    want = np.concatenate([tensors[n].numpy().T for n in "qkv"], axis=1)
    assert packed is not None and tuple(packed.shape) == want.shape
    with open(tmp_path / "data", "wb") as f, reused_buffers():
        packed.tofile(f)
    assert (tmp_path / "data").read_bytes() == want.tobytes() == packed.numpy().tobytes()
    assert joined(parts, axis=0) is None  # not along the checkpoint tensors' rows
    assert joined([parts[0], StreamedWeight([infos["k"]], ir.DataType.FLOAT, (1, 0), name="k")], axis=1) is None
    assert joined([parts[0], ir.tensor(want)], axis=1) is None


def test_a_checkpoint_cut_short_after_it_was_checked_is_bad_input(checkpoint, tmp_path: Path) -> None:
    """Read or copied in the kernel, a weight whose file ends early is refused in one line, never written
    with what a reused buffer held before."""
    _, infos = checkpoint
    copied, transposed = (StreamedWeight([infos["t0"]], ir.DataType.FLOAT16, perm, name="t0") for perm in (None, (1, 0)))
    with open(infos["t0"].file, "r+b") as f:
        f.truncate(infos["t0"].offset + 10)
    for weight in (copied, transposed):
        with open(tmp_path / "data", "wb") as f, reused_buffers(), pytest.raises(BadInput, match="ends inside tensor t0: it changed after"):
            weight.tofile(f)
