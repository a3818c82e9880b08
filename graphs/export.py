"""Export a (converted) checkpoint to ONNX with one fused, GQA-shaped `Attention` node per layer.

Decoders get one merged graph by default, model.onnx: input_ids [B, S], attention_mask [B, P + S]
and past K/V [B, kvᵢ, P, d] with P ≥ 0 → logits, present K/V, so a prompt (P = 0), one generated
token and multi-token appends after a past all run through it; beside it genai_config.json and the
checkpoint's tokenizer files make the folder an onnxruntime-genai model (graphs.genai). With
graphs="split" they get prefill.onnx (no past) and decode.onnx (one new token + past), the pair
TensorRT profiles want. Encoders get model.onnx (→ last_hidden_state). Encoder-decoders get
encoder.onnx (source → cross-attention K/V, computed once) and one merged decoder.onnx
(graphs.seq2seq). Each graph is exported by
torch.onnx (dynamo), rewritten by headfold.graphs.rewrite, checked, and saved with external
weights; export.json summarises them.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import onnx
import onnx_ir as ir
import torch
import transformers
from torch import nn
from torch.export import Dim
from tqdm import tqdm
from transformers.cache_utils import DynamicCache

from headfold.converter.checkpoint import CheckpointFacts, TensorInfo
from headfold.converter.modeling import hollow_model
from headfold.converter.per_layer import collapse
from headfold.converter.sources import checkpoint_folder
from headfold.graphs import seq2seq as seq2seq_graphs
from headfold.graphs.genai import copy_tokenizer, seq2seq_genai_blocker, write_model_folder
from headfold.graphs.rewrite import ATTENTION_OPS, AttentionKind, attention_op, optimize, ort_gqa
from headfold.graphs.rewrite.decompose import decompose
from headfold.graphs.rewrite.int4 import BLOCK_SIZES, Int4, quantize_weights
from headfold.graphs.rewrite.ort_fusions import fuse_for_ort
from headfold.graphs.template import TRACED_LAYERS, LayerTemplate, NotAlike
from headfold.graphs.trt_lint import rule_set
from headfold.graphs.weights import attach, fake_parameters, optimize_like_torch, reused_buffers
from headfold.ground.artifacts import DECODE_GRAPH, MODEL_GRAPH, PREFILL_GRAPH
from headfold.ground.atomic import atomic_output, check_output
from headfold.ground.cache_names import PAST, PRESENT, cache_names
from headfold.ground.errors import BadInput, HeadfoldError, first_line
from headfold.ground.export_summary import ExportSummary
from headfold.ground.precision import Precision
from headfold.ground.settings import OPSETS, ExportOptions

__all__ = [
    "export",
    "export_graph",
    "torch_export",
    "decoder_graphs",
    "visible_keys",
    "GRAPH_LAYOUTS",
    "encoder_graphs",
    "positions_from_mask",
    "POSITION_IDS",
    "check_opset",
    "check_options",
    "OPSETS",
    "ATTENTION_CHOICES",
    "OPTIMIZATIONS",
    "AttentionChoice",
    "choose_attention",
]

log = logging.getLogger(__name__)


WRAPPED = "model"  # the attribute the graph modules below keep the transformers model in: its parameters' prefix
# Example sizes for tracing; all are dynamic in the graph. Avoid 0/1, which torch.export specialises.
_BATCH, _SEQUENCE, _PAST = 2, 7, 5


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens (left padding allowed), as transformers' generate does.

    Passing them explicitly (B, S) also keeps torch.onnx from fusing RotaryEmbedding with a
    batch-1 cos cache, which fails in ORT for batch > 1. The count runs in float32 (exact up to
    2^24 tokens) because TensorRT documents CumSum for float types only.
    """
    counted = attention_mask.float().cumsum(-1).long()
    return (counted - 1).masked_fill(attention_mask == 0, 1)


class Prefill(nn.Module):
    """input_ids, attention_mask → logits, present.{i}.key, present.{i}.value (kv-heads)."""

    def __init__(self, model: transformers.PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions_from_mask(attention_mask),
            cache=cache,
            use_cache=True,
        )
        return (out.logits, *seq2seq_graphs.cache_tensors(cache))


