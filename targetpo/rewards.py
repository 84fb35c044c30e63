"""Reward functions and reward models, turned into one ``(N, F)`` tensor of scores.

A reward function is called as ``f(prompts=..., completions=..., completion_ids=..., **columns, trainer_state=...)``
and returns one float, or ``None`` for "this function does not score this sample", per completion. A reward model is
a ``PreTrainedModel`` for sequence classification (or its id) whose first logit scores prompt + completion.
:func:`accuracy_reward` is a ready-made reward function for math answers.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from .modeling.loading import from_pretrained_or_explain, model_identifier, model_tokenizer

RewardFunc = Callable[..., Sequence[float | None]] | PreTrainedModel | str
#: What every reward function is given besides the dataset's columns; a column may not take these names.
REWARD_ARGUMENTS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"})
#: The largest score in magnitude: scores are held as float32.
LARGEST_SCORE = torch.finfo(torch.float32).max


def reward_name(func: Any) -> str:
    """A short, readable name for logs: the function's name or the model's id."""
    if isinstance(func, PreTrainedModel):
        return (model_identifier(func) or type(func).__name__).rstrip("/").split("/")[-1]
    if isinstance(func, functools.partial):
        return reward_name(func.func)
    return getattr(func, "__name__", type(func).__name__)


def unique_reward_names(names: Sequence[str]) -> list[str]:
    """The names, each shared one numbered in order (``f, f`` -> ``f_1, f_2``), so each function logs on its own."""
    counts = {name: names.count(name) for name in names}
    taken = {name for name in names if counts[name] == 1}
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        if counts[name] == 1:
            unique.append(name)
            continue
        number = seen.get(name, 0) + 1
        while f"{name}_{number}" in taken:  # a function already named like that keeps its name
            number += 1
        seen[name] = number
        taken.add(f"{name}_{number}")
        unique.append(f"{name}_{number}")
    return unique


def required_arguments(func: Any) -> list[str]:
    """The keyword arguments ``func`` cannot be called without (no default); none when its signature is unknown."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables
        return []
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in parameters if p.kind in keyword_kinds and p.default is inspect.Parameter.empty]


def _as_score(value: Any, name: str, index: int) -> float:
    """One returned value as a float (NaN for None), or a ValueError that names the function."""
    if value is None:
        return math.nan
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # 0-d torch or numpy values
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise ValueError(
            f"Reward function '{name}' returned {value!r} ({type(value).__name__}) for completion {index}; each entry "
            "must be a number, or None when the function does not score that completion."
        )
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(
            f"Reward function '{name}' returned {number} for completion {index}; scores must be finite (return None "
            "to leave a completion unscored)."
        )
    if abs(number) > LARGEST_SCORE:
        raise ValueError(
            f"Reward function '{name}' returned {number} for completion {index}; scores are float32, which holds at "
            f"most {LARGEST_SCORE:.4g} in magnitude: scale the scores down."
        )
    return number


def check_reward_output(output: Any, name: str, expected: int) -> list[float]:
    """Validate what a reward function returned and turn it into floats, NaN standing for None."""
    if getattr(output, "ndim", None) == 1 and hasattr(output, "tolist"):  # 1-D torch or numpy arrays
        output = output.tolist()
    if isinstance(output, (str, bytes)) or not isinstance(output, Sequence):
        raise ValueError(
            f"Reward function '{name}' must return a list with one score per completion, got {type(output).__name__}."
        )
    if len(output) != expected:
        raise ValueError(
            f"Reward function '{name}' returned {len(output)} scores for {expected} completions; it must return "
            "exactly one (a number or None) per completion."
        )
    return [_as_score(value, name, index) for index, value in enumerate(output)]


