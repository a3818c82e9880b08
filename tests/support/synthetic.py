"""Llama-layout checkpoints of random weights at any size, written one layer at a time (safetensors),
for memory tests and benchmarks: the generator never holds more than one layer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file


def llama_shapes(config: transformers.LlamaConfig) -> list[dict[str, tuple[int, ...]]]:
    """The tensors by name and shape, grouped as written: embeddings, each layer, then norm and head."""
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    layers = [
        {
            f"model.layers.{i}.self_attn.q_proj.weight": (h, h),
            f"model.layers.{i}.self_attn.k_proj.weight": (kv, h),
            f"model.layers.{i}.self_attn.v_proj.weight": (kv, h),
            f"model.layers.{i}.self_attn.o_proj.weight": (h, h),
            f"model.layers.{i}.mlp.gate_proj.weight": (f, h),
            f"model.layers.{i}.mlp.up_proj.weight": (f, h),
            f"model.layers.{i}.mlp.down_proj.weight": (h, f),
            f"model.layers.{i}.input_layernorm.weight": (h,),
            f"model.layers.{i}.post_attention_layernorm.weight": (h,),
        }  # fmt: skip
        for i in range(config.num_hidden_layers)
    ]
    return [{"model.embed_tokens.weight": (v, h)}, *layers, {"model.norm.weight": (h,), "lm_head.weight": (v, h)}]


def llama_checkpoint(folder: Path, *, dtype: torch.dtype = torch.float16, seed: int = 0, **sizes) -> dict[str, int]:
    """Write a LlamaForCausalLM checkpoint (config from `sizes`: hidden_size, num_hidden_layers, …) with
    one safetensors shard per group of llama_shapes; return its total and largest group's bytes."""
    config = transformers.LlamaConfig(tie_word_embeddings=False, max_position_embeddings=4096, **sizes)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    generator = torch.Generator().manual_seed(seed)
    groups = llama_shapes(config)
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, group_bytes = {}, []
    for group, name in zip(groups, names, strict=True):
        tensors = {n: (torch.randn(s, generator=generator) * 0.02).to(dtype) for n, s in group.items()}
        tensors |= {n: (1 + torch.randn(s, generator=generator) * 0.02).to(dtype) for n, s in group.items() if len(s) == 1}  # norm scales
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(group, name)
        group_bytes.append(sum(t.nbytes for t in tensors.values()))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": sum(group_bytes)}, "weight_map": weight_map}))
    return {"total_bytes": sum(group_bytes), "largest_group_bytes": max(group_bytes)}
