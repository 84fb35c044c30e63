"""TargetPOTrainer: sample a group of completions per prompt, score them, fit the policy to the TPO target.

The trainer wires; each part lives where its concern does. One micro-step: ``_prepare_inputs`` takes the step batch
of the current rollout from the scheduler (``rollout/scheduler.py``), whose first use makes the rollout
(``_rollout``: a source's completions, scored and whitened, then what the step needs of it, ``step/run.py``);
``compute_loss`` hands it to the step runner: rows -> masks -> log-probs -> loss terms -> record. With
``max_tokens_per_micro_batch`` ``training_step`` runs the micro-step in passes, each back-propagated on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate.utils import set_seed
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

from . import data, distributed
from . import functional as F
from .batch import StepBatch
from .callbacks import CheckpointExtras, OnOptimizerStep, check_sync_ref_model
from .config import preflight
from .config.fields import GRPOConfig, TargetPOConfig
from .episodes import environments
from .episodes.parts import EpisodeParts
from .faults import lost_processes
from .faults.checkpoints import AtomicCheckpoints, CheckpointsWrittenWhole
from .generation import RolloutBackend, SamplingSettings
from .modeling.loading import PromptLimit, load_policy_and_processing, max_positions, mix_weights_into, prepare_policy
from .objectives.settings import trains_whole_groups
from .reporting.completions import CompletionsLog
from .reporting.metrics import MetricsRecorder, record_targets
from .reporting.run_summary import RunSummary, announce_run, processes_asked_here, rollouts_description
from .rewards import RewardFunc, RewardScorer, RewardsUnderTRLNames
from .rollout.context import RolloutContext
from .rollout.in_progress import RolloutInProgress
from .rollout.scheduler import RolloutScheduler
from .rollout.scoring import RolloutScorer
from .rollout.sources import rollout_source
from .step.plan import StepPlan, check_passes_supported
from .step.run import StepRunner


class TargetPOTrainer(CheckpointsWrittenWhole, RewardsUnderTRLNames, Trainer):
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
        args = preflight.resolve_config(model, args, self.default_config)
        preflight.check_run_settings(args, evaluates=eval_dataset is not None)
        self.tools, self.rollout_func = list(tools or []), rollout_func
        self._episodes = EpisodeParts.of(self.tools, environment_factory, rollout_func)
        self._environments = self._episodes.environments
        reward_funcs, reward_weights = self._episodes.with_rewards(reward_funcs, args.reward_weights)
        if eval_dataset is None:  # given one, the trainer may only evaluate: train() checks its prompts then
            preflight.check_train_prompts(args, train_dataset, self._environments)
        # The reward scorer checks its arguments before it loads any reward model, so a bad call fails in seconds.
        self.reward_scorer = RewardScorer(
            reward_funcs,
            reward_processing_classes,
            reward_weights,
            args.model_init_kwargs,
            args.trust_remote_code,
            args.chat_template_kwargs,
        )
        policy = self._load_policy(model, processing_class, args, train_dataset, eval_dataset, rollout_func)
        policy, self.ref_model = prepare_policy(policy, args, peft_config)
        super().__init__(
            model=policy,
            args=args,
            data_collator=data.identity_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=self._processor or self._tokenizer,  # saved with every checkpoint
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._set_up_engine()
        self._set_up_rollouts()
        # The step is given the parts the rollouts are given (the warnings of its parts point at the caller's line).
        context = self._rollout_context
        self._step = StepRunner.build(self._plan, context, self._record_targets, self._group_size, self._local_slice)
        self._set_up_checkpoint_extras()
        # Each process samples its own completions (a group split over processes must not repeat itself), and the
        # same seed still reproduces the same run.
        set_seed(args.seed, device_specific=True)

    def _load_policy(
        self,
        model: str | PreTrainedModel,
        processing_class: Any,
        args: TargetPOConfig,
        train_dataset: Any,
        eval_dataset: Any,
        rollout_func: Any,
    ) -> PreTrainedModel:
        """The policy and its tokenizer (or processor), the datasets checked against them, and the prompt limit its
        positions leave."""
        policy, self._tokenizer, self._processor = load_policy_and_processing(model, processing_class, args)
        # What prompts with images would need that this run lacks (None: they can be trained on).
        self._images_need = data.NEEDS_PROCESSOR if self._processor is None else None
        self._dataset_needs = preflight.DatasetNeeds(
            self._processor or self._tokenizer,
            self._images_need,
            multi_turn=self._episodes.multi_turn,
            environments=self._environments,
            check_reward_arguments=self.reward_scorer.check_arguments if rollout_func is None else None,
        )
        preflight.check_datasets(args, train_dataset, eval_dataset, self._dataset_needs)
        # Prompt and completion must fit the model's positions: prompts give way, keeping their last tokens.
        self._prompt_limit = PromptLimit(
            args.max_prompt_length,
            args.max_completion_length,
            max_positions(policy),
            prompt_length_is_default=args.max_prompt_length == TargetPOConfig.max_prompt_length,
        )
        self._max_prompt_tokens = self._prompt_limit.tokens
        return policy

    def _set_up_engine(self) -> None:
        """What the accelerator decides: sharded weights, the guard of local work, where frozen models live, how
        sampling works, and the metrics recorder."""
        args, accelerator = self.args, self.accelerator
        self.model_accepts_loss_kwargs = False
        distributed.check_engine_supported(
            accelerator, passes_per_micro_step=args.max_tokens_per_micro_batch is not None
        )
        distributed.destroy_gloo_group_at_exit()
        # Sharded weights (ZeRO-3, FSDP2) make every forward pass, generation included, a collective.
        self._sharded = distributed.shards_parameters(accelerator)
        self._failures_reach_every_process = distributed.ProcessGuard(accelerator.device)
        # Frozen models are sharded like the policy under ZeRO-3 / FSDP2, so they cost no full copy per device.
        micro_batch = args.per_device_train_batch_size
        if self.ref_model is not None:
            self.ref_model = distributed.prepare_frozen_model(accelerator, self.ref_model, micro_batch)
        if args.sync_ref_model:
            check_sync_ref_model(has_reference_copy=self.ref_model is not None, sharded=self._sharded)
            unwrap = accelerator.unwrap_model

            def mix() -> None:  # move the reference towards the policy by ref_model_mixup_alpha
                mix_weights_into(unwrap(self.ref_model), unwrap(self.model), args.ref_model_mixup_alpha)

            self.add_callback(OnOptimizerStep(mix, every=args.ref_model_sync_steps))
        self.reward_scorer.prepare_models(
            lambda model: distributed.prepare_frozen_model(accelerator, model, micro_batch)
        )
        self.sampling = SamplingSettings.from_config(args, self._tokenizer, accelerator.unwrap_model(self.model))
        self._metrics = MetricsRecorder(accelerator)  # each metric's running mean since the last log

    def _set_up_checkpoint_extras(self) -> None:
        """What moves with training beyond the weights, saved and loaded beside the optimiser (``callbacks.py``):
        the adaptive entropy bonus, the synced reference model and the rollout a checkpoint falls in; and how
        checkpoints are written (whole: ``faults/checkpoints.py``)."""
        args = self.args
        self.whole_checkpoints = AtomicCheckpoints(args, self.accelerator.wait_for_everyone)
        entropy_bonus = self._step.loss.entropy_bonus if args.use_adaptive_entropy else None
        if entropy_bonus is not None:
            self.add_callback(OnOptimizerStep(entropy_bonus.adapt))
        reference = self.accelerator.unwrap_model(self.ref_model) if args.sync_ref_model else None
        rollout = RolloutInProgress(self._scheduler, self._plan.generate_every, self.accelerator)  # one per process
        self._checkpoint_extras = CheckpointExtras(entropy_bonus, reference, args.entropy_coef, rollout)

    def _set_up_rollouts(self) -> None:
        """How rollouts are made: the step plan, what the rollout side is given (``rollout/context.py``), the scheduler
        and its backend (built now, so a missing server or a bad setting fails before any work), the source, and
        scoring."""
        args, accelerator, rollout_func = self.args, self.accelerator, self.rollout_func
        whole_groups = trains_whole_groups(args.loss_type)
        self._plan = StepPlan.of(args, accelerator.num_processes, self._max_prompt_tokens, whole_groups)
        if self._plan.token_budget is not None:
            overrides = type(self).compute_loss is not TargetPOTrainer.compute_loss
            check_passes_supported(type(self).__name__, overrides, accelerator)
        context = self._rollout_context = RolloutContext(
            args=args,
            accelerator=accelerator,
            sampling=self.sampling,
            metrics=self._metrics,
            guard=self._failures_reach_every_process,
            model=lambda: self.model,
            engine_model=lambda: self.model_wrapped,
            global_step=lambda: self.state.global_step,
            sharded=self._sharded,
            tokenizer=self._tokenizer,
            processor=self._processor,
            prompt_limit=self._prompt_limit,
            images_allowed=self._images_need is None,
            episodes=self._episodes,
            run_rollout_func=None if rollout_func is None else (lambda prompts: rollout_func(prompts, self)),
        )
        # The rollout a step batch's first use asks for, looked up at each call (a subclass's or a test's own).
        self._scheduler = RolloutScheduler(
            context, self._episodes.async_runner, lambda rows, mode: self._rollout(rows, mode), self._plan.lookahead_use
        )
        if args.async_rollouts:
            self.add_callback(OnOptimizerStep(self._scheduler.push_weights_while_generating))
        # Text or images, tools or environments, or rollout_func.
        self._rollout_source = self._scheduler.source = rollout_source(context, self._scheduler)
        self.rollout_backend  # noqa: B018 -- built now: a missing server or a bad setting fails here, before any work
        if args.async_rollouts and self._rollout_source.plays_episodes:
            self._scheduler.check_plays_ahead()  # every process's own connection, opened now
        self._rollout_scorer = RolloutScorer.of(context, self.reward_scorer)
        self._rollout_count = 0
        self._eval_metric_prefix = "eval"  # set by each `evaluate()` call
        self._completions = CompletionsLog(args)

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
    def environments(self) -> list[Any] | None:
        """This process's environments of the latest rollout, one per sample in order, as they ended; None without
        ``environment_factory`` or before the first rollout."""
        return None if self._environments is None else self._environments.latest

    # ------------------------------------------------------------------------------------------------ data
    def _get_train_sampler(self, train_dataset: Any = None) -> data.RepeatSampler:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sampler = data.training_sampler(self.args, len(dataset), self._plan.generate_every, self._plan.lookahead_use)
        if isinstance(dataset, data.RolloutRows):  # the epoch may reach the sampler through the rows (set_epoch)
            dataset.sampler = sampler
        return sampler

    def _get_eval_sampler(self, eval_dataset: Any) -> data.RepeatSampler:
        return data.RepeatSampler(len(eval_dataset), num_generations=self._group_size("eval"), shuffle=False)

    def get_train_dataloader(self):
        if self.train_dataset is None:  # the environment makes up the prompts (or the trainer says what is missing)
            preflight.check_train_prompts(self.args, None, self._environments)
            prompts_per_rollout = self.args.generation_batch_size // self.args.num_generations
            self.train_dataset = environments.prompts_from_environments(prompts_per_rollout)
        # Each process's batch is its whole share of a rollout; the sampler repeats it for every micro-step it
        # serves, tagging each repeat, and `_prepare_inputs` hands out one step batch at a time. A stream is read in
        # order and repeated the same way as it arrives.
        batch_size = self.args.per_device_train_batch_size * self.args.steps_per_generation
        if data.is_stream(self.train_dataset):
            stream = data.training_stream(
                self.args,
                self.train_dataset,
                self._plan.generate_every,
                images_allowed=self._images_need is None,
                prompt_optional=self._environments is not None,
            )
            with data.stream_loader_settings(self.args, self.accelerator):
                return self._get_dataloader(stream, "Training", batch_size=batch_size, is_training=True)
        rows = data.RolloutRows(self.train_dataset)
        return self._get_dataloader(rows, "Training", batch_size, self._get_train_sampler, is_training=True)

    def get_eval_dataloader(self, eval_dataset: Any = None):
        if isinstance(eval_dataset, str):  # the name of one of a dict's datasets (see `evaluate`)
            dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            dataset = self.eval_dataset
        else:  # given to `evaluate()`, so not checked yet
            dataset = eval_dataset
            preflight.check_datasets(self.args, None, dataset, self._dataset_needs)
        self.args.check_eval_batch_size()
        if dataset is not None and data.is_stream(dataset):
            images_allowed, prompt_optional = self._images_need is None, self._environments is not None
            stream = data.evaluation_stream(dataset, self._group_size("eval"), images_allowed, prompt_optional)
            with data.stream_loader_settings(self.args, self.accelerator):
                return self._get_dataloader(stream, "Evaluation", batch_size=self.args.eval_batch_size)
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
            self._signature_columns = [*preflight.kept_columns(self._environments), *data.SAMPLER_TAGS]

    def train(self, *args: Any, **kwargs: Any):
        self._scheduler.buffer = None  # a fresh rollout (or the one a resumed run's checkpoint holds)
        self._scheduler.forget_weights()  # and gives the rollout backend its weights before it
        if self.accelerator.is_main_process:  # what trains; the block stays quiet at log_level "error" and above
            announce_run(self._run_summary(), show_block=self.args.get_process_log_level() <= logging.WARNING)
        try:
            return super().train(*args, **kwargs)
        except Exception as error:
            lost_processes.raise_if_a_process_was_lost(error, self.state.global_step, self.args.output_dir)
            raise
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
    def _prepare_inputs(self, rows: list[dict[str, Any]]) -> StepBatch:
        if not self.model.training:
            return self._rollout(rows, mode="eval")
        batch = self._scheduler.step_batch(rows)  # the step batch of the current rollout, made at its first use
        split_groups = self._step.split_groups
        if split_groups is not None:  # p of the groups this optimiser step trains, at its weights
            split_groups.refresh(self.model, self._scheduler.buffer, self._scheduler.use, self.state.global_step)
        return batch

    @torch.no_grad()
    def _rollout(self, rows: list[dict[str, Any]], mode: str) -> StepBatch:
        """Generate, score and whiten one rollout; record old/reference log-probs and q where they are needed."""
        sourced = self._rollout_source.collect(rows, mode)
        group_size = self._group_size(mode)
        scored = self._rollout_scorer.score(sourced, self.state, group_size, self._local_slice(len(rows)))
        batch, advantages_all, valid_all = scored.batch, scored.advantages_all, scored.valid_all
        reference = self._reference_logps if self.args.beta > 0 else None
        batch = self._step.prepare_rollout(batch, advantages_all, valid_all, mode, self.model, reference)
        self._rollout_count += 1
        batch = batch.replaced(rollout=self._rollout_count)
        extra_columns = self._rollout_scorer.record_reward_logs(scored.reward_logs, mode)
        if mode == "train" and self.args.log_completions:
            step, rollout = self.state.global_step, self._rollout_count
            self._completions.table = self._rollout_scorer.completion_table(scored, step, rollout, extra_columns)
        self._step.build_targets(batch, advantages_all, valid_all, mode)
        self._rollout_scorer.record_metrics(scored, group_size, mode)
        return batch

    def _reference_logps(self, batch: StepBatch) -> torch.Tensor:
        """The reference model's token log-probs of a rollout (beta > 0)."""
        return self._step.logps.of_reference(batch, self.ref_model, self.model, self.accelerator.unwrap_model)

    def _load_from_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_checkpoint(*args, **kwargs)
        self._scheduler.forget_weights()  # new weights that came without an optimiser step

    # What a resumed run needs beyond the Trainer's own checkpoint, saved and loaded beside the optimiser (a
    # checkpoint without the optimiser, save_only_model, cannot be resumed from anyway).
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        self._checkpoint_extras.save(output_dir, main_process=self.args.should_save)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self._checkpoint_extras.load(checkpoint)

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
        """Per-token completion log-probs of ``batch`` (a StepBatch, or a dict of its four row tensors) under
        ``model``, as sampling saw them, and no entropies."""
        logps = self._step.logps(model, batch)
        return logps.per_token, logps.entropies

    # ------------------------------------------------------------------------------------------------ loss
    def compute_loss(
        self,
        model: nn.Module,
        inputs: StepBatch,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        if return_outputs:
            raise ValueError("TargetPOTrainer.compute_loss does not return model outputs.")
        if not isinstance(inputs, StepBatch):  # a batch built by hand, keyed by the record's names
            inputs = StepBatch.from_mapping(inputs)
        return self._step.loss_of(model, inputs, "train" if model.training else "eval")

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if self._plan.token_budget is None:
            return super().training_step(model, inputs, num_items_in_batch)
        # max_tokens_per_micro_batch: the micro-step's passes each run their own backward (the Trainer's step runs one).
        model.train()
        if callable(getattr(self.optimizer, "train", None)):  # schedule-free optimisers, as the Trainer does
            self.optimizer.train()
        batch = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self._step.train_in_passes(
                model, batch, self.accelerator.backward, self.current_gradient_accumulation_steps
            )
        distributed.empty_device_cache_if_due(self.args.torch_empty_cache_steps, self.state.global_step)
        return loss

    def prediction_step(self, model: nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # ------------------------------------------------------------------------------------------------ metrics
    def _record_targets(self, batch: StepBatch, mode: str, valid: torch.Tensor | None = None) -> None:
        """The diagnostics of a freshly built q (``record_targets``), and q itself for the completions table."""
        sample_index, targets = record_targets(self._metrics, mode, batch, self._group_size(mode), valid)
        if mode == "train":
            self._completions.fill_targets(batch.rollout, sample_index, targets)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        averaged = self._metrics.pop_means(mode)
        if mode == "eval":
            averaged = {f"{self._eval_metric_prefix}_{name}": value for name, value in averaged.items()}
        logs.update(averaged)  # in place: `evaluate()` returns this same dict
        super().log(logs, start_time)
        if mode == "train" and self.accelerator.is_main_process:
            self._completions.show(self.state.global_step)


class GRPOTrainer(TargetPOTrainer):
    """TargetPOTrainer under TRL's name: with ``args=None`` it trains GRPOConfig's defaults (loss_type='dapo')."""

    default_config = GRPOConfig
