"""The losses a run can train, one registry keyed by ``loss_type``, and the loss ``compute_loss`` returns: the chosen
objective plus the regularisers the run switches on (``regularisers.py``).

An objective says what it needs of a rollout (a token count, the rows that may be left out, q at rollout) and gives
its loss with diagnostics; it writes nothing into the batch: what it built for later iterations (q) comes back in its
result, and the caller keeps it in the step batch's ``StepCache``. A new loss is one entry in ``OBJECTIVES``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from accelerate import Accelerator

from .. import functional as F
from ..batch import StepBatch, StepCache
from ..distributed import all_gather_with_grad, groups_span_processes
from ..step.forward import TokenLogps
from ..step.token_budget import joined_by_rows
from .regularisers import BuiltImportanceWeights, EntropyBonus, ImportanceWeights, KLPenalty, TokenFilter


class ObjectiveResult(NamedTuple):
    """An objective's loss on a step batch, what it built for the batch's later uses, and its diagnostics."""

    loss: torch.Tensor
    targets: torch.Tensor | None  # q, when this call built it (the step batch's first use)
    token_means: dict[str, torch.Tensor]  # metric name -> per-token values, logged as their token mean
    sequence_extremes: dict[str, tuple[torch.Tensor, str]]  # metric name -> (per-token values, "min" | "max")


class Objective:
    """One ``loss_type``: its loss, and what it needs of a rollout."""

    ratio_level = "token"  # the importance ratio (token or sequence) the KL's bias correction uses
    token_count: str | None = None  # "rollout": divided by the rollout's token share; "batch": by the batch's

    def __init__(
        self,
        name: str,
        args: Any,
        accelerator: Accelerator,
        group_size: Callable[[str], int],
        local_rows: Callable[[int], slice],
    ):
        self.name = name
        self.args = args
        self.accelerator = accelerator
        self.group_size = group_size  # completions per prompt, by mode
        self.local_rows = local_rows  # this process's rows of a rollout gathered from every process

    def rollout_token_count(self, completion_mask: torch.Tensor, mode: str) -> float | None:
        """The token-normalised losses' divisor, per micro-step; None for the others.

        Each token is weighted by 1 / (the tokens of one optimiser step's accumulated batch, over every process), taken
        as the rollout's mean: exact when one optimiser step spans the rollout. The Trainer divides by the accumulation
        steps and DDP averages over processes, so one micro-step divides by its share.
        """
        if self.token_count is None:
            return None
        tokens = self.accelerator.gather(completion_mask.sum()).sum().item()
        steps = self.args.steps_per_generation if mode == "train" else 1
        return tokens / (steps * self.accelerator.num_processes)

    def rows_with_gradient(
        self, advantages_all: torch.Tensor, valid_all: torch.Tensor, policy_is_old: bool
    ) -> torch.Tensor:
        """The rollout's rows (every process's) whose gradient can be non-zero; ``policy_is_old``: the policy is
        still the one that sampled them (the same weights and no dropout)."""
        raise NotImplementedError

    def targets_at_rollout(
        self, batch: StepBatch, advantages_all: torch.Tensor, valid_all: torch.Tensor
    ) -> torch.Tensor | None:
        """A target built at rollout from the old log-probs, for the batch's cache; None: the objective has none."""
        return None

    def entropy_token_count(self, batch: StepBatch, tokens: torch.Tensor) -> torch.Tensor | float:
        """What the entropy bonus divides its entropy sum by: the loss's own token count, so that over an optimiser
        step it adds up to the step's mean entropy as the loss does."""
        if self.token_count == "rollout":
            return max(batch["loss_token_count"], 1)
        return tokens.sum().clamp(min=1)

    def loss(
        self,
        per_token_logps: torch.Tensor,
        batch: StepBatch,
        mask: torch.Tensor,
        valid: torch.Tensor,
        mode: str,
        token_weights: torch.Tensor | None = None,
    ) -> ObjectiveResult:
        """The loss of the step batch's rows in ``mask`` (``valid``: completions it counts); ``token_weights`` (0/1)
        leave tokens out of the training."""
        raise NotImplementedError


