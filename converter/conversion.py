"""MHA → GQA/MQA checkpoint conversion, streamed tensor by tensor into an atomic output.

mean and first run without torch (converter/rawpool.py: numpy over the safetensors bytes, the
other tensors copied as byte ranges), so this module imports torch and the calibration only
inside the data-aware path: a plain conversion starts as fast as a copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from headfold.converter import rawpool, seq2seq
from headfold.converter.checkpoint import PICKLE_INDEX, SAFETENSORS_INDEX, WEIGHT_FILE, SourceCheckpoint, dtype_code
from headfold.converter.layout import AttentionCodec, HeadShape, expected_shapes, head_axis_sizes
from headfold.converter.per_layer import KV_HEADS_PER_ATTENTION, KV_HEADS_PER_LAYER, collapse, expand
from headfold.converter.recipes import DEFAULT_LOCAL_STEPS, DEFAULT_METHOD, LayerContext, Recipe, contiguous_groups, get_method
from headfold.converter.sources import checkpoint_folder, hub_origin
from headfold.converter.spec import Retarget, layer_tensor_pattern, spec_for
from headfold.converter.tokens import can_tokenize, read_text
from headfold.converter.writer import PlannedTensor, ShardedWriter
from headfold.ground.artifacts import MANIFEST
from headfold.ground.atomic import atomic_output, check_output
from headfold.ground.errors import BadInput
from headfold.ground.hashing import copy_hashed, sha256_file, versions
from headfold.ground.lazy import lazy_import
from headfold.ground.manifest import Conversion, Manifest, ManifestSource, load_raw
from headfold.ground.manifest import load as load_manifest
from headfold.ground.settings import Calibration, LocalFit
from headfold.ground.units import parse_size, whole

if TYPE_CHECKING:
    import torch
else:  # torch loads where tensors are made: a mean/first conversion runs without it
    torch = lazy_import("torch")

log = logging.getLogger(__name__)
SKIPPED_DIRS = {".git", ".cache", "__pycache__"}
PACKAGES = ("headfold", "torch", "transformers", "safetensors", "numpy")  # versions the manifest records


def convert(
    source: str | Path,
    output: str | Path,
    kv_heads: int | Sequence[int],
    method: str = DEFAULT_METHOD,
    *,
    revision: str | None = None,
    overwrite: bool = False,
    max_shard_size: str | int | None = None,
    allow_pickle: bool = False,
    calibration: str | Path | None = None,
    calibration_tokens: int = Calibration.tokens,
    seed: int = Calibration.seed,
    progress: bool = True,
    builtin_text: str | None = None,
    pool: str | None = None,
    local_steps: int | None = None,
    local_fit: LocalFit = LocalFit(),
) -> Path:
    """Convert the checkpoint folder `source` to `kv_heads` K/V heads; return the output path.

    `source` is a checkpoint folder or a hub id ORG/NAME (at `revision`, converter/sources.py).
    `kv_heads` is one count for every layer or one per layer; equal counts are the single count.

    Data-aware methods (grouped, aligned, refit) read activations on `calibration`: a text
    file, None for `builtin_text` (the caller's default text: `headfold.convert` and the CLI pass
    the embedded corpus; a checkpoint without tokenizer files, or no `builtin_text`, calibrates on the
    weights alone, with a warning), or "weights" to work on the weights alone.
    An encoder-decoder (T5, BART, Whisper) pools the attention kinds `pool` names (converter/seq2seq.py:
    self, cross, decoder, encoder or all; None: decoder, its self- and cross-attention); its data-aware
    methods calibrate on text split into source → target, or an audio model on synthesized features.
    `local_steps`: the Adam steps per layer of a method with `local` (None: DEFAULT_LOCAL_STEPS); `local_fit`: how it fits.
    Raises BadInput (nothing written) for anything wrong with the request or the source.
    """
    check_options(max_shard_size, calibration_tokens)
    source = checkpoint_folder(source, revision=revision, allow_pickle=allow_pickle)
    steps = local_step_budget(get_method(method), local_steps)
    with SourceCheckpoint(source, allow_pickle=allow_pickle) as ckpt:
        targets = target_shapes(ckpt, kv_heads, pool)
        recipe = method_for(ckpt, method)
        retarget = retarget_for(ckpt, targets)
        text_file = () if calibration is None or str(calibration) == "weights" else (Path(calibration),)
        out = check_output(Path(output), overwrite=overwrite, sources=(source, *text_file))  # never over an input
        shard_bytes = parse_size(max_shard_size, "--shard-size") if max_shard_size is not None else default_shard_bytes(ckpt)
        pools = targets != list(ckpt.layer_shapes)  # kv heads = heads everywhere: byte-identical, nothing to calibrate
        if recipe.data_aware and pools:  # the request is valid: say what the seconds before the first bar are
            log.info(
                f"convert: loading torch, transformers, the tokenizer and {calibration_tokens} tokens of {calibration or 'the built-in text'}; "
                "then calibrating one layer at a time"
            )
            from headfold.converter.calibration import check_settings  # torch and transformers: data-aware methods only

            check_settings()  # a bad $HEADFOLD_DEVICE or $HEADFOLD_CALIBRATION_RAM fails before the slow calibration
        text: str | seq2seq.SynthesizedAudio | None
        if ckpt.facts.audio_input and recipe.data_aware and pools:
            text = audio_calibration(calibration)
        else:
            text = calibration_text(calibration, builtin_text if can_tokenize(ckpt.facts) else None) if recipe.data_aware and pools else None
        if recipe.local and pools and text is None:
            recipe = without_local(recipe, method)
        fit = recipe.local and pools
        contexts = layer_contexts(ckpt, None if fit else text, calibration_tokens, seed, progress)
        fitted = fitted_layers(ckpt, targets, recipe, text, calibration_tokens, seed, contexts, steps, progress, local_fit) if fit and text is not None else {}
        fit_record = local_record(fitted, steps, local_fit)  # before write_weights takes the fitted layers
        with atomic_output(out, overwrite=overwrite) as tmp:
            files, groups = write_weights(ckpt, targets, recipe, contexts, tmp, shard_bytes, progress, retarget, fitted)
            files |= write_config(ckpt, targets, tmp, retarget)
            copied, skipped = copy_other_files(ckpt, tmp)
            files |= copied
            manifest = build_manifest(ckpt, targets, recipe, groups, files, skipped, retarget, pool)
            if recipe.data_aware and pools:
                used = "weights" if text is None else str(text) if isinstance(text, seq2seq.SynthesizedAudio) else str(calibration or "built-in")
                manifest.conversion.calibration = {"text": used, "tokens": calibration_tokens, "seed": seed}
                if fit:
                    manifest.conversion.calibration["local"] = fit_record
            manifest.save_in(tmp)
    return out


def check_options(max_shard_size: str | int | None, calibration_tokens: int | None) -> None:
    """What convert refuses in its options alone, before the source is read (run: before its first stage)."""
    if max_shard_size is not None:
        parse_size(max_shard_size, "--shard-size")
    whole("--calibration-tokens", calibration_tokens, 1)


def local_record(fitted: dict, steps: int, settings: LocalFit) -> dict:
    """What the manifest says of local's fit: the step budget, the fit's settings and, per layer, the steps taken, what the fit changed
    and the relative attention-output error before and after on every calibration window, the fitted ones and the
    held-out ones."""
    error, layers = {}, {}
    for i, layer in sorted(fitted.items()):
        error[str(i)] = [layer.start.whole, layer.end.whole]
        layers[str(i)] = {"steps": layer.steps, "free": layer.free, "fit": [layer.start.fit, layer.end.fit]}
        if layer.start.validation is not None:
            layers[str(i)]["validation"] = [layer.start.validation, layer.end.validation]
    return {"steps": steps, "settings": asdict(settings), "error": error, "layers": layers}


def local_step_budget(recipe: Recipe, steps: int | None) -> int:
    """The Adam steps per layer of `local`; BadInput for a budget without local or below one step."""
    if steps is None:
        return DEFAULT_LOCAL_STEPS
    if not recipe.local:
        raise BadInput(f"--local-steps applies to methods with local, not to {recipe.name}; drop it or add +local")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise BadInput(f"--local-steps {steps!r} is not a positive number of steps; give e.g. {DEFAULT_LOCAL_STEPS}")
    return steps


def fitted_layers(
    ckpt: SourceCheckpoint,
    targets: list[HeadShape],
    recipe: Recipe,
    text: str | seq2seq.SynthesizedAudio,
    tokens: int,
    seed: int,
    contexts: list[LayerContext],
    steps: int,
    progress: bool,
    settings: LocalFit,
) -> dict:
    """local's layers, converted while calibration runs them (converter/local.py: torch, imported only here)."""
    from headfold.converter import local

    return local.fitted_layers(ckpt, targets, recipe, text, tokens, seed, contexts, steps, progress, settings)


