"""Test helper: run exported graphs in ONNX Runtime CPU, incl. greedy decoding with the KV cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from headfold.graphs.export import position_ids
from headfold.ground.cache_names import PAST, PRESENT, CacheName, cache_names, is_cache


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def ort_greedy(onnx_dir: Path, input_ids: np.ndarray, mask: np.ndarray, layers: int, new_tokens: int) -> tuple[np.ndarray, list]:
    """Prefill once, then new_tokens - 1 single-token decode steps feeding present K/V back.

    Returns the tokens [batch, new_tokens] and the last present K/V.
    """
    prefill, decode = session(onnx_dir / "prefill.onnx"), session(onnx_dir / "decode.onnx")
    logits, *present = prefill.run(None, {"input_ids": input_ids, "attention_mask": mask})
    tokens = [logits[:, -1].argmax(-1)]
    names = cache_names(PAST, layers)
    for _ in range(new_tokens - 1):
        mask = np.concatenate([mask, np.ones_like(mask[:, :1])], axis=1)
        feeds = {"input_ids": tokens[-1][:, None], "attention_mask": mask, **dict(zip(names, present))}
        logits, *present = decode.run(None, feeds)
        tokens.append(logits[:, -1].argmax(-1))
    return np.stack(tokens, axis=1), present


def run_chunks(graph: Path, ids: np.ndarray, mask: np.ndarray, chunks) -> np.ndarray:
    """Feed a merged graph the sequence chunk by chunk (the first with an empty past), present fed
    back as past; the logits of every column."""
    sess = session(graph)
    past = {i.name: np.zeros((len(ids), i.shape[1], 0, i.shape[3]), np.float32) for i in sess.get_inputs() if is_cache(i.name, PAST)}
    names = [o.name for o in sess.get_outputs()]
    explicit = any(i.name == "position_ids" for i in sess.get_inputs())  # fed the mask-derived positions
    positions = position_ids(torch.from_numpy(mask)).numpy()
    logits, start = [], 0
    for n in chunks:
        feeds = {"input_ids": ids[:, start : start + n], "attention_mask": mask[:, : start + n], **past}
        feeds |= {"position_ids": positions[:, start : start + n]} if explicit else {}
        out = dict(zip(names, sess.run(None, feeds)))
        past = {str(CacheName.parse(k).as_past()): v for k, v in out.items() if is_cache(k, PRESENT)}
        logits.append(out["logits"])
        start += n
    return np.concatenate(logits, axis=1)
