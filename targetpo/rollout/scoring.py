"""From completions to a scored rollout: decode them, score them with the reward functions, combine the rewards and
whiten them within their groups (over every process's rows) into advantages, and record the rollout's metrics and
its completions table.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather_object

from .. import functional as F
from ..batch import RolloutBatch
from ..data import message_text
from ..episodes.multi_turn import conversation_text
from ..reporting.completions import RolloutTable
from ..reporting.metrics import MetricsRecorder
from ..rewards import RewardLogs, RewardScorer
from .context import RolloutContext
from .no_signal import NoSignalWatch
from .sources import SourcedRollout

#: The rollout's score statistics (``F.rollout_diagnostics``) and the names they are logged under.
ROLLOUT_DIAGNOSTICS = {
    "reward": "reward",
    "reward_std": "reward_std",
    "informative_group_fraction": "tpo/informative_group_fraction",
}


@dataclass
class ScoredRollout:
    """A rollout's record for this process, and what its metrics and completions table read."""

    batch: RolloutBatch
    advantages_all: torch.Tensor  # (every process's rows,)
    valid_all: torch.Tensor
    scores_per_func: torch.Tensor  # (this process's rows, reward functions); NaN where a function did not score
    scores_per_func_all: torch.Tensor
    scores_all: torch.Tensor
    reward_logs: RewardLogs
    sourced: SourcedRollout
    completion_texts: list[str]  # as the table shows them (a multi-turn sample's whole conversation)


