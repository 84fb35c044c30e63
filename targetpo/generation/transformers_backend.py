"""Rollouts with ``model.generate``: works for any causal LM, on any device, with or without adapters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from .base import Completions, completion_masks


class TransformersGenerator:
    """Samples completions with the config's sampling settings from the (unwrapped) policy."""

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float | None = None,
        repetition_penalty: float = 1.0,
        generation_kwargs: dict[str, Any] | None = None,
        synced_gpus: bool = False,
    ):
        self.eos_token_ids = list(eos_token_ids)
        # With sharded weights every forward pass is a collective: a process whose completions all ended must keep
        # stepping until every process's have.
        self.synced_gpus = synced_gpus
        settings: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            eos_token_id=self.eos_token_ids,
            pad_token_id=pad_token_id,
            use_cache=True,
        )
        settings.update(generation_kwargs or {})
        self.generation_config = GenerationConfig(**settings)

    @torch.no_grad()
    def generate(self, model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Completions:
        """One completion per prompt row; rows that repeat a prompt give independent samples."""
        was_training = model.training
        model.eval()
        try:
            with _without_checkpoint_sampling_defaults(model):
                output = model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    generation_config=self.generation_config,
                    synced_gpus=self.synced_gpus,
                )
        finally:
            model.train(was_training)
        return completion_masks(output[:, prompt_ids.size(1) :], self.eos_token_ids)


@contextlib.contextmanager
def _without_checkpoint_sampling_defaults(model: nn.Module) -> Iterator[None]:
    """Hide the checkpoint's generation_config while generating.

    ``generate`` fills every setting left unset in the config it is given from ``model.generation_config``, so a
    checkpoint's min_p, suppress_tokens, no_repeat_ngram_size, ... would reshape sampling behind the trainer's back.
    The sampled distribution must be exactly the one the configuration (and the trainer's log-probs) describes.
    """
    owner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT generates with the base
    saved = owner.generation_config
    owner.generation_config = GenerationConfig(bos_token_id=getattr(saved, "bos_token_id", None))
    try:
        yield
    finally:
        owner.generation_config = saved
