"""Prompt datasets: checks, rendering and the sampler that keeps each prompt's completions together."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import datasets
import torch
from torch.utils.data import Sampler

from .modeling.vision import IMAGE_COLUMNS, row_images

T = TypeVar("T")
#: Dataset columns that carry images (or other media) for vision-language prompts.
MEDIA_COLUMNS = frozenset({"image", "images", "video", "videos", "audio"})
#: Why prompts with images cannot be trained on, when the policy's processing class is a tokenizer.
NEEDS_PROCESSOR = (
    "the model's processor as `processing_class` (e.g. `AutoProcessor.from_pretrained(model_id)`), not its tokenizer"
)


def is_conversational(example: dict[str, Any]) -> bool:
    """True when the example's prompt is a list of chat messages (dicts with 'role' and 'content')."""
    prompt = example.get("prompt")
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(message, dict) and "role" in message and "content" in message for message in prompt)
    )


def validate_prompt_dataset(
    dataset: Any, split: str, tokenizer: Any, images_need: str | None = NEEDS_PROCESSOR, prompt_optional: bool = False
) -> None:
    """Refuse datasets the trainer cannot use, before any model work starts: every row's prompt is checked.

    ``images_need`` says what prompts with images would need that this run lacks; None when they can be trained on.
    ``prompt_optional``: rows may leave the prompt out (environments make it up in ``reset()``, from an empty user
    message).
    """
    if dataset is None:
        return
    _check_dataset_kind(dataset, split)
    first = first_row(dataset)
    if first is None:
        raise ValueError(f"The {split} dataset is empty: it needs at least one row with a 'prompt'.")
    has_prompts = _check_first_row(first, split, images_need, prompt_optional)
    # A stream is read once, while training: its first row is checked now, the others as they arrive (RolloutStream).
    if not has_prompts:
        prompts = []
    else:
        prompts = [first["prompt"]] if is_stream(dataset) else column_values(dataset, "prompt", split)
    # None without prompts: the environments' prompts are conversations.
    first_is_text = _check_prompts(prompts, split, images_allowed=images_need is None)
    if not first_is_text and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"The {split} dataset is conversational (its prompts are lists of messages) but the tokenizer has no chat "
            "template. Set `tokenizer.chat_template`, or use a standard dataset whose prompts are strings."
        )


def _check_dataset_kind(dataset: Any, split: str) -> None:
    """A dataset the trainer can read more than once: map-style or a stream, not a one-shot iterator."""
    if isinstance(dataset, Iterator):
        raise ValueError(
            f"The {split} dataset is a one-shot iterator ({type(dataset).__name__}): the trainer reads a dataset more "
            "than once (its first row is checked before training, and every epoch reads it again from its start), "
            "so an iterator's first rows would never be trained and its next epoch would be empty. Pass something "
            "that starts again each time it is read: `datasets.IterableDataset.from_generator(make_rows)` with the "
            "function that makes the generator (not the generator itself), or `datasets.Dataset.from_list(list(rows))`."
        )
    if not is_stream(dataset) and not hasattr(dataset, "__getitem__"):
        raise ValueError(
            f"The {split} dataset must be a map-style dataset (e.g. `datasets.Dataset`) or a stream (e.g. "
            f"`datasets.IterableDataset`), not a {type(dataset).__name__}."
        )


def _check_first_row(first: Any, split: str, images_need: str | None, prompt_optional: bool) -> bool:
    """The columns of the first row: a prompt (unless optional), and images only where they can be trained on.
    Returns whether the rows have prompts."""
    has_prompts = isinstance(first, dict) and "prompt" in first
    if not has_prompts and not (prompt_optional and isinstance(first, dict)):
        columns = list(first.keys()) if isinstance(first, dict) else type(first).__name__
        raise ValueError(
            f"The {split} dataset has no 'prompt' column (found {columns}). Prompt-only datasets need a 'prompt' column "
            "holding either a string or a list of chat messages; rename yours with "
            "`dataset.rename_column('question', 'prompt')`."
        )
    media = sorted(MEDIA_COLUMNS & set(first))
    unsupported = media if images_need is not None else [column for column in media if column not in IMAGE_COLUMNS]
    if unsupported:
        need = (
            f"prompts with images need {images_need}"
            if set(unsupported) <= set(IMAGE_COLUMNS)
            else "videos and audio are not supported (images are, in an 'image' or 'images' column)"
        )
        raise ValueError(
            f"The {split} dataset has the column(s) {unsupported}: {need}; training would otherwise see the text "
            f"alone. To train on the text on purpose, drop them with `dataset.remove_columns({unsupported})`."
        )
    if images_need is None and row_images(first) and isinstance(first.get("prompt"), str):
        raise ValueError(
            f"The {split} dataset has images but its prompts are plain strings: images need conversational prompts, "
            "whose chat template places them. Wrap each as `[{'role': 'user', 'content': prompt}]`."
        )
    return has_prompts


