"""Runners: one model on one backend, each a Polygraphy runner (polygraphy.backend.base.BaseRunner).

A runner is a context manager that loads its model on entry (`activate`) and releases it on exit;
`infer(feed)` checks the feed against `get_input_metadata()` (names, dtypes, shapes: Polygraphy's
check) and maps input names to numpy arrays → output names to numpy arrays, with the exported
graph's names (input_ids, attention_mask [, token_type_ids] → logits or last_hidden_state).
The torch runner is a BaseRunner subclass, ONNX Runtime is Polygraphy's OnnxrtRunner on a session
built with headfold's options, TensorRT its TrtRunner (verification.tensorrt_runner), so any
Polygraphy runner plugs into verify and Polygraphy's Comparator can run headfold's; headfold's
checks keep their own metrics and budgets. `describe()` adds backend details for reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import torch
import transformers
from polygraphy.backend.base import BaseRunner
from polygraphy.backend.onnxrt import OnnxrtRunner
from polygraphy.common import TensorMetadata
from polygraphy.datatype import DataType
from polygraphy.exception import PolygraphyException
from polygraphy.logger import G_LOGGER

from headfold.converter.checkpoint import CheckpointFacts
from headfold.converter.modeling import load_model
from headfold.ground.cache_names import PAST, CacheName, is_cache
from headfold.ground.errors import BadInput, first_line
from headfold.verification.inputs import wants_token_type_ids
from headfold.verification.seq2seq import token_metadata as pair_metadata
from headfold.verification.sessions import ORT_FLOATS, SessionFromGraph, ort

Runner: TypeAlias = BaseRunner  # what verify runs: headfold's runners below, or any of Polygraphy's own


@contextmanager
def polygraphy_errors(subject: str, fix: str) -> Iterator[None]:
    """Polygraphy refuses a feed (a missing input, a wrong dtype) by logging it and raising; headfold
    says it in one line (BadInput), so Polygraphy's log stays silent meanwhile."""
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL + 1):
        try:
            yield
        except PolygraphyException as err:
            raise BadInput(f"{subject} ({first_line(err)}); {fix}") from None


def token_metadata(names: Sequence[str]) -> TensorMetadata:
    """int64 [batch, sequence] inputs: the token feeds verification.inputs builds."""
    meta = TensorMetadata()
    for name in names:
        meta.add(name, DataType.INT64, ("batch", "sequence"))
    return meta


