"""The completions table: printed when ``log_completions`` is on, logged to wandb and trackio, and pushed to the Hub."""

from __future__ import annotations

import math
import sys
import warnings
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
    extra: dict[str, list[Any]] = field(default_factory=dict)  # columns reward functions logged (log_extra)
    unique_prompts: bool = False  # write each prompt once, on its first completion's row
    sent_to_trackers: bool = False  # logged to wandb/trackio already (once per rollout, at its first log)

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


def written_prompts(table: RolloutTable) -> list[Any]:
    """Each row's prompt; with ``unique_prompts``, None on the rows that repeat the row before's (a group's)."""
    return [
        None if table.unique_prompts and index > 0 and prompt == table.prompts[index - 1] else prompt
        for index, prompt in enumerate(table.prompts)
    ]


def print_completions_table(table: RolloutTable, max_rows: int | None = None, console: Console | None = None) -> None:
    """Print prompt, completion, each reward, the total and the target q, a row per completion."""
    view = Table(title=f"Completions at step {table.step}", show_lines=False, expand=False)
    view.add_column("Prompt", overflow="fold", max_width=40)
    view.add_column("Completion", overflow="fold", max_width=60)
    for name in table.rewards:
        view.add_column(name, justify="right")
    view.add_column("Reward", justify="right", style="bold")
    view.add_column("Target q", justify="right", style="cyan")
    for name in table.extra:
        view.add_column(name, overflow="fold", max_width=30)
    rows = len(table.completions) if max_rows is None else min(max_rows, len(table.completions))
    prompts = written_prompts(table)
    for index in range(rows):
        view.add_row(
            "" if prompts[index] is None else _text(prompts[index]),
            _text(table.completions[index]),
            *(_number(scores[index]) for scores in table.rewards.values()),
            _number(table.total_rewards[index]),
            _number(table.targets[index]),
            *(_text(values[index]) for values in table.extra.values()),
        )
    (console or Console()).print(view)


def table_columns(table: RolloutTable) -> dict[str, list[Any]]:
    """The table as named columns: step, prompt, completion, each reward, the total, q and the logged extras; with
    ``unique_prompts`` a prompt is written on its first row only (None on the rows that repeat it)."""
    return {
        "step": [table.step] * len(table.completions),
        "prompt": written_prompts(table),
        "completion": table.completions,
        **{f"reward/{name}": scores for name, scores in table.rewards.items()},
        "reward": table.total_rewards,
        "target_q": table.targets,
        **{name: [None if value is None else str(value) for value in values] for name, values in table.extra.items()},
    }


def push_completions_table(
    table: RolloutTable, repo_id: str, private: bool | None = None, token: str | None = None
) -> bool:
    """Push the table to a Hub dataset repository, as the split ``step_<step>`` (one split per logged step); return
    whether it was pushed. A failure (an outage, a rate limit, an expired token) is a warning, never the end of
    training: the caller tries again at its next log."""
    import datasets

    try:
        datasets.Dataset.from_dict(table_columns(table)).push_to_hub(
            repo_id, split=f"step_{table.step}", private=private, token=token
        )
    except Exception as error:  # noqa: BLE001 - whatever breaks the push, the run it reports on goes on
        warnings.warn(
            f"Pushing the completions table of step {table.step} to log_completions_hub_repo={repo_id!r} failed "
            f"({type(error).__name__}: {error}). Training goes on; the next log pushes the latest table.",
            stacklevel=2,
        )
        return False
    return True


#: Trackers that take the table, as transformers' ``report_to`` names them; each has ``Table`` and ``log``.
TABLE_TRACKERS = ("wandb", "trackio")


def log_completions_to_trackers(table: RolloutTable, report_to: list[str], global_step: int) -> list[str]:
    """Log the table as ``completions`` to the runs of the trackers in ``report_to`` that take tables, beside the
    metrics just logged at ``global_step``, once per rollout; return the trackers' names. Their runs are the ones
    transformers' callbacks started; a tracker without a run in this process is skipped."""
    if table.sent_to_trackers:
        return []
    table.sent_to_trackers = True
    columns = table_columns(table)
    names, rows = list(columns), [list(row) for row in zip(*columns.values())]
    logged = []
    for tracker in TABLE_TRACKERS:
        run = _open_run(tracker) if tracker in report_to else None
        if run is None:
            continue
        module = sys.modules[tracker]
        completions = module.Table(columns=names, data=rows)
        try:
            if tracker == "wandb":  # its charts are keyed on train/global_step, as transformers logs them
                module.log({"completions": completions, "train/global_step": global_step})
            else:  # at the step the metrics took, so trackio's step counter stays one per log
                last_step = getattr(run, "_next_step", None)
                module.log({"completions": completions}, step=None if last_step is None else max(last_step - 1, 0))
        except Exception as error:  # a tracker's hiccup must not end training
            warnings.warn(
                f"Logging the completions table to {tracker} failed; training goes on: {error!r}", stacklevel=2
            )
            continue
        logged.append(tracker)
    return logged


def _open_run(tracker: str) -> Any:
    """``tracker``'s run open in this process, if it is imported (its callback imports it) and has one."""
    if tracker not in sys.modules:
        return None
    if tracker == "wandb":
        return sys.modules["wandb"].run
    from trackio.context_vars import current_run

    return current_run.get()


class CompletionsLog:
    """``log_completions``: the table of the latest training rollout, shown at each log (printed, logged to the
    trackers) and pushed to ``log_completions_hub_repo`` once per rollout."""

    def __init__(self, args: Any):
        self.args = args
        self.table: RolloutTable | None = None
        self.pushed_rollout: int | None = None  # the last rollout pushed to the Hub

    def fill_targets(self, rollout: int, sample_index: Any, targets: Any) -> None:
        """q of the samples of ``rollout`` (tensors), once built (at rollout, or by the first use of their step
        batch)."""
        if self.table is not None and self.table.rollout == rollout:
            self.table.fill_targets(sample_index.tolist(), targets.tolist())

    def show(self, global_step: int) -> None:
        """Print the table, log it to the trackers, and push it where it was not yet (a failed push is tried again at
        the next log)."""
        table, args = self.table, self.args
        if not args.log_completions or table is None:
            return
        print_completions_table(table, args.num_completions_to_print)
        log_completions_to_trackers(table, args.report_to or [], global_step)
        if args.log_completions_hub_repo is not None and self.pushed_rollout != table.rollout:
            pushed = push_completions_table(
                table, args.log_completions_hub_repo, private=args.hub_private_repo, token=args.hub_token
            )
            if pushed:
                self.pushed_rollout = table.rollout
