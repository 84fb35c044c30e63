"""The tokenizer's chat template as a multi-turn rollout uses it: reading the model's calls out of its turns, and the
tokens the template writes for a tool turn between them."""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from .tools import tool_message

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