def target_shape(source: HeadShape, kv_heads: int, layer: int | str | None = None) -> HeadShape:
    """`source` pooled to `kv_heads`; BadInput naming the valid counts (and `layer`, for a per-layer list,
    or the attention it is, for an encoder-decoder)."""
    h, n = source.heads, source.kv_heads
    if not isinstance(kv_heads, int) or kv_heads < 1 or h % kv_heads or n % kv_heads:
        choices = ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)
        have = f"{h} attention heads" + (f" and {n} kv heads" if n != h else "")
        where = "" if layer is None else f" for {layer}" if isinstance(layer, str) else f" for layer {layer}"
        raise BadInput(f"--kv-heads {kv_heads}{where} is impossible for a model with {have}; choose one of: {choices}")
    return HeadShape(h, kv_heads, source.head_dim)


def target_shapes(ckpt: SourceCheckpoint, kv_heads: int | Sequence[int], pool: str | None = None) -> list[HeadShape]:
    """Each layer's target; a list must have one entry per layer dividing that layer's kv heads.
    An encoder-decoder's: each attention block's, pooled where `pool` names its kind."""
    if (kinds := seq2seq.pooled_kinds(ckpt.spec, pool)) is not None:
        return seq2seq_targets(ckpt, kv_heads, kinds)
    per_layer = expand(kv_heads, ckpt.layers)
    by_layer = not isinstance(kv_heads, int) or len(set(ckpt.layer_shapes)) > 1  # name the layer in errors
    targets = [target_shape(src, kv, i if by_layer else None) for i, (src, kv) in enumerate(zip(ckpt.layer_shapes, per_layer, strict=True))]
    if ckpt.spec.mqa_only and len({t.kv_heads for t in targets} | {1}) > 1:
        raise BadInput(f"transformers' {ckpt.spec.family} has multi-query attention (1 kv head) or none, nothing between: use --kv-heads 1 for every layer")
    return targets


