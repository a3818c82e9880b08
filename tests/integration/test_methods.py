"""Data-aware methods: every transform they fold into the weights preserves the function, and
each method is lossless where nothing needs pooling."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.checkpoint_edits import edit_attention, identical_heads
from support.reading import outputs, read_tensors
from support.tiny_models import HEADS

from headfold import convert
from headfold.converter import alignment
from headfold.converter.layout import AttentionWeights
from headfold.converter.methods import LayerContext, align, convert_attention, get_method, head_activations, pairs_as_halves, permute
from headfold.ground.errors import BadInput

# RoPE (full and partial rotary), RoPE with q/k norms, no RoPE with fused QKV, encoder with biases;
# partial rotary with a q/k LayerNorm per head (stablelm), interleaved rotary pairs (gptj), head_dim
# above hidden/heads (gemma), ALiBi (bloom: no query head may move, so not `grouped`)
FAMILIES = ("llama", "gpt_neox", "qwen3", "gpt2", "bert", "phi", "gemma", "olmo", "stablelm", "gptj", "bloom")
METHODS = ("aligned", "grouped", "refit", "aligned+grouped", "scored", "aligned+scored+refit", "aligned+grouped+refit", "first+aligned")
BEST = {"bloom": "aligned+refit"}  # the richest method each family allows; aligned+grouped+refit elsewhere


def align_in_pairs(attn: AttentionWeights, ctx: LayerContext) -> AttentionWeights:
    """Alignment rotations for groups of two heads, folded in, but nothing pooled (interleaved RoPE
    pairs reordered to (i, i + r/2) and back, as the methods do)."""
    if ctx.interleaved:
        return pairs_as_halves(align_in_pairs(pairs_as_halves(attn, ctx.rotary), replace(ctx, interleaved=False)), ctx.rotary, inverse=True)
    groups = [[j, j + 1] for j in range(0, attn.kv_heads, 2)]
    keys, values = head_activations(attn.k, attn.k_bias, ctx), head_activations(attn.v, attn.v_bias, ctx)
    return align(attn, groups, keys, values, ctx.rotary if ctx.rotate_keys else None)


def reverse_heads(attn: AttentionWeights, ctx: LayerContext) -> AttentionWeights:
    return permute(attn, list(reversed(range(attn.kv_heads))))


@pytest.mark.parametrize("edit", [align_in_pairs, reverse_heads])
@pytest.mark.parametrize("family", FAMILIES)
def test_function_preserving_transforms(family: str, edit, tiny_checkpoint, tmp_path: Path) -> None:
    src = tiny_checkpoint(family)
    edited = edit_attention(src, tmp_path / "edited", edit)
    diff = (outputs(src) - outputs(edited)).abs().max().item()
    if family == "bloom" and edit is reverse_heads:  # ALiBi slopes stay with the head positions
        assert diff > 1e-2, f"moving bloom's query heads should change the model: {diff}"
    else:
        assert diff <= 1e-5, f"{family} {edit.__name__}: {diff}"


def test_alignment_really_rotates(tiny_checkpoint, tmp_path: Path) -> None:
    """Guards the test above: the rotations are far from the identity, so weights change."""
    src = tiny_checkpoint("llama")
    edited = edit_attention(src, tmp_path / "edited", align_in_pairs)

    before, after = read_tensors(src), read_tensors(edited)
    name = next(k for k in before if k.endswith("layers.0.self_attn.k_proj.weight"))
    assert (before[name] - after[name]).abs().max() > 0.05


@pytest.mark.parametrize(
    "family, method", [(f, BEST.get(f, "aligned+grouped+refit")) for f in FAMILIES] + [("gpt_neox", m) for m in METHODS[:-2]] + [("bert", METHODS[-1])]
)
def test_methods_lossless_at_identity(family: str, method: str, tiny_checkpoint, tmp_path: Path) -> None:
    """Each method's maths at kv = heads, on the weights alone (convert copies such a layer byte for byte
    without running them: test_convert), changes no output."""
    src, recipe = tiny_checkpoint(family), get_method(method)
    out = edit_attention(src, tmp_path / "out", lambda attn, ctx: convert_attention(recipe, attn, attn.kv_heads, ctx).attn)
    diff = (outputs(src) - outputs(out)).abs().max().item()
    assert diff <= 1e-4, f"{family} {method}: {diff}"


@pytest.mark.parametrize("family", FAMILIES)
def test_identical_heads_pool_without_loss(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    """The richest method each family allows, on the weights alone, pools heads identical in each group of
    two without loss (mean and first: test_convert; with local: test_local)."""
    src = edit_attention(tiny_checkpoint(family), tmp_path / "src", identical_heads(2))
    out = convert(src, tmp_path / "out", kv_heads=HEADS // 2, method=BEST.get(family, "aligned+grouped+refit"), calibration="weights", progress=False)
    diff = (outputs(src) - outputs(out)).abs().max().item()
    assert diff <= 1e-4, f"{family}: {diff}"


def test_rope_pairs_rotate_only_within_pairs() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(50, 8, generator=gen), torch.randn(50, 8, generator=gen)
    r = alignment.orthogonal_fit(a, b, rotary=8)
    assert torch.allclose(r @ r.T, torch.eye(8), atol=1e-5)
    i, j = torch.arange(4), torch.arange(4) + 4
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[i, i] = mask[i, j] = mask[j, i] = mask[j, j] = True
    assert r[~mask].abs().max() == 0
    assert torch.allclose(r[i, i], r[j, j]) and torch.allclose(r[i, j], -r[j, i])  # rotations, no reflections


def test_procrustes_recovers_a_known_rotation() -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(200, 6, dtype=torch.float64, generator=gen)
    q, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64, generator=gen))
    assert torch.allclose(alignment.orthogonal_fit(a, a @ q), q, atol=1e-8)
    assert torch.allclose(alignment.linear_fit(a, a @ q), q, atol=1e-5)


@pytest.mark.parametrize("rotary", [0, 4, 8])
def test_alignment_similarities_equal_each_pairs_procrustes_fit(rotary: int) -> None:
    gen = torch.Generator().manual_seed(2)
    acts = [torch.randn(300, 8, dtype=torch.float64, generator=gen) @ torch.randn(8, 8, dtype=torch.float64, generator=gen) for _ in range(4)]
    acts[3] = acts[1] @ alignment.orthogonal_fit(acts[1], acts[2], rotary)  # an allowed rotation of head 1: similarity 1
    fitted = torch.tensor([[float((a @ alignment.orthogonal_fit(a, b, rotary) * b).sum() / (a.norm() * b.norm())) for b in acts] for a in acts])
    batched = alignment.alignment_similarities(acts, rotary)
    assert torch.allclose(batched, fitted.double(), atol=1e-10)
    assert batched[1, 3] == pytest.approx(1.0, abs=1e-10)


def test_grouped_records_its_groups(tiny_checkpoint, tmp_path: Path) -> None:
    byte_level = tiny_checkpoint("llama", vocab_size=256)  # calibrates on the built-in text as bytes
    out = convert(byte_level, tmp_path / "out", kv_heads=2, method="aligned+grouped", progress=False)
    conversion = json.loads((out / "headfold.json").read_text())["conversion"]
    groups = conversion["source_kv_heads_of_kv_head"]
    layers = groups if isinstance(groups[0][0], list) else [groups]
    for layer in layers:
        assert sorted(j for g in layer for j in g) == list(range(HEADS)) and all(len(g) == 4 for g in layer)
    assert conversion["method"] == "aligned+grouped" and conversion["calibration"]["text"] == "built-in"


@pytest.mark.parametrize("name", ["median", "mean+first", "aligned+aligned", ""])
def test_unknown_methods_are_bad_input(name: str) -> None:
    with pytest.raises(BadInput, match="unknown method"):
        get_method(name)


def test_grouped_and_scored_exclude_each_other() -> None:
    with pytest.raises(BadInput, match="grouped and scored, which both choose the groups; keep one"):
        get_method("aligned+grouped+scored")


def paired_heads(attn: AttentionWeights, ctx: LayerContext) -> AttentionWeights:
    """K/V head j equal to head j mod 4: the pairs (0, 4), (1, 5), (2, 6), (3, 7), which contiguous groups miss."""
    return attn.map_kv(lambda t: t[torch.arange(len(t)) % 4])


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
def test_scored_finds_equal_heads_wherever_they_sit(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    """scored pairs the equal heads (query heads and W_O rows permuted to match) and pools them without loss; mean cannot."""
    src = edit_attention(tiny_checkpoint(family), tmp_path / "src", paired_heads)
    out = convert(src, tmp_path / "scored", kv_heads=4, method="scored", calibration="weights", progress=False)
    assert json.loads((out / "headfold.json").read_text())["conversion"]["source_kv_heads_of_kv_head"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (outputs(src) - outputs(out)).abs().max().item() <= 1e-5
    mean = convert(src, tmp_path / "mean", kv_heads=4, method="mean", progress=False)
    assert (outputs(src) - outputs(mean)).abs().max().item() > 1e-2


def _random_layer(seed: int = 0, heads: int = 4, d: int = 8, hidden: int = 16) -> tuple[AttentionWeights, LayerContext]:
    gen = torch.Generator().manual_seed(seed)
    w = lambda: torch.randn(heads, d, hidden, generator=gen)  # noqa: E731
    return AttentionWeights(w(), w(), w(), w()), LayerContext(torch.randn(64, hidden, generator=gen), rotary=d)


@pytest.mark.parametrize("value, message", [("bogus", "not a device"), ("meta", "not a device"), ("cuda:0", r"CUDA GPU\(s\)")])
def test_bad_compute_device_is_bad_input(value: str, message: str, monkeypatch) -> None:
    if value.startswith("cuda") and torch.cuda.is_available():
        value = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU
    monkeypatch.setenv("HEADFOLD_DEVICE", value)
    attn, ctx = _random_layer()
    with pytest.raises(BadInput, match=message):
        convert_attention(get_method("refit"), attn, 2, ctx)


@pytest.mark.gpu
def test_gpu_refit_matches_cpu(monkeypatch) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch: the GPU path of the data-aware methods is not exercised")
    attn, ctx = _random_layer()
    results = {}
    for device in ("cpu", "cuda"):
        monkeypatch.setenv("HEADFOLD_DEVICE", device)
        results[device] = convert_attention(get_method("aligned+grouped+refit"), attn, 2, ctx)
    cpu, gpu = results["cpu"], results["cuda"]
    assert cpu.groups == gpu.groups and gpu.attn.q.device.type == "cpu"
    for name in ("q", "k", "v", "o"):
        assert torch.allclose(getattr(cpu.attn, name), getattr(gpu.attn, name), atol=1e-4), name


def test_bad_compute_device_fails_before_calibration(tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HEADFOLD_DEVICE", "meta")
    with pytest.raises(BadInput, match="HEADFOLD_DEVICE='meta'"):
        convert(tiny_checkpoint("llama"), tmp_path / "out", kv_heads=2, method="refit", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "family, config, kv, method, message",
    [
        ("bloom", {}, 2, "aligned+grouped", "ALiBi"),
        ("bloom", {}, 2, "scored", "ALiBi"),
        ("olmo", {"clip_qkv": 8.0}, 2, "aligned", "clip_qkv"),
        ("olmo", {"clip_qkv": 8.0}, 2, "refit", "clip_qkv"),
    ],
)
def test_methods_whose_maths_does_not_hold_are_refused(family: str, config: dict, kv: int, method: str, message: str, tiny_checkpoint, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=message) as err:
        convert(tiny_checkpoint(family, **config), tmp_path / "out", kv_heads=kv, method=method, calibration="weights", progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_clip_qkv_allows_grouped_but_not_rotations(tiny_checkpoint, tmp_path: Path) -> None:
    """A permutation commutes with OLMo's elementwise q/k/v clamp (so grouped stays allowed), a rotation does not."""
    src = tiny_checkpoint("olmo", clip_qkv=0.5)  # small enough to clamp these activations
    permuted = edit_attention(src, tmp_path / "permuted", reverse_heads)
    assert (outputs(src) - outputs(permuted)).abs().max().item() <= 1e-5
    rotated = edit_attention(src, tmp_path / "rotated", align_in_pairs)
    assert (outputs(src) - outputs(rotated)).abs().max().item() > 1e-3
