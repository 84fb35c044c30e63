"""A rollout's prompts as the model reads them: rendered with the chat template, then tokenized (text) or encoded with
their images by the processor, left-padded and cut to the prompt limit.

:meth:`PromptEncoder.encode` is the one place that decides whether a rollout's prompts carry images.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..data import render_prompts
from ..generation import PromptImages
from ..modeling.loading import PromptLimit
from ..modeling.vision import (
    EncodedPrompts,
    encode_prompts_with_images,
    image_column,
    prompt_images,
    row_images,
    with_image_parts,
)

#: ``guard(what)``: a block whose failure on one process stops every process (``failures_reach_every_process``).
Guard = Callable[[str], contextlib.AbstractContextManager]
#: Each prompt's tool schemas (when each row's environment brings its own tools); None: the run's tools for all.
ToolsPerPrompt = Sequence[list[dict[str, Any]]] | None


@dataclass
class RolloutPrompts:
    """One process's prompts of a rollout, as generation and the training pass read them."""

    prompts: list[Any]  # as rendered: with image parts, or as the environments reset them
    ids: torch.Tensor  # (rows, prompt tokens), left-padded
    mask: torch.Tensor
    encoded: EncodedPrompts | None = None  # prompts with images: the processor's encoding (pixels, per-token extras)
    images: PromptImages | None = None  # prompts with images: the images as rollout backends take them


