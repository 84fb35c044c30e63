"""What a rollout holds, and what one step batch of it may cache across ``num_iterations``.

A :class:`RolloutBatch` is one process's rows of a rollout (or of one step batch cut from it): a row is one completion
of one prompt, and rows of a group are contiguous. It also reads and writes like a dict under the names TRL's GRPO
trainer gives the same tensors (``inputs["advantages"]``, ``inputs["completion_mask"]``, ...), so code written
against those names, a ``compute_loss`` override included, keeps working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

#: Keys under which per-token extras of prompts with images, and of completions whose tool results hold images, are
#: read and written one by one.
PROMPT_ALIGNED = "prompt_aligned/"
COMPLETION_ALIGNED = "completion_aligned/"
_ALIGNED = {PROMPT_ALIGNED: "prompt_aligned", COMPLETION_ALIGNED: "completion_aligned"}


@dataclass
class StepCache:
    """What the first use of a step batch computes and its later uses (``num_iterations``) reuse: every use then fits
    the same ``q`` and applies the same importance weights, whatever the weights have become."""

    targets: torch.Tensor | None = None  # q of the rows: built at rollout, or by the step batch's first use
    importance_weights: torch.Tensor | None = None  # p_trainer / p_sampler per token, bounded

    def rows(self, index: slice) -> StepCache:
        return StepCache(*(None if value is None else value[index] for value in _values(self)))

    def updated(self, built: StepCache) -> StepCache:
        """This cache with what a use of the step batch ``built`` (its fields that are not None) added."""
        return StepCache(*(new if new is not None else kept for kept, new in zip(_values(self), _values(built))))


@dataclass
class RolloutBatch:
    """One process's rows of a rollout, or of one step batch of it."""

    prompt_ids: torch.Tensor  # (rows, prompt tokens), left-padded
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor  # (rows, completion tokens), right-padded
    completion_attention_mask: torch.Tensor  # the tokens the model reads (tool results included)
    completion_mask: torch.Tensor  # the tokens the loss trains (the policy's own, of valid completions)
    valid: torch.Tensor  # (rows,) bool: completions the loss counts
    scores: torch.Tensor  # (rows,) combined rewards
    advantages: torch.Tensor  # (rows,) u: the scores whitened within their group
    sample_index: torch.Tensor  # (rows,) each row's place in the whole rollout, over every process
    rollout: int = 0  # which rollout of the run (1, 2, ...)
    # Prompts (or tool results) with images: each row's per-image model inputs, in the order of their tokens, and
    # per-token extras of the prompt and of the completion (by name; the completion's: the tool images' tokens).
    pixel_inputs: list[Any] | None = None
    prompt_aligned: dict[str, torch.Tensor] = field(default_factory=dict)
    completion_aligned: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per-token log-probs of the completions: the sampler's (vLLM), the policy's at rollout time (when the weights
    # move before the rollout is trained on; the rows a step batch's first use trains at the rollout's weights are
    # filled in by that use), the reference model's (beta > 0).
    sampler_per_token_logps: torch.Tensor | None = None
    old_per_token_logps: torch.Tensor | None = None
    ref_per_token_logps: torch.Tensor | None = None
    # The token-normalised losses' divisor: one optimiser step's tokens over every process, per micro-step share.
    loss_token_count: float | None = None
    # The optimiser step the rollout was made at (training): its weights are the rollout's until the next step.
    rollout_step: int | None = None
    # skip_zero_gradient_completions: the rows whose gradient can be non-zero, while the weights are still the
    # rollout's and afterwards.
    rows_with_gradient_at_rollout: torch.Tensor | None = None
    rows_with_gradient: torch.Tensor | None = None
    # The rows whose old log-probs the step batch's first use fills in (it runs at the rollout's weights and computes
    # them anyway); None once filled, or where the rollout recorded them all.
    old_logps_from_first_use: torch.Tensor | None = None
    # Groups split over micro-steps (TPO): each row's log of its group's softmax p at the weights of optimiser step
    # ``group_log_probs_step`` (``split_groups.py``).
    group_log_probs: torch.Tensor | None = None
    group_log_probs_step: int | None = None
    cache: StepCache = field(default_factory=StepCache)

    def __len__(self) -> int:
        return self.completion_ids.size(0)

    def rows(self, index: slice) -> RolloutBatch:
        """The rows in ``index`` (whole groups, for a step batch); the rollout-wide values are shared."""
        cut = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if torch.is_tensor(value) or spec.name == "pixel_inputs" and value is not None:
                value = value[index]
            elif spec.name in _ALIGNED.values():
                value = {key: tensor[index] for key, tensor in value.items()}
            elif spec.name == "cache":
                value = value.rows(index)
            cut[spec.name] = value
        return RolloutBatch(**cut)

    def masks_without(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The completion mask and validity with only ``rows`` (bool; None: every row) kept. Rows left out count as
        invalid, all-masked members: each loss then gives them exactly 0 while keeping them (and their groups) in its
        averages, which is what their zero gradient contributes."""
        if rows is None:
            return self.completion_mask, self.valid
        return self.completion_mask * rows.unsqueeze(-1), self.valid & rows

    def step_batches(self, rows_per_step: int) -> list[RolloutBatch]:
        """Cut into step batches of ``rows_per_step`` rows, each with its own cache."""
        return [self.rows(slice(start, start + rows_per_step)) for start in range(0, len(self), rows_per_step)]

    @classmethod
    def from_mapping(cls, inputs: Mapping[str, Any]) -> RolloutBatch:
        """A batch from a dict keyed by the names this class reads as (e.g. one built by hand for ``compute_loss``)."""
        batch = cls(**{name: inputs[name] for name in _REQUIRED})
        for key, value in inputs.items():
            if key not in _REQUIRED:
                batch[key] = value
        return batch

    # --- read and written like a dict, under TRL's names -----------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        value = self._lookup(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _CACHED:
            setattr(self.cache, key, value)
        elif _aligned_prefix(key) is not None:
            prefix = _aligned_prefix(key)
            getattr(self, _ALIGNED[prefix])[key[len(prefix) :]] = value
        elif key in _FIELDS:
            setattr(self, key, value)
        else:
            raise KeyError(f"{key!r} is not a rollout field; the fields are {sorted(_FIELDS | _CACHED)}.")

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._lookup(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self._lookup(key)
        return default if value is None else value

    def keys(self) -> Iterator[str]:
        names = [name for name in _FIELDS if name not in ("cache", *_ALIGNED.values())] + sorted(_CACHED)
        yield from (name for name in names if name in self)
        for prefix, field_name in _ALIGNED.items():
            yield from (prefix + name for name in getattr(self, field_name))

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((key, self[key]) for key in self.keys())

    def _lookup(self, key: str) -> Any:
        if key in _CACHED:
            return getattr(self.cache, key)
        prefix = _aligned_prefix(key)
        if prefix is not None:
            return getattr(self, _ALIGNED[prefix]).get(key[len(prefix) :])
        if key in _FIELDS and key not in ("cache", *_ALIGNED.values()):
            return getattr(self, key)
        return None


def _aligned_prefix(key: str) -> str | None:
    """The per-token-extras prefix ``key`` starts with, if any."""
    return next((prefix for prefix in _ALIGNED if key.startswith(prefix)), None)


def _values(cache: StepCache) -> list[Any]:
    """The cache's fields in order, not copied (``dataclasses.astuple`` would deep-copy the tensors)."""
    return [getattr(cache, spec.name) for spec in dataclasses.fields(cache)]


_FIELDS = {spec.name for spec in dataclasses.fields(RolloutBatch)}
_REQUIRED = [
    spec.name
    for spec in dataclasses.fields(RolloutBatch)
    if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING
]
_CACHED = {spec.name for spec in dataclasses.fields(StepCache)}
