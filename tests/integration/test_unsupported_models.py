"""A model headfold does not convert gets the same one line from every command, and never exit 3.

Falcon (a causal LM transformers traces with SDPA) still exports and verifies unconverted, MQA
included; ViT (no token ids) and MPT (eager attention only) do not, and every command says so the same
way; Falcon-RW's ALiBi, which torch.onnx refuses to trace, is one line from export.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version

from headfold.cli import main
from headfold.converter.spec import supported_model_types

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
MODELS = {
    "falcon": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(vocab_size=64, new_decoder_architecture=False, multi_query=False, **TINY)),
    "falcon-mqa": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(vocab_size=64, new_decoder_architecture=False, multi_query=True, **TINY)),
    "falcon-alibi": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(vocab_size=64, new_decoder_architecture=False, alibi=True, **TINY)),
    "vit": lambda: transformers.ViTModel(transformers.ViTConfig(intermediate_size=64, image_size=16, patch_size=8, **TINY)),
    "mpt": lambda: transformers.MptForCausalLM(transformers.MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=64)),
}
REFUSING = {  # command: arguments after it (SRC and OUT filled in)
    "convert": ["{src}", "{out}", "--kv-heads", "2"],
    "inspect": ["{src}"],
    "distill": ["{src}", "{src}", "{out}", "--data", "{src}/config.json"],
    "run": ["{src}", "{out}", "--kv-heads", "2"],
    "export": ["{src}", "{out}"],
    "verify": ["{src}", "{src}"],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folders = {}
    for name, build in MODELS.items():
        torch.manual_seed(0)
        build().save_pretrained(folders.setdefault(name, tmp_path_factory.mktemp(name)))
    return folders


def _answers(src: Path, out: Path, commands, capsys) -> dict[str, tuple[int, str]]:
    answers = {}
    for command in commands:
        args = [a.format(src=src, out=out) for a in REFUSING[command]]
        code = main([command, *args, "--quiet"])
        answers[command] = (code, capsys.readouterr().err.strip())
        assert not out.exists()
    return answers


@pytest.mark.parametrize("model, why", [("vit", "has no vocab_size"), ("mpt", "MptForCausalLM with its own attention only")])
def test_one_answer_from_every_command(model: str, why: str, models, tmp_path: Path, capsys) -> None:
    answers = _answers(models[model], tmp_path / "out", REFUSING, capsys)
    codes, lines = {code for code, _ in answers.values()}, {line for _, line in answers.values()}
    assert codes == {2} and len(lines) == 1, answers
    line = lines.pop()
    assert "\n" not in line and f"does not convert model_type '{model}'" in line
    assert f"it converts {', '.join(supported_model_types())};" in line and "export does not run on it either: " in line and why in line


def test_exportable_model_exports_and_verifies_unconverted(models, tmp_path: Path, capsys) -> None:
    answers = _answers(models["falcon"], tmp_path / "out", ["convert", "inspect", "distill", "run"], capsys)
    assert {code for code, _ in answers.values()} == {2} and len({line for _, line in answers.values()}) == 1
    assert next(iter(answers.values()))[1].endswith("export and verify run on it unconverted")

    assert main(["export", str(models["falcon"]), str(tmp_path / "onnx"), "--quiet"]) == 0
    assert main(["verify", str(models["falcon"]), str(tmp_path / "onnx"), "--quiet"]) == 0


def test_a_stock_mqa_falcon_exports_with_its_one_kv_head(models, tmp_path: Path, capsys) -> None:
    """transformers 5.25 on runs Falcon's multi_query attention through its shared attention code and
    says num_key_value_heads=1 in config.json: that is the model as it is, not a conversion to undo.
    Before 5.25 torch.onnx refuses Falcon's own MQA broadcast: one line, as for any model it refuses."""
    code = main(["export", str(models["falcon-mqa"]), str(tmp_path / "onnx"), "--quiet"])
    err = capsys.readouterr().err.strip()
    if Version(transformers.__version__) < Version("5.25"):
        assert code == 2 and err.startswith("headfold: error: torch.onnx cannot export this 'falcon' model") and "\n" not in err
        return
    assert code == 0, err
    assert json.loads((tmp_path / "onnx/export.json").read_text())["kv_heads"] == 1
    assert main(["verify", str(models["falcon-mqa"]), str(tmp_path / "onnx"), "--max-rows", "2", "--quiet"]) == 0  # KV cache fed back too


def test_export_that_torch_onnx_refuses_is_one_line(models, tmp_path: Path, capsys) -> None:
    assert main(["export", str(models["falcon-alibi"]), str(tmp_path / "onnx"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("headfold: error: torch.onnx cannot export this 'falcon' model (") and "\n" not in err
    assert not (tmp_path / "onnx").exists()
