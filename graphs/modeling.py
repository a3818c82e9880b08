"""The torch model for a checkpoint lives in converter/ (weights → torch module sits below ONNX);
graphs/ keeps this name for the exporters and existing imports."""

from headfold.converter.modeling import GQA_ATTENTION, load_model, parameter_names

__all__ = ["GQA_ATTENTION", "load_model", "parameter_names"]
