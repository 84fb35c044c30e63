"""The rollout interface: what every backend returns, and what every backend does.

A backend turns a step's left-padded prompts into :class:`Completions` and owns everything specific to it: how the
work is spread over the training processes, an engine's sleep and wake, keeping the engine's weights equal to the
policy's (:meth:`RolloutBackend.sync_weights`) and shutting the engine down. The trainer calls this interface only.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Completions:
    """Generated completions, right-padded to a common length ``C``.

    ``attention_mask`` covers each completion up to and including its first EOS; ``loss_mask`` marks, within it, the
    tokens the policy is trained on (the policy's own tokens: a tool's output inserted into a completion is in the
    attention mask but not in the loss mask). ``truncated`` marks completions that reached the length limit without
    an EOS. ``sampler_logps`` holds the sampling engine's own log-prob of each token when the engine reports them
    (vLLM), for the importance-sampling correction; ``weight_versions`` the optimiser step of the oldest weights that
    wrote any token of each completion, where the engine reports it (asynchronous rollouts).
    """

    ids: torch.Tensor  # (N, C) long
    attention_mask: torch.Tensor  # (N, C) long
    truncated: torch.Tensor  # (N,) bool
    loss_mask: torch.Tensor | None = None  # (N, C) long; None: the attention mask
    sampler_logps: torch.Tensor | None = None  # (N, C) float32, 0 past each completion's end
    weight_versions: torch.Tensor | None = None  # (N,) long
    extra: dict[str, list[Any]] = field(default_factory=dict)  # per-row fields handed to reward functions

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.attention_mask.clone()
        elif bool((self.loss_mask.bool() & ~self.attention_mask.bool()).any()):
            raise ValueError("A completion's loss mask may only cover tokens inside its attention mask.")

    @property
    def lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(dim=1)

    def padded_to_multiple(self, multiple: int, pad_token_id: int) -> Completions:
        """The same completions with ``C`` padded up to a multiple of ``multiple`` (padding is outside every mask)."""
        extra_columns = -self.ids.size(1) % multiple
        if extra_columns == 0:
            return self

        def pad(tensor: torch.Tensor | None, value: float) -> torch.Tensor | None:
            return None if tensor is None else nn.functional.pad(tensor, (0, extra_columns), value=value)

        return Completions(
            pad(self.ids, pad_token_id),
            pad(self.attention_mask, 0),
            self.truncated,
            pad(self.loss_mask, 0),
            pad(self.sampler_logps, 0.0),
            self.weight_versions,
            self.extra,
        )

    def rows(self, selection: slice) -> Completions:
        """The completions of ``selection`` (a process's share of a rollout)."""
        tensors = {
            name: None if value is None else value[selection]
            for name, value in (
                ("ids", self.ids),
                ("attention_mask", self.attention_mask),
                ("truncated", self.truncated),
                ("loss_mask", self.loss_mask),
                ("sampler_logps", self.sampler_logps),
                ("weight_versions", self.weight_versions),
            )
        }
        return Completions(**tensors, extra={key: values[selection] for key, values in self.extra.items()})


@dataclass
class PromptImages:
    """The images of a step's prompts, in the two forms backends take them.

    ``model_inputs`` are the processor's outputs for ``model.generate`` (the rows' pixel inputs concatenated, and the
    per-token extras of the left-padded prompts). An engine that runs the image processor itself (vLLM) takes each
    row's ``images`` with its ``unexpanded_ids``: the prompt as the tokenizer writes it, one placeholder per image,
    which the engine expands as the processor did (the expansion must give the row's prompt ids exactly). A row
    without images has an empty list and generates from its prompt ids.
    """

    model_inputs: dict[str, torch.Tensor]
    images: list[list[Any]]
    unexpanded_ids: list[list[int]]


def check_expanded_prompts(
    expected: Sequence[Sequence[int]], engine_ids: Sequence[Sequence[int] | None], with_images: Sequence[bool]
) -> None:
    """Refuse completions an engine sampled from other prompt tokens than the trainer's: an engine that expands image
    placeholders unlike the processor would have its completions trained against a prompt they never saw. Rows
    ``with_images`` are checked; the engine must report their expanded ids."""
    for row, (ours, theirs, has_images) in enumerate(zip(expected, engine_ids, with_images)):
        if not has_images:
            continue
        if theirs is None:
            raise ValueError(
                f"vLLM did not report the expanded ids of prompt {row}, which holds images, so they cannot be checked "
                "against the processor's: serve with a vLLM whose /inference/v1/generate answers `return_token_ids`."
            )
        if list(theirs) == list(ours):
            continue
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise ValueError(
            f"vLLM expanded the image placeholders of prompt {row} into other tokens than the processor did "
            f"({len(theirs)} tokens against {len(ours)}, first differing at position {first}): the completions "
            "would be trained against a prompt they were not sampled from. Give vLLM the same model and processor "
            "files as the trainer's processing_class."
        )


class PendingCompletions:
    """Completions being generated; :meth:`result` waits for them. Backends that cannot overlap generation with
    training return them already made."""

    def __init__(self, completions: Completions | None = None):
        self._completions = completions
        self.wait_seconds = 0.0  # how long :meth:`result` waited

    def result(self) -> Completions:
        assert self._completions is not None
        return self._completions

    def cancel(self) -> None:
        """Drop completions that will not be used."""


class RolloutBackend:
    """A way of producing rollouts; subclasses implement :meth:`generate` (or :meth:`start`).

    Attributes a backend sets:
        collective: every process must call :meth:`generate` together (it runs collectives itself), so the trainer
            cannot guard it per process; such a backend makes its own failures reach every process.
        holds_weights: it samples from weights of its own, which :meth:`sync_weights` keeps equal to the policy's.
        overlaps_training: :meth:`start` returns before the completions are made, so training can go on meanwhile.
        takes_images: :meth:`generate` and :meth:`start` take prompts with images (``images``).
        pads_rows_together: a call's rows run as one left-padded batch (``model.generate``), so every row's positions
            run on for the call's whole budget of new tokens, whatever room the row itself has.
    """

    collective: bool = False
    pads_rows_together: bool = False
    holds_weights: bool = False
    overlaps_training: bool = False
    takes_images: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> RolloutBackend:
        # Each default calls the other: a subclass with neither would recurse at its first rollout.
        if cls.generate is RolloutBackend.generate and cls.start is RolloutBackend.start:
            raise NotImplementedError(
                f"{cls.__qualname__} overrides neither `generate` nor `start`: a RolloutBackend must implement one "
                "of them (`generate` returns Completions, `start` returns PendingCompletions)."
            )
        return super().__new__(cls)

    def describe(self) -> str:
        """How this backend generates, in a few words (the block printed when training starts shows it)."""
        return type(self).__name__

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        max_new_tokens: int | None = None,
        images: PromptImages | None = None,
    ) -> Completions:
        """One completion per left-padded prompt row; rows that repeat a prompt give independent samples.

        ``max_new_tokens`` lowers the configured completion length for this call (a multi-turn rollout's later turns
        have less room left). ``images`` come with prompts that hold images (backends with ``takes_images``)."""
        # Passed only when given: a backend written for text prompts may override start without it.
        return self.start(
            prompt_ids, prompt_mask, max_new_tokens, **({} if images is None else {"images": images})
        ).result()

    def start(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        max_new_tokens: int | None = None,
        images: PromptImages | None = None,
    ) -> PendingCompletions:
        """Start generating; the default generates at once."""
        started = time.perf_counter()
        # A backend written for single-turn text rollouts may take neither: each is passed only when there is one.
        optional = {"max_new_tokens": max_new_tokens, "images": images}
        pending = PendingCompletions(
            self.generate(
                prompt_ids, prompt_mask, **{key: value for key, value in optional.items() if value is not None}
            )
        )
        pending.wait_seconds = time.perf_counter() - started
        return pending

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Keep the backend ready for several :meth:`generate` calls in a row (the turns of a multi-turn rollout):
        a backend that prepares for each call (wakes an engine, gathers sharded weights) does it once here, and may
        carry work from one call into the next (the transformers backend continues the KV cache of rows a call
        extends). Nothing else may change the weights meanwhile."""
        yield

    def for_this_process(self) -> RolloutBackend | None:
        """A backend this process alone generates with, from a thread of its own, beside training and the other
        processes (rollouts played ahead: ``async_rollouts`` with tools, environments or ``rollout_func``). It samples
        with this backend's weights, which :meth:`sync_weights` keeps pushing; None where every generation is made
        together by all processes or beside nothing."""
        return None

    def start_playing(self, seed: int) -> None:
        """A backend from :meth:`for_this_process`: ready for a new rollout's episodes, sampled from ``seed``."""

    def cancel(self) -> None:
        """A backend from :meth:`for_this_process`: stop generating; the call under way and every later one raise."""

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Give the engine the policy's current weights (``model`` holds them in full); ``version`` names them (the
        optimiser step). Called on every process, at most once per optimiser step, before the weights are needed."""

    def recovers_from(self, error: BaseException) -> bool:
        """Whether work lost with ``error`` (episodes played ahead on :meth:`for_this_process`) is done again, with
        this backend, rather than stopping training: a server that went away and may come back."""
        return False

    def close(self) -> None:
        """Release the engine, connections and helper processes."""


class PolicySessions:
    """For a backend that generates with the policy module itself (no engine, no weights of its own), opened by
    ``generation_model`` (unwrapped, sharded weights gathered): a :meth:`RolloutBackend.session` opens it once for all
    its calls, not once per call (per turn of a multi-turn rollout). List it before :class:`RolloutBackend`."""

    generation_model: Callable[[], contextlib.AbstractContextManager[nn.Module]]
    _session_model: nn.Module | None = None  # the policy opened for generation, during a session

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        if self._session_model is not None:
            yield
            return
        with self.generation_model() as model:
            self._session_model = model
            try:
                yield
            finally:
                self._session_model = None
                self._session_ended()

    def _session_ended(self) -> None:
        """Drop what the session's calls kept for each other: outside a session the weights may change."""

    def _opened_model(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The policy for one call: the session's, or opened for the call alone."""
        if self._session_model is not None:
            return contextlib.nullcontext(self._session_model)
        return self.generation_model()


def close_at_exit(backend: RolloutBackend) -> None:
    """Close ``backend`` from a finalizer (garbage collection, interpreter exit): a failure there is a warning, since
    nothing is left to raise it to."""
    try:
        backend.close()
    except Exception as error:  # noqa: BLE001
        warnings.warn(f"Closing the rollout backend {type(backend).__name__} failed: {error!r}", stacklevel=1)


def completion_masks(
    completion_ids: torch.Tensor, eos_token_ids: Sequence[int], lengths: torch.Tensor | None = None
) -> Completions:
    """Mask each completion up to and including its first EOS; one without EOS is truncated and kept whole.

    ``lengths`` gives each row's own token count when the rows are padded (padding may use an EOS id): tokens past
    it are never part of the completion.
    """
    width = completion_ids.size(1)
    positions = torch.arange(width, device=completion_ids.device).unsqueeze(0)
    if lengths is None:
        lengths = torch.full((completion_ids.size(0),), width, device=completion_ids.device)
    within = positions < lengths.to(completion_ids.device).unsqueeze(1)
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), device=completion_ids.device)) & within
    has_eos = is_eos.any(dim=1)
    end = torch.where(has_eos, is_eos.int().argmax(dim=1), lengths.to(completion_ids.device) - 1)
    attention_mask = (positions <= end.unsqueeze(1)).long()
    return Completions(ids=completion_ids, attention_mask=attention_mask, truncated=~has_eos)


