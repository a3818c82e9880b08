"""What headfold reads: files inside the folder it was given, JSON/YAML/TOML through one bounded
reader, and strings from files printed with their control characters escaped.

- A folder-shaped input (checkpoint, export folder, dataset) is read only inside itself: a link
  or an entry of an index/summary that resolves outside is refused, naming the entry (a Hugging
  Face cache snapshot may also reach its repo's blobs/, where its own links point).
- Every JSON, YAML or TOML artifact is read by `read_json` / `read_config_file`: a size limit, a
  nesting limit (deeply nested input would exhaust Python's recursion), and YAML aliases expanded
  at most MAX_NODES times (a few hundred bytes of nested aliases otherwise expand to gigabytes).
- `printable` escapes control characters: a tensor name or manifest field can hold escape
  sequences that would retitle or clear the user's terminal.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from headfold.ground.errors import BadInput, first_line

MAX_JSON_BYTES = 64 << 20  # far above any config, index, manifest or report headfold reads
MAX_CONFIG_BYTES = 1 << 20  # budget files: a few tables of numbers
MAX_DEPTH = 64  # headfold's deepest artifact nests about 6 levels
MAX_NODES = 100_000  # values in a YAML document once its aliases are expanded


# -- staying inside a folder -------------------------------------------------------------


def allowed_roots(folder: Path) -> tuple[Path, ...]:
    """The folder, and for a Hugging Face cache snapshot (…/snapshots/REV) its repo's blobs/."""
    real = Path(folder).resolve()
    return (real, real.parent.parent / "blobs") if real.parent.name == "snapshots" else (real,)


def outside(path: Path, roots: tuple[Path, ...]) -> bool:
    real = Path(path).resolve()
    return not any(real == root or real.is_relative_to(root) for root in roots)


def check_links(folder: Path, what: str = "checkpoint folder") -> None:
    """BadInput naming the first link in `folder` whose target lies outside it, or the first special
    file (a FIFO or device would block or never end when read)."""
    roots = allowed_roots(folder)
    for parent, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            path = Path(parent) / name
            if path.is_symlink() and outside(path, roots):
                raise BadInput(
                    f"the symbolic link {path} links to {os.readlink(path)}, outside {folder}; headfold reads nothing outside the "
                    f"{what}: copy the file into it or remove the link"
                )
            if name in files and path.exists() and not path.is_file():
                raise BadInput(f"{path} is not a regular file (a FIFO, socket or device); remove it from the {what}")


def contained(folder: Path, entry: Any, listed_in: Path | str, fix: str, what: str = "entry") -> Path:
    """`folder / entry` for a file name that `listed_in` (an index, export.json, a dataset's state, a
    graph's external data) gives as its `what`: refused when it is not a file name, escapes `folder`
    (absolute, or through '..'), or leads out of it through a symbolic link."""
    name = f"{Path(listed_in).name} {what} {entry!r}"
    if not isinstance(entry, str) or not entry or "\0" in entry:
        raise BadInput(f"{name} is not a file name; {fix}")
    if os.path.isabs(entry) or ".." in Path(entry).parts:
        raise BadInput(f"{name} escapes the folder {folder}; {fix}")
    path, roots = Path(folder) / entry, allowed_roots(folder)
    if outside(path, roots):
        steps = [Path(folder).joinpath(*Path(entry).parts[: i + 1]) for i in range(len(Path(entry).parts))]
        link = next((step for step in steps if step.is_symlink() and outside(step, roots)), path)  # the first link on the way out
        raise BadInput(
            f"{name} leads out of the folder {folder} through the symbolic link {link} (to {os.readlink(link) if link.is_symlink() else link.resolve()}); {fix}"
        )
    return path


# -- bounded readers ---------------------------------------------------------------------


