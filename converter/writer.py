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
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from headfold.converter.checkpoint import SAFETENSORS_DTYPES, SAFETENSORS_INDEX

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


class ShardedWriter:
    """Write planned tensors, in plan order, into ``folder``; sha256 of every file kept.

    Hashing and writing run on one background thread (both release the GIL) while the
    caller reads and converts the next tensor; at most ``IN_FLIGHT`` tensors wait, so
    memory stays bounded.
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
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headfold-writer")
        self._in_flight: deque[Future[None]] = deque()
        self._file: BinaryIO | None = None
        self._hash = hashlib.sha256()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard_index, planned = self._queue[self._next]
        if name != planned.name or tensor.dtype != planned.dtype or tuple(tensor.shape) != planned.shape:
            raise RuntimeError(f"writer expected {planned}, got {name} {tensor.dtype} {tuple(tensor.shape)}")
        self._next += 1
        last_of_shard = self._next == len(self._queue) or self._queue[self._next][0] != shard_index
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._in_flight.append(self._pool.submit(self._store, shard_index, data, last_of_shard))
        while len(self._in_flight) > self.IN_FLIGHT:
            self._in_flight.popleft().result()  # re-raises a failed write here

    def _store(self, shard_index: int, data: torch.Tensor, last_of_shard: bool) -> None:
        """Runs on the writer thread, one call at a time, in order."""
        if self._file is None:
            self._file = open(self.folder / self.names[shard_index], "wb")
            self._hash = hashlib.sha256()
            self._emit(_header(self.shards[shard_index], self.metadata))
        self._emit(memoryview(data.numpy()))
        if last_of_shard:
            self._file.close()
            self._file = None
            self.sha256[self.names[shard_index]] = self._hash.hexdigest()

    def _emit(self, data: bytes | memoryview) -> None:
        assert self._file is not None
        self._file.write(data)
        self._hash.update(data)

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
                self._in_flight.popleft().result()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