class TorchRunner(BaseRunner):
    """A checkpoint folder (source or converted) as `headfold.load_model` builds it, on CPU."""

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = Path(checkpoint)
        super().__init__(name=f"torch:{self.checkpoint.name}")
        self.facts: CheckpointFacts | None = None
        self.model: transformers.PreTrainedModel | None = None

    def activate_impl(self) -> None:
        self.facts = CheckpointFacts.read(self.checkpoint)
        self.model = load_model(self.facts)

    def deactivate_impl(self) -> None:
        self.model = None

    def get_input_metadata_impl(self) -> TensorMetadata:
        assert self.facts is not None  # read by activate_impl: Polygraphy asks only after activate
        if self.facts.kind == "seq2seq":  # source and teacher-forced target (verification.seq2seq)
            return pair_metadata(self.facts)
        assert self.model is not None  # loaded by activate_impl, released by deactivate_impl
        segments = wants_token_type_ids(self.model.config.to_dict())
        return token_metadata(["input_ids", "attention_mask", *(["token_type_ids"] if segments else [])])

    def infer_impl(self, feed_dict: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.facts is not None and self.model is not None  # activate_impl loaded them: Polygraphy infers only while active
        inputs = {name: torch.from_numpy(np.asarray(value)) for name, value in feed_dict.items()}
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model(**inputs)
        self.inference_time = time.perf_counter() - start
        if self.facts.kind != "encoder":  # a decoder's logits; an encoder-decoder's over its target
            return {"logits": out.logits.float().numpy()}
        return {"last_hidden_state": out.last_hidden_state.float().numpy()}

    def describe(self) -> dict[str, str]:
        dtype = str(next(self.model.parameters()).dtype) if self.model is not None else "unloaded"
        return {"runner": self.name, "backend": f"torch {torch.__version__}", "device": "cpu", "dtype": dtype}


class OnnxRuntimeRunner(OnnxrtRunner):
    """An ONNX graph in ONNX Runtime (Polygraphy's OnnxrtRunner), on the best provider present."""

    def __init__(self, graph: Path, providers: tuple[str, ...] | None = None) -> None:
        self.graph, self.providers = Path(graph), providers
        super().__init__(SessionFromGraph(self.graph, providers), name=f"onnxruntime:{self.graph.name}")

    @property
    def session(self) -> Any:
        """The ONNX Runtime session while active, else None (Polygraphy's `sess`, deleted on exit)."""
        return getattr(self, "sess", None)

    def infer(self, feed_dict: Mapping[str, np.ndarray], check_inputs: bool = True, *args: Any, **kwargs: Any) -> dict[str, np.ndarray]:
        """Polygraphy's infer, with a merged decoder graph's past K/V filled in empty when the feed has none.

        `infer`, not `infer_impl`: Polygraphy checks the feed against the graph's inputs before
        `infer_impl`, and a prompt fed without past must pass that check as the full feed."""
        if not self.is_active:  # Polygraphy refuses it: a bug of the caller, not bad input
            return super().infer(feed_dict, check_inputs, *args, **kwargs)
        feed = {**self._empty_past(feed_dict), **feed_dict}
        with polygraphy_errors(f"{self.graph.name} does not take headfold's feed", "verify a graph written by headfold export"):
            return super().infer(feed, check_inputs, *args, **kwargs)

    def _empty_past(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A merged decoder graph fed without past K/V runs a prompt: past of length 0 [B, kvᵢ, 0, d]."""
        batch = len(feed["input_ids"]) if "input_ids" in feed else 0
        missing = [i for i in self.session.get_inputs() if is_cache(i.name, PAST) and i.name not in feed]
        if any(i.type not in ORT_FLOATS for i in missing):
            raise BadInput(f"{self.graph.name} takes its past K/V as {missing[0].type}, which numpy cannot build; export it in fp32 or fp16 to verify it")
        return {i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), ORT_FLOATS[i.type]) for i in missing}

    def describe(self) -> dict[str, str]:
        providers = self.session.get_providers() if self.session is not None else list(self.providers or ())
        return {"runner": self.name, "backend": f"onnxruntime {ort.__version__}", "providers": ",".join(providers)}


class SharedKvCache:
    """onnxruntime-genai's `past_present_share_buffer` in plain ONNX Runtime: each layer's past and
    present K/V are one [B, kvᵢ, length, d] buffer bound as both (IOBinding), so a GroupQueryAttention
    graph writes every step's K/V into it in place, as onnxruntime-genai runs it (the buffers live on
    the device of the session's first provider).

    `infer(feed)` runs input_ids and attention_mask (the prompt, then one token per call; the mask
    covering everything so far) and returns the logits.
    """

    def __init__(self, session: Any, batch: int, length: int, head_size: int | None = None) -> None:
        """`session`: the graph's onnxruntime.InferenceSession (an OnnxRuntimeRunner's `session`);
        `head_size` where its past inputs leave it symbolic (onnxruntime-genai's builder's graphs)."""
        self.session = session
        device = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        self.buffers = {
            i.name: ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, i.shape[1], length, head_size or i.shape[3]), ORT_FLOATS[i.type]), device, 0)
            for i in self.session.get_inputs()
            if is_cache(i.name, PAST)
        }

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        binding = self.session.io_binding()
        for name, value in feed.items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        for name, buffer in self.buffers.items():
            past = CacheName.parse(name)
            assert past is not None  # every buffer is a past K/V input (is_cache above)
            binding.bind_ortvalue_input(name, buffer)
            binding.bind_ortvalue_output(str(past.as_present()), buffer)
        binding.bind_output("logits")
        self.session.run_with_iobinding(binding)
        return {"logits": binding.copy_outputs_to_cpu()[-1]}