class RolloutScorer:
    """Scores rollouts and records their metrics and completions table."""

    def __init__(
        self,
        reward_scorer: RewardScorer,
        tokenizer: Any,
        accelerator: Any,
        args: Any,
        metrics: MetricsRecorder,
        guard: Callable[[str], contextlib.AbstractContextManager],
        run_async: Callable[..., Any],
        sharded: bool,
        render: Callable[..., list[str]],
    ):
        self.reward_scorer, self.tokenizer, self.accelerator, self.args = reward_scorer, tokenizer, accelerator, args
        self.metrics, self.guard, self.run_async, self.sharded = metrics, guard, run_async, sharded
        self.render = render  # prompts as the completions table shows them
        self._warned_unscored = False
        self.no_signal = NoSignalWatch.from_config(args, reward_scorer.names, speaks=accelerator.is_main_process)

    @classmethod
    def of(cls, context: RolloutContext, reward_scorer: RewardScorer) -> RolloutScorer:
        """The scorer of the rollouts ``context`` makes."""
        return cls(
            reward_scorer,
            context.tokenizer,
            context.accelerator,
            context.args,
            context.metrics,
            context.guard,
            context.episodes.async_runner.run,
            context.sharded,
            context.prompt_encoder.render,
        )

    def score(self, sourced: SourcedRollout, state: Any, group_size: int, local: slice) -> ScoredRollout:
        """Reward, combine and whiten one rollout; ``local`` is this process's rows among every process's."""
        device, completions = self.accelerator.device, sourced.completions
        # What one process can fail at alone (a reward function raising or returning the wrong number of scores) is
        # guarded. A sharded reward model's forward pass runs collectives itself, which every process must reach.
        with self.guard("scoring the completions"):
            completion_texts, completion_id_lists = self.decode(completions)
            if sourced.conversations is None:
                reward_completions = as_reward_completions(sourced.prompts, completion_texts)
            else:  # the table shows the conversation too
                reward_completions = sourced.conversations
                completion_texts = [conversation_text(conversation) for conversation in sourced.conversations]
            reward_logs = RewardLogs(len(sourced.prompts))
            scores_per_func = self.reward_scorer.score(
                sourced.prompts,
                reward_completions,
                completion_id_lists,
                {**sourced.columns, "log_extra": reward_logs.log_extra, "log_metric": reward_logs.log_metric},
                state,
                device,
                models=not self.sharded,
                run_async=self.run_async,
            )
        if self.sharded:
            scores_per_func = self.reward_scorer.score_models(
                scores_per_func, sourced.prompts, reward_completions, device
            )
        completion_mask = completions.loss_mask.clone()
        if self.args.mask_truncated_completions:
            completion_mask[completions.truncated] = 0
        valid = completion_mask.any(dim=1)

        # Whitening needs whole groups, which may span processes: score over the gathered rollout, keep our slice.
        scores_per_func_all = self.accelerator.gather(scores_per_func)
        valid_all = self.accelerator.gather(valid)
        scores_all = self.combine_rewards(scores_per_func_all)
        advantages_all = self.advantages(scores_per_func_all, scores_all, valid_all, group_size)
        batch = RolloutBatch(
            prompt_ids=sourced.prompt_ids,
            prompt_mask=sourced.prompt_mask,
            completion_ids=completions.ids,
            completion_attention_mask=completions.attention_mask,
            completion_mask=completion_mask,
            valid=valid,
            scores=scores_all[local],
            advantages=advantages_all[local],
            sample_index=torch.arange(local.start, local.stop, device=device),
            pixel_inputs=sourced.pixel_inputs,
            prompt_aligned=sourced.token_aligned if sourced.pixel_inputs is not None else {},
            completion_aligned=sourced.completion_aligned,
            sampler_per_token_logps=completions.sampler_logps,
        )
        return ScoredRollout(
            batch, advantages_all, valid_all, scores_per_func, scores_per_func_all, scores_all, reward_logs, sourced,
            completion_texts,
        )  # fmt: skip

    def decode(self, completions: Any) -> tuple[list[str], list[list[int]]]:
        """Completion texts and token ids, each cut after its first EOS."""
        lengths = completions.lengths.tolist()
        id_lists = [row[:length] for row, length in zip(completions.ids.tolist(), lengths)]
        texts = self.tokenizer.batch_decode(id_lists, skip_special_tokens=True)
        return texts, id_lists

    def combine_rewards(self, scores_per_func: torch.Tensor) -> torch.Tensor:
        """The weighted sum over reward functions; functions that returned None for a sample are left out."""
        unscored = torch.isnan(scores_per_func).all(dim=1)
        if unscored.any() and not self._warned_unscored:
            warnings.warn(
                f"{int(unscored.sum())} completions were scored by no reward function (all returned None); they get a "
                "reward of 0. Make sure every sample is scored by at least one function.",
                stacklevel=2,
            )
            self._warned_unscored = True
        weights = self.reward_scorer.weights.to(scores_per_func.device)
        rewards = (scores_per_func * weights).nansum(dim=1)
        if not torch.isfinite(rewards).all():
            first = int((~torch.isfinite(rewards)).nonzero()[0])
            raise ValueError(
                f"The weighted sum of the rewards of completion {first} overflows float32 ({rewards[first].item()}): "
                f"its scores {scores_per_func[first].tolist()} times reward_weights {weights.tolist()}. Scale the "
                "rewards or reward_weights down."
            )
        return rewards

    def advantages(
        self, scores_per_func_all: torch.Tensor, scores_all: torch.Tensor, valid_all: torch.Tensor, group_size: int
    ) -> torch.Tensor:
        """The rollout's advantages ``u``, as ``scale_rewards`` and ``multi_objective_aggregation`` say."""
        if self.args.multi_objective_aggregation == "normalize_then_sum":
            weights = self.reward_scorer.weights.to(scores_per_func_all.device)
            return F.decoupled_advantages(scores_per_func_all, weights, group_size, valid_all)
        return F.group_advantages(scores_all, group_size, valid_all, self.args.scale_rewards)

    # ------------------------------------------------------------------------------------------------ metrics
    def record_metrics(self, scored: ScoredRollout, group_size: int, mode: str) -> None:
        """Completion lengths and truncation, the valid fraction, each reward function's mean and spread, and the
        rollout's score statistics, over every process; a training rollout without an informative group counts
        towards the no-signal warning (``no_signal.py``)."""
        metrics, completions = self.metrics[mode], scored.sourced.completions
        # Tokens the policy wrote: in multi-turn samples, tool turns do not count.
        lengths = self.accelerator.gather(completions.loss_mask.sum(dim=1)).float()
        truncated = self.accelerator.gather(completions.truncated).float()
        metrics["completions/mean_length"].append(lengths.mean().item())
        metrics["completions/min_length"].append(lengths.min().item())
        metrics["completions/max_length"].append(lengths.max().item())
        metrics["completions/clipped_ratio"].append(truncated.mean().item())
        metrics["completions/valid_fraction"].append(scored.valid_all.float().mean().item())
        for index, name in enumerate(self.reward_scorer.names):
            column = scored.scores_per_func_all[:, index]
            scored_values = column[~torch.isnan(column)]
            if scored_values.numel() > 0:
                metrics[f"rewards/{name}/mean"].append(scored_values.mean().item())
                metrics[f"rewards/{name}/std"].append(scored_values.std(unbiased=False).item())
        diagnostics = F.rollout_diagnostics(scored.scores_all, group_size, scored.valid_all)
        for name, logged_as in ROLLOUT_DIAGNOSTICS.items():
            value = getattr(diagnostics, name).item()
            if not math.isnan(value):  # reward_std has none when no completion is valid
                metrics[logged_as].append(value)
        if mode == "train":
            informative = diagnostics.informative_group_fraction.item()
            self.no_signal.see(informative, diagnostics.reward.item(), truncated.mean().item())

    def record_reward_logs(self, logs: RewardLogs, mode: str) -> dict[str, list[Any]]:
        """Average the metrics reward functions logged over every process; return their extra columns, gathered (a
        process that logged no such column contributes None for each of its completions)."""
        per_process = gather_object([(logs.metrics, logs.columns, logs.num_completions)])
        for name in sorted({name for metrics, _, _ in per_process for name in metrics}):
            values = [value for metrics, _, _ in per_process for value in metrics.get(name, [])]
            self.metrics[mode][name].append(sum(values) / len(values))
        names = sorted({name for _, columns, _ in per_process for name in columns})
        return {name: [v for _, cols, n in per_process for v in cols.get(name, [None] * n)] for name in names}

    def completion_table(
        self,
        scored: ScoredRollout,
        step: int,
        rollout: int,
        extra_columns: dict[str, list[Any]] | None = None,
    ) -> RolloutTable:
        """The rollout's completions table, over every process."""
        prompts = gather_object(self.render(scored.sourced.prompts, scored.sourced.tools))
        completions = gather_object(scored.completion_texts)
        per_func = self.accelerator.gather(scored.scores_per_func).cpu()
        return RolloutTable(
            step=step,
            prompts=prompts,
            completions=completions,
            rewards={name: per_func[:, index].tolist() for index, name in enumerate(self.reward_scorer.names)},
            total_rewards=scored.scores_all.tolist(),
            rollout=rollout,
            extra=extra_columns or {},
            unique_prompts=self.args.log_unique_prompts,
        )


def as_reward_completions(prompts: list[Any], texts: list[str]) -> list[Any]:
    """Strings for standard prompts; one assistant message for conversations (continuing a final one)."""
    if isinstance(prompts[0], str):
        return texts
    completions = []
    for prompt, text in zip(prompts, texts):
        prefix = message_text(prompt[-1]) if prompt[-1]["role"] == "assistant" else ""
        completions.append([{"role": "assistant", "content": prefix + text}])
    return completions
