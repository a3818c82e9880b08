"""Reading an ONNX graph file, the one way build, the lint, the plugins, ONNX convert and verify do.

A graph is refused in one line when it is empty (a 0-byte file parses as an empty model), is not
ONNX, or names external data outside its own folder (a location `../x` or `/etc/passwd`): headfold
reads nothing outside the folder of the graph it was given. External weights stay on disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import onnx_ir as ir

from headfold.ground.errors import BadInput, first_line
from headfold.ground.inputs import contained

__all__ = ["load_graph", "external_data_files"]


def load_graph(path: Path) -> ir.Model:
    """The ONNX model at `path` (external weights left on disk); BadInput for anything else."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"no ONNX file at {path}")
    if path.stat().st_size == 0:
        raise BadInput(f"{path} is empty (0 bytes), not an ONNX model; re-export it")
    try:
        model = ir.load(path)
    except Exception as err:  # protobuf and onnx_ir raise several unrelated types for a corrupt file
        raise BadInput(f"{path} is not a valid ONNX model ({type(err).__name__}: {first_line(err)}); re-export it") from None
    if model.ir_version < 1 or not model.opset_imports:
        raise BadInput(f"{path} is not an ONNX model (no IR version or opset: garbage that happened to parse); re-export it")
    external_data_files(model, path)
    return model


def external_data_files(model: ir.Model, path: Path) -> list[Path]:
    """The files `model` (loaded from `path`) keeps its weights in; BadInput for a location outside the graph's
    folder, a missing file, or one that does not hold the bytes the graph says its tensors are at."""
    fix = "re-export the graph with its weights beside it"
    found: dict[Path, int] = {}  # each data file → its size
    for tensor in _external_tensors(model):
        file = contained(path.parent, tensor.location, path, fix, "external data")
        if file not in found:
            if not file.is_file():
                raise BadInput(f"{path} keeps its weights in {file}, which does not exist; {fix}")
            found[file] = file.stat().st_size
        offset = tensor.offset or 0  # ONNX: an absent offset is 0
        end = offset + tensor.nbytes
        if (tensor.length is not None and tensor.length != tensor.nbytes) or end > found[file]:
            raise BadInput(
                f"{path} does not match its external data {file}: tensor {tensor.name!r} is bytes {offset}-{end} "
                f"of {found[file]}; {fix} (the graph and its .onnx.data come from one export)"
            )
    return sorted(found)


def _external_tensors(model: ir.Model) -> Iterator[ir.ExternalTensor]:
    graphs: list[ir.Graph | ir.Function] = [model.graph, *model.functions.values()]
    for graph in graphs:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            for attribute in node.attributes.values():
                if isinstance(getattr(attribute, "value", None), ir.ExternalTensor):
                    yield attribute.value
        for value in getattr(graph, "initializers", {}).values():
            if isinstance(value.const_value, ir.ExternalTensor):
                yield value.const_value