class Decode(nn.Module):
    """One new token: input_ids (B, 1), attention_mask (B, past + 1), past K/V → logits, present K/V."""

    def __init__(self, model: transformers.PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = DynamicCache(list(zip(past[0::2], past[1::2], strict=True)), config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions_from_mask(attention_mask)[:, -1:],
            cache=cache,
            use_cache=True,
        )
        return (out.logits, *seq2seq_graphs.cache_tensors(cache))


def visible_keys(attention_mask: torch.Tensor, new_tokens: int, window: int | None = None) -> torch.Tensor:
    """[B, 1, S, P + S] bool: which keys each of the S new tokens attends to.

    Causal aligned bottom-right (new token i sits at column P + i) and real keys only, so left,
    right and gapped padding all work with any past. Every token also sees its own column: a pad
    query would otherwise see no key at all, and its NaN would reach the real rows through the
    cache. An explicit mask instead of `is_causal` keeps S dynamic (torch cannot trace is_causal
    for a symbolic length).

    A sliding `window` keeps the keys whose position (counted over real tokens, as the rotary
    positions are) lies less than `window` before the token's own: the last `window` tokens of its
    row, itself included, whatever pads lie between them. That is transformers' sliding-window mask
    for unpadded, left- and right-padded rows, and what each row computes alone for gapped ones
    (a right-padded prompt followed by generated tokens), where transformers would count the pads.
    """
    total = attention_mask.shape[1]
    keys = torch.arange(total, device=attention_mask.device)
    queries = torch.arange(total - new_tokens, total, device=attention_mask.device)[:, None]  # S exactly, not a slice
    causal_real = (keys <= queries) & attention_mask.bool()[:, None, None, :]
    if window is not None:
        positions = positions_from_mask(attention_mask)
        causal_real = causal_real & (positions[:, None, None, :] > positions[:, None, -new_tokens:, None] - window)
    return causal_real | (keys == queries)


FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # transformers' config.layer_types


def attention_windows(config: transformers.PretrainedConfig, layers: int) -> list[int | None]:
    """Each layer's sliding window (the keys a token sees, itself included), None where it sees all
    before it: config.layer_types where the config has them, else config.sliding_window in every
    layer, as transformers' models pick their masks and size their caches. BadInput for a layer type
    headfold has no mask for."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or [SLIDING_ATTENTION if window is not None else FULL_ATTENTION] * layers
    if unknown := sorted(set(kinds) - {FULL_ATTENTION, SLIDING_ATTENTION}):
        raise BadInput(f"config.layer_types has {unknown[0]!r} layers, which headfold cannot export; it exports {FULL_ATTENTION} and {SLIDING_ATTENTION}")
    return [window if kind == SLIDING_ATTENTION else None for kind in kinds]


def layer_masks(attention_mask: torch.Tensor, new_tokens: int, windows: Sequence[int | None]) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask each layer attends with: one for all when the layers' windows agree, else one per
    layer type, the mapping transformers' models with config.layer_types take."""
    if len(set(windows)) <= 1:
        return visible_keys(attention_mask, new_tokens, windows[0] if windows else None)
    window = next(w for w in windows if w is not None)
    return {FULL_ATTENTION: visible_keys(attention_mask, new_tokens), SLIDING_ATTENTION: visible_keys(attention_mask, new_tokens, window)}


class Decoder(nn.Module):
    """The merged graph: input_ids (B, S), attention_mask (B, P + S), past K/V (B, kvᵢ, P, d), P ≥ 0
    → logits (B, S, V), present K/V (B, kvᵢ, P + S, d).

    With `position_ids` a position_ids (B, S) input follows attention_mask and the rotary
    positions are taken from it; otherwise they are counted over the mask's real tokens. Sliding
    windows (`windows`, one per layer) are in the masks; the cache keeps every token.
    """

    def __init__(self, model: transformers.PreTrainedModel, position_ids: bool = False, windows: Sequence[int | None] = ()) -> None:
        super().__init__()
        self.model = model
        self.position_ids = position_ids
        self.windows = list(windows)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        positions, past = (rest[0], rest[1:]) if self.position_ids else (None, rest)
        cache = DynamicCache(list(zip(past[0::2], past[1::2], strict=True)))  # no config: no layer drops what its window no longer sees
        new_tokens = input_ids.shape[1]
        if positions is None:
            positions = positions_from_mask(attention_mask)[:, -new_tokens:]
        out = self.model(
            input_ids=input_ids,
            attention_mask=layer_masks(attention_mask, new_tokens, self.windows),
            position_ids=positions,
            cache=cache,
            use_cache=True,
        )
        return (out.logits, *seq2seq_graphs.cache_tensors(cache))


class Encoder(nn.Module):
    """input_ids, attention_mask [, token_type_ids] → last_hidden_state."""

    def __init__(self, model: transformers.PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *token_type_ids: torch.Tensor) -> torch.Tensor:
        types = token_type_ids[0] if token_type_ids else None
        return self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=types).last_hidden_state


