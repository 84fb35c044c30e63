"""Rollouts with ``model.generate``: works for any causal LM, on any device, with or without adapters.

Within a session (the turns of one multi-turn rollout) each turn continues the previous turn's KV cache where the
model and settings allow it (``kv_cache.py``), and re-prefills the whole context where they do not."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import GenerationConfig

from .base import Completions, PolicySessions, PromptImages, RolloutBackend, completion_masks
from .kv_cache import CacheReuse, TurnCache, cache_problem, continuation_problem
from .sampling import SamplingSettings

#: Why a session re-prefills when ``model.generate`` gave back a tensor of sequences, not the output holding the cache.
PLAIN_TENSOR_OUTPUT = (
    "model.generate returned a plain tensor of sequences (a wrapped or patched generate?), not an output holding the "
    "cache to continue"
)


class TransformersBackend(PolicySessions, RolloutBackend):
    """Samples completions with ``model.generate`` from the policy itself: no engine, no weights of its own.

    ``generation_model`` opens the policy as ``generate`` needs it (unwrapped, sharded weights gathered). With
    ``synced_gpus`` (sharded weights over several processes) every forward pass is a collective: a process whose
    completions all ended keeps stepping until every process's have.

    ``reuse_kv_cache``: within a :meth:`session`, a call whose rows extend the rows of the call before (a multi-turn
    rollout's next turn) takes their keys and values from that call's cache and prefills only the new tokens. The
    sampled tokens are those re-prefilling samples, up to float rounding in the logits; :attr:`cache_reuse` counts
    what was reused, and says why a call re-prefilled when it had to.
    """

    takes_images = True
    pads_rows_together = True

    def __init__(
        self,
        settings: SamplingSettings,
        generation_model: Callable[[], contextlib.AbstractContextManager[nn.Module]],
        synced_gpus: bool = False,
        reuse_kv_cache: bool = True,
    ):
        self.settings = settings
        self.generation_model = generation_model
        self.synced_gpus = synced_gpus
        self.collective = synced_gpus
        self.generation_config = settings.generation_config()
        self.reuse_kv_cache = reuse_kv_cache
        self.cache_reuse = CacheReuse()
        self._turn_cache: TurnCache | None = None  # the last call's cache, during a session

    def describe(self) -> str:
        return "model.generate"

    def _session_ended(self) -> None:
        self._turn_cache = None  # a cache never outlives its session

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
        generation_config = copy.deepcopy(self.generation_config)
        if max_new_tokens is not None:
            generation_config.max_new_tokens = max_new_tokens
        with self._opened_model() as model:
            previous, self._turn_cache = self._turn_cache, None  # freed before generating
            keep = self._keeps_cache(model, generation_config, images)
            continued = previous.continuation(prompt_ids, prompt_mask) if keep and previous is not None else None
            del previous
            generation_config.return_dict_in_generate = keep  # to get the cache back
            cache = {} if continued is None else {"past_key_values": continued[0]}
            was_training = model.training
            model.eval()
            try:
                with _without_checkpoint_sampling_defaults(model):
                    output = model.generate(
                        input_ids=prompt_ids,
                        attention_mask=prompt_mask,
                        generation_config=generation_config,
                        synced_gpus=self.synced_gpus,
                        **cache,
                        **(images.model_inputs if images is not None else {}),
                    )
            finally:
                model.train(was_training)
        # A wrapped or patched generate may return the bare sequences whatever it was asked: no cache comes back.
        plain_tensor = torch.is_tensor(output)
        sequences = output if plain_tensor else output.sequences
        completions = completion_masks(sequences[:, prompt_ids.size(1) :], self.settings.eos_token_ids)
        reused = 0 if continued is None else continued[1]
        self.cache_reuse.continued_turns += continued is not None
        self.cache_reuse.reused_tokens += reused
        self.cache_reuse.prefilled_tokens += int(prompt_mask.sum()) - reused
        if keep and plain_tensor:
            self.cache_reuse.fallback = PLAIN_TENSOR_OUTPUT
        elif keep:
            self._keep(output.past_key_values, prompt_mask, sequences, completions)
        return completions

    def _keep(
        self, cache: object, prompt_mask: torch.Tensor, sequences: torch.Tensor, completions: Completions
    ) -> None:
        """Keep a call's cache for the session's next call, unless its layers cannot be continued row by row."""
        self.cache_reuse.fallback = cache_problem(cache)
        if self.cache_reuse.fallback is None:
            self._turn_cache = TurnCache.after_generation(cache, prompt_mask, sequences, completions.lengths)

    def _keeps_cache(self, model: nn.Module, generation_config: GenerationConfig, images: PromptImages | None) -> bool:
        """Whether this call continues (or starts) a cache for the next turn; a fallback's reason is recorded."""
        if not self.reuse_kv_cache or self._session_model is None:
            self.cache_reuse.fallback = None if self.reuse_kv_cache else "reuse_kv_cache=False"
            return False
        self.cache_reuse.fallback = continuation_problem(model, generation_config, images is not None, self.synced_gpus)
        return self.cache_reuse.fallback is None


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