def read_bytes(path: Path, limit: int, what: str) -> bytes:
    """A regular file's bytes, refused above `limit` (a device or FIFO would never end)."""
    path = Path(path)
    info = path.stat()  # OSError (missing, permission) passes through: the CLI names it with its fix
    if not stat.S_ISREG(info.st_mode):
        raise BadInput(f"{what} {path} is not a regular file; pass a file")
    if info.st_size > limit:
        raise BadInput(f"{what} {path} has {info.st_size / 2**20:.1f} MiB, more than the {limit / 2**20:g} MiB headfold reads; is it the right file?")
    return path.read_bytes()


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` nests lists/dicts deeper than `limit` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def parse_json(data: bytes | str, where: Path | str, fix: str) -> Any:
    """JSON text → value; BadInput "WHERE is corrupt (why); FIX" for bad or too deeply nested JSON."""
    try:
        value, deep = json.loads(data), False
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadInput(f"{where} is corrupt (not JSON: {err}); {fix}") from None
    except RecursionError:  # deeper still: json gave up where Python's recursion ends
        value, deep = None, True
    if deep or too_deep(value):
        raise BadInput(f"{where} is corrupt (nested deeper than {MAX_DEPTH} levels); {fix}")
    return value


def read_json(path: Path, fix: str, limit: int = MAX_JSON_BYTES) -> Any:
    """A JSON file of at most `limit` bytes and MAX_DEPTH levels; BadInput naming it and `fix` otherwise."""
    return parse_json(read_bytes(path, limit, "JSON file"), path, fix)


def read_json_object(path: Path, fix: str, limit: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """read_json, and BadInput unless it holds a JSON object."""
    data = read_json(path, fix, limit)
    if not isinstance(data, dict):
        raise BadInput(f"{path} is corrupt (not a JSON object); {fix}")
    return data


def read_config_file(path: Path, what: str) -> Any:
    """A small .toml, .yaml/.yml or .json file (budgets): bounded in size, depth and YAML aliases."""
    path = Path(path)
    kinds = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}
    if path.suffix not in kinds:
        raise BadInput(f"{what} {path} must end in .toml, .yaml, .yml or .json")
    data = read_bytes(path, MAX_CONFIG_BYTES, what)
    try:
        text = data.decode("utf-8")
        if kinds[path.suffix] == "JSON":
            return parse_json(text, f"{what} {path}", "fix the file")
        value = tomllib.loads(text) if kinds[path.suffix] == "TOML" else _yaml(text, f"{what} {path}")
    except RecursionError:
        raise BadInput(f"cannot parse {what} {path}: nested deeper than Python reads; fix the file") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as err:
        raise BadInput(f"cannot parse {what} {path}: {first_line(err)}") from None
    if too_deep(value):
        raise BadInput(f"cannot parse {what} {path}: nested deeper than {MAX_DEPTH} levels; fix the file")
    return value


def _yaml(text: str, where: str) -> Any:
    """yaml.safe_load, refused once the document, its aliases expanded, holds more than MAX_NODES values."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is None:
        return {}
    if _expanded_nodes(root) > MAX_NODES:
        raise BadInput(f"cannot parse {where}: its aliases expand to more than {MAX_NODES} values; write the values out")
    return yaml.SafeLoader("").construct_document(root)


def _expanded_nodes(root: Any) -> int:
    """How many nodes a YAML node graph holds with every alias expanded, counted up to MAX_NODES + 1."""
    count, stack = 0, [(root, 0)]
    while stack and count <= MAX_NODES:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            return MAX_NODES + 1
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            stack.extend((child, depth + 1) for pair in node.value for child in pair)
    return count


# -- echoing what came from a file -------------------------------------------------------

# C0 and C1 controls and DEL, and the bidirectional overrides that reorder what a terminal shows
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_STYLE = re.compile(r"\x1b\[[0-9;]*m")  # the colours click.style writes


def shown(value: Any, limit: int = 80) -> str:
    """repr(value) for a message, cut to `limit` characters (a file's value may be megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _escape(match: re.Match) -> str:
    code = ord(match[0])
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, lines: bool = False, styles: bool = False) -> str:
    """`text` with control characters escaped (ESC → \\x1b); `lines` keeps newlines and tabs (a
    table), `styles` keeps SGR colour sequences (headfold's own PASS/FAIL colours)."""

    def clean(part: str) -> str:
        if lines:
            return "\n".join("\t".join(_CONTROL.sub(_escape, cell) for cell in line.split("\t")) for line in part.split("\n"))
        return _CONTROL.sub(_escape, part)

    if not styles:
        return clean(text)
    return "".join(clean(part) if i % 2 == 0 else part for i, part in enumerate(_split_styles(text)))


def _split_styles(text: str) -> Iterator[str]:
    """Text and SGR sequences alternating: text, style, text, …"""
    start = 0
    for match in _STYLE.finditer(text):
        yield text[start : match.start()]
        yield match[0]
        start = match.end()
    yield text[start:]
