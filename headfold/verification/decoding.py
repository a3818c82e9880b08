"""The KV-cache path of a decoder export, as a runner, and the fidelity check that gates it.

`KvCacheRunner.infer(feed)` answers like a full forward (logits [B, S, V] over the feed's rows)
but fills only each row's last `steps` real positions, and computes them through the cache:
prefill on the row's earlier tokens, then one decode call per remaining token (through the same
graph for a merged export, through decode.onnx for a split one), fed that token
(teacher forcing: the row's next real token, not the model's guess) and the previous call's
present K/V as past K/V. The attention mask grows by one per step, so a row shorter than the
batch's longest keeps its pads between prefix and new tokens; the graphs derive positions from
the mask (graphs.export.positions_from_mask), so each new token still gets its own position, as in
generation. A GroupQueryAttention export runs as onnxruntime-genai runs it (`shared`): one
max-length K/V buffer per layer bound as both past and present, written in place by every call
(runners.SharedKvCache). The `<fidelity check>-decode` check compares those positions only, against
the other side's full forward (torch, a prefill graph, an engine) or its own KV-cache path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from polygraphy.common import TensorMetadata

from headfold.ground.cache_names import PRESENT, CacheName, is_cache
from headfold.verification.checks import CheckSpec
from headfold.verification.inputs import pad_batch
from headfold.verification.runners import BaseRunner, OnnxRuntimeRunner, Runner, SharedKvCache, token_metadata

SKIPPED_NOTE = "KV-cache path (decode graph) not checked: --decode-steps 0"


def decoded_positions(attention_mask: np.ndarray, steps: int) -> np.ndarray:
    """[B, S] bool: each row's last `steps` real tokens (all but its first when the row is shorter).

    Counted over real tokens, so left, right or gapped padding all work.
    """
    real = attention_mask.astype(bool)
    from_end = real[:, ::-1].cumsum(1)[:, ::-1]  # at a real token: 1 for the row's last, 2 before it, ...
    per_row = np.minimum(steps, real.sum(1) - 1)  # the prefill keeps one token at least
    return real & (from_end <= per_row[:, None])


@dataclass(frozen=True)
class DecodePlan:
    """Per row: the tokens prefilled, the tokens then fed one at a time, and their columns in the feed."""

    prefixes: list[np.ndarray]
    fed: list[np.ndarray]
    columns: list[np.ndarray]
    pad_id: int

    @classmethod
    def of(cls, feed: Mapping[str, np.ndarray], steps: int) -> DecodePlan:
        ids, real = feed["input_ids"], feed["attention_mask"].astype(bool)
        decoded = decoded_positions(real, steps)
        pads = ids[~real]
        return cls(
            prefixes=[row[r & ~d] for row, r, d in zip(ids, real, decoded, strict=True)],
            fed=[row[d] for row, d in zip(ids, decoded, strict=True)],
            columns=[np.flatnonzero(d) for d in decoded],
            pad_id=int(pads[0]) if pads.size else 0,
        )

    @property
    def steps(self) -> int:
        return max(len(f) for f in self.fed)

    def step(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Step k's token per row and which rows are still decoding (the others get a masked pad)."""
        active = np.array([k < len(f) for f in self.fed])
        tokens = np.array([f[k] if a else self.pad_id for f, a in zip(self.fed, active, strict=True)], dtype=np.int64)
        return tokens[:, None], active