class TargetObjective(Objective):
    """TPO: the cross-entropy to the target q over whole groups (``F.tpo_loss``)."""

    def rows_with_gradient(
        self, advantages_all: torch.Tensor, valid_all: torch.Tensor, policy_is_old: bool
    ) -> torch.Tensor:
        return F.tpo_rows_with_gradient(advantages_all, self.args.num_generations, valid_all, policy_is_old)

    def targets_at_rollout(
        self, batch: StepBatch, advantages_all: torch.Tensor, valid_all: torch.Tensor
    ) -> torch.Tensor | None:
        """q from the old log-probs, when the rollout has them (the weights move before it is trained on)."""
        if batch.old_per_token_logps is None or batch.old_logps_from_first_use is not None:
            return None  # the first use builds q: from its own log-probs, or once it has completed the old ones
        targets_all = self._targets_from_old_logps(batch, advantages_all, valid_all, self.accelerator.gather)
        return targets_all[self.local_rows(len(batch))]

    def _targets_from_old_logps(
        self, batch: StepBatch, advantages: torch.Tensor, valid: torch.Tensor, gather: Callable
    ) -> torch.Tensor:
        """q from the rollout's old log-probs, ``gather`` putting every process's rows together (or leaving them)."""
        args = self.args
        old = F.sequence_logps(batch.old_per_token_logps, batch.completion_mask, args.tpo_length_normalize_logps)
        return F.tpo_targets(gather(old), advantages, args.num_generations, valid, args.tpo_target_temperature)

    def loss(self, per_token_logps, batch, mask, valid, mode, token_weights=None) -> ObjectiveResult:
        if token_weights is not None:  # the values, and so p and q, stay; the left-out tokens get no gradient
            per_token_logps = F.scale_token_gradients(per_token_logps, token_weights.expand_as(per_token_logps))
        if batch.group_log_probs is not None:
            return self.cross_entropy_of_members(per_token_logps, batch, mask, valid, mode)
        return self.cross_entropy_to_targets(per_token_logps, batch, mask, valid, mode)

    def cross_entropy_of_members(
        self, per_token_logps: torch.Tensor, batch: StepBatch, mask: torch.Tensor, valid: torch.Tensor, mode: str
    ) -> ObjectiveResult:
        """The step batch's part of the cross-entropy of groups split over micro-steps, from their softmax at the
        current weights (``split_groups.py``); q was built at rollout. Per micro-step it is divided by the groups the
        batch's rows make up, as a step batch of whole groups is by its groups."""
        sequence_logps = F.sequence_logps(per_token_logps, mask, self.args.tpo_length_normalize_logps)
        num_groups = len(batch) / self.group_size(mode)
        loss = F.tpo_loss_of_members(sequence_logps, batch.group_log_probs, batch.cache.targets, num_groups, valid)
        return ObjectiveResult(loss, None, {}, {})

    def cross_entropy_to_targets(
        self, per_token_logps: torch.Tensor, batch: StepBatch, mask: torch.Tensor, valid: torch.Tensor, mode: str
    ) -> ObjectiveResult:
        """Cross-entropy to q over whole groups, gathering the step batch when its groups span processes; q is built
        from the current (detached) log-probs when the batch holds none yet."""
        args = self.args
        group_size = self.group_size(mode)
        sequence_logps = F.sequence_logps(per_token_logps, mask, args.tpo_length_normalize_logps)
        span = self._groups_span_processes(mode)
        gather = self.accelerator.gather if span else (lambda tensor: tensor)
        sequence_logps_all = all_gather_with_grad(sequence_logps) if span else sequence_logps
        valid_all = gather(valid)
        built = None
        old_logps_complete = batch.old_per_token_logps is not None and batch.old_logps_from_first_use is None
        if batch.cache.targets is None and old_logps_complete:
            # The first use, with the rollout's log-probs completed: q of every row, for the later uses too.
            if span:
                gather_all = self.accelerator.gather
                built = self.targets_at_rollout(batch, gather_all(batch.advantages), gather_all(batch.valid))
            else:  # no collective: under token-budget passes each process completes its old log-probs in its own pass
                built = self._targets_from_old_logps(batch, batch.advantages, batch.valid, gather)
            targets_all = gather(built)
        elif batch.cache.targets is None:
            targets_all = F.tpo_targets(
                sequence_logps_all.detach(),
                gather(batch.advantages),
                group_size,
                valid_all,
                args.tpo_target_temperature,
            )
            built = targets_all[self.local_rows(len(sequence_logps))] if span else targets_all
        else:
            targets_all = gather(batch.cache.targets)
        return ObjectiveResult(F.tpo_loss(sequence_logps_all, targets_all, group_size, valid_all), built, {}, {})

    def _groups_span_processes(self, mode: str) -> bool:
        args = self.args
        per_device = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
        return groups_span_processes(per_device, self.group_size(mode), self.accelerator.num_processes)


