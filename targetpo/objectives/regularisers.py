"""What joins any objective's loss: the KL penalty to the reference, the entropy bonus (and its adaptive coefficient),
the token filters (``top_entropy_quantile``, ``off_policy_mask_threshold``) and the importance weights that correct for
a sampler other than the trainer (vLLM). Each takes tensors and returns tensors; none records a metric.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, NamedTuple

import torch
from accelerate import Accelerator

from .. import functional as F
from ..batch import StepBatch


class KLPenalty:
    """``beta x`` the per-token KL to the reference (``exp(r) - r - 1``), optionally bias-corrected by the ratio to the
    rollout's policy (``use_bias_correction_kl``)."""

    def __init__(self, beta: float, bias_correction: bool, ratio_level: str):
        self.beta = beta
        self.bias_correction = bias_correction
        self.ratio_level = ratio_level  # the objective's importance-ratio level (TPO's is per token)

    def __call__(
        self,
        per_token_logps: torch.Tensor,
        batch: StepBatch,
        mask: torch.Tensor,
        token_count: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The mean token KL (before ``beta``); ``token_count``: the tokens it is a mean over, if not ``mask``'s."""
        ratios = None
        if self.bias_correction:
            old = batch.get("old_per_token_logps", per_token_logps.detach())
            ratios = torch.exp(F.log_importance_ratios(per_token_logps, old, mask, self.ratio_level))
        return F.token_kl(per_token_logps, batch["ref_per_token_logps"], mask, ratios, token_count)


class EntropyBonus:
    """``coefficient x`` the mean entropy of the trained tokens, subtracted from the loss. With
    ``use_adaptive_entropy`` the coefficient moves after each optimiser step to keep the entropy at its target, and
    applies only while the last step's entropy is at or below it (none before the first step)."""

    def __init__(self, args: Any, accelerator: Accelerator):
        self.accelerator = accelerator
        self.adaptive = args.use_adaptive_entropy
        self.target = args.entropy_target
        self.step = args.entropy_coef_delta
        self.bounds = (args.entropy_coef_min, args.entropy_coef_max)
        self.coefficient = args.entropy_coef
        self.last_step_entropy = math.inf
        self._window = torch.zeros(2, device=accelerator.device)  # this optimiser step's entropy sum and token count

    def __call__(
        self, entropies: torch.Tensor, tokens: torch.Tensor, token_count: torch.Tensor | float, mode: str
    ) -> tuple[torch.Tensor, float]:
        """The bonus (``coefficient x`` the entropy sum over ``tokens`` divided by ``token_count``) and the
        coefficient it applied."""
        total = (entropies * tokens).sum()
        coefficient = self.coefficient
        if self.adaptive:
            coefficient = coefficient if self.last_step_entropy <= self.target else 0.0
            if mode == "train":
                self._window += torch.stack([total.detach(), tokens.sum()]).float()
        return coefficient * (total / token_count), coefficient

    def adapt(self) -> None:
        """After an optimiser step: move the coefficient towards keeping the entropy at its target."""
        total, count = self.accelerator.reduce(self._window, reduction="sum").tolist()
        self._window.zero_()
        if count == 0:
            return
        self.last_step_entropy = total / count
        low, high = self.bounds
        if self.last_step_entropy <= self.target:
            self.coefficient = min(self.coefficient + self.step, high)
        else:
            self.coefficient = max(self.coefficient - self.step, low)

    def state(self) -> dict[str, float]:
        return {"entropy_coef": self.coefficient, "last_step_entropy": self.last_step_entropy}

    def load_state(self, state: dict[str, float]) -> None:
        self.coefficient, self.last_step_entropy = state["entropy_coef"], state["last_step_entropy"]


class TokenFilter:
    """0/1 weights of the tokens the policy loss trains on (``top_entropy_quantile``, ``off_policy_mask_threshold``)."""

    def __init__(self, args: Any, accelerator: Accelerator, sampler_reshapes_distribution: bool):
        self.accelerator = accelerator
        self.top_entropy_quantile = args.top_entropy_quantile
        self.off_policy_threshold = args.off_policy_mask_threshold
        self.sampler_reshapes_distribution = sampler_reshapes_distribution

    @property
    def active(self) -> bool:
        return self.top_entropy_quantile < 1 or self.off_policy_threshold is not None

    def __call__(
        self, per_token_logps: torch.Tensor, entropies: torch.Tensor, batch: StepBatch, mask: torch.Tensor
    ) -> torch.Tensor | None:
        """The weights; None: every token trains."""
        weights = None
        if self.top_entropy_quantile < 1:
            # Ranked against every process's tokens of this micro-step, as one batch would be.
            local = entropies.detach()[mask.bool()].float()
            padded = self.accelerator.pad_across_processes(local, dim=0, pad_index=-1.0)  # entropies are >= 0
            pool = self.accelerator.gather(padded)
            weights = F.high_entropy_mask(entropies, mask, self.top_entropy_quantile, pool[pool >= 0]).float()
        if self.off_policy_threshold is not None:
            # The policy that sampled: vLLM's log-probs where they describe the trainer's distribution, else the
            # rollout's own (under top-k, penalties, ... vLLM's are of the reshaped one, as for the importance weights).
            sampler = batch.get("old_per_token_logps", per_token_logps.detach())
            if not self.sampler_reshapes_distribution:
                sampler = batch.get("sampler_per_token_logps", sampler)
            keep = F.off_policy_sequence_mask(
                batch["advantages"], per_token_logps, sampler, mask, self.off_policy_threshold
            ).float()
            weights = keep if weights is None else weights * keep
        return weights


class BuiltImportanceWeights(NamedTuple):
    """Importance weights a step batch's first use built, with what they were built from (for the metrics)."""

    weights: torch.Tensor
    trainer_logps: torch.Tensor
    sampler_logps: torch.Tensor
    mask: torch.Tensor
    outside_bounds: torch.Tensor  # 1 where the ratio fell outside the bounds (clamped or zeroed)


class ImportanceWeights:
    """Token weights ``p_trainer / p_sampler`` of a step batch, bounded as ``vllm_importance_sampling_mode`` says."""

    def __init__(self, args: Any):
        self.mode = args.vllm_importance_sampling_mode
        self.clip_min = args.vllm_importance_sampling_clip_min
        self.clip_max = args.importance_sampling_clip_max

    def build(self, per_token_logps: torch.Tensor, batch: StepBatch, mask: torch.Tensor) -> BuiltImportanceWeights:
        """The weights, built once per step batch and kept by the caller for its later uses.

        The trainer's side is its own rollout-time log-probs, the same ones ``p_old`` (and so ``q``) is built from.
        """
        old = batch.get("old_per_token_logps")
        if old is None:  # every use is in this optimiser step, over the same rows: those in `mask`
            old = per_token_logps.detach()
        else:  # kept for later steps, which may train rows this one leaves out
            mask = batch["completion_mask"]
        sampler = batch["sampler_per_token_logps"]
        weights = F.importance_sampling_weights(old, sampler, mask, self.mode, self.clip_min, self.clip_max)
        return BuiltImportanceWeights(weights, old, sampler, mask, self._outside_bounds(old, sampler, mask))

    def _outside_bounds(self, trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor):
        level = self.mode.split("_")[0]
        ratios = F.importance_sampling_weights(trainer_logps, sampler_logps, mask, f"{level}_truncate", None, None)
        return ((ratios > self.clip_max) | (ratios < (self.clip_min or 0.0))).float()


def importance_sampling_applies(args: Any, sampling: Any) -> bool:
    """Whether the importance-sampling correction runs: asked for, with an engine that reports its sampling log-probs
    (vLLM, transformers' continuous batching), and sampling not reshaped (a warning says why when it is); a warning
    too when async rollouts go without it."""
    engine_reports_logps = args.use_vllm or args.use_transformers_continuous_batching
    applies = engine_reports_logps and args.vllm_importance_sampling_correction
    if applies and sampling.reshapes_distribution:
        # vLLM reports log-probs after truncation and penalties, the trainer's are of the tempered distribution:
        # their ratio would measure the truncation, not an implementation mismatch.
        warnings.warn(
            "vllm_importance_sampling_correction is switched off: sampling is reshaped by "
            f"{', '.join(sampling.reshaping_settings)}; the engine's sampling log-probs include that reshaping and the "
            "trainer's do not, so the weights would shrink every gradient. Sample without them to use the correction.",
            stacklevel=4,
        )
        applies = False
    if args.async_rollouts and not applies:
        warnings.warn(
            "async_rollouts=True without the importance-sampling correction: completions sampled by older weights "
            "are trained on as if the current policy had written them.",
            stacklevel=4,
        )
    return applies
