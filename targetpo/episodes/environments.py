"""Environments of multi-turn rollouts: one per sample, built by their factory once and reset with each row's
columns for every rollout; the prompt a reset makes up; the reward functions environments with ``get_reward()``
bring."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from datasets import Dataset

from .async_runner import AsyncRunner
from .tools import Toolbox, environment_tools

#: The environment lanes: the rollout made now (and evaluation), and the one played ahead (``async_rollouts``).
NOW, AHEAD = "now", "ahead"

#: The dataset column that names each row's environment when ``environment_factory`` is a dict of factories.
ENVIRONMENT_COLUMN = "environment"


class EnvironmentReward:
    """The reward function an environment with ``get_reward()`` brings: each sample's environment scores it, or with
    ``kind`` (several environments) only those of that class, the others getting None (an ``async`` get_reward runs on
    ``runner``, all samples at once)."""

    def __init__(self, name: str, runner: AsyncRunner, kind: type | None = None):
        self.__name__ = name
        self.kind = kind
        self.runner = runner

    def __call__(self, environments: Sequence[Any], **kwargs: Any) -> list[float | None]:
        rewards = [
            environment.get_reward() if self.kind is None or type(environment) is self.kind else None
            for environment in environments
        ]
        waiting = [index for index, reward in enumerate(rewards) if inspect.isawaitable(reward)]
        if waiting:
            results = self.runner.run([rewards[index] for index in waiting])
            for index, result in zip(waiting, results):
                if isinstance(result, BaseException):
                    raise result
                rewards[index] = result
        return rewards


class EnvironmentPool:
    """The environments of a rollout, one per sample: built by their factory once and reset for every rollout that
    needs them ("construct once, reset often"), so a costly environment is not rebuilt each step.

    ``factory`` is one callable, or a dict of them by name; then each row's ``environment`` column names its
    environment, and its prompt shows that environment's tools alone. A probe instance of each, built when the trainer
    is, is checked and gives its tools; each class with ``get_reward()`` brings a reward function (:attr:`rewards`).
    """

    def __init__(self, factory: Any, tools: Sequence[Callable], runner: AsyncRunner):
        self.named = isinstance(factory, dict)
        factories = factory if self.named else {None: factory}
        if not factories:
            raise ValueError("environment_factory is an empty dict: give at least one name and factory.")
        self.tools = list(tools)
        self.factories: dict[str | None, Callable[[], Any]] = {}
        # Per lane and name: the rollout made now and the one played ahead (async_rollouts) never share an object.
        self._pools: dict[tuple[str, str | None], list[tuple[Any, Toolbox]]] = {}
        self.rewards: list[EnvironmentReward] = []
        self.latest: list[Any] | None = None  # the environments of the rollout taken last, one per sample, in order
        schemas: dict[str, dict[str, Any]] = {}
        kinds_with_reward: list[type] = []
        for name, make in factories.items():
            probe = _probe_environment(name, make)
            self.factories[name] = make
            toolbox = self._add(NOW, name, probe)
            for schema in toolbox.schemas:  # every tool any environment shows, for checking the template
                schemas.setdefault(schema["function"]["name"], schema)
            kind = type(probe)
            if callable(getattr(probe, "get_reward", None)) and kind not in kinds_with_reward:
                kinds_with_reward.append(kind)  # one reward per class, even named twice
                self.rewards.append(EnvironmentReward(kind.__name__, runner, kind if self.named else None))
        self.tool_schemas = list(schemas.values())

    @property
    def names(self) -> list[str]:
        """The environments' names, when a dict of factories gave them."""
        return [name for name in self.factories if name is not None]

    def _add(self, lane: str, name: str | None, environment: Any) -> Toolbox:
        toolbox = Toolbox(self.tools + environment_tools(environment))
        self._pools.setdefault((lane, name), []).append((environment, toolbox))
        return toolbox

    def check_names(self, names: Any, where: str) -> None:
        """Refuse an environment name that no factory has."""
        unknown = sorted({name for name in names if name is None or name not in self.factories}, key=str)
        if unknown:
            missing = " (None: a row without the column)" if None in unknown else ""
            raise ValueError(
                f"The `{ENVIRONMENT_COLUMN}` column of {where} names {unknown}, which environment_factory does not "
                f"have; its environments are {self.names}{missing}."
            )

    def start(self, rows: Sequence[dict[str, Any]], lane: str = NOW) -> tuple[list[Any], list[Any], list[Toolbox]]:
        """Reset one environment per row with the row's columns: the environments, the prompts (with the text each
        reset returned added to the last message) and each sample's tools, bound to its environment. ``lane``
        (``NOW`` or ``AHEAD``) keeps the environments of a rollout played ahead apart from those in use meanwhile."""
        names = [row.get(ENVIRONMENT_COLUMN) if self.named else None for row in rows]
        if self.named:
            self.check_names(names, "a rollout's rows")
        taken: dict[str | None, int] = {}
        environments, toolboxes = [], []
        for name in names:
            index = taken[name] = taken.get(name, -1) + 1
            pool = self._pools.get((lane, name), [])
            if index == len(pool):
                self._add(lane, name, self.factories[name]())
            environment, toolbox = self._pools[(lane, name)][index]
            environments.append(environment)
            toolboxes.append(toolbox)
        prompts = [
            start_environment(environment, row, skip=ENVIRONMENT_COLUMN if self.named else None)
            for environment, row in zip(environments, rows)
        ]
        return environments, prompts, toolboxes