def _check_prompts(prompts: Iterable[Any], split: str, images_allowed: bool) -> bool | None:
    """Every prompt well formed, all of one format; whether they are strings (None: no prompts)."""
    first_is_text = None
    for index, prompt in enumerate(prompts):
        problem = prompt_problem(prompt, images_allowed=images_allowed)
        if problem is not None:
            raise ValueError(
                f"The {split} dataset's prompt in row {index} {problem[0]}. Every prompt must be a non-empty string or "
                f"a non-empty list of chat messages; {problem[1]}"
            )
        is_text = isinstance(prompt, str)
        if first_is_text is None:
            first_is_text = is_text
        elif is_text != first_is_text:
            kinds = ("a list of chat messages", "a string") if is_text else ("a string", "a list of chat messages")
            raise ValueError(
                f"The {split} dataset mixes prompt formats: row 0 is {kinds[0]} but row {index} is {kinds[1]}. A batch "
                "is rendered by its first prompt's format, so use one throughout: render conversations to strings "
                "with `tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)` in "
                "`dataset.map(...)`, or wrap strings as `[{'role': 'user', 'content': prompt}]`."
            )
    return first_is_text


def column_values(dataset: Any, column: str, split: str) -> Iterator[Any]:
    """Every row's ``column`` in order; a `datasets.Dataset` is read a column batch at a time, not row by row."""
    if isinstance(dataset, datasets.Dataset):
        if dataset.format["type"] != "custom":  # a custom transform may build the column: read through it
            dataset = dataset.select_columns([column]).with_format(None)
        for batch in dataset.iter(batch_size=1000):
            yield from batch[column]
        return
    for index in range(len(dataset)):
        row = dataset[index]
        if not isinstance(row, dict) or column not in row:
            found = list(row.keys()) if isinstance(row, dict) else type(row).__name__
            raise ValueError(
                f"The {split} dataset's row {index} has no '{column}' (found {found}); every row needs one."
            )
        yield row[column]


def prompt_problem(prompt: Any, images_allowed: bool = False) -> tuple[str, str] | None:
    """What makes a prompt unusable and how to fix it, or None for a non-empty string or list of chat messages
    (whose content parts are text, or also images when ``images_allowed``)."""
    drop = "drop such rows with `dataset = dataset.filter(lambda row: {})`."
    if prompt is None:
        return "is None", drop.format("row['prompt'] is not None")
    if isinstance(prompt, str):
        if prompt and not prompt.isspace():
            return None
        return ("is empty" if not prompt else "is only whitespace"), drop.format("bool(row['prompt'].strip())")
    if not isinstance(prompt, list):
        return (
            f"has type {type(prompt).__name__} ({prompt!r:.80}), not a string or a list of chat messages",
            "convert it (e.g. `dataset.map(lambda row: {'prompt': str(row['prompt'])})`) or drop such rows.",
        )
    if not prompt:
        return "is an empty list of messages", drop.format("len(row['prompt']) > 0")
    for position, message in enumerate(prompt):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            return (
                f"has message {position} without a string 'role' and a 'content': {message!r:.80}",
                "each message is a dict like `{'role': 'user', 'content': 'Hi'}`.",
            )
        content = message["content"]
        if not isinstance(content, (str, list)):  # a list holds content parts
            problem = f"has message {position} whose content is {type(content).__name__}, not a string or a list"
            return problem, "give every message a text (or a list of content parts), or drop such rows."
        for part in content if isinstance(content, list) else ():
            kind = part.get("type", "text") if isinstance(part, dict) else None
            if kind != "text" and not (kind == "image" and images_allowed):
                fix = (
                    "only text parts are supported, and image parts with the model's processor as `processing_class` "
                    "(other parts would be dropped silently): keep the `{'type': 'text', 'text': ...}` parts."
                )
                return f"has message {position} with a content part of type {kind or type(part).__name__!r}", fix
    return None