@dataclass
class GraphSpec:
    """One graph to export: the module, example inputs, names and dynamic axes."""

    file: str
    module: nn.Module
    args: tuple[torch.Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    dynamic_shapes: tuple
    # An encoder-decoder's graph holds several attentions per numbered module: which blocks, their
    # kv heads and each node's block index (graphs.seq2seq); None: one attention per layer.
    blocks: seq2seq_graphs.GraphBlocks | None = None


def _example_tokens(config: transformers.PretrainedConfig, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return ids, torch.ones(batch, seq, dtype=torch.long)


GRAPH_LAYOUTS = ("merged", "split")


POSITION_IDS = "position_ids"


def decoder_graphs(model: transformers.PreTrainedModel, layers: int, layout: str = "merged", *, position_ids: bool = False) -> list[GraphSpec]:
    """The merged graph (model.onnx), with a position_ids input if `position_ids` and each
    layer's sliding window in its mask, or prefill.onnx + decode.onnx for layout="split"."""
    batch, sequence, past = Dim("batch"), Dim("sequence"), Dim("past_sequence")
    ids, mask = _example_tokens(model.config, _BATCH, _SEQUENCE)
    prefill = Prefill(model)
    with torch.no_grad():  # only the past's shapes matter (the model may be hollow: fake parameters), all _PAST long
        past_kv = tuple(torch.zeros(*t.shape[:2], _PAST, *t.shape[3:], dtype=t.dtype) for t in prefill(*_example_tokens(model.config, _BATCH, _PAST))[1:])
    kv_axes = {0: batch, 2: past}
    if layout == "merged":
        mask = torch.ones(_BATCH, _PAST + _SEQUENCE, dtype=torch.long)
        positions = (positions_from_mask(mask)[:, -_SEQUENCE:],) if position_ids else ()
        position_axes = ({0: batch, 1: sequence},) if position_ids else ()
        return [
            GraphSpec(
                MODEL_GRAPH,
                Decoder(model, position_ids, attention_windows(model.config, layers)),
                (ids, mask, *positions, *past_kv),
                ["input_ids", "attention_mask", *[POSITION_IDS] * len(positions), *cache_names(PAST, layers)],
                ["logits", *cache_names(PRESENT, layers)],
                # P + S as its own symbol: torch.export's derived dims take one symbol only; *rest is one tuple
                ({0: batch, 1: sequence}, {0: batch, 1: Dim("total_sequence")}, (*position_axes, *(kv_axes,) * len(past_kv))),
            )
        ]
    return [
        GraphSpec(
            PREFILL_GRAPH,
            prefill,
            (ids, mask),
            ["input_ids", "attention_mask"],
            ["logits", *cache_names(PRESENT, layers)],
            ({0: batch, 1: sequence}, {0: batch, 1: sequence}),
        ),
        GraphSpec(
            DECODE_GRAPH,
            Decode(model),
            (ids[:, :1], torch.ones(_BATCH, _PAST + 1, dtype=torch.long), *past_kv),
            ["input_ids", "attention_mask", *cache_names(PAST, layers)],
            ["logits", *cache_names(PRESENT, layers)],
            ({0: batch}, {0: batch, 1: past + 1}, (kv_axes,) * len(past_kv)),  # *past is one tuple
        ),
    ]


def encoder_graphs(model: transformers.PreTrainedModel) -> list[GraphSpec]:
    batch, sequence = Dim("batch"), Dim("sequence")
    ids, mask = _example_tokens(model.config, _BATCH, _SEQUENCE)
    inputs, names = [ids, mask], ["input_ids", "attention_mask"]
    if getattr(model.config, "type_vocab_size", 0) > 1:  # segment embeddings are trained: expose them
        inputs.append(torch.zeros_like(ids))
        names.append("token_type_ids")
    axes = {0: batch, 1: sequence}
    dynamic = (axes, axes, (axes,) * (len(inputs) - 2))  # *token_type_ids is one tuple
    return [GraphSpec(MODEL_GRAPH, Encoder(model), tuple(inputs), names, ["last_hidden_state"], dynamic)]


def encoder_decoder_graphs(model: transformers.PreTrainedModel, facts: CheckpointFacts) -> list[GraphSpec]:
    """encoder.onnx and decoder.onnx, each checked for one fused node per attention block it holds."""
    return [
        GraphSpec(file, module, args, inputs, outputs, dynamic, seq2seq_graphs.GraphBlocks(facts, file))
        for file, module, args, inputs, outputs, dynamic in seq2seq_graphs.seq2seq_graphs(model, facts)
    ]


def check_opset(opset: int) -> None:
    if opset not in OPSETS:
        why = (
            f"torch.onnx writes an invalid model above {OPSETS[-1]} (opset_import 18 next to Attention nodes)"
            if opset > OPSETS[-1]
            else f"the fused Attention op exists from opset {OPSETS[0]} on"
        )
        raise BadInput(f"opset {opset} is not supported: {why}; use --opset {', '.join(map(str, OPSETS[:-1]))} or {OPSETS[-1]}")


def parse_dtype(dtype: Precision | str | None) -> Precision | None:
    """--dtype as export takes it (None: the checkpoint's own); BadInput for a precision it does not know."""
    return None if dtype is None else Precision.parse(dtype, "--dtype")


def int4_settings(dtype: Precision | None, block_size: int | None, symmetric: bool | None, trt_version: str | None = None) -> Int4 | None:
    """The int4 quantization `--dtype int4` asks for (defaults: Int4's); BadInput for settings without
    it, a block size MatMulNBits does not take, or a TensorRT target."""
    if dtype == Precision.INT4 and trt_version:
        raise BadInput("--dtype int4 writes ONNX Runtime's MatMulNBits, which TensorRT cannot parse; drop --dtype int4 or --trt-version")
    if dtype != Precision.INT4:
        if block_size is not None or symmetric is not None:
            raise BadInput("--int4-block-size and --int4-symmetric/--int4-asymmetric set up --dtype int4; add it or drop them")
        return None
    if block_size is not None and block_size not in BLOCK_SIZES:
        raise BadInput(f"--int4-block-size {block_size}: MatMulNBits takes {', '.join(map(str, BLOCK_SIZES))}")
    defaults = Int4()
    return Int4(block_size=block_size or defaults.block_size, symmetric=defaults.symmetric if symmetric is None else symmetric)


def torch_export(spec: GraphSpec, opset: int, weights: dict[str, TensorInfo] | None = None, template: LayerTemplate | None = None) -> ir.Model:
    """torch.onnx's graph for `spec`, optimized as torch.onnx does; `weights` (parameter name in
    spec.module → checkpoint tensor) give a hollow model's parameters their values (graphs.weights).
    With a `template`, spec is the model cut to its traced layers, and the graph gets the others as
    copies of its layer 1 (graphs.template; NotAlike when it cannot)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # torch.onnx warns per op about missing optional packages
        program = torch.onnx.export(
            spec.module,
            spec.args,
            dynamo=True,
            opset_version=opset,
            input_names=spec.input_names,
            output_names=spec.output_names,
            dynamic_shapes=spec.dynamic_shapes,
            verbose=False,
            optimize=False,  # below, once the weights are attached
        )
    assert program is not None  # dynamo=True returns the program
    attach(program.model, weights or {}, lazy_prefixes=template.lazy_prefixes() if template else ())
    optimize_like_torch(program.model)
    if template is not None:
        template.replicate(program.model, weights or {})
    return program.model


def save(model: ir.Model, path: Path, *, progress: bool = False) -> None:
    """Weights to `<name>.data` next to the graph, one at a time (lazy ones read from the checkpoint
    as they are written); the checker reads both (path-based)."""
    with tqdm(desc=f"{path.name} weights", unit="tensor", disable=not progress) as bar:

        def written(tensor: ir.TensorProtocol, info: ir.external_data.CallbackInfo) -> None:
            bar.total = info.total
            bar.set_postfix_str(tensor.name or "", refresh=False)
            bar.update()

        with reused_buffers():
            ir.save(model, path, external_data=f"{path.name}.data", callback=written)
    onnx.checker.check_model(str(path))


def export_graph(
    spec: GraphSpec,
    folder: Path,
    *,
    opset: int,
    kv_heads: int | Sequence[int],
    layers: int,
    attention: AttentionKind = "onnx",
    trt_version: str | None = None,
    ort_fusions: bool = False,
    positions: int | None = None,
    int4: Int4 | None = None,
    weights: dict[str, TensorInfo] | None = None,
    template: LayerTemplate | None = None,
    windows: Sequence[int | None] = (),
    progress: bool = False,
) -> dict:
    """Export, rewrite, check and save one graph; return its summary.

    `windows` are each layer's sliding window, which the graph's masks hold and ORT's
    GroupQueryAttention (attention="ort-gqa") takes as its local_window_size.

    With `ort_fusions`, ONNX Runtime's fused ops follow (graphs/rewrite/ort_fusions), counted;
    `positions` (the context length) sizes the rotary tables GroupQueryAttention then takes. With
    `int4`, MatMul weights then become MatMulNBits, each quantized as it is saved (graphs/rewrite/int4).
    `weights` stream a hollow model's parameters from the checkpoint, and a `template` copies its
    traced layer 1 as the later layers (torch_export).

    With `trt_version`, ops that version's TensorRT parser lacks are then decomposed into
    primitives (graphs/rewrite/decompose); the fused attention nodes stay.
    """
    start = time.perf_counter()
    model = torch_export(spec, opset, weights, template)
    exported = time.perf_counter()
    graph, layer_of = spec.file, None
    if spec.blocks is not None:
        kv_heads, layers, graph, layer_of = spec.blocks.kv_heads, len(spec.blocks.kv_heads), spec.blocks.label, spec.blocks.layer_of
    report = optimize(model, kv_heads=kv_heads, layers=layers, graph=graph, attention=attention, layer_of=layer_of, windows=windows)
    decomposed = {op: n for op, n in decompose(model, trt_version).items() if n} if trt_version else {}
    fused_for_ort = fuse_for_ort(model, positions=positions) if ort_fusions else None
    quantized = quantize_weights(model, int4) if int4 is not None else None
    rewritten = time.perf_counter()
    save(model, folder / spec.file, progress=progress)
    saved = time.perf_counter()
    summary = {
        "inputs": [value.name for value in model.graph.inputs],
        "outputs": [value.name for value in model.graph.outputs],
        "fusions": report.fusions,
        "attention_nodes": len(report.attention),
        "attention_op": attention_op(attention),
        "attention_kv_heads": [node.kv_heads for node in report.attention],
        "torch_export_s": round(exported - start, 2),
        "rewrite_s": round(rewritten - exported, 2),
        "save_s": round(saved - rewritten, 2),  # the weights streamed from the checkpoint
    }
    if template is not None:  # the later layers are copies of the traced layer 1 (graphs.template)
        summary["traced_layers"] = TRACED_LAYERS
    if fused_for_ort is not None:
        summary["ort_fusions"] = fused_for_ort
    if quantized is not None:
        summary["int4"] = quantized
    if decomposed:  # only when the version lacks an op a rule covers
        summary["decomposed_for_tensorrt"] = {"version": trt_version, **decomposed}
    return summary


def _layout(facts: CheckpointFacts, graphs: str, *, attention: str, optimize: str | None, position_ids: bool, trt_version: str | None) -> str:
    """The export's layout (export.json "layout"): merged | split (decoders), encoder, seq2seq; BadInput
    for an option the checkpoint's kind has no graph for."""
    src = facts.folder
    if facts.kind == "decoder":
        return graphs
    kind = "an encoder-decoder" if facts.kind == "seq2seq" else "an encoder"
    if attention == "ort-gqa":
        raise BadInput(f"--attention ort-gqa is for decoders (ORT's GroupQueryAttention is causal); {src} is {kind}")
    if position_ids:
        raise BadInput(f"position_ids is an input of decoder graphs; {src} is {kind}")
    if facts.kind == "encoder":
        return "encoder"
    if trt_version:  # before --graphs: graph_layout makes --trt-version's default layout split
        raise BadInput(f"--trt-version targets headfold build, which takes decoder and encoder exports; drop it for the encoder-decoder {src}")
    if graphs != "merged":
        raise BadInput(f"{src} is an encoder-decoder: export writes encoder.onnx and one merged decoder.onnx; drop --graphs {graphs}")
    if optimize == "ort":
        raise BadInput(f"--optimize {optimize} is for decoders and encoders; drop it for the encoder-decoder {src}")
    return "seq2seq"


ATTENTION_CHOICES = ("auto", *ATTENTION_OPS)
OPTIMIZATIONS = ("auto", "ort", "none")
ORT_DEFAULT = "the default for ONNX Runtime and onnxruntime-genai: GroupQueryAttention writes each step's K/V in place into one shared past/present buffer"


@dataclass(frozen=True)
class AttentionChoice:
    """The fused attention op an export writes, and why (export.json records both per graph)."""

    kind: AttentionKind
    reason: str

    def optimization(self, requested: str | None) -> str | None:
        """The --optimize that applies: "auto" is ORT's fusions on a GroupQueryAttention graph (what
        onnxruntime-genai's builder writes) and none on the portable standard graph."""
        if requested == "auto":
            return "ort" if self.kind == "ort-gqa" else None
        return None if requested == "none" else requested


def choose_attention(facts: CheckpointFacts, requested: str, *, layout: str, trt_version: str | None) -> AttentionChoice:
    """ "auto": GroupQueryAttention for a merged decoder graph (the folder users deploy in ONNX Runtime
    and onnxruntime-genai) where the op computes the family's attention, else the standard
    Attention (TensorRT targets, split graphs, encoders, encoder-decoders, ALiBi). "onnx" and
    "ort-gqa" are taken as asked; BadInput where ort-gqa cannot compute the model or its target."""
    if requested not in ATTENTION_CHOICES:
        raise BadInput(f"unknown attention kind {requested!r}; use one of {', '.join(ATTENTION_CHOICES)}")
    why_not = ort_gqa.inexpressible(facts)
    if requested == "ort-gqa":
        if trt_version:
            raise BadInput("--attention ort-gqa writes ONNX Runtime's own GroupQueryAttention, which TensorRT cannot parse; drop --attention or --trt-version")
        if why_not:
            raise BadInput(f"--attention ort-gqa cannot export {facts.folder}: {why_not}; drop --attention to get the standard Attention graph")
    if requested != "auto":
        return AttentionChoice(cast(AttentionKind, requested), f"requested (--attention {requested})")  # one of them, checked above
    if why_not:
        return AttentionChoice("onnx", why_not)
    if trt_version:
        return AttentionChoice("onnx", f"a TensorRT {trt_version} target: its parser takes the standard Attention op")
    if layout != "merged":
        return AttentionChoice("onnx", "split graphs are the pair headfold build makes TensorRT engines of: the standard Attention op")
    return AttentionChoice("ort-gqa", ORT_DEFAULT)


def _check_windows(windows: Sequence[int | None], layout: str, trt_version: str | None, src: Path) -> None:
    """BadInput for an option whose graphs cannot hold the layers' sliding windows: only the merged
    graph's masks carry them (TensorRT builds take the split graphs)."""
    if (window := next((w for w in windows if w is not None), None)) is None:
        return
    has = f"{src} has sliding-window attention (sliding_window={window}), which headfold carries in the merged graph's mask only"
    if trt_version:
        raise BadInput(f"{has}, and TensorRT engines are built from split graphs; drop --trt-version and run the merged graph in ONNX Runtime")
    if layout == "split":
        raise BadInput(f"{has}; drop --graphs split")


@contextmanager
def _answered_for_unconverted(facts: CheckpointFacts) -> Iterator[None]:
    """torch.onnx failing on a family headfold has no spec for is an answer about the model, not a bug."""
    try:
        yield
    except HeadfoldError:
        raise
    except Exception as err:
        if facts.spec is not None:
            raise
        root: BaseException = err
        while root.__cause__ is not None:
            root = root.__cause__
        raise BadInput(
            f"torch.onnx cannot export this {facts.config.get('model_type')!r} model ({first_line(root)}); "
            f"headfold exports it unconverted only where torch.onnx traces it as it is"
        ) from None


def _export_all(
    specs: Callable[[int], list[GraphSpec]],
    export_one: Callable[[GraphSpec, LayerTemplate | None], dict],
    template: Callable[[], LayerTemplate | None],
    layers: int,
    *,
    progress: bool,
) -> dict[str, dict]:
    """Each graph's summary: traced from the template's layers when the model's layers are alike and
    its traced layers prove the copies (graphs.template), else from all `layers`, with why in
    "traced_whole"."""
    try:
        if (alike := template()) is not None:
            with alike.traced() as traced:
                return {spec.file: export_one(spec, alike) for spec in tqdm(specs(traced), desc="export", unit="graph", disable=not progress)}
        why = None
    except NotAlike as err:
        why = str(err)
        log.debug("tracing every layer: %s", why)
    summaries = {spec.file: export_one(spec, None) for spec in tqdm(specs(layers), desc="export", unit="graph", disable=not progress)}
    return {file: summary | ({"traced_whole": why} if why else {}) for file, summary in summaries.items()}


def _traceable_model(facts: CheckpointFacts, dtype: Precision) -> tuple[transformers.PreTrainedModel, dict[str, TensorInfo]]:
    """The model to trace in `dtype` (int4: fp32, its MatMul weights quantized as they are saved),
    hollow (fake parameters), and where each of its parameters' values lies in the checkpoint, by its
    name in every graph module (they keep the model as `WRAPPED`): streamed into .onnx.data as each
    graph is saved."""
    model, plan = hollow_model(facts, dtype.computed_in.torch_dtype)
    fake_parameters(model)
    index = facts.tensor_index().tensors
    return model, {f"{WRAPPED}.{name}": index[tensor] for name, tensor in plan.items()}


def graph_layout(graphs: str | None, trt_version: str | None) -> str:
    """The decoder layout asked for: `graphs`, or by default the split pair for a TensorRT target (what
    build takes) and the merged onnxruntime-genai folder otherwise. The one place this is chosen."""
    return graphs or ("split" if trt_version else "merged")


def check_options(
    *,
    opset: int = ExportOptions.opset,
    dtype: Precision | str | None = None,
    attention: str = ExportOptions.attention,
    trt_version: str | None = None,
    graphs: str | None = None,
    optimize: str | None = ExportOptions.optimize,
    position_ids: bool = False,
    int4_block_size: int | None = None,
    int4_symmetric: bool | None = None,
) -> None:
    """What export refuses in its options alone, before the checkpoint is read (run: before its first stage)."""
    check_opset(opset)
    graphs = graph_layout(graphs, trt_version)
    if graphs not in GRAPH_LAYOUTS:
        raise BadInput(f"unknown graph layout {graphs!r}; use --graphs merged or --graphs split")
    if optimize not in (None, *OPTIMIZATIONS):
        raise BadInput(f"unknown optimization {optimize!r}; use --optimize {', '.join(OPTIMIZATIONS)}")
    if optimize == "ort" and trt_version:
        raise BadInput("--optimize ort writes ONNX Runtime's own ops, which TensorRT cannot parse; drop --optimize or --trt-version")
    if position_ids and graphs != "merged":
        raise BadInput("position_ids is an input of the merged graph only; drop it or use --graphs merged")
    if trt_version is not None:
        rule_set(trt_version)  # an unknown version is bad input before the slow part
    if attention not in ATTENTION_CHOICES:
        raise BadInput(f"unknown attention kind {attention!r}; use one of {', '.join(ATTENTION_CHOICES)}")
    int4_settings(parse_dtype(dtype), int4_block_size, int4_symmetric, trt_version)  # an unknown dtype: before the checkpoint is read


def export(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    opset: int = ExportOptions.opset,
    dtype: Precision | str | None = None,
    attention: str = ExportOptions.attention,
    revision: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    trt_version: str | None = None,
    graphs: str | None = None,
    optimize: str | None = ExportOptions.optimize,
    position_ids: bool = False,
    int4_block_size: int | None = None,
    int4_symmetric: bool | None = None,
) -> dict:
    """Export the checkpoint `src` (a folder, or a hub id ORG/NAME at `revision`) to ONNX graphs in
    `out_dir` (atomically); return the summary.

    The weights are never all in memory: the model (decoder, encoder or encoder-decoder) is traced
    hollow and each weight is streamed from the checkpoint into the `.onnx.data` of each graph that
    holds it, cast to `dtype` (default: the checkpoint's own, fp32 for fp64), as it is written
    (graphs.weights). dtype="int4" (decoders) quantizes the MatMul weights to 4 bits with ONNX
    Runtime's MatMulNBits quantizer, each as it is written (`int4_block_size`, default 32;
    `int4_symmetric`, default True), everything else fp32; export.json records it as "quantization".

    graphs="merged" (decoders) writes model.onnx, genai_config.json and the tokenizer files: an
    onnxruntime-genai model folder; graphs="split" writes prefill.onnx + decode.onnx instead; None:
    split for a `trt_version` target, else merged (graph_layout).
    optimize="ort" applies ONNX Runtime's fusions and records their counts per graph; "auto" (the
    default) applies them to GroupQueryAttention graphs only, "none" (or None) never.
    position_ids=True gives the merged graph a position_ids [B, S] input that the rotary
    positions come from (else they are counted over the mask's real tokens); genai_config names it.

    attention="auto" (the default) writes com.microsoft.GroupQueryAttention, with a shared K/V
    buffer in genai_config.json, into a merged decoder graph whose attention the op computes, and
    the standard Attention everywhere else (choose_attention; export.json says which and why per
    graph); "onnx" and "ort-gqa" ask for one. GroupQueryAttention graphs need unpadded or
    right-padded batches, as onnxruntime-genai feeds them (headfold.graphs.rewrite.ort_gqa).
    trt_version="10.14" decomposes the ops that TensorRT version cannot parse (RMSNormalization,
    RotaryEmbedding before 10.15) and records them per graph as "decomposed_for_tensorrt".
    Raises BadInput for unsupported opsets/dtypes/attention kinds and unloadable checkpoints,
    CheckFailed when a graph does not end up with exactly one fused attention node per layer
    with K/V at kv-heads.
    """
    dtype = parse_dtype(dtype)
    check_options(
        opset=opset, dtype=dtype, attention=attention, trt_version=trt_version, graphs=graphs, optimize=optimize,
        position_ids=position_ids, int4_block_size=int4_block_size, int4_symmetric=int4_symmetric,
    )  # fmt: skip
    int4 = int4_settings(dtype, int4_block_size, int4_symmetric, trt_version)
    graphs = graph_layout(graphs, trt_version)
    src, out = checkpoint_folder(src, revision=revision), Path(out_dir)
    out = check_output(out, overwrite=overwrite, sources=(src,))
    facts = CheckpointFacts.read(src)
    layout = _layout(facts, graphs, attention=attention, optimize=optimize, position_ids=position_ids, trt_version=trt_version)
    if int4 is not None and facts.kind != "decoder":
        raise BadInput(
            f"--dtype int4 is for decoders (onnxruntime-genai's int4 folders); {src} is {'an encoder' if facts.kind == 'encoder' else 'an encoder-decoder'}"
        )
    choice = choose_attention(facts, attention, layout=layout, trt_version=trt_version)
    optimize = choice.optimization(optimize)
    dtype = dtype or facts.precision  # fp64 weights export as fp32
    model, weights = _traceable_model(facts, dtype)
    layers, heads, kv_heads = facts.layers, facts.heads, facts.kv_heads
    decoder = facts.kind == "decoder"
    windows = attention_windows(model.config, layers) if decoder else []
    _check_windows(windows, layout, trt_version, src)

    def specs(traced_layers: int) -> list[GraphSpec]:
        if layout == "seq2seq":
            return encoder_decoder_graphs(model, facts)
        return decoder_graphs(model, traced_layers, graphs, position_ids=position_ids) if decoder else encoder_graphs(model)

    def export_one(folder: Path, spec: GraphSpec, template: LayerTemplate | None) -> dict:
        summary = export_graph(
            spec, folder, opset=opset, kv_heads=kv_heads, layers=layers, attention=choice.kind, trt_version=trt_version,
            ort_fusions=optimize == "ort", positions=facts.positions if decoder else None,
            int4=int4, weights=weights, template=template, windows=windows, progress=progress,
        )  # fmt: skip
        return {**summary, "attention": choice.kind, "attention_reason": choice.reason}

    # An encoder-decoder's two stacks of layers are traced whole: the template copies one stack of one graph.
    template = partial(LayerTemplate.of, model, layers, WRAPPED) if layout != "seq2seq" else lambda: None
    summary = ExportSummary(
        source=str(src), model_type=model.config.model_type, opset=opset, dtype=dtype, attention=choice.kind, layers=layers,
        heads=heads, kv_heads=collapse(kv_heads), optimize=optimize, layout=layout, graphs={},
        quantization=int4.summary() if int4 is not None else None,
    )  # fmt: skip
    with atomic_output(out, overwrite=overwrite) as tmp, _answered_for_unconverted(facts):
        summary.graphs = _export_all(specs, partial(export_one, tmp), template, layers, progress=progress)
        summary.genai = _runtime_files(facts, tmp, model.config, layout, choice.kind, position_ids)
        summary.save_in(tmp)
    return summary.to_dict()


def _runtime_files(facts: CheckpointFacts, folder: Path, config, layout: str, attention: str, position_ids: bool) -> dict | None:
    """What a runtime needs beside the graphs: onnxruntime-genai's config and the tokenizer files (a merged
    decoder or an encoder-decoder genai runs: export.json's `genai`), else the tokenizer files alone, with
    why genai cannot run the folder where that is the reason."""
    blocker = seq2seq_genai_blocker(facts) if layout == "seq2seq" else None
    if layout in ("merged", "seq2seq") and blocker is None:
        return write_model_folder(facts, folder, config, MODEL_GRAPH, attention=attention, position_ids=position_ids)
    tokenizer_files = copy_tokenizer(facts.folder, folder)  # encoder and split graphs: ORT users tokenize with the folder's own files too
    return {"not_written": blocker, "tokenizer_files": tokenizer_files} if blocker is not None else None
