"""Vision-language prompts: a row's images, image parts in its messages, and the pixel inputs of each row; the images
tool results bring into a sample after its prompt.

A prompt with images is encoded one row at a time by the model's processor, so that every row keeps its own pixel
inputs and a batch of any rows (a training step's, the rows left after skipping) can be put together again by
:func:`collate_pixel_inputs`. Processor outputs come in two kinds: per-token ones, aligned with the prompt's ids
(``token_type_ids``, ``mm_token_type_ids``), which are padded and cut like the ids, and per-image ones
(``pixel_values``, ``image_grid_thw``, ``image_sizes``, ``pixel_attention_mask``, ...), which the model matches to the
image tokens in order, so rows' tensors are concatenated along their first dimension.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import ProcessorMixin

if TYPE_CHECKING:
    from ..generation.base import PromptImages

#: Columns that hold a row's images: ``images`` (a list) or ``image`` (one), as in TRL's vision datasets.
IMAGE_COLUMNS = ("images", "image")
#: Per-image inputs from which a model numbers positions itself (multimodal rotary positions, Qwen2-VL's family).
SELF_POSITIONED_KEYS = ("image_grid_thw", "video_grid_thw")


#: Config attributes naming the tokens that stand for an image's (or a video's) features in the text.
PLACEHOLDER_TOKEN_ATTRIBUTES = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def placeholder_token_ids(model: Any) -> set[int]:
    """The tokens a vision-language model replaces with image or video features. A completion must never hold one:
    the next forward pass would find more placeholders than images and fail, so generation suppresses them."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is None:
        return set()
    ids = (getattr(config, attribute, None) for attribute in PLACEHOLDER_TOKEN_ATTRIBUTES)
    return {int(token) for token in ids if isinstance(token, int)}


def is_processor(processing_class: Any) -> bool:
    """Whether ``processing_class`` is a multimodal processor (wrapping a tokenizer and an image processor)."""
    return isinstance(processing_class, ProcessorMixin)


def image_column(row: dict[str, Any]) -> str | None:
    """The row's image column, if it has one."""
    return next((column for column in IMAGE_COLUMNS if column in row), None)


def row_images(row: dict[str, Any]) -> list[Any]:
    """The row's images as a list (empty when its image column holds None)."""
    column = image_column(row)
    if column is None or row[column] is None:
        return []
    value = row[column]
    return list(value) if isinstance(value, (list, tuple)) else [value]