def message_text(message: dict[str, Any]) -> str:
    """A message's text: its content string, or its text parts joined (how chat templates render content parts)."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if isinstance(part, dict) and part.get("type", "text") == "text")


def render_prompts(
    prompts: Sequence[Any], tokenizer: Any, tools: list[dict[str, Any]] | None = None, **template_kwargs: Any
) -> list[str]:
    """Prompt texts: strings as they are, conversations through the tokenizer's chat template (with the ``tools``
    schemas, if any, and ``template_kwargs``).

    A conversation that ends with an assistant message is continued rather than followed by a new turn.
    """
    texts = []
    for prompt in prompts:
        if isinstance(prompt, str):
            texts.append(prompt)
            continue
        continue_final = prompt[-1]["role"] == "assistant"
        texts.append(
            tokenizer.apply_chat_template(
                prompt,
                tokenize=False,
                add_generation_prompt=not continue_final,
                continue_final_message=continue_final,
                tools=tools or None,
                **template_kwargs,
            )
        )
    return texts


class RawRows(list):
    """A batch of raw dataset rows, handed to the trainer as they are: tokenisation happens at rollout time.

    Its ``to`` keeps it as it is. accelerate's dataloader moves each batch to the device by walking every value of
    every row (about a millisecond for a batch of 128 prompt rows, every micro-step), though rollouts build their
    tensors on the device themselves.
    """

    def to(self, *args: Any, **kwargs: Any) -> RawRows:
        return self


def identity_collator(rows: list[dict[str, Any]]) -> RawRows:
    """Hand the raw rows to the trainer: tokenisation happens at rollout time."""
    return RawRows(rows)


#: Key under which a training row carries which use of its rollout the dataloader fetched it for.
ROLLOUT_USE = "__rollout_use__"
#: Key under which a training row carries the row at its place in the next rollout (asynchronous rollouts), or None.
UPCOMING_ROW = "__upcoming_row__"
#: Key under which rows read for asynchronous rollouts carry their index in the dataset (this row's, and the upcoming
#: row's): episodes played ahead are used only for the rows they were played for.
ROW_INDEX = "__row_index__"
#: Every key the training sampler tags a row with.
SAMPLER_TAGS = (ROLLOUT_USE, UPCOMING_ROW, ROW_INDEX)


class RolloutRows(torch.utils.data.Dataset):
    """The training dataset as its dataloader reads it, with keys ``(index, use)`` from a tagging RepeatSampler.

    Each row comes back with ``ROLLOUT_USE`` set to ``use``, so the trainer knows which micro-step of a rollout the
    batch is for, exactly, also when a resumed run starts in the middle of a rollout. Keys ``(index, use, upcoming)``
    from a sampler that looks ahead also bring the dataset row ``upcoming`` under ``UPCOMING_ROW`` (None when < 0).
    """

    def __init__(self, dataset: Any):
        self.dataset = dataset
        self.sampler: RepeatSampler | None = None  # the sampler whose keys it is read by
        self._first_use_rows: dict[int, dict[str, Any]] = {}  # the current rollout's rows, as its first use read them

    def set_epoch(self, epoch: int) -> None:
        """The epoch, for the sampler's order. accelerate's loader hands it to the sampler itself, except where the
        sampler lies deeper than it looks (several processes with a resumed run's skipped batches): there it hands
        it to the dataset, and without this the sampler would serve the rest of the epoch in epoch 0's order."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, ...]) -> dict[str, Any]:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, ...]]) -> list[dict[str, Any]]:
        """The rows of a batch of keys, read from the dataset in one go (a Dataset reads a batch of rows in about the
        time of one). They may share objects (a list of dicts gives its own at every read): a rollout deep-copies
        each sample's row before using it (``rollout.sources.own_copies``), so nothing a sample's rollout changes
        reaches another sample, the dataset, or the rows kept here.

        Every micro-step of a rollout gets its rows, but only the first use makes the rollout from them (later ones
        take their step batch from the rollout buffer, except where a resumed run begins mid-rollout): a later use
        is given, for each dataset index, the row this reader kept from the last first use it read (one process
        without dataloader workers, the default: its own rollout's), and reads the others. A kept row is the same
        dataset row, shared by the later use's repeats of it, which make no rollout. So a dataset of images is decoded
        once a rollout, not once a micro-step."""
        kept = [key[1] > 0 and key[0] in self._first_use_rows for key in keys]
        upcoming = [key[2] for key in keys if len(key) > 2 and key[2] >= 0]
        read = iter(_read_rows(self.dataset, [key[0] for key, hit in zip(keys, kept) if not hit] + upcoming))
        untagged = [self._first_use_rows[key[0]] if hit else next(read) for key, hit in zip(keys, kept)]
        if keys and keys[0][1] == 0:  # a new rollout's first use
            self._first_use_rows = {key[0]: row for key, row in zip(keys, untagged)}
        rows = [_tagged(row, key[1]) for row, key in zip(untagged, keys)]
        for row, key in zip(rows, keys):
            if len(key) > 2:
                row[ROW_INDEX] = key[0]
                row[UPCOMING_ROW] = {**next(read), ROW_INDEX: key[2]} if key[2] >= 0 else None
        return rows


def _read_rows(dataset: Any, indices: list[int]) -> list[dict[str, Any]]:
    """``dataset``'s rows at ``indices``: in one read where the dataset reads batches (``__getitems__``)."""
    if not hasattr(dataset, "__getitems__"):
        return [dataset[index] for index in indices]
    rows = dataset.__getitems__(indices)
    if isinstance(rows, Mapping):  # a batch read as columns, {name: [values]}, as some datasets give it
        return [dict(zip(rows, values)) for values in zip(*rows.values())]
    return list(rows)


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is read by iterating (a ``datasets.IterableDataset``, a torch ``IterableDataset``), not by
    index."""
    return isinstance(dataset, (datasets.IterableDataset, torch.utils.data.IterableDataset)) or (
        dataset is not None and not hasattr(dataset, "__len__") and hasattr(dataset, "__iter__")
    )


def first_row(dataset: Any) -> Any:
    """The dataset's first row, also for a stream (which is read again from its start afterwards)."""
    if is_stream(dataset):
        return next(iter(dataset), None)
    return dataset[0] if len(dataset) else None


def check_streaming_supported(args: Any, train_is_stream: bool) -> None:
    """Refuse the settings a streamed dataset cannot serve, before any model work starts; warn that a stream is read
    without dataloader workers."""
    if train_is_stream and args.async_rollouts:
        raise ValueError(
            "async_rollouts=True needs a map-style train dataset: the next rollout's prompts are read ahead by index. "
            "Set async_rollouts=False, or load the data as a `datasets.Dataset` (without `streaming=True`)."
        )
    if args.accelerator_config.dispatch_batches:
        raise ValueError(
            "accelerator_config.dispatch_batches=True sends batches from the main process, which cannot carry prompt "
            "rows; with a streamed dataset each process reads the stream itself. Leave dispatch_batches unset."
        )
    if args.dataloader_num_workers > 0:
        warnings.warn(
            f"dataloader_num_workers={args.dataloader_num_workers} does not apply to streamed datasets: each worker "
            "would read the whole stream, repeating every prompt, so a stream is read in the main process "
            "(dataloader_num_workers=0 for its loader). Map-style datasets still use the workers.",
            stacklevel=3,
        )


@contextlib.contextmanager
def stream_loader_settings(args: Any, accelerator: Any) -> Iterator[None]:
    """While a stream's dataloader is built: no worker processes (each would read the whole stream), and every process
    reads the stream itself, keeping its share (no batches dispatched from the main process)."""
    worker_settings = {
        "dataloader_num_workers": 0,
        "dataloader_persistent_workers": False,
        "dataloader_prefetch_factor": None,
        "dataloader_multiprocessing_context": None,
    }
    saved = {name: getattr(args, name) for name in worker_settings}
    saved_dispatch = accelerator.dataloader_config.dispatch_batches
    for name, value in worker_settings.items():
        setattr(args, name, value)
    accelerator.dataloader_config.dispatch_batches = False
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(args, name, value)
        accelerator.dataloader_config.dispatch_batches = saved_dispatch


class RolloutStream(torch.utils.data.IterableDataset):
    """A streamed dataset's rows in the order a :class:`RepeatSampler` gives a map-style one's (without shuffling).

    The stream is read ``prompts_per_rollout`` prompts at a time; each chunk is served ``repeat_count`` times, each
    prompt ``num_generations`` times in a row, tagged with ``ROLLOUT_USE`` when ``tag_uses``. A trailing chunk with
    fewer prompts is dropped. Every prompt is checked as it arrives; with ``prompt_optional`` (environments make up
    the prompts) a row may have none.
    """

    def __init__(
        self,
        dataset: Any,
        num_generations: int,
        prompts_per_rollout: int = 1,
        repeat_count: int = 1,
        tag_uses: bool = False,
        split: str = "train",
        images_allowed: bool = False,
        prompt_optional: bool = False,
    ):
        self.dataset = dataset
        self.num_generations = num_generations
        self.prompts_per_rollout = prompts_per_rollout
        self.repeat_count = repeat_count
        self.tag_uses = tag_uses
        self.split = split
        self.images_allowed = images_allowed
        self.prompt_optional = prompt_optional

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):  # a shuffled datasets.IterableDataset reshuffles per epoch
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        chunks = _whole_chunks(self._checked_rows(), self.prompts_per_rollout)
        for row, use in _served_in_rollouts(chunks, self.num_generations, self.repeat_count):
            yield _tagged(row, use) if self.tag_uses else row

    def _checked_rows(self) -> Iterator[dict[str, Any]]:
        """The stream's rows, each refused as it arrives if its prompt is missing or unusable."""
        for index, row in enumerate(self.dataset):
            if not isinstance(row, dict) or ("prompt" not in row and not self.prompt_optional):
                found = list(row) if isinstance(row, dict) else type(row).__name__
                raise ValueError(f"The {self.split} dataset's row {index} has no 'prompt' (found {found}).")
            problem = prompt_problem(row["prompt"], self.images_allowed) if "prompt" in row else None
            if problem is not None:
                raise ValueError(f"The {self.split} dataset's prompt in row {index} {problem[0]}; {problem[1]}")
            yield row


