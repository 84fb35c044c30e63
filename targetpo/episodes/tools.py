"""Tools for multi-turn rollouts: schemas, running the model's calls, reading calls out of its text, and the tokens
a chat template writes between the model's turns.

A tool is a plain typed Python function (sync or ``async``) with a Google-style docstring; transformers turns it into
the JSON schema a chat template renders (``apply_chat_template(tools=...)``). An environment's public methods are
tools too. Whatever a call does wrong — an unknown name, bad arguments, an exception inside the tool, text that is
not a well-formed call — comes back to the model as a tool message that says so: it never stops the run.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from transformers.utils.chat_template_utils import get_json_schema

#: How a Hermes-style template (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, used by Qwen2.5/3 and
#: many others) marks calls, for tokenizers and models with no response template of their own. Its start anchor is
#: the chat template's own assistant header, filled in by :func:`hermes_response_template`.
HERMES_FIELDS = {
    "content": {},
    "tool_calls": {
        "open": "<tool_call>",
        "close": "</tool_call>",
        "content": "json",
        "repeats": True,
        "transform": {"type": "function", "function": "{content}"},
    },
}

#: What a call given up at its timeout returns in place of a result.
TIMED_OUT = object()

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
        stacklevel=2,
    )
    error = f"Error: {name} returned an image; this model reads text only. Return text."
    return ToolOutcome(tool_message(name, error), failed=True)


@dataclass(frozen=True)
class ToolCallLimits:
    """How a turn's calls run: ``timeout`` seconds at most per call (None: no limit), and at most ``concurrency``
    sync calls of different samples at once (1: one after another in the training process)."""

    timeout: float | None = None
    concurrency: int = 1

    @property
    def off_thread(self) -> bool:
        """Whether sync tools run on threads of their own: to be waited for with a timeout, or side by side."""
        return self.timeout is not None or self.concurrency > 1


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
    return f"Error: {name} raised {type(error).__name__}: {error}"


class AsyncRunner:
    """Runs coroutines on an event loop of its own, in a background thread.

    A loop of its own works whether or not the caller is already inside a running loop (a notebook), where
    ``asyncio.run`` would refuse.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._starting = threading.Lock()  # episodes played ahead call it from their own thread too

    def run(self, awaitables: Sequence[Any]) -> list[Any]:
        """The results of all ``awaitables``, run concurrently; an exception is returned in place of its result."""
        with self._starting:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="targetpo-tools", daemon=True)
                self._thread.start()

        async def gather() -> list[Any]:
            return await asyncio.gather(*map(_returning_errors, awaitables), return_exceptions=True)

        results = asyncio.run_coroutine_threadsafe(gather(), self._loop).result()
        interrupted = next((result.error for result in results if isinstance(result, _Interrupted)), None)
        if interrupted is not None:  # a SystemExit or KeyboardInterrupt ends the run, as in the training process
            raise interrupted
        return results

    def run_sample_calls(
        self, samples: Sequence[Sequence[tuple[int, str, Callable[[], Any]]]], limits: ToolCallLimits
    ) -> list[Any]:
        """Each sample's calls in order, the samples side by side: sync tools on a thread each, at most
        ``limits.concurrency`` at once; every call bounded by ``limits.timeout``. Results (or exceptions) in order."""
        slots: asyncio.Semaphore | None = None

        async def call(invoke: Callable[[], Any]) -> Any:
            """Its result, the exception the tool raised, or TIMED_OUT."""
            clock = asyncio.get_running_loop().time
            try:
                async with slots:  # the timeout counts from the call's start, not while it queues
                    started = clock()
                    result = await asyncio.wait_for(_in_thread(invoke), limits.timeout)
                if inspect.isawaitable(result):  # an async tool: the thread only made its coroutine
                    left = None if limits.timeout is None else limits.timeout - (clock() - started)
                    result = await asyncio.wait_for(_returning_errors(result), left)
                return result
            except asyncio.TimeoutError:  # the tool's own errors come back as values, so this is the timeout
                return TIMED_OUT

        async def sample_calls(calls: Sequence[tuple[int, str, Callable[[], Any]]]) -> list[Any]:
            return [await call(invoke) for _, _, invoke in calls]

        async def every_sample() -> list[Any]:
            nonlocal slots
            slots = asyncio.Semaphore(limits.concurrency)  # made on the loop that uses it
            return await asyncio.gather(*(sample_calls(calls) for calls in samples))

        (per_sample,) = self.run([every_sample()])
        if isinstance(per_sample, BaseException):  # not a tool's error (those are values): it ends the run
            raise per_sample
        results = [result for results in per_sample for result in results]
        interrupted = next((result.error for result in results if isinstance(result, _Interrupted)), None)
        if interrupted is not None:
            raise interrupted
        return results

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            self._loop = self._thread = None