class RewardLogs:
    """What reward functions log during one rollout, through the ``log_extra`` and ``log_metric`` arguments they get:
    extra columns for the completions table (a value per completion) and scalar metrics (averaged at each log)."""

    def __init__(self, num_completions: int):
        self.num_completions = num_completions
        self.columns: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        if len(values) != self.num_completions:
            raise ValueError(
                f"log_extra({column!r}, ...) got {len(values)} values for {self.num_completions} completions: give one "
                "value per completion."
            )
        self.columns[column] = list(values)

    def log_metric(self, name: str, value: float) -> None:
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"log_metric({name!r}, ...) needs a number, got {type(value).__name__}.")
        self.metrics.setdefault(name, []).append(float(value))


def _checked_reward_sources(
    reward_funcs: Any, reward_processing_classes: Any, reward_weights: Sequence[float] | None
) -> tuple[list[Any], list[Any], Sequence[float]]:
    """The reward functions as a list, one tokenizer (or None) and one finite weight each; refused otherwise."""
    if reward_funcs is None or (
        isinstance(reward_funcs, Sequence) and not isinstance(reward_funcs, str) and not reward_funcs
    ):
        raise ValueError(
            "No reward source: pass reward_funcs (at least one reward function or reward model), or an "
            "environment_factory whose environments define get_reward()."
        )
    funcs = (
        list(reward_funcs)
        if isinstance(reward_funcs, Sequence) and not isinstance(reward_funcs, str)
        else [reward_funcs]
    )
    if reward_processing_classes is None:
        tokenizers: list[Any] = [None] * len(funcs)
    elif isinstance(reward_processing_classes, Sequence):
        tokenizers = list(reward_processing_classes)
    else:
        tokenizers = [reward_processing_classes]
    if len(tokenizers) != len(funcs):
        raise ValueError(
            f"`reward_processing_classes` has {len(tokenizers)} entries for {len(funcs)} reward functions; give one "
            "per reward function (None for plain functions)."
        )
    if reward_weights is None:
        reward_weights = [1.0] * len(funcs)
    if len(reward_weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(reward_weights)} entries but there are {len(funcs)} reward functions; give "
            "one weight per reward function."
        )
    try:  # a number, or a 0-d tensor or array; not text, which float() would read too
        numbers_given = [math.nan if isinstance(weight, (str, bytes)) else float(weight) for weight in reward_weights]
    except (TypeError, ValueError):
        numbers_given = [math.nan]
    if not all(math.isfinite(weight) for weight in numbers_given):
        raise ValueError(f"reward_weights must be finite numbers, got {list(reward_weights)}.")
    if any(abs(weight) > LARGEST_SCORE for weight in numbers_given):
        raise ValueError(
            f"reward_weights are float32, at most {LARGEST_SCORE:.4g} in magnitude: got {list(reward_weights)}."
        )
    return funcs, tokenizers, reward_weights


