"""What a run's episodes are made of: the tools every sample may call, the environments (one per sample, built by
their factory), and the runner of async tools and rewards; checked together when the trainer is built."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .async_runner import AsyncRunner
from .environments import EnvironmentPool, with_environment_rewards
from .multi_turn import check_multi_turn_arguments
from .tools import Toolbox


@dataclass
class EpisodeParts:
    """The tools, the environments and the async runner of a run."""

    tools: list[Callable]
    toolbox: Toolbox  # the tools of every sample, when there is no environment
    async_runner: AsyncRunner  # async tools and rewards; its thread starts on first use
    environments: EnvironmentPool | None = None

    @classmethod
    def of(cls, tools: Sequence[Callable] | None, environment_factory: Any, rollout_func: Any) -> EpisodeParts:
        """The parts a trainer's ``tools``, ``environment_factory`` and ``rollout_func`` ask for, checked."""
        tools = list(tools or [])
        check_multi_turn_arguments(tools, environment_factory, rollout_func)
        runner = AsyncRunner()
        environments = None if environment_factory is None else EnvironmentPool(environment_factory, tools, runner)
        return cls(tools, Toolbox(tools), runner, environments)

    @property
    def multi_turn(self) -> bool:
        """Tools or environments: rollouts are loops of turns with the tools' results between them."""
        return bool(self.tools) or self.environments is not None

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools every prompt shows (an environment's come from a probe instance)."""
        return self.environments.tool_schemas if self.environments is not None else self.toolbox.schemas

    def with_rewards(self, reward_funcs: Any, reward_weights: Sequence[float] | None) -> tuple[Any, Any]:
        """The reward functions and weights, with each environment class's own ``get_reward()`` joined."""
        if self.environments is not None and self.environments.rewards:
            return with_environment_rewards(reward_funcs, reward_weights, self.environments.rewards)
        return reward_funcs, reward_weights
