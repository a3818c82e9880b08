"""Checkpoint conversion: MHA → GQA/MQA by pooling K/V heads, streamed and atomic."""

from headfold.converter.conversion import convert
from headfold.converter.recipes import METHODS
from headfold.converter.spec import supported_model_types

__all__ = ["convert", "METHODS", "supported_model_types"]