class PromptEncoder:
    """Renders, tokenizes and encodes prompts within the prompt limit, on this process's device."""

    def __init__(
        self,
        tokenizer: Any,
        processor: Any,
        tool_schemas: list[dict[str, Any]],
        chat_template_kwargs: dict[str, Any] | None,
        prompt_limit: PromptLimit,
        pad_token_id: int,
        device: torch.device,
        guard: Guard,
        images_allowed: bool,
    ):
        self.tokenizer, self.processor, self.tool_schemas = tokenizer, processor, tool_schemas
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.prompt_limit, self.max_tokens = prompt_limit, prompt_limit.tokens
        self.pad_token_id, self.device, self.guard, self.images_allowed = pad_token_id, device, guard, images_allowed

    def for_another_thread(self) -> PromptEncoder:
        """A copy to encode with on another thread: a tokenizer (and processor) of its own, since a fast tokenizer
        used from two threads at once can refuse ("Already borrowed"), and no guard (its collective must not run off
        the training thread)."""
        twin = copy.copy(self)
        if self.processor is not None:
            twin.processor = copy.deepcopy(self.processor)
            twin.tokenizer = getattr(twin.processor, "tokenizer", None) or copy.deepcopy(self.tokenizer)
        else:
            twin.tokenizer = copy.deepcopy(self.tokenizer)
        twin.guard = lambda what: contextlib.nullcontext()
        return twin

    def has_images(self, rows: list[dict[str, Any]]) -> bool:
        """Whether the rows' prompts are encoded with images (the run can train on them and the rows have some)."""
        return self.images_allowed and image_column(rows[0]) is not None

    def encode(
        self, rows: list[dict[str, Any]], prompts: list[Any] | None = None, tools: ToolsPerPrompt = None
    ) -> RolloutPrompts:
        """The rows' prompts (or ``prompts``, e.g. as environments reset them), with their images if they have some;
        ``tools``: each prompt's tool schemas (each row's environment), else the run's."""
        prompts = [row["prompt"] for row in rows] if prompts is None else prompts
        if self.has_images(rows):
            prompts, encoded, images = self.encode_with_images(rows, prompts, tools)
            return RolloutPrompts(prompts, encoded.ids, encoded.mask, encoded, images)
        with self.guard("tokenizing the prompts"):
            ids, mask = self.tokenize(prompts, tools)
        return RolloutPrompts(prompts, ids, mask)

    def tokenize(self, prompts: list[Any], tools: ToolsPerPrompt = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and mask; long prompts keep their last tokens (``max_prompt_length``, or fewer to
        leave the completion room within the model's positions). A group's repeats of its prompt (in a row) are
        rendered and tokenized once (at K = 32 on a GPU, tokenizing every repeat was 8 % of a small model's step)."""
        conversational = not isinstance(prompts[0], str)
        firsts, repeat_of = first_of_each_repeat(prompts, tools)
        texts = self.render([prompts[row] for row in firsts], None if tools is None else [tools[row] for row in firsts])
        encoded = self.tokenizer(
            text=texts,
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=not conversational,  # a chat template writes its own special tokens
        )
        repeats = torch.tensor(repeat_of)
        prompt_ids = encoded["input_ids"][repeats].to(self.device)
        prompt_mask = encoded["attention_mask"][repeats].to(self.device)
        if self.max_tokens is not None:
            cut = encoded["attention_mask"][:, : -self.max_tokens].any(dim=1)
            self.report_cut(texts, cut.tolist())
            prompt_ids = prompt_ids[:, -self.max_tokens :]
            prompt_mask = prompt_mask[:, -self.max_tokens :]
        return prompt_ids, prompt_mask

    def encode_with_images(
        self, rows: list[dict[str, Any]], prompts: list[Any] | None = None, tools: ToolsPerPrompt = None
    ) -> tuple[list[Any], EncodedPrompts, PromptImages]:
        """The rows' prompts (or ``prompts``) with their image parts, encoded with the rows' images by the processor,
        and the images as rollout backends take them."""
        prompts = [row["prompt"] for row in rows] if prompts is None else prompts
        with self.guard("encoding the prompts and their images"):
            images = [row_images(row) for row in rows]
            prompts = [
                with_image_parts(prompt, len(row_images_), index)
                for index, (prompt, row_images_) in enumerate(zip(prompts, images))
            ]
            texts = self.render(prompts, tools)
            encoded = encode_prompts_with_images(
                self.processor,
                texts,
                images,
                self.max_tokens,
                self.pad_token_id,
                plain=[isinstance(prompt, str) for prompt in prompts],
            ).to(self.device)
            if self.max_tokens is not None:  # rows with images are never cut (an error instead)
                cut = [
                    not row_images_ and len(ids) > self.max_tokens
                    for row_images_, ids in zip(images, encoded.unexpanded_ids)
                ]
                self.report_cut(texts, cut)
        return prompts, encoded, prompt_images(encoded, images)

    def report_cut(self, texts: list[str], cut: list[bool]) -> None:
        """Warn once when prompts were cut to the limit, counting distinct prompts (a group repeats its prompt)."""
        self.prompt_limit.report_cut(len({text for text, was_cut in zip(texts, cut) if was_cut}), len(set(texts)))

    def render(self, prompts: list[Any], tools: ToolsPerPrompt = None) -> list[str]:
        """The prompts as text: conversations through the chat template (with each prompt's tools, or the run's),
        strings as they are."""
        renderer, settings = self.processor or self.tokenizer, self.chat_template_kwargs
        if tools is None:
            return render_prompts(prompts, renderer, self.tool_schemas, **settings)
        return [render_prompts([prompt], renderer, schemas, **settings)[0] for prompt, schemas in zip(prompts, tools)]


def first_of_each_repeat(prompts: list[Any], tools: ToolsPerPrompt = None) -> tuple[list[int], list[int]]:
    """Where each run of equal prompts (with equal tools) starts, and for each prompt the number of its run: a group
    repeats its prompt in a row, so the runs are the distinct prompts of a rollout."""
    firsts, repeat_of = [], []
    for row, prompt in enumerate(prompts):
        repeated = row > 0 and prompt == prompts[row - 1] and (tools is None or tools[row] == tools[row - 1])
        if not repeated:
            firsts.append(row)
        repeat_of.append(len(firsts) - 1)
    return firsts, repeat_of
