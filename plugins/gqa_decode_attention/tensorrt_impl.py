"""TensorRT implementation: a quickly deployable Python plugin (tensorrt.plugin), JIT only.

Imported lazily by `register()`. Deliberately without `from __future__ import annotations`:
tensorrt.plugin reads the decorated functions' annotations to tell tensor inputs (TensorDesc /
Tensor) from attributes, so they must be real objects, not strings. Signatures follow NVIDIA's
samples/python/quickly_deployable_plugins (register → output descriptors, autotune → type
combinations, impl → computes on the given CUDA stream).

No @trtp.aot_impl: an AOT plugin needs a compiled GPU kernel (Triton/PTX) for masked GQA attention
over a growing cache; writing and validating one is not feasible without a GPU to test it on. The
JIT plugin therefore needs this Python module (and torch with CUDA) wherever the engine runs.

Attributes are declared as one-element numpy arrays, not int/float: tensorrt.plugin converts a
scalar attribute with `int(field.data)` on a 1-element array, which NumPy ≥ 2.4 refuses, while
arrays go through `field.data.astype(...)`. The ONNX parser hands INT attributes over as int32
and FLOAT ones as float32. bf16 is not offered: tensorrt.plugin's Tensor has no CUDA array
interface for it, so the torch views below could not be made.
"""

from typing import List, Tuple  # noqa: UP035 - as NVIDIA's samples annotate; tensorrt.plugin inspects them

import numpy as np
import numpy.typing as npt
import tensorrt.plugin as trtp
import torch

from headfold.plugins.gqa_decode_attention.reference import (
    NAME,
    attention_reference,
)

_FLOATING = "FP32|FP16"
_INPUTS, _OUTPUTS = 6, 3
_MASK = 3  # input position of attn_mask
_registered = False


def register() -> None:
    """Define the plugin once per process (tensorrt.plugin refuses a second definition)."""
    global _registered
    if not _registered:
        _define()
        _registered = True


def _define() -> None:
    @trtp.register(NAME)
    def describe(
        query: trtp.TensorDesc,
        key: trtp.TensorDesc,
        value: trtp.TensorDesc,
        attn_mask: trtp.TensorDesc,
        past_key: trtp.TensorDesc,
        past_value: trtp.TensorDesc,
        q_num_heads: npt.NDArray[np.int32],
        kv_num_heads: npt.NDArray[np.int32],
        scale: npt.NDArray[np.float32],
        is_causal: npt.NDArray[np.int32],
        softcap: npt.NDArray[np.float32],
    ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:  # noqa: UP006
        output = query.like()
        output.shape_expr[3] = value.shape_expr[3]  # Y is (B, q_heads, S, v_head_size)
        return output, _grown(past_key, key), _grown(past_value, value)

    @trtp.autotune(NAME)
    def combinations(query, key, value, attn_mask, past_key, past_value, outputs) -> List[trtp.AutoTuneCombination]:  # noqa: UP006
        floating = [i for i in range(_INPUTS + _OUTPUTS) if i != _MASK]
        bool_mask = trtp.AutoTuneCombination()
        bool_mask.pos(floating, _FLOATING)  # one shared float type for all tensors but the mask
        bool_mask.pos([_MASK], "BOOL")
        float_mask = trtp.AutoTuneCombination()
        float_mask.pos(list(range(_INPUTS + _OUTPUTS)), _FLOATING)  # additive mask in Q's type
        return [bool_mask, float_mask]

    @trtp.impl(NAME)
    def compute(
        query: trtp.Tensor,
        key: trtp.Tensor,
        value: trtp.Tensor,
        attn_mask: trtp.Tensor,
        past_key: trtp.Tensor,
        past_value: trtp.Tensor,
        q_num_heads: npt.NDArray[np.int32],
        kv_num_heads: npt.NDArray[np.int32],
        scale: npt.NDArray[np.float32],
        is_causal: npt.NDArray[np.int32],
        softcap: npt.NDArray[np.float32],
        outputs: Tuple[trtp.Tensor, trtp.Tensor, trtp.Tensor],  # noqa: UP006
        stream: int,
    ) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            inputs = [torch.as_tensor(t, device="cuda") for t in (query, key, value, attn_mask, past_key, past_value)]
            results = attention_reference(*inputs, scale=float(scale[0]), is_causal=bool(is_causal[0]), softcap=float(softcap[0]))
            for output, result in zip(outputs, results, strict=True):
                torch.as_tensor(output, device="cuda").copy_(result)


def _grown(past: trtp.TensorDesc, new: trtp.TensorDesc) -> trtp.TensorDesc:
    """present = concat(past, new) along the sequence axis: past + new positions."""
    present = past.like()
    present.shape_expr[2] = past.shape_expr[2] + new.shape_expr[2]
    return present