def unpadded_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Each prompt's own token ids, without its padding, as engines that take token-id lists want them."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]


def pad_completions(
    token_ids: Sequence[Sequence[int]],
    token_logps: Sequence[Sequence[float]],
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    device: torch.device | str = "cpu",
    weight_versions: Sequence[int] | None = None,
) -> Completions:
    """Right-pad per-completion token ids and the engine's log-probs of them into :class:`Completions`."""
    width = max(1, max((len(ids) for ids in token_ids), default=1))
    ids = torch.full((len(token_ids), width), pad_token_id, dtype=torch.long)
    logps = torch.zeros((len(token_ids), width), dtype=torch.float32)
    for row, (row_ids, row_logps) in enumerate(zip(token_ids, token_logps)):
        ids[row, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        logps[row, : len(row_logps)] = torch.tensor(row_logps, dtype=torch.float32)
    lengths = torch.tensor([len(row) for row in token_ids], dtype=torch.long)
    completions = completion_masks(ids.to(device), eos_token_ids, lengths)
    completions.sampler_logps = logps.to(device) * completions.attention_mask
    if weight_versions is not None:
        completions.weight_versions = torch.tensor(list(weight_versions), dtype=torch.long, device=device)
    return completions


def check_takes_images(backend: RolloutBackend) -> None:
    """Refuse a backend that cannot generate from prompts with images."""
    if not getattr(backend, "takes_images", False):
        raise ValueError(
            f"The rollout backend {type(backend).__name__} does not take prompts with images (its `takes_images` is "
            "not True): generate with one that does (model.generate or vLLM), or give prompts without images."
        )
