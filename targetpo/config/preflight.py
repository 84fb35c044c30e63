"""What the trainer checks before any work: the config it was given, and every dataset against the run's settings,
tools and reward functions. Each problem is a ValueError naming what is wrong and how to fix it."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

from ..data import check_streaming_supported, column_values, first_row, is_stream, validate_prompt_dataset
from ..episodes.environments import ENVIRONMENT_COLUMN, EnvironmentPool
from ..modeling.loading import model_identifier
from ..modeling.logps import require_liger, require_triton
from ..modeling.vision import IMAGE_COLUMNS
from ..objectives.registry import warn_if_grpo_config_trains_another_loss
from ..rewards import REWARD_ARGUMENTS
from .fields import GRPOConfig, TargetPOConfig


def resolve_config(model: Any, args: Any, default: type[GRPOConfig] = TargetPOConfig) -> TargetPOConfig:
    """The run's TargetPOConfig: the one given, one made from a GRPOConfig, or ``default``'s defaults named after the
    model (a GRPOConfig's then train its loss, as a GRPOConfig passed in does)."""
    if args is None:
        name = model if isinstance(model, str) else model_identifier(model) or "model"
        suffix = default.__name__.removesuffix("Config")
        args = default(output_dir=f"{name.rstrip('/').split('/')[-1]}-{suffix}")
    if isinstance(args, GRPOConfig) and not isinstance(args, TargetPOConfig):
        # A GRPO script's config: the same fields, and the TPO ones at their defaults. Its loss_type is kept, so it
        # trains the GRPO-family loss it names on this trainer's rollouts.
        warn_if_grpo_config_trains_another_loss(args)
        with warnings.catch_warnings():  # the GRPOConfig said them already: its checks run again on the same values
            warnings.simplefilter("ignore")
            return TargetPOConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init})
    if not isinstance(args, TargetPOConfig):
        raise TypeError(f"`args` must be a TargetPOConfig (or a GRPOConfig), got {type(args).__name__}.")
    return args


def check_run_settings(args: TargetPOConfig, evaluates: bool) -> None:
    """Settings the trainer cannot honour here: refused before any model is loaded."""
    if args.auto_find_batch_size:
        raise ValueError(
            "auto_find_batch_size is not supported: the batch size fixes how prompt groups map to steps. Set "
            "per_device_train_batch_size (a multiple of num_generations) instead."
        )
    if evaluates:
        args.check_eval_batch_size()
    if args.use_liger_kernel:
        require_liger(args.device)
    if args.logps_head_kernel == "triton":
        require_triton(args.device)
    if args.log_completions_hub_repo is not None:
        from huggingface_hub.constants import HF_HUB_OFFLINE

        if HF_HUB_OFFLINE:
            raise ValueError(
                f"log_completions_hub_repo={args.log_completions_hub_repo!r} pushes the completions to the Hugging "
                "Face Hub, but the Hub is switched off (HF_HUB_OFFLINE=1). Unset log_completions_hub_repo, or run "
                "with Hub access."
            )


def named_splits(train_dataset: Any, eval_dataset: Any) -> list[tuple[str, Any]]:
    """``(name, dataset)`` of every dataset given; a dict of evaluation datasets gives one split per name."""
    named_evals = eval_dataset if isinstance(eval_dataset, dict) else {None: eval_dataset}
    splits = [("train", train_dataset)] + [
        ("eval" if name is None else f"eval[{name!r}]", dataset) for name, dataset in named_evals.items()
    ]
    return [(split, dataset) for split, dataset in splits if dataset is not None]


@dataclasses.dataclass
class DatasetNeeds:
    """What the run asks of its datasets' rows."""

    renderer: Any  # the processor or tokenizer that renders the prompts
    images_need: str | None  # what prompts with images would need that the run lacks; None: they can be trained on
    multi_turn: bool  # tools or environments: prompts must be conversations
    environments: EnvironmentPool | None  # reward functions get `environments=`; several need a column naming them
    # Refuses a reward function that needs an argument the rollouts do not pass: (the arguments a split's columns
    # pass, where they come from). None when a rollout_func makes the rollouts (its extra fields are arguments too,
    # known only once it runs).
    check_reward_arguments: Callable[[set[str], str], None] | None


