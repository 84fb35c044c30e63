"""The warning for a run that learns nothing from its rewards: when ``warn_after_uninformative_rollouts`` training
rollouts in a row hold no informative group (one whose valid completions' rewards are not all equal), every group's
advantages are 0 and the rewards move nothing. Said once, naming the reward functions and what to check.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any


class NoSignalWatch:
    """Counts the training rollouts in a row without an informative group and warns once, when they reach ``limit``
    (0: never). Every process counts the same (the counts come from every process's groups); ``speaks`` says on which
    the warning is shown."""

    def __init__(
        self,
        limit: int,
        reward_names: Sequence[str],
        num_generations: int,
        max_completion_length: int,
        speaks: bool = True,
    ):
        self.limit, self.reward_names, self.speaks = limit, list(reward_names), speaks
        self.num_generations, self.max_completion_length = num_generations, max_completion_length
        self.in_a_row = 0
        self.warned = False

    @classmethod
    def from_config(cls, args: Any, reward_names: Sequence[str], speaks: bool = True) -> NoSignalWatch:
        return cls(
            args.warn_after_uninformative_rollouts,
            reward_names,
            args.num_generations,
            args.max_completion_length,
            speaks,
        )

    def see(self, informative_fraction: float, mean_reward: float, clipped_ratio: float) -> None:
        """One training rollout: the fraction of its groups that are informative (over every process's groups), its
        mean reward and the fraction of its completions cut at max_completion_length (these two for the message)."""
        if self.limit == 0 or self.warned:
            return
        self.in_a_row = 0 if informative_fraction > 0 else self.in_a_row + 1
        if self.in_a_row < self.limit:
            return
        self.warned = True
        if self.speaks:
            warnings.warn(self.message(mean_reward, clipped_ratio), stacklevel=2)

    def message(self, mean_reward: float, clipped_ratio: float) -> str:
        names = ", ".join(self.reward_names)
        rollouts = "training rollout" if self.in_a_row == 1 else f"{self.in_a_row} training rollouts"
        return (
            f"No informative group in the last {rollouts}: in every group all {self.num_generations} completions got "
            f"the same reward (the last rollout's mean reward: {mean_reward:g}), so every advantage is 0 and the "
            "rewards teach the policy nothing (grad_norm stays at 0 unless beta or an entropy bonus is on). Check the "
            f"reward functions ({names}): do they give every completion the same value (a parsing bug, a column read "
            "wrongly, a bar no completion reaches)? Are completions cut at "
            f"max_completion_length={self.max_completion_length} before the answer ({clipped_ratio:.0%} of the last "
            f"rollout's were)? Is the task too hard for num_generations={self.num_generations} (more completions per "
            "prompt, partial credit or easier prompts)? tpo/informative_group_fraction logs the fraction; "
            "warn_after_uninformative_rollouts=0 turns this warning off."
        )