def seq2seq_targets(ckpt: SourceCheckpoint, kv_heads: int | Sequence[int], kinds: Sequence[str]) -> list[HeadShape]:
    """Each attention block's target: `kv_heads` (one count, or one per layer of every pooled kind) for the
    blocks of `kinds`, the source's for the others."""
    targets = list(ckpt.layer_shapes)
    for kind in kinds:
        indices = [i for i, b in enumerate(ckpt.facts.blocks) if b.kind == kind]
        name = seq2seq.KIND_NAMES[kind]
        for layer, (i, kv) in enumerate(zip(indices, expand(kv_heads, len(indices)), strict=True)):
            targets[i] = target_shape(targets[i], kv, name if isinstance(kv_heads, int) else f"{name} layer {layer}")
    return targets


def audio_calibration(calibration: str | Path | None) -> seq2seq.SynthesizedAudio | None:
    """What an audio encoder-decoder (Whisper) calibrates on: synthesized log-mel features (None, the
    default: SYNTHESIZED_AUDIO), or the weights alone; BadInput for a text file, which it cannot read."""
    if calibration is None:
        return seq2seq.SYNTHESIZED_AUDIO
    if str(calibration) == "weights":
        return None
    raise BadInput("an audio encoder-decoder calibrates on synthesized log-mel features, not on text: drop --calibration, or pass --calibration weights")


