"""Rule: Attention(Q, repeat_kv(K), repeat_kv(V)) → Attention(Q, K, V), a native GQA node.

transformers repeats K/V to the query head count before SDPA whenever a mask is passed
(`repeat_kv`: Unsqueeze at axis 2 → Expand or Tile along it → Reshape that merges kv-heads and
groups). That is torch's repeat_interleave: query head h reads kv head h // group, which is the
contiguous GQA mapping of ONNX Attention, so the node can take K/V at kv-heads directly and the
runtime never materialises the repeated tensors.
"""

from __future__ import annotations

from typing import Literal

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, pattern

from headfold.graphs.rewrite.values import dims, int_list, same_dims

RepeatOp = Literal["Expand", "Tile"]


class CollapseRepeatKV(pattern.RewriteRuleClassBase):
    """Matches 4D (B, heads, S, D) Attention whose K and V are both repeat_kv outputs."""

    def __init__(self, repeat: RepeatOp) -> None:
        super().__init__(f"CollapseRepeatKV{repeat}")
        self.repeat = repeat

    def _repeated(self, op, x, prefix: str):
        unsqueezed = op.Unsqueeze(x, pattern.Var(f"{prefix}_axes"))
        if self.repeat == "Tile":  # torch's Tensor.repeat adds a broadcast-only Expand before Tile
            broadcast = op.Expand(unsqueezed, pattern.ANY_VALUE, _outputs=[f"{prefix}_broadcast"])
            unsqueezed = pattern.OrValue([broadcast, unsqueezed])
        grouped = getattr(op, self.repeat)(unsqueezed, pattern.Var(f"{prefix}_repeats"), _outputs=[f"{prefix}_grouped"])
        return op.Reshape(grouped, pattern.ANY_VALUE, _outputs=[f"{prefix}_repeated"])

    def pattern(self, op, query, key, value):
        return op.Attention(
            query,
            self._repeated(op, key, "key"),
            self._repeated(op, value, "value"),
            pattern.Var("mask", can_match_none=True),
            _outputs=["attention"],
        )

    def check(self, context, key, value, **bindings) -> MatchResult:
        result = MatchResult()
        key_heads = self._kv_heads(result, key, "key", bindings)
        value_heads = self._kv_heads(result, value, "value", bindings)
        if key_heads is None or value_heads is None:
            return result
        if key_heads != value_heads:
            return result.fail(f"K has {key_heads} heads but V has {value_heads}")
        return result

    def _kv_heads(self, result: MatchResult, x: ir.Value, prefix: str, bindings: dict) -> int | None:
        """kv-heads of `x` when its repeat is a contiguous per-head repeat, else fail `result`."""
        source = dims(x, 4)
        grouped = dims(bindings[f"{prefix}_grouped"], 5)
        repeated = dims(bindings[f"{prefix}_repeated"], 4)
        if source is None or grouped is None or repeated is None:
            result.fail(f"{prefix}: shapes unknown or not 4D (run shape inference first)", x)
            return None
        if int_list(bindings[f"{prefix}_axes"]) not in ([2], [-3]):
            # Unsqueeze at axis 1 would repeat the whole head block: head h reads h % kv-heads.
            result.fail(f"{prefix}: not unsqueezed at axis 2 (the heads would interleave)", x)
            return None
        kv, group = source[1], grouped[2]
        if not (isinstance(kv, int) and isinstance(group, int)):
            result.fail(f"{prefix}: head count or group size is not static", x)
            return None
        expected_grouped = (source[0], kv, group, *source[2:])
        expected_repeated = (source[0], kv * group, *source[2:])
        if not (same_dims(grouped, expected_grouped) and same_dims(repeated, expected_repeated)):
            result.fail(f"{prefix}: repeat shapes {grouped} / {repeated} are not repeat_kv of {source}", x)
            return None
        if self.repeat == "Tile" and not self._tiles_group_axis(bindings, prefix, source, group):
            result.fail(f"{prefix}: Tile repeats other axes than the group axis", x)
            return None
        return kv

    @staticmethod
    def _tiles_group_axis(bindings: dict, prefix: str, source: tuple, group: int) -> bool:
        """Tile repeats only axis 2, and an Expand before it (if any) changes no shape."""
        broadcast = bindings.get(f"{prefix}_broadcast")
        unchanged = broadcast is None or same_dims(dims(broadcast, 5) or (), (*source[:2], 1, *source[2:]))
        return unchanged and int_list(bindings[f"{prefix}_repeats"]) == [1, 1, group, 1, 1]

    def rewrite(self, op, query, key, value, mask, attention, **_):
        inputs = [query, key, value] if mask is None else [query, key, value, mask]
        return op.Attention(*inputs, **attention.producer().attributes)


rules = [CollapseRepeatKV.rule("Expand"), CollapseRepeatKV.rule("Tile")]
