"""Multi-turn rollouts: a loop of single-turn generations on any rollout backend, with tools run between turns.

Each sample is one token sequence ``prompt | turn 1 | tool turn 1 | turn 2 | ...``: the model's turns are the tokens
it sampled, a tool turn the tokens the chat template writes for the tool results and the next assistant header. Only
the model's turns are in the loss mask. The whole completion, tool turns included, fits in ``max_completion_length``;
a sample cut by that limit, or still calling tools after ``max_tool_calling_iterations`` rounds, is truncated.

:func:`custom_rollout_completions` reads what a user's ``rollout_func`` returns into the same form.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..generation import Completions, PromptImages, RolloutBackend
from ..modeling.vision import ImagesAfterPrompt, encode_turn_with_images
from .async_runner import AsyncRunner, ToolCallLimits
from .chat_template import ConversationTemplate
from .tools import (
    INVALID_CALL_NAME,
    Toolbox,
    ToolOutcome,
    message_images,
    run_tool_calls,
    tool_message,
)

#: ``images_of_turn(samples, contexts, after)``: the images of the samples a turn continues, as the backend takes
#: them (None: none to give), ``after`` holding each one's images from tool results.
ImagesOfTurn = Callable[[list[int], list[list[int]], list[ImagesAfterPrompt]], PromptImages | None]


@dataclass
class _Sample:
    """One sample's conversation as it grows."""

    context: list[int]  # the tokens the next turn is generated after: prompt and completion so far
    ids: list[int] = field(default_factory=list)  # the completion
    loss_mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation after the prompt
    oldest_version: int | None = None
    images: ImagesAfterPrompt = field(default_factory=ImagesAfterPrompt)  # images tool results brought
    tool_rounds: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    turns: int = 0
    turn_start: int | None = None  # where in ``ids`` the model's turn under way began (None: between turns)
    done: bool = False
    truncated: bool = False


@dataclass
class MultiTurnRollout:
    """A multi-turn rollout's completions, the conversations (messages after each prompt) and per-sample counts."""

    completions: Completions
    conversations: list[list[dict[str, Any]]]
    tool_calls: list[int]
    tool_failures: list[int]
    turns: list[int]
    images: list[ImagesAfterPrompt] | None = None  # where any tool result held images: each sample's
    completion_aligned: dict[str, torch.Tensor] = field(default_factory=dict)  # their per-token extras, (N, C)