def refused_modifiers(ckpt: SourceCheckpoint) -> dict[str, str]:
    """Modifier → why this model's maths does not allow it (its function would change)."""
    why: dict[str, str] = {}
    if ckpt.spec.alibi:
        why["grouped"] = why["scored"] = (
            f"{ckpt.spec.family} uses ALiBi, whose slope belongs to each query head's position, so grouped and scored (which move query heads) "
            "would change the model"
        )
    if ckpt.spec.head_position_bias:
        why["grouped"] = why["scored"] = (
            f"{ckpt.spec.family}'s relative attention bias belongs to each query head, so grouped and scored (which move query heads) would change the model"
        )
    if ckpt.config.get("clip_qkv") is not None:
        why["aligned"] = why["refit"] = "config.json sets clip_qkv: the q/k/v clamp does not commute with the rotations and refits of aligned and refit"
    return why


def without_refused(ckpt: SourceCheckpoint, method: str) -> str | None:
    """`method` without the parts this model refuses (refused_modifiers), as the default runs here: its name,
    or None when nothing of it is left. The benchmarks run every method so, to have a row on every model."""
    parts = [p for p in method.split("+") if p not in refused_modifiers(ckpt)]
    return get_method("+".join(parts)).name if parts else None


def method_for(ckpt: SourceCheckpoint, method: str) -> Recipe:
    """The recipe `method` names for this model. The default (DEFAULT_METHOD) leaves out what the model
    refuses, saying so in a warning; any other method that needs a refused modifier is BadInput."""
    recipe = get_method(method)
    refused = {m: why for m, why in refused_modifiers(ckpt).items() if getattr(recipe, m)}
    if not refused:
        return recipe
    reasons = "; ".join(dict.fromkeys(refused.values()))
    if method == DEFAULT_METHOD:
        off: dict[str, Any] = dict.fromkeys(refused, False)  # modifier fields, named by the family's refusals
        kept = replace(recipe, **off)
        log.warning(f"headfold: the default method is {kept.name} for this model, without {' and '.join(refused)}: {reasons}")
        return kept
    allowed = [m for m in ("mean", "first", "aligned", "grouped", "refit", "aligned+refit") if not set(m.split("+")) & set(refused)]
    raise BadInput(f"{reasons}; use {', '.join(allowed)}")


def without_local(recipe: Recipe, method: str) -> Recipe:
    """The default method where there is no calibration text (the weights alone): its other parts, with a
    warning; any other method with local is BadInput (local fits attention outputs on text)."""
    if method != DEFAULT_METHOD:
        raise BadInput(
            "local fits each layer's attention output on calibration text: pass --calibration TEXT_FILE (a checkpoint with tokenizer files), "
            "not the weights alone"
        )
    kept = replace(recipe, local=False)
    log.warning(
        f"headfold: the default method is {kept.name} here, without local: local fits each layer's attention output on calibration text, and "
        "this conversion has the weights alone"
    )
    return kept


def retarget_for(ckpt: SourceCheckpoint, targets: list[HeadShape]) -> Retarget | None:
    """The family an all-MQA conversion is written as, when its spec names one and the config fits it."""
    retarget = ckpt.spec.mqa_as
    return retarget if retarget and all(t.kv_heads == 1 for t in targets) and retarget.applies(ckpt.config) else None


