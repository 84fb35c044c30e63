"""What the rollout side is given to make rollouts: the run's settings and parts, named one by one, and the few
values that change as training goes (the model, the optimiser step) as callables. The scheduler and the rollout
sources read only this, never the trainer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from accelerate import Accelerator
from torch import nn

from ..episodes.multi_turn import EnvironmentPool, ToolLoop
from ..episodes.tools import AsyncRunner, ConversationTemplate, Toolbox, ToolCallLimits
from ..generation import Completions, PromptImages, RolloutBackend, SamplingSettings
from ..modeling.loading import max_positions
from ..reporting.metrics import MetricsRecorder
from .prompts import PromptEncoder

#: ``guard(what, local=True)``: stop every process when the block fails on one (``failures_reach_every_process`` on
#: this process's device); work that runs collectives itself passes ``local=False`` and is not guarded.
Guard = Callable[..., contextlib.AbstractContextManager]


@dataclass
class RolloutContext:
    """One trainer's parts that rollouts use."""

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
    processing_class: (
        Any  # what encodes prompts for a backend: the processor of a vision-language model, else tokenizer
    )
    max_prompt_tokens: int | None  # the longest prompt a rollout holds (None: not limited)
    vocab_size: int  # token ids a rollout may hold
    prompt_encoder: PromptEncoder
    tool_loop: ToolLoop | None = None  # multi-turn rollouts
    toolbox: Toolbox | None = None  # the tools of every sample, without environments
    environments: EnvironmentPool | None = None
    run_rollout_func: Callable[[list[Any]], Any] | None = None  # the user's rollout_func, given its trainer

    @property
    def training(self) -> bool:
        return self.model().training


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


def build_tool_loop(
    args: Any,
    tokenizer: Any,
    tool_schemas: list[dict[str, Any]],
    sampling: SamplingSettings,
    model: nn.Module,
    runner: AsyncRunner,
    processor: Any = None,
) -> ToolLoop:
    """The loop of multi-turn rollouts: turns of generation with the tools' results between them, in the model's chat
    template; ``processor``: a vision-language policy's, whose tool results may hold images."""
    template = ConversationTemplate(
        tokenizer,
        tool_schemas,
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
        runner,
        ToolCallLimits(args.tool_call_timeout, args.tool_call_concurrency),
        processor=processor,
        max_positions=max_positions(model),
    )
