"""Reading a Hugging Face checkpoint folder lazily, tensor by tensor, after validating it.

Everything a conversion needs to refuse is checked here, before anything is written:
config, weight files (headers, truncation), head counts and attention tensor shapes.
"""

from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from headfold.converter.layout import HeadShape, head_axis_sizes
from headfold.converter.per_layer import KV_HEADS_PER_LAYER, config_kv_heads
from headfold.converter.spec import ArchitectureSpec, spec_for
from headfold.errors import BadInput

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
# Files that hold weights in some format: never copied into a converted checkpoint,
# because they would still describe the MHA model.
WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|onnx|onnx_data|onnx\.data|ot|gguf)$|.*\.(safetensors|bin)\.index\.json$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int = 0  # byte offset in a safetensors file (unused for pickles)

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class FileRange:
    """Tensor bytes as they sit in a file: the writer copies them in the kernel, unread."""

    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class AttentionLayout:
    """Where each layer's attention tensors are: layer → {spec suffix: tensor name}."""

    layers: list[dict[str, str]]

    def owner(self) -> dict[str, int]:
        """tensor name → layer index."""
        return {name: i for i, layer in enumerate(self.layers) for name in layer.values()}


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise BadInput(f"{path} is missing: a Hugging Face checkpoint folder needs its config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadInput(f"{path} is not valid JSON ({e}); restore it from the original checkpoint") from None
    if not isinstance(config, dict):
        raise BadInput(f"{path} must hold a JSON object; restore it from the original checkpoint")
    return config


def _positive_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BadInput(f"config.json: {key!r} must be a positive integer, found {value!r}")
    return value


def head_shape(config: dict[str, Any], spec: ArchitectureSpec) -> HeadShape:
    keys = spec.config
    heads = _positive_int(config, keys.heads)
    kv_heads = _positive_int(config, keys.kv_heads) if config.get(keys.kv_heads) is not None else heads
    hidden = _positive_int(config, keys.hidden)
    if keys.head_dim and config.get(keys.head_dim) is not None:
        head_dim = _positive_int(config, keys.head_dim)
    elif hidden % heads:
        raise BadInput(f"config.json: hidden size {hidden} is not divisible by {heads} heads")
    else:
        head_dim = hidden // heads
    if heads % kv_heads:
        raise BadInput(f"config.json: {heads} heads are not divisible by {kv_heads} kv heads")
    return HeadShape(heads, kv_heads, head_dim)


def layer_head_shapes(config: dict[str, Any], shape: HeadShape, layers: int) -> tuple[HeadShape, ...]:
    """Each layer's head shape: a chained conversion's source may hold per-layer kv heads."""
    per_layer = config_kv_heads(shape.kv_heads, config.get(KV_HEADS_PER_LAYER), shape.heads, layers)
    return tuple(HeadShape(shape.heads, kv, shape.head_dim) for kv in per_layer)


def rotary_dims(config: dict[str, Any], spec: ArchitectureSpec, head_dim: int) -> int:
    """Leading head dims RoPE rotates (0 without RoPE); partial rotary under its several config names."""
    if not spec.rope:
        return 0
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    fraction = params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or config.get("rotary_pct") or 1.0
    return int(head_dim * fraction) // 2 * 2


def _safetensors_header(file: Path) -> list[TensorInfo]:
    """Validate a safetensors file with the library, then take data offsets from its header."""
    try:
        safe_open(file, framework="pt")  # checks header, dtypes and that the data is complete
    except (SafetensorError, OSError) as e:
        raise BadInput(f"{file} is unreadable or truncated ({e}); download it again") from None
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise BadInput(f"{file.name}: tensor {name} has unsupported dtype {entry['dtype']}")
        infos.append(TensorInfo(name, dtype, tuple(entry["shape"]), file, 8 + length + entry["data_offsets"][0]))
    return sorted(infos, key=lambda t: t.offset)  # storage order: sequential reads


class SourceCheckpoint:
    """A validated checkpoint folder whose tensors are read only when asked for."""

    def __init__(self, folder: Path, *, allow_pickle: bool = False) -> None:
        if not folder.is_dir():
            raise BadInput(f"source {folder} is not a folder; pass a Hugging Face checkpoint folder")
        self.folder = folder
        self.config = read_config(folder)
        self.spec = spec_for(self.config.get("model_type"))
        self.shape = head_shape(self.config, self.spec)  # kv_heads: the largest layer's
        self.layers = _positive_int(self.config, self.spec.config.layers)
        self.layer_shapes = layer_head_shapes(self.config, self.shape, self.layers)
        self._index_names: set[str] = set()
        self._pickles: dict[Path, dict[str, torch.Tensor]] = {}
        self.weight_files = self._find_weight_files(allow_pickle)
        self.tensors = self._read_headers()
        self.attention = self._locate_attention()

    # -- weight files -------------------------------------------------------------------
    def _find_weight_files(self, allow_pickle: bool) -> list[Path]:
        folder = self.folder
        if (folder / SAFETENSORS_INDEX).is_file():
            return self._files_from_index(folder / SAFETENSORS_INDEX)
        if (folder / "model.safetensors").is_file():
            return [folder / "model.safetensors"]
        pickles = (folder / PICKLE_INDEX, folder / "pytorch_model.bin")
        if any(p.is_file() for p in pickles):
            if not allow_pickle:
                raise BadInput(
                    f"{folder} holds only pickle weights (pytorch_model.bin), which can run code when "
                    "loaded; convert them to safetensors or pass --allow-pickle (loaded with weights_only=True)"
                )
            return self._files_from_index(pickles[0]) if pickles[0].is_file() else [pickles[1]]
        raise BadInput(f"no weights in {folder}: expected model.safetensors or {SAFETENSORS_INDEX} with its shards")

    def _files_from_index(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({self.folder / f for f in weight_map.values()})
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise BadInput(f"{index} is corrupt ({type(e).__name__}: {e}); restore it from the original checkpoint") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise BadInput(f"{index.name} lists missing shard(s) {', '.join(missing)}; download the complete checkpoint")
        self._index_names = set(weight_map)
        return files

    def _read_headers(self) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for file in self.weight_files:
            infos = _safetensors_header(file) if file.suffix == ".safetensors" else self._pickle_header(file)
            tensors.update((t.name, t) for t in infos)
        if missing := self._index_names - set(tensors):
            raise BadInput(f"the weight index names {len(missing)} tensor(s) absent from the shards (e.g. {min(missing)}); the checkpoint is incomplete")
        return tensors

    def _pickle_header(self, file: Path) -> list[TensorInfo]:
        try:  # mmap: tensors are paged in only when read
            self._pickles[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises many types for a bad pickle
            raise BadInput(f"{file} is not a loadable weights-only pickle ({type(e).__name__}); download it again") from None
        return [TensorInfo(n, t.dtype, tuple(t.shape), file) for n, t in self._pickles[file].items()]

    # -- attention tensors --------------------------------------------------------------
    def _locate_attention(self) -> AttentionLayout:
        sizes = [head_axis_sizes(self.spec, shape) for shape in self.layer_shapes]
        found: dict[str, dict[int, str]] = defaultdict(dict)
        prefixes: set[str] = set()
        for suffix in sizes[0]:
            pattern = self.spec.tensor_pattern(suffix)
            for name in self.tensors:
                if m := pattern.match(name):
                    prefixes.add(m.group(1))
                    found[suffix][int(m.group(2))] = name
        if len(prefixes) > 1:
            raise BadInput(f"attention tensors under several prefixes ({', '.join(sorted(prefixes))}); only single-model checkpoints are supported")
        layers: list[dict[str, str]] = [{} for _ in range(self.layers)]
        for suffix, by_layer in found.items():
            if set(by_layer) != set(range(self.layers)):
                raise BadInput(f"tensor '*{suffix}' found for layers {sorted(by_layer)}, expected 0..{self.layers - 1}; weights and config.json disagree")
            for i, name in by_layer.items():
                self._check_size(name, *sizes[i][suffix], self.layer_shapes[i])
                layers[i][suffix] = name
        required = self._required_suffixes()
        if missing := [s for s in required if s not in found]:
            raise BadInput(f"no '{missing[0]}' tensors for {self.spec.family}; is this a {self.spec.family} checkpoint?")
        return AttentionLayout(layers)

    def _required_suffixes(self) -> list[str]:
        weights = [p.weight for p in self.spec.projections.values()]
        return weights + ([self.spec.fused_qkv.weight] if self.spec.fused_qkv else [])

    def _check_size(self, name: str, axis: int, size: int, s: HeadShape) -> None:
        shape = self.tensors[name].shape
        if axis >= len(shape) or shape[axis] != size:
            raise BadInput(
                f"tensor {name} has shape {list(shape)}, expected {size} on axis {axis} for "
                f"{s.heads} heads, {s.kv_heads} kv heads, head_dim {s.head_dim}; weights and config.json disagree"
            )

    # -- reading ------------------------------------------------------------------------
    def get(self, name: str) -> torch.Tensor:
        """Read one tensor with a plain positioned read: no mmap, so memory holds only what is in use."""
        info = self.tensors[name]
        if info.file in self._pickles:
            return self._pickles[info.file][name]
        buffer = torch.empty(info.nbytes, dtype=torch.uint8)
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            f.readinto(buffer.numpy())
        return buffer.view(info.dtype).reshape(info.shape)

    def byte_range(self, name: str) -> FileRange | None:
        """Where a tensor's bytes sit in a safetensors file (None for pickles)."""
        info = self.tensors[name]
        return None if info.file in self._pickles else FileRange(info.file, info.offset, info.nbytes)

    def close(self) -> None:
        self._pickles.clear()

    def __enter__(self) -> SourceCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