def tensors_matching(ckpt: SourceCheckpoint, suffixes: Sequence[str]) -> set[str]:
    """Names of the source tensors that end in one of the per-layer `suffixes`."""
    patterns = [layer_tensor_pattern(s) for s in suffixes]
    return {name for name in ckpt.tensors if any(p.match(name) for p in patterns)}


def dropped_tensors(ckpt: SourceCheckpoint, targets: list[HeadShape], retarget: Retarget | None) -> set[str]:
    """Source tensors the output has no place for: per-head norms of pooled-away kv heads, and what
    the retarget family lacks."""
    hidden = ckpt.config[ckpt.spec.config.hidden]
    dropped = tensors_matching(ckpt, retarget.drop) if retarget else set()
    for layer, target in zip(ckpt.attention.layers, targets, strict=True):
        kept = expected_shapes(ckpt.spec, target, hidden)
        dropped |= {name for suffix, name in layer.items() if suffix not in kept}
    return dropped


def default_shard_bytes(ckpt: SourceCheckpoint) -> int:
    """Mirror the source: one file stays one file, shards keep the source's largest shard size."""
    if len(ckpt.weight_files) == 1:
        return 1 << 62
    return max(f.stat().st_size for f in ckpt.weight_files)


def plan_outputs(ckpt: SourceCheckpoint, targets: list[HeadShape], retarget: Retarget | None = None) -> list[PlannedTensor]:
    """Every output tensor's name, dtype and shape, in source storage order."""
    resized: dict[str, tuple[int, int]] = {}  # attention tensor → (head axis, its new size)
    for layer, target in zip(ckpt.attention.layers, targets, strict=True):
        sizes = head_axis_sizes(ckpt.spec, target)
        resized |= {name: sizes[suffix] for suffix, name in layer.items() if suffix in sizes}
    dropped = dropped_tensors(ckpt, targets, retarget)
    transposed = tensors_matching(ckpt, retarget.transpose) if retarget else set()
    planned = []
    for info in ckpt.tensors.values():
        if info.name in dropped:
            continue
        shape = list(info.shape)
        if info.name in resized:
            axis, size = resized[info.name]
            shape[axis] = size
        planned.append(PlannedTensor(info.name, info.code, tuple(shape[::-1] if info.name in transposed else shape)))
    return planned


def calibration_text(calibration: str | Path | None, builtin: str | None) -> str | None:
    """None → `builtin`, the caller's default text (None: the weights alone, said in a warning);
    "weights" → no activations (weight-space methods); else the text file."""
    if calibration is None:
        if builtin is None:
            log.warning(
                "headfold: no text to calibrate on (the checkpoint has no tokenizer files): the method works on the weights alone; pass "
                "--calibration TEXT_FILE with a tokenizer to calibrate on text"
            )
        return builtin
    if str(calibration) == "weights":
        return None
    return read_text(Path(calibration), "--calibration")


def layer_contexts(ckpt: SourceCheckpoint, text: str | seq2seq.SynthesizedAudio | None, tokens: int, seed: int, progress: bool) -> list[LayerContext]:
    """What a method may know about each layer: calibration inputs, RoPE dims, whether K may rotate."""
    inputs: Sequence[torch.Tensor | None]
    if text is None:
        inputs = [None] * ckpt.layers
    else:
        from headfold.converter.calibration import attention_inputs  # torch and transformers: only when calibrating

        inputs = attention_inputs(ckpt, text, tokens, seed, progress)
    spec, rotary = ckpt.spec, ckpt.facts.rotary.dims
    norms = [spec.qk_norm] if spec.qk_norm else []
    norms += spec.head_norm_suffixes("k", 1)  # StableLM: one norm per kv head, as little rotation-invariant
    normed = any(spec.tensor_pattern(norm).match(n) for norm in norms for n in ckpt.tensors)
    interleaved = spec.rotary_pairs == "interleaved"
    return [LayerContext(x, rotary, rotate_keys=not normed, interleaved=interleaved) for x in inputs]


