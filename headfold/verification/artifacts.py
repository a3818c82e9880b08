"""What a path given to `headfold verify` is, which model it holds, and which check two of them need.

A checkpoint folder (config.json) runs in torch; an export folder (export.json) or a .onnx file
runs in ONNX Runtime; a .engine (or a `headfold build` folder) runs in TensorRT. An ONNX graph's
model is the checkpoint export.json names as its source; an engine's is its source graph's
(found through the engine's .engine.json sidecar). A decoder export's graph carries the graph
that continues from its cache along (`Artifact.decode`) for the KV-cache check
(verification.decoding): a merged model.onnx continues through itself, a split prefill.onnx
through decode.onnx; a merged GroupQueryAttention graph continues in one shared past/present
buffer per layer, as onnxruntime-genai runs it (`Artifact.shared_cache`). An encoder-decoder's
export is its encoder.onnx with decoder.onnx as its `pair`, run together (verification.seq2seq).
Same model on both sides → fidelity, or loss where a side has int4 weights (quantization loses
what a conversion loses: the same metrics and budgets); a candidate whose model is a headfold
conversion (headfold.json) of the reference's → conversion loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.per_layer import collapse
from headfold.engines.sidecar import load_sidecar, source_onnx
from headfold.graphs.onnx_files import load_graph
from headfold.ground import export_summary, manifest
from headfold.ground.artifacts import DECODE_GRAPH, DECODER_GRAPH, ENCODER_GRAPH, ENGINE_SUFFIXES, MODEL_GRAPH, PREFILL_GRAPH, engine_name
from headfold.ground.errors import BadInput
from headfold.ground.hashing import sha256_file
from headfold.ground.inputs import check_links
from headfold.ground.precision import Precision
from headfold.verification.runners import BaseRunner, OnnxRuntimeRunner, TorchRunner
from headfold.verification.seq2seq import Seq2SeqOnnxRunner
from headfold.verification.tensorrt_runner import TensorRTRunner

GRAPHS = (PREFILL_GRAPH, MODEL_GRAPH)  # the full-sequence graph of a decoder / an encoder
PREFILL_ENGINE, DECODE_ENGINE = engine_name(PREFILL_GRAPH), engine_name(DECODE_GRAPH)  # the pair after `headfold build`
ENGINES = tuple(map(engine_name, GRAPHS))  # in a `headfold build` folder, like GRAPHS


@dataclass(frozen=True)
class Artifact:
    path: Path
    kind: str  # "checkpoint" | "onnx" | "engine"
    model: Path | None  # the checkpoint folder of this model; None for an ONNX file of unknown origin
    precision: Precision
    decode: Path | None = None  # a decoder's decode graph or engine (KV cache), next to its prefill one
    graph: Path | None = None  # an engine's source graph
    pair: Path | None = None  # an encoder-decoder export's decoder.onnx, run after the encoder.onnx in `path`
    shared_cache: bool = False  # its decode graph writes K/V in place into shared past/present buffers (GroupQueryAttention)

    @property
    def reads(self) -> list[Path]:
        """The files and folders running this artifact reads."""
        return [p for p in (self.path, self.model, self.decode, self.graph, self.pair) if p is not None]

    def runner(self, decode_steps: int = 0) -> BaseRunner:
        """Its runner; an encoder-decoder export's feeds its target's last `decode_steps` tokens one at a time."""
        if self.pair is not None:
            return Seq2SeqOnnxRunner(self.path, self.pair, decode_steps)
        return _runner(self.kind, self.path)

    def decode_runner(self) -> BaseRunner:
        """The runner of the decode graph or engine paired with this prefill one."""
        if self.decode is None:
            raise ValueError(f"{self.path} has no decode graph")
        return _runner(self.kind, self.decode)

    @property
    def is_conversion(self) -> bool:
        return self.model is not None and manifest.exists(self.model)

    def describe(self) -> dict[str, Any]:
        """Path, kind, precision, head counts and the sha256 of the file that identifies it."""
        key_file = self.path / "config.json" if self.kind == "checkpoint" else self.path
        info: dict[str, Any] = {
            "path": str(self.path),
            "kind": self.kind,
            "model": str(self.model) if self.model else None,
            "precision": self.precision,
            f"{key_file.name}_sha256": sha256_file(key_file),
        }
        for other in (self.decode, self.pair):
            if other is not None and other != self.path:
                info[f"{other.name}_sha256"] = sha256_file(other)
        if self.model is not None:
            info |= attention_info(self.model, self.precision)
        if self.kind == "engine":
            info["engine"] = load_sidecar(self.path).summary()
        if self.model is not None and self.is_conversion:
            info["conversion"] = conversion_manifest(self.model).conversion.to_dict()
        return info


def _runner(kind: str, path: Path) -> BaseRunner:
    if kind == "engine":
        return TensorRTRunner(path)
    return TorchRunner(path) if kind == "checkpoint" else OnnxRuntimeRunner(path)


def attention_info(checkpoint: Path, precision: Precision) -> dict[str, Any]:
    """Heads, kv heads (one count, or one per layer) and the KV-cache bytes per token they imply at `precision`."""
    facts = CheckpointFacts.read(checkpoint)
    cache = facts.cache_bytes_per_token(int(precision.computed_in.itemsize))  # int4 weights keep their K/V cache in fp32
    info = {"heads": facts.heads, "kv_heads": collapse(facts.kv_heads), "kv_cache_bytes_per_token": cache["self"]}
    return info | ({"cross_cache_bytes_per_source_token": cache["cross"]} if "cross" in cache else {})  # an encoder-decoder's, per source token


def conversion_manifest(model: Path) -> manifest.Manifest:
    """headfold.json of a converted checkpoint; BadInput when it is corrupt."""
    return manifest.load(model)


def _decode_graph(graph: Path, summary: export_summary.ExportSummary) -> Path | None:
    """The graph that continues from `graph`'s cache: itself for a merged decoder graph, decode.onnx
    for a split export's prefill graph, else None."""
    if graph.name == MODEL_GRAPH and summary.layout == "merged":
        return graph
    decode = graph.parent / DECODE_GRAPH
    paired = graph.name == PREFILL_GRAPH and DECODE_GRAPH in summary.graphs
    return decode if paired and decode.is_file() else None


