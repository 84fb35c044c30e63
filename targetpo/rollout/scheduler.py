"""When rollouts are made and with which weights: the rollout buffer and its reuse over step batches and iterations,
rollouts generated ahead (``async_rollouts``), the weight pushes to the rollout backend, and the backend's life.

The sampler repeats each process's rows of a rollout for every micro-step the rollout serves, tagging each repeat
with its use (``ROLLOUT_USE``): use 0 makes the rollout, and each use takes its step batch from the buffer. A sampler
that looks ahead also hands, at one use, the rows of the next rollout (``UPCOMING_ROW``), whose generation then
starts while this one trains.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..batch import StepBatch
from ..data import ROLLOUT_USE, ROW_INDEX, SAMPLER_TAGS, UPCOMING_ROW
from ..distributed import full_model_for_generation
from ..generation import (
    Completions,
    PendingCompletions,
    PromptImages,
    RolloutBackend,
    build_rollout_backend,
    close_at_exit,
)
from ..generation.base import check_takes_images

if TYPE_CHECKING:
    from ..episodes.async_runner import AsyncRunner
    from .context import RolloutContext
    from .sources import RolloutSource

#: ``make_rollout(rows, mode)``: generate, score and whiten one rollout of these dataset rows.
MakeRollout = Callable[[list[dict[str, Any]], str], StepBatch]


@dataclass
class UpcomingRollout:
    """The next rollout's prompts (and their images) and its generation under way."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    pending: PendingCompletions
    images: PromptImages | None = None

    def cancel(self) -> None:
        self.pending.cancel()


@dataclass
class EpisodesAhead:
    """The next rollout's episodes (turns and tool calls, or the user's loop) being played on a thread of their own,
    on this process's own connection to the backend: what they return, once played, or the error they raised."""

    indices: list[int]  # the dataset rows they are played for
    played: Future
    backend: RolloutBackend
    cancelled: threading.Event

    def cancel(self) -> None:
        self.cancelled.set()
        self.played.cancel()  # not started yet: never starts
        self.backend.cancel()  # under way: stops at its next generation (a tool call under way finishes first)