class RewardScorer:
    """Holds the reward functions and models with their weights, and scores a batch of completions."""

    def __init__(
        self,
        reward_funcs: RewardFunc | Sequence[RewardFunc],
        reward_processing_classes: PreTrainedTokenizerBase | Sequence[PreTrainedTokenizerBase | None] | None = None,
        reward_weights: Sequence[float] | None = None,
        model_init_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        # Conversations reach reward models through their chat templates, with the run's template settings.
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        funcs, tokenizers, reward_weights = _checked_reward_sources(
            reward_funcs, reward_processing_classes, reward_weights
        )
        self.funcs: list[Any] = []
        self.tokenizers: list[Any] = []
        for func, tokenizer in zip(funcs, tokenizers):
            if isinstance(func, str):
                kwargs = {"num_labels": 1, "trust_remote_code": trust_remote_code, **(model_init_kwargs or {})}
                func = from_pretrained_or_explain(AutoModelForSequenceClassification, func, "reward model", **kwargs)
            if isinstance(func, PreTrainedModel):
                tokenizer = self._reward_tokenizer(func, tokenizer, trust_remote_code)
                func.requires_grad_(False)
                func.eval()
            elif not callable(func):
                raise TypeError(
                    f"Each reward function must be a callable, a PreTrainedModel or a model id; got {type(func).__name__}."
                )
            self.funcs.append(func)
            self.tokenizers.append(tokenizer)
        self.names = unique_reward_names([reward_name(func) for func in self.funcs])
        # Fixed here: once prepared for a distributed engine a reward model may no longer be a PreTrainedModel.
        self.is_model = [isinstance(func, PreTrainedModel) for func in self.funcs]

        self.weights = torch.tensor([float(weight) for weight in reward_weights], dtype=torch.float32)

    @staticmethod
    def _reward_tokenizer(model: PreTrainedModel, tokenizer: Any, trust_remote_code: bool) -> PreTrainedTokenizerBase:
        """The reward model's tokenizer, with the pad id the classifier uses to find the last token."""
        tokenizer = model_tokenizer(
            model,
            tokenizer,
            trust_remote_code,
            "reward model tokenizer",
            f"Reward model {type(model).__name__} was built from a config: pass its tokenizer in "
            "`reward_processing_classes`.",
        )
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        return tokenizer

    def check_arguments(self, passed: Collection[str], source: str) -> None:
        """Refuse a reward function that needs an argument neither ``passed`` (columns) nor the standard ones give."""
        given = REWARD_ARGUMENTS | set(passed)
        for func, name, is_model in zip(self.funcs, self.names, self.is_model):
            missing = [] if is_model else [argument for argument in required_arguments(func) if argument not in given]
            if missing:
                raise ValueError(
                    f"Reward function '{name}' needs the argument(s) {missing}, which {source} does not give. Reward "
                    "functions receive each dataset column under its name (and prompts, completions, completion_ids, "
                    f"trainer_state): add or rename the column (e.g. `dataset.rename_column('answer', {missing[0]!r})`), "
                    "or give the parameter a default."
                )

    def prepare_models(self, prepare: Callable[[PreTrainedModel], Any]) -> None:
        """Place every reward model with ``prepare`` (e.g. the accelerator's ``prepare_model``)."""
        self.funcs = [prepare(func) if is_model else func for func, is_model in zip(self.funcs, self.is_model)]

    def score(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        columns: dict[str, list[Any]],
        trainer_state: Any,
        device: torch.device,
        models: bool = True,
        run_async: Callable[[list[Any]], list[Any]] | None = None,
    ) -> torch.Tensor:
        """Scores of every completion under every reward function: ``(N, F)`` float32, NaN where one returned None.

        With ``models=False`` the reward models' columns stay NaN, for :meth:`score_models` to fill in. Async reward
        functions are awaited together, concurrently, through ``run_async`` (awaitables -> results or exceptions).
        """
        scores = torch.full((len(prompts), len(self.funcs)), math.nan, dtype=torch.float32)
        arguments = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            **columns,
            "trainer_state": trainer_state,
        }
        self.check_arguments(columns, f"the rollout (its columns: {sorted(set(columns) - REWARD_ARGUMENTS)})")
        pending: dict[int, Any] = {}  # column -> the awaitable of an async reward function
        for index, (func, name) in enumerate(zip(self.funcs, self.names)):
            if self.is_model[index]:
                continue
            try:
                output = func(**arguments)
            except Exception as error:
                raise ValueError(f"Reward function '{name}' raised {type(error).__name__}: {error}") from error
            if inspect.isawaitable(output):
                pending[index] = output
            else:
                scores[:, index] = torch.tensor(check_reward_output(output, name, len(prompts)))
        if pending and run_async is None:
            for awaitable in pending.values():
                getattr(awaitable, "close", lambda: None)()
            raise ValueError("Async reward functions need an event loop to run on: pass `run_async`.")
        for index, output in zip(pending, run_async(list(pending.values())) if pending else []):
            name = self.names[index]
            if isinstance(output, Exception):
                raise ValueError(f"Reward function '{name}' raised {type(output).__name__}: {output}") from output
            scores[:, index] = torch.tensor(check_reward_output(output, name, len(prompts)))
        scores = scores.to(device)
        return self.score_models(scores, prompts, completions, device) if models else scores

    def score_models(
        self, scores: torch.Tensor, prompts: list[Any], completions: list[Any], device: torch.device
    ) -> torch.Tensor:
        """``scores`` (from ``score(..., models=False)``) with the reward models' columns filled in."""
        scores = scores.clone()
        for index, func in enumerate(self.funcs):
            if self.is_model[index]:
                model_scores = self._score_with_model(func, self.tokenizers[index], prompts, completions, device)
                if not torch.isfinite(model_scores).all():
                    first = int((~torch.isfinite(model_scores)).nonzero()[0])
                    raise ValueError(
                        f"Reward model '{self.names[index]}' scored completion {first} "
                        f"{model_scores[first].item()}; its scores must be finite (the model overflowed: load it in "
                        "float32 or bfloat16 rather than float16)."
                    )
                scores[:, index] = model_scores.to(scores.device)
        return scores

    @torch.no_grad()
    def _score_with_model(
        self,
        model: Any,
        tokenizer: PreTrainedTokenizerBase,
        prompts: list[Any],
        completions: list[Any],
        device: torch.device,
    ) -> torch.Tensor:
        if isinstance(prompts[0], str):
            texts = [prompt + completion for prompt, completion in zip(prompts, completions)]
            add_special_tokens = True
        else:
            # A prompt ending in an assistant message was continued: the completion message already includes it.
            texts = [
                tokenizer.apply_chat_template(
                    (prompt[:-1] if prompt[-1]["role"] == "assistant" else prompt) + completion,
                    tokenize=False,
                    **self.chat_template_kwargs,
                )
                for prompt, completion in zip(prompts, completions)
            ]
            add_special_tokens = False  # the chat template already wrote the special tokens
        encoded = tokenizer(
            texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=add_special_tokens
        ).to(device)
        return model(**encoded).logits[:, 0].float().cpu()


