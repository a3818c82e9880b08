"""The files headfold writes and reads back: their names, spelled once, and `Record`, the base of
their typed contracts.

A stage finds another stage's output through these names only. What is inside each file is one
dataclass with load/save in one module: the manifest (ground/manifest.py), export.json
(ground/export_summary.py), the run ledger (ground/ledger.py), the engine sidecar
(headfold/engines/sidecar.py) and lint findings (graphs/trt_lint.py).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from headfold.ground import VERSION
from headfold.ground.errors import BadInput
from headfold.ground.inputs import read_json_object, shown

MANIFEST = "headfold.json"  # headfold convert / distill: how a checkpoint was made
EXPORT_SUMMARY = "export.json"  # headfold export: graphs, layout, dtype and the source checkpoint
GENAI_CONFIG = "genai_config.json"  # headfold export: onnxruntime-genai's model folder config
LEDGER = "stages.json"  # headfold run: per stage its key, output digest and timing
PREFILL_GRAPH, DECODE_GRAPH = "prefill.onnx", "decode.onnx"  # a split decoder export's KV-cache pair
MODEL_GRAPH = "model.onnx"  # the one graph of a merged decoder export (prompt and cache steps) or of an encoder
ENCODER_GRAPH, DECODER_GRAPH = "encoder.onnx", "decoder.onnx"  # an encoder-decoder's export: source → cross K/V; merged decoder
ENGINE_SUFFIX = ".engine"  # headfold build names each engine after its graph: prefill.onnx -> prefill.engine
ENGINE_SUFFIXES = (ENGINE_SUFFIX, ".plan")  # what build and verify take as an engine file
SIDECAR_SUFFIX = ".json"  # model.engine -> model.engine.json, the engine sidecar
REPORT = "report.json"  # headfold verify / run: the checks and their verdicts

# What marks a file as headfold's, which `--overwrite` may replace (docs/design.md): this text in it. JSON
# carries it as {"created_by": "headfold VERSION"}, Markdown and XML as a comment, a PNG as its Software
# text chunk, an ONNX graph in its metadata; an engine has its sidecar. A file's name proves nothing:
# a folder is headfold's when one of these records in it carries the mark (or an engine sidecar does).
OWN_RECORDS = (MANIFEST, EXPORT_SUMMARY, LEDGER, REPORT)
MARK = "created by headfold"
CREATED_BY = "created_by"
_MARK_SCAN = 1 << 20  # bytes read from each end of a file to find the mark


NAME_MAX = 255  # bytes in one file name (Linux and macOS file systems)
_TAG_ROOM = 24  # the longest tag hidden_sibling adds: ".partial-" and a pid, ".distill-state"


def hidden_stem(path: Path) -> str:
    """`.NAME`, the start of every hidden sibling headfold keeps beside `path`; a NAME too long to take a
    tag within NAME_MAX is cut, with a hash of the whole name, so each NAME still has its own siblings."""
    encoded = os.fsencode(path.name)
    if len(encoded) + 1 + _TAG_ROOM <= NAME_MAX:
        return f".{path.name}"
    digest = hashlib.sha256(encoded).hexdigest()[:16]
    return f".{os.fsdecode(encoded[: NAME_MAX - 1 - _TAG_ROOM - 1 - len(digest)])}~{digest}"


def hidden_sibling(path: Path, tag: str) -> Path:
    """`.NAME.TAG` beside `path`: its lock, staging folder, backup or distillation state."""
    return path.with_name(f"{hidden_stem(path)}.{tag}")


def created_by() -> str:
    """The value of a JSON record's `created_by` key (and of the text mark after MARK's first word)."""
    return f"headfold {VERSION}"


def mark_comment() -> str:
    """The mark as Markdown / XML write it."""
    return f"<!-- {MARK} {VERSION} -->"


def written_by_headfold(path: Path) -> bool:
    """A folder: empty, or holding one of headfold's records (or an engine sidecar) that carries the
    mark. A file: carrying the mark (an engine: beside its sidecar; model.onnx.data: beside its graph)."""
    path = Path(path)
    if path.is_dir():
        records = [path / name for name in OWN_RECORDS if (path / name).is_file()]
        return not any(path.iterdir()) or any(map(_marked_json, [*records, *path.glob(f"*{ENGINE_SUFFIX}{SIDECAR_SUFFIX}")]))
    if path.suffix in ENGINE_SUFFIXES:
        return _marked_json(path.with_name(path.name + SIDECAR_SUFFIX))
    if path.name.endswith(".onnx.data"):
        return written_by_headfold(path.with_name(path.name.removesuffix(".data")))
    return _marked_json(path) if path.suffix == ".json" else _marked_bytes(path)


def _marked_json(path: Path) -> bool:
    try:
        data = read_json_object(path, "")
    except (OSError, BadInput):
        return False
    kind = data.get("format")
    return str(data.get(CREATED_BY, "")).startswith("headfold") or isinstance(kind, str) and kind.startswith("headfold.")


def _marked_bytes(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(_MARK_SCAN)
            f.seek(max(f.seek(0, os.SEEK_END) - _MARK_SCAN, 0))
            tail = f.read(_MARK_SCAN)
    except OSError:
        return False
    return MARK.encode() in head or MARK.encode() in tail


def engine_name(graph: str) -> str:
    """The engine `headfold build` makes of a graph file: prefill.onnx -> prefill.engine."""
    return Path(graph).stem + ENGINE_SUFFIX


EXTRA = "extra"  # the field that keeps keys a record does not know (a newer writer's), written back
R = TypeVar("R", bound="Record")


class Malformed(ValueError):
    """JSON that does not fit its record; each loader turns it into its own one-line BadInput."""


def mark() -> Any:
    """The `created_by` field of a record headfold writes into an output folder: the folder's mark."""
    return dataclasses.field(default_factory=created_by)


