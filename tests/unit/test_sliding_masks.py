"""graphs.export's masks for sliding-window attention: transformers' sliding window for unpadded,
left- and right-padded rows, the row's own last tokens for gapped ones; windows read from configs."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import tiny_config

from headfold.graphs.export import FULL_ATTENTION, SLIDING_ATTENTION, attention_windows, layer_masks, visible_keys
from headfold.ground.errors import BadInput

WINDOW = 3
ROWS = {  # 9 columns, the last 4 new (5 in the past)
    "unpadded": [1] * 9,
    "left": [0, 0, 0, 1, 1, 1, 1, 1, 1],
    "right": [1, 1, 1, 1, 1, 1, 1, 0, 0],
    "gapped": [1, 1, 1, 0, 0, 1, 1, 1, 1],  # a right-padded prompt, then tokens after the pads
}
NEW = 4


def by_columns(mask: torch.Tensor, q: int, k: int) -> bool:
    """transformers' sliding-window mask: causal, real keys, the last WINDOW columns."""
    return k <= q and bool(mask[k]) and k > q - WINDOW


def by_positions(mask: torch.Tensor, q: int, k: int) -> bool:
    """The row alone: causal, real keys, the last WINDOW real tokens."""
    counted = mask.cumsum(0)
    return k <= q and bool(mask[k]) and counted[k] > counted[q] - WINDOW


def expected(mask: torch.Tensor, rule) -> torch.Tensor:
    total = len(mask)
    return torch.tensor([[rule(mask, q, k) or q == k for k in range(total)] for q in range(total - NEW, total)])


@pytest.mark.parametrize("row", ROWS)
def test_window_mask_keeps_the_rows_last_tokens(row: str) -> None:
    mask = torch.tensor([ROWS[row]])
    got = visible_keys(mask, NEW, WINDOW)[0, 0]
    real_queries = mask[0, -NEW:].bool()
    assert torch.equal(got[real_queries], expected(mask[0], by_positions)[real_queries])
    same_as_transformers = torch.equal(got[real_queries], expected(mask[0], by_columns)[real_queries])
    assert same_as_transformers == (row != "gapped")  # transformers counts the pads between prompt and new tokens
    assert torch.equal(visible_keys(mask, NEW)[0, 0], expected(mask[0], lambda m, q, k: k <= q and bool(m[k])))


def test_windows_come_from_sliding_window_or_layer_types() -> None:
    assert attention_windows(tiny_config("llama", num_hidden_layers=3), 3) == [None] * 3
    assert attention_windows(tiny_config("mistral", num_hidden_layers=3, sliding_window=5), 3) == [5] * 3
    qwen2 = tiny_config("qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=5, max_window_layers=1)
    assert qwen2.layer_types == [FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_ATTENTION]
    assert attention_windows(qwen2, 3) == [None, 5, 5]
    assert attention_windows(tiny_config("qwen2", num_hidden_layers=3, sliding_window=5), 3) == [None] * 3  # use_sliding_window off
    with pytest.raises(BadInput, match="chunked_attention"):
        attention_windows(tiny_config("qwen2", num_hidden_layers=2, layer_types=["chunked_attention", FULL_ATTENTION]), 2)


def test_one_mask_when_the_windows_agree_else_one_per_layer_type() -> None:
    mask = torch.tensor([ROWS["left"]])
    assert torch.equal(layer_masks(mask, NEW, [WINDOW] * 2), visible_keys(mask, NEW, WINDOW))
    assert torch.equal(layer_masks(mask, NEW, [None] * 2), visible_keys(mask, NEW))
    masks = layer_masks(mask, NEW, [None, WINDOW])
    assert torch.equal(masks[FULL_ATTENTION], visible_keys(mask, NEW)) and torch.equal(masks[SLIDING_ATTENTION], visible_keys(mask, NEW, WINDOW))
