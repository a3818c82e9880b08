"""Layer-wise reconstruction (`local`): the fit never ends above its start, leaves an exact start untouched
(kv = heads, identical heads), is deterministic, runs for every family (encoder-decoders included), refuses
what it cannot do in one line, and keeps calibration's memory bound (one layer loaded)."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.checkpoint_edits import edit_attention, identical_heads
from support.reading import outputs, read_tensors
from support.tiny_models import FAMILIES, HEADS

from headfold import Calibration, LocalFit, convert, corpus
from headfold.converter import local
from headfold.converter.calibration import sample_windows, text_feeds, text_windows
from headfold.converter.checkpoint import SourceCheckpoint
from headfold.converter.layerwise import layer_runs
from headfold.converter.layout import AttentionCodec, HeadShape
from headfold.converter.methods import convert_attention, expand_kv
from headfold.converter.modeling import at_kv_heads, load_model, parameter_names
from headfold.converter.recipes import DEFAULT_METHOD, get_method
from headfold.ground.errors import BadInput

BYTES = 256  # a byte-level vocabulary: the tiny models calibrate on the built-in text as bytes
POSITIONS = {
    "gpt2": {"n_positions": 256},
    "opt": {"max_position_embeddings": 256},
    "bert": {"max_position_embeddings": 256},
    "roberta": {"max_position_embeddings": 258},
}
TOKENS = 2048  # eight calibration windows: six fitted, two held out


def calibrated(family: str, tiny_checkpoint, **kwargs) -> Path:
    """A tiny model of `family` that reads calibration's 256-token windows of bytes."""
    return tiny_checkpoint(family, vocab_size=BYTES, **POSITIONS.get(family, {}), **kwargs)


def local_convert(src: Path, out: Path, method: str = "local", kv: int = 2, steps: int = 10, seed: int = 0, **kwargs) -> Path:
    return convert(src, out, kv_heads=kv, method=method, calibration=Calibration(tokens=TOKENS, seed=seed), local_steps=steps, progress=False, **kwargs)


def fit_errors(out: Path) -> dict[str, list[float]]:
    return json.loads((out / "headfold.json").read_text())["conversion"]["calibration"]["local"]["error"]


def fit_layers(out: Path) -> dict[str, dict]:
    return json.loads((out / "headfold.json").read_text())["conversion"]["calibration"]["local"]["layers"]


@pytest.fixture(autouse=True)
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HEADFOLD_DEVICE", "cpu")