def optional(default: Any = None) -> Any:
    """A field that may be absent from the file (older writers) and is left out when None."""
    return dataclasses.field(default=default, metadata={"omit_if_none": True})


def keep_unknown() -> Any:
    """The `extra` field: keys this headfold does not know, kept and written back."""
    return dataclasses.field(default_factory=dict, compare=False, repr=False)


class Record:
    """Base of a dataclass that is one JSON object: its fields are the keys, in order. Nested
    records, and lists and dicts of them, are built from the annotations; a value of the wrong
    type is Malformed. (A plain class, so frozen and mutable dataclasses can both derive from it.)"""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # set by @dataclass on every subclass

    def to_dict(self) -> dict[str, Any]:
        data = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != EXTRA and not (value is None and f.metadata.get("omit_if_none")):
                data[f.name] = plain(value)
        return data | getattr(self, EXTRA, {})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: Path) -> None:
        """Write to `path` whole or not at all (a sibling temporary file renamed over it)."""
        path = Path(path)
        tmp = hidden_sibling(path, f"partial-{os.getpid()}")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def from_dict(cls: type[R], data: Any) -> R:
        if not isinstance(data, dict):
            raise Malformed("not a JSON object")
        hints = typing.get_type_hints(cls)
        known = {f.name: f for f in dataclasses.fields(cls) if f.init}
        values = {name: typed(data[name], hints[name], name) for name in known if name in data and name != EXTRA}
        missing = [name for name, f in known.items() if name not in values and name != EXTRA and _required(f)]
        if missing:
            raise Malformed(f"no {' and '.join(map(repr, missing))}")
        if EXTRA in known:
            values[EXTRA] = {k: v for k, v in data.items() if k not in known}
        record = cls(**values)
        _refuse_newer_format(record)
        return record


def _refuse_newer_format(record: Record) -> None:
    """Malformed when the record's numeric `format` is above its field's default, the newest this
    headfold writes: a newer headfold wrote the file."""
    newest = next((f.default for f in dataclasses.fields(record) if f.name == "format"), None)
    written = getattr(record, "format", None)
    if isinstance(newest, int) and isinstance(written, int) and written > newest:
        raise Malformed(f"format {written} is newer than this headfold's {newest}; upgrade headfold")


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def plain(value: Any) -> Any:
    """`value` as JSON holds it: records as objects, paths as strings, tuples as lists."""
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def typed(value: Any, hint: Any, name: str) -> Any:
    """`value` read as `hint` says (records built, in lists and dicts too); Malformed when it does not fit."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    options = typing.get_args(hint) if union else (hint,)
    for option in options:
        origin = typing.get_origin(option) or option
        if isinstance(origin, type) and issubclass(origin, Record) and isinstance(value, dict):
            return origin.from_dict(value)
        if origin is typing.Literal and value in typing.get_args(option):
            return value
        if isinstance(origin, type) and issubclass(origin, enum.Enum):
            if value in [member.value for member in origin]:  # a name the file spells (a Precision: "fp16")
                return origin(value)
        elif _fits(value, origin):
            return _items(value, typing.get_args(option), name)
    choices = [str(member.value) for option in options if isinstance(option, type) and issubclass(option, enum.Enum) for member in option]
    if choices:
        raise Malformed(f"{name!r} is {shown(value) if isinstance(value, str) else _json_type(value)}, not one of {', '.join(choices)}")
    raise Malformed(f"{name!r} is {_json_type(value)}")


def _fits(value: Any, origin: Any) -> bool:
    if origin is Any:
        return True
    if origin is None or origin is type(None):
        return value is None
    if not isinstance(origin, type) or issubclass(origin, Record) or isinstance(value, bool) and origin is not bool:
        return False
    return isinstance(value, origin) or origin is float and isinstance(value, int)


def _items(value: Any, args: tuple, name: str) -> Any:
    """The records inside a list[R] or a dict[str, R]; other containers as they are."""
    item = args[-1] if args else None
    if not (isinstance(item, type) and issubclass(item, Record)):
        return value
    if isinstance(value, dict):
        return {k: typed(v, item, f"{name}.{k}") for k, v in value.items()}
    return [typed(v, item, f"{name}[{i}]") for i, v in enumerate(value)]


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def load_record(cls: type[R], path: Path, fix: str) -> R:
    """The record in the JSON file `path`; BadInput "PATH is corrupt (why); FIX" when it does not fit."""
    try:
        return cls.from_dict(read_json_object(path, fix))
    except Malformed as err:
        raise BadInput(f"{path} is corrupt ({err}); {fix}") from None
