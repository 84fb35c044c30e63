"""Human-readable views of a rollout: the completions table printed when ``log_completions`` is on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass
class RolloutTable:
    """The latest training rollout, over all processes, in generation order (groups are contiguous)."""

    step: int
    prompts: list[str]
    completions: list[str]
    rewards: dict[str, list[float]]  # reward function name -> score per completion (NaN: not scored)
    total_rewards: list[float]
    rollout: int = 0  # which rollout this is, so targets of a later one are not written into it
    targets: list[float] = field(default_factory=list)  # q per completion; NaN until its step computes it

    def __post_init__(self) -> None:
        if not self.targets:
            self.targets = [math.nan] * len(self.completions)

    def fill_targets(self, indices: list[int], values: list[float]) -> None:
        for index, value in zip(indices, values):
            if 0 <= index < len(self.targets):
                self.targets[index] = value


def _number(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.3f}"


def _text(value: Any, limit: int = 200) -> str:
    text = str(value).replace("\n", "⏎ ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def print_completions_table(table: RolloutTable, max_rows: int | None = None, console: Console | None = None) -> None:
    """Print prompt, completion, each reward, the total and the target q, a row per completion."""
    view = Table(title=f"Completions at step {table.step}", show_lines=False, expand=False)
    view.add_column("Prompt", overflow="fold", max_width=40)
    view.add_column("Completion", overflow="fold", max_width=60)
    for name in table.rewards:
        view.add_column(name, justify="right")
    view.add_column("Reward", justify="right", style="bold")
    view.add_column("Target q", justify="right", style="cyan")
    rows = len(table.completions) if max_rows is None else min(max_rows, len(table.completions))
    for index in range(rows):
        view.add_row(
            _text(table.prompts[index]),
            _text(table.completions[index]),
            *(_number(scores[index]) for scores in table.rewards.values()),
            _number(table.total_rewards[index]),
            _number(table.targets[index]),
        )
    (console or Console()).print(view)
