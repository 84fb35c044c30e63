"""Multi-turn helpers shared by the tests and their spawned worker processes: a scripted policy (the public rollout
interface, writing given turns), the halving strategy for the guessing game, and a two-process training worker."""

import json
import os
from pathlib import Path

import torch
from conftest import make_config
from datasets import Dataset
from distributed_workers import leave_without_teardown

from targetpo import TargetPOTrainer
from targetpo.demo import (
    GuessingGame,
    build_tiny_causal_lm,
    digits_only_generation_kwargs,
    guessing_tokenizer,
)
from targetpo.generation import RolloutBackend, completion_masks


class ScriptedPolicy(RolloutBackend):
    """Writes the turn ``policy(conversation so far, as text)`` returns, then EOS (unless the length limit cuts it)."""

    def __init__(self, tokenizer, policy, max_new_tokens=64, collective=False):
        self.tokenizer, self.policy, self.max_new_tokens = tokenizer, policy, max_new_tokens
        self.collective = collective
        self.limits = []

    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None):
        limit = max_new_tokens or self.max_new_tokens
        self.limits.append(limit)
        rows = []
        for ids, mask in zip(prompt_ids, prompt_mask):
            context = self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            turn = self.tokenizer(self.policy(context), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            rows.append(turn[:limit])
        width = max(len(row) for row in rows)
        ids = torch.tensor([row + [self.tokenizer.pad_token_id] * (width - len(row)) for row in rows])
        lengths = torch.tensor([len(row) for row in rows])
        return completion_masks(ids, [self.tokenizer.eos_token_id], lengths)


def halving_search(context):
    """Binary search over 0-7 from the game's answers so far (4, then 2 or 6, ...): it finds every digit within three
    guesses but 0, which takes a fourth, so the limit of three cuts those games."""
    low, high = 0, 7
    for guess, answer in zip(context.split("<assistant>")[1:], context.split("<tool>")[1:]):
        number, reply = int(guess[0]), answer[0]
        if reply == "=":
            return ""
        low, high = (number + 1, high) if reply == "+" else (low, number - 1)
    return str((low + high + 1) // 2)


def two_process_game_worker(rank, world_size, port, out_dir, collective):
    """One rollout of guessing games on 2 gloo processes: process 0 never calls the tool (one turn per sample),
    process 1 plays the halving search (up to four turns). Saves the number of generate calls, each sample's
    conversation and the log history."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    tokenizer = guessing_tokenizer()
    conversations = []

    def record(completions, **kwargs):
        conversations.extend(completions)
        return [0.0] * len(completions)

    args = make_config(
        Path(out_dir), max_steps=1, max_completion_length=20, max_tool_calling_iterations=3, use_cpu=True,
        ddp_backend="gloo", ddp_timeout=60, generation_kwargs=digits_only_generation_kwargs(tokenizer),
    )
    trainer = TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0),
        record, args=args, processing_class=tokenizer, environment_factory=GuessingGame,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "?"}]] * 8, "secret": [1, 2, 5, 6] * 2}),
    )
    policy = (lambda context: "") if rank == 0 else halving_search
    backend = ScriptedPolicy(tokenizer, policy, collective=collective)
    trainer.rollout_backend = backend
    trainer.train()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(
            {"generate_calls": len(backend.limits), "conversations": conversations, "log": trainer.state.log_history},
            file,
        )
    leave_without_teardown()
