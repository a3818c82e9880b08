"""Verification: runners (torch, ONNX Runtime; TensorRT plugs in), metrics, gated checks, reports.

The entry point is `headfold.verify(reference, candidate, ...)` (verification.api.verify).
"""

from headfold.verification.api import verify
from headfold.verification.budget import Thresholds
from headfold.verification.inputs import InputSpec
from headfold.verification.report import Report

__all__ = ["verify", "Thresholds", "InputSpec", "Report"]