def check_datasets(args: TargetPOConfig, train_dataset: Any, eval_dataset: Any, needs: DatasetNeeds) -> None:
    """Every dataset's rows suit the run: prompts, streaming, conversations for tools, columns for the rewards."""
    splits = named_splits(train_dataset, eval_dataset)
    prompt_optional = needs.environments is not None  # a row may leave its prompt to its environment's reset()
    for split, dataset in splits:
        validate_prompt_dataset(dataset, split, needs.renderer, needs.images_need, prompt_optional)
    if any(is_stream(dataset) for _, dataset in splits):
        check_streaming_supported(args, train_is_stream=is_stream(train_dataset))
    if needs.multi_turn:
        for split, dataset in splits:
            if isinstance(first_row(dataset).get("prompt"), str):
                raise ValueError(
                    f"Tools and environments need a conversational {split} dataset (prompts as lists of chat "
                    "messages): the chat template renders the tools and the tool turns. Wrap each prompt as "
                    "`[{'role': 'user', 'content': prompt}]`."
                )
    if needs.environments is not None and needs.environments.named:
        for split, dataset in splits:
            _check_environment_column(split, dataset, needs.environments)
    reserved = REWARD_ARGUMENTS | ({"environments"} if needs.environments is not None else set())
    for split, dataset in splits:
        columns = set(getattr(dataset, "column_names", None) or first_row(dataset))
        clashes = reserved & columns
        if clashes:
            raise ValueError(
                f"Dataset column(s) {sorted(clashes)} would collide with the reward-function arguments of the same "
                "name; rename them (e.g. `dataset.rename_column(...)`)."
            )
        if needs.check_reward_arguments is not None:
            _check_reward_columns(split, columns, args.remove_unused_columns, needs)
    prompts_per_rollout = args.generation_batch_size // args.num_generations
    if train_dataset is not None and not is_stream(train_dataset) and len(train_dataset) < prompts_per_rollout:
        raise ValueError(
            f"The train dataset has {len(train_dataset)} prompts but one rollout needs "
            f"generation_batch_size // num_generations = {prompts_per_rollout}."
        )


def _check_reward_columns(split: str, columns: set[str], remove_unused_columns: bool, needs: DatasetNeeds) -> None:
    """Refuse a reward function that needs a column the dataset (as rollouts see it) lacks."""
    source = f"the {split} dataset (its columns: {sorted(columns)})"
    passed = columns - {"prompt"}  # the prompt arrives as `prompts`
    if remove_unused_columns:
        passed &= set(kept_columns(needs.environments))
        source += " with remove_unused_columns=True, which keeps only the prompt and the image column"
        if needs.environments is not None and needs.environments.named:
            source += " (and, with several environments, the environment column)"
    if needs.environments is not None:
        passed.add("environments")
    needs.check_reward_arguments(passed, source)


def _check_environment_column(split: str, dataset: Any, environments: EnvironmentPool) -> None:
    """With a dict of environments every row names a known one in its ``environment`` column (a stream's rows are
    checked as they arrive)."""
    columns = set(getattr(dataset, "column_names", None) or first_row(dataset))
    if ENVIRONMENT_COLUMN not in columns:
        raise ValueError(
            f"environment_factory is a dict of environments, so each row of the {split} dataset names its "
            f"environment in an `{ENVIRONMENT_COLUMN}` column, which it lacks (its columns: {sorted(columns)}). Add "
            f"the column (one of {environments.names} per row), or pass one environment factory."
        )
    if not is_stream(dataset):
        environments.check_names(set(column_values(dataset, ENVIRONMENT_COLUMN, split)), f"the {split} dataset")


def kept_columns(environments: EnvironmentPool | None) -> list[str]:
    """The columns ``remove_unused_columns=True`` keeps: what rollouts themselves read (the prompt, its images, and
    each row's environment name when there are several environments)."""
    named = environments is not None and environments.named
    return ["prompt", *IMAGE_COLUMNS, *([ENVIRONMENT_COLUMN] if named else [])]


def check_train_prompts(args: TargetPOConfig, train_dataset: Any, environments: EnvironmentPool | None) -> None:
    """That ``train()`` has prompts: a train dataset, or one environment that makes up each prompt in ``reset()``,
    with ``max_steps`` to say how long to train."""
    if train_dataset is not None:
        return
    if environments is None:
        raise ValueError(
            "TargetPOTrainer: training requires a train_dataset. Pass one (prompts in a `prompt` column), or an "
            "environment_factory whose reset() makes up each prompt; a trainer that only evaluates is given an "
            "eval_dataset instead."
        )
    if environments.named:
        raise ValueError(
            f"environment_factory is a dict of environments {environments.names}, so a train_dataset must name each "
            f"row's environment in an `{ENVIRONMENT_COLUMN}` column. Pass one (that column alone will do where each "
            "reset() makes up its prompt), or one factory whose reset() makes up the prompt."
        )
    if args.max_steps <= 0:
        raise ValueError(
            "No train_dataset: the environment makes up each prompt in reset(), so no dataset sets how long to "
            "train. Set max_steps to the number of optimiser steps."
        )
