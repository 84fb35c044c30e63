"""The plan of a run's training steps, fixed when the trainer is built: how many micro-steps a rollout serves, whether
its prompt groups are split over micro-steps or passes (and so train from a softmax known ahead), whether the weights
move before a rollout is trained on (so that its old log-probs must be recorded, at rollout or at first use), and
when the next rollout starts ahead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accelerate import Accelerator

from ..data import lookahead_use
from .layout import BatchLayout
from .token_budget import check_budget_fits


@dataclass(frozen=True)
class StepPlan:
    """Which rows go to which micro-step, optimiser step and pass, and what the step needs of a rollout for that."""

    layout: BatchLayout
    #: micro-steps one rollout serves (steps_per_generation x num_iterations)
    generate_every: int
    #: max_tokens_per_micro_batch, and the most tokens of one sequence (None: prompts are not limited)
    token_budget: int | None
    longest_sequence: int | None
    #: TPO's groups spread over micro-steps, or a micro-step's passes: trained from their softmax known ahead
    groups_split: bool
    #: whether the weights may move before a rollout is trained on: its old log-probs are then recorded
    needs_old_logps: bool
    #: whether each step batch is first used at the rollout's weights: that use records its rows' old log-probs
    old_logps_at_first_use: bool
    #: with max_tokens_per_micro_batch, the rows of a group one pass must hold (None: any rows may share a pass)
    group_kept_whole_in_a_pass: int | None
    #: async_rollouts: the use of a rollout at which the next one starts (None: rollouts are made when used)
    lookahead_use: int | None

    @classmethod
    def of(cls, args: Any, num_processes: int, max_prompt_tokens: int | None, whole_groups: bool) -> StepPlan:
        """The plan of ``args``; ``whole_groups``: the objective's loss is a softmax over each prompt group (TPO)."""
        layout = BatchLayout.from_config(args, num_processes)
        generate_every = args.steps_per_generation * args.num_iterations
        budget = args.max_tokens_per_micro_batch
        longest = None if max_prompt_tokens is None else max_prompt_tokens + args.max_completion_length
        if budget is not None:
            check_budget_fits(budget, longest)
        passes_split = budget is not None and (
            args.num_generations * longest > budget or args.per_device_train_batch_size % args.num_generations != 0
        )
        groups_split = whole_groups and (layout.splits_groups or passes_split)
        accumulation = args.gradient_accumulation_steps
        needs_old_logps = accumulation % generate_every != 0 or groups_split
        # Where every step batch is first used at the rollout's weights, that use computes the old log-probs of the
        # rows it trains anyway (pass by pass under a token budget): the rollout records only the others.
        at_first_use = (
            needs_old_logps
            and not groups_split
            and generate_every % accumulation == 0
            and args.steps_per_generation <= accumulation
        )
        ahead = lookahead_use(generate_every, accumulation, args.max_staleness) if args.async_rollouts else None
        whole_in_a_pass = args.num_generations if whole_groups and not groups_split else None
        return cls(
            layout=layout,
            generate_every=generate_every,
            token_budget=budget,
            longest_sequence=longest,
            groups_split=groups_split,
            needs_old_logps=needs_old_logps,
            old_logps_at_first_use=at_first_use,
            group_kept_whole_in_a_pass=whole_in_a_pass,
            lookahead_use=ahead,
        )


def check_passes_supported(trainer_name: str, overrides_compute_loss: bool, accelerator: Accelerator) -> None:
    """max_tokens_per_micro_batch: its passes replace the Trainer's own training step, so an overridden compute_loss
    would never run, and context parallelism (which that step sets up) is not set up."""
    if overrides_compute_loss:
        raise ValueError(
            f"{trainer_name} overrides compute_loss, which max_tokens_per_micro_batch does not call: its "
            "passes compute each part of the micro-step's loss themselves. Unset max_tokens_per_micro_batch, or "
            "keep the loss in compute_loss without it."
        )
    parallelism = getattr(accelerator, "parallelism_config", None)
    if parallelism is not None and parallelism.cp_enabled:
        raise ValueError(
            "max_tokens_per_micro_batch is not supported with context parallelism: its passes replace the "
            "Trainer's training step, which sets context parallelism up. Unset one of them."
        )
