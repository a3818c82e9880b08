"""The streaming writer produces files that the safetensors library reads back exactly."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from headfold.converter.writer import PlannedTensor, ShardedWriter, plan_shards

TENSORS = {
    "f32": torch.randn(3, 5),
    "bf16": torch.randn(7).to(torch.bfloat16),
    "f16": torch.randn(2, 2, 2).to(torch.float16),
    "i64": torch.arange(6).reshape(2, 3),
    "bool": torch.tensor([True, False, True]),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
    "u8": torch.arange(5, dtype=torch.uint8),
}


def plan(tensors: dict[str, torch.Tensor]) -> list[PlannedTensor]:
    return [PlannedTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


@pytest.mark.parametrize("shard_bytes", [1 << 30, 40])
def test_round_trip(shard_bytes: int, tmp_path: Path) -> None:
    with ShardedWriter(tmp_path, plan(TENSORS), shard_bytes, {"format": "pt"}) as writer:
        for name, t in TENSORS.items():
            writer.write(name, t)
        hashes = writer.finish()
    files = sorted(tmp_path.glob("*.safetensors"))
    assert (len(files) == 1) == (shard_bytes == 1 << 30)
    read = {}
    for f in files:
        with safe_open(f, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            read.update({k: handle.get_tensor(k) for k in handle.keys()})
        assert hashes[f.name] == hashlib.sha256(f.read_bytes()).hexdigest()
    assert read.keys() == TENSORS.keys()
    for name, t in TENSORS.items():
        assert read[name].dtype == t.dtype and torch.equal(read[name], t), name
    if len(files) > 1:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(TENSORS)


def test_plan_keeps_order_and_isolates_large_tensors() -> None:
    sizes = [PlannedTensor(str(i), torch.uint8, (n,)) for i, n in enumerate([10, 10, 100, 5, 5])]
    shards = plan_shards(sizes, 25)
    assert [[t.name for t in s] for s in shards] == [["0", "1"], ["2"], ["3", "4"]]


def test_out_of_plan_write_is_refused(tmp_path: Path) -> None:
    with ShardedWriter(tmp_path, plan(TENSORS), 1 << 30, {}) as writer:
        with pytest.raises(RuntimeError, match="expected"):
            writer.write("bf16", TENSORS["bf16"])


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_copied_ranges_equal_written_tensors(kernel_copy: bool, tmp_path: Path, monkeypatch) -> None:
    """Unchanged tensors are copied from the source file's byte range (kernel copy, or the
    read/write fallback where copy_file_range is refused) with the same bytes and hashes."""
    from safetensors.torch import save_file

    from headfold.converter.checkpoint import FileRange, _safetensors_header

    save_file(TENSORS, tmp_path / "src.safetensors", metadata={"format": "pt"})
    infos = _safetensors_header(tmp_path / "src.safetensors")
    if not kernel_copy:
        monkeypatch.setattr("os.copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(18, "EXDEV")))
    (tmp_path / "out").mkdir()
    planned = [PlannedTensor(i.name, i.dtype, i.shape) for i in infos]
    with ShardedWriter(tmp_path / "out", planned, 64, {"format": "pt"}) as writer:
        for i in infos:
            writer.copy(i.name, i.dtype, i.shape, FileRange(i.file, i.offset, i.nbytes))
        hashes = writer.finish()
    for f in (tmp_path / "out").glob("*.safetensors"):
        assert hashes[f.name] == hashlib.sha256(f.read_bytes()).hexdigest()
        with safe_open(f, framework="pt") as handle:
            for k in handle.keys():
                assert torch.equal(handle.get_tensor(k), TENSORS[k]), k


def test_arrays_under_safetensors_codes(tmp_path: Path) -> None:
    """The torch-free path: dtypes as safetensors codes, data as numpy arrays (bf16 as uint16)."""
    import numpy as np

    bf16 = torch.randn(3, 5).to(torch.bfloat16)
    half = torch.randn(4).half()
    planned = [PlannedTensor("a", "BF16", (3, 5)), PlannedTensor("b", "F16", (4,))]
    with ShardedWriter(tmp_path, planned, 1 << 30, {"format": "pt"}) as writer:
        with pytest.raises(RuntimeError, match="float32"):
            writer.write_array("a", "BF16", np.zeros((3, 5), np.float32))
        writer.write_array("a", "BF16", bf16.view(torch.int16).numpy().view(np.uint16))
        writer.write_array("b", "F16", half.numpy())
        hashes = writer.finish()
    with safe_open(tmp_path / "model.safetensors", framework="pt") as handle:
        assert torch.equal(handle.get_tensor("a"), bf16) and torch.equal(handle.get_tensor("b"), half)
    assert hashes["model.safetensors"] == hashlib.sha256((tmp_path / "model.safetensors").read_bytes()).hexdigest()


def test_every_byte_written_is_sent_to_disk_at_once(tmp_path: Path, monkeypatch) -> None:
    """start_writeback covers each file from its header to its end, in order, once."""
    from headfold.converter import writer as module

    if sys.platform == "linux":
        assert module._SYNC_FILE_RANGE is not None  # libc has it: writing out is not left to the kernel's threshold
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(module, "_SYNC_FILE_RANGE", lambda fd, offset, nbytes, flags: calls.append((offset, nbytes, flags)) or 0)
    with ShardedWriter(tmp_path, plan(TENSORS), 64, {"format": "pt"}) as writer:
        for name, t in TENSORS.items():
            writer.write(name, t)
        writer.finish()
    files = [f.stat().st_size for f in sorted(tmp_path.glob("*.safetensors"))]
    covered: list[int] = []  # per file: where the last range ended, a new file starting at 0
    for offset, nbytes, flags in calls:
        assert flags == module.SYNC_FILE_RANGE_WRITE  # start the writing, never wait for it
        if offset == 0:
            covered.append(0)
        assert offset == covered[-1], "ranges leave a gap or overlap"
        covered[-1] += nbytes
    assert covered == files and len(files) > 1
