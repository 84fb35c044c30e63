"""Running the training step: what a rollout needs before its first micro-step (the rows that carry gradient, old and
reference log-probs, the objective's target), and each micro-step's loss, in one pass or in passes of bounded tokens
each back-propagated on its own, with the old log-probs a step batch's first use records."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from ..batch import RolloutBatch, StepBatch
from ..objectives.registry import LossTerms, Objective, TrainingLoss, build_objective
from ..objectives.regularisers import importance_sampling_applies
from ..reporting.metrics import MetricsRecorder, record_loss_metrics
from ..rollout.context import RolloutContext
from .forward import PolicyLogps, TokenLogps
from .plan import StepPlan
from .split_groups import SplitGroups
from .token_budget import joined_by_rows, pass_token_shares

#: ``guard(what, local=True)``: stop every process when the block fails on one (see ``distributed.py``).
Guard = Callable[..., contextlib.AbstractContextManager]
#: ``record_targets(batch, mode, valid)``: the diagnostics of a freshly built q (the trainer adds it to its table).
RecordTargets = Callable[[StepBatch, str, "torch.Tensor | None"], None]


class StepRunner:
    """Runs the loss of the run's objective over a rollout's step batches, as the step plan lays them out."""

    def __init__(
        self,
        plan: StepPlan,
        objective: Objective,
        loss: TrainingLoss,
        logps: PolicyLogps,
        accelerator: Accelerator,
        metrics: MetricsRecorder,
        guard: Guard,
        global_step: Callable[[], int],
        record_targets: RecordTargets,
        *,
        sharded: bool,
        importance_sampling: bool,
        split_groups: SplitGroups | None = None,
    ):
        self.plan, self.objective, self.loss, self.logps = plan, objective, loss, logps
        self.accelerator, self.metrics, self.guard = accelerator, metrics, guard
        self.global_step, self.record_targets = global_step, record_targets
        self.sharded, self.importance_sampling, self.split_groups = sharded, importance_sampling, split_groups

    @classmethod
    def build(
        cls,
        plan: StepPlan,
        context: RolloutContext,
        record_targets: RecordTargets,
        group_size: Callable[[str], int],
        local_rows: Callable[[int], slice],
    ) -> StepRunner:
        """The step of a run, given the parts its rollouts are given: the objective ``loss_type`` names, the
        regularisers the run switches on, the policy's token log-probs as sampling saw them, and the softmax of split
        groups. Called from the trainer's ``__init__``: the warnings of these parts point at the line that builds the
        trainer."""
        args, accelerator, sampling, sharded = context.args, context.accelerator, context.sampling, context.sharded
        model = context.model()
        unwrapped = accelerator.unwrap_model(model)
        objective = build_objective(args, accelerator, group_size, local_rows)
        loss = _training_loss(objective, args, accelerator, sampling, unwrapped)
        logps = PolicyLogps.for_model(
            model,
            unwrapped,
            sampling.temperature,
            sampling.suppressed_token_ids,
            accelerator.device,
            sharded,
            args.use_liger_kernel,
            args.logps_chunk_size,
            rows_per_pass=args.per_device_train_batch_size,
            padding_free=args.padding_free,
            head_kernel=args.logps_head_kernel,
            token_budget=args.max_tokens_per_micro_batch,
            autocast=accelerator.autocast,
            share_prompts=args.share_prompt_forward,
        )
        split_groups = None
        if plan.groups_split:
            split_groups = SplitGroups(
                plan.layout,
                accelerator,
                logps,
                args.tpo_length_normalize_logps,
                lambda what: context.guard(what, local=not sharded),
            )
        importance_sampling = importance_sampling_applies(args, sampling)
        return cls(
            plan,
            objective,
            loss,
            logps,
            accelerator,
            context.metrics,
            context.guard,
            context.global_step,
            record_targets,
            sharded=sharded,
            importance_sampling=importance_sampling,
            split_groups=split_groups,
        )

    # ------------------------------------------------------------------------------------------------ at rollout
    def prepare_rollout(
        self,
        record: RolloutBatch,
        advantages_all: torch.Tensor,
        valid_all: torch.Tensor,
        mode: str,
        model: nn.Module,
        reference: Callable[[StepBatch], torch.Tensor] | None,
    ) -> StepBatch:
        """The rollout with what the loss needs of it beyond its rows: its token count, the rows it may leave out, and
        the old and reference log-probs (``reference(batch)``: the reference model's, where beta > 0)."""
        args = self.objective.args
        batch = StepBatch(record)
        batch.loss_token_count = self.objective.rollout_token_count(batch.completion_mask, mode)
        if mode == "train":
            batch.rollout_step = self.global_step()
        if mode == "train" and self.plan.token_budget is not None:
            # Now, not at the micro-step: a rollout_func's sequences are bounded by the model's positions only.
            with self.guard("checking the rollout's sequences against the token budget"):
                self.logps.token_passes(model, batch, None, self.plan.group_kept_whole_in_a_pass)
        if mode == "train" and args.skip_zero_gradient_completions and self.loss.reaches_only_rows_with_gradient:
            # Which rows a step may leave out depends on whether the weights have moved since this rollout. With
            # dropout on, two forward passes of the same weights differ, so p = p_old never holds exactly.
            local = self.objective.local_rows(len(batch))
            with_gradient = self.objective.rows_with_gradient
            batch.rows_with_gradient = with_gradient(advantages_all, valid_all, policy_is_old=False)[local]
            batch.rows_with_gradient_at_rollout = with_gradient(advantages_all, valid_all, args.disable_dropout)[local]
        needs_old_logps = mode == "train" and self.plan.needs_old_logps
        if needs_old_logps or reference is not None:
            with self.guard("computing the old and reference log-probs", local=not self.sharded):
                if needs_old_logps:
                    self._record_old_logps(batch, model)
                if reference is not None:
                    batch = batch.replaced(ref_per_token_logps=reference(batch))
        return batch

    def build_targets(self, batch: StepBatch, advantages_all: torch.Tensor, valid_all: torch.Tensor, mode: str):
        """The objective's target where it is built at rollout, and the softmax of groups split over micro-steps."""
        targets = self.objective.targets_at_rollout(batch, advantages_all, valid_all)
        if targets is not None:  # built once at rollout (TPO's q): kept for every use of the rollout
            batch.cache.targets = targets
            self.record_targets(batch, mode, None)
        if mode == "train" and self.split_groups is not None:
            self.split_groups.at_rollout(batch, valid_all, self.global_step())

    def _record_old_logps(self, batch: StepBatch, model: nn.Module) -> None:
        """The policy's log-probs at rollout time, of the rows no step batch's first use computes (all of them, unless
        each step batch is first used at the rollout's weights)."""
        if not self.plan.old_logps_at_first_use:
            batch.old_per_token_logps = self.logps.batched(model, batch)
            return
        first_use = batch.rows_with_gradient_at_rollout
        first_use = torch.ones_like(batch.valid) if first_use is None else first_use
        batch.old_logps_from_first_use = first_use
        rest = batch.valid & ~first_use
        # A sharded model's forward is a collective: every process passes through it, with rows or not.
        if bool(rest.any()) or self.sharded:
            batch.old_per_token_logps = self.logps.batched(model, batch, rows=rest)

    # ------------------------------------------------------------------------------------------------ micro-steps
    def loss_of(self, model: nn.Module, batch: StepBatch, mode: str) -> torch.Tensor:
        """One micro-step's loss of a step batch: rows -> masks -> log-probs -> loss terms -> record."""
        rows = self.rows_to_train(batch, mode)
        mask, valid = batch.masks_without(rows)
        logps = self.policy_logps(model, batch, rows, mask)
        terms = self._loss_of_rows(batch, logps, mask, valid, mode)
        self._keep_and_record(batch, terms, logps.entropies, rows, mode)
        self._require_finite_loss(terms.loss)
        return terms.loss

    def train_in_passes(
        self, model: nn.Module, batch: StepBatch, backward: Callable[[torch.Tensor], None], accumulation: int
    ) -> torch.Tensor:
        """One micro-step in passes of at most max_tokens_per_micro_batch tokens, each back-propagated
        (``backward(loss / accumulation)``) as soon as its loss is known: every pass's loss is its rows' part of the
        micro-step's (rows left out of a pass count as in ``masks_without``), so their gradients add up to the
        micro-step's. Returns the micro-step's loss, as the Trainer's step returns it (detached, divided by the
        accumulation steps)."""
        rows = self.rows_to_train(batch, "train")
        mask, _ = batch.masks_without(rows)
        passes = self._training_passes(model, batch, rows)
        shares = pass_token_shares(batch.prompt_mask, batch.completion_attention_mask, passes)
        # Each pass builds what the first use builds (q, importance weights): from the rollout's old log-probs for
        # every row, from a pass's own log-probs for its rows only. Where the first use completes the old log-probs
        # pass by pass, the pass that completes them builds for every row.
        built_for_every_row = batch.old_per_token_logps is not None or batch.old_logps_from_first_use is not None
        cache = batch.cache
        parts = []
        for index, (pass_rows, share) in enumerate(zip(passes, shares)):
            batch.cache = cache
            pass_mask, pass_valid = batch.masks_without(pass_rows)
            # Only the last pass's backward reduces gradients over processes (DDP), once for all of them.
            last = index == len(passes) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                logps = self.policy_logps(model, batch, pass_rows, pass_mask)
                if logps.aux_loss is not None:  # the router's loss, a mean over the pass's tokens: by their share
                    logps = logps._replace(aux_loss=share * logps.aux_loss)
                terms = self._loss_of_rows(batch, logps, pass_mask, pass_valid, "train", mask, pass_rows)
                self._require_finite_loss(terms.loss)
                backward(terms.loss / accumulation)
            parts.append((terms, logps.entropies))
        batch.cache = cache
        terms = LossTerms.joined([terms for terms, _ in parts], passes, built_for_every_row)
        entropies = joined_by_rows([entropies for _, entropies in parts], passes)
        self._keep_and_record(batch, terms, entropies, rows, "train")
        return terms.loss / accumulation

    def _training_passes(self, model: nn.Module, batch: StepBatch, rows: torch.Tensor | None) -> list[torch.Tensor]:
        """The rows to train (bool; None: all) in passes of at most max_tokens_per_micro_batch tokens (row masks), a
        group's rows in one pass where the plan keeps groups whole; as many passes on every process, since the
        training model's forward pass is a collective under DDP (it shares the model's buffers)."""
        with self.guard("cutting the micro-step into passes"):
            passes = self.logps.token_passes(model, batch, rows, self.plan.group_kept_whole_in_a_pass)
        if self.accelerator.num_processes > 1:  # passes without rows make up the count (one short row, zero loss)
            count = torch.tensor([len(passes)], device=self.accelerator.device)
            most = int(self.accelerator.gather(count).max())
            passes += [torch.zeros_like(passes[0]) for _ in range(most - len(passes))]
        return passes

    def rows_to_train(self, batch: StepBatch, mode: str) -> torch.Tensor | None:
        """The step batch's rows whose gradient can be non-zero (``F.rows_with_gradient``); None: every row."""
        if mode != "train" or batch.rows_with_gradient is None:
            return None
        if self.global_step() == batch.rollout_step:
            return batch.rows_with_gradient_at_rollout
        return batch.rows_with_gradient

    def _loss_of_rows(
        self,
        batch: StepBatch,
        logps: TokenLogps,
        mask: torch.Tensor,
        valid: torch.Tensor,
        mode: str,
        micro_step_mask: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> LossTerms:
        """The loss terms of the rows in ``mask`` from their log-probs (of ``rows``, bool; None: every row the step
        trains); at a step batch's first use, its old log-probs are completed from them first."""
        if mode == "train" and batch.old_logps_from_first_use is not None:
            self._fill_old_logps(batch, logps.per_token, rows)
        importance_sampling = mode == "train" and self.importance_sampling
        return self.loss(logps, batch, mask, valid, mode, importance_sampling, micro_step_mask)

    def _keep_and_record(
        self,
        batch: StepBatch,
        terms: LossTerms,
        entropies: torch.Tensor | None,
        rows: torch.Tensor | None,
        mode: str,
    ) -> None:
        """Keep what the step batch's use built, and record its metrics and any freshly built q."""
        mask, valid = batch.masks_without(rows)
        # `batch` is the rollout buffer's own step batch: what this use built serves its later uses (num_iterations).
        batch.cache = batch.cache.updated(terms.built())
        record_loss_metrics(self.metrics, mode, terms, entropies, mask, rows)
        if terms.objective.targets is not None:  # built over the rows trained, or all of them from old log-probs
            self.record_targets(batch, mode, None if batch.old_per_token_logps is not None else valid)

    def policy_logps(
        self, model: nn.Module, batch: StepBatch, rows: torch.Tensor | None, mask: torch.Tensor
    ) -> TokenLogps:
        """The policy's token log-probs and entropies of the rows to train (and a router's loss), checked finite."""

        def forward() -> TokenLogps:
            entropy_grad = self.loss.entropy_bonus is not None
            router_aux_loss = self.loss.router_aux_loss_coef is not None
            if self.plan.token_budget is not None and not torch.is_grad_enabled():  # evaluation: passes, one loss
                # (with the model unwrapped, as the Trainer evaluates: its forward is no collective)
                passes = self.logps.token_passes(model, batch, rows)
                return self.logps.by_passes(model, batch, passes, with_entropy=True, router_aux_loss=router_aux_loss)
            return self.logps(model, batch, True, rows, entropy_grad, router_aux_loss)

        # A forward pass that fails, or gives non-finite log-probs, on one process stops every process before the
        # collectives of the loss. A sharded model's forward is itself collectives: it runs before the guarded block.
        # (DDP's forward opens with a buffer broadcast, which every process reaches: nothing that can fail precedes it.)
        if self.sharded:
            logps = forward()
        with self.guard("computing the policy's token log-probs"):
            if not self.sharded:
                logps = forward()
            self._require_finite_logps(logps.per_token, mask)
        return logps

    def _fill_old_logps(self, batch: StepBatch, per_token_logps: torch.Tensor, rows: torch.Tensor | None) -> None:
        """At a step batch's first use, at the rollout's weights: the old log-probs of the rows it trains are its own
        (of ``rows``, a pass's under a token budget; None: all it trains). The rows still to come stay marked."""
        if self.global_step() != batch.rollout_step:
            raise RuntimeError("A step batch first used after the weights moved has no old log-probs for its rows.")
        current = per_token_logps.detach()
        pending = batch.old_logps_from_first_use
        filled = pending if rows is None else pending & rows
        old = torch.zeros_like(current) if batch.old_per_token_logps is None else batch.old_per_token_logps
        batch.old_per_token_logps = torch.where(filled.unsqueeze(-1), current, old)
        remaining = pending & ~filled
        batch.old_logps_from_first_use = remaining if bool(remaining.any()) else None

    def _require_finite_logps(self, per_token_logps: torch.Tensor, mask: torch.Tensor) -> None:
        """A FloatingPointError when a token log-prob the loss uses is NaN or infinite (the model overflowed)."""
        used = per_token_logps.detach()[mask.bool()]
        if not torch.isfinite(used).all():
            bad = used[~torch.isfinite(used)][0].item()
            raise FloatingPointError(
                f"The policy's token log-probs are no longer finite ({bad}) at step {self.global_step()}: its "
                "weights or activations overflowed. Lower the learning rate, enable gradient clipping (max_grad_norm) "
                "or use bf16/fp32 instead of fp16."
            )

    def _require_finite_loss(self, loss: torch.Tensor) -> None:
        """Stop before backward, on every process together: a non-finite loss would put NaN into every weight."""
        with self.guard("checking the loss"):
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"The loss is {loss.item()} at step {self.global_step()} although the policy's log-probs are "
                    "finite: a term overflowed (the KL to the reference, once the policy is far from it) or the "
                    "rollout's old, reference or vLLM log-probs are not finite. Lower the learning rate, enable "
                    "gradient clipping (max_grad_norm) or use bf16/fp32 instead of fp16."
                )


def _training_loss(
    objective: Objective, args: Any, accelerator: Accelerator, sampling: Any, model: nn.Module
) -> TrainingLoss:
    """The objective plus the regularisers the run switches on; a mixture-of-experts model's router loss joins it
    (TRL's router_aux_loss_coef)."""
    is_moe = getattr(model.config.get_text_config(decoder=True), "output_router_logits", None) is not None
    return TrainingLoss(
        objective,
        args,
        accelerator,
        sampling.reshapes_distribution,
        router_aux_loss=is_moe and args.router_aux_loss_coef != 0,
    )