def block_outputs(folder: Path, batch: torch.Tensor, layer: int) -> torch.Tensor:
    """The output of layer `layer`'s attention block, the model loaded as any user loads it."""
    model = load_model(folder, dtype=torch.float32)
    with SourceCheckpoint(folder) as ckpt:
        path = ckpt.spec.layer_prefix.format(layer=layer).rstrip(".")
    block = next(m for name, m in model.named_modules() if name == path or name.endswith("." + path))
    kept: list[torch.Tensor] = []
    block.register_forward_hook(lambda module, args, out: kept.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        model(input_ids=batch)
    return torch.cat(kept)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_fits_below_its_start(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    """No layer ends worse on its held-out windows than it started and the fit lowers the error, and the first
    layer's is the written model's own: its attention block, loaded at its kv heads, differs from the source's by
    exactly what the fit recorded."""
    assert_fits_below_its_start(family, tiny_checkpoint, tmp_path, LocalFit())


def assert_fits_below_its_start(family: str, tiny_checkpoint, tmp_path: Path, settings: LocalFit) -> None:
    src = calibrated(family, tiny_checkpoint)
    out = local_convert(src, tmp_path / "local", local_fit=settings)
    errors, layers = fit_errors(out), fit_layers(out)
    assert sorted(errors) == sorted(layers) == ["0", "1"]
    assert all(0 < layer["validation"][1] <= layer["validation"][0] for layer in layers.values()), layers
    assert all(0 < end <= start for start, end in errors.values()) and any(end < start for start, end in errors.values()), errors
    with SourceCheckpoint(src) as ckpt:
        batch = text_windows(ckpt, corpus.calibration_text(), TOKENS, seed=0)
    source, converted = block_outputs(src, batch, 0), block_outputs(out, batch, 0)
    written = float((converted - source).double().square().sum() / source.double().square().sum())
    assert written == pytest.approx(errors["0"][1], rel=1e-3)


@pytest.mark.parametrize("family", ["qwen3", "gpt2", "bloom", "gptj"])
def test_maps_fit_below_their_start(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    """free "maps" (pooled K/V and a map per query head on Q and on O) through q/k norms, fused QKV with biases,
    ALiBi and interleaved rotary: never worse on validation, better somewhere, and the written model's first
    block is what the fit recorded."""
    assert_fits_below_its_start(family, tiny_checkpoint, tmp_path, LocalFit(free="maps"))


@pytest.mark.parametrize("family", ["llama", "gpt2", "stablelm"])
def test_maps_at_their_start_are_the_start(family: str, tiny_checkpoint) -> None:
    """Identity maps multiplied into Q, its bias and O give back the start's tensors bit for bit."""
    src = calibrated(family, tiny_checkpoint)
    with SourceCheckpoint(src) as ckpt:
        codec = AttentionCodec(ckpt.spec, ckpt.shape)
        start = codec.decode({s: ckpt.get(n).float() for s, n in ckpt.attention.layers[0].items()})
    free = local.free_tensors(start, "maps")
    assert {"q", "o"}.isdisjoint(free) and free["q_map"].shape == (HEADS, *free["q_map"].shape[1:])
    again = local.applied(start, free)
    for name in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm"):
        a, b = getattr(start, name), getattr(again, name)
        assert (a is None and b is None) or torch.equal(a, b), name


def test_auto_frees_every_tensor_only_where_the_windows_determine_them(tiny_checkpoint, tmp_path: Path) -> None:
    """free "auto": every tensor while their parameters per fitted target stay within `determined`, else the maps;
    headfold.json says which each layer fitted, and the settings the fit ran with."""
    src = calibrated("llama", tiny_checkpoint)
    kinds = {}
    for determined in (1e9, 0.0):
        out = local_convert(src, tmp_path / str(determined), steps=2, local_fit=LocalFit(free="auto", determined=determined))
        kinds[determined] = {layer["free"] for layer in fit_layers(out).values()}
        assert json.loads((out / "headfold.json").read_text())["conversion"]["calibration"]["local"]["settings"]["determined"] == determined
    assert kinds == {1e9: {"all"}, 0.0: {"maps"}}


@pytest.mark.parametrize("family", ["t5", "bart", "whisper"])
def test_encoder_decoders_fit_their_decoder_attentions(family: str, tiny_checkpoint, tmp_path: Path) -> None:
    """The whole model runs once (teacher-forced; Whisper on synthesized audio), then each pooled block (the
    decoder's self- and cross-attention, by default) is fitted; the encoder's blocks are kept as they are."""
    src = tiny_checkpoint(family, vocab_size=BYTES) if family != "whisper" else tiny_checkpoint(family)
    out = local_convert(src, tmp_path / "local")
    errors = fit_errors(out)
    with SourceCheckpoint(src) as ckpt:
        pooled = [str(i) for i, block in enumerate(ckpt.facts.blocks) if block.kind != "encoder_self"]
    assert sorted(errors) == sorted(pooled)
    assert all(0 < end <= start for start, end in errors.values()) and any(end < start for start, end in errors.values()), errors
    source, converted = read_tensors(src), read_tensors(out)
    assert all(torch.equal(source[n], converted[n]) for n in source if ".encoder." in f".{n}" and n in converted)
    if family != "whisper":  # the first decoder self-attention's error is the written model's own, as for decoders
        first = pooled[0]
        written = seq2seq_block_error(src, out, int(first))
        assert written == pytest.approx(errors[first][1], rel=1e-3)


def seq2seq_block_error(src: Path, out: Path, index: int) -> float:
    """Relative squared error of attention block `index` of the model in `out` against `src`'s, on the calibration feeds."""
    kept = {}
    for folder in (src, out):
        model = load_model(folder, dtype=torch.float32)
        with SourceCheckpoint(folder) as ckpt:
            key = ckpt.spec.projections["k"].weight
            path = parameter_names(model, ckpt.facts)[ckpt.attention.layers[index][key]][: -len(key) - 1]
            feeds = text_feeds(ckpt, model, corpus.calibration_text(), TOKENS, seed=0)
        outputs_ = []
        model.get_submodule(path).register_forward_hook(lambda module, args, o, outputs_=outputs_: outputs_.append(o[0]))
        with torch.no_grad():
            for feed in feeds:
                model(**feed, use_cache=False)
        kept[folder] = torch.cat(outputs_).double()
    return float((kept[out] - kept[src]).square().sum() / kept[src].square().sum())


def test_a_diverging_fit_keeps_its_start(tiny_checkpoint, tmp_path: Path) -> None:
    """Every step far too large: each layer ends at its start, so the weights are the start method's, byte for byte."""
    src = calibrated("llama", tiny_checkpoint)
    out = local_convert(src, tmp_path / "local", method="aligned+grouped+refit+local", local_fit=LocalFit(rate=1e3))
    assert all(start == end for start, end in fit_errors(out).values())
    start = convert(src, tmp_path / "start", kv_heads=2, method="aligned+grouped+refit", calibration=Calibration(tokens=TOKENS), progress=False)
    assert (out / "model.safetensors").read_bytes() == (start / "model.safetensors").read_bytes()


@pytest.mark.parametrize("family", ["llama", "gpt2", "bloom"])
def test_an_exact_start_is_left_untouched(family: str, tiny_checkpoint) -> None:
    """kv = heads: the source's own weights reproduce each block exactly, and the fit returns them as they are."""
    src = calibrated(family, tiny_checkpoint)
    with SourceCheckpoint(src) as ckpt:
        batch = sample_windows([b % BYTES for b in range(2000)], TOKENS, seed=0)
        for run in layer_runs(ckpt, batch, torch.device("cpu"), sequential=False, progress=False):
            names, codec = ckpt.attention.layers[run.index], AttentionCodec(ckpt.spec, ckpt.layer_shapes[run.index])
            start = codec.decode({s: ckpt.get(n).float() for s, n in names.items()})
            tensors = lambda attn, run=run, names=names, codec=codec: {  # noqa: E731
                run.names[names[s]]: t for s, t in codec.encode(expand_kv(attn, ckpt.shape.kv_heads)).items()
            }
            result = local.fit(run, start, tensors, steps=5)
            assert result.attn is start and result.start == result.end and result.start.whole <= local.EXACT and result.steps == 0


@pytest.mark.parametrize("method", list(dict.fromkeys(["local", "aligned+grouped+refit+local", DEFAULT_METHOD])))
@pytest.mark.parametrize("family", ["llama", "gpt_neox", "bert"])
def test_identical_heads_stay_lossless(family: str, method: str, tiny_checkpoint, tmp_path: Path) -> None:
    """Every start pools identical heads exactly, so the fit (whatever it frees) returns it untouched."""
    src = edit_attention(calibrated(family, tiny_checkpoint), tmp_path / "src", identical_heads(HEADS // 2))
    out = local_convert(src, tmp_path / "out", method=method)
    diff = (outputs(src) - outputs(out)).abs().max().item()
    assert diff <= (1e-5 if method == "local" else 1e-4), f"{family} {method}: {diff}"  # refit's ridge: 1e-4, as at identity (test_methods)


def test_identity_is_byte_identical(tiny_checkpoint, tmp_path: Path) -> None:
    src = calibrated("llama", tiny_checkpoint)
    out = local_convert(src, tmp_path / "out", method=DEFAULT_METHOD, kv=HEADS)
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_deterministic_with_a_seed(tiny_checkpoint, tmp_path: Path) -> None:
    src = calibrated("gpt_neox", tiny_checkpoint)
    first, again = (local_convert(src, tmp_path / name, seed=3) for name in ("first", "again"))
    other = local_convert(src, tmp_path / "other", seed=4)
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    a, b = read_tensors(first), read_tensors(other)
    assert any(not torch.equal(a[n], b[n]) for n in a)  # other windows, another fit


def test_the_held_out_windows_are_a_seeded_share() -> None:
    """A quarter of the windows, at least one, chosen by the seed; none held out of a single window."""
    fitted, held = local.split(16, seed=0)
    assert len(held) == 4 and sorted(fitted + held) == list(range(16))
    assert local.split(16, seed=0) == (fitted, held) and local.split(16, seed=1) != (fitted, held)
    assert local.split(2, seed=0)[1] != [] and local.split(1, seed=0) == ([0], [])


def test_the_fit_stops_when_validation_stops_improving(tiny_checkpoint, tmp_path: Path) -> None:
    """Validation every step with a patience of one: the fit ends at the first step that does not improve it,
    well inside a budget of 500, records the steps it took, and keeps the best iterate on validation."""
    src = calibrated("llama", tiny_checkpoint)
    settings = LocalFit(every=1, patience=1, rate=0.5)  # large steps: validation turns within a few
    layers = fit_layers(local_convert(src, tmp_path / "out", steps=500, local_fit=settings))
    assert all(1 <= layer["steps"] < 500 for layer in layers.values()), layers
    assert all(layer["validation"][1] <= layer["validation"][0] for layer in layers.values()), layers


def test_each_tensor_keeps_its_source_dtype(tiny_checkpoint, tmp_path: Path) -> None:
    """A layer whose Q is bf16 and whose K, V and O are fp32 is written so: each tensor in its own dtype."""
    from safetensors.torch import load_file, save_file

    src = calibrated("llama", tiny_checkpoint)
    tensors = load_file(src / "model.safetensors")
    q = [n for n in tensors if n.endswith("q_proj.weight")]
    save_file({n: t.to(torch.bfloat16) if n in q else t for n, t in tensors.items()}, src / "model.safetensors", metadata={"format": "pt"})
    written = read_tensors(local_convert(src, tmp_path / "out"))
    assert {written[n].dtype for n in q} == {torch.bfloat16}
    assert {t.dtype for n, t in written.items() if n.endswith(("k_proj.weight", "v_proj.weight", "o_proj.weight"))} == {torch.float32}


def test_sequential_reads_the_converted_layers(tiny_checkpoint, tmp_path: Path) -> None:
    """GPTQ's order: the second layer fits on the first layer as written, so its start differs; the first's does not."""
    src = calibrated("llama", tiny_checkpoint)
    teacher = fit_errors(local_convert(src, tmp_path / "teacher"))
    sequential = fit_errors(local_convert(src, tmp_path / "sequential", local_fit=LocalFit(sequential=True)))
    assert teacher["0"] == sequential["0"] and teacher["1"][0] != sequential["1"][0]
    assert all(end <= start for start, end in sequential.values())


def test_run_fits_with_its_local_steps(tiny_checkpoint, tmp_path: Path) -> None:
    """run's convert stage takes --local-steps as convert does: its manifest records that budget, and no layer exceeds it."""
    from headfold import InputSpec, run

    src = calibrated("llama", tiny_checkpoint)
    run(src, tmp_path / "run", 2, calibration=Calibration(tokens=TOKENS), local_steps=3, inputs=InputSpec(max_rows=2, window=16, decode_steps=0))
    record = json.loads((tmp_path / "run" / "convert" / "headfold.json").read_text())["conversion"]["calibration"]["local"]
    assert record["steps"] == 3 and all(1 <= layer["steps"] <= 3 for layer in record["layers"].values()), record


@pytest.mark.parametrize(
    "family, kwargs, message",
    [
        ("llama", {"calibration": "weights"}, "local fits each layer's attention output on calibration text"),
        ("llama", {"local_steps": 0}, "--local-steps 0 is not a positive number of steps"),
    ],
)
def test_refused_in_one_line(family: str, kwargs: dict, message: str, tiny_checkpoint, tmp_path: Path) -> None:
    src = calibrated(family, tiny_checkpoint)
    with pytest.raises(BadInput, match=re.escape(message)) as err:
        convert(src, tmp_path / "out", kv_heads=2, method="local", progress=False, **{"local_steps": 2, **kwargs})
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_steps_without_local_are_refused(tiny_checkpoint, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"--local-steps applies to methods with local, not to aligned"):
        convert(calibrated("llama", tiny_checkpoint), tmp_path / "out", kv_heads=2, method="aligned", local_steps=5, progress=False)


def test_inspect_refuses_local(tiny_checkpoint) -> None:
    from headfold import inspect

    with pytest.raises(BadInput, match="inspect aligned"):
        inspect(calibrated("llama", tiny_checkpoint), method="aligned+local", progress=False)


def test_the_default_without_text_leaves_local_out(tiny_checkpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The weights alone give local nothing to fit: the default runs its other parts and says so (inspect
    predicts with those parts too); a method that names local is refused instead (above)."""
    from headfold import inspect

    src = calibrated("llama", tiny_checkpoint)
    with caplog.at_level(logging.WARNING, logger="headfold"):
        out = convert(src, tmp_path / "out", kv_heads=2, calibration="weights", progress=False)
    without = get_method(DEFAULT_METHOD).name.replace("+local", "")
    conversion = json.loads((out / "headfold.json").read_text())["conversion"]
    assert conversion["method"] == without and "local" not in conversion["calibration"]
    assert f"the default method is {without} here, without local" in caplog.text
    assert inspect(src, candidates="2", calibration=Calibration(tokens=TOKENS), progress=False).method == without


# A Llama layout larger than the bound below; its conversion with local in a fresh process. The peak comes
# from VmHWM: ru_maxrss starts from the forking parent's.
CHILD = """
import json, re, sys
from pathlib import Path
from headfold import Calibration, convert
convert(sys.argv[1], sys.argv[2], kv_heads=4, method="local", calibration=Calibration(tokens=512), local_steps=1, progress=False)
peak_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
print(json.dumps({"peak_rss_bytes": peak_kb * 1024}))
"""


@pytest.mark.slow
def test_peak_memory_is_one_layer(tmp_path: Path) -> None:
    """A 1.1 GB fp32 Llama layout (16 layers of hidden 1024) converted with local in a fresh process: peak RSS
    ≤ the interpreter's baseline + 2 × one fp32 layer + the converted attention tensors + the activations,
    well under the model itself."""
    from support.tiny_models import make_checkpoint

    hidden, layers, mlp, vocab = 1024, 16, 2816, 256
    src = make_checkpoint("llama", tmp_path / "src", hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=16,
                          num_key_value_heads=16, vocab_size=vocab, max_position_embeddings=512)  # fmt: skip
    layer = 4 * (4 * hidden * hidden + 3 * hidden * mlp)
    model = layers * layer + 4 * vocab * hidden
    converted = layers * 4 * (2 * hidden * hidden + 2 * hidden * hidden // 4)  # Q, O and the pooled K, V in fp32
    activations = 512 * hidden * 4 * 6  # hidden states, the layer's attention input, its block's input and output, gradients
    baseline = 750e6  # torch, transformers and what a conversion imports on the way (tokenizers, safetensors, accelerate)
    done = subprocess.run([sys.executable, "-c", CHILD, src, tmp_path / "out"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
    bound = baseline + 2 * layer + converted + activations
    assert bound < baseline + model  # the bound excludes holding the model
    assert peak <= bound, f"peak RSS {peak / 1e9:.2f} GB > {bound / 1e9:.2f} GB"


@pytest.mark.parametrize("field, value", [("free", "some"), ("batch", 0), ("rate", 0.0), ("validation", 0.9), ("runaway", 1.0), ("patience", 1.5)])
def test_local_fit_settings_are_checked(field: str, value: object) -> None:
    """LocalFit refuses a value outside its field's domain as it is built, naming the field."""
    with pytest.raises(BadInput, match=field):
        LocalFit(**{field: value})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gqa_form_is_the_mha_form(family: str, tiny_checkpoint) -> None:
    """Every family's block at the GQA shape (K/V projected once per kv head, as the converted model's block) gives
    the output and the gradient to the pooled K/V of the MHA block with each kv head repeated for its group."""
    src = calibrated(family, tiny_checkpoint)
    with SourceCheckpoint(src) as ckpt:
        shape = ckpt.layer_shapes[0]
        target = HeadShape(shape.heads, 2, shape.head_dim)
        runs = layer_runs(ckpt, text_windows(ckpt, corpus.calibration_text(), 512, seed=0), torch.device("cpu"), False, False, chunk=1)
        run = next(runs)  # its layer stays loaded while `runs` is open
        names = ckpt.attention.layers[0]
        source = AttentionCodec(ckpt.spec, shape).decode({s: ckpt.get(n).float() for s, n in names.items()})
        pooled = convert_attention(get_method("mean"), source, 2).attn
        before = (type(run.block), {n: (p.shape, p.data_ptr()) for n, p in run.block.named_parameters()}, vars(run.block).copy())
        block = at_kv_heads(run.block, family, shape, target.kv_heads)
        assert block is not None
        assert_gqa_form_is_mha_form(run, block, ckpt.spec, names, shape, target, pooled)
        assert (type(run.block), {n: (p.shape, p.data_ptr()) for n, p in run.block.named_parameters()}, vars(run.block)) == before  # untouched
        runs.close()


def assert_gqa_form_is_mha_form(run, block: torch.nn.Module, spec, names: dict[str, str], shape: HeadShape, target: HeadShape, pooled) -> None:

    def output_and_grad(module: torch.nn.Module, shape_of: HeadShape, attn) -> tuple[torch.Tensor, torch.Tensor]:
        k = attn.k.clone().requires_grad_(True)
        weights = dataclasses.replace(attn, k=k)
        weights = weights if shape_of.kv_heads == 2 else expand_kv(weights, shape_of.kv_heads)
        tensors = {run.names[names[s]]: t for s, t in AttentionCodec(spec, shape_of).encode(weights).items()}
        out = local.block_output(dataclasses.replace(run, block=module), tensors, 1)
        out.square().sum().backward()
        return out.detach(), k.grad

    (mha, mha_grad), (gqa, gqa_grad) = output_and_grad(run.block, shape, pooled), output_and_grad(block, target, pooled)
    assert torch.allclose(gqa, mha, rtol=1e-5, atol=1e-6 * float(mha.abs().max()))
    assert torch.allclose(gqa_grad, mha_grad, rtol=1e-4, atol=1e-5 * float(mha_grad.abs().max()))


@pytest.mark.parametrize(("family", "form"), [("llama", "gqa"), ("gpt2", "gqa"), ("bloom", "gqa"), ("llama", "wrong")])
def test_the_fit_at_the_gqa_shape_is_the_fit_at_the_mha_shape(family: str, form: str, tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    """A conversion whose fit runs the GQA block gives the fit of the MHA block it equals; a GQA form whose output
    differs on the first call (here counts that say one kv head) is not used."""
    src = calibrated(family, tiny_checkpoint)
    if form == "wrong":
        monkeypatch.setattr(local, "at_kv_heads", lambda block, model_type, shape, kv: at_kv_heads(block, model_type, shape, 1))
    grouped = local_convert(src, tmp_path / "gqa")
    monkeypatch.setattr(local, "at_kv_heads", lambda *args: None)
    expanded = local_convert(src, tmp_path / "mha")
    flat = lambda out: [e for layer in sorted(fit_errors(out)) for e in fit_errors(out)[layer]]  # noqa: E731
    assert flat(grouped) == pytest.approx(flat(expanded), rel=1e-4)
    with SourceCheckpoint(src) as ckpt:
        batch = text_windows(ckpt, corpus.calibration_text(), TOKENS, seed=0)
    for layer in (0, 1):  # the function, not the tensors: K's bias moves the scores of every key alike, so its steps are noise
        a, b = block_outputs(grouped, batch, layer), block_outputs(expanded, batch, layer)
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-4 * float(b.abs().max()))
