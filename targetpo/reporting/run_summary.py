"""The block printed when training starts: what trains. The loss, the groups, the prompts of a rollout and of an
optimiser step, the processes, where completions come from, the model and the reward sources; and a launch that asked
for more processes than the run has (``accelerate launch --num_processes 2`` on a machine without GPUs and without a
multi-CPU config starts one process, and says nothing).

``RunSummary.of`` reads the settings and objects of a run, ``summary_table`` renders the block; neither prints.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..episodes.environments import EnvironmentReward
from ..objectives.settings import loss_description

#: Environment variables in which launchers give a process the run's number of processes: torchrun and accelerate's
#: multi-process launchers (WORLD_SIZE), Open MPI, MPICH/Intel MPI and MVAPICH (mpirun, accelerate's multi-CPU runs).
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
#: Set by every ``accelerate launch``, including the one that starts a single process without saying how many were
#: asked for; its own command line then still says.
ACCELERATE_LAUNCH_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU")


@dataclass(frozen=True)
class RunSummary:
    """What a run trains, as the start-up block shows it."""

    loss: str  # tpo with its η, or a GRPO-family loss's name; the KL term where beta > 0
    num_generations: int  # K
    prompts_per_rollout: float  # generation_batch_size / K
    prompts_per_optimiser_step: float  # completions trained per optimiser step / K (a reused rollout counts again)
    processes: int
    processes_asked: int | None  # what the launcher asked for, where it says
    rollouts: str  # the backend or rollout_func, and any tools or environments
    model: str
    parameters: int
    trainable_parameters: int
    reward_sources: tuple[str, ...]

    @classmethod
    def of(
        cls,
        args: Any,
        model: Any,
        num_processes: int,
        reward_scorer: Any,
        rollouts: str,
        processes_asked: int | None = None,
    ) -> RunSummary:
        """The summary of a run with config ``args``, the (unwrapped) policy ``model`` and a ``RewardScorer``;
        ``rollouts`` as :func:`rollouts_description` gives it."""
        group = args.num_generations
        rows_per_optimiser_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * num_processes
        parameters, trainable = parameter_counts(model)
        return cls(
            loss=loss_description(args),
            num_generations=group,
            prompts_per_rollout=args.generation_batch_size / group,
            prompts_per_optimiser_step=rows_per_optimiser_step / group,
            processes=num_processes,
            processes_asked=processes_asked,
            rollouts=rollouts,
            model=model_description(model),
            parameters=parameters,
            trainable_parameters=trainable,
            reward_sources=tuple(reward_sources(reward_scorer)),
        )

    @property
    def process_mismatch(self) -> str | None:
        """The warning for a launch that asked for another number of processes than run; None when they agree."""
        if self.processes_asked is None or self.processes_asked == self.processes:
            return None
        return (
            f"The launch asked for {self.processes_asked} processes, but this run has {self.processes}, which does "
            "all the work. `accelerate launch --num_processes N` without a config file starts one "
            "process on a machine without GPUs: on CPUs use a multi-CPU config (accelerate_configs/"
            "cpu_multi_process.yaml, which needs Open MPI) or `torchrun --nproc_per_node N`; on GPUs check that "
            "they are visible (CUDA_VISIBLE_DEVICES)."
        )


def parameter_counts(model: Any) -> tuple[int, int]:
    """All parameters and those that train (DeepSpeed ZeRO-3 keeps a sharded parameter's full size in ds_numel)."""
    total = trainable = 0
    for parameter in model.parameters():
        count = getattr(parameter, "ds_numel", None) or parameter.numel()
        total += count
        trainable += count if parameter.requires_grad else 0
    return total, trainable


def model_description(model: Any) -> str:
    """The model's class, and its id or path when it was loaded from one (PEFT: the base model's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = getattr(getattr(base, "config", None), "_name_or_path", "") or ""
    wrapper = f" in {type(model).__name__}" if base is not model else ""
    return f"{type(base).__name__}{wrapper}" + (f" ({name})" if name else "")


def reward_sources(scorer: Any) -> list[str]:
    """Each reward source by the name its metrics use: a function, a reward model or an environment's get_reward(),
    with its weight where it is not 1."""
    sources = []
    for func, name, is_model, weight in zip(scorer.funcs, scorer.names, scorer.is_model, scorer.weights.tolist()):
        if isinstance(func, EnvironmentReward):
            source = f"{name}.get_reward() (environment)"
        else:
            source = f"{name} (reward model)" if is_model else name
        sources.append(source if weight == 1.0 else f"{source} × {weight:g}")
    return sources


def rollouts_description(
    backend: Any,
    rollout_func: Callable | None,
    tools: Sequence[Callable],
    environment_factories: Mapping[str | None, Callable] | None,
    async_rollouts: bool,
) -> str:
    """Where completions come from: rollout_func, or the backend, with any tools or environments."""
    if rollout_func is not None:
        return f"rollout_func {getattr(rollout_func, '__name__', type(rollout_func).__name__)}"
    text = backend.describe() if callable(getattr(backend, "describe", None)) else type(backend).__name__
    if environment_factories:
        names = [getattr(make, "__name__", type(make).__name__) for make in environment_factories.values()]
        text += f", environments {', '.join(names)}"
    if tools:
        text += f", tools {', '.join(getattr(tool, '__name__', type(tool).__name__) for tool in tools)}"
    return text + (", generated ahead (async_rollouts)" if async_rollouts else "")


def asked_processes(environ: Mapping[str, str], launcher_command: Sequence[str] | None) -> int | None:
    """The number of processes the launch asked for, where it says: a launcher's world-size variable, or
    ``--num_processes`` on the ``accelerate launch`` command line that started this process."""
    for name in WORLD_SIZE_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    if launcher_command is None or not any(name in environ for name in ACCELERATE_LAUNCH_VARIABLES):
        return None
    return _num_processes_option(launcher_command)


def _num_processes_option(command: Sequence[str]) -> int | None:
    """``--num_processes N`` (or ``--num-processes=N``) among the launcher's own options, before the script."""
    for index, word in enumerate(command):
        if word.endswith(".py"):  # the training script: what follows is its own arguments
            return None
        option, _, value = word.partition("=")
        if option in ("--num_processes", "--num-processes"):
            value = value or (command[index + 1] if index + 1 < len(command) else "")
            return int(value) if value.isdigit() else None
    return None


def launcher_command() -> list[str] | None:
    """The command line of the process that started this one (the launcher's), where it can be read."""
    try:
        import psutil  # accelerate's dependency

        parent = psutil.Process(os.getpid()).parent()
        return None if parent is None else parent.cmdline()
    except Exception:  # noqa: BLE001 - no launcher command is only a summary line the less
        return None


def summary_table(summary: RunSummary) -> Table:
    """The block, as a two-column table (values as plain text: a name with brackets is no rich markup)."""
    group = summary.num_generations
    processes = Text(str(summary.processes))
    if summary.process_mismatch is not None:
        asked = f"{summary.processes} (asked for {summary.processes_asked}, running {summary.processes})"
        processes = Text(asked, style="bold red")
    parameters = f"{summary.parameters:,} parameters"
    if summary.trainable_parameters != summary.parameters:
        parameters += f", {summary.trainable_parameters:,} trainable"
    rows = {
        "loss": Text(summary.loss),
        "completions per prompt (K)": Text(str(group)),
        "prompts per rollout": Text(_prompts(summary.prompts_per_rollout, group)),
        "prompts per optimiser step": Text(_prompts(summary.prompts_per_optimiser_step, group)),
        "processes": processes,
        "rollouts": Text(summary.rollouts),
        "model": Text(f"{summary.model}, {parameters}"),
        "rewards": Text(", ".join(summary.reward_sources)),
    }
    table = Table(title="targetpo: what trains", title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows.items():
        table.add_row(name, value)
    return table


def _prompts(prompts: float, group: int) -> str:
    return f"{prompts:g} ({prompts * group:g} completions)"


def processes_asked_here() -> int | None:
    """The number of processes this process's launch asked for (:func:`asked_processes`), where it says."""
    return asked_processes(os.environ, launcher_command())


def announce_run(summary: RunSummary, show_block: bool = True, console: Console | None = None) -> None:
    """Print the block (``show_block``), and warn when the launch asked for another number of processes than run."""
    if show_block:
        (console or Console()).print(summary_table(summary))
    if summary.process_mismatch is not None:
        warnings.warn(summary.process_mismatch, stacklevel=2)
