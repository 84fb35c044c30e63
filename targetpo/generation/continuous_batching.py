"""Rollouts through transformers' continuous batching: each prompt a request of its own, scheduled token by token over
a paged KV cache, run by the policy module itself (no copy of its weights, so every update reaches the next rollout).

Each :meth:`ContinuousBatchingBackend.generate` call builds an engine over the policy, sized for that call's
requests, and drops it with its cache once every request has finished: no cache outlives the weights it was computed
with, and memory does not grow from one rollout to the next."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.generation import ContinuousBatchingConfig
from transformers.generation import logits_process as processors
from transformers.generation.continuous_batching.utils import WorkloadHints

from .base import Completions, PolicySessions, PromptImages, RolloutBackend, pad_completions, unpadded_prompts
from .sampling import SamplingSettings

#: The logits processors the engine applies to each request's next-token scores alone, as ``model.generate`` does:
#: none reads the tokens before it, which the engine does not give a processor (only each request's last token).
ROW_WISE_PROCESSORS = (
    processors.TemperatureLogitsWarper,
    processors.TopKLogitsWarper,
    processors.TopPLogitsWarper,
    processors.MinPLogitsWarper,
    processors.TypicalLogitsWarper,
    processors.EpsilonLogitsWarper,
    processors.EtaLogitsWarper,
    processors.SuppressTokensLogitsProcessor,
    processors.InfNanRemoveLogitsProcessor,
    processors.LogitNormalization,
)
#: GenerationConfig settings the engine leaves unread: a time limit, and the minimum lengths, whose processors need the
#: EOS tensors only ``model.generate`` prepares.
IGNORED_GENERATION_SETTINGS = ("max_time", "min_new_tokens", "min_length")


class ContinuousBatchingBackend(PolicySessions, RolloutBackend):
    """Samples completions with transformers' continuous-batching engine (``init_continuous_batching``) over the
    policy itself: each row's prompt, unpadded, is a request; a row stops at its own EOS or length limit, and its slot
    is given to the next request at once.

    Sampling is the run's (:class:`SamplingSettings`): temperature, top-k, top-p, min-p and suppressed tokens apply
    per request exactly as in ``model.generate``; settings whose processor reads a request's earlier tokens
    (``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ...) are refused when the backend is built,
    since the engine would drop them. The engine reports each sampled token's log-prob under the distribution it
    sampled from (tempered, after the processors): they fill ``Completions.sampler_logps``, for the
    importance-sampling correction (``vllm_importance_sampling_correction``) and the off-policy mask, as with vLLM.

    ``engine_settings`` are ``ContinuousBatchingConfig`` fields (``transformers_continuous_batching_config``). Without
    ``num_blocks`` or ``max_memory_percent`` the cache is sized to each call's requests (every request held at
    once), so it never takes more memory than the rollout needs; ``max_batch_tokens`` likewise defaults to the call's
    prompt tokens (at most 8192). Prompts with images are not taken (``takes_images`` is False).
    """

    def __init__(
        self,
        settings: SamplingSettings,
        generation_model: Callable[[], contextlib.AbstractContextManager[nn.Module]],
        policy: nn.Module,
        engine_settings: dict[str, Any] | None = None,
    ):
        self.settings = settings
        self.generation_model = generation_model
        self.engine_settings = dict(engine_settings or {})
        self.generation_config = engine_generation_config(settings)
        check_engine_sampling(engine_model(policy), self.generation_config)
        self.cache_sizes: list[int] = []  # each call's cache, in bytes: sized per call, freed after it

    def describe(self) -> str:
        return "transformers continuous batching"

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        max_new_tokens: int | None = None,
        images: PromptImages | None = None,
    ) -> Completions:
        """As :meth:`RolloutBackend.generate`: one request per row, its prompt without padding."""
        if images is not None:
            raise ValueError(
                "use_transformers_continuous_batching=True cannot generate from prompts with images: set "
                "use_transformers_continuous_batching=False (model.generate takes them) or use_vllm=True."
            )
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        limit = self.settings.max_new_tokens if max_new_tokens is None else max_new_tokens
        with self._opened_model() as model:
            tokens, logps = self._run(engine_model(model), prompts, limit)
        return pad_completions(
            tokens, logps, self.settings.pad_token_id, self.settings.eos_token_ids, device=prompt_ids.device
        )

    def _run(self, model: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> tuple[list, list]:
        """Every prompt's sampled tokens and their log-probs, in the prompts' order."""
        was_training = model.training  # the engine puts the model in eval mode and leaves it so
        with quiet_processor_warnings():
            manager = model.init_continuous_batching(
                generation_config=self.generation_config,
                continuous_batching_config=self.engine_config(prompts, max_new_tokens),
                workload_hints=WorkloadHints(max(map(len, prompts)), max_new_tokens, len(prompts)),
            )
        try:
            manager.start()
            # Queued while the engine waits, so its first step sees them all: batches (and so samples) do not depend
            # on how fast requests arrive.
            with manager.pause():
                request_ids = manager.add_requests(prompts, max_new_tokens=max_new_tokens)
            outputs = _finished_outputs(manager, request_ids)
            self.cache_sizes.append(manager.batch_processor.cache.cache_tensor.numel())
        finally:
            manager.stop(block=True)
            manager.destroy()
            model.train(was_training)
        return [outputs[rid].generated_tokens for rid in request_ids], [outputs[rid].logprobs for rid in request_ids]

    def engine_config(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> ContinuousBatchingConfig:
        """The engine's settings: the user's, the log-probs the trainer needs, and a cache sized to these requests
        unless the user sized it."""
        fields = dict(self.engine_settings)
        # No seed: the engine seeds its sampler from torch's generator, which the run's seed set.
        fields.update(return_logprobs=True, seed=None, drop_unsupported_processors=False)
        page_size = fields.get("page_size") or fields.get("block_size") or ContinuousBatchingConfig.page_size
        if fields.get("num_blocks") is None and fields.get("max_memory_percent") is None:
            fields["num_blocks"] = sum(math.ceil((len(prompt) + max_new_tokens) / page_size) for prompt in prompts)
        if fields.get("max_batch_tokens") is None:
            fields["max_batch_tokens"] = min(8192, max(sum(map(len, prompts)), len(prompts)))
        return ContinuousBatchingConfig(**fields)


def engine_model(model: nn.Module) -> nn.Module:
    """The transformers model the engine runs: a PEFT model's base model, whose layers hold the active adapters."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def engine_generation_config(settings: SamplingSettings) -> GenerationConfig:
    """``model.generate``'s settings for the engine, without the KV-cache choice (the engine pages its own)."""
    fields = settings.generation_config_fields()
    fields.pop("cache_implementation", None)
    return GenerationConfig(**fields)