def _probe_environment(name: str | None, factory: Any) -> Any:
    """One environment from ``factory``, checked: it must start with ``reset(**row)``."""
    described = "environment_factory" if name is None else f"environment_factory[{name!r}]"
    if not callable(factory):
        raise TypeError(
            f"{described} must be a callable that returns a new environment (e.g. the class), got {factory!r}."
        )
    probe = factory()
    if not callable(getattr(probe, "reset", None)):
        raise ValueError(
            f"The environment {type(probe).__name__} ({described}) has no reset() method: each sample's environment "
            "is started with reset(**row), the dataset row's columns as keyword arguments."
        )
    return probe


def with_environment_rewards(
    reward_funcs: Any, reward_weights: Sequence[float] | None, rewards: Sequence[EnvironmentReward]
) -> tuple[list[Any], list[float] | None]:
    """The reward functions with the environments' appended; weights given for the others alone weigh each 1."""
    if reward_funcs is None:
        funcs = []
    elif isinstance(reward_funcs, Sequence) and not isinstance(reward_funcs, str):
        funcs = list(reward_funcs)
    else:
        funcs = [reward_funcs]
    weights = None if reward_weights is None else list(reward_weights)
    if weights is not None and len(weights) == len(funcs):
        weights += [1.0] * len(rewards)
    return funcs + list(rewards), weights


def empty_prompt() -> list[dict[str, Any]]:
    """The prompt of a row that has none, where the environment makes it up: an empty user message, which the text
    ``reset()`` returns fills."""
    return [{"role": "user", "content": ""}]


def start_environment(environment: Any, row: dict[str, Any], skip: str | None = None) -> Any:
    """Reset ``environment`` with the row's columns (but ``skip``); its prompt (the row's, or :func:`empty_prompt`
    for a row without one), with the text reset returns added to the last message."""
    observation = environment.reset(**{key: value for key, value in row.items() if key != skip})
    prompt = row["prompt"] if "prompt" in row else empty_prompt()
    if observation is None:
        return prompt
    if not isinstance(observation, str):
        raise ValueError(
            f"{type(environment).__name__}.reset() returned {type(observation).__name__}; it returns None or a string "
            "to add to the prompt's last message."
        )
    last = dict(prompt[-1])
    content = last["content"]
    # A message of content parts (text and images) takes the text as one more part.
    last["content"] = (
        content + observation if isinstance(content, str) else [*content, {"type": "text", "text": observation}]
    )
    return [*prompt[:-1], last]


def prompts_from_environments(prompts_per_rollout: int) -> Dataset:
    """The train dataset when the environment makes up each prompt in ``reset()``: one rollout's worth of empty user
    messages, read again for every rollout (``max_steps`` sets the run's length)."""
    return Dataset.from_dict({"prompt": [empty_prompt() for _ in range(prompts_per_rollout)]})
