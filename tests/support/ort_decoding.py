"""Test helpers: run exported graphs in ONNX Runtime CPU, incl. greedy decoding with the KV cache, and
in onnxruntime-genai."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from headfold.graphs.export import positions_from_mask
from headfold.ground.artifacts import GENAI_CONFIG
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
        feeds = {"input_ids": tokens[-1][:, None], "attention_mask": mask, **dict(zip(names, present, strict=True))}
        logits, *present = decode.run(None, feeds)
        tokens.append(logits[:, -1].argmax(-1))
    return np.stack(tokens, axis=1), present


def og_greedy(folder: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """og greedy generation for a batch of prompts, right-padded with the pad id as og.Tokenizer pads."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    pad = json.loads((folder / GENAI_CONFIG).read_text())["model"]["pad_token_id"]
    width = max(map(len, prompts))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + new_tokens, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([p + [pad] * (width - len(p)) for p in prompts], dtype=np.int32))
    steps = []
    while not generator.is_done():
        generator.generate_next_token()
        steps.append(np.array(generator.get_next_tokens()))
    return np.stack(steps, axis=1).tolist()


def run_chunks(graph: Path, ids: np.ndarray, mask: np.ndarray, chunks) -> np.ndarray:
    """Feed a merged graph the sequence chunk by chunk (the first with an empty past), present fed
    back as past; the logits of every column."""
    sess = session(graph)
    past = {i.name: np.zeros((len(ids), i.shape[1], 0, i.shape[3]), np.float32) for i in sess.get_inputs() if is_cache(i.name, PAST)}
    names = [o.name for o in sess.get_outputs()]
    explicit = any(i.name == "position_ids" for i in sess.get_inputs())  # fed the mask-derived positions
    positions = positions_from_mask(torch.from_numpy(mask)).numpy()
    logits, start = [], 0
    for n in chunks:
        feeds = {"input_ids": ids[:, start : start + n], "attention_mask": mask[:, : start + n], **past}
        feeds |= {"position_ids": positions[:, start : start + n]} if explicit else {}
        out = dict(zip(names, sess.run(None, feeds), strict=True))
        past = {str(CacheName.parse(k).as_past()): v for k, v in out.items() if is_cache(k, PRESENT)}
        logits.append(out["logits"])
        start += n
    return np.concatenate(logits, axis=1)
