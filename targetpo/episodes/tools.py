"""Tools for multi-turn rollouts: their schemas, and running the model's calls (reading calls out of the model's text
and writing the tool turns is :mod:`targetpo.episodes.chat_template`'s; the event loop they run on,
:mod:`targetpo.episodes.async_runner`'s).

A tool is a plain typed Python function (sync or ``async``) with a Google-style docstring; transformers turns it into
the JSON schema a chat template renders (``apply_chat_template(tools=...)``). An environment's public methods are
tools too. Whatever a call does wrong — an unknown name, bad arguments, an exception inside the tool, text that is
not a well-formed call — comes back to the model as a tool message that says so: it never stops the run.
"""

from __future__ import annotations

import functools
import inspect
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.utils.chat_template_utils import get_json_schema

from .async_runner import TIMED_OUT, AsyncRunner, ToolCallLimits

#: The tool name under which text that opens a call but cannot be parsed is answered.
INVALID_CALL_NAME = "invalid_tool_call"

#: Methods of an environment that are never tools.
ENVIRONMENT_HOOKS = frozenset({"reset", "get_reward"})


def tool_schema(tool: Callable) -> dict[str, Any]:
    """The JSON schema of a tool, or a ValueError naming the tool and what its definition lacks."""
    name = getattr(tool, "__name__", type(tool).__name__)
    if not callable(tool):
        raise TypeError(f"Tool {name!r} is not callable: tools are plain Python functions or methods.")
    try:
        return get_json_schema(tool)
    except Exception as error:  # transformers raises its own schema errors (missing docstring, type hints, ...)
        raise ValueError(
            f"Tool {name!r} cannot be described to the model: {error}. A tool needs a type hint on every argument "
            "and a Google-style docstring with an `Args:` section describing each one."
        ) from error


def environment_tools(environment: Any) -> list[Callable]:
    """An environment's tools: its public methods other than ``reset`` and ``get_reward``."""
    tools = []
    for name in dir(type(environment)):
        if name.startswith("_") or name in ENVIRONMENT_HOOKS:
            continue
        static = inspect.getattr_static(environment, name)
        if inspect.isdatadescriptor(static) or isinstance(static, functools.cached_property):
            continue  # state (a property, a slot), not a tool: read before reset() it may not exist yet
        member = getattr(environment, name)
        if inspect.ismethod(member) or inspect.isfunction(member):
            tools.append(member)
    return tools


@dataclass
class ToolOutcome:
    """What one call gave back: the tool message for the model, and whether the call failed."""

    message: dict[str, Any]
    failed: bool


class Toolbox:
    """Callables by name, with their schemas; runs a model's tool calls."""

    def __init__(self, tools: Sequence[Callable]):
        self.schemas = [tool_schema(tool) for tool in tools]
        self.functions: dict[str, Callable] = {}
        for tool, schema in zip(tools, self.schemas):
            name = schema["function"]["name"]
            if name in self.functions:
                raise ValueError(f"Two tools are named {name!r}: tool names must be unique.")
            self.functions[name] = tool

    def bind(self, call: dict[str, Any]) -> tuple[str, Callable[[], Any] | None, str | None]:
        """The called name and a zero-argument function making the call, or an error text for the model."""
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return INVALID_CALL_NAME, None, f"Error: a tool call needs a function name, got {call!r}."
        name = function["name"]
        tool = self.functions.get(name)
        if tool is None:
            return name, None, f"Error: there is no tool named {name!r}. Available tools: {', '.join(self.functions)}."
        arguments = function.get("arguments")
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):  # some templates leave the arguments as JSON text
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                return name, None, f"Error: the arguments of {name!r} are not valid JSON: {error}."
        if not isinstance(arguments, dict):
            return name, None, f"Error: the arguments of {name!r} must be an object, got {arguments!r}."
        try:
            inspect.signature(tool).bind(**arguments)
        except TypeError as error:
            return name, None, f"Error: wrong arguments for {name!r}: {error}."
        return name, lambda: tool(**arguments), None


def tool_message(name: str, content: Any) -> dict[str, Any]:
    """A tool message; non-text results are written as JSON where they can be."""
    if not isinstance(content, str):
        try:
            content = json.dumps(content)
        except (TypeError, ValueError):
            content = str(content)
    return {"role": "tool", "name": name, "content": content}


def _holds_image(content: Any) -> bool:
    """Whether a tool result is or holds an image: a PIL image or a content part of type image, alone or in a list."""
    if isinstance(content, (list, tuple)):
        return any(_holds_image(item) for item in content)
    if isinstance(content, dict):
        return content.get("type") in ("image", "image_url")
    return _is_pil_image(content)


def _is_pil_image(value: Any) -> bool:
    return type(value).__module__.startswith("PIL.")


def message_images(message: dict[str, Any]) -> list[Any]:
    """The images a message's content parts hold, in order."""
    content = message.get("content")
    if not isinstance(content, list):
        return []
    return [part["image"] for part in content if isinstance(part, dict) and part.get("type") == "image"]