class RolloutScheduler:
    """The rollout buffer, rollouts generated ahead, weight pushes and the rollout backend of one trainer."""

    def __init__(
        self,
        context: RolloutContext,
        async_runner: AsyncRunner,
        make_rollout: MakeRollout,
        lookahead_use: int | None = None,
    ):
        self.context = context
        self.async_runner = async_runner
        self.make_rollout = make_rollout
        self.lookahead_use = lookahead_use  # the use at which the next rollout starts ahead (async_rollouts)
        self.source: RolloutSource | None = None  # where rollouts come from; set once the source is built
        self._backend: RolloutBackend | None = None  # the one rollouts use
        self.built_backend: RolloutBackend | None = None  # the one this scheduler built, and closes
        self._backend_closer: weakref.finalize | None = None  # closes the built one at `close()`, collection or exit
        self.weights_version: int | None = None  # the optimiser step whose weights the rollout backend holds
        self.upcoming: UpcomingRollout | EpisodesAhead | None = None  # the next rollout, under way (async_rollouts)
        self.buffer: list[StepBatch] | None = None  # the current rollout's step batches
        self.use = 0  # the current rollout's use the last step batch was handed out for
        self.rollout_indices: list[int] | None = None  # the dataset rows of the rollout being made (async_rollouts)
        self._episode_player: ThreadPoolExecutor | None = None  # plays episodes ahead, one rollout at a time
        self._this_thread = threading.local()  # the backend the episodes playing ahead generate with, on their thread

    # ------------------------------------------------------------------------------------------------ the backend
    @property
    def backend(self) -> RolloutBackend:
        """The backend rollouts use: built on first use (again after :meth:`close`). On the thread that plays
        episodes ahead, this process's own connection to it."""
        playing = getattr(self._this_thread, "backend", None)
        if playing is not None:
            return playing
        if self._backend is None:
            context, args = self.context, self.context.args
            max_model_len = None
            if context.max_prompt_tokens is not None:
                # Room for the longest prompt and completion, within what the model's positions allow.
                max_model_len = context.max_prompt_tokens + args.max_completion_length
            self._backend = self.built_backend = build_rollout_backend(
                args,
                context.accelerator,
                context.accelerator.unwrap_model(context.model()),
                context.sampling,
                _weak_method(self.generation_model),  # the backend, closed when the trainer goes, must not keep it
                context.sharded,
                max_model_len,
                context.processing_class,
            )
            # The finalizer holds the backend, not this scheduler: it runs at `close()`, when the scheduler (with its
            # trainer) is collected, or at the interpreter's exit, whichever comes first.
            self._backend_closer = weakref.finalize(self, close_at_exit, self.built_backend)
            self.weights_version = None
        return self._backend

    def use_backend(self, backend: RolloutBackend) -> None:
        """Generate with ``backend`` from now on; the built one stays open until :meth:`close`."""
        self._backend = backend
        self.weights_version = None

    def close(self) -> None:
        """Stop generating and close the backend this scheduler built (once)."""
        self.stop_generating()
        built, self.built_backend = self.built_backend, None
        closer, self._backend_closer = self._backend_closer, None
        if closer is not None and closer.detach() is not None:  # never closed again at exit
            built.close()
            self.weights_version = None  # a backend that wrapped it holds no weights now either
            if self._backend is built:
                self._backend = None

    def stop_generating(self) -> None:
        """Cancel a rollout generated ahead that nothing will use, and stop the tools' event loop."""
        if self.upcoming is not None:
            self.upcoming.cancel()
            self.upcoming = None
        if self._episode_player is not None:
            self._episode_player.shutdown(wait=True, cancel_futures=True)  # cancelled: it ends at its next generation
            self._episode_player = None
        self.async_runner.close()

    # ------------------------------------------------------------------------------------------------ weights
    def generation_model(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The policy as ``generate`` needs it: unwrapped from its engine, sharded weights gathered if so configured."""
        context = self.context
        # vLLM takes the full weights whatever the setting: they are gathered for the push.
        gather = context.args.ds3_gather_for_generation or context.args.use_vllm
        return full_model_for_generation(context.accelerator, context.engine_model(), gather)

    def forget_weights(self) -> None:
        """The policy's weights changed without an optimiser step (a new run, a loaded checkpoint): push them again."""
        self.weights_version = None

    def sync_weights(self) -> None:
        """Give the rollout backend the current weights, at most once per optimiser step, if it keeps its own."""
        backend, step = self.backend, self.context.global_step()
        if not backend.holds_weights or self.weights_version == step:
            return
        started = time.perf_counter()
        with self.generation_model() as model:
            backend.sync_weights(model, step)
        self.weights_version = step
        mode = "train" if self.context.training else "eval"
        self.context.metrics[mode]["rollout/weight_sync_seconds"].append(time.perf_counter() - started)

    def push_weights_while_generating(self) -> None:
        """After an optimiser step: a rollout being generated ahead goes on with the new weights at once."""
        if self.upcoming is not None:
            self.sync_weights()

    # ------------------------------------------------------------------------------------------------ rollouts
    def step_batch(self, rows: list[dict[str, Any]]) -> StepBatch:
        """The training step batch these tagged rows stand for: use 0 makes a new rollout (so does a resumed run, which
        may begin mid-rollout); uses cycle through the step batches, ``num_iterations`` times."""
        args = self.context.args
        use = self.use = rows[0][ROLLOUT_USE]
        upcoming = [row.get(UPCOMING_ROW) for row in rows]
        self.rollout_indices = [row.get(ROW_INDEX) for row in rows]
        if self.buffer is None or use == 0:
            rollout = self.make_rollout([_untagged(row) for row in rows], "train")
            self.buffer = rollout.step_batches(args.per_device_train_batch_size)
        if use == self.lookahead_use and upcoming[0] is not None:
            self.start_upcoming([row[ROW_INDEX] for row in upcoming], [_untagged(row) for row in upcoming])
        return self.buffer[use % args.steps_per_generation]

    def completions(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, mode: str, images: PromptImages | None = None
    ) -> Completions:
        """This rollout's completions: the ones generated ahead for these prompts (and images), or generated now."""
        context, backend = self.context, self.backend
        pending = self.take_upcoming(prompt_ids, prompt_mask, images) if mode == "train" else None
        if pending is None:
            self.sync_weights()  # collective where weights are gathered: outside the guarded block
        started = time.perf_counter()
        with context.guard("generating the completions", local=not backend.collective):
            if pending is None:
                pending = self.start_generating(prompt_ids, prompt_mask, images)
            completions = pending.result()
        context.metrics[mode]["rollout/generation_wait_seconds"].append(time.perf_counter() - started)
        self.record_staleness(completions, mode)
        return completions

    def record_staleness(self, completions: Completions, mode: str) -> None:
        """Optimiser steps between the weights of each completion's oldest token and the current ones (collective)."""
        context = self.context
        if completions.weight_versions is None:
            return
        known = completions.weight_versions >= 0
        staleness = context.accelerator.gather(
            torch.where(known, context.global_step() - completions.weight_versions, -1)
        )
        staleness = staleness[staleness >= 0].float()
        if staleness.numel() > 0:
            context.metrics[mode]["rollout/staleness_mean"].append(staleness.mean().item())
            context.metrics[mode]["rollout/staleness_max"].append(staleness.max().item())

    def start_upcoming(self, indices: list[int], rows: list[dict[str, Any]]) -> None:
        """Start the next rollout (async_rollouts) from the rows it will hold (``indices`` in the dataset): its
        generation, or its episodes, played ahead."""
        if self.upcoming is not None:  # a resumed run can meet a lookahead before using the previous one
            self.upcoming.cancel()
        self.sync_weights()
        if self.source.plays_episodes:
            self.upcoming = self.play_ahead(indices, rows)
            return
        prompts = self.context.prompt_encoder.encode(rows)
        pending = self.start_generating(prompts.ids, prompts.mask, prompts.images)
        self.upcoming = UpcomingRollout(prompts.ids, prompts.mask, pending, prompts.images)

    def check_plays_ahead(self) -> RolloutBackend:
        """This process's own connection to the backend, for episodes played ahead; refused where there is none."""
        backend = self.backend.for_this_process()
        if backend is None:
            raise ValueError(
                f"async_rollouts=True with tools, environments or rollout_func plays each rollout's episodes ahead on "
                f"every process's own connection to the rollout backend, which {type(self.backend).__name__} does not "
                "give (`for_this_process()` returns None). Generate on a vLLM server, or set async_rollouts=False."
            )
        return backend

    def play_ahead(self, indices: list[int], rows: list[dict[str, Any]]) -> EpisodesAhead:
        """Play the next rollout's episodes on a thread of their own, generating through this process's own
        connection to the backend; no collectives there (they would interleave with training's)."""
        backend = self.check_plays_ahead()
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())  # drawn here, on the training thread: from the run's seed
        if self._episode_player is None:
            self._episode_player = ThreadPoolExecutor(max_workers=1, thread_name_prefix="targetpo-episodes")
        source, cancelled = self.source, threading.Event()

        def play() -> Any:
            # Ready once the rollout before it (cancelled, maybe finishing a tool call) has left the thread.
            backend.start_playing(seed)
            if cancelled.is_set():  # cancelled while it was being readied
                backend.cancel()
            with self._generating_with(backend):
                return source.play_ahead(rows)

        return EpisodesAhead(indices, self._episode_player.submit(play), backend, cancelled)

    @contextlib.contextmanager
    def _generating_with(self, backend: RolloutBackend) -> Iterator[None]:
        self._this_thread.backend = backend
        try:
            yield
        finally:
            self._this_thread.backend = None

    def take_played(self) -> Any | None:
        """What the episodes played ahead returned, if they were played for exactly this rollout's rows on every
        process (collective); None if there are none (the rollout is played now). Their failure reaches every
        process."""
        upcoming, self.upcoming = self.upcoming, None
        if not isinstance(upcoming, EpisodesAhead):  # the same on every process
            return None
        context = self.context
        same = upcoming.indices == self.rollout_indices
        if not bool(context.accelerator.gather(torch.tensor([same], device=context.accelerator.device)).all()):
            upcoming.cancel()  # e.g. a run resumed mid-epoch: the rows it guessed are not the ones to train on
            return None
        played, lost = None, None
        with context.guard("playing the episodes ahead"):
            try:
                played = upcoming.played.result()
            except Exception as error:
                if not self.backend.recovers_from(error):
                    raise
                lost = error
        # Episodes lost with the server on any process are played again now, on every process, through the backend,
        # which waits for the server to come back.
        if bool(context.accelerator.gather(torch.tensor([lost is not None], device=context.accelerator.device)).any()):
            return None
        return played

    def start_generating(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, images: PromptImages | None
    ) -> PendingCompletions:
        backend = self.backend
        if images is None:  # a backend written for text prompts need not take images at all
            return backend.start(prompt_ids, prompt_mask)
        check_takes_images(backend)
        return backend.start(prompt_ids, prompt_mask, images=images)

    def take_upcoming(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, images: PromptImages | None
    ) -> PendingCompletions | None:
        """The rollout generated ahead, if it was made for exactly these prompts (and images) on every process."""
        upcoming, self.upcoming = self.upcoming, None
        if not isinstance(upcoming, UpcomingRollout):  # the same on every process: they start them together
            return None
        same = (
            upcoming.prompt_ids.shape == prompt_ids.shape
            and bool((upcoming.prompt_ids == prompt_ids).all() and (upcoming.prompt_mask == prompt_mask).all())
            and same_model_inputs(upcoming.images, images)
        )
        if bool(self.context.accelerator.gather(torch.tensor([same], device=prompt_ids.device)).all()):
            return upcoming.pending
        upcoming.pending.cancel()  # e.g. a run resumed mid-epoch: the prompts it guessed are not the ones to train on
        return None


def same_model_inputs(first: PromptImages | None, second: PromptImages | None) -> bool:
    """Whether two rollouts' prompts carry the same pixels (prompts of equal ids can hold other images)."""
    if first is None or second is None:
        return first is second
    one, other = first.model_inputs, second.model_inputs
    return one.keys() == other.keys() and all(
        one[key].shape == other[key].shape and torch.equal(one[key], other[key]) for key in one
    )


def _untagged(row: dict[str, Any]) -> dict[str, Any]:
    """A dataset row without the sampler's tags."""
    return {key: value for key, value in row.items() if key not in SAMPLER_TAGS}


def _weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, without keeping its object alive."""
    reference = weakref.WeakMethod(method)
    return lambda *args, **kwargs: reference()(*args, **kwargs)
