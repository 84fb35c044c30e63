"""What a rollout holds, and what training one step batch of it works out: the records passed between the rollout
side and the step.

A :class:`RolloutBatch` is one process's rows of a rollout (or of one step batch cut from it): a row is one completion
of one prompt, and rows of a group are contiguous. Its facts are frozen once the rollout is made. What the step works
out for a step batch (which rows train, the old log-probs, the softmax of groups split over micro-steps, the token
count of the normaliser, what its first use built for the later ones) is its :class:`StepState`, which only the step
writes. The loss reads both through a :class:`StepBatch`, which also reads like a dict under the names TRL's GRPO
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
#: read one by one.
PROMPT_ALIGNED = "prompt_aligned/"
COMPLETION_ALIGNED = "completion_aligned/"
_ALIGNED = {PROMPT_ALIGNED: "prompt_aligned", COMPLETION_ALIGNED: "completion_aligned"}


@dataclass(frozen=True)
class RolloutBatch:
    """One process's rows of a rollout, or of one step batch of it: what the rollout made, frozen."""

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
    # Per-token log-probs of the completions: the sampler's (vLLM) and the reference model's (beta > 0).
    sampler_per_token_logps: torch.Tensor | None = None
    ref_per_token_logps: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.completion_ids.size(0)

    def rows(self, index: slice) -> RolloutBatch:
        """The rows in ``index`` (whole groups, for a step batch); the rollout-wide values are shared."""
        return RolloutBatch(**{name: _cut(value, index) for name, value in _fields(self).items()})

    def replaced(self, **facts: Any) -> RolloutBatch:
        """This rollout with ``facts`` in place of its own (a new record: this one stays as it is)."""
        return dataclasses.replace(self, **facts)


@dataclass
class StepCache:
    """What the first use of a step batch computes and its later uses (``num_iterations``) reuse: every use then fits
    the same ``q`` and applies the same importance weights, whatever the weights have become."""

    targets: torch.Tensor | None = None  # q of the rows: built at rollout, or by the step batch's first use
    importance_weights: torch.Tensor | None = None  # p_trainer / p_sampler per token, bounded

    def rows(self, index: slice) -> StepCache:
        return StepCache(*(_cut(value, index) for value in _fields(self).values()))

    def updated(self, built: StepCache) -> StepCache:
        """This cache with what a use of the step batch ``built`` (its fields that are not None) added."""
        return StepCache(*(new if new is not None else kept for kept, new in zip(_values(self), _values(built))))


@dataclass
class StepState:
    """What the step works out for a rollout's rows and keeps across their micro-steps (``step/run.py``)."""

    # The token-normalised losses' divisor: one optimiser step's tokens over every process, per micro-step share.
    loss_token_count: float | None = None
    # The optimiser step the rollout was made at (training): its weights are the rollout's until the next step.
    rollout_step: int | None = None
    # skip_zero_gradient_completions: the rows whose gradient can be non-zero, while the weights are still the
    # rollout's and afterwards.
    rows_with_gradient_at_rollout: torch.Tensor | None = None
    rows_with_gradient: torch.Tensor | None = None
    # The policy's per-token log-probs at rollout time, where the weights move before the rows are trained on: recorded
    # at rollout, or (the rows a step batch's first use trains at the rollout's weights) filled in by that use.
    old_per_token_logps: torch.Tensor | None = None
    # The rows whose old log-probs the step batch's first use fills in; None once filled, or where all were recorded.
    old_logps_from_first_use: torch.Tensor | None = None
    # Groups split over micro-steps (TPO): each row's log of its group's softmax p at the weights of optimiser step
    # ``group_log_probs_step`` (``step/split_groups.py``).
    group_log_probs: torch.Tensor | None = None
    group_log_probs_step: int | None = None
    cache: StepCache = field(default_factory=StepCache)

    def rows(self, index: slice) -> StepState:
        return StepState(**{name: _cut(value, index) for name, value in _fields(self).items()})


