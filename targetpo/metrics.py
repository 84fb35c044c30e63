"""The metrics a run logs: each one's values since the last log, over every process, kept as running means.

Values reach the recorder already computed (the math lives elsewhere); the recorder gathers them across processes
and averages them between logs. ``recorder[mode]`` is that mode's ``{name: RunningMean}``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from accelerate import Accelerator

from .reporting import RunningMean

MODES = ("train", "eval")


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
