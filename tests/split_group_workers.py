"""Runs for tests/test_split_groups.py: the same rollouts trained with whole groups per micro-batch and with groups
spread over micro-steps (in one process, or over two gloo processes), recording the weights after every optimiser
step.

Completions come from :class:`FixedCompletions`, a function of each row's place in the rollout and of the rollout's
number, so every run, on every process and every machine, trains exactly the same completions.
"""

from __future__ import annotations

import os

import torch
from datasets import Dataset
from distributed_workers import leave_without_teardown
from transformers import TrainerCallback

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm
from targetpo.generation import Completions, RolloutBackend

PROMPTS = ["Say cat:", "Say dog:", "Say sun:", "Say map:"]
NUM_GENERATIONS = 8
MAX_COMPLETION_LENGTH = 5


class FixedCompletions(RolloutBackend):
    """Completions of 1 to 5 letters from "abce" (EOS after the shorter ones), drawn from a generator seeded by the
    rollout's number and the row's place in the rollout over every process."""

    def __init__(self, tokenizer, process_index: int):
        self.letters = [tokenizer.convert_tokens_to_ids(letter) for letter in "abce"]
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        self.process_index, self.calls = process_index, 0

    def generate(self, prompt_ids, prompt_mask):
        rows = prompt_ids.size(0)
        first_row, self.calls = self.process_index * rows, self.calls + 1
        ids = torch.full((rows, MAX_COMPLETION_LENGTH), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row in range(rows):
            drawn = torch.Generator().manual_seed(1000 * self.calls + first_row + row)
            length = int(torch.randint(1, MAX_COMPLETION_LENGTH + 1, (1,), generator=drawn))
            letters = torch.randint(0, len(self.letters), (length,), generator=drawn)
            ids[row, :length] = torch.tensor([self.letters[i] for i in letters])
            if length < MAX_COMPLETION_LENGTH:
                ids[row, length] = self.eos
            mask[row, : min(length + 1, MAX_COMPLETION_LENGTH)] = 1
        truncated = mask.sum(dim=1) == MAX_COMPLETION_LENGTH
        truncated &= (ids != self.eos).all(dim=1)
        return Completions(ids, mask, truncated)


def letter_score(prompts, completions, **kwargs):
    """Dense: scores differ within almost every group."""
    return [float(sum(ord(character) % 5 for character in text)) for text in completions]


def letter_score_but_cat_ties(prompts, completions, **kwargs):
    """letter_score, except that every completion of "Say cat:" scores 1: its group has u = 0 throughout, so its rows
    have no gradient while the weights are the rollout's, and are skipped."""
    return [1.0 if prompt == PROMPTS[0] else score for prompt, score in zip(prompts, letter_score(prompts, completions))]


REWARDS = {"letter_score": letter_score, "letter_score_but_cat_ties": letter_score_but_cat_ties}


class WeightsAfterEachStep(TrainerCallback):
    def __init__(self):
        self.weights = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights.append({name: value.detach().clone() for name, value in model.state_dict().items()})


def train(
    out_dir: str,
    reward: str = "letter_score",
    process_index: int = 0,
    on_trainer=None,
    prompts: list[str] = PROMPTS,
    **settings,
) -> TargetPOTrainer:
    """A plain-SGD run on the fixed completions; the weights after each optimiser step are in ``trainer.recorded``.
    ``on_trainer(trainer)`` runs before training."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    args = TargetPOConfig(
        output_dir=out_dir, num_generations=NUM_GENERATIONS, max_completion_length=MAX_COMPLETION_LENGTH,
        shuffle_dataset=False, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, learning_rate=0.5,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True, logging_steps=1, **settings,
    )
    recorder = WeightsAfterEachStep()
    trainer = TargetPOTrainer(
        model, REWARDS[reward], args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer, callbacks=[recorder],
    )
    trainer.rollout_backend = FixedCompletions(tokenizer, process_index)
    if on_trainer is not None:
        on_trainer(trainer)
    trainer.train()
    trainer.recorded = recorder.weights
    return trainer


def count_shared_passes(trainer):
    """Counts the forward passes through the model that continue from returned keys and values (the completion
    passes of share_prompt_forward) in ``trainer.shared_passes``."""
    trainer.shared_passes = 0

    def count(module, args, kwargs):
        trainer.shared_passes += kwargs.get("past_key_values") is not None

    trainer.model.register_forward_pre_hook(count, with_kwargs=True)


def two_process_worker(rank, world_size, port, out_dir, cases, on_trainer=None):
    """Each case trained in a 2-process gloo world; every process saves its weights after each optimiser step (and,
    with ``on_trainer="count_shared_passes"``, the count)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    for name, reward, settings in cases:
        prepare = {"count_shared_passes": count_shared_passes}.get(on_trainer)
        trainer = train(out_dir, reward, process_index=rank, on_trainer=prepare, ddp_backend="gloo", ddp_timeout=60,
                        **settings)
        assert trainer.accelerator.num_processes == world_size
        torch.save(trainer.recorded, os.path.join(out_dir, f"{name}_rank{rank}.pt"))
        if prepare is not None:
            torch.save(trainer.shared_passes, os.path.join(out_dir, f"{name}_rank{rank}_shared_passes.pt"))
    leave_without_teardown()