class ToolLoop:
    """Generates multi-turn samples: the model's turn, its tool calls run, their results appended, and again.

    ``any_process_active`` (for backends whose generation is collective) tells whether any process still has a
    sample to continue: every process must then generate as many turns as the busiest one. ``images_of_turn`` (for
    prompts with images, or a vision-language policy whose tools may return images) gives the images of the samples
    a turn continues, with their inputs over those contexts. With ``processor`` (a vision-language policy's) tool
    results may hold images: a tool turn's images are encoded by it, their placeholders expanded in the sample's
    tokens, and every later turn is generated with them. ``max_positions`` (the model's, None: no limit): on a backend
    that pads a call's rows together (``pads_rows_together``, ``model.generate``), every row's positions run on for
    as many tokens as the turn's budget (the most room any sample has left), so when the longest context would pass
    the limit the budget is lowered, and a sample with more room than that writes the rest of its turn in the next
    call. A backend that sends each row alone (vLLM) generates every turn in one request.
    """

    def __init__(
        self,
        template: ConversationTemplate,
        max_completion_length: int,
        max_tool_calling_iterations: int | None,
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        runner: AsyncRunner | None = None,
        limits: ToolCallLimits = ToolCallLimits(),
        processor: Any = None,
        max_positions: int | None = None,
    ):
        self.template = template
        self.max_positions = max_positions
        self.processor = processor
        self.limits = limits  # per-call timeout, sync calls side by side
        self.tokenizer = template.tokenizer
        self.max_completion_length = max_completion_length
        self.max_rounds = math.inf if max_tool_calling_iterations is None else max_tool_calling_iterations
        self.eos_token_ids = set(int(token) for token in eos_token_ids)
        self.pad_token_id = pad_token_id
        self.runner = runner if runner is not None else AsyncRunner()  # runs async tools

    def for_another_thread(self) -> ToolLoop:
        """A copy to play episodes with on another thread: a tokenizer of its own (a fast tokenizer used from two
        threads at once can refuse), the same tools, limits and event loop."""
        twin, template = copy.copy(self), copy.copy(self.template)
        template.tokenizer = twin.tokenizer = copy.deepcopy(self.tokenizer)
        if self.processor is not None:  # it encodes tool turns with images: its tokenizer is used too
            twin.processor = copy.deepcopy(self.processor)
        twin.template = template
        return twin

    def run(
        self,
        backend: RolloutBackend,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        toolboxes: Sequence[Toolbox],
        any_process_active: Callable[[bool], bool] | None = None,
        images_of_turn: ImagesOfTurn | None = None,
    ) -> MultiTurnRollout:
        samples = [_Sample(context=ids[mask.bool()].tolist()) for ids, mask in zip(prompt_ids, prompt_mask)]
        with backend.session():
            has_logps, has_versions = self._play(
                backend, samples, prompt_ids.device, toolboxes, any_process_active, images_of_turn
            )
        return self._collect(samples, prompt_ids.device, has_logps, has_versions)

    def _play(
        self,
        backend: RolloutBackend,
        samples: list[_Sample],
        device: torch.device,
        toolboxes: Sequence[Toolbox],
        any_process_active: Callable[[bool], bool] | None,
        images_of_turn: ImagesOfTurn | None,
    ) -> tuple[bool, bool]:
        """Alternate the model's turns and the tool turns until every sample is done; whether every turn came with
        the sampler's log-probs, and with weight versions."""
        has_logps = has_versions = True
        while True:
            active = [index for index, sample in enumerate(samples) if not sample.done]
            if any_process_active is not None:
                if not any_process_active(bool(active)):
                    break
            elif not active:
                break
            # Rows of a collective backend take part even with nothing left to do: one token of a stand-in row.
            rows = active or [0]
            budget = max(self.max_completion_length - len(samples[index].ids) for index in rows) if active else 1
            contexts = [samples[index].context for index in rows]
            if self.max_positions is not None and backend.pads_rows_together:
                # At least a token: a prompt limit fitted to the model leaves the longest context that much room.
                budget = max(1, min(budget, self.max_positions - max(len(context) for context in contexts)))
            ids, mask = left_pad(contexts, self.pad_token_id, device)
            # Every turn is generated with the sample's images so far (its prompt's, its tool results'), their inputs
            # over the context.
            turn_images = None
            if images_of_turn is not None:
                turn_images = images_of_turn(rows, contexts, [samples[index].images for index in rows])
            images = {} if turn_images is None else {"images": turn_images}
            generated = backend.generate(ids, mask, max_new_tokens=budget, **images)
            if not active:
                continue
            has_logps &= generated.sampler_logps is not None
            has_versions &= generated.weight_versions is not None
            requests: list[tuple[int, Toolbox | None, Any]] = []  # (sample, its toolbox, call or parse error)
            for row, index in enumerate(active):
                calls = self._read_turn(samples[index], generated, row, budget, has_logps, toolboxes[index])
                requests += [(index, toolbox, call) for toolbox, call in calls]
            self._answer_calls(samples, requests)
        return has_logps, has_versions

    def _read_turn(
        self, sample: _Sample, generated: Any, row: int, budget: int, has_logps: bool, toolbox: Toolbox
    ) -> list[tuple[Toolbox | None, Any]]:
        """Add row ``row`` of a generated turn to its sample (its tokens, log-probs and oldest weight version) and end
        the turn; returns the tool calls to answer, each with its toolbox (None and the error for a malformed call)."""
        length = int(generated.attention_mask[row].sum())
        room = self.max_completion_length - len(sample.ids)
        turn = generated.ids[row, :length].tolist()[:room]
        logps = generated.sampler_logps[row, : len(turn)].tolist() if has_logps else [0.0] * len(turn)
        if generated.weight_versions is not None:
            version = int(generated.weight_versions[row])
            sample.oldest_version = version if sample.oldest_version is None else min(sample.oldest_version, version)
        self._extend_turn(sample, turn, logps)
        if len(turn) == budget < room and turn[-1] not in self.eos_token_ids:
            return []  # cut by the budget the model's positions left this call, not by its own room: it goes on
        malformed = self._end_turn(sample, toolbox.schemas)
        if sample.done:
            return []
        if malformed is not None:
            return [(None, malformed)]
        return [(toolbox, call) for call in sample.messages[-1]["tool_calls"]]

    @staticmethod
    def _extend_turn(sample: _Sample, tokens: list[int], logps: list[float]) -> None:
        """Append tokens the model wrote (a turn, or the part of one a call wrote) to the sample."""
        if sample.turn_start is None:
            sample.turn_start = len(sample.ids)
        sample.ids += tokens
        sample.images.add_tokens(tokens)
        sample.loss_mask += [1] * len(tokens)
        sample.logps += logps
        sample.context += tokens

    def _end_turn(self, sample: _Sample, schemas: list[dict[str, Any]]) -> str | None:
        """Read the model's turn just written and mark the sample done unless it calls tools it may still call.
        Returns the error of a call that could not be read, which is answered like a failed call. ``schemas``: the
        sample's tools, which its calls are read against."""
        turn, sample.turn_start = sample.ids[sample.turn_start :], None
        ended = bool(turn) and turn[-1] in self.eos_token_ids
        prefix = self.tokenizer.decode(sample.context[: len(sample.context) - len(turn)], skip_special_tokens=False)
        text = self.tokenizer.decode(turn[:-1] if ended else turn, skip_special_tokens=False)
        message, malformed = self.template.parse(text, prefix, schemas)
        sample.turns += 1
        sample.messages.append(message)
        calls_tools = "tool_calls" in message or malformed is not None
        if not ended:  # cut by the length limit mid-turn
            sample.done = sample.truncated = True
        elif calls_tools and sample.tool_rounds >= self.max_rounds:  # still calling tools at the turn limit
            sample.done = sample.truncated = True
        elif not calls_tools:
            sample.done = True
        return malformed

    def _answer_calls(self, samples: list[_Sample], requests: list[tuple[int, Toolbox | None, Any]]) -> None:
        """Run the turn's calls, then give each sample its tool turn (or end it if the turn does not fit)."""
        runnable = [(index, toolbox, call) for index, toolbox, call in requests if toolbox is not None]
        calls, callers = [(toolbox, call) for _, toolbox, call in runnable], [index for index, _, _ in runnable]
        ran = iter(run_tool_calls(calls, self.runner, self.limits, callers, images_allowed=self.processor is not None))
        answers: dict[int, list[ToolOutcome]] = {}
        for index, toolbox, call in requests:
            outcome = next(ran) if toolbox is not None else ToolOutcome(tool_message(INVALID_CALL_NAME, call), True)
            answers.setdefault(index, []).append(outcome)
        for index, outcomes in answers.items():
            sample = samples[index]
            sample.tool_rounds += 1
            sample.tool_calls += len(outcomes)
            sample.tool_failures += sum(outcome.failed for outcome in outcomes)
            messages = [outcome.message for outcome in outcomes]
            images = [image for message in messages for image in message_images(message)]
            encoded = None
            if images:  # expanded as the processor expands a prompt's; the sample's inputs grow by its pixels
                encoded = encode_turn_with_images(self.processor, self.template.tool_turn_text(messages), images)
                tool_turn = encoded.ids
            else:
                tool_turn = self.template.tool_turn_ids(messages)
            if len(sample.ids) + len(tool_turn) >= self.max_completion_length:  # no room left for the next turn
                sample.done = sample.truncated = True
                continue
            if encoded is None:
                sample.images.add_tokens(tool_turn)
            else:
                sample.images.add_turn(encoded, images, start=len(sample.ids))
            sample.messages += messages
            sample.ids += tool_turn
            sample.loss_mask += [0] * len(tool_turn)
            sample.logps += [0.0] * len(tool_turn)
            sample.context += tool_turn

    def _collect(
        self, samples: list[_Sample], device: torch.device, has_logps: bool, has_versions: bool
    ) -> MultiTurnRollout:
        completions = pack_completions(
            [sample.ids for sample in samples],
            [sample.loss_mask for sample in samples],
            [sample.logps for sample in samples] if has_logps else None,
            [sample.truncated for sample in samples],
            self.pad_token_id,
            device,
        )
        if has_versions:
            versions = [-1 if sample.oldest_version is None else sample.oldest_version for sample in samples]
            completions.weight_versions = torch.tensor(versions, dtype=torch.long, device=device)
        rollout = MultiTurnRollout(
            completions=completions,
            conversations=[sample.messages for sample in samples],
            tool_calls=[sample.tool_calls for sample in samples],
            tool_failures=[sample.tool_failures for sample in samples],
            turns=[sample.turns for sample in samples],
        )
        if any(sample.images.images for sample in samples):
            rollout.images = [sample.images for sample in samples]
            width = completions.ids.size(1)
            keys = dict.fromkeys(key for sample in samples for key in sample.images.aligned_keys())
            rollout.completion_aligned = {
                key: torch.tensor([sample.images.aligned(key, width) for sample in samples], device=device)
                for key in keys
            }
        return rollout

    def close(self) -> None:
        self.runner.close()