class PolicyGradientObjective(Objective):
    """A GRPO-family loss (its pieces in ``F.POLICY_GRADIENT_FAMILY``, reduced by ``F.policy_gradient_loss``), and
    where its clipping bites."""

    def __init__(self, *args: Any, token_count: str | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.token_count = token_count
        self.pieces = F.POLICY_GRADIENT_FAMILY[self.name]
        config = self.args
        self.ratio_level = config.importance_sampling_level
        self.settings = {
            "importance_sampling_level": config.importance_sampling_level,
            "epsilon_low": config.epsilon,
            "epsilon_high": config.epsilon_high,
            "delta": config.delta,
            "sapo_temperature_pos": config.sapo_temperature_pos,
            "sapo_temperature_neg": config.sapo_temperature_neg,
            "vespo_parameters": (
                config.vespo_k_pos,
                config.vespo_lambda_pos,
                config.vespo_k_neg,
                config.vespo_lambda_neg,
            ),
        }

    def loss(self, per_token_logps, batch, mask, valid, mode, token_weights=None) -> ObjectiveResult:
        args = self.args
        old = batch.get("old_per_token_logps", per_token_logps.detach())
        loss = F.policy_gradient_loss(
            per_token_logps,
            old,
            batch.advantages,
            mask,
            self.pieces,
            max_completion_length=args.max_completion_length,
            token_count=self._loss_token_count(batch),
            token_weights=token_weights,
            **self.settings,
        )
        fractions = F.clip_fractions(
            per_token_logps.detach(),
            old,
            batch.advantages,
            mask,
            self.pieces,
            self.ratio_level,
            args.epsilon,
            args.epsilon_high,
        )
        return ObjectiveResult(loss, None, self._clip_means(fractions), self._clip_extremes(fractions))

    def rows_with_gradient(
        self, advantages_all: torch.Tensor, valid_all: torch.Tensor, policy_is_old: bool
    ) -> torch.Tensor:
        return F.advantage_rows_with_gradient(advantages_all, self.args.num_generations, valid_all, policy_is_old)

    def _loss_token_count(self, batch: StepBatch) -> torch.Tensor | float | None:
        if self.token_count == "batch":
            return batch.completion_mask.sum()  # the local batch's, rows left out of this pass included
        return batch.loss_token_count  # fixed at rollout; None (unused) for the losses that need no count

    @staticmethod
    def _clip_means(fractions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"clip_ratio/{name}_mean": clipped for name, clipped in fractions.items()}

    @staticmethod
    def _clip_extremes(fractions: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, str]]:
        """The most clipped sequence in each direction, as a fraction of its tokens."""
        pairs = (("low", "min"), ("high", "max"))
        return {
            f"clip_ratio/{name}_{extreme}": (fractions[name], extreme) for name, extreme in pairs if name in fractions
        }