def convert_layer(ckpt: SourceCheckpoint, index: int, target: HeadShape, recipe: Recipe, ctx: LayerContext) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """One layer's changed attention tensors, converted in fp32 and cast back to their source dtypes.

    Tensors the recipe leaves as they are stay unread (shapes only, on the meta device) and are
    not returned: the writer copies them unchanged. mean/first read the source dtype (mean
    accumulates in fp32 itself); the data-aware maths get fp32 copies. The torch path: every
    data-aware method, and mean/first of a pickle source (rawpool does the others)."""
    from headfold.converter.methods import convert_attention  # the torch maths: a mean/first conversion never loads them

    layer = ckpt.attention.layers[index]
    codec = AttentionCodec(ckpt.spec, ckpt.layer_shapes[index])
    kept = untouched_suffixes(ckpt, recipe)

    def read(suffix: str, name: str) -> torch.Tensor:
        if suffix in kept:
            return torch.empty(ckpt.tensors[name].shape, device="meta")
        return ckpt.get(name).float() if recipe.data_aware else ckpt.get(name)

    result = convert_attention(recipe, codec.decode({s: read(s, n) for s, n in layer.items()}), target.kv_heads, ctx)
    tensors = {layer[s]: t.to(ckpt.tensors[layer[s]].dtype) for s, t in codec.encode(result.attn).items() if s not in kept}
    return tensors, result.groups


def untouched_suffixes(ckpt: SourceCheckpoint, recipe: Recipe) -> set[str]:
    """What a recipe leaves byte-identical: the separate Q and O tensors under mean/first, which
    pool only K/V and keep the contiguous groups in place."""
    if recipe.data_aware:
        return set()
    kept = [p for role, p in ckpt.spec.projections.items() if role in "qo"]
    return {s for p in kept for s in (p.weight, p.bias) if s} | set(ckpt.spec.head_norm_suffixes("q", ckpt.shape.heads))


def write_weights(
    ckpt: SourceCheckpoint,
    targets: list[HeadShape],
    recipe: Recipe,
    contexts: list[LayerContext],
    folder: Path,
    shard_bytes: int,
    progress: bool,
    retarget: Retarget | None = None,
    fitted: dict | None = None,
) -> tuple[dict[str, str], list[list[list[int]]]]:
    """Stream every tensor to the output; return file hashes and each layer's head groups. `fitted`: layers
    local already converted (converter/local.py FittedLayer, tensors kept in fp32)."""
    fitted = fitted or {}
    plan = plan_outputs(ckpt, targets, retarget)
    transposed = tensors_matching(ckpt, retarget.transpose) if retarget else set()
    turn = lambda name, t: t.T if name in transposed else t  # noqa: E731 - the retarget family's layout
    owner = ckpt.attention.owner()
    raw = not recipe.data_aware and rawpool.readable(ckpt)  # mean/first without torch
    pending: dict[str, Any] = {}  # converted tensors (torch) or arrays (raw) of the current layer not yet written
    groups: list[list[list[int]]] = [[] for _ in range(ckpt.layers)]
    bar = tqdm(total=sum(t.nbytes for t in plan), unit="B", unit_scale=True, desc="convert", disable=not progress)
    with bar, ShardedWriter(folder, plan, shard_bytes, metadata={"format": "pt"}) as writer:
        for t in plan:
            if (layer := owner.get(t.name)) is not None and not groups[layer]:
                if targets[layer] == ckpt.layer_shapes[layer]:  # nothing to pool: every method keeps the layer as it is
                    converted, groups[layer] = {}, contiguous_groups(targets[layer].kv_heads, targets[layer].kv_heads)
                elif layer in fitted:
                    done = fitted.pop(layer)
                    converted, groups[layer] = {name: t.to(ckpt.tensors[name].dtype) for name, t in done.tensors.items()}, done.groups
                elif raw:
                    converted = rawpool.convert_layer(ckpt, layer, targets[layer], recipe.pool)
                    groups[layer] = contiguous_groups(ckpt.layer_shapes[layer].kv_heads, targets[layer].kv_heads)
                else:
                    converted, groups[layer] = convert_layer(ckpt, layer, targets[layer], recipe, contexts[layer])
                contexts[layer] = LayerContext()  # calibration inputs of a done layer: free them
                pending.update(converted)
            if t.name in pending:
                if raw:
                    writer.write_array(t.name, dtype_code(t.dtype), turn(t.name, pending.pop(t.name)))
                else:
                    writer.write(t.name, turn(t.name, pending.pop(t.name)))
            elif (source := ckpt.byte_range(t.name)) and t.name not in transposed:  # unchanged tensor: no trip through Python
                writer.copy(t.name, t.dtype, t.shape, source)
            else:
                writer.write(t.name, turn(t.name, ckpt.get(t.name)))
            bar.update(t.nbytes)
        return writer.finish(), groups


