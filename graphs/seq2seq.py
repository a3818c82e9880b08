"""An encoder-decoder (T5, BART, Whisper) as two ONNX graphs, cross-attention K/V computed once per source.

encoder.onnx: the source (input_ids [B, T] + attention_mask [B, T]; Whisper: input_features
[B, mels, frames]) → encoder_hidden_states [B, T, D] and, for each decoder layer i, the
cross-attention's K/V present.{i}.encoder.key/value [B, kvᵢ, T, d] at its kv heads: the decoder's
own cross-attention projections applied to the encoder output, once per request.

decoder.onnx, the merged graph: input_ids [B, S], encoder_attention_mask [B, T] (not Whisper: its
encoder attends to every frame), past_key_values.{i}.decoder.key/value [B, kvᵢ, P, d] with P ≥ 0
and past_key_values.{i}.encoder.key/value (the encoder graph's outputs) → logits [B, S, V] and
present.{i}.decoder.key/value [B, kvᵢ, P + S, d]. The S new tokens attend causally to the past
and to each other, so a prompt (P = 0), one generated token and teacher-forced appends all run
through it; the target has no padding input (batch rows of unequal length end with pads the
caller ignores). Inside, the cross K/V fill transformers' EncoderDecoderCache as already
computed, so no cross projection of the encoder output is left in the graph.

Each attention (encoder self, decoder self, decoder cross) ends as one fused `Attention` node;
the nodes are told apart by the module scope the exporter records (spec paths per attention kind).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import transformers
from torch import nn
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from transformers.cache_utils import CacheLayerMixin, DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.seq2seq import DECODER_CROSS, DECODER_SELF, ENCODER_SELF
from headfold.graphs.rewrite import AttentionNode
from headfold.ground.artifacts import DECODER_GRAPH, ENCODER_GRAPH
from headfold.ground.cache_names import CROSS_HALF, PAST, PRESENT, SELF_HALF, cache_names
from headfold.ground.errors import BadInput

__all__ = ["GraphBlocks", "seq2seq_graphs", "source_names", "cross_names", "self_names", "ENCODER_OUTPUT", "ENCODER_MASK", "AUDIO_INPUT"]

ENCODER_OUTPUT = "encoder_hidden_states"
ENCODER_MASK = "encoder_attention_mask"
AUDIO_INPUT = "input_features"  # Whisper's main input: log-mel features
GRAPH_KINDS = {ENCODER_GRAPH: (ENCODER_SELF,), DECODER_GRAPH: (DECODER_SELF, DECODER_CROSS)}
# Example sizes for tracing (all dynamic but Whisper's frames); not 0/1, which torch.export specialises.
_BATCH, _SOURCE, _TARGET, _PAST = 2, 7, 5, 3


def source_names(audio: bool) -> list[str]:
    """The encoder's inputs: log-mel features (CheckpointFacts.audio_input), or token ids and their mask."""
    return [AUDIO_INPUT] if audio else ["input_ids", "attention_mask"]


def self_names(prefix: str, layers: int) -> list[str]:
    """past_key_values/present.{i}.decoder.key|value: the decoder self-attention's cache."""
    return cache_names(prefix, layers, SELF_HALF)


def cross_names(prefix: str, layers: int) -> list[str]:
    """past_key_values/present.{i}.encoder.key|value: the cross-attention's K/V of the source."""
    return cache_names(prefix, layers, CROSS_HALF)


def _pairs(flat: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(flat[0::2], flat[1::2], strict=True))


def cache_tensors(cache: DynamicCache) -> tuple[torch.Tensor, ...]:
    """A filled cache's tensors: each layer's keys, then its values (the graphs' past/present order)."""
    tensors: list[torch.Tensor] = []
    for layer in cache.layers:
        assert isinstance(layer, CacheLayerMixin) and layer.keys is not None and layer.values is not None  # filled by the forward
        tensors += (layer.keys, layer.values)
    return tuple(tensors)


