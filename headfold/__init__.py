"""headfold: MHA → GQA/MQA conversion, distillation, ONNX export, TensorRT engines, verification.

One function per command, with the command's options as keyword arguments (headfold.api):
convert, inspect, distill, export, build, verify, run, and load_model. The rooms are importable
as ``headfold.converter``, ``headfold.graphs`` and ``headfold.plugins``; heavy dependencies
(torch, transformers, onnx) load only when a function runs.
"""

from headfold.api import build, convert, distill, export, inspect, load_model, run, sentence_transformer, verify
from headfold.ground import VERSION as __version__

__all__ = ["convert", "inspect", "distill", "export", "build", "verify", "run", "load_model", "sentence_transformer", "__version__"]
