"""Where a rollout's completions come from, behind one interface: the rollout backend generating from text prompts or
prompts with images (:class:`GeneratedRollouts`), a multi-turn loop calling tools or environments
(:class:`ToolRollouts`), or the user's ``rollout_func`` (:class:`FunctionRollouts`). Each gives the same
:class:`SourcedRollout`; :func:`rollout_source` picks one when the trainer is built.

What one process can fail at alone (a bad prompt, generation running out of memory, a rollout_func raising) runs in
guarded blocks, so that the failure stops every process before the next gather. Collective generation (a vLLM
server, sharded weights) runs collectives itself, which every process must reach: it is not guarded.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..generation import Completions, PromptImages, unpadded_prompts
from ..modeling.loading import max_positions
from ..multi_turn import custom_rollout_completions, left_pad
from ..rewards import REWARD_ARGUMENTS
from ..vision import EncodedPrompts, ImagesAfterPrompt, collate_pixel_inputs, prompt_images, with_image_objects
from .scheduler import check_takes_images

if TYPE_CHECKING:
    from ..trainer import TargetPOTrainer


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

    def __init__(self, trainer: TargetPOTrainer):
        self.trainer = trainer

    def collect(self, rows: list[dict[str, Any]], mode: str) -> SourcedRollout:
        """The rollout of ``rows``: its completions, the rows' other columns for the rewards, padded as configured."""
        rollout = self.generate(rows, mode)
        columns = {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}
        rollout.columns = {**columns, **rollout.columns}
        multiple = self.trainer.args.pad_to_multiple_of
        if multiple is not None:
            rollout = rollout.padded_to_multiple(multiple, self.trainer.sampling.pad_token_id)
        return rollout

    @abstractmethod
    def generate(self, rows: list[dict[str, Any]], mode: str) -> SourcedRollout:
        """Prompts and completions of ``rows``; ``columns`` holds only what the source adds to the rows' own."""


class GeneratedRollouts(RolloutSource):
    """The rollout backend completes each prompt (text, or with its images) once."""

    def generate(self, rows: list[dict[str, Any]], mode: str) -> SourcedRollout:
        prompts = self.trainer._prompt_encoder.encode(rows)
        completions = self.trainer._scheduler.completions(prompts.ids, prompts.mask, mode, prompts.images)
        return SourcedRollout(prompts.prompts, prompts.ids, prompts.mask, completions).with_images_of(prompts.encoded)


class ToolRollouts(RolloutSource):
    """Each sample calls tools (or its environment's methods) over several turns of generation."""

    def generate(self, rows: list[dict[str, Any]], mode: str) -> SourcedRollout:
        trainer = self.trainer
        prompts = [row["prompt"] for row in rows]
        environments = None
        toolboxes = [trainer._toolbox] * len(rows)
        with trainer._failures_reach_every_process("starting the environments"):
            if trainer._environments is not None:
                environments, prompts, toolboxes = trainer._environments.start(rows)
        tools = [toolbox.schemas for toolbox in toolboxes]  # each row's environment shows its own tools
        encoded = trainer._prompt_encoder.encode(rows, prompts, tools)
        backend = trainer._scheduler.backend
        images_of_turn = None
        if encoded.images is not None:
            check_takes_images(backend)
            images_of_turn = _images_of_turn(encoded.encoded, encoded.images.images, backend)
        elif trainer._tool_loop.processor is not None:  # text prompts: tool results may bring the first images
            without = EncodedPrompts.without_images(encoded.ids, encoded.mask)
            images_of_turn = _images_of_turn(without, [[] for _ in rows], backend, prompts_have_images=False)
        trainer._scheduler.sync_weights()  # collective where weights are gathered: outside the guarded block
        started = time.perf_counter()
        # A collective backend needs every process to generate each turn: they agree on whether any still has one.
        agree = self._any_process if backend.collective else None
        what = "generating the multi-turn completions"
        with trainer._failures_reach_every_process(what, local=not backend.collective):
            rollout = trainer._tool_loop.run(backend, encoded.ids, encoded.mask, toolboxes, agree, images_of_turn)
        self._record_tool_metrics(rollout, mode, time.perf_counter() - started, encoded.ids.device)
        columns = {"environments": environments} if environments is not None else {}
        sourced = SourcedRollout(
            encoded.prompts, encoded.ids, encoded.mask, rollout.completions, rollout.conversations, columns, tools=tools
        ).with_images_of(encoded.encoded)
        return _with_tool_images(sourced, rollout.images, rollout.completion_aligned)

    def _record_tool_metrics(self, rollout: Any, mode: str, waited: float, device: torch.device) -> None:
        metrics = self.trainer._metrics[mode]
        metrics["rollout/generation_wait_seconds"].append(waited)
        calls, failures, turns = (
            self.trainer.accelerator.gather(torch.tensor(values, dtype=torch.float32, device=device))
            for values in (rollout.tool_calls, rollout.tool_failures, rollout.turns)
        )
        metrics["tools/call_frequency"].append(calls.mean().item())
        metrics["tools/failure_frequency"].append((failures.sum() / calls.sum().clamp(min=1)).item())
        metrics["multi_turn/turns_per_sample"].append(turns.mean().item())

    def _any_process(self, active: bool) -> bool:
        accelerator = self.trainer.accelerator
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


