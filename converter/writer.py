"""Streaming, sharded safetensors writer.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once. Because a
conversion knows every output tensor's name, dtype and shape before computing any of them,
this writer lays out the shards up front, writes each header first and then streams tensor
bytes in order, so memory stays bounded by one layer. The bytes follow the safetensors
format exactly (8-byte little-endian header length, JSON header padded to 8 bytes, data);
tests read the result back with ``safetensors.safe_open``. It imports no torch: dtypes are
safetensors codes ("F16") or torch dtypes, data torch tensors, numpy arrays or source byte ranges.

Shards are planned here rather than with huggingface_hub's split_state_dict_into_shards_factory:
that one puts a tensor larger than the cap into a shard *before* the one being filled, which
breaks writing in source order (the streaming this writer exists for).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import struct
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from headfold.converter.checkpoint import SAFETENSORS_INDEX, FileRange, dtype_code
from headfold.ground.hashing import update_from_file
from headfold.ground.lazy import lazy_import
from headfold.ground.precision import SAFETENSORS_DTYPES

torch = lazy_import("torch")  # loaded already wherever a tensor is written: `tensor` is one

DTYPE_SIZES = {code: stored.itemsize for code, stored in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: Any  # torch.dtype or safetensors code
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[dtype_code(self.dtype)] * math.prod(self.shape)


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
        entries[t.name] = {"dtype": dtype_code(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def copy_range(source: FileRange, out: BinaryIO) -> None:
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


def _libc_sync_file_range() -> Any:
    """libc's sync_file_range (Linux; Python's os has no binding), or None elsewhere."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return call


_SYNC_FILE_RANGE = _libc_sync_file_range()
SYNC_FILE_RANGE_WRITE = 2  # start writing the range out, do not wait for it


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing bytes just written to disk now. Left alone, it waits until dirty
    pages reach its background threshold (~10 % of memory): an output smaller than that is still all
    in memory when the conversion ends, and the user's `sync` (or the next job's memory pressure)
    waits for all of it. benchmarks/results/convert_vs_cp.json has convert + sync with and without it.
    posix_fadvise(DONTNEED) also starts writeback, but drains
    every core's page lists and evicts the pages: slower. This returns without waiting for the disk."""
    if _SYNC_FILE_RANGE is not None and nbytes:
        _SYNC_FILE_RANGE(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # a failure only leaves it to the kernel


class ShardedWriter:
    """Write planned tensors, in plan order, into ``folder``; sha256 of every file kept.

    Writing runs on one background thread and hashing on one per shard (both release the GIL),
    so the hash of one tensor overlaps the write of the next while the caller reads and converts
    the one after, and the shards of a sharded output hash side by side, as many at once as
    there are cores: sha256 is the slowest step of a plain conversion.
    The hash reads the bytes the writer is given (arrays, or the source's page cache for copied
    ranges), never the output file. At most ``IN_FLIGHT`` converted tensors wait in memory; byte
    ranges copied from the source hold none, so they queue freely and no thread waits for the caller.
    Each tensor's bytes go on to the disk as soon as they are written (start_writeback).
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
        self._hashers: dict[int, ThreadPoolExecutor] = {}  # shard → its hash thread, in order within the shard
        self._hashing = threading.BoundedSemaphore(os.cpu_count() or 1)  # shards hashing at once
        self._in_flight: deque[tuple[Future[None], Future[None], bool]] = deque()  # write, hash, holds memory
        self._file: BinaryIO | None = None
        self._hashes: dict[int, Any] = {}

    def write(self, name: str, tensor: Any) -> None:
        """Queue the next planned tensor (a torch tensor)."""
        self._check(name, tensor.dtype, tuple(tensor.shape))
        self._submit(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))

    def write_array(self, name: str, dtype: str, array: np.ndarray) -> None:
        """Queue the next planned tensor as a numpy array holding `dtype`'s bytes (BF16: uint16)."""
        if array.dtype.itemsize != DTYPE_SIZES[dtype]:
            raise RuntimeError(f"writer got {array.dtype} data for {name}, which is {dtype}")
        self._check(name, dtype, tuple(array.shape))
        self._submit(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)

    def copy(self, name: str, dtype: Any, shape: tuple[int, ...], source: FileRange) -> None:
        """Queue the next planned tensor, taken unchanged from a byte range of a source file."""
        self._check(name, dtype, shape)
        self._submit(source)

    def _check(self, name: str, dtype: Any, shape: tuple[int, ...]) -> None:
        planned = self._queue[self._next][1]
        if (name, dtype_code(dtype), shape) != (planned.name, dtype_code(planned.dtype), planned.shape):
            raise RuntimeError(f"writer expected {planned}, got {name} {dtype} {shape}")

    def _submit(self, data: memoryview | FileRange) -> None:
        shard_index = self._queue[self._next][0]
        first = self._next == 0 or self._queue[self._next - 1][0] != shard_index
        self._next += 1
        last = self._next == len(self._queue) or self._queue[self._next][0] != shard_index
        header = _header(self.shards[shard_index], self.metadata) if first else None
        if first:
            self._hashers[shard_index] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"headfold-hash-{shard_index}")
        hasher = self._hashers[shard_index]
        self._in_flight.append((
            self._writer.submit(self._store, shard_index, header, data, last),
            hasher.submit(self._digest, shard_index, header, data, last),
            isinstance(data, memoryview),
        ))  # fmt: skip
        if last:
            hasher.shutdown(wait=False)  # its thread ends once the shard's hash is done
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
        start = 0 if header is not None else self._file.tell()
        if isinstance(data, FileRange):
            copy_range(data, self._file)
        else:
            self._file.write(data)
        start_writeback(self._file.fileno(), start, self._file.tell() - start)
        if last:
            self._file.close()
            self._file = None

    def _digest(self, shard_index: int, header: bytes | None, data: memoryview | FileRange, last: bool) -> None:
        """A shard's hash thread: its tensors one at a time, in order."""
        with self._hashing:
            if header is not None:
                self._hashes[shard_index] = hashlib.sha256(header)
            digest = self._hashes[shard_index]
            if isinstance(data, FileRange):
                update_from_file(digest, data.path, data.offset, data.nbytes)
            else:
                digest.update(data)
            if last:
                self.sha256[self.names[shard_index]] = self._hashes.pop(shard_index).hexdigest()

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
            for hasher in self._hashers.values():
                hasher.shutdown(wait=True, cancel_futures=True)
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
