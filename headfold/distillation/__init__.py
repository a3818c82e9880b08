"""Distillation: recover the conversion loss by training the GQA student towards its MHA teacher."""

from headfold.distillation.run import DistillOptions, distill

__all__ = ["DistillOptions", "distill"]
