"""The rollout a checkpoint falls in the middle of, kept with it.

A rollout serves several optimiser steps when ``num_iterations`` or ``steps_per_generation`` spread it over them. A
checkpoint taken between two of them holds, per process, the rollout's step batches and what the step worked out for
them (old log-probs, q, the split groups' softmax), so that a resumed run trains on that rollout as the run straight
through did, instead of sampling it again from other weights. A checkpoint between rollouts holds none. With
``async_rollouts`` the checkpoint also holds the rollout under way ahead of it (``ahead.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .ahead import RolloutAhead

FILE = "rollout_in_progress_{rank}.pt"


@dataclass
class RolloutInProgress:
    """Saves and restores the rollout ``scheduler`` is in the middle of (``uses_per_rollout`` micro-steps each) on
    this process of ``accelerator``, and the one it generates ahead."""

    scheduler: Any  # the RolloutScheduler: its buffer of step batches and the use last handed out
    uses_per_rollout: int
    accelerator: Any
    ahead: RolloutAhead = field(init=False)

    def __post_init__(self) -> None:
        self.ahead = RolloutAhead(self.scheduler, self.accelerator)

    def save(self, output_dir: str) -> None:
        scheduler = self.scheduler
        if scheduler.buffer is not None and scheduler.use != self.uses_per_rollout - 1:  # not between rollouts
            torch.save({"use": scheduler.use, "step_batches": scheduler.buffer}, self._path(output_dir))
        self.ahead.save(output_dir)

    def load(self, checkpoint: str) -> None:
        """The checkpoint's rollout, if it holds one (else the next step batch starts a rollout of its own), and the
        one generated ahead."""
        path = self._path(checkpoint)
        if os.path.exists(path):
            # The file is one this class wrote: its step batches are records of this library, not only tensors.
            state = torch.load(path, map_location=self.accelerator.device, weights_only=False)
            self.scheduler.buffer, self.scheduler.use = state["step_batches"], state["use"]
        self.ahead.load(checkpoint)

    def _path(self, directory: str) -> str:
        return os.path.join(directory, FILE.format(rank=self.accelerator.process_index))
