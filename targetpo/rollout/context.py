"""What the rollout side is given to make rollouts: the run's settings and parts, named one by one, and the few
values that change as training goes (the model, the optimiser step) as callables. The scheduler and the rollout
sources read only this, never the trainer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from torch import nn

from ..episodes.async_runner import ToolCallLimits
from ..episodes.chat_template import ConversationTemplate
from ..episodes.environments import EnvironmentPool
from ..episodes.multi_turn import ToolLoop
from ..episodes.parts import EpisodeParts
from ..generation import Completions, PromptImages, RolloutBackend, SamplingSettings
from ..modeling.loading import PromptLimit, max_positions
from ..reporting.metrics import MetricsRecorder
from .prompts import PromptEncoder

#: ``guard(what, local=True)``: stop every process when the block fails on one (``failures_reach_every_process`` on
#: this process's device); work that runs collectives itself passes ``local=False`` and is not guarded.
Guard = Callable[..., contextlib.AbstractContextManager]


@dataclass
class RolloutContext:
    """One trainer's parts that rollouts use, and the prompt encoder and tool loop made from them."""

    args: Any  # the run's config
    accelerator: Accelerator
    sampling: SamplingSettings
    metrics: MetricsRecorder
    guard: Guard
    #: the training model as the Trainer holds it now (``trainer.model``) and wrapped by its engine (``model_wrapped``)
    model: Callable[[], nn.Module]
    engine_model: Callable[[], nn.Module]
    global_step: Callable[[], int]  # the optimiser step the weights are at
    sharded: bool  # ZeRO-3 / FSDP2: every forward pass, generation included, is a collective
    tokenizer: Any
    processor: Any  # a vision-language model's processor: encodes prompts with images; else None
    prompt_limit: PromptLimit
    images_allowed: bool  # whether prompts may carry images (else a row with one is refused, saying why)
    episodes: EpisodeParts  # tools, environments, the async runner
    run_rollout_func: Callable[[list[Any]], Any] | None = None  # the user's rollout_func, given its trainer
    prompt_encoder: PromptEncoder = field(init=False)
    tool_loop: ToolLoop | None = field(init=False)
    vocab_size: int = field(init=False)  # token ids a rollout may hold

    def __post_init__(self) -> None:
        model = self.accelerator.unwrap_model(self.model())
        # The tokenizer's ids, and any the output layer has beyond them (padded vocabularies).
        text_config = model.config.get_text_config(decoder=True)
        self.vocab_size = max(len(self.tokenizer), getattr(text_config, "vocab_size", None) or 0)
        self.prompt_encoder = PromptEncoder(
            self.tokenizer,
            self.processor,
            self.episodes.tool_schemas,
            self.args.chat_template_kwargs,
            self.prompt_limit,
            self.sampling.pad_token_id,
            self.accelerator.device,
            self.guard,
            images_allowed=self.images_allowed,
        )
        self.tool_loop = self._tool_loop(model) if self.episodes.multi_turn else None

    @property
    def training(self) -> bool:
        return self.model().training

    @property
    def environments(self) -> EnvironmentPool | None:
        return self.episodes.environments

    @property
    def processing_class(self) -> Any:
        """What encodes prompts for a backend: the processor of a vision-language model, else the tokenizer."""
        return self.processor or self.tokenizer

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest prompt a rollout holds (None: not limited)."""
        return self.prompt_limit.tokens

    def _tool_loop(self, model: nn.Module) -> ToolLoop:
        """The loop of multi-turn rollouts: turns of generation with the tools' results between them, in the model's
        chat template (a vision-language policy's tool results may hold images)."""
        args, sampling = self.args, self.sampling
        template = ConversationTemplate(
            self.tokenizer,
            self.episodes.tool_schemas,
            sampling.eos_token_ids,
            args.chat_template_kwargs,
            model.config.model_type,
            added_stop_token_ids=sampling.added_stop_token_ids,
        )
        return ToolLoop(
            template,
            args.max_completion_length,
            args.max_tool_calling_iterations,
            sampling.eos_token_ids,
            sampling.pad_token_id,
            self.episodes.async_runner,
            ToolCallLimits(args.tool_call_timeout, args.tool_call_concurrency),
            processor=self.processor,
            max_positions=max_positions(model),
        )


class RolloutService(Protocol):
    """What a rollout source asks of the scheduler that runs it (``scheduler.py``): the backend, completions (maybe
    generated ahead), episodes played ahead, weight pushes, and the staleness of what was generated."""

    @property
    def backend(self) -> RolloutBackend: ...

    def completions(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, mode: str, images: PromptImages | None = None
    ) -> Completions: ...

    def take_played(self) -> Any | None: ...

    def sync_weights(self) -> None: ...

    def record_staleness(self, completions: Completions, mode: str) -> None: ...
