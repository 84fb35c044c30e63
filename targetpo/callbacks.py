"""What the trainer does after each optimiser step (one callback running an action), and what its checkpoints hold
beyond the Trainer's own: the adaptive entropy coefficient and the synced reference model, which move with training.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from safetensors.torch import load_model, save_model
from torch import nn
from transformers import TrainerCallback

from .objectives.regularisers import EntropyBonus

#: Files a checkpoint holds beside the Trainer's: the adaptive entropy coefficient, and the synced reference model.
ENTROPY_STATE_FILE = "entropy_coefficient.json"
REFERENCE_FILE = "reference_model.safetensors"


class OnOptimizerStep(TrainerCallback):
    """Runs ``action()`` on every process after every ``every``-th optimiser step."""

    def __init__(self, action: Callable[[], None], every: int = 1):
        self.action = action
        self.every = every

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step % self.every == 0:
            self.action()


def check_sync_ref_model(has_reference_copy: bool, sharded: bool) -> None:
    """sync_ref_model mixes the policy into a reference copy, whole: refused without a copy or with sharded weights."""
    if not has_reference_copy:  # PEFT: the reference is the base model itself, which the adapters leave as is
        raise ValueError(
            "sync_ref_model=True moves a reference copy towards the policy, but under PEFT the reference is the "
            "adapter-free base model, not a copy. Set sync_ref_model=False."
        )
    if sharded:
        raise ValueError(
            "sync_ref_model=True is not supported with sharded weights (DeepSpeed ZeRO-3, FSDP2) yet: mixing "
            "the policy into the reference needs both whole. Use ZeRO-1/2 or DDP, or sync_ref_model=False."
        )


def save_checkpoint_extras(output_dir: str, entropy_bonus: EntropyBonus | None, reference: nn.Module | None) -> None:
    """Write the adaptive entropy state and the synced reference (each when given) into ``output_dir``."""
    if entropy_bonus is not None:
        with open(os.path.join(output_dir, ENTROPY_STATE_FILE), "w") as file:
            # The entropy before the first step is inf: Python's json writes Infinity.
            json.dump(entropy_bonus.state(), file)
    if reference is not None:
        save_model(reference, os.path.join(output_dir, REFERENCE_FILE))


def load_checkpoint_extras(
    checkpoint: str, entropy_bonus: EntropyBonus | None, reference: nn.Module | None, entropy_coef: float
) -> None:
    """Read back what :func:`save_checkpoint_extras` wrote; a checkpoint without it keeps the start values, with a
    warning (``entropy_coef``: the configured coefficient the bonus then starts from)."""
    entropy_state, reference_file = (os.path.join(checkpoint, name) for name in (ENTROPY_STATE_FILE, REFERENCE_FILE))
    if entropy_bonus is not None:
        if os.path.exists(entropy_state):
            with open(entropy_state) as file:
                entropy_bonus.load_state(json.load(file))
        else:  # a run that switches the entropy control on
            warnings.warn(
                f"{checkpoint} holds no {ENTROPY_STATE_FILE} (it was saved without use_adaptive_entropy): the "
                f"adaptive entropy coefficient starts again from entropy_coef={entropy_coef}.",
                stacklevel=3,
            )
    if reference is not None:
        if os.path.exists(reference_file):
            load_model(reference, reference_file)
        else:
            warnings.warn(
                f"{checkpoint} holds no {REFERENCE_FILE} (it was saved without sync_ref_model): the reference "
                "model starts again from the model given to the trainer, not from the checkpoint's policy.",
                stacklevel=3,
            )


@dataclass
class CheckpointExtras:
    """What a resumed run needs beyond the Trainer's own checkpoint (each when the run has it): the adaptive entropy
    bonus and the synced reference model; ``entropy_coef``, the configured coefficient a bonus restarts from; and
    ``rollout``, the rollout in progress (``rollout/in_progress.py``: each process saves and loads its own)."""

    entropy_bonus: EntropyBonus | None
    reference: nn.Module | None
    entropy_coef: float
    rollout: Any = None

    def save(self, output_dir: str, main_process: bool) -> None:
        if main_process:
            save_checkpoint_extras(output_dir, self.entropy_bonus, self.reference)
        if self.rollout is not None:
            self.rollout.save(output_dir)

    def load(self, checkpoint: str) -> None:
        load_checkpoint_extras(checkpoint, self.entropy_bonus, self.reference, self.entropy_coef)
        if self.rollout is not None:
            self.rollout.load(checkpoint)