class FunctionRollouts(RolloutSource):
    """The user's ``rollout_func(prompts, trainer)`` makes the completions; its extra fields become reward columns."""

    def generate(self, rows: list[dict[str, Any]], mode: str) -> SourcedRollout:
        trainer = self.trainer
        if not trainer._prompt_encoder.has_images(rows):
            prompts = [row["prompt"] for row in rows]
            prompt_ids, prompt_mask, completions, columns = self._run(prompts, mode)
            return SourcedRollout(prompts, prompt_ids, prompt_mask, completions, columns=columns)
        encoded = trainer._prompt_encoder.encode(rows)
        # The function gets each prompt's image parts holding the images themselves.
        with_images = [with_image_objects(prompt, row) for prompt, row in zip(encoded.prompts, encoded.images.images)]
        prompt_ids, prompt_mask, completions, columns = self._run(with_images, mode)
        with trainer._failures_reach_every_process("reading rollout_func's result"):
            _check_rollout_func_prompts(encoded.encoded, prompt_ids, prompt_mask)
        sourced = SourcedRollout(encoded.prompts, prompt_ids, prompt_mask, completions, columns=columns)
        return sourced.with_images_of(encoded.encoded)

    def _run(self, prompts: list[Any], mode: str) -> tuple[torch.Tensor, torch.Tensor, Completions, dict]:
        """Run ``rollout_func`` and check its result: prompt ids and mask, completions, extra fields."""
        trainer = self.trainer
        trainer._scheduler.sync_weights()
        backend = trainer._scheduler.backend
        # The function may generate with a collective backend itself, which a failure must not leave waiting.
        started = time.perf_counter()
        with trainer._failures_reach_every_process("running rollout_func", local=not backend.collective):
            result = trainer.rollout_func(copy.deepcopy(prompts), trainer)
        trainer._metrics[mode]["rollout/generation_wait_seconds"].append(time.perf_counter() - started)
        with trainer._failures_reach_every_process("reading rollout_func's result"):
            prompt_lists, completions, extra = custom_rollout_completions(
                result,
                len(prompts),
                trainer.sampling.eos_token_ids,
                trainer.sampling.pad_token_id,
                trainer._vocab_size,
                trainer.accelerator.device,
                max_positions(trainer.accelerator.unwrap_model(trainer.model)),
            )
            clashes = (REWARD_ARGUMENTS | {"prompt"}) & set(extra)
            if clashes:
                raise ValueError(
                    f"rollout_func returned extra field(s) {sorted(clashes)}, which are reward-function arguments "
                    "already: rename them."
                )
        prompt_ids, prompt_mask = left_pad(prompt_lists, trainer.sampling.pad_token_id, trainer.accelerator.device)
        return prompt_ids, prompt_mask, completions, extra


def rollout_source(trainer: TargetPOTrainer) -> RolloutSource:
    """The source the trainer's arguments ask for: ``rollout_func``, else tools or environments, else generation."""
    if trainer.rollout_func is not None:
        return FunctionRollouts(trainer)
    if trainer._tool_loop is not None:
        return ToolRollouts(trainer)
    return GeneratedRollouts(trainer)


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