def _onnx_artifact(graph: Path) -> Artifact:
    load_graph(graph)  # empty, garbage, or weights outside its folder: one line, before ONNX Runtime sees it
    if not export_summary.exists(graph.parent):
        return Artifact(graph, "onnx", None, Precision.FP32)
    summary = export_summary.load(graph.parent)
    model = export_summary.export_source(summary, graph.parent)
    if summary.layout == "seq2seq":  # either graph stands for the pair
        encoder, decoder = graph.with_name(ENCODER_GRAPH), graph.with_name(DECODER_GRAPH)
        for part in (encoder, decoder):
            if part != graph:
                load_graph(part)
        return Artifact(encoder, "onnx", model, summary.dtype, pair=decoder)
    decode = _decode_graph(graph, summary)
    shared = decode == graph and summary.attention == "ort-gqa"  # genai_config.json's past_present_share_buffer
    return Artifact(graph, "onnx", model, summary.dtype, decode, shared_cache=shared)


def _engine_artifact(engine: Path) -> Artifact:
    """An engine's model is its source graph's; its precision the one it was built in."""
    info = load_sidecar(engine)
    graph = source_onnx(engine, info)
    decode = engine.with_name(DECODE_ENGINE)  # `headfold build` writes the pair side by side
    paired = engine.name == PREFILL_ENGINE and decode.is_file()
    return Artifact(engine, "engine", _onnx_artifact(graph).model if graph else None, info.precision.name, decode if paired else None, graph)


def resolve(path: Path) -> Artifact:
    """Classify a path; BadInput for anything headfold cannot run."""
    if path.is_dir() and (path / "config.json").is_file():
        return Artifact(path.resolve(), "checkpoint", path.resolve(), CheckpointFacts.read(path).precision)
    if path.is_dir() and export_summary.exists(path):
        check_links(path, "export folder")
        graph = next((path / g for g in (*GRAPHS, ENCODER_GRAPH) if (path / g).is_file()), None)
        if graph is None:
            raise BadInput(f"export folder {path} has neither {' nor '.join(GRAPHS)}; re-run headfold export")
        return _onnx_artifact(graph.resolve())
    if path.is_file() and path.suffix == ".onnx":
        return _onnx_artifact(path.resolve())
    if path.is_file() and path.suffix in ENGINE_SUFFIXES:
        return _engine_artifact(path.resolve())
    engine = next((path / e for e in ENGINES if (path / e).is_file()), None) if path.is_dir() else None
    if engine is not None:
        return _engine_artifact(engine.resolve())
    if not path.exists():
        raise BadInput(f"{path} does not exist")
    raise BadInput(f"{path} is not a checkpoint folder (config.json), an export folder (export.json), a .onnx file or a .engine")


def _converted_from(reference: Path, candidate: Path) -> bool:
    return conversion_manifest(candidate).source.config_sha256 == sha256_file(reference / "config.json")


def check_kind(reference: Artifact, candidate: Artifact, requested: str = "auto") -> str:
    """ "fidelity" or "loss" for this pair; `requested` other than auto is taken as is."""
    if reference.model is None and candidate.model is None:
        raise BadInput("neither side names a checkpoint (tokenizer, vocabulary); pass a checkpoint folder or an export folder")
    if requested != "auto":
        return requested
    if reference.model == candidate.model or reference.model is None or candidate.model is None:
        # an ONNX file of unknown origin is taken to be the other side's export
        return "loss" if Precision.INT4 in (reference.precision, candidate.precision) else "fidelity"
    if candidate.is_conversion and _converted_from(reference.model, candidate.model):
        return "loss"
    if candidate.is_conversion:
        raise BadInput(
            f"{candidate.path} was converted from another model than {reference.path} (config.json differs); pass --check loss to compare them anyway"
        )
    raise BadInput(
        f"cannot tell how {reference.path} and {candidate.path} relate (neither the same model nor a headfold "
        "conversion of it); pass --check fidelity or --check loss"
    )