def image_part_count(prompt: list[dict[str, Any]]) -> int:
    return sum(
        1
        for message in prompt
        if isinstance(message["content"], list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )


def with_image_parts(prompt: Any, num_images: int, row: int) -> list[dict[str, Any]]:
    """The conversation with one ``{"type": "image"}`` part per image.

    A prompt that already places its image parts keeps them (their number must match the images); otherwise they go
    at the start of the first user message, before its text.
    """
    if num_images == 0:
        return prompt
    if isinstance(prompt, str):
        raise ValueError(
            f"Row {row} has images but its prompt is a plain string: images need a conversational prompt, whose chat "
            "template places them. Wrap it as `[{'role': 'user', 'content': prompt}]`."
        )
    placed = image_part_count(prompt)
    if placed == num_images:
        return prompt
    if placed:
        raise ValueError(
            f"Row {row} has {num_images} image(s) but its messages hold {placed} image part(s): give one "
            "`{'type': 'image'}` part per image, or none to put them all at the start of the first user message."
        )
    first_user = next((index for index, message in enumerate(prompt) if message["role"] == "user"), None)
    if first_user is None:
        raise ValueError(f"Row {row} has images but no user message to put them in.")
    message = prompt[first_user]
    text = message["content"]
    parts = [{"type": "text", "text": text}] if isinstance(text, str) else list(text)
    images = [{"type": "image"} for _ in range(num_images)]
    return [*prompt[:first_user], {**message, "content": images + parts}, *prompt[first_user + 1 :]]


def with_image_objects(prompt: list[dict[str, Any]], images: list[Any]) -> list[dict[str, Any]]:
    """The conversation with each ``{"type": "image"}`` part holding its image (``"image": ...``), in order: how a
    rollout_func receives prompts with images, to hand them to its own engine."""
    if not images:
        return prompt
    remaining = iter(images)
    return [
        {
            **message,
            "content": [
                {**part, "image": next(remaining)} if isinstance(part, dict) and part.get("type") == "image" else part
                for part in message["content"]
            ],
        }
        if isinstance(message.get("content"), list)
        else message
        for message in prompt
    ]


class EncodedPrompts:
    """Left-padded prompt ids and mask, their per-token extras, each row's per-image inputs, and each row's ids before
    the processor expanded its image placeholders (what an engine that expands them itself takes)."""

    def __init__(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        token_aligned: dict[str, torch.Tensor],
        pixel_inputs: list[dict[str, torch.Tensor]],
        unexpanded_ids: list[list[int]],
    ):
        self.ids, self.mask, self.token_aligned, self.pixel_inputs = ids, mask, token_aligned, pixel_inputs
        self.unexpanded_ids = unexpanded_ids

    @classmethod
    def without_images(cls, ids: torch.Tensor, mask: torch.Tensor) -> EncodedPrompts:
        """Text prompts as encoded prompts with no pixels: for tool results that may bring the first images."""
        unexpanded = [row[row_mask.bool()].tolist() for row, row_mask in zip(ids, mask)]
        return cls(ids, mask, {}, [{} for _ in unexpanded], unexpanded)

    def to(self, device: torch.device | str) -> EncodedPrompts:
        return EncodedPrompts(
            self.ids.to(device),
            self.mask.to(device),
            {key: value.to(device) for key, value in self.token_aligned.items()},
            [{key: value.to(device) for key, value in row.items()} for row in self.pixel_inputs],
            self.unexpanded_ids,
        )


def encode_prompts_with_images(
    processor: Any,
    texts: list[str],
    images: list[list[Any]],
    max_tokens: int | None,
    pad_token_id: int,
    plain: Sequence[bool] | None = None,
) -> EncodedPrompts:
    """Encode each rendered prompt with its images through ``processor``, a row at a time, and left-pad the rows.

    Rows that repeat the previous row's prompt (a group) reuse its encoding. A prompt longer than ``max_tokens`` keeps
    its last tokens when it has no images; one with images cannot lose any (its image tokens must match its pixels),
    which is an error naming the fix. ``plain`` marks rows whose prompt was a plain string: the tokenizer adds its
    special tokens to those, as to text prompts; a chat template writes its own.
    """
    rows: list[dict[str, torch.Tensor]] = []
    unexpanded_ids: list[list[int]] = []
    for index, (text, row_images_) in enumerate(zip(texts, images)):
        if index > 0 and text == texts[index - 1] and _same_images(row_images_, images[index - 1]):
            rows.append(rows[-1])
            unexpanded_ids.append(unexpanded_ids[-1])
            continue
        # A chat template writes the special tokens itself; a ``plain`` string prompt gets the tokenizer's (as text
        # prompts do).
        special = bool(plain[index]) if plain is not None else False
        row = _encode_one_prompt(processor, text, row_images_, special, max_tokens)
        unexpanded_ids.append(processor.tokenizer(text, add_special_tokens=special)["input_ids"])
        rows.append(row)
    width = max(row["input_ids"].size(1) for row in rows)
    lengths = [row["input_ids"].size(1) for row in rows]

    def left_padded(key: str, value: int) -> torch.Tensor:
        return torch.cat(
            [torch.nn.functional.pad(row[key], (width - length, 0), value=value) for row, length in zip(rows, lengths)]
        )

    ids = left_padded("input_ids", pad_token_id)
    mask = left_padded("attention_mask", 0)
    token_keys = [
        key
        for key, value in rows[0].items()
        if key not in ("input_ids", "attention_mask") and value.dim() == 2 and value.size(1) == lengths[0]
    ]
    token_aligned = {key: left_padded(key, 0) for key in token_keys}
    pixel_inputs = [
        {key: value for key, value in row.items() if key not in ("input_ids", "attention_mask", *token_keys)}
        for row in rows
    ]
    return EncodedPrompts(ids, mask, token_aligned, pixel_inputs, unexpanded_ids)


def _encode_one_prompt(
    processor: Any, text: str, images: list[Any], special: bool, max_tokens: int | None
) -> dict[str, torch.Tensor]:
    """One rendered prompt encoded with its images, cut to its last ``max_tokens`` tokens if it has no image (image
    tokens cannot be cut: a prompt with images that is too long is an error naming the fix)."""
    encoded = processor(
        text=[text], images=[images] if images else None, return_tensors="pt", add_special_tokens=special
    )
    row = {key: value for key, value in encoded.items() if torch.is_tensor(value)}
    length = row["input_ids"].size(1)
    if max_tokens is None or length <= max_tokens:
        return row
    if images:
        raise ValueError(
            f"A prompt with {len(images)} image(s) is {length} tokens long, more than the "
            f"{max_tokens} prompt tokens allowed (max_prompt_length, or what the model's positions leave "
            "beside max_completion_length); its image tokens cannot be cut. Raise max_prompt_length, or "
            "make the images smaller (the processor's max_pixels / size)."
        )
    return {
        key: value[:, -max_tokens:] if value.dim() == 2 and value.size(1) == length else value
        for key, value in row.items()
    }


def _same_images(first: list[Any], second: list[Any]) -> bool:
    return len(first) == len(second) and all(_same_image(a, b) for a, b in zip(first, second))


def _same_image(first: Any, second: Any) -> bool:
    """Whether two images hold the same pixels. A group's rows are read from the dataset one by one, so their images
    are equal objects, not the same one; ``==`` compares PIL images (and paths) by content, but numpy arrays and
    tensors elementwise, which cannot be a truth value."""
    if first is second:
        return True
    if type(first) is not type(second):
        return False
    if isinstance(first, np.ndarray):
        return first.dtype == second.dtype and np.array_equal(first, second)
    if isinstance(first, torch.Tensor):
        return first.dtype == second.dtype and first.device == second.device and torch.equal(first, second)
    return bool(first == second)


def collate_pixel_inputs(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One batch's per-image inputs from its rows' (rows without images add nothing).

    Rows' tensors are concatenated along the first dimension, in row order, which is the order the model meets the
    image tokens in. Where rows' tensors differ in a later dimension (images split into different numbers of tiles,
    rows with different numbers of images), they are zero-padded to the largest, as the processors pad a batch.
    """
    keys = list(dict.fromkeys(key for row in rows for key in row))
    collated = {}
    for key in keys:
        tensors = [row[key] for row in rows if key in row]
        shape = [max(sizes) for sizes in zip(*(tensor.shape[1:] for tensor in tensors))]
        padded = []
        for tensor in tensors:
            padding = []
            for size, target in zip(reversed(tensor.shape[1:]), reversed(shape)):
                padding += [0, target - size]
            padded.append(torch.nn.functional.pad(tensor, padding) if any(padding) else tensor)
        collated[key] = torch.cat(padded)
    return collated


def prompt_images(
    encoded: EncodedPrompts,
    images: list[list[Any]],
    rows: Sequence[int] | None = None,
    contexts: Sequence[list[int]] | None = None,
    after: Sequence[ImagesAfterPrompt | None] | None = None,
) -> PromptImages:
    """The images of ``rows`` (default: all) of ``encoded`` prompts as rollout backends take them.

    ``contexts`` continue those rows' prompts (a multi-turn rollout's later turns: prompt, model turns, tool turns),
    left-padded to the longest as the backend's ids are: per-token extras then cover each context, zero past its
    prompt, and the unexpanded ids continue with the context's tokens after the prompt. ``after`` (one per row, with
    ``contexts``) holds the images tool turns brought: they follow the prompt's, with their inputs, their per-token
    extras and their placeholders unexpanded in the continuation.
    """
    from ..generation.base import PromptImages  # here: the generation package reads this module's placeholder ids

    rows = list(range(len(images))) if rows is None else list(rows)
    after = [None] * len(rows) if after is None else list(after)
    pixel_rows = []
    for row, later in zip(rows, after):
        pixel_rows += [encoded.pixel_inputs[row], *(later.pixel_inputs if later is not None else [])]
    model_inputs = collate_pixel_inputs(pixel_rows)  # in token order: each row's prompt images, then its tools'
    unexpanded = [encoded.unexpanded_ids[row] for row in rows]
    row_images_ = [images[row] + (later.images if later is not None else []) for row, later in zip(rows, after)]
    if contexts is None:
        model_inputs.update({key: value[rows] for key, value in encoded.token_aligned.items()})
        return PromptImages(model_inputs, row_images_, unexpanded)
    width = max(len(context) for context in contexts)
    prompt_lengths = [int(encoded.mask[row].sum()) for row in rows]
    keys = dict.fromkeys(encoded.token_aligned)
    keys.update(dict.fromkeys(key for later in after if later is not None for key in later.aligned_keys()))
    for key in keys:
        model_inputs[key] = torch.stack(
            [
                _aligned_over_context(encoded, key, row, length, context, later, width)
                for row, length, context, later in zip(rows, prompt_lengths, contexts, after)
            ]
        )
    unexpanded = [
        ids + (later.unexpanded_ids if later is not None else context[length:])
        for ids, length, context, later in zip(unexpanded, prompt_lengths, contexts, after)
    ]
    return PromptImages(model_inputs, row_images_, unexpanded)


def _aligned_over_context(
    encoded: EncodedPrompts,
    key: str,
    row: int,
    prompt_length: int,
    context: list[int],
    later: ImagesAfterPrompt | None,
    width: int,
) -> torch.Tensor:
    """One per-token extra over a row's context, left-padded to ``width``: the prompt's (zeros where it has none),
    then the tool turns' (zeros elsewhere in the completion)."""
    prompt_values = encoded.token_aligned.get(key)
    if prompt_values is None:
        prompt = encoded.mask.new_zeros(prompt_length)
    else:
        prompt = prompt_values[row, -prompt_length:] if prompt_length else prompt_values.new_zeros(0)
    completion_length = len(context) - prompt_length
    completion = prompt.new_zeros(completion_length)
    if later is not None:
        completion = torch.tensor(later.aligned(key, completion_length), dtype=prompt.dtype, device=prompt.device)
    return torch.nn.functional.pad(torch.cat([prompt, completion]), (width - len(context), 0))