class StepBatch:
    """One step batch as the loss reads it: the rollout's rows (``record``, frozen) and what the step works out for
    them (``state``). Attributes and dict keys of either read through; only the state's can be written."""

    __slots__ = ("record", "state")

    def __init__(self, record: RolloutBatch, state: StepState | None = None):
        object.__setattr__(self, "record", record)
        object.__setattr__(self, "state", StepState() if state is None else state)

    def __getattr__(self, name: str) -> Any:
        if name in StepBatch.__slots__:  # not set yet (an object being unpickled): not found, not looked up again
            raise AttributeError(name)
        source = self.state if name in _STATE else self.record
        return getattr(source, name)

    # Pickled whole (a checkpoint keeps the rollout in progress): the slots, set as __init__ sets them.
    def __getstate__(self) -> tuple[RolloutBatch, StepState]:
        return self.record, self.state

    def __setstate__(self, state: tuple[RolloutBatch, StepState]) -> None:
        object.__setattr__(self, "record", state[0])
        object.__setattr__(self, "state", state[1])

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _STATE:
            raise AttributeError(
                f"{name!r} is a fact of the rollout, frozen once made; the step writes only {sorted(_STATE)}. "
                "For other facts, make a new batch: `batch.replaced(name=value)`."
            )
        setattr(self.state, name, value)

    def __len__(self) -> int:
        return len(self.record)

    def rows(self, index: slice) -> StepBatch:
        """The rows in ``index``, with their own state."""
        return StepBatch(self.record.rows(index), self.state.rows(index))

    def step_batches(self, rows_per_step: int) -> list[StepBatch]:
        """Cut into step batches of ``rows_per_step`` rows, each with its own state (and cache)."""
        return [self.rows(slice(start, start + rows_per_step)) for start in range(0, len(self), rows_per_step)]

    def replaced(self, **facts: Any) -> StepBatch:
        """This step batch with other rollout facts (a test's sampler log-probs, ...); the state is shared."""
        return StepBatch(self.record.replaced(**facts), self.state)

    def masks_without(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The completion mask and validity with only ``rows`` (bool; None: every row) kept. Rows left out count as
        invalid, all-masked members: each loss then gives them exactly 0 while keeping them (and their groups) in its
        averages, which is what their zero gradient contributes."""
        if rows is None:
            return self.record.completion_mask, self.record.valid
        return self.record.completion_mask * rows.unsqueeze(-1), self.record.valid & rows

    @classmethod
    def from_mapping(cls, inputs: Mapping[str, Any]) -> StepBatch:
        """A step batch from a dict keyed by the names it reads as (e.g. one built by hand for ``compute_loss``)."""
        facts = {name: inputs[name] for name in _RECORD if name in inputs}
        for prefix, name in _ALIGNED.items():
            facts[name] = {key[len(prefix) :]: value for key, value in inputs.items() if key.startswith(prefix)}
        batch = cls(RolloutBatch(**facts))
        for key, value in inputs.items():
            if key in _STATE or key in _CACHED:
                batch[key] = value
            elif key not in _RECORD and _aligned_prefix(key) is None:
                raise KeyError(f"{key!r} is not a rollout field; the fields are {sorted(_NAMES)}.")
        return batch

    # --- read like a dict under TRL's names; the step's state written the same way ---------------------------------
    def __getitem__(self, key: str) -> Any:
        value = self._lookup(key)
        if value is None:
            raise KeyError(key)
        return value

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _CACHED:
            setattr(self.state.cache, key, value)
        elif key in _STATE:
            setattr(self.state, key, value)
        elif key in _NAMES or _aligned_prefix(key) is not None:
            raise KeyError(
                f"{key!r} is a fact of the rollout, frozen once made: make a new batch, `batch.replaced({key}=...)`."
            )
        else:
            raise KeyError(f"{key!r} is not a rollout field; the fields are {sorted(_NAMES)}.")

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._lookup(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self._lookup(key)
        return default if value is None else value

    def keys(self) -> Iterator[str]:
        yield from (name for name in _NAMES_IN_ORDER if name in self)
        for prefix, field_name in _ALIGNED.items():
            yield from (prefix + name for name in getattr(self.record, field_name))

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((key, self[key]) for key in self.keys())

    def _lookup(self, key: str) -> Any:
        if key in _CACHED:
            return getattr(self.state.cache, key)
        if key in _STATE and key != "cache":
            return getattr(self.state, key)
        prefix = _aligned_prefix(key)
        if prefix is not None:
            return getattr(self.record, _ALIGNED[prefix]).get(key[len(prefix) :])
        if key in _RECORD and key not in _ALIGNED.values():
            return getattr(self.record, key)
        return None


def _aligned_prefix(key: str) -> str | None:
    """The per-token-extras prefix ``key`` starts with, if any."""
    return next((prefix for prefix in _ALIGNED if key.startswith(prefix)), None)


def _fields(record: Any) -> dict[str, Any]:
    """A dataclass's fields by name, not copied (``dataclasses.asdict`` would deep-copy the tensors)."""
    return {spec.name: getattr(record, spec.name) for spec in dataclasses.fields(record)}


def _values(cache: StepCache) -> list[Any]:
    return list(_fields(cache).values())


def _cut(value: Any, index: slice) -> Any:
    """A field's value for the rows in ``index``: tensors, per-row lists and dicts of per-row tensors are cut, a cache
    cut row by row; rollout-wide values are shared."""
    if torch.is_tensor(value) or isinstance(value, list):
        return value[index]
    if isinstance(value, dict):
        return {key: tensor[index] for key, tensor in value.items()}
    if isinstance(value, StepCache):
        return value.rows(index)
    return value


_RECORD = [spec.name for spec in dataclasses.fields(RolloutBatch)]
_STATE = {spec.name for spec in dataclasses.fields(StepState)}
_CACHED = {spec.name for spec in dataclasses.fields(StepCache)}
#: Every name a step batch reads as, in the order ``keys()`` gives them (the record's, the state's, the cache's).
_NAMES_IN_ORDER = [
    *(name for name in _RECORD if name not in _ALIGNED.values()),
    *(spec.name for spec in dataclasses.fields(StepState) if spec.name != "cache"),
    *sorted(_CACHED),
]
_NAMES = set(_NAMES_IN_ORDER)
