"""Rollouts with ``model.generate``: works for any causal LM, on any device, with or without adapters."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import GenerationConfig

from .base import Completions, PromptImages, RolloutBackend, completion_masks
from .sampling import SamplingSettings


class TransformersBackend(RolloutBackend):
    """Samples completions with ``model.generate`` from the policy itself: no engine, no weights of its own.

    ``generation_model`` opens the policy as ``generate`` needs it (unwrapped, sharded weights gathered). With
    ``synced_gpus`` (sharded weights over several processes) every forward pass is a collective: a process whose
    completions all ended keeps stepping until every process's have.
    """

    takes_images = True

    def __init__(
        self,
        settings: SamplingSettings,
        generation_model: Callable[[], contextlib.AbstractContextManager[nn.Module]],
        synced_gpus: bool = False,
    ):
        self.settings = settings
        self.generation_model = generation_model
        self.synced_gpus = synced_gpus
        self.collective = synced_gpus
        self.generation_config = settings.generation_config()
        self._session_model: nn.Module | None = None  # the policy opened for generation, during a session

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        # Sharded weights are gathered once for all the turns, not once per turn.
        if self._session_model is not None:
            yield
            return
        with self.generation_model() as model:
            self._session_model = model
            try:
                yield
            finally:
                self._session_model = None

    def _opened_model(self) -> contextlib.AbstractContextManager[nn.Module]:
        if self._session_model is not None:
            return contextlib.nullcontext(self._session_model)
        return self.generation_model()

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        max_new_tokens: int | None = None,
        images: PromptImages | None = None,
    ) -> Completions:
        """As :meth:`RolloutBackend.generate`; prompts with images bring the model's inputs for them (pixel values,
        image grids, token type ids)."""
        generation_config = self.generation_config
        if max_new_tokens is not None:
            generation_config = copy.deepcopy(generation_config)
            generation_config.max_new_tokens = max_new_tokens
        with self._opened_model() as model:
            was_training = model.training
            model.eval()
            try:
                with _without_checkpoint_sampling_defaults(model):
                    output = model.generate(
                        input_ids=prompt_ids,
                        attention_mask=prompt_mask,
                        generation_config=generation_config,
                        synced_gpus=self.synced_gpus,
                        **(images.model_inputs if images is not None else {}),
                    )
            finally:
                model.train(was_training)
        return completion_masks(output[:, prompt_ids.size(1) :], self.settings.eos_token_ids)


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