def left_pad(sequences: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask of token lists, as backends take prompts."""
    width = max(len(sequence) for sequence in sequences)
    ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if sequence:
            ids[row, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
            mask[row, width - len(sequence) :] = 1
    return ids.to(device), mask.to(device)


def pack_completions(
    ids: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]],
    logps: Sequence[Sequence[float]] | None,
    truncated: Sequence[bool],
    pad_token_id: int,
    device: torch.device | str = "cpu",
) -> Completions:
    """Right-padded :class:`Completions` whose attention mask covers each completion whole (EOS tokens between turns
    included)."""
    width = max(1, max((len(row) for row in ids), default=1))
    padded = torch.full((len(ids), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(ids), width), dtype=torch.long)
    loss = torch.zeros((len(ids), width), dtype=torch.long)
    sampler = torch.zeros((len(ids), width), dtype=torch.float32) if logps is not None else None
    for row, row_ids in enumerate(ids):
        length = len(row_ids)
        padded[row, :length] = torch.tensor(list(row_ids), dtype=torch.long)
        attention[row, :length] = 1
        loss[row, :length] = torch.tensor(list(loss_masks[row]), dtype=torch.long)
        if sampler is not None:
            sampler[row, :length] = torch.tensor(list(logps[row]), dtype=torch.float32)
    return Completions(
        ids=padded.to(device),
        attention_mask=attention.to(device),
        truncated=torch.tensor(list(truncated), dtype=torch.bool, device=device),
        loss_mask=loss.to(device),
        sampler_logps=None if sampler is None else (sampler * loss).to(device),
    )


#: Keys a ``rollout_func`` result must have, and may have.
ROLLOUT_REQUIRED_KEYS = ("prompt_ids", "completion_ids")
ROLLOUT_OPTIONAL_KEYS = ("logprobs", "env_mask", "loss_mask", "truncated")


def custom_rollout_completions(
    result: Any,
    num_samples: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    vocab_size: int,
    device: Any,
    max_length: int | None = None,
) -> tuple[list[list[int]], Completions, dict[str, list[Any]]]:
    """Prompt ids, :class:`Completions` and the extra per-sample fields of what a ``rollout_func`` returned.

    Every problem is a ValueError that names the key and the sample; ``max_length`` is the most tokens a prompt and
    its completion may hold together (the model's positions). A completion is truncated when it does not end with an
    EOS token, unless ``truncated`` says otherwise.
    """
    if not isinstance(result, dict):
        raise ValueError(f"rollout_func must return a dict, got {type(result).__name__}.")
    missing = [key for key in ROLLOUT_REQUIRED_KEYS if key not in result]
    if missing:
        raise ValueError(
            f"rollout_func's result lacks {missing}: it must hold 'prompt_ids' and 'completion_ids' (a list of token "
            "ids per sample), and may hold 'logprobs', 'env_mask' (or 'loss_mask'), 'truncated' and extra fields."
        )
    if "env_mask" in result and "loss_mask" in result:
        raise ValueError("rollout_func returned both 'env_mask' and 'loss_mask': they are the same thing, give one.")
    mask_key = "env_mask" if "env_mask" in result else "loss_mask"
    prompt_ids = _token_lists(result["prompt_ids"], "prompt_ids", num_samples, vocab_size)
    completion_ids = _token_lists(result["completion_ids"], "completion_ids", num_samples, vocab_size)
    for index, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        if max_length is not None and len(prompt) + len(completion) > max_length:
            raise ValueError(
                f"rollout_func's sample {index} has {len(prompt)} prompt and {len(completion)} completion tokens, "
                f"more than the model's {max_length} positions: shorten what the loop generates."
            )
    loss_masks = _per_token(result.get(mask_key), mask_key, completion_ids, default=1)
    for index, row in enumerate(loss_masks):
        if any(value not in (0, 1) for value in row):
            raise ValueError(f"rollout_func's '{mask_key}' for sample {index} must hold only 0 and 1, got {row[:20]}.")
    logps = None
    if result.get("logprobs") is not None:
        logps = _per_token(result["logprobs"], "logprobs", completion_ids, default=0.0)
        for index, row in enumerate(logps):
            if any(not (math.isfinite(value) and value <= 1e-6) for value, on in zip(row, loss_masks[index]) if on):
                raise ValueError(
                    f"rollout_func's 'logprobs' for sample {index} must be finite log-probabilities (<= 0) on every "
                    "token in the loss mask."
                )
    eos = set(int(token) for token in eos_token_ids)
    truncated = [not row or row[-1] not in eos for row in completion_ids]
    if result.get("truncated") is not None:
        truncated = [bool(value) for value in _per_sample(result["truncated"], "truncated", num_samples)]
    completions = pack_completions(completion_ids, loss_masks, logps, truncated, pad_token_id, device)
    extra = {
        key: _per_sample(value, key, num_samples)
        for key, value in result.items()
        if key not in ROLLOUT_REQUIRED_KEYS + ROLLOUT_OPTIONAL_KEYS
    }
    return prompt_ids, completions, extra


def _per_sample(value: Any, key: str, num_samples: int) -> list[Any]:
    """A list with one entry per sample; a value that is not a list is given to every sample."""
    if not isinstance(value, (list, tuple)):
        return [value] * num_samples
    if len(value) != num_samples:
        raise ValueError(
            f"rollout_func's '{key}' has {len(value)} entries for {num_samples} prompts; give one per prompt (the "
            "prompts it received already repeat each dataset prompt num_generations times)."
        )
    return list(value)


def _token_lists(value: Any, key: str, num_samples: int, vocab_size: int) -> list[list[int]]:
    rows = _per_sample(value, key, num_samples) if isinstance(value, (list, tuple)) else None
    if rows is None:
        raise ValueError(f"rollout_func's '{key}' must be a list with a list of token ids per sample.")
    lists = []
    for index, row in enumerate(rows):
        if torch.is_tensor(row):
            row = row.tolist()
        if not isinstance(row, (list, tuple)) or not all(isinstance(token, int) for token in row):
            raise ValueError(f"rollout_func's '{key}' for sample {index} must be a list of token ids (ints).")
        if any(not 0 <= token < vocab_size for token in row):
            raise ValueError(
                f"rollout_func's '{key}' for sample {index} holds ids outside the vocabulary (0..{vocab_size - 1})."
            )
        lists.append(list(row))
    if key == "completion_ids" and any(not row for row in lists):
        raise ValueError(
            f"rollout_func returned an empty completion for sample {[bool(r) for r in lists].index(False)}."
        )
    if key == "prompt_ids" and any(not row for row in lists):
        raise ValueError(f"rollout_func returned an empty prompt for sample {[bool(r) for r in lists].index(False)}.")
    return lists


def _per_token(value: Any, key: str, completion_ids: list[list[int]], default: Any) -> list[list[Any]]:
    if value is None:
        return [[default] * len(row) for row in completion_ids]
    rows = _per_sample(value, key, len(completion_ids)) if isinstance(value, (list, tuple)) else None
    if rows is None:
        raise ValueError(f"rollout_func's '{key}' must be a list with one list per sample.")
    lists = []
    for index, (row, ids) in enumerate(zip(rows, completion_ids)):
        if torch.is_tensor(row):
            row = row.tolist()
        if not isinstance(row, (list, tuple)) or len(row) != len(ids):
            size = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
            raise ValueError(
                f"rollout_func's '{key}' for sample {index} must have one entry per completion token ({len(ids)}), got "
                f"{size}."
            )
        lists.append([float(entry) if isinstance(default, float) else int(entry) for entry in row])
    return lists


def check_multi_turn_arguments(tools: Sequence[Callable], environment_factory: Any, rollout_func: Any) -> None:
    """Refuse impossible combinations of tools, environments and ``rollout_func`` before any work."""
    for tool in tools:
        if not callable(tool):
            raise TypeError(f"Every tool must be a callable (a typed function with a docstring), got {tool!r}.")
    if rollout_func is not None:
        if not callable(rollout_func):
            raise TypeError(f"rollout_func must be callable as rollout_func(prompts, trainer), got {rollout_func!r}.")
        if tools or environment_factory is not None:
            raise ValueError(
                "rollout_func replaces the trainer's generation, tool loop included: pass tools and environments to "
                "your own loop instead of to the trainer, or drop rollout_func."
            )


def conversation_text(messages: list[dict[str, Any]]) -> str:
    """A conversation for the completions table: each message on a line, tool calls and results by name."""
    lines = []
    for message in messages:
        calls = ", ".join(
            f"{call['function'].get('name')}({call['function'].get('arguments', {})})"
            for call in message.get("tool_calls") or []
            if isinstance(call, dict) and isinstance(call.get("function"), dict)
        )
        role = message["role"] if message["role"] != "tool" else f"tool {message.get('name', '')}".rstrip()
        text = f"{role}: {message.get('content') or ''}"
        lines.append(f"{text} -> {calls}" if calls else text)
    return "\n".join(lines)