class ClippedWeightObjective(PolicyGradientObjective):
    """CISPO: its clipping caps the importance weight, logged as one ratio."""

    @staticmethod
    def _clip_means(fractions: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"cispo_clip_ratio": fractions["high"]}

    @staticmethod
    def _clip_extremes(fractions: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, str]]:
        return {}


_per_sequence = PolicyGradientObjective  # a token mean per sequence, a constant, or a sequence sum: no count needed
_per_rollout_token = functools.partial(PolicyGradientObjective, token_count="rollout")

#: Each ``loss_type`` and the objective that trains it.
OBJECTIVES: dict[str, Callable[..., Objective]] = {
    "tpo": TargetObjective,
    "grpo": _per_sequence,
    "dapo": _per_rollout_token,
    "dr_grpo": _per_sequence,
    # Divided by the local batch's tokens; the rollout's count is still taken, as for the other token-normalised ones.
    "bnpo": functools.partial(PolicyGradientObjective, token_count="batch"),
    "cispo": functools.partial(ClippedWeightObjective, token_count="rollout"),
    "sapo": _per_sequence,
    "luspo": _per_sequence,
    "vespo": _per_rollout_token,
}


def build_objective(
    args: Any, accelerator: Accelerator, group_size: Callable[[str], int], local_rows: Callable[[int], slice]
) -> Objective:
    """The objective ``args.loss_type`` names."""
    return OBJECTIVES[args.loss_type](args.loss_type, args, accelerator, group_size, local_rows)


def warn_if_grpo_config_trains_another_loss(args: Any) -> None:
    """A GRPO script's config keeps its loss_type; a script whose imports alone changed would believe it trains TPO,
    so say which loss trains."""
    if args.loss_type != "tpo":
        warnings.warn(
            f"args is a GRPOConfig, so this trainer trains its loss_type={args.loss_type!r} (a GRPO-family "
            "policy-gradient loss), not TPO. For TPO, pass a TargetPOConfig (same fields, loss_type='tpo' by "
            "default) or set loss_type='tpo'.",
            stacklevel=3,
        )


