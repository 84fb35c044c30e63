"""The metrics a run logs: each one's values since the last log, over every process, kept as running means.

Values reach the recorder already computed (the math lives elsewhere); the recorder gathers them across processes
and averages them between logs. ``recorder[mode]`` is that mode's ``{name: RunningMean}``. ``record_loss_metrics`` and
``record_targets`` record what a loss step produced.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator

from .. import functional as F
from ..batch import StepBatch

if TYPE_CHECKING:  # the loss's types, from the modules above this one
    from ..objectives.registry import LossTerms
    from ..objectives.regularisers import BuiltImportanceWeights

MODES = ("train", "eval")


class RunningMean:
    """The mean of the values a metric recorded since the last log, kept as a sum and a count: its memory stays the
    same however long nothing logs (``logging_strategy="no"``, a large ``logging_steps``)."""

    __slots__ = ("total", "count")

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def append(self, value: float) -> None:
        """Record one value (named as a list's, so recording reads the same either way)."""
        self.total += value
        self.count += 1

    def mean(self) -> float:
        return self.total / self.count


class MetricsRecorder:
    """Running means of the training and evaluation metrics since their last log."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self._values: dict[str, dict[str, RunningMean]] = {mode: defaultdict(RunningMean) for mode in MODES}

    def __getitem__(self, mode: str) -> dict[str, RunningMean]:
        return self._values[mode]

    def add(self, mode: str, name: str, value: float) -> None:
        """One value this process computed for every process (the same on each: e.g. already gathered)."""
        self._values[mode][name].append(value)

    def mean(self, mode: str, name: str, value: torch.Tensor) -> None:
        """The mean over processes of one value each."""
        self.add(mode, name, self.accelerator.gather(value.reshape(1).float()).mean().item())

    def token_mean(self, mode: str, name: str, values: torch.Tensor, mask: torch.Tensor) -> None:
        """The mean of per-token ``values`` over every process's tokens in ``mask``; nothing when there are none."""
        totals = torch.stack([(values * mask).sum(), mask.sum()]).float()
        total, count = self.accelerator.gather(totals.unsqueeze(0)).sum(dim=0).tolist()
        if count > 0:
            self.add(mode, name, total / count)

    def sequence_extreme(
        self, mode: str, name: str, values: torch.Tensor | None, mask: torch.Tensor, extreme: str
    ) -> None:
        """The min or max over every process's sequences (with a token in ``mask``) of their token mean."""
        if values is None:
            return
        counts = mask.sum(dim=-1)
        means = (values * mask).sum(dim=-1) / counts.clamp(min=1)
        means = torch.where(counts > 0, means, torch.full_like(means, math.nan))
        means = self.accelerator.gather(means)
        means = means[~torch.isnan(means)]
        if means.numel() > 0:
            self.add(mode, name, (means.min() if extreme == "min" else means.max()).item())

    def pop_means(self, mode: str) -> dict[str, float]:
        """Each metric's mean since the last log; the running means start again."""
        means = {name: values.mean() for name, values in self._values[mode].items() if values.count}
        self._values[mode].clear()
        return means


def record_loss_metrics(
    recorder: MetricsRecorder,
    mode: str,
    terms: LossTerms,
    entropies: torch.Tensor,
    mask: torch.Tensor,
    rows: torch.Tensor | None,
) -> None:
    """What one micro-step's loss produced: the skipped rows, new importance weights, the objective's diagnostics
    (clip ratios), the KL, the entropy coefficient, the router loss and the entropy."""
    if rows is not None:
        recorder.mean(mode, "completions/skipped_fraction", 1 - rows.float().mean())
    if terms.importance_weights is not None:
        _record_importance_weights(recorder, terms.importance_weights)
    for name, values in terms.objective.token_means.items():
        recorder.token_mean(mode, name, values, mask)
    for name, (values, extreme) in terms.objective.sequence_extremes.items():
        recorder.sequence_extreme(mode, name, values, mask, extreme)
    if terms.kl is not None:
        recorder.mean(mode, "kl", terms.kl.detach())
    if terms.entropy_coefficient is not None:
        recorder.add(mode, "entropy_coef", terms.entropy_coefficient)
    if terms.aux_loss is not None:
        recorder.mean(mode, "aux_loss", terms.aux_loss.detach())
    recorder.token_mean(mode, "entropy", entropies.detach(), mask)


def _record_importance_weights(recorder: MetricsRecorder, built: BuiltImportanceWeights) -> None:
    """How far vLLM's sampling log-probs are from the trainer's, and how much the correction reweights."""
    weights, mask = built.weights, built.mask
    on = mask.bool()
    difference = torch.where(on, (built.trainer_logps - built.sampler_logps).abs(), torch.zeros_like(weights))
    recorder.token_mean("train", "vllm/logp_abs_diff", difference, mask)
    recorder.token_mean("train", "vllm/importance_weight_mean", weights, mask)
    recorder.token_mean("train", "vllm/importance_weight_capped_fraction", built.outside_bounds, mask)
    lowest = torch.where(on, weights, torch.full_like(weights, math.inf)).min().reshape(1)
    lowest = recorder.accelerator.gather(lowest).min().item()
    if lowest < math.inf:  # no token at all when a step skips every completion
        recorder.add("train", "vllm/importance_weight_min", lowest)


def record_targets(
    recorder: MetricsRecorder, mode: str, batch: StepBatch, group_size: int, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's diagnostics of a freshly built q over all processes; returns the sample indices and q of every
    process's rows whose q was built (for the completions table).

    ``valid`` narrows both to the rows whose q was built (a step that leaves rows out builds no q for them).
    """
    built = torch.ones_like(batch.valid) if valid is None else valid | ~batch.valid  # invalid: q = 0
    valid = batch.valid if valid is None else valid
    targets, scores, valid, built, sample_index = (
        recorder.accelerator.gather(tensor)
        for tensor in (batch.cache.targets, batch.scores, valid, built, batch.sample_index)
    )
    diagnostics = F.tpo_target_diagnostics(targets, scores, group_size, valid)
    for name in ("target_entropy", "best_completion_target_mass"):  # informative fraction: at rollout
        value = getattr(diagnostics, name).item()
        if not math.isnan(value):
            recorder.add(mode, f"tpo/{name}", value)
    return sample_index[built], targets[built]