class _Interrupted(Exception):
    """A tool's SystemExit or KeyboardInterrupt, carried out of its thread to be raised in the training process."""

    def __init__(self, error: BaseException):
        super().__init__(repr(error))
        self.error = error


async def _returning_errors(awaitable: Any) -> Any:
    """The awaitable's result, or the exception it raised as a value (a SystemExit or KeyboardInterrupt carried as
    ``_Interrupted``: raised on the loop, either would stop the loop's thread and leave its caller waiting forever)."""
    try:
        return await awaitable
    except Exception as error:
        return error
    except (SystemExit, KeyboardInterrupt) as error:
        return _Interrupted(error)


def _in_thread(invoke: Callable[[], Any]) -> asyncio.Future:
    """``invoke()`` (its result, or the exception it raised) on a daemon thread of its own, as a future of the running
    loop. Not a pool: a call that hangs past its timeout keeps its thread, and must not hold up the calls after it (nor
    the interpreter's exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():  # given up by then: nobody waits for it
            outcome()

    def hand_over(outcome: Callable[[], None]) -> None:
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop is closed: the run ended while this call, given up, ran on
            pass

    def work() -> None:
        try:
            result = invoke()
        except Exception as error:  # a value, told apart from the timeout: the model is answered with it
            result = error
        except BaseException as error:  # SystemExit, KeyboardInterrupt: not the model's to read; they end the run
            result = _Interrupted(error)  # carried as a value: raised in the loop it would stop the loop itself
        hand_over(lambda: future.set_result(result))

    threading.Thread(target=work, name="targetpo-tool-call", daemon=True).start()
    return future


class ConversationTemplate:
    """The tokenizer's chat template as a multi-turn rollout uses it: read the model's turns, write the tool turns.

    ``schemas`` are the tools rendered into every prompt. The model's calls are read with transformers' response
    parsing (``tokenizer.parse_response``) and the template :func:`response_template` finds. ``eos_token_ids`` must
    hold the template's end-of-turn token; ``added_stop_token_ids`` (those ``generation_kwargs`` added) may hold no
    other: both are checked here, as is that the template renders tool turns apart from the model's text.
    """

    def __init__(
        self,
        tokenizer: Any,
        schemas: list[dict[str, Any]],
        eos_token_ids: Sequence[int],
        chat_template_kwargs: dict[str, Any] | None = None,
        model_type: str | None = None,
        added_stop_token_ids: Sequence[int] = (),
    ):
        self.tokenizer = tokenizer
        self.schemas = schemas
        self.template_kwargs = dict(chat_template_kwargs or {})
        self._family = repr(model_type) if model_type else "policy's"
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "Tools need a chat template that renders them: the tokenizer has none. Set `tokenizer.chat_template`."
            )
        self.eos_texts = [tokenizer.convert_ids_to_tokens(int(token)) for token in eos_token_ids]
        self._check_renders_tools()  # first: finding the response template renders a conversation too
        self.response_template = response_template(tokenizer, model_type, self.template_kwargs)
        if self.response_template is None and schemas:
            raise ValueError(
                "The tokenizer has no `response_template`, so the model's tool calls cannot be read from its output. "
                "Set `tokenizer.response_template` to a transformers response template for your chat format (see "
                "docs/multi_turn.md), or write your own loop with `rollout_func`."
            )
        self._check_stop_tokens(added_stop_token_ids)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.schemas or None,  # some templates write tool boilerplate even for an empty list
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def parse(
        self, text: str, prefix: str, schemas: list[dict[str, Any]] | None = None
    ) -> tuple[dict[str, Any], str | None]:
        """The assistant message in ``text`` (the model's turn, without its EOS) and, if the text opens a tool call
        that cannot be read, what is wrong with it. ``schemas``: the tools this sample's prompt shows (its
        environment's), else every tool; a call's arguments are cast to its tool's parameter types."""
        schemas = self.schemas if schemas is None else schemas
        if not schemas:  # no tools: every turn is an answer
            return {"role": "assistant", "content": text}, None
        try:
            parsed = self.tokenizer.parse_response(text, self.response_template, prefix=prefix, tools=schemas)
        except (ValueError, TypeError, KeyError) as error:
            return {"role": "assistant", "content": text}, f"Error: the tool call could not be read: {error}"
        message = {"role": "assistant", "content": parsed.get("content") or ""}
        calls = parsed.get("tool_calls")
        if calls:
            message["tool_calls"] = calls if isinstance(calls, list) else [calls]
        return message, None

    def tool_turn_ids(self, tool_messages: list[dict[str, Any]]) -> list[int]:
        """The tokens after the model's end-of-turn token up to the start of its next turn: the rest of the template's
        assistant turn, the tool messages and the next assistant header.

        Rendered after a stand-in exchange rather than the real conversation, and cut where the stand-in assistant's
        turn ends, so that nothing the model wrote is rendered again: a template that rewrites earlier assistant turns
        (Qwen3 drops their reasoning and writes an empty think block only on the last one) cannot change the tokens
        the model is trained on.
        """
        return self.tokenizer(self.tool_turn_text(tool_messages), add_special_tokens=False)["input_ids"]

    def tool_turn_text(self, tool_messages: list[dict[str, Any]]) -> str:
        """The text of :meth:`tool_turn_ids` before tokenizing (a processor encodes it with the messages' images)."""
        return self._tool_turn_after(_STAND_IN, tool_messages)

    def _tool_turn_after(self, content: str, tool_messages: list[dict[str, Any]]) -> str:
        """The text after a stand-in assistant turn (writing ``content`` and a call) up to the next assistant header.

        The assistant's turn, from its content (or, for a template that writes only the call, from the start) to its
        end-of-turn token, must render the same alone and with tool messages after it: the model writes it itself."""
        exchange = self._stand_in_exchange(content)
        alone = self.render(exchange, add_generation_prompt=False)
        followed = self.render(exchange + tool_messages, add_generation_prompt=True)
        start, start_followed = (alone.find(_STAND_IN), followed.find(_STAND_IN)) if _STAND_IN in alone else (0, 0)
        turn = alone[start : self._turn_end(alone, start)[0]]
        if start_followed < 0 or not followed.startswith(turn, start_followed):
            raise ValueError(
                f"The chat template of this {self._family} model renders an assistant turn differently once tool "
                "messages follow it (its text or its end-of-turn token change), so the tokens the model wrote would "
                "not match the conversation it is trained on. Set `tokenizer.chat_template` to a template that "
                "renders an assistant turn the same whatever follows it, or write your own loop with `rollout_func`."
            )
        return followed[start_followed + len(turn) :]

    def _stand_in_exchange(self, content: str) -> list[dict[str, Any]]:
        name = self.schemas[0]["function"]["name"] if self.schemas else "tool"
        return [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": content, "tool_calls": [_call(name)]},
        ]

    def _turn_end(self, alone: str, start: int) -> tuple[int, str | None]:
        """Where the assistant's turn that ``alone`` renders last (from ``start``) ends, and the stop token that ends
        it: the last stop token in the text (None, and the text's end, if it holds none)."""
        ends = [(alone.rfind(eos) + len(eos), eos) for eos in self.eos_texts if eos and eos in alone[start:]]
        return max(ends, default=(len(alone), None))

    def _end_of_turn_token(self) -> str | None:
        """The stop token that ends an assistant turn (with a call) in the chat template, None if the turn holds none."""
        alone = self.render(self._stand_in_exchange(_STAND_IN), add_generation_prompt=False)
        return self._turn_end(alone, max(alone.find(_STAND_IN), 0))[1]

    def _check_stop_tokens(self, added_stop_token_ids: Sequence[int]) -> None:
        """Refuse stop tokens added in ``generation_kwargs`` that are not the template's end-of-turn token: a turn
        that stops on one (say ``</tool_call>``) is read without it, so its call cannot be, and the tool turn would
        follow without the end-of-turn token the template writes."""
        if not self.schemas or not added_stop_token_ids:
            return
        end_of_turn = self._end_of_turn_token()
        stray = [self.tokenizer.convert_ids_to_tokens(int(token)) for token in added_stop_token_ids]
        stray = [text for text in stray if text != end_of_turn]
        if stray:
            raise ValueError(
                f"generation_kwargs stop token(s) {stray} would end the model's turn in a tool rollout, but the chat "
                f"template ends an assistant turn with {end_of_turn!r}: a turn stopped early is read without its stop "
                "token (a call cut at '</tool_call>' cannot be read) and the tool turn would follow without the "
                "template's end-of-turn token. Leave them out of generation_kwargs (eos_token_id / stop_token_ids); "
                "the model's turn ends at its end-of-turn token."
            )

    def _check_renders_tools(self) -> None:
        """Refuse, before any work, a template that cannot render a tool exchange, or whose tool turn cannot be cut
        from what the model wrote (the assistant turn changes once tools follow it, or the tool turn depends on it)."""
        if not self.schemas:
            return
        probe = [tool_message(self.schemas[0]["function"]["name"], "ok")]
        try:
            turns = {self._tool_turn_after(content, probe) for content in _STAND_IN_TURNS}
        except ValueError:
            raise
        except Exception as error:  # jinja errors: the template does not know tool calls or tool messages
            raise ValueError(
                f"The chat template cannot render a tool exchange (user, assistant with tool_calls, tool): {error}. "
                "Use a chat template that supports tools."
            ) from error
        if self._end_of_turn_token() is None:
            turn = self.render(self._stand_in_exchange(_STAND_IN), add_generation_prompt=False).split(_STAND_IN)[-1]
            raise ValueError(
                f"No stop token ({self.eos_texts}) is in the chat template's assistant turn (after its text: "
                f"{turn!r}), so generation would not stop where the model's turn ends and every tool rollout would run "
                "on to max_completion_length. Add the template's end-of-turn token to the stop tokens, e.g. "
                "generation_kwargs={'eos_token_id': tokenizer.convert_tokens_to_ids('<|im_end|>')} for ChatML "
                "templates, or set the tokenizer's eos_token to it."
            )
        if len(turns) > 1:
            raise ValueError(
                f"The chat template of this {self._family} model writes the tool messages differently depending on "
                "what the assistant wrote before them, so the tool turn cannot be rendered apart from the model's "
                "tokens. Set `tokenizer.chat_template` to a template whose tool messages do not depend on earlier "
                "assistant text, or write your own loop with `rollout_func`."
            )


def response_template(
    tokenizer: Any, model_type: str | None = None, template_kwargs: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """How to read the model's turns: the tokenizer's own ``response_template``; else the one transformers keeps for
    the model type (Qwen2/2.5/3/3.5, Gemma 4, ...); else, for chat templates that write ``<tool_call>`` markup, the
    Hermes format anchored at the template's assistant header; else None."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own
    header = generation_prompt(tokenizer, template_kwargs or {})
    if model_type is not None:
        try:  # transformers keeps its per-model templates beside its server, a part older releases do not have
            from transformers.cli.serving.utils import get_response_template
        except Exception as error:  # missing, or a broken optional dependency of transformers' server
            warnings.warn(
                f"transformers' per-model response templates cannot be imported ({type(error).__name__}: {error}), so "
                f"this {model_type} model's turns are read as Hermes-style tool calls, if its chat template writes "
                "them, with any reasoning left in the message content. Upgrade or repair transformers (its serving "
                "module), or set tokenizer.response_template.",
                stacklevel=2,
            )
            known = None
        else:
            try:
                known = get_response_template(tokenizer, SimpleNamespace(config=SimpleNamespace(model_type=model_type)))
            except Exception:  # one it cannot build for this tokenizer: read as without one
                known = None
        # Only for the chat format it was written for: a custom template on the same model may mark calls otherwise.
        if known is not None and _anchored_in(known, header):
            return known
    if "<tool_call>" not in str(getattr(tokenizer, "chat_template", "")):
        return None
    return {"start_anchor": header, "fields": HERMES_FIELDS}


def _anchored_in(template: dict[str, Any], header: str) -> bool:
    """Whether a response template's start anchor is found in the chat template's assistant header."""
    anchors = template.get("start_anchor") or []
    anchors = [anchors] if isinstance(anchors, str) else list(anchors)
    pattern = template.get("start_anchor_pattern")
    return any(anchor in header for anchor in anchors) or (
        pattern is not None and re.search(pattern, header) is not None
    )


def generation_prompt(tokenizer: Any, template_kwargs: dict[str, Any]) -> str:
    """The text a chat template writes to open the assistant's turn (what ``add_generation_prompt`` adds)."""
    messages = [{"role": "user", "content": "x"}]
    without = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return with_prompt[len(without) :] if with_prompt.startswith(without) else with_prompt


#: What the stand-in assistant turn writes before its call, in two forms: the tool turn after it must be the same for
#: both (checked once, when the template is built), so that it depends on nothing the model writes (reasoning
#: templates render a turn with a think block differently from one without).
_STAND_IN = "(stand-in turn)"
_STAND_IN_TURNS = (_STAND_IN, f"<think>\nreasoning\n</think>\n\n{_STAND_IN}")


def _call(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": {}}}