class LossTerms(NamedTuple):
    """One micro-step's loss and its parts, for the metrics and the step batch's cache."""

    loss: torch.Tensor
    objective: ObjectiveResult
    importance_weights: BuiltImportanceWeights | None  # when this call built them
    kl: torch.Tensor | None
    entropy_coefficient: float | None
    aux_loss: torch.Tensor | None

    def built(self) -> StepCache:
        """What this call built that the step batch's later uses (``num_iterations``) reuse."""
        weights = None if self.importance_weights is None else self.importance_weights.weights
        return StepCache(targets=self.objective.targets, importance_weights=weights)

    @classmethod
    def joined(
        cls, parts: Sequence[LossTerms], passes: Sequence[torch.Tensor], built_for_every_row: bool = False
    ) -> LossTerms:
        """One micro-step's terms from those of its passes (``passes``: each one's rows, bool), detached: the loss,
        the KL and the router loss add up (each pass's is its part of the micro-step's); what a pass measured per
        row or token is taken from the rows it trained, and so is what it built (q, importance weights) unless it
        was ``built_for_every_row`` (from the old log-probs, complete at the latest in the last pass)."""

        def by_rows(values: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
            return joined_by_rows(values, passes)

        def built(values: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
            if not built_for_every_row:
                return by_rows(values)
            # The last pass's: the old log-probs were complete by then (a first use completes them pass by pass).
            return next((value.detach() for value in reversed(values) if value is not None), None)

        def summed(values: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
            present = [value.detach() for value in values if value is not None]
            return torch.stack(present).sum(dim=0) if present else None

        objectives = [part.objective for part in parts]
        first = objectives[0]
        objective = ObjectiveResult(
            summed([result.loss for result in objectives]),
            built([result.targets for result in objectives]),
            {name: by_rows([result.token_means[name] for result in objectives]) for name in first.token_means},
            {
                name: (by_rows([result.sequence_extremes[name][0] for result in objectives]), extreme)
                for name, (_, extreme) in first.sequence_extremes.items()
            },
        )
        weights = [part.importance_weights for part in parts]
        importance_weights = None
        if any(built is not None for built in weights):
            importance_weights = BuiltImportanceWeights(
                *(built([None if one is None else one[index] for one in weights]) for index in range(5))
            )
        return cls(
            summed([part.loss for part in parts]),
            objective,
            importance_weights,
            summed([part.kl for part in parts]),
            parts[0].entropy_coefficient,
            summed([part.aux_loss for part in parts]),
        )


class TrainingLoss:
    """The objective and the regularisers a run switches on: the loss of one micro-step."""

    def __init__(
        self, objective: Objective, args: Any, accelerator: Accelerator, sampler_reshapes: bool, router_aux_loss: bool
    ):
        self.objective = objective
        self.kl = KLPenalty(args.beta, args.use_bias_correction_kl, objective.ratio_level) if args.beta > 0 else None
        bonus = args.entropy_coef != 0 or args.use_adaptive_entropy
        self.entropy_bonus = EntropyBonus(args, accelerator) if bonus else None
        self.token_filter = TokenFilter(args, accelerator, sampler_reshapes)
        self.importance_weights = ImportanceWeights(args)
        self.router_aux_loss_coef = args.router_aux_loss_coef if router_aux_loss else None

    @property
    def reaches_only_rows_with_gradient(self) -> bool:
        """Whether rows whose objective gradient is 0 get no gradient at all: no term reaches every completion (the
        KL, the entropy bonus, an entropy quantile ranked over all of the batch's tokens, the router loss)."""
        filters_by_entropy = self.token_filter.top_entropy_quantile < 1
        regularised = self.kl is not None or self.entropy_bonus is not None or self.router_aux_loss_coef is not None
        return not regularised and not filters_by_entropy

    def __call__(
        self,
        logps: TokenLogps,
        batch: StepBatch,
        mask: torch.Tensor,
        valid: torch.Tensor,
        mode: str,
        importance_sampling: bool,
        micro_step_mask: torch.Tensor | None = None,
    ) -> LossTerms:
        """The loss of the rows in ``mask``; ``importance_sampling``: reweight by the batch's sampler log-probs.

        ``micro_step_mask``: when ``mask`` is one pass of a micro-step trained in several (``max_tokens_per_micro_batch``),
        the tokens of all of them; the terms that average over the micro-step's tokens divide by its count, so that
        the passes' losses add up to the micro-step's.
        """
        per_token_logps, entropies = logps.per_token, logps.entropies
        policy_logps, built_weights = per_token_logps, None
        if importance_sampling and "sampler_per_token_logps" in batch:
            weights = batch.cache.importance_weights
            if weights is None:
                built_weights = self.importance_weights.build(per_token_logps, batch, mask)
                weights = built_weights.weights
            policy_logps = F.scale_token_gradients(per_token_logps, weights)
        trained_tokens = self.token_filter(per_token_logps, entropies, batch, mask)
        result = self.objective.loss(policy_logps, batch, mask, valid, mode, trained_tokens)
        loss, kl, coefficient = result.loss, None, None
        micro_step_count = None if micro_step_mask is None else micro_step_mask.sum().clamp(min=1)
        if self.kl is not None:
            kl = self.kl(per_token_logps, batch, mask, micro_step_count)
            loss = loss + self.kl.beta * kl
        if self.entropy_bonus is not None:
            tokens = mask if trained_tokens is None else mask * trained_tokens
            # Passes: no token filter is on together with the bonus (the config refuses it), so the count is known.
            count = self.objective.entropy_token_count(batch, tokens if micro_step_mask is None else micro_step_mask)
            bonus, coefficient = self.entropy_bonus(entropies, tokens, count, mode)
            loss = loss - bonus
        if logps.aux_loss is not None:  # (a pass's: already weighted by its share of the micro-step's tokens)
            loss = loss + self.router_aux_loss_coef * logps.aux_loss
        return LossTerms(loss, result, built_weights, kl, coefficient, logps.aux_loss)
