"""TargetPOTrainer: sample a group of completions per prompt, score them, fit the policy to the TPO target.

One training micro-step reads as:

1. ``_prepare_inputs`` hands out a step batch of the current rollout; the sampler repeats each rollout's rows for the
   ``steps_per_generation * num_iterations`` micro-steps it serves, and the first of them makes the rollout;
2. a rollout (``_rollout``) gets completions from the rollout backend (``generation/``: ``model.generate``, vLLM in
   process or a ``vllm serve`` process, possibly generated ahead), scores them, whitens the scores into ``u`` and,
   where the weights will have moved before the rollout is used, records the old log-probs and builds the target ``q``;
3. ``compute_loss`` computes the policy's token log-probs (``policy_logps.py``) and returns the loss of the objective
   ``loss_type`` names (TPO: the cross-entropy to ``q``, built from the detached log-probs if the rollout did not) plus
   the regularisers (``objectives.py``); what the step built for later iterations is kept in the batch's cache.
   With ``max_tokens_per_micro_batch``, ``training_step`` runs it in passes of bounded tokens, each back-propagated
   on its own (``token_budget.py``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate.utils import set_seed
from accelerate.utils.memory import clear_device_cache
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

from . import functional as F
from .batch import RolloutBatch
from .callbacks import OnOptimizerStep, load_checkpoint_extras, save_checkpoint_extras
from .config.fields import GRPOConfig, TargetPOConfig
from .config.preflight import (
    DatasetNeeds,
    check_datasets,
    check_run_settings,
    check_train_prompts,
    kept_columns,
    prompts_from_environments,
    resolve_config,
)
from .data import (
    NEEDS_PROCESSOR,
    ROLLOUT_USE,
    ROW_INDEX,
    UPCOMING_ROW,
    RepeatSampler,
    RolloutRows,
    RolloutStream,
    identity_collator,
    is_stream,
    lookahead_use,
    stream_loader_settings,
)
from .distributed import (
    check_engine_supported,
    destroy_gloo_group_at_exit,
    failures_reach_every_process,
    prepare_frozen_model,
    shards_parameters,
)
from .episodes.multi_turn import EnvironmentPool, ToolLoop, check_multi_turn_arguments, with_environment_rewards
from .episodes.tools import AsyncRunner, ConversationTemplate, Toolbox, ToolCallLimits
from .generation import RolloutBackend, SamplingSettings
from .modeling.loading import (
    PromptLimit,
    load_policy,
    load_processing_class,
    load_tokenizer,
    max_positions,
    mix_weights_into,
    prepare_policy,
)
from .modeling.vision import is_processor
from .objectives.registry import LossTerms, TrainingLoss, build_objective
from .objectives.regularisers import EntropyBonus, importance_sampling_applies
from .reporting.completions import (
    RolloutTable,
    log_completions_to_trackers,
    print_completions_table,
    push_completions_table,
)
from .reporting.metrics import MetricsRecorder, record_loss_metrics, record_targets
from .reporting.run_summary import RunSummary, announce_run, processes_asked_here, rollouts_description
from .rewards import RewardFunc, RewardScorer
from .rollout.prompts import PromptEncoder
from .rollout.scheduler import RolloutScheduler
from .rollout.scoring import RolloutScorer
from .rollout.sources import rollout_source
from .step.forward import PolicyLogps, TokenLogps
from .step.layout import BatchLayout
from .step.split_groups import SplitGroups
from .step.token_budget import check_budget_fits, joined_by_rows, pass_token_shares


class TargetPOTrainer(Trainer):
    """Fine-tune a causal language model with Target Policy Optimization.

    Args:
        model: a model id or local path, or a ``PreTrainedModel`` for causal language modelling or image-text-to-text.
        reward_funcs: one or several reward functions (``f(prompts, completions, completion_ids, **kwargs)``),
            reward models (``PreTrainedModel`` for sequence classification) or reward-model ids; None when an
            environment's ``get_reward()`` scores the samples.
        args: a :class:`~targetpo.TargetPOConfig`.
        train_dataset, eval_dataset: prompt-only datasets with a ``prompt`` column (string or chat messages); with
            environments a row may leave its prompt to ``reset()``. A trainer that could not train is refused when
            built, unless it is given an eval_dataset to evaluate.
        processing_class: the policy's tokenizer, or a vision-language model's processor (prompts with images, from an
            ``image`` or ``images`` column); loaded from the model's id when omitted.
        reward_processing_classes: one tokenizer per reward function (None for plain functions).
        callbacks, optimizers: as for ``transformers.Trainer``.
        peft_config: a ``peft.PeftConfig``; only the adapters train and the reference is the adapter-free base.
        tools: typed Python functions (sync or async) with docstrings the model may call; rollouts become
            multi-turn (``docs/multi_turn.md``). Needs a conversational dataset.
        environment_factory: a callable that makes one environment per sample: ``reset(**row)`` starts it, its public
            methods are tools, and an optional ``get_reward()`` scores it. Reward functions get ``environments=``. A
            dict of them by name: each row's ``environment`` column chooses one. Without a train_dataset (and with
            max_steps) one environment makes up every prompt in ``reset()``.
        rollout_func: ``rollout_func(prompts, trainer) -> dict`` replaces generation with a loop of one's own: it
            returns ``prompt_ids``, ``completion_ids`` and optionally ``logprobs``, ``env_mask`` and extra fields.
    """

    default_config = TargetPOConfig  # what args=None trains
    # The loss is a per-micro-batch mean: the Trainer divides it by the gradient-accumulation steps.
    loss_is_scaled_for_ga = False

    get_tpo_scores = staticmethod(F.tpo_scores)
    get_tpo_targets = staticmethod(F.tpo_targets)

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: RewardFunc | Sequence[RewardFunc] | None = None,
        args: TargetPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | Sequence[PreTrainedTokenizerBase | None] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: Any = None,
        tools: Sequence[Callable] | None = None,
        environment_factory: Callable[[], Any] | dict[str, Callable[[], Any]] | None = None,
        rollout_func: Callable[[list[Any], TargetPOTrainer], dict[str, Any]] | None = None,
    ):
        args = resolve_config(model, args, self.default_config)
        check_run_settings(args, evaluates=eval_dataset is not None)
        reward_funcs, reward_weights = self._set_up_tools(tools, environment_factory, rollout_func, reward_funcs, args)
        if eval_dataset is None:  # given one, the trainer may only evaluate: train() checks its prompts then
            check_train_prompts(args, train_dataset, self._environments)
        # The reward scorer checks its arguments before it loads any reward model, so a bad call fails in seconds.
        self.reward_scorer = RewardScorer(
            reward_funcs,
            reward_processing_classes,
            reward_weights,
            args.model_init_kwargs,
            args.trust_remote_code,
            args.chat_template_kwargs,
        )
        policy = load_policy(model, args.model_init_kwargs, args.trust_remote_code)
        processing_class = load_processing_class(policy, processing_class, args.trust_remote_code)
        self._tokenizer = load_tokenizer(policy, processing_class, args.trust_remote_code)
        # A vision-language model's processor encodes prompts with images and renders them with its chat template.
        self._processor = processing_class if is_processor(processing_class) else None
        self._images_need = self._what_images_need()
        self._dataset_needs = DatasetNeeds(
            self._processor or self._tokenizer,
            self._images_need,
            multi_turn=self._tool_loop_needed,
            environments=self._environments,
            check_reward_arguments=self.reward_scorer.check_arguments if rollout_func is None else None,
        )
        check_datasets(args, train_dataset, eval_dataset, self._dataset_needs)
        # Prompt and completion must fit the model's positions: prompts give way, keeping their last tokens.
        self._prompt_limit = PromptLimit(
            args.max_prompt_length,
            args.max_completion_length,
            max_positions(policy),
            prompt_length_is_default=args.max_prompt_length == TargetPOConfig.max_prompt_length,
        )
        self._max_prompt_tokens = self._prompt_limit.tokens
        policy, self.ref_model = prepare_policy(policy, args, peft_config)
        super().__init__(
            model=policy,
            args=args,
            data_collator=identity_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=self._processor or self._tokenizer,  # saved with every checkpoint
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.model_accepts_loss_kwargs = False
        check_engine_supported(self.accelerator, passes_per_micro_step=args.max_tokens_per_micro_batch is not None)
        destroy_gloo_group_at_exit()
        # Sharded weights (ZeRO-3, FSDP2) make every forward pass, generation included, a collective.
        self._sharded = shards_parameters(self.accelerator)
        self._prepare_frozen_models()
        self.sampling = SamplingSettings.from_config(args, self._tokenizer, self.accelerator.unwrap_model(self.model))
        self._metrics = MetricsRecorder(self.accelerator)  # each metric's running mean since the last log
        self._set_up_rollouts()
        self._set_up_loss()
        # Each process samples its own completions (a group split over processes must not repeat itself), and the
        # same seed still reproduces the same run.
        set_seed(args.seed, device_specific=True)

    def _set_up_tools(
        self,
        tools: Sequence[Callable] | None,
        environment_factory: Any,
        rollout_func: Any,
        reward_funcs: Any,
        args: Any,
    ) -> tuple[Any, Any]:
        """Tools, environments and rollout_func, checked; the reward functions and weights, with an environment's
        own reward joined."""
        self.tools = list(tools or [])
        self.rollout_func = rollout_func
        check_multi_turn_arguments(self.tools, environment_factory, rollout_func)
        self._toolbox = Toolbox(self.tools)  # the tools of every sample, when there is no environment
        self._async_runner = AsyncRunner()  # async tools and rewards; its thread starts on first use
        self._environments = (
            EnvironmentPool(environment_factory, self.tools, self._async_runner)
            if environment_factory is not None
            else None
        )
        self._tool_loop_needed = bool(self.tools) or self._environments is not None
        if self._environments is not None and self._environments.rewards:
            return with_environment_rewards(reward_funcs, args.reward_weights, self._environments.rewards)
        return reward_funcs, args.reward_weights

    def _prepare_frozen_models(self) -> None:
        """The reference model and reward models, placed (and sharded) like the policy, and sync_ref_model's mixing."""
        args = self.args
        # Frozen models are sharded like the policy under ZeRO-3 / FSDP2, so they cost no full copy per device.
        micro_batch = args.per_device_train_batch_size
        if self.ref_model is not None:
            self.ref_model = prepare_frozen_model(self.accelerator, self.ref_model, micro_batch)
        if args.sync_ref_model:
            if self.ref_model is None:  # PEFT: the reference is the base model itself, which the adapters leave as is
                raise ValueError(
                    "sync_ref_model=True moves a reference copy towards the policy, but under PEFT the reference is the "
                    "adapter-free base model, not a copy. Set sync_ref_model=False."
                )
            if self._sharded:
                raise ValueError(
                    "sync_ref_model=True is not supported with sharded weights (DeepSpeed ZeRO-3, FSDP2) yet: mixing "
                    "the policy into the reference needs both whole. Use ZeRO-1/2 or DDP, or sync_ref_model=False."
                )
            self.add_callback(OnOptimizerStep(self._mix_policy_into_reference, every=args.ref_model_sync_steps))
        self.reward_scorer.prepare_models(lambda rm: prepare_frozen_model(self.accelerator, rm, micro_batch))

    def _set_up_rollouts(self) -> None:
        """How rollouts are made: the tool loop, prompt encoding, the scheduler and its backend (built now, so a
        missing server or a bad setting fails before any work), the source, and scoring."""
        args, tokenizer = self.args, self._tokenizer
        # Token ids a rollout may hold: the tokenizer's, and any the output layer has beyond them (padded vocabularies).
        text_config = self.accelerator.unwrap_model(self.model).config.get_text_config(decoder=True)
        self._vocab_size = max(len(tokenizer), getattr(text_config, "vocab_size", None) or 0)
        # Multi-turn rollouts: the tools every prompt shows (an environment's come from a probe instance) and the loop.
        self._tool_schemas = self._environments.tool_schemas if self._environments else self._toolbox.schemas
        self._tool_loop: ToolLoop | None = None
        if self._tool_loop_needed:
            model_type = self.accelerator.unwrap_model(self.model).config.model_type
            eos_token_ids, pad_token_id = self.sampling.eos_token_ids, self.sampling.pad_token_id
            template = ConversationTemplate(
                tokenizer,
                self._tool_schemas,
                eos_token_ids,
                args.chat_template_kwargs,
                model_type,
                added_stop_token_ids=self.sampling.added_stop_token_ids,
            )
            self._tool_loop = ToolLoop(
                template,
                args.max_completion_length,
                args.max_tool_calling_iterations,
                eos_token_ids,
                pad_token_id,
                self._async_runner,
                ToolCallLimits(args.tool_call_timeout, args.tool_call_concurrency),
                processor=self._processor,  # a vision-language policy: tool results may hold images
                max_positions=max_positions(self.accelerator.unwrap_model(self.model)),
            )
        self._prompt_encoder = PromptEncoder(
            tokenizer,
            self._processor,
            self._tool_schemas,
            args.chat_template_kwargs,
            self._prompt_limit,
            self.sampling.pad_token_id,
            self.accelerator.device,
            self._failures_reach_every_process,
            images_allowed=self._images_need is None,
        )
        # A rollout serves this many micro-steps. If they all fall inside one optimiser step the weights cannot move
        # in between, and the current (detached) log-probs are the old ones: no extra forward pass at rollout.
        self._generate_every = args.steps_per_generation * args.num_iterations
        # TPO's groups spread over micro-steps (or over a micro-step's passes) need their q and p_old before their
        # first micro-step.
        self._layout = BatchLayout.from_config(args, self.accelerator.num_processes)
        self._token_budget = args.max_tokens_per_micro_batch
        if self._token_budget is not None:
            self._check_token_budget()
        self._groups_split = args.loss_type == "tpo" and (self._layout.splits_groups or self._passes_split_groups())
        self._needs_old_logps = args.gradient_accumulation_steps % self._generate_every != 0 or self._groups_split
        # Where every step batch is first used at the rollout's weights, that use computes the old log-probs of the
        # rows it trains anyway (pass by pass under a token budget): the rollout records only the others.
        self._old_logps_at_first_use = (
            self._needs_old_logps
            and not self._groups_split
            and self._generate_every % args.gradient_accumulation_steps == 0
            and args.steps_per_generation <= args.gradient_accumulation_steps
        )
        self._lookahead_use = None
        if args.async_rollouts:
            self._lookahead_use = lookahead_use(
                self._generate_every, args.gradient_accumulation_steps, args.max_staleness
            )
        self._scheduler = RolloutScheduler(self, self._async_runner)
        if args.async_rollouts:
            self.add_callback(OnOptimizerStep(self._scheduler.push_weights_while_generating))
        self._rollout_source = rollout_source(self)  # text or images, tools or environments, or rollout_func
        self.rollout_backend  # noqa: B018 -- built now: a missing server or a bad setting fails here, before any work
        if args.async_rollouts and self._rollout_source.plays_episodes:
            self._scheduler.check_plays_ahead()  # every process's own connection, opened now
        self._rollout_count = 0
        self._eval_metric_prefix = "eval"  # set by each `evaluate()` call
        self._completion_table: RolloutTable | None = None
        self._pushed_rollout: int | None = None  # the last rollout pushed to log_completions_hub_repo
        self._rollout_scorer = RolloutScorer(
            self.reward_scorer,
            tokenizer,
            self.accelerator,
            args,
            self._metrics,
            self._failures_reach_every_process,
            self._async_runner.run,
            self._sharded,
            self._prompt_encoder.render,
        )

    def _check_token_budget(self) -> None:
        """max_tokens_per_micro_batch: one sequence must fit a pass, and the passes replace the Trainer's own
        training step (so an overridden compute_loss would never run)."""
        check_budget_fits(self._token_budget, self._longest_sequence)
        if type(self).compute_loss is not TargetPOTrainer.compute_loss:
            raise ValueError(
                f"{type(self).__name__} overrides compute_loss, which max_tokens_per_micro_batch does not call: its "
                "passes compute each part of the micro-step's loss themselves. Unset max_tokens_per_micro_batch, or "
                "keep the loss in compute_loss without it."
            )
        parallelism = getattr(self.accelerator, "parallelism_config", None)
        if parallelism is not None and parallelism.cp_enabled:
            raise ValueError(
                "max_tokens_per_micro_batch is not supported with context parallelism: its passes replace the "
                "Trainer's training step, which sets context parallelism up. Unset one of them."
            )

    @property
    def _longest_sequence(self) -> int | None:
        """The most tokens of one sequence (prompt and completion); None: prompts are not limited."""
        if self._max_prompt_tokens is None:
            return None
        return self._max_prompt_tokens + self.args.max_completion_length

    @property
    def _group_kept_whole_in_a_pass(self) -> int | None:
        """With max_tokens_per_micro_batch: the rows of a group one pass must hold (TPO without its groups' softmax
        known ahead), or None: any rows may share a pass."""
        return self.args.num_generations if self.args.loss_type == "tpo" and not self._groups_split else None

    def _passes_split_groups(self) -> bool:
        """With max_tokens_per_micro_batch: whether a micro-step's passes may cut a prompt group (it may outgrow a
        pass, or span processes), so that TPO must train its groups from a softmax known ahead."""
        if self._token_budget is None:
            return False
        group_size = self.args.num_generations
        outgrows = group_size * self._longest_sequence > self._token_budget
        return outgrows or self.args.per_device_train_batch_size % group_size != 0

    def _set_up_loss(self) -> None:
        """The loss: the objective loss_type names, the regularisers the run switches on, and the token log-probs."""
        args = self.args
        # Mixture-of-experts models: the router's load-balancing loss joins the loss (TRL's router_aux_loss_coef).
        text_config = self.accelerator.unwrap_model(self.model).config.get_text_config(decoder=True)
        is_moe = getattr(text_config, "output_router_logits", None) is not None
        self._objective = build_objective(args, self.accelerator, self._group_size, self._local_slice)
        self._loss = TrainingLoss(
            self._objective,
            args,
            self.accelerator,
            self.sampling.reshapes_distribution,
            router_aux_loss=is_moe and args.router_aux_loss_coef != 0,
        )
        if args.use_adaptive_entropy:
            self.add_callback(OnOptimizerStep(self._loss.entropy_bonus.adapt))
        self._importance_sampling = importance_sampling_applies(args, self.sampling)
        self._logps = PolicyLogps.for_model(
            self.model,
            self.accelerator.unwrap_model(self.model),
            self.sampling.temperature,
            self.sampling.suppressed_token_ids,
            self.accelerator.device,
            self._sharded,
            args.use_liger_kernel,
            args.logps_chunk_size,
            rows_per_pass=args.per_device_train_batch_size,
            padding_free=args.padding_free,
            head_kernel=args.logps_head_kernel,
            token_budget=args.max_tokens_per_micro_batch,
            autocast=self.accelerator.autocast,
            share_prompts=args.share_prompt_forward,
        )
        self._split_groups = None
        if self._groups_split:
            self._split_groups = SplitGroups(
                self._layout,
                self.accelerator,
                self._logps,
                args.tpo_length_normalize_logps,
                lambda what: self._failures_reach_every_process(what, local=not self._sharded),
            )

    @property
    def rollout_backend(self) -> RolloutBackend:
        """How rollouts are generated (``generation/``): built once, on first use, and kept for every later
        ``train()`` and ``evaluate()``; :meth:`close` releases it (so does the interpreter's exit)."""
        return self._scheduler.backend

    @rollout_backend.setter
    def rollout_backend(self, backend: RolloutBackend) -> None:
        """Generate with another backend (a :class:`~targetpo.generation.RolloutBackend`); its owner closes it.

        The backend the trainer built stays open, so the new one may wrap it; :meth:`close` closes it."""
        self._scheduler.use_backend(backend)

    @property
    def reward_func_names(self) -> list[str]:
        """Each reward function's name, as its metrics log it (``rewards/<name>/mean``); an environment class's
        ``get_reward()`` comes last, under the class's name."""
        return list(self.reward_scorer.names)

    @property
    def environments(self) -> list[Any] | None:
        """This process's environments of the latest rollout, one per sample in order, as they ended; None without
        ``environment_factory`` or before the first rollout."""
        return None if self._environments is None else self._environments.latest

    # ------------------------------------------------------------------------------------------------ data
    def _what_images_need(self) -> str | None:
        """What prompts with images would need that this run lacks; None when they can be trained on."""
        return NEEDS_PROCESSOR if self._processor is None else None

    def _get_train_sampler(self, train_dataset: Any = None) -> RepeatSampler:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sampler = RepeatSampler(
            len(dataset),
            num_generations=self.args.num_generations,
            prompts_per_rollout=self.args.generation_batch_size // self.args.num_generations,
            repeat_count=self._generate_every,
            shuffle=self.args.shuffle_dataset,
            seed=self.args.seed if self.args.data_seed is None else self.args.data_seed,
            tag_uses=True,
            lookahead_use=self._lookahead_use,
        )
        if isinstance(dataset, RolloutRows):  # the epoch may reach the sampler through the rows (RolloutRows.set_epoch)
            dataset.sampler = sampler
        return sampler

    def _get_eval_sampler(self, eval_dataset: Any) -> RepeatSampler:
        return RepeatSampler(len(eval_dataset), num_generations=self._group_size("eval"), shuffle=False)

    def get_train_dataloader(self):
        if self.train_dataset is None:  # the environment makes up the prompts (or the trainer says what is missing)
            self.train_dataset = prompts_from_environments(self.args, self._environments)
        # Each process's batch is its whole share of a rollout; the sampler repeats it for every micro-step it
        # serves, tagging each repeat, and `_prepare_inputs` hands out one step batch at a time. A stream is read in
        # order and repeated the same way as it arrives.
        if is_stream(self.train_dataset):
            stream = RolloutStream(
                self.train_dataset,
                num_generations=self.args.num_generations,
                prompts_per_rollout=self.args.generation_batch_size // self.args.num_generations,
                repeat_count=self._generate_every,
                tag_uses=True,
                images_allowed=self._images_need is None,
                prompt_optional=self._environments is not None,
            )
            with stream_loader_settings(self.args, self.accelerator):
                return self._get_dataloader(
                    dataset=stream,
                    description="Training",
                    batch_size=self.args.per_device_train_batch_size * self.args.steps_per_generation,
                    is_training=True,
                )
        return self._get_dataloader(
            dataset=RolloutRows(self.train_dataset),
            description="Training",
            batch_size=self.args.per_device_train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def get_eval_dataloader(self, eval_dataset: Any = None):
        if isinstance(eval_dataset, str):  # the name of one of a dict's datasets (see `evaluate`)
            dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            dataset = self.eval_dataset
        else:  # given to `evaluate()`, so not checked yet
            dataset = eval_dataset
            check_datasets(self.args, None, dataset, self._dataset_needs)
        self.args.check_eval_batch_size()
        if dataset is not None and is_stream(dataset):
            stream = RolloutStream(
                dataset,
                self._group_size("eval"),
                split="eval",
                images_allowed=self._images_need is None,
                prompt_optional=self._environments is not None,
            )
            with stream_loader_settings(self.args, self.accelerator):
                return self._get_dataloader(
                    dataset=stream, description="Evaluation", batch_size=self.args.eval_batch_size
                )
        # A name goes on as it is: the Trainer keeps each named dataset's (persistent-worker) loader under its name.
        return super().get_eval_dataloader(eval_dataset if isinstance(eval_dataset, str) else dataset)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        # The rollout metrics logged during evaluation take the same prefix as the loss: `eval_<name>_...` for each
        # dataset of a dict.
        self._eval_metric_prefix = metric_key_prefix
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _set_signature_columns_if_needed(self) -> None:
        # With remove_unused_columns=True only what rollouts themselves read is kept.
        if self._signature_columns is None:
            self._signature_columns = [*kept_columns(self._environments), ROLLOUT_USE, UPCOMING_ROW, ROW_INDEX]

    def train(self, *args: Any, **kwargs: Any):
        self._scheduler.buffer = None  # a (resumed) run starts with a fresh rollout
        self._scheduler.forget_weights()  # and gives the rollout backend its weights before it
        if self.accelerator.is_main_process:  # what trains; the block stays quiet at log_level "error" and above
            announce_run(self._run_summary(), show_block=self.args.get_process_log_level() <= logging.WARNING)
        try:
            return super().train(*args, **kwargs)
        finally:
            self._scheduler.stop_generating()  # the backend stays up: `evaluate()` and another `train()` use it

    def _run_summary(self) -> RunSummary:
        """What this trainer trains, as the block printed when training starts shows it (``run_summary.py``)."""
        environments = self._environments.factories if self._environments is not None else None
        rollouts = rollouts_description(
            self.rollout_backend, self.rollout_func, self.tools, environments, self.args.async_rollouts
        )
        model, processes = self.accelerator.unwrap_model(self.model), self.accelerator.num_processes
        return RunSummary.of(self.args, model, processes, self.reward_scorer, rollouts, processes_asked_here())

    def close(self) -> None:
        """Release the rollout backend this trainer built (a vLLM engine and its memory, a server connection and its
        weight-transfer group, helper threads). Safe to call again; generating afterwards builds a new backend.
        Called at the interpreter's exit too; ``with TargetPOTrainer(...) as trainer:`` calls it at the block's end."""
        self._scheduler.close()

    def __enter__(self) -> TargetPOTrainer:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ rollout
    def _prepare_inputs(self, rows: list[dict[str, Any]]) -> RolloutBatch:
        if not self.model.training:
            return self._rollout(rows, mode="eval")
        batch = self._scheduler.step_batch(rows)  # the step batch of the current rollout, made at its first use
        if self._split_groups is not None:  # p of the groups this optimiser step trains, at its weights
            self._split_groups.refresh(self.model, self._scheduler.buffer, self._scheduler.use, self.state.global_step)
        return batch

    @torch.no_grad()
    def _rollout(self, rows: list[dict[str, Any]], mode: str) -> RolloutBatch:
        """Generate, score and whiten one rollout; record old/reference log-probs and q where they are needed."""
        args = self.args
        sourced = self._rollout_source.collect(rows, mode)
        group_size = self._group_size(mode)
        scored = self._rollout_scorer.score(sourced, self.state, group_size, self._local_slice(len(rows)))
        batch, advantages_all, valid_all = scored.batch, scored.advantages_all, scored.valid_all
        self._finish_rollout(batch, advantages_all, valid_all, mode)
        self._rollout_count += 1
        batch["rollout"] = self._rollout_count
        extra_columns = self._rollout_scorer.record_reward_logs(scored.reward_logs, mode)
        if mode == "train" and args.log_completions:
            step, rollout = self.state.global_step, self._rollout_count
            self._completion_table = self._rollout_scorer.completion_table(scored, step, rollout, extra_columns)
        self._targets_at_rollout(batch, advantages_all, valid_all, mode)
        if mode == "train" and self._split_groups is not None:
            self._split_groups.at_rollout(batch, valid_all, self.state.global_step)
        self._rollout_scorer.record_metrics(scored, group_size, mode)
        return batch

    def _finish_rollout(
        self, batch: RolloutBatch, advantages_all: torch.Tensor, valid_all: torch.Tensor, mode: str
    ) -> None:
        """What the loss needs of the rollout beyond its rows: its token count, the rows it may leave out, and the
        old and reference log-probs."""
        args = self.args
        batch.loss_token_count = self._objective.rollout_token_count(batch.completion_mask, mode)
        if mode == "train":
            batch.rollout_step = self.state.global_step
        if mode == "train" and self._token_budget is not None:
            # Now, not at the micro-step: a rollout_func's sequences are bounded by the model's positions only.
            with self._failures_reach_every_process("checking the rollout's sequences against the token budget"):
                self._logps.token_passes(self.model, batch, None, self._group_kept_whole_in_a_pass)
        if mode == "train" and args.skip_zero_gradient_completions and self._loss.reaches_only_rows_with_gradient:
            # Which rows a step may leave out depends on whether the weights have moved since this rollout. With
            # dropout on, two forward passes of the same weights differ, so p = p_old never holds exactly.
            local = self._local_slice(len(batch))
            with_gradient = self._objective.rows_with_gradient
            batch.rows_with_gradient = with_gradient(advantages_all, valid_all, policy_is_old=False)[local]
            batch.rows_with_gradient_at_rollout = with_gradient(advantages_all, valid_all, args.disable_dropout)[local]
        needs_old_logps = mode == "train" and self._needs_old_logps
        if needs_old_logps or args.beta > 0:
            what = "computing the old and reference log-probs"
            with self._failures_reach_every_process(what, local=not self._sharded):
                if needs_old_logps:
                    self._record_old_logps(batch)
                if args.beta > 0:
                    unwrap = self.accelerator.unwrap_model
                    batch.ref_per_token_logps = self._logps.of_reference(batch, self.ref_model, self.model, unwrap)

    def _record_old_logps(self, batch: RolloutBatch) -> None:
        """The policy's log-probs at rollout time, of the rows no step batch's first use computes (all of them, unless
        each step batch is first used at the rollout's weights)."""
        if not self._old_logps_at_first_use:
            batch.old_per_token_logps = self._logps.batched(self.model, batch)
            return
        first_use = batch.rows_with_gradient_at_rollout
        first_use = torch.ones_like(batch.valid) if first_use is None else first_use
        batch.old_logps_from_first_use = first_use
        rest = batch.valid & ~first_use
        # A sharded model's forward is a collective: every process passes through it, with rows or not.
        if bool(rest.any()) or self._sharded:
            batch.old_per_token_logps = self._logps.batched(self.model, batch, rows=rest)

    def _targets_at_rollout(
        self, batch: RolloutBatch, advantages_all: torch.Tensor, valid_all: torch.Tensor, mode: str
    ) -> None:
        """The objective's target (TPO's q), where it is built once at rollout: kept for every use of the rollout."""
        targets = self._objective.targets_at_rollout(batch, advantages_all, valid_all)
        if targets is not None:
            batch.cache.targets = targets
            self._record_targets(batch, mode)

    def _failures_reach_every_process(self, what: str, local: bool = True) -> contextlib.AbstractContextManager:
        """``failures_reach_every_process`` on this process's device, for local work.

        Work that runs collectives itself (``local=False``) is not guarded: after a failure inside it the other
        processes wait in its collectives whatever follows, and the failing one must not wait in another.
        """
        if not local:
            return contextlib.nullcontext()
        return failures_reach_every_process(what, self.accelerator.device)

    def _load_from_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_checkpoint(*args, **kwargs)
        self._scheduler.forget_weights()  # new weights that came without an optimiser step

    # What a resumed run needs beyond the Trainer's own checkpoint (``callbacks.py``), saved and loaded beside the
    # optimiser (a checkpoint without the optimiser, save_only_model, cannot be resumed from anyway).
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            save_checkpoint_extras(output_dir, *self._checkpoint_extras())

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            load_checkpoint_extras(checkpoint, *self._checkpoint_extras(), entropy_coef=self.args.entropy_coef)

    def _checkpoint_extras(self) -> tuple[EntropyBonus | None, nn.Module | None]:
        """What moves with training beyond the weights: the adaptive entropy bonus and the synced reference model."""
        entropy_bonus = self._loss.entropy_bonus if self.args.use_adaptive_entropy else None
        synced = self.args.sync_ref_model and self.ref_model is not None
        return entropy_bonus, self.accelerator.unwrap_model(self.ref_model) if synced else None

    def _mix_policy_into_reference(self) -> None:
        """``sync_ref_model``: move the reference towards the policy by ``ref_model_mixup_alpha``."""
        unwrap = self.accelerator.unwrap_model
        mix_weights_into(unwrap(self.ref_model), unwrap(self.model), self.args.ref_model_mixup_alpha)

    def _load_best_model(self, *args: Any, **kwargs: Any) -> None:
        super()._load_best_model(*args, **kwargs)
        self._scheduler.forget_weights()

    def _group_size(self, mode: str) -> int:
        """Completions per prompt: ``num_generations`` in training, ``num_generations_eval`` (if set) in evaluation."""
        if mode == "eval" and self.args.num_generations_eval is not None:
            return self.args.num_generations_eval
        return self.args.num_generations

    def _local_slice(self, local_size: int) -> slice:
        start = self.accelerator.process_index * local_size
        return slice(start, start + local_size)

    def _token_logps(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token completion log-probs of ``batch`` (a RolloutBatch, or a dict of its four row tensors) under
        ``model``, as sampling saw them, and no entropies."""
        logps = self._logps(model, batch)
        return logps.per_token, logps.entropies

    # ------------------------------------------------------------------------------------------------ loss
    def compute_loss(
        self,
        model: nn.Module,
        inputs: RolloutBatch,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        if return_outputs:
            raise ValueError("TargetPOTrainer.compute_loss does not return model outputs.")
        if not isinstance(inputs, RolloutBatch):  # a batch built by hand, keyed by the record's names
            inputs = RolloutBatch.from_mapping(inputs)
        mode = "train" if model.training else "eval"
        rows = self._rows_to_train(inputs, mode)
        mask, valid = inputs.masks_without(rows)
        logps = self._policy_logps(model, inputs, rows, mask)
        terms = self._loss_of_rows(inputs, logps, mask, valid, mode)
        self._keep_and_record(inputs, terms, logps.entropies, rows, mode)
        self._require_finite_loss(terms.loss)
        return terms.loss

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if self._token_budget is None:
            return super().training_step(model, inputs, num_items_in_batch)
        # max_tokens_per_micro_batch: the micro-step's passes each run their own backward (the Trainer's step runs one).
        model.train()
        if callable(getattr(self.optimizer, "train", None)):  # schedule-free optimisers, as the Trainer does
            self.optimizer.train()
        batch = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self._train_in_passes(model, batch)
        steps = self.args.torch_empty_cache_steps
        if steps is not None and self.state.global_step % steps == 0:
            clear_device_cache()
            if torch.backends.mps.is_available() and hasattr(torch.mps, "clear_graph_cache"):
                torch.mps.clear_graph_cache()
        return loss

    def _train_in_passes(self, model: nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """One micro-step in passes of at most max_tokens_per_micro_batch tokens, each back-propagated as soon as its
        loss is known: every pass's loss is its rows' part of the micro-step's (rows left out of a pass count as in
        ``masks_without``), so their gradients add up to the micro-step's. Returns the micro-step's loss, as the
        Trainer's step returns it (detached, divided by the accumulation steps)."""
        rows = self._rows_to_train(batch, "train")
        mask, _ = batch.masks_without(rows)
        passes = self._training_passes(model, batch, rows, self._group_kept_whole_in_a_pass)
        shares = pass_token_shares(batch.prompt_mask, batch.completion_attention_mask, passes)
        # Each pass builds what the first use builds (q, importance weights): from the rollout's old log-probs for
        # every row, from a pass's own log-probs for its rows only. Where the first use completes the old log-probs
        # pass by pass, the pass that completes them builds for every row.
        built_for_every_row = batch.old_per_token_logps is not None or batch.old_logps_from_first_use is not None
        cache = batch.cache
        parts = []
        for index, (pass_rows, share) in enumerate(zip(passes, shares)):
            batch.cache = cache
            pass_mask, pass_valid = batch.masks_without(pass_rows)
            # Only the last pass's backward reduces gradients over processes (DDP), once for all of them.
            last = index == len(passes) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                logps = self._policy_logps(model, batch, pass_rows, pass_mask)
                if logps.aux_loss is not None:  # the router's loss, a mean over the pass's tokens: by their share
                    logps = logps._replace(aux_loss=share * logps.aux_loss)
                terms = self._loss_of_rows(
                    batch, logps, pass_mask, pass_valid, "train", micro_step_mask=mask, rows=pass_rows
                )
                self._require_finite_loss(terms.loss)
                self.accelerator.backward(terms.loss / self.current_gradient_accumulation_steps)
            parts.append((terms, logps.entropies))
        batch.cache = cache
        terms = LossTerms.joined([terms for terms, _ in parts], passes, built_for_every_row)
        entropies = joined_by_rows([entropies for _, entropies in parts], passes)
        self._keep_and_record(batch, terms, entropies, rows, "train")
        return terms.loss / self.current_gradient_accumulation_steps

    def _training_passes(
        self, model: nn.Module, batch: RolloutBatch, rows: torch.Tensor | None, group_size: int | None
    ) -> list[torch.Tensor]:
        """The rows to train (bool; None: all) in passes of at most max_tokens_per_micro_batch tokens (row masks), a
        group's rows in one pass with ``group_size``; as many passes on every process, since the training model's
        forward pass is a collective under DDP (it shares the model's buffers)."""
        with self._failures_reach_every_process("cutting the micro-step into passes"):
            passes = self._logps.token_passes(model, batch, rows, group_size)
        if self.accelerator.num_processes > 1:  # passes without rows make up the count (one short row, zero loss)
            count = torch.tensor([len(passes)], device=self.accelerator.device)
            most = int(self.accelerator.gather(count).max())
            passes += [torch.zeros_like(passes[0]) for _ in range(most - len(passes))]
        return passes

    def _loss_of_rows(
        self,
        inputs: RolloutBatch,
        logps: TokenLogps,
        mask: torch.Tensor,
        valid: torch.Tensor,
        mode: str,
        micro_step_mask: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> LossTerms:
        """The loss terms of the rows in ``mask`` from their log-probs (of ``rows``, bool; None: every row the step
        trains); at a step batch's first use, its old log-probs are completed from them first."""
        if mode == "train" and inputs.old_logps_from_first_use is not None:
            self._fill_old_logps(inputs, logps.per_token, rows)
        importance_sampling = mode == "train" and self._importance_sampling
        return self._loss(logps, inputs, mask, valid, mode, importance_sampling, micro_step_mask)

    def _keep_and_record(
        self,
        inputs: RolloutBatch,
        terms: LossTerms,
        entropies: torch.Tensor | None,
        rows: torch.Tensor | None,
        mode: str,
    ) -> None:
        """Keep what the step batch's use built, and record its metrics and any freshly built q."""
        mask, valid = inputs.masks_without(rows)
        # `inputs` is the rollout buffer's own step batch: what this use built serves its later uses (num_iterations).
        inputs.cache = inputs.cache.updated(terms.built())
        record_loss_metrics(self._metrics, mode, terms, entropies, mask, rows)
        if terms.objective.targets is not None:  # built over the rows trained, or all of them from old log-probs
            self._record_targets(inputs, mode, None if inputs.old_per_token_logps is not None else valid)

    def _policy_logps(
        self, model: nn.Module, inputs: RolloutBatch, rows: torch.Tensor | None, mask: torch.Tensor
    ) -> TokenLogps:
        """The policy's token log-probs and entropies of the rows to train (and a router's loss), checked finite."""

        def forward() -> TokenLogps:
            entropy_grad = self._loss.entropy_bonus is not None
            router_aux_loss = self._loss.router_aux_loss_coef is not None
            if self._token_budget is not None and not torch.is_grad_enabled():  # evaluation: passes, then one loss
                # (with the model unwrapped, as the Trainer evaluates: its forward is no collective)
                passes = self._logps.token_passes(model, inputs, rows)
                return self._logps.by_passes(model, inputs, passes, with_entropy=True, router_aux_loss=router_aux_loss)
            return self._logps(model, inputs, True, rows, entropy_grad, router_aux_loss)

        # A forward pass that fails, or gives non-finite log-probs, on one process stops every process before the
        # collectives of the loss. A sharded model's forward is itself collectives: it runs before the guarded block.
        # (DDP's forward opens with a buffer broadcast, which every process reaches: nothing that can fail precedes it.)
        if self._sharded:
            logps = forward()
        with self._failures_reach_every_process("computing the policy's token log-probs"):
            if not self._sharded:
                logps = forward()
            self._require_finite_logps(logps.per_token, mask)
        return logps

    def _fill_old_logps(self, batch: RolloutBatch, per_token_logps: torch.Tensor, rows: torch.Tensor | None) -> None:
        """At a step batch's first use, at the rollout's weights: the old log-probs of the rows it trains are its own
        (of ``rows``, a pass's under a token budget; None: all it trains). The rows still to come stay marked."""
        if self.state.global_step != batch.rollout_step:
            raise RuntimeError("A step batch first used after the weights moved has no old log-probs for its rows.")
        current = per_token_logps.detach()
        pending = batch.old_logps_from_first_use
        filled = pending if rows is None else pending & rows
        old = torch.zeros_like(current) if batch.old_per_token_logps is None else batch.old_per_token_logps
        batch.old_per_token_logps = torch.where(filled.unsqueeze(-1), current, old)
        remaining = pending & ~filled
        batch.old_logps_from_first_use = remaining if bool(remaining.any()) else None

    def _require_finite_logps(self, per_token_logps: torch.Tensor, mask: torch.Tensor) -> None:
        """A FloatingPointError when a token log-prob the loss uses is NaN or infinite (the model overflowed)."""
        used = per_token_logps.detach()[mask.bool()]
        if not torch.isfinite(used).all():
            bad = used[~torch.isfinite(used)][0].item()
            raise FloatingPointError(
                f"The policy's token log-probs are no longer finite ({bad}) at step {self.state.global_step}: its "
                "weights or activations overflowed. Lower the learning rate, enable gradient clipping (max_grad_norm) "
                "or use bf16/fp32 instead of fp16."
            )

    def _require_finite_loss(self, loss: torch.Tensor) -> None:
        """Stop before backward, on every process together: a non-finite loss would put NaN into every weight."""
        with self._failures_reach_every_process("checking the loss"):
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"The loss is {loss.item()} at step {self.state.global_step} although the policy's log-probs are "
                    "finite: a term overflowed (the KL to the reference, once the policy is far from it) or the "
                    "rollout's old, reference or vLLM log-probs are not finite. Lower the learning rate, enable "
                    "gradient clipping (max_grad_norm) or use bf16/fp32 instead of fp16."
                )

    def _rows_to_train(self, inputs: RolloutBatch, mode: str) -> torch.Tensor | None:
        """The step batch's rows whose gradient can be non-zero (``F.rows_with_gradient``); None: every row."""
        if mode != "train" or "rows_with_gradient" not in inputs:
            return None
        if self.state.global_step == inputs["rollout_step"]:
            return inputs["rows_with_gradient_at_rollout"]
        return inputs["rows_with_gradient"]

    def prediction_step(self, model: nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # ------------------------------------------------------------------------------------------------ metrics

    def _record_targets(self, batch: RolloutBatch, mode: str, valid: torch.Tensor | None = None) -> None:
        """The diagnostics of a freshly built q (``record_targets``), and q itself for the completions table."""
        sample_index, targets = record_targets(self._metrics, mode, batch, self._group_size(mode), valid)
        table = self._completion_table
        if mode == "train" and table is not None and table.rollout == batch.rollout:
            table.fill_targets(sample_index.tolist(), targets.tolist())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        averaged = self._metrics.pop_means(mode)
        if mode == "eval":
            averaged = {f"{self._eval_metric_prefix}_{name}": value for name, value in averaged.items()}
        logs.update(averaged)  # in place: `evaluate()` returns this same dict
        super().log(logs, start_time)
        if (
            mode == "train"
            and self.args.log_completions
            and self._completion_table is not None
            and self.accelerator.is_main_process
        ):
            print_completions_table(self._completion_table, self.args.num_completions_to_print)
            log_completions_to_trackers(self._completion_table, self.args.report_to or [], self.state.global_step)
            if (
                self.args.log_completions_hub_repo is not None
                and self._pushed_rollout != self._completion_table.rollout
            ):
                pushed = push_completions_table(
                    self._completion_table,
                    self.args.log_completions_hub_repo,
                    private=self.args.hub_private_repo,
                    token=self.args.hub_token,
                )
                if pushed:  # each rollout once, at its first log; a failed push is tried again at the next log
                    self._pushed_rollout = self._completion_table.rollout


class GRPOTrainer(TargetPOTrainer):
    """TargetPOTrainer under TRL's name: with ``args=None`` it trains GRPOConfig's defaults (loss_type='dapo')."""

    default_config = GRPOConfig