def past_from_present(outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """present.{i}.{key,value} → past_key_values.{i}.{key,value}, matched by name, never by order:
    a decode graph that wires a layer to another layer's cache shows up in the numbers."""
    return {str(cache.as_past()): value for name, value in outputs.items() if is_cache(name, PRESENT) and (cache := CacheName.parse(name))}


class KvCacheRunner(BaseRunner):
    """Prefill + teacher-forced decode steps through a decoder export's two graphs, as one runner.

    `prefill` may be the runner another check already uses for the prefill graph (it is shared,
    not reloaded: activating activates only the runners not yet active, and releases only those);
    `decode` runs the decode graph. Both speak the export's names. `shared`: the merged graph's
    ONNX Runtime runner, run with shared past/present buffers (SharedKvCache) instead of feeding
    present back as past.
    """

    def __init__(self, prefill: Runner, decode: Runner, steps: int, *, shared: bool = False) -> None:
        super().__init__(name=decode.name)
        if shared and not (prefill is decode and isinstance(decode, OnnxRuntimeRunner)):
            raise ValueError("a shared K/V buffer runs one merged graph in ONNX Runtime for the prompt and every step")
        self.prefill, self.decode, self.steps, self.shared = prefill, decode, steps, shared
        self._stack: ExitStack | None = None

    def activate_impl(self) -> None:
        self._stack = ExitStack()
        for runner in (self.prefill, self.decode):  # the same runner twice for a merged graph
            if not runner.is_active:
                self._stack.enter_context(runner)

    def deactivate_impl(self) -> None:
        assert self._stack is not None  # set by activate_impl: Polygraphy deactivates only an active runner
        self._stack.close()
        self._stack = None

    def get_input_metadata_impl(self) -> TensorMetadata:
        return token_metadata(["input_ids", "attention_mask"])  # it builds the int64 feeds of both graphs itself

    def infer_impl(self, feed_dict: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        plan = DecodePlan.of(feed_dict, self.steps)
        prefill = pad_batch(plan.prefixes, plan.pad_id, token_type_ids=False)
        mask = prefill["attention_mask"]
        step = self._prompted(prefill, mask.shape[1] + plan.steps)
        logits = None
        for k in range(plan.steps):
            tokens, active = plan.step(k)
            mask = np.concatenate([mask, active[:, None].astype(mask.dtype)], axis=1)
            out = step({"input_ids": tokens, "attention_mask": mask})
            if logits is None:  # the full-forward shape, zero where nothing was decoded
                logits = np.zeros((*feed_dict["input_ids"].shape, out["logits"].shape[-1]), out["logits"].dtype)
            for row in np.flatnonzero(active):
                logits[row, plan.columns[row][k]] = out["logits"][row, -1]
        self.inference_time = time.perf_counter() - start
        assert logits is not None  # one step at least: every row has 2 real tokens (verification.inputs) and steps >= 1 (decode_check)
        return {"logits": logits}

    def _prompted(self, prompt: dict[str, np.ndarray], length: int) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
        """Run the prompt; return what runs each next step with the cache so far (`length`: the
        longest the cache gets)."""
        if self.shared:  # the prompt and every step write into the buffers: nothing is fed back
            cache = SharedKvCache(self.decode.session, len(prompt["input_ids"]), length)
            cache.infer(prompt)
            return cache.infer
        past = past_from_present(self.prefill.infer(prompt))

        def step(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            nonlocal past
            out = self.decode.infer({**feed, **past})
            past = past_from_present(out)
            return out

        return step

    def describe(self) -> dict[str, Any]:
        describe = getattr(self.decode, "describe", None)
        info = describe() if describe else {}
        cache = "one shared past/present buffer per layer" if self.shared else "present fed back as past"
        return {**info, "runner": self.name, "prefill_runner": self.prefill.name, "decode_steps": self.steps, "kv_cache": cache}


def decode_check(fidelity: CheckSpec, reference: Runner, candidate: Runner, steps: int) -> CheckSpec | None:
    """The KV-cache twin of a fidelity check: same budget, compared at the decoded positions only.

    `reference` / `candidate` are a KvCacheRunner on a decoder export's side, the fidelity
    check's own runner on the other (its full forward is the truth the cache must reproduce).
    With `steps` 0 there is no twin; the fidelity check notes that the decode graph went unchecked.
    """
    if steps == 0:
        fidelity.notes.append(SKIPPED_NOTE)
        return None
    note = (
        f"prefill on each row but its last {steps} tokens, then {steps} teacher-forced decode steps "
        "(present K/V fed back as past K/V); metrics over the decoded positions only"
    )
    return CheckSpec(
        f"{fidelity.name}-decode", "fidelity", reference, candidate, fidelity.budget,
        positions=partial(_decoded_mask, steps=steps), notes=[note],
    )  # fmt: skip


def _decoded_mask(feed: Mapping[str, np.ndarray], steps: int) -> np.ndarray:
    return decoded_positions(feed["attention_mask"], steps)