# ------------------------------------------------------------------------------------------ ready-made rewards
def accuracy_reward(completions: Sequence[Any], solution: Sequence[str], **kwargs) -> list[float | None]:
    """1.0 where a completion's answer equals its row's ``solution`` as mathematics (``\\frac{1}{2}`` and ``0.5``
    agree), else 0.0; None, leaving the sample unscored, where the solution itself cannot be read.

    The answer is read from the completion's text (LaTeX such as ``\\boxed{}`` or ``$...$`` first, else a plain
    expression) and compared by math-verify (``pip install 'targetpo[math]'``). Completions are text or a list of one
    assistant message, as for any reward function; the dataset needs a ``solution`` column.
    """
    try:
        from math_verify import parse, verify
    except ImportError as error:
        raise ImportError(
            "accuracy_reward compares answers with the math-verify package: pip install 'targetpo[math]' (or "
            "math-verify)."
        ) from error
    # math-verify times itself out with signal.alarm, which works only in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    scores: list[float | None] = []
    for completion, expected in zip(completions, solution, strict=True):
        gold = parse(expected, parsing_timeout=timeout)
        if not gold:
            scores.append(None)
            continue
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        answer = parse(text, parsing_timeout=timeout)
        scores.append(float(verify(gold, answer, timeout_seconds=timeout)))
    return scores


class RewardsUnderTRLNames:
    """The reward attributes TRL's GRPOTrainer has, read from the trainer's ``reward_scorer``, so that code reading
    them ports unchanged: the functions and models (a model id given as a string, loaded), their names, their weights,
    and each one's tokenizer (None for a function). Read-only: the scorer is built with the trainer."""

    reward_scorer: RewardScorer

    @property
    def reward_funcs(self) -> list[Any]:
        return self.reward_scorer.funcs

    @property
    def reward_func_names(self) -> list[str]:
        """Each one's name, as its metrics log it (``rewards/<name>/mean``); an environment class's ``get_reward()``
        comes last, under the class's name."""
        return list(self.reward_scorer.names)

    @property
    def reward_weights(self) -> torch.Tensor:
        return self.reward_scorer.weights

    @property
    def reward_processing_classes(self) -> list[Any]:
        return self.reward_scorer.tokenizers
