"""ground.cache_names: one spelling of the per-layer cache names, read back by parsing."""

from __future__ import annotations

import pytest

from headfold.ground.cache_names import CROSS_HALF, PAST, PRESENT, SELF_HALF, CacheName, cache_names, is_cache, name_template


def test_names_in_the_graphs_order_and_genai_templates() -> None:
    assert cache_names(PAST, 2) == ["past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]
    assert cache_names(PRESENT, 1, CROSS_HALF) == ["present.0.encoder.key", "present.0.encoder.value"]
    assert name_template(PAST, "value") == "past_key_values.%d.value"
    assert name_template(PRESENT, "key", SELF_HALF) == "present.%d.decoder.key"


@pytest.mark.parametrize("name", [*cache_names(PAST, 12), *cache_names(PRESENT, 3, SELF_HALF), *cache_names(PAST, 2, CROSS_HALF)])
def test_every_name_parses_back_to_itself(name: str) -> None:
    assert str(CacheName.parse(name)) == name


def test_parsing_moves_layers_and_feeds_present_back_as_past() -> None:
    name = CacheName.parse("present.10.decoder.value")
    assert (name.prefix, name.layer, name.half, name.kind) == (PRESENT, 10, SELF_HALF, "value")
    assert str(name.in_layer(3)) == "present.3.decoder.value" and str(name.as_past()) == "past_key_values.10.decoder.value"
    assert str(CacheName.parse("past_key_values.1.key").in_layer(11)) == "past_key_values.11.key"  # not a substring swap


@pytest.mark.parametrize("name", ["logits", "present.1", "present.x.key", "present.1.keys", "past_key_values.1.cross.key", "model.layers.1.key"])
def test_other_names_are_no_cache_names(name: str) -> None:
    assert CacheName.parse(name) is None and not is_cache(name, PAST) and not is_cache(name, PRESENT)


def test_is_cache_checks_prefix_and_half() -> None:
    assert is_cache("past_key_values.0.decoder.key", PAST, SELF_HALF) and not is_cache("past_key_values.0.encoder.key", PAST, SELF_HALF)
    assert is_cache("present.4.value", PRESENT) and not is_cache("present.4.value", PAST)