def write_config(ckpt: SourceCheckpoint, targets: list[HeadShape], folder: Path, retarget: Retarget | None = None) -> dict[str, str]:
    """The source config with the new kv heads: the largest layer's, plus the per-layer list when they
    differ; as the retarget family's config when there is one."""
    config = dict(ckpt.config)
    per_layer = [t.kv_heads for t in targets]
    if ckpt.spec.encoder_decoder:  # its own key: the family's num_key_value_heads means something else (Whisper) or nothing
        config[KV_HEADS_PER_ATTENTION] = kinds_kv_heads(ckpt, per_layer)
        return _write_json(folder, config)
    keys = ckpt.spec.config
    config[keys.kv_heads] = max(per_layer)
    if keys.multi_query:
        config[keys.multi_query] = max(per_layer) == 1
    config.pop(KV_HEADS_PER_LAYER, None)  # a per-layer source converted to one count
    if len(set(per_layer)) > 1:
        config[KV_HEADS_PER_LAYER] = per_layer
    if retarget:
        config |= {"model_type": retarget.model_type, "architectures": [retarget.architectures[config["architectures"][0]]], **retarget.config}
    return _write_json(folder, config)


def _write_json(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    raw = (json.dumps(config, indent=2) + "\n").encode()
    (folder / "config.json").write_bytes(raw)
    return {"config.json": hashlib.sha256(raw).hexdigest()}


def kinds_kv_heads(ckpt: SourceCheckpoint, per_block: Sequence[int]) -> dict[str, int | list[int]]:
    """An encoder-decoder's kv heads per attention kind (one count, or one per layer) from one per block."""
    by_kind: dict[str, list[int]] = {}
    for block, kv in zip(ckpt.facts.blocks, per_block, strict=True):
        by_kind.setdefault(block.kind, []).append(kv)
    return {kind: collapse(counts) for kind, counts in by_kind.items()}


def copy_other_files(ckpt: SourceCheckpoint, folder: Path) -> tuple[dict[str, str], list[str]]:
    """Copy tokenizer and every other non-weight file; return their sha256 and the stale
    weight files (other formats of the same MHA weights) that were left out."""
    source = ckpt.folder
    converted = {f.name for f in ckpt.weight_files} | {SAFETENSORS_INDEX, PICKLE_INDEX}
    copied: dict[str, str] = {}
    skipped: list[str] = []
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if not path.is_file() or SKIPPED_DIRS & set(rel.parts) or rel.as_posix() in ("config.json", MANIFEST):
            continue
        if WEIGHT_FILE.fullmatch(path.name):
            if rel.as_posix() not in converted:
                skipped.append(rel.as_posix())
            continue
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        copied[rel.as_posix()] = copy_hashed(path, folder / rel)
    return copied, skipped


def output_loader(ckpt: SourceCheckpoint, kv_heads: int | list[int], retarget: Retarget | None) -> str:
    """What loads the output: plain transformers when its family knows these kv heads, else headfold.load_model."""
    spec = spec_for(retarget.model_type) if retarget else ckpt.spec
    # per-layer kv heads are headfold's own config key: transformers would refuse them
    return "transformers" if spec.native_gqa and isinstance(kv_heads, int) else "headfold.load_model"


def load_hint(folder: Path) -> str | None:
    """How to load a conversion that plain transformers cannot (convert's last line); None when it can."""
    manifest = load_manifest(folder)
    if manifest.loader == "transformers":
        return None
    why = (
        "its layers have different kv-head counts" if isinstance(manifest.conversion.kv_heads, list) and not manifest.conversion.attentions
        else f"transformers has no grouped-query {manifest.source.model_type}"
    )  # fmt: skip
    entries = ["headfold.load_model"] + ["headfold.sentence_transformer (SentenceTransformer)"] * (folder / "modules.json").is_file()
    return f"plain transformers cannot load {folder} ({why}): load it with {' or '.join(entries)}"


def build_manifest(
    ckpt: SourceCheckpoint,
    targets: list[HeadShape],
    recipe: Recipe,
    groups: list[list[list[int]]],
    files: dict[str, str],
    skipped: list[str],
    retarget: Retarget | None = None,
    pool: str | None = None,
) -> Manifest:
    src = ckpt.shape
    uniform = all(layer == groups[0] for layer in groups)
    query_map = [[h // t.group for h in range(t.heads)] for t in targets]
    kv_heads = collapse([t.kv_heads for t in targets])
    parent = load_raw(ckpt.folder, "restore it or remove it from the source") if (ckpt.folder / MANIFEST).is_file() else None
    hub = hub_origin(ckpt.folder)  # a source given as a hub id
    return Manifest(
        source=ManifestSource(
            path=str(ckpt.folder.resolve()),
            model_type=ckpt.config.get("model_type"),
            family=ckpt.spec.family,
            heads=src.heads,
            kv_heads=collapse([s.kv_heads for s in ckpt.layer_shapes]),
            head_dim=src.head_dim,
            config_sha256=sha256_file(ckpt.folder / "config.json"),
            manifest=parent,
            repo_id=hub.repo_id if hub else None,
            revision=hub.commit if hub else None,
        ),
        conversion=Conversion(
            method=recipe.name,
            kv_heads=kv_heads,
            group_size=collapse([t.group for t in targets]),
            kv_head_of_query_head=query_map[0] if len(set(map(tuple, query_map))) == 1 else query_map,
            source_kv_heads_of_kv_head=groups[0] if uniform else groups,
            **(seq2seq_record(ckpt, targets, pool) if ckpt.spec.encoder_decoder else {}),
        ),
        loader=output_loader(ckpt, kv_heads, retarget),
        versions=versions(PACKAGES),
        files=files,
        skipped_weight_files=skipped,
    )


def seq2seq_record(ckpt: SourceCheckpoint, targets: list[HeadShape], pool: str | None) -> dict[str, Any]:
    """An encoder-decoder conversion's manifest entries: each attention kind's heads and kv heads, and the
    decoder's self- and cross-cache bytes per token before and after (the per-block lists of the other
    entries run over the kinds in this order)."""
    pooled = seq2seq.pooled_kinds(ckpt.spec, pool) or ()
    kinds = [b.kind for b in ckpt.facts.blocks]
    after = kinds_kv_heads(ckpt, [t.kv_heads for t in targets])
    attentions = {kind: {"heads": ckpt.layer_shapes[kinds.index(kind)].heads, "kv_heads": kv, "pooled": kind in pooled} for kind, kv in after.items()}
    return {"attentions": attentions, "cache_bytes_per_token": seq2seq.cache_bytes(ckpt, targets)}