class EncodedTurn:
    """A tool turn whose messages hold images, encoded by the processor: its ids with the image placeholders expanded
    (as a prompt's are), the same before expansion (what an engine that expands them itself takes), its per-image
    inputs and its per-token extras."""

    def __init__(
        self,
        ids: list[int],
        unexpanded_ids: list[int],
        pixel_inputs: dict[str, torch.Tensor],
        token_aligned: dict[str, list[int]],
    ):
        self.ids, self.unexpanded_ids = ids, unexpanded_ids
        self.pixel_inputs, self.token_aligned = pixel_inputs, token_aligned


def encode_turn_with_images(processor: Any, text: str, images: list[Any]) -> EncodedTurn:
    """Encode a rendered tool turn with the images its messages hold, as :func:`encode_prompts_with_images` encodes a
    prompt (the chat template wrote the special tokens: the tokenizer adds none)."""
    encoded = processor(text=[text], images=[images], return_tensors="pt", add_special_tokens=False)
    unexpanded = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = encoded["input_ids"][0].tolist()
    if ids == unexpanded:  # some processors ignore images that the text has no placeholder for
        raise ValueError(
            f"A tool returned {len(images)} image(s) but the chat template renders the tool message without an "
            "image placeholder, so the model could not see them. Use a chat template that renders a tool message's "
            "content parts of type 'image' as the processor's image placeholder (as it does in user messages)."
        )
    token_keys = [
        key
        for key, value in encoded.items()
        if key not in ("input_ids", "attention_mask") and torch.is_tensor(value) and value.shape == (1, len(ids))
    ]
    pixel_inputs = {
        key: value
        for key, value in encoded.items()
        if torch.is_tensor(value) and key not in ("input_ids", "attention_mask", *token_keys)
    }
    return EncodedTurn(ids, unexpanded, pixel_inputs, {key: encoded[key][0].tolist() for key in token_keys})


