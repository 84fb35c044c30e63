"""Rollout backends: they turn left-padded prompt ids into completion ids (vLLM's live in ``vllm_*.py``)."""

from .base import Completions, completion_masks, pad_completions, unpadded_prompts
from .transformers_backend import TransformersGenerator

__all__ = ["Completions", "TransformersGenerator", "completion_masks", "pad_completions", "unpadded_prompts"]