def image_content(name: str, result: Any) -> list[dict[str, Any]]:
    """A result holding images as content parts: ``{"type": "image", "image": ...}`` for each image (a PIL image, or
    a part of type image holding one), ``{"type": "text", "text": ...}`` for the rest (text parts, strings, other
    values written as JSON). A ValueError names what cannot be shown to the model."""
    items = list(result) if isinstance(result, (list, tuple)) else [result]
    parts = []
    for item in items:
        if _is_pil_image(item):
            parts.append({"type": "image", "image": item})
        elif isinstance(item, dict) and item.get("type") == "image":
            if item.get("image") is None:
                raise ValueError(
                    f"{name} returned an image part without its image: give the image itself, "
                    "{'type': 'image', 'image': <PIL image>}."
                )
            parts.append({"type": "image", "image": item["image"]})
        elif isinstance(item, dict) and item.get("type") == "image_url":
            raise ValueError(
                f"{name} returned an image_url part: the trainer needs the pixels, so return the image itself, "
                "{'type': 'image', 'image': <PIL image>}."
            )
        elif isinstance(item, dict) and item.get("type") == "text":
            parts.append({"type": "text", "text": str(item.get("text", ""))})
        else:
            parts.append({"type": "text", "text": tool_message(name, item)["content"]})
    return parts


def _result_outcome(name: str, result: Any, images_allowed: bool = False) -> ToolOutcome:
    """A tool's result as its outcome; a result that cannot be written as text (its ``str()`` raises, or it nests too
    deep) fails the call with an error the model sees, like any failed call."""
    try:
        return _written_outcome(name, result, images_allowed)
    except Exception as error:
        kind = type(result).__name__
        text = f"Error: {name} returned a {kind} that cannot be written as text ({type(error).__name__})."
        return ToolOutcome(tool_message(name, text), failed=True)


def _written_outcome(name: str, result: Any, images_allowed: bool) -> ToolOutcome:
    """A tool's result as its outcome. Images reach a vision-language policy (``images_allowed``: it is trained with
    its processor) as content parts. A text-only policy cannot see them, and written as text an image would read as
    a Python object: the call fails with an error the model sees (the run goes on, like any failed call)."""
    if not _holds_image(result):
        return ToolOutcome(tool_message(name, result), failed=False)
    if images_allowed:
        try:
            parts = image_content(name, result)
        except ValueError as error:
            return ToolOutcome(tool_message(name, f"Error: {error}"), failed=True)
        return ToolOutcome({"role": "tool", "name": name, "content": parts}, failed=False)
    # Python shows a warning once per tool (same text, same place) unless its filters ask for more.
    warnings.warn(
        f"The tool {name!r} returned an image, which a text-only policy cannot read, so the call is answered with an "
        "error. Images in tool results need a vision-language model trained with its processor "
        "(processing_class=AutoProcessor.from_pretrained(...)); otherwise return text from tools.",
        stacklevel=3,
    )
    error = f"Error: {name} returned an image; this model reads text only. Return text."
    return ToolOutcome(tool_message(name, error), failed=True)


def run_tool_calls(
    calls: Sequence[tuple[Toolbox, dict[str, Any]]],
    runner: AsyncRunner,
    limits: ToolCallLimits = ToolCallLimits(),
    samples: Sequence[int] | None = None,
    images_allowed: bool = False,
) -> list[ToolOutcome]:
    """Run every call of a turn, over all samples (``samples``: the sample that made each call, its calls in its
    order; by default each call its own): async tools of every sample at once; sync tools one after another, or side
    by side across samples (``limits``); a call past the timeout is answered with an error and the turn goes on.
    ``images_allowed``: results may hold images (a vision-language policy), given to the model as content parts."""
    outcomes: list[ToolOutcome | None] = [None] * len(calls)
    by_sample: dict[int, list[tuple[int, str, Callable[[], Any]]]] = {}
    samples = range(len(calls)) if samples is None else samples
    for index, (sample, (toolbox, call)) in enumerate(zip(samples, calls, strict=True)):
        name, invoke, problem = toolbox.bind(call)
        if invoke is None:
            outcomes[index] = ToolOutcome(tool_message(name, problem), failed=True)
        else:
            by_sample.setdefault(sample, []).append((index, name, invoke))
    in_order = [entry for entries in by_sample.values() for entry in entries]
    if limits.off_thread:
        results = runner.run_sample_calls(list(by_sample.values()), limits)
    else:  # sync tools here, in order; then the async ones, all at once
        results, waiting = [], []
        for position, (_, _, invoke) in enumerate(in_order):
            try:
                result = invoke()
            except Exception as error:
                result = error
            if inspect.isawaitable(result):
                waiting.append((position, result))
            results.append(result)
        awaited = runner.run([awaitable for _, awaitable in waiting]) if waiting else []
        for (position, _), result in zip(waiting, awaited):
            results[position] = result
    for (index, name, _), result in zip(in_order, results):
        outcomes[index] = _outcome(name, result, limits.timeout, images_allowed)
    return outcomes  # type: ignore[return-value]


def _outcome(name: str, result: Any, timeout: float | None = None, images_allowed: bool = False) -> ToolOutcome:
    """A call's outcome from what it returned, or from the exception it raised (a timeout included)."""
    if result is TIMED_OUT:
        text = f"Error: {name} did not finish within {timeout:g} s (tool_call_timeout); it was given up."
        return ToolOutcome(tool_message(name, text), failed=True)
    if isinstance(result, Exception):
        return ToolOutcome(tool_message(name, _error_text(name, result)), failed=True)
    return _result_outcome(name, result, images_allowed)


def _error_text(name: str, error: BaseException) -> str:
    try:
        detail = str(error)
    except Exception:  # an exception whose message itself fails
        detail = "(its message cannot be written as text)"
    return f"Error: {name} raised {type(error).__name__}: {detail}"
