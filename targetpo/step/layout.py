"""How a rollout's rows fall into micro-steps and optimiser steps, and whether TPO can train groups split over them.

A rollout's rows come group after group (``num_generations`` contiguous rows per prompt). They are shared out to the
processes in order, ``per_device_train_batch_size * steps_per_generation`` rows each, and every process cuts its share
into ``steps_per_generation`` step batches. Use ``u`` of the rollout (``0 <= u < steps_per_generation *
num_iterations``) trains step batch ``u % steps_per_generation`` on every process, and each
``gradient_accumulation_steps`` consecutive uses make one optimiser step.

TPO's loss needs a group's softmax over all its members, at one set of weights. A group whose rows fall in several
step batches is still trained exactly when all of them are trained within one optimiser step, where the weights are
fixed: its softmax is then known before any of its micro-steps (``split_groups.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..objectives.settings import trains_whole_groups


@dataclass(frozen=True)
class BatchLayout:
    """The batch settings that decide which rows each micro-step and optimiser step trains."""

    num_generations: int
    rows_per_step: int  # per_device_train_batch_size
    steps_per_generation: int
    num_iterations: int
    accumulation_steps: int  # gradient_accumulation_steps
    world_size: int

    @classmethod
    def from_config(cls, args, world_size: int | None = None) -> BatchLayout:
        return cls(
            args.num_generations,
            args.per_device_train_batch_size,
            args.steps_per_generation,
            args.num_iterations,
            args.gradient_accumulation_steps,
            args.world_size if world_size is None else world_size,
        )

    @property
    def uses(self) -> int:
        """Micro-steps one rollout serves."""
        return self.steps_per_generation * self.num_iterations

    @property
    def rollout_rows(self) -> int:
        """Rows of one rollout, over every process."""
        return self.rows_per_step * self.steps_per_generation * self.world_size

    @property
    def splits_groups(self) -> bool:
        """Whether some group has rows in more than one step batch (with one step batch per rollout a group can only
        span processes, which one micro-step gathers)."""
        return self.steps_per_generation > 1 and self.rows_per_step % self.num_generations != 0

    @property
    def rollout_within_one_optimiser_step(self) -> bool:
        """Whether every use of a rollout falls in one optimiser step (its weights never move while it trains)."""
        return self.accumulation_steps % self.uses == 0

    def step_batches_of_group(self, group: int) -> list[int]:
        """The step batches (on whichever processes) that hold the rows of rollout group ``group``."""
        share = self.rows_per_step * self.steps_per_generation
        rows = range(group * self.num_generations, (group + 1) * self.num_generations)
        return sorted({(row % share) // self.rows_per_step for row in rows})

    def uses_in_optimiser_step(self, use: int) -> range:
        """The uses of the rollout that share an optimiser step with ``use``, where optimiser steps start with the
        rollout (as :meth:`split_group_problem` makes them wherever groups span step batches)."""
        if self.rollout_within_one_optimiser_step:
            return range(self.uses)
        first = use - use % self.accumulation_steps
        return range(first, first + self.accumulation_steps)

    def split_group_problem(self) -> str | None:
        """Why groups split over step batches cannot all be trained within one optimiser step each; None if they can
        (or no group is split)."""
        if not self.splits_groups or self.rollout_within_one_optimiser_step:
            return None
        if self.uses % self.accumulation_steps:
            return (
                f"gradient_accumulation_steps ({self.accumulation_steps}) neither divides nor is a multiple of "
                f"steps_per_generation x num_iterations ({self.uses}), so optimiser steps cut rollouts at different "
                "places"
            )
        spg, steps = self.steps_per_generation, self.accumulation_steps
        for group in range(self.rollout_rows // self.num_generations):
            batches = self.step_batches_of_group(group)
            for iteration in range(self.num_iterations):
                optimiser_steps = sorted({(iteration * spg + batch) // steps for batch in batches})
                if len(optimiser_steps) > 1:
                    return (
                        f"prompt group {group}'s completions fall in step batches {batches}, which different "
                        f"optimiser steps train (gradient_accumulation_steps={steps} micro-steps each)"
                    )
        return None


def resolve_batch_layout(config: Any) -> None:
    """Derive generation_batch_size and steps_per_generation, and check that steps hold whole prompt groups."""
    world_size = config.world_size
    step_batch = config.per_device_train_batch_size * world_size
    if config.generation_batch_size is not None and (
        config.generation_batch_size < 1 or config.generation_batch_size % step_batch != 0
    ):
        raise ValueError(
            f"generation_batch_size ({config.generation_batch_size}) must be a positive multiple of "
            f"per_device_train_batch_size * world_size ({config.per_device_train_batch_size} * {world_size} = "
            f"{step_batch})."
        )
    if config.generation_batch_size is None:
        if config.steps_per_generation is None:  # one rollout per optimiser step, as TRL lays batches out
            config.steps_per_generation = config.gradient_accumulation_steps
        config.generation_batch_size = step_batch * config.steps_per_generation
    elif config.steps_per_generation is None:
        config.steps_per_generation = config.generation_batch_size // step_batch
    elif config.generation_batch_size != step_batch * config.steps_per_generation:
        # Both set: fine when they agree (as in a copy of an already-resolved config), an error otherwise.
        raise ValueError(
            f"Set either generation_batch_size or steps_per_generation, not both: generation_batch_size="
            f"{config.generation_batch_size} disagrees with steps_per_generation={config.steps_per_generation} x "
            f"{step_batch} completions per step."
        )
    _check_whole_groups(config, world_size)
    if config.do_eval or config.eval_strategy != "no":
        check_eval_batch_size(config)


def _check_whole_groups(config: Any, world_size: int) -> None:
    """Rollouts hold whole prompt groups; TPO's groups each fall within one optimiser step; an asynchronous rollout
    spans whole optimiser steps or fits inside one."""
    if config.generation_batch_size % config.num_generations:
        raise ValueError(
            f"Each rollout must hold whole prompt groups: generation_batch_size = {config.generation_batch_size} "
            f"completions (per_device_train_batch_size {config.per_device_train_batch_size} x {world_size} "
            f"processes x steps_per_generation {config.steps_per_generation}) is not a multiple of "
            f"num_generations={config.num_generations}. Change per_device_train_batch_size, steps_per_generation or "
            "num_generations so that the first divides by the second."
        )
    if trains_whole_groups(config.loss_type):
        problem = BatchLayout.from_config(config, world_size).split_group_problem()
        if problem is not None:
            raise ValueError(
                f"TPO fits each prompt group's softmax at one set of weights, so the micro-steps that train a "
                f"group must fall within one optimiser step (whole prompt groups per optimiser step), but "
                f"{problem}. Set gradient_accumulation_steps to steps_per_generation x num_iterations "
                f"({config.steps_per_generation * config.num_iterations}) or steps_per_generation "
                f"({config.steps_per_generation}), or make per_device_train_batch_size a multiple of "
                f"num_generations ({config.num_generations})."
            )
    uses = config.steps_per_generation * config.num_iterations
    accumulation = config.gradient_accumulation_steps
    if config.async_rollouts and uses % accumulation and accumulation % uses:
        raise ValueError(
            f"async_rollouts=True needs each rollout to span whole optimiser steps or to fit inside one: its "
            f"steps_per_generation x num_iterations = {uses} micro-steps and gradient_accumulation_steps = "
            f"{accumulation} must divide one another."
        )


def check_eval_batch_size(config: Any) -> None:
    """Evaluation batches, like training steps, must hold whole prompt groups."""
    eval_batch = config.per_device_eval_batch_size * config.world_size
    group = config.num_generations if config.num_generations_eval is None else config.num_generations_eval
    name = "num_generations" if config.num_generations_eval is None else "num_generations_eval"
    if eval_batch % group != 0:
        raise ValueError(
            f"Evaluation batches must hold whole prompt groups: per_device_eval_batch_size "
            f"({config.per_device_eval_batch_size}) x {config.world_size} processes = {eval_batch} is not a multiple "
            f"of {name} ({group})."
        )
