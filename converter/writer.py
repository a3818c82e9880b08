"""Streaming, sharded safetensors writer.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once. Because a
conversion knows every output tensor's name, dtype and shape before computing any of them,
this writer lays out the shards up front, writes each header first and then streams tensor
bytes in order, so memory stays bounded by one layer. The bytes follow the safetensors
format exactly (8-byte little-endian header length, JSON header padded to 8 bytes, data);
tests read the result back with ``safetensors.safe_open``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from headfold.converter.checkpoint import SAFETENSORS_DTYPES, SAFETENSORS_INDEX, FileRange

DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Fill shards in order up to the cap; a tensor larger than the cap gets a shard alone."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(shard: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in shard:
        entries[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _copy_range(source: FileRange, out: BinaryIO) -> None:
    """Kernel-side copy (copy_file_range); a plain read/write loop where the kernel refuses."""
    done = 0
    with open(source.path, "rb", buffering=0) as f:
        try:
            while done < source.nbytes:
                n = os.copy_file_range(f.fileno(), out.fileno(), source.nbytes - done, source.offset + done)
                if n == 0:
                    raise EOFError(f"{source.path} ended before byte {source.offset + source.nbytes}")
                done += n
        except (AttributeError, OSError):  # no copy_file_range here, or not between these files
            f.seek(source.offset + done)
            while done < source.nbytes:
                chunk = f.read(min(1 << 24, source.nbytes - done))
                if not chunk:
                    raise EOFError(f"{source.path} ended before byte {source.offset + source.nbytes}") from None
                out.write(chunk)
                done += len(chunk)


def _hash_range(source: FileRange, digest: Any) -> None:
    """Hash bytes straight from the page cache (mmap); unmapping keeps them out of our RSS."""
    if source.nbytes == 0:
        return
    start = source.offset - source.offset % mmap.ALLOCATIONGRANULARITY
    with open(source.path, "rb") as f, mmap.mmap(f.fileno(), source.offset + source.nbytes - start, offset=start, access=mmap.ACCESS_READ) as m:
        with memoryview(m) as view:
            digest.update(view[source.offset - start :])


class ShardedWriter:
    """Write planned tensors, in plan order, into ``folder``; sha256 of every file kept.

    Writing and hashing each run on their own background thread (both release the GIL), so the
    hash of one tensor overlaps the write of the next while the caller reads and converts the
    one after. At most ``IN_FLIGHT`` converted tensors wait in memory; byte ranges copied from
    the source hold none, so they queue freely and neither thread waits for the caller.
    """

    IN_FLIGHT = 2

    def __init__(self, folder: Path, tensors: list[PlannedTensor], max_shard_bytes: int, metadata: dict[str, str]) -> None:
        self.folder = folder
        self.shards = plan_shards(tensors, max_shard_bytes)
        self.names = shard_names(len(self.shards))
        self.metadata = metadata
        self.sha256: dict[str, str] = {}
        self._queue = [(i, t) for i, shard in enumerate(self.shards) for t in shard]
        self._next = 0
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headfold-write")
        self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headfold-hash")
        self._in_flight: deque[tuple[Future[None], Future[None], bool]] = deque()  # write, hash, holds memory
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Queue the next planned tensor."""
        self._check(name, tensor.dtype, tuple(tensor.shape))
        self._submit(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))

    def copy(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], source: FileRange) -> None:
        """Queue the next planned tensor, taken unchanged from a byte range of a source file."""
        self._check(name, dtype, shape)
        self._submit(source)

    def _check(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        planned = self._queue[self._next][1]
        if (name, dtype, shape) != (planned.name, planned.dtype, planned.shape):
            raise RuntimeError(f"writer expected {planned}, got {name} {dtype} {shape}")

    def _submit(self, data: memoryview | FileRange) -> None:
        shard_index = self._queue[self._next][0]
        first = self._next == 0 or self._queue[self._next - 1][0] != shard_index
        self._next += 1
        last = self._next == len(self._queue) or self._queue[self._next][0] != shard_index
        header = _header(self.shards[shard_index], self.metadata) if first else None
        self._in_flight.append((
            self._writer.submit(self._store, shard_index, header, data, last),
            self._hasher.submit(self._digest, shard_index, header, data, last),
            isinstance(data, memoryview),
        ))  # fmt: skip
        while sum(held for *_, held in self._in_flight) > self.IN_FLIGHT:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        write, digest, _ = self._in_flight.popleft()
        write.result()  # re-raises a failed write here
        digest.result()

    def _store(self, shard_index: int, header: bytes | None, data: memoryview | FileRange, last: bool) -> None:
        """Writer thread: one call at a time, in order."""
        if header is not None:
            if self._file is not None:  # the previous shard failed mid-write (disk full): close, not leak, it
                self._file.close()
            self._file = open(self.folder / self.names[shard_index], "wb", buffering=0)  # fd writes below
            self._file.write(header)
        assert self._file is not None
        if isinstance(data, FileRange):
            _copy_range(data, self._file)
        else:
            self._file.write(data)
        if last:
            self._file.close()
            self._file = None

    def _digest(self, shard_index: int, header: bytes | None, data: memoryview | FileRange, last: bool) -> None:
        """Hash thread: one call at a time, in order."""
        if header is not None:
            self._hash = hashlib.sha256(header)
        if isinstance(data, FileRange):
            _hash_range(data, self._hash)
        else:
            self._hash.update(data)
        if last:
            self.sha256[self.names[shard_index]] = self._hash.hexdigest()

    def finish(self) -> dict[str, str]:
        """Wait for the writes, write the index (when sharded); return {file name: sha256}."""
        self.close()
        if self._next != len(self._queue):
            raise RuntimeError(f"writer finished after {self._next} of {len(self._queue)} tensors")
        if len(self.shards) > 1:
            weight_map = {t.name: self.names[i] for i, shard in enumerate(self.shards) for t in shard}
            total = sum(t.nbytes for shard in self.shards for t in shard)
            raw = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()
            (self.folder / SAFETENSORS_INDEX).write_bytes(raw)
            self.sha256[SAFETENSORS_INDEX] = hashlib.sha256(raw).hexdigest()
        return dict(self.sha256)

    def close(self) -> None:
        """Drain the writer thread (re-raising its first error) and close any open file."""
        try:
            while self._in_flight:
                self._wait_oldest()
        finally:
            self._writer.shutdown(wait=True, cancel_futures=True)
            self._hasher.shutdown(wait=True, cancel_futures=True)
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