def _zeros_like(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Real tensors of the shapes and dtypes of `tensors` (fake ones, from a hollow model)."""
    return tuple(torch.zeros(t.shape, dtype=t.dtype) for t in tensors)


@contextmanager
def _traceable(model: transformers.PreTrainedModel) -> Iterator[None]:
    """A hollow model's run (fake parameters) that branches on activation values cannot be traced
    either: bad input for that dtype (BART's encoder layers test in fp16 whether they are finite)."""
    try:
        yield
    except GuardOnDataDependentSymNode as err:
        where = re.search(r"Caused by: \((.*?)\)", str(err))
        dtype = str(model.dtype).removeprefix("torch.")
        raise BadInput(
            f"transformers' {model.config.model_type} code branches on its activations' values in {dtype}"
            f"{f' ({where.group(1)})' if where else ''}, which torch.export cannot trace; export with another --dtype (fp32, bf16)"
        ) from None


class Encoder(nn.Module):
    """source → encoder_hidden_states, cross K/V per decoder layer.

    The cross K/V come from one decoder step on the start token with an empty cache: transformers'
    own cross-attention fills the cache's cross half; the rest of that step reaches no output and
    the exporter's cleanup drops it.
    """

    def __init__(self, model: transformers.PreTrainedModel, audio: bool) -> None:
        super().__init__()
        self.model, self.audio = model, audio

    def forward(self, *source: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = dict(zip(source_names(self.audio), source, strict=True))
        hidden = self.model.get_encoder()(**inputs).last_hidden_state
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        start = torch.full((hidden.shape[0], 1), self.model.config.decoder_start_token_id, dtype=torch.long, device=hidden.device)
        self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=hidden), attention_mask=inputs.get("attention_mask"),
            decoder_input_ids=start, cache=cache, use_cache=True,
        )  # fmt: skip
        return (hidden, *cache_tensors(cache.cross_attention_cache))


class Decoder(nn.Module):
    """input_ids [, encoder_attention_mask], self past K/V, cross K/V → logits, present self K/V."""

    def __init__(self, model: transformers.PreTrainedModel, audio: bool) -> None:
        super().__init__()
        self.model, self.audio = model, audio

    def forward(self, input_ids: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mask, kv = (None, rest) if self.audio else (rest[0], rest[1:])
        half = len(kv) // 2
        cache = EncoderDecoderCache(DynamicCache(_pairs(kv[:half])), DynamicCache(_pairs(kv[half:])))
        # The cross K/V are in the cache (marked as computed): the encoder output is read for its shape only.
        source = kv[half].new_zeros(input_ids.shape[0], kv[half].shape[2], self.model.config.d_model)
        out = self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=source), attention_mask=mask,
            decoder_input_ids=input_ids, cache=cache, use_cache=True,
        )  # fmt: skip
        return (out.logits, *cache_tensors(out.cache.self_attention_cache))


class GraphBlocks:
    """The attention blocks one graph holds (check order), their kv heads, and which block a fused node is."""

    def __init__(self, facts: CheckpointFacts, file: str) -> None:
        self.blocks = [b for b in facts.blocks if b.kind in GRAPH_KINDS[file]]
        self.kv_heads = [b.shape.kv_heads for b in self.blocks]
        self.label = f"{file} ({', '.join(f'{b.kind} {b.layer}' for b in self.blocks)} in check order)"
        index = {(b.kind, b.layer): i for i, b in enumerate(self.blocks)}
        spec = facts.spec
        assert spec is not None  # an encoder-decoder headfold exports has its spec
        patterns = [(kind.name, spec.for_kind(kind).tensor_pattern("")) for kind in spec.attentions]

        def layer_of(node: AttentionNode) -> int:
            """The node's block index; -1 (reported as extra) for a node outside every attention module."""
            for kind, pattern in patterns:
                if node.module and (m := pattern.match(node.module + ".")):
                    return index.get((kind, int(m.group(2))), -1)
            return -1

        self.layer_of: Callable[[AttentionNode], int] = layer_of


def seq2seq_graphs(model: transformers.PreTrainedModel, facts: CheckpointFacts) -> list[tuple[str, nn.Module, tuple, list[str], list[str], tuple]]:
    """(file, module, example args, input names, output names, dynamic shapes) of encoder.onnx and decoder.onnx.

    `model` may be hollow (fake parameters: graphs.weights): the example past and cross K/V take only
    the shapes of its outputs, and the modules keep it as `model`, the prefix of their parameters' names.
    """
    batch, source_len, target, past_len = Dim("batch"), Dim("source_sequence"), Dim("sequence"), Dim("past_sequence")
    gen = torch.Generator().manual_seed(0)
    config = model.config
    audio, names = facts.audio_input, source_names(facts.audio_input)
    source: tuple[torch.Tensor, ...]
    source_axes: tuple[dict[int, Dim], ...]
    if audio:  # Whisper's encoder takes its full frame count only
        source = (torch.randn(_BATCH, facts.mel_bins, facts.audio_frames, generator=gen).to(model.dtype),)
        source_axes, cross_axes = ({0: batch},), {0: batch}
    else:
        ids = torch.randint(0, config.vocab_size, (_BATCH, _SOURCE), generator=gen)
        source = (ids, torch.ones_like(ids))
        source_axes, cross_axes = ({0: batch, 1: source_len},) * 2, {0: batch, 2: source_len}
    encoder, decoder = Encoder(model, audio), Decoder(model, audio)
    prompt = torch.randint(0, config.vocab_size, (_BATCH, _PAST), generator=gen)
    with torch.no_grad(), _traceable(model):  # only their shapes matter (the model may be hollow: its outputs fake tensors)
        cross = _zeros_like(encoder(*source)[1:])
        past = _zeros_like(cache_tensors(model(**dict(zip(names, source, strict=True)), decoder_input_ids=prompt, use_cache=True).cache.self_attention_cache))
    layers, mask = len(cross) // 2, source[1:]  # mask: the encoder attention mask, when there is one
    ids = torch.randint(0, config.vocab_size, (_BATCH, _TARGET), generator=gen)
    mask_axes = source_axes[1:]
    return [
        (ENCODER_GRAPH, encoder, source, names, [ENCODER_OUTPUT, *cross_names(PRESENT, layers)], (source_axes,)),
        (
            DECODER_GRAPH,
            decoder,
            (ids, *mask, *past, *cross),
            ["input_ids", *([ENCODER_MASK] if mask else []), *self_names(PAST, layers), *cross_names(PAST, layers)],
            ["logits", *self_names(PRESENT, layers)],
            ({0: batch, 1: target}, (*mask_axes, *({0: batch, 2: past_len},) * len(past), *(cross_axes,) * len(cross))),  # *rest is one tuple
        ),
    ]
