"""Where a rollout's completions come from, behind one interface: the rollout backend generating from text prompts or
prompts with images (:class:`GeneratedRollouts`), a multi-turn loop calling tools or environments
(:class:`ToolRollouts`), or the user's ``rollout_func`` (:class:`FunctionRollouts`). Each gives the same
:class:`SourcedRollout`; :func:`rollout_source` picks one when the trainer is built.

What one process can fail at alone (a bad prompt, generation running out of memory, a rollout_func raising) runs in
guarded blocks, so that the failure stops every process before the next gather. Collective generation (a vLLM
server, sharded weights) runs collectives itself, which every process must reach: it is not guarded.

Episodes (tools, environments, ``rollout_func``) can also be played ahead, on a thread of their own while training
goes on (``async_rollouts``): :class:`Player` says what they are played with, and the training thread reads what was
played (:meth:`EpisodeRollouts.finish`), where failures and metrics reach every process.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..episodes.environments import AHEAD, NOW
from ..episodes.multi_turn import MultiTurnRollout, ToolLoop, custom_rollout_completions, left_pad
from ..generation import Completions, PromptImages, unpadded_prompts
from ..generation.base import check_takes_images
from ..modeling.loading import max_positions
from ..modeling.vision import (
    EncodedPrompts,
    ImagesAfterPrompt,
    collate_pixel_inputs,
    prompt_images,
    row_images,
    with_image_objects,
)
from ..rewards import REWARD_ARGUMENTS
from .prompts import PromptEncoder, RolloutPrompts

if TYPE_CHECKING:
    from .context import RolloutContext, RolloutService


@dataclass
class SourcedRollout:
    """One process's prompts and completions of a rollout, with what the reward functions and the training pass need
    beside them."""

    prompts: list[Any]  # as the model saw them (with image parts, or as the environments reset them)
    prompt_ids: torch.Tensor  # (rows, prompt tokens), left-padded
    prompt_mask: torch.Tensor
    completions: Completions
    conversations: list[list[dict[str, Any]]] | None = None  # multi-turn: each sample's whole conversation
    columns: dict[str, list[Any]] = field(default_factory=dict)  # reward-function arguments beside the prompts
    pixel_inputs: list[Any] | None = None  # prompts (or tool results) with images: each row's per-image model inputs
    token_aligned: dict[str, torch.Tensor] = field(default_factory=dict)  # and the prompts' per-token extras
    completion_aligned: dict[str, torch.Tensor] = field(default_factory=dict)  # the tool images' per-token extras
    tools: list[list[dict[str, Any]]] | None = None  # each prompt's tool schemas, where each sample has its own

    def with_images_of(self, encoded: EncodedPrompts | None) -> SourcedRollout:
        """This rollout with the pixel inputs and per-token extras of prompts encoded with their images."""
        if encoded is None:
            return self
        return dataclasses.replace(self, pixel_inputs=encoded.pixel_inputs, token_aligned=encoded.token_aligned)

    def padded_to_multiple(self, multiple: int, pad_id: int) -> SourcedRollout:
        """Prompts (left) and completions (right) padded to lengths that are multiples of ``multiple``."""
        extra_columns = -self.prompt_ids.size(1) % multiple
        completions = self.completions.padded_to_multiple(multiple, pad_id)
        return dataclasses.replace(
            self,
            prompt_ids=nn.functional.pad(self.prompt_ids, (extra_columns, 0), value=pad_id),
            prompt_mask=nn.functional.pad(self.prompt_mask, (extra_columns, 0), value=0),
            token_aligned={
                key: nn.functional.pad(value, (extra_columns, 0)) for key, value in self.token_aligned.items()
            },
            completions=completions,
            completion_aligned={
                key: nn.functional.pad(value, (0, completions.ids.size(1) - value.size(1)))
                for key, value in self.completion_aligned.items()
            },
        )


class RolloutSource(ABC):
    """Makes one process's prompts and completions of a rollout from its dataset rows."""

    #: Whether a rollout is a loop of turns (tools, environments, ``rollout_func``), which ``async_rollouts`` plays
    #: ahead on a thread of its own (:meth:`play_ahead`) rather than only generating ahead.
    plays_episodes = False

    def __init__(self, context: RolloutContext, scheduler: RolloutService):
        self.context, self.scheduler = context, scheduler

    def collect(self, rows: list[dict[str, Any]], mode: str) -> SourcedRollout:
        """The rollout of ``rows``: its completions, the rows' other columns for the rewards, padded as configured."""
        rows = own_copies(rows)
        rollout = self.generate(rows, mode)
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        rollout.columns = {**columns, **rollout.columns}
        multiple = self.context.args.pad_to_multiple_of
        if multiple is not None:
            rollout = rollout.padded_to_multiple(multiple, self.context.sampling.pad_token_id)
        return rollout

    @abstractmethod
    def generate(self, rows: list[dict[str, Any]], mode: str) -> SourcedRollout:
        """Prompts and completions of ``rows``; ``columns`` holds only what the source adds to the rows' own."""

    def play_ahead(self, rows: list[dict[str, Any]]) -> Any:
        """Play the episodes of ``rows`` on the calling thread, beside training: no collectives."""
        raise NotImplementedError(f"{type(self).__name__} does not play episodes.")