@dataclass
class ImagesAfterPrompt:
    """The images a sample's tool turns brought, grown with its completion: generation and the training pass read
    them after the prompt's images."""

    images: list[Any] = field(default_factory=list)
    pixel_inputs: list[dict[str, torch.Tensor]] = field(default_factory=list)  # each turn with images: its inputs
    unexpanded_ids: list[int] = field(default_factory=list)  # the completion so far, tool images unexpanded
    # Each turn with images: where it starts in the completion, and its per-token extras.
    _aligned: list[tuple[int, dict[str, list[int]]]] = field(default_factory=list)

    def add_tokens(self, ids: list[int]) -> None:
        """Tokens without images (a model turn, a tool turn of text) continue the completion as they are."""
        self.unexpanded_ids += ids

    def add_turn(self, turn: EncodedTurn, images: list[Any], start: int) -> None:
        """A tool turn with ``images``, placed at ``start`` in the completion."""
        self.images += images
        self.pixel_inputs.append(turn.pixel_inputs)
        self.unexpanded_ids += turn.unexpanded_ids
        self._aligned.append((start, turn.token_aligned))

    def aligned_keys(self) -> list[str]:
        """The per-token extras the tool turns have."""
        return list(dict.fromkeys(key for _, extras in self._aligned for key in extras))

    def aligned(self, key: str, length: int) -> list[int]:
        """The per-token extra ``key`` over the first ``length`` tokens of the completion (0 outside its turns)."""
        values = [0] * length
        for start, extras in self._aligned:
            turn = extras.get(key, [])[: max(0, length - start)]
            values[start : start + len(turn)] = turn
        return values