def check_engine_sampling(model: nn.Module, generation_config: GenerationConfig) -> None:
    """Refuse sampling settings the engine would not honour: a logits processor that reads a request's earlier
    tokens (the engine would drop it, or feed it only the last token), or a setting it leaves unread."""
    made = model._get_logits_processor(generation_config)
    refused = [type(processor).__name__ for processor in made if not isinstance(processor, ROW_WISE_PROCESSORS)]
    if refused:
        raise ValueError(
            f"use_transformers_continuous_batching=True cannot honour the sampling settings that make "
            f"{', '.join(refused)} (repetition_penalty, no_repeat_ngram_size, min_new_tokens, bad_words_ids, ...): "
            "the engine gives a logits processor only each request's last token, not the tokens before it. Remove "
            "those settings, or set use_transformers_continuous_batching=False (model.generate honours them)."
        )
    blank = GenerationConfig()
    ignored = [name for name in IGNORED_GENERATION_SETTINGS if getattr(generation_config, name) != getattr(blank, name)]
    if ignored:
        raise ValueError(
            f"use_transformers_continuous_batching=True leaves generation_kwargs {ignored} unread: remove them, or "
            "set use_transformers_continuous_batching=False."
        )


def _finished_outputs(manager: Any, request_ids: list[str]) -> dict[str, Any]:
    """Wait for every request's final output; an engine that stops or a request that fails raises."""
    outputs: dict[str, Any] = {}
    while len(outputs) < len(request_ids):
        output = manager.get_result(timeout=1)
        if output is None:
            if not manager.is_running():
                raise RuntimeError(
                    f"transformers' continuous-batching engine stopped with {len(request_ids) - len(outputs)} "
                    "requests unfinished"
                ) from manager.background_thread_status.fatal_error
            continue
        if output.error is not None:
            raise RuntimeError(f"transformers' continuous-batching engine failed a request: {output.error}")
        if output.is_finished():
            outputs[output.request_id] = output
    return outputs


@contextlib.contextmanager
def quiet_processor_warnings() -> Iterator[None]:
    """Hide the engine's warning that a processor it has not classified "might not be supported": the processors
    that reach it were checked (:data:`ROW_WISE_PROCESSORS`)."""
    engine_logger = logging.getLogger("ContinuousBatchingLogger")  # the engine's own logger

    def keep(record: logging.LogRecord) -> bool:
        return "might not be supported by CB" not in record.getMessage()

    engine_logger.addFilter(keep)
    try:
        yield
    finally:
        engine_logger.removeFilter(keep)
