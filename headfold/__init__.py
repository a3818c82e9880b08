"""headfold: MHA → GQA/MQA conversion, ONNX export, TensorRT engines, verification.

The rooms are importable as ``headfold.converter``, ``headfold.graphs`` and
``headfold.plugins``; heavy dependencies load only when used.
"""

from __future__ import annotations

from headfold.ground import VERSION as __version__

__all__ = ["convert", "distill", "load_model", "sentence_transformer", "verify", "run", "__version__"]


def convert(source, output, kv_heads, method: str = "mean", **options):
    """`headfold.converter.convert`, with the embedded corpus as the calibration text when
    `calibration` is None (as `headfold convert` does); the options are the same."""
    from headfold import corpus
    from headfold.converter import convert as convert_checkpoint

    options.setdefault("builtin_text", corpus.calibration_text())
    return convert_checkpoint(source, output, kv_heads, method, **options)


def __getattr__(name: str):  # lazy: `import headfold` stays cheap
    if name == "distill":
        from headfold.distillation import distill

        return distill
    if name == "load_model":
        from headfold.converter.modeling import load_model

        return load_model
    if name == "sentence_transformer":
        from headfold.converter.sentence import sentence_transformer

        return sentence_transformer
    if name == "verify":
        from headfold.verification import verify

        return verify
    if name == "run":
        from headfold.pipeline import run

        return run
    raise AttributeError(f"module 'headfold' has no attribute {name!r}")
