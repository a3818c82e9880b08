"""Test helper: run exported graphs in ONNX Runtime CPU, incl. greedy decoding with the KV cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def ort_greedy(onnx_dir: Path, input_ids: np.ndarray, mask: np.ndarray, layers: int, new_tokens: int) -> tuple[np.ndarray, list]:
    """Prefill once, then new_tokens - 1 single-token decode steps feeding present K/V back.

    Returns the tokens [batch, new_tokens] and the last present K/V.
    """
    prefill, decode = session(onnx_dir / "prefill.onnx"), session(onnx_dir / "decode.onnx")
    logits, *present = prefill.run(None, {"input_ids": input_ids, "attention_mask": mask})
    tokens = [logits[:, -1].argmax(-1)]
    names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    for _ in range(new_tokens - 1):
        mask = np.concatenate([mask, np.ones_like(mask[:, :1])], axis=1)
        feeds = {"input_ids": tokens[-1][:, None], "attention_mask": mask, **dict(zip(names, present))}
        logits, *present = decode.run(None, feeds)
        tokens.append(logits[:, -1].argmax(-1))
    return np.stack(tokens, axis=1), present
