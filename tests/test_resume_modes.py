"""Resuming from a checkpoint taken mid-run ends at the weights of the run straight through (to 1e-6), in every way a
step can be laid out: groups split over micro-steps, token-budget passes, several iterations over a rollout, and
multi-turn rollouts with tools and environments (each sample's environment is reset from its row at the rollout's
start, so a resumed rollout starts its environments as the straight run did).

Every reward adds the row's position in its batch, so every group differs and every step trains whatever was sampled.
The run straight through (3 steps) saves after each step; a fresh trainer resumes from the checkpoint of step 1. Where
a rollout serves two optimiser steps (``num_iterations=2``) that checkpoint falls in its middle.
"""

import pytest
import torch
from conftest import count_letters_reward, make_config, prompt_dataset

from targetpo import TargetPOTrainer
from targetpo.demo import (
    GuessingGame,
    build_char_tokenizer,
    build_tiny_causal_lm,
    digits_only_generation_kwargs,
    guessing_dataset,
    guessing_tokenizer,
)


def by_position(completions, **kwargs):
    return [index / len(completions) for index in range(len(completions))]


def letters(completions, **kwargs):
    return [score + index / len(completions) for index, score in enumerate(count_letters_reward(completions))]


#: Each way a step can be laid out; "num_iterations=2" spreads a rollout over two optimiser steps, so the checkpoint of
#: step 1 falls in the middle of a rollout.
MODES = {
    "split groups": dict(per_device_train_batch_size=4, num_generations=8, gradient_accumulation_steps=2),
    "split groups, num_iterations=2": dict(
        per_device_train_batch_size=4, num_generations=8, gradient_accumulation_steps=2, num_iterations=2
    ),
    "token-budget passes": dict(per_device_train_batch_size=8, max_tokens_per_micro_batch=150),
    "token-budget passes, num_iterations=2": dict(
        per_device_train_batch_size=8, max_tokens_per_micro_batch=150, num_iterations=2
    ),
    "several micro-steps, num_iterations=2": dict(num_iterations=2, steps_per_generation=2),
    "tools and environments": dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=20, max_tool_calling_iterations=3
    ),
    "tools and environments, num_iterations=2": dict(
        per_device_train_batch_size=8, num_generations=4, max_completion_length=20, max_tool_calling_iterations=3,
        num_iterations=2,
    ),
}


def trainer_for(mode, out_dir, **overrides):
    settings = dict(MODES[mode], max_steps=3, **overrides)
    if mode.startswith("tools"):
        tokenizer = guessing_tokenizer()
        settings["generation_kwargs"] = digits_only_generation_kwargs(tokenizer)
        return TargetPOTrainer(
            build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0),
            [by_position], args=make_config(out_dir, **settings), train_dataset=guessing_dataset(num_prompts=32, seed=0),
            processing_class=tokenizer, environment_factory=GuessingGame,
        )  # fmt: skip
    tokenizer = build_char_tokenizer()
    return TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0),
        letters, args=make_config(out_dir, **settings), train_dataset=prompt_dataset.__wrapped__(),
        processing_class=tokenizer,
    )  # fmt: skip


def weights(trainer):
    return torch.cat([parameter.detach().flatten() for parameter in trainer.model.parameters()])


@pytest.mark.parametrize("mode", list(MODES))
def test_a_run_resumed_mid_run_ends_at_the_weights_of_the_run_straight_through(tmp_path, mode):
    straight = trainer_for(mode, tmp_path / "straight", save_strategy="steps", save_steps=1)
    before = weights(straight).clone()
    straight.train()
    assert not torch.allclose(weights(straight), before)  # it trained
    resumed = trainer_for(mode, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "out" / "checkpoint-1"))
    assert resumed.state.global_step == 3
    assert torch.allclose(weights(resumed), weights(straight), atol=1e-6), (weights(resumed) - weights(straight)).abs().max()
    rewards = [[entry["reward"] for entry in run.state.log_history if "reward" in entry] for run in (straight, resumed)]
    assert rewards[1] == pytest.approx(rewards[0])  # the checkpoint's log, then the same rollouts as straight through