def _whole_chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """``items`` in consecutive lists of ``size``; a shorter trailing list is dropped, so every rollout is as large."""
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []


def _served_in_rollouts(chunks: Iterable[list[T]], num_generations: int, repeat_count: int) -> Iterator[tuple[T, int]]:
    """The order rollouts read their prompts in, as ``(item, use)``: each chunk (one rollout's prompts) served
    ``repeat_count`` times (``use`` counts them), each of its items ``num_generations`` times in a row."""
    for chunk in chunks:
        for use in range(repeat_count):
            for item in chunk:
                for _ in range(num_generations):
                    yield item, use


def _tagged(row: dict[str, Any], use: int) -> dict[str, Any]:
    """A copy of ``row`` that says which use of its rollout it is read for (``ROLLOUT_USE``)."""
    return {**row, ROLLOUT_USE: use}


def lookahead_use(uses_per_rollout: int, accumulation_steps: int, max_staleness: int) -> int:
    """At which use of a rollout the next rollout starts generating (asynchronous rollouts).

    As late as ``max_staleness`` allows: when the next rollout is trained on, its generation started at most that many
    optimiser steps before (a rollout that spans ``S`` optimiser steps starts the next one ``min(S, max_staleness)``
    steps before its end; one that fits inside an optimiser step starts it at once).
    """
    steps_per_rollout = uses_per_rollout // accumulation_steps
    return max(0, steps_per_rollout - max_staleness) * accumulation_steps


