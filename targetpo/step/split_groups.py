"""Prompt groups spread over the micro-steps of an optimiser step, trained exactly by TPO.

Within an optimiser step the weights are fixed, so the gradient of the step's loss with respect to member ``i``'s
sequence log-prob is ``(p_i - q_i) / G``, with ``p`` the group's softmax at those weights. ``p`` is known before the
step's first micro-step: while the weights are still the rollout's it is ``p_old``, from the rollout's old log-probs;
after they have moved, one pass without gradient over the step batches the optimiser step trains gives it (over the
trained step batch alone where each holds whole groups, as when only token-budget passes cut them). Each
micro-step then back-propagates its own rows' part (``F.tpo_loss_of_members``), so a micro-batch never needs a whole
group, and the parts add up to the whole groups' gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from accelerate import Accelerator
from torch import nn

from .. import functional as F
from ..batch import StepBatch
from .forward import PolicyLogps
from .layout import BatchLayout


class SplitGroups:
    """The policy's group softmax ``p`` for step batches that hold parts of groups, refreshed each optimiser step."""

    def __init__(
        self,
        layout: BatchLayout,
        accelerator: Accelerator,
        logps: PolicyLogps,
        length_normalize: bool,
        failures_reach_every_process: Callable[[str], contextlib.AbstractContextManager],
    ):
        self.layout = layout
        self.accelerator = accelerator
        self.logps = logps
        self.length_normalize = length_normalize
        self.failures_reach_every_process = failures_reach_every_process  # around local work before a collective

    def at_rollout(self, batch: StepBatch, valid_all: torch.Tensor, step: int) -> None:
        """``p_old`` from the rollout's old log-probs: ``p`` for every optimiser step that trains at these weights."""
        old = F.sequence_logps(batch.old_per_token_logps, batch.completion_mask, self.length_normalize)
        log_probs_all = F.group_log_softmax(self.accelerator.gather(old), self.layout.num_generations, valid_all)
        batch.group_log_probs = log_probs_all[batch.sample_index]
        batch.group_log_probs_step = step

    def refresh(self, model: nn.Module, step_batches: list[StepBatch], use: int, step: int) -> None:
        """Before use ``use`` of the rollout: ``p`` at the current weights for the step batches whose rows make up the
        groups it trains (every one this optimiser step trains, or its own where each holds whole groups), from one
        pass without gradient over them (collective: every process computes its rows')."""
        layout = self.layout
        if step_batches[use % layout.steps_per_generation].group_log_probs_step == step:
            return
        if layout.rollout_within_one_optimiser_step:  # p_old serves every use: reaching here is a bug
            raise RuntimeError("A rollout trained within one optimiser step has no group softmax from its rollout.")
        if layout.splits_groups:  # a group's rows lie in several step batches of this optimiser step
            indices = dict.fromkeys(use % layout.steps_per_generation for use in layout.uses_in_optimiser_step(use))
        else:  # whole groups per step batch over the processes (only passes cut them): its rows give their softmax
            indices = [use % layout.steps_per_generation]
        batches = [step_batches[index] for index in indices]
        with self.failures_reach_every_process("computing the group softmax at the current weights"):
            sequence_logps, valid = zip(*(self._sequence_logps(model, batch) for batch in batches))
        # Every process holds the same step batches' worth of rows: gathered, they are whole groups.
        sequence_logps, valid, place = (
            self.accelerator.gather(torch.cat(values))
            for values in (sequence_logps, valid, [batch.sample_index for batch in batches])
        )
        rows = layout.rollout_rows
        present = torch.zeros(rows, dtype=torch.bool, device=place.device).index_fill_(0, place, True)
        counts = present.view(-1, layout.num_generations).sum(dim=-1)
        if not ((counts == 0) | (counts == layout.num_generations)).all():
            raise RuntimeError("An optimiser step holds part of a prompt group: its softmax cannot be computed.")
        sequence_all = torch.zeros(rows, dtype=sequence_logps.dtype, device=place.device).index_copy_(
            0, place, sequence_logps
        )
        valid_all = torch.zeros(rows, dtype=torch.bool, device=place.device).index_copy_(0, place, valid)
        log_probs_all = F.group_log_softmax(sequence_all, layout.num_generations, valid_all)
        for batch in batches:
            batch.group_log_probs = log_probs_all[batch.sample_index]
            batch.group_log_probs_step = step

    @torch.no_grad()
    def _sequence_logps(self, model: nn.Module, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The step batch's sequence log-probs, and which rows count in their group's softmax: the valid rows whose
        gradient can be non-zero at moved weights (the rest, whole groups or invalid rows, are skipped)."""
        rows = batch.rows_with_gradient
        mask, valid = batch.masks_without(rows)
        per_token = self.logps.batched(model, batch, rows)  # in passes of max_tokens_per_micro_batch, if set
        return F.sequence_logps(per_token, mask, self.length_normalize), valid