class GeneratedRollouts(RolloutSource):
    """The rollout backend completes each prompt (text, or with its images) once."""

    def generate(self, rows: list[dict[str, Any]], mode: str) -> SourcedRollout:
        prompts = self.context.prompt_encoder.encode(rows)
        completions = self.scheduler.completions(prompts.ids, prompts.mask, mode, prompts.images)
        return SourcedRollout(prompts.prompts, prompts.ids, prompts.mask, completions).with_images_of(prompts.encoded)


def own_copies(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A deep copy of each row, one per sample, made once a rollout: the K samples of a prompt are served the same
    row (a list of dicts or a torch Dataset hands out its own objects at every read, and a rollout's later uses are
    given the rows its first use read), so an environment or reward function that changed a row value in place (a
    board: a list of lists) would change its siblings' and the dataset's, for every later epoch.

    The images of the row's image column stay shared: they are only read, and copying one costs milliseconds."""
    return [_own_copy(row) for row in rows]  # each on its own: one deepcopy of the list would keep them shared


def _own_copy(row: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``row`` but its images; a value that cannot be copied (a lock, an open file) is shared, with a
    warning naming its column."""
    memo: dict[int, Any] = {id(image): image for image in row_images(row)}
    copied = {}
    for column, value in row.items():
        try:
            copied[column] = copy.deepcopy(value, memo)
        except Exception as error:  # noqa: BLE001 - whatever deepcopy raises, the value is shared as it is
            warnings.warn(
                f"The dataset column {column!r} holds a value that cannot be deep-copied ({type(error).__name__}: "
                f"{error}): the samples of a prompt share it, so one that changes it changes it for the others.",
                stacklevel=2,
            )
            copied[column] = value
    return copied


#: ``guard(what, local)``: the context's guard on the training thread, or nothing on a thread playing ahead.
PlayGuard = Callable[..., contextlib.AbstractContextManager]


@dataclass
class Player:
    """What a rollout's episodes are played with: on the training thread, the trainer's own parts (failures reach
    every process, a collective backend generates with all of them); ahead of time, on a thread of their own, copies
    that share nothing the training thread uses (a tokenizer of their own, the environments of the other lane, this
    process's own connection to the backend) and no guards (no collectives off the training thread)."""

    guard: PlayGuard
    encoder: PromptEncoder
    tool_loop: ToolLoop | None
    lane: str  # which environments (NOW or AHEAD)
    ahead: bool


def _unguarded(what: str, local: bool = True) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class EpisodeRollouts(RolloutSource):
    """A source whose rollouts are episodes, several turns each: played now on the training thread, or, with
    ``async_rollouts``, taken as they were played ahead (:meth:`RolloutScheduler.play_ahead`)."""

    plays_episodes = True

    def __init__(self, context: RolloutContext, scheduler: RolloutService):
        super().__init__(context, scheduler)
        self._ahead_player: Player | None = None

    def generate(self, rows: list[dict[str, Any]], mode: str) -> SourcedRollout:
        context, scheduler = self.context, self.scheduler
        started = time.perf_counter()
        played = scheduler.take_played() if mode == "train" else None
        if played is None:
            scheduler.sync_weights()  # collective where weights are gathered: outside the guarded blocks
            started = time.perf_counter()  # the wait for the episodes, not for the weight push
            now = Player(context.guard, context.prompt_encoder, context.tool_loop, NOW, False)
            played = self.play(rows, now)
        context.metrics[mode]["rollout/generation_wait_seconds"].append(time.perf_counter() - started)
        sourced = self.finish(played, mode)
        scheduler.record_staleness(sourced.completions, mode)
        return sourced

    def play_ahead(self, rows: list[dict[str, Any]]) -> Any:
        if self._ahead_player is None:  # made once: one thread plays ahead, one rollout at a time
            context = self.context
            tool_loop = context.tool_loop.for_another_thread() if context.tool_loop is not None else None
            encoder = context.prompt_encoder.for_another_thread()
            self._ahead_player = Player(_unguarded, encoder, tool_loop, AHEAD, True)
        return self.play(own_copies(rows), self._ahead_player)

    @abstractmethod
    def play(self, rows: list[dict[str, Any]], player: Player) -> Any:
        """The episodes of ``rows``, as :meth:`finish` reads them."""

    @abstractmethod
    def finish(self, played: Any, mode: str) -> SourcedRollout:
        """The rollout of played episodes, on the training thread (its metrics are gathered from every process)."""


@dataclass
class PlayedConversations:
    """Tool-calling episodes as played: the prompts as encoded, the rollout, each sample's environment and tools."""

    encoded: RolloutPrompts
    rollout: MultiTurnRollout
    environments: list[Any] | None
    tools: list[list[dict[str, Any]]]


class ToolRollouts(EpisodeRollouts):
    """Each sample calls tools (or its environment's methods) over several turns of generation."""

    def play(self, rows: list[dict[str, Any]], player: Player) -> PlayedConversations:
        context = self.context
        environments = None
        if context.environments is None:
            prompts, toolboxes = [row["prompt"] for row in rows], [context.episodes.toolbox] * len(rows)
        else:  # each environment's reset() adds to its row's prompt (or makes it up, for a row without one)
            with player.guard("starting the environments"):
                environments, prompts, toolboxes = context.environments.start(rows, player.lane)
        tools = [toolbox.schemas for toolbox in toolboxes]  # each row's environment shows its own tools
        encoded = player.encoder.encode(rows, prompts, tools)
        backend = self.scheduler.backend
        images_of_turn = None
        if encoded.images is not None:
            check_takes_images(backend)
            images_of_turn = _images_of_turn(encoded.encoded, encoded.images.images, backend)
        elif player.tool_loop.processor is not None:  # text prompts: tool results may bring the first images
            without = EncodedPrompts.without_images(encoded.ids, encoded.mask)
            images_of_turn = _images_of_turn(without, [[] for _ in rows], backend, prompts_have_images=False)
        # A collective backend needs every process to generate each turn: they agree on whether any still has one.
        agree = self._any_process if backend.collective else None
        with player.guard("generating the multi-turn completions", local=not backend.collective):
            rollout = player.tool_loop.run(backend, encoded.ids, encoded.mask, toolboxes, agree, images_of_turn)
        return PlayedConversations(encoded, rollout, environments, tools)

    def finish(self, played: PlayedConversations, mode: str) -> SourcedRollout:
        encoded, rollout = played.encoded, played.rollout
        self._record_tool_metrics(rollout, mode, encoded.ids.device)
        columns = {}
        if played.environments is not None:
            columns["environments"] = played.environments
            self.context.environments.latest = played.environments  # what `trainer.environments` shows
        sourced = SourcedRollout(
            encoded.prompts,
            encoded.ids,
            encoded.mask,
            rollout.completions,
            rollout.conversations,
            columns,
            tools=played.tools,
        ).with_images_of(encoded.encoded)
        return _with_tool_images(sourced, rollout.images, rollout.completion_aligned)

    def _record_tool_metrics(self, rollout: MultiTurnRollout, mode: str, device: torch.device) -> None:
        metrics = self.context.metrics[mode]
        calls, failures, turns = (
            self.context.accelerator.gather(torch.tensor(values, dtype=torch.float32, device=device))
            for values in (rollout.tool_calls, rollout.tool_failures, rollout.turns)
        )
        metrics["tools/call_frequency"].append(calls.mean().item())
        metrics["tools/failure_frequency"].append((failures.sum() / calls.sum().clamp(min=1)).item())
        metrics["multi_turn/turns_per_sample"].append(turns.mean().item())

    def _any_process(self, active: bool) -> bool:
        accelerator = self.context.accelerator
        return bool(accelerator.gather(torch.tensor([active], device=accelerator.device)).any())


def _images_of_turn(
    encoded: EncodedPrompts, images: list[list[Any]], backend: Any, prompts_have_images: bool = True
) -> Any:
    """The images of the samples still generating (their prompts', then their tool results'), as each turn's backend
    call takes them; for text prompts, None until a tool result brings an image."""

    def images_of_turn(
        active: list[int], contexts: list[list[int]], after: list[ImagesAfterPrompt]
    ) -> PromptImages | None:
        if not prompts_have_images:
            if not any(later.images for later in after):
                return None
            check_takes_images(backend)
        return prompt_images(encoded, images, active, contexts, after)

    return images_of_turn


def _with_tool_images(
    sourced: SourcedRollout, images: list[ImagesAfterPrompt] | None, completion_aligned: dict[str, torch.Tensor]
) -> SourcedRollout:
    """The rollout with each row's pixel inputs covering its tool results' images after its prompt's (the order the
    model meets their tokens in), and their per-token extras over the completions."""
    if images is None:
        return sourced
    prompt_pixels = sourced.pixel_inputs or [{} for _ in images]
    pixel_inputs = [collate_pixel_inputs([prompt, *later.pixel_inputs]) for prompt, later in zip(prompt_pixels, images)]
    return dataclasses.replace(sourced, pixel_inputs=pixel_inputs, completion_aligned=completion_aligned)


@dataclass
class PlayedFunction:
    """What ``rollout_func`` returned for a rollout, read and checked: the prompts as the model saw them and as
    token ids, the completions, the extra fields, and the prompts' encoding with their images."""

    prompts: list[Any]
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completions: Completions
    columns: dict[str, list[Any]]
    encoded: EncodedPrompts | None = None


class FunctionRollouts(EpisodeRollouts):
    """The user's ``rollout_func(prompts, trainer)`` makes the completions; its extra fields become reward columns."""

    def play(self, rows: list[dict[str, Any]], player: Player) -> PlayedFunction:
        if not player.encoder.has_images(rows):
            prompts = [row["prompt"] for row in rows]
            return PlayedFunction(prompts, *self._run(prompts, player))
        encoded = player.encoder.encode(rows)
        # The function gets each prompt's image parts holding the images themselves.
        with_images = [with_image_objects(prompt, row) for prompt, row in zip(encoded.prompts, encoded.images.images)]
        prompt_ids, prompt_mask, completions, columns = self._run(with_images, player)
        with player.guard("reading rollout_func's result"):
            _check_rollout_func_prompts(encoded.encoded, prompt_ids, prompt_mask)
        return PlayedFunction(encoded.prompts, prompt_ids, prompt_mask, completions, columns, encoded.encoded)

    def finish(self, played: PlayedFunction, mode: str) -> SourcedRollout:
        sourced = SourcedRollout(
            played.prompts, played.prompt_ids, played.prompt_mask, played.completions, columns=played.columns
        )
        return sourced.with_images_of(played.encoded)

    def _run(self, prompts: list[Any], player: Player) -> tuple[torch.Tensor, torch.Tensor, Completions, dict]:
        """Run ``rollout_func`` and check its result: prompt ids and mask, completions, extra fields."""
        context = self.context
        backend = self.scheduler.backend
        # The function may generate with a collective backend itself, which a failure must not leave waiting.
        with player.guard("running rollout_func", local=not backend.collective):
            result = context.run_rollout_func(copy.deepcopy(prompts))
        with player.guard("reading rollout_func's result"):
            prompt_lists, completions, extra = custom_rollout_completions(
                result,
                len(prompts),
                context.sampling.eos_token_ids,
                context.sampling.pad_token_id,
                context.vocab_size,
                context.accelerator.device,
                max_positions(context.accelerator.unwrap_model(context.model())),
            )
            clashes = (REWARD_ARGUMENTS | {"prompt"}) & set(extra)
            if clashes:
                raise ValueError(
                    f"rollout_func returned extra field(s) {sorted(clashes)}, which are reward-function arguments "
                    "already: rename them."
                )
        prompt_ids, prompt_mask = left_pad(prompt_lists, context.sampling.pad_token_id, context.accelerator.device)
        return prompt_ids, prompt_mask, completions, extra


def rollout_source(context: RolloutContext, scheduler: RolloutService) -> RolloutSource:
    """The source the run asks for: ``rollout_func``, else tools or environments, else generation."""
    if context.run_rollout_func is not None:
        return FunctionRollouts(context, scheduler)
    if context.tool_loop is not None:
        return ToolRollouts(context, scheduler)
    return GeneratedRollouts(context, scheduler)


def _check_rollout_func_prompts(encoded: EncodedPrompts, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
    """The training pass reads each prompt's pixels beside the prompt ids: those a rollout_func returns must be the
    processor's encoding of the prompt with its images, image tokens expanded."""
    expected, returned = unpadded_prompts(encoded.ids, encoded.mask), unpadded_prompts(prompt_ids, prompt_mask)
    for row, (ours, theirs) in enumerate(zip(expected, returned)):
        if ours == theirs:
            continue
        was_cut = len(encoded.unexpanded_ids[row]) > len(ours)  # a row without images: its ids, before the cut
        if not encoded.pixel_inputs[row] and was_cut and theirs[-len(ours) :] == ours:
            raise ValueError(
                f"rollout_func returned prompt_ids for prompt {row} (no images) {len(theirs)} tokens long, more than "
                f"the {len(ours)} prompt tokens allowed (max_prompt_length, or what the model's positions leave beside "
                "max_completion_length). In a batch with images every prompt's ids must be the processor's encoding, "
                f"which keeps a longer prompt's last tokens: return its last {len(ours)} tokens, or raise "
                "max_prompt_length."
            )
        raise ValueError(
            f"rollout_func returned prompt_ids for prompt {row} ({len(theirs)} tokens) that are not the processor's "
            f"encoding of that prompt with its images ({len(ours)} tokens, image placeholders expanded), which the "
            "training pass reads the pixels against. Return the ids the engine reports after expanding the images "
            "(vLLM: `output.prompt_token_ids`), or `processor(text=..., images=...)['input_ids']` of the prompt "
            "rendered with `processor.apply_chat_template`."
        )