class RepeatSampler(Sampler[int]):
    """Yield prompt indices so that rollouts hold whole, contiguous groups and are reused for several steps.

    Prompts are shuffled (per epoch, from ``seed``) and cut into chunks of ``prompts_per_rollout``; each chunk is
    yielded ``repeat_count`` times, and each prompt inside it ``num_generations`` times in a row::

        RepeatSampler(4, num_generations=2, prompts_per_rollout=2, repeat_count=2, shuffle=False)
        -> 0 0 1 1 | 0 0 1 1 | 2 2 3 3 | 2 2 3 3

    A trailing chunk with fewer than ``prompts_per_rollout`` prompts is dropped so every rollout has the same size.
    With ``tag_uses=True`` it yields ``(index, use)`` pairs instead, ``use`` counting the repeats of the chunk
    (for :class:`RolloutRows`). With ``lookahead_use`` as well, it yields ``(index, use, upcoming)``: at that use of
    each chunk ``upcoming`` is the index at the same place in the next chunk (the next epoch's first chunk after the
    last one), so its rollout can be generated ahead; -1 at every other use.
    """

    def __init__(
        self,
        num_prompts: int,
        num_generations: int,
        prompts_per_rollout: int = 1,
        repeat_count: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        tag_uses: bool = False,
        lookahead_use: int | None = None,
    ):
        if prompts_per_rollout > num_prompts:
            raise ValueError(
                f"The dataset has {num_prompts} prompts but one rollout needs {prompts_per_rollout} "
                "(generation_batch_size // num_generations). Use a larger dataset or a smaller batch."
            )
        self.num_prompts = num_prompts
        self.num_generations = num_generations
        self.prompts_per_rollout = prompts_per_rollout
        self.repeat_count = repeat_count
        self.shuffle = shuffle
        self.seed = seed
        self.tag_uses = tag_uses
        self.lookahead_use = lookahead_use
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle differently, but reproducibly, in each epoch."""
        self.epoch = epoch

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_prompts, generator=generator).tolist()

    def __iter__(self) -> Iterator[int | tuple[int, ...]]:
        size = self.prompts_per_rollout
        chunks = list(_whole_chunks(self._order(self.epoch), size))
        # Each prompt paired with the one at its place in the next chunk (the next epoch's first, after the last).
        upcoming = [*chunks[1:], self._order(self.epoch + 1)[:size]]
        paired = (list(zip(chunk, following)) for chunk, following in zip(chunks, upcoming))
        for (index, upcoming_index), use in _served_in_rollouts(paired, self.num_generations, self.repeat_count):
            if not self.tag_uses:
                yield index
            elif self.lookahead_use is None:
                yield index, use
            else:
                yield index, use, upcoming_index if use == self.lookahead_use else -1

    def __len__(self) -> int:
        num_chunks = self.num_prompts // self.prompts_per_rollout
        return num_chunks * self.prompts_per_rollout * self.num_generations * self.repeat_count


def training_sampler(args: Any, dataset_size: int, uses_per_rollout: int, lookahead: int | None) -> RepeatSampler:
    """The training sampler: each rollout's rows, repeated for each of its ``uses_per_rollout`` micro-steps and tagged
    with the use (and, with ``lookahead``, the next rollout's rows at that use)."""
    return RepeatSampler(
        dataset_size,
        num_generations=args.num_generations,
        prompts_per_rollout=args.generation_batch_size // args.num_generations,
        repeat_count=uses_per_rollout,
        shuffle=args.shuffle_dataset,
        seed=args.seed if args.data_seed is None else args.data_seed,
        tag_uses=True,
        lookahead_use=lookahead,
    )


def training_stream(
    args: Any, dataset: Any, uses_per_rollout: int, images_allowed: bool, prompt_optional: bool
) -> RolloutStream:
    """A streamed training dataset, read in order and repeated as :func:`training_sampler` repeats rows."""
    return RolloutStream(
        dataset,
        num_generations=args.num_generations,
        prompts_per_rollout=args.generation_batch_size // args.num_generations,
        repeat_count=uses_per_rollout,
        tag_uses=True,
        images_allowed=images_allowed,
        prompt_optional=prompt_optional,
    )


def evaluation_stream(dataset: Any, group_size: int, images_allowed: bool, prompt_optional: bool) -> RolloutStream:
    """A streamed evaluation dataset, read in order, each prompt ``group_size`` times."""
    return RolloutStream(
        dataset, group_size, split="eval", images_allowed=images_allowed, prompt_optional=prompt_optional
    )
