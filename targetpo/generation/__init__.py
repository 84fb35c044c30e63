"""Rollout backends: they turn left-padded prompt ids into completion ids."""

from .base import Completions, completion_masks
from .transformers_backend import TransformersGenerator

__all__ = ["Completions", "TransformersGenerator", "completion_masks"]
