"""graphs.template's checks before tracing: a later layer whose non-parameter state differs from the
template's (attributes, buffers' values; the layer index apart) is named, layer 0 may differ."""

from __future__ import annotations

import pytest
import torch

from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.modeling import hollow_model
from headfold.graphs.template import TEMPLATE, TRACED_LAYERS, LayerTemplate, NotAlike

LAYERS = TRACED_LAYERS + 2


def hollow(tiny_checkpoint, family: str, **config) -> torch.nn.Module:
    model, _ = hollow_model(CheckpointFacts.read(tiny_checkpoint(family, num_hidden_layers=LAYERS, **config)), torch.float32)
    return model


def test_alike_layers_differ_in_their_index_only(tiny_checkpoint) -> None:
    model = hollow(tiny_checkpoint, "llama")
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(LAYERS))
    assert LayerTemplate.of(model, LAYERS, "model") is not None


def test_an_attribute_of_a_later_layer_is_named(tiny_checkpoint) -> None:
    model = hollow(tiny_checkpoint, "llama")
    scaling = model.model.layers[TEMPLATE].self_attn.scaling
    model.model.layers[0].self_attn.scaling = 0.5  # layer 0 is traced: it may differ
    assert LayerTemplate.of(model, LAYERS, "model") is not None
    model.model.layers[LAYERS - 1].self_attn.scaling = 0.5
    with pytest.raises(NotAlike, match=rf"layer {LAYERS - 1}'s self_attn.scaling \(0.5 against {scaling}\)"):
        LayerTemplate.of(model, LAYERS, "model")


def test_a_buffer_is_compared_by_value(tiny_checkpoint) -> None:
    model = hollow(tiny_checkpoint, "llama")
    for i, layer in enumerate(model.model.layers):
        layer.mlp.register_buffer("table", torch.arange(4.0) * (1 + (i == LAYERS - 1)), persistent=False)
    with pytest.raises(NotAlike, match=rf"layer {LAYERS - 1}'s mlp.buffer table"):
        LayerTemplate.of(model, LAYERS, "model")


def test_gpt2_scaled_by_the_inverse_layer_index(tiny_checkpoint) -> None:
    with pytest.raises(NotAlike, match=rf"layer {TEMPLATE + 1}'s attn.scaling"):
        LayerTemplate.of(hollow(tiny_checkpoint, "gpt2", scale_attn_by_inverse_layer_idx=True), LAYERS, "transformer")


def test_a_per_layer_config_list_that_differs(tiny_checkpoint) -> None:
    model = hollow(tiny_checkpoint, "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=3)
    with pytest.raises(NotAlike, match="config.layer_types differs"):
        LayerTemplate.of(model, LAYERS, "model")
