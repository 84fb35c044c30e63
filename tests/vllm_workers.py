"""Training processes (2, gloo, CPU) of the server-mode tests: each builds a real trainer that talks to a server."""

import json
import os
import signal
import time
import traceback

import torch
from distributed_workers import leave_without_teardown
from scripted_policies import script_one_bit_turns
from transformers import TrainerCallback

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import (
    binary_only_generation_kwargs,
    build_tiny_causal_lm,
    exact_reversal_reward,
    reverse_task_dataset,
    reverse_task_tokenizer,
)


def join_world(rank, world_size, port):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )


def vllm_config(out_dir, world_size=1, **overrides):
    """The reverse task with vLLM rollouts, in large steps: an engine a step behind would be far from the trainer."""
    tokenizer = reverse_task_tokenizer()
    settings = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=64 // world_size,
        num_generations=8,
        max_completion_length=6,
        max_prompt_length=32,
        generation_kwargs=binary_only_generation_kwargs(tokenizer),
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_vllm=True,
        # The checks read the engine-vs-trainer metrics of every rollout; a step that skips every completion (sparse
        # reward) computes no trainer log-probs to compare, so nothing is skipped here.
        skip_zero_gradient_completions=False,
    )
    if world_size > 1:
        settings.update(use_cpu=True, ddp_backend="gloo", ddp_timeout=120)
    settings.update(overrides)
    return TargetPOConfig(**settings)


def server_config(out_dir, base_url, world_size, **overrides):
    settings = dict(vllm_mode="server", vllm_server_base_url=base_url, vllm_server_timeout=180)
    return vllm_config(out_dir, world_size, **{**settings, **overrides})


def make_trainer(args, model=None, **kwargs):
    tokenizer = reverse_task_tokenizer()
    return TargetPOTrainer(
        model=model if model is not None else build_tiny_causal_lm(tokenizer, seed=42),
        reward_funcs=exact_reversal_reward,
        args=args,
        train_dataset=reverse_task_dataset(length=6, num_prompts=256, seed=0),
        processing_class=tokenizer,
        **kwargs,
    )


#: Multi-turn rollouts on the reverse task's 6-token vocabulary ("0", "1", "=" and the specials), so the served
#: model serves them too: the model's turn is bits, read as a call of `flip` with them; the tool's answer comes back
#: between "=" signs; a turn with no bits ends the sample.
BITS_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.bits }}{% else %}{{ m.content }}{% endif %}<eos>"
    "{% elif m.role == 'tool' %}={{ m.content }}={% else %}{{ m.content }}{% endif %}{% endfor %}"
)
BITS_RESPONSE_TEMPLATE = {
    "start_anchor": "=",
    "fields": {
        "tool_calls": {
            "repeats": True,
            "transform": {"type": "function", "function": {"name": "flip", "arguments": {"bits": "{content}"}}},
        }
    },
}


class BitFlipper:
    """An environment whose tool flips the bits it is given; it scores the share of ones it was ever sent."""

    def reset(self, **row):
        self.sent = ""

    def flip(self, bits: str) -> str:
        """Flip every bit.

        Args:
            bits: a string of 0s and 1s.
        """
        self.sent += bits
        return "".join("1" if bit == "0" else "0" for bit in bits)

    def get_reward(self) -> float:
        return self.sent.count("1") / max(1, len(self.sent))


def multi_turn_trainer(args, environment_factory=None):
    """The reverse task as conversations with the bit-flipping environment (at most two rounds of calls); the model's
    weights script each turn as one bit then EOS, so every sample makes both rounds of calls and a third turn."""
    tokenizer = reverse_task_tokenizer()
    tokenizer.chat_template = BITS_TEMPLATE
    tokenizer.response_template = BITS_RESPONSE_TEMPLATE
    allowed = {tokenizer.convert_tokens_to_ids(bit) for bit in "01"} | {tokenizer.eos_token_id}
    args.generation_kwargs = {"suppress_tokens": [i for i in range(len(tokenizer)) if i not in allowed]}
    args.max_completion_length, args.max_tool_calling_iterations = 16, 2
    dataset = reverse_task_dataset(length=6, num_prompts=256, seed=0)
    dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
    return TargetPOTrainer(
        model=script_one_bit_turns(build_tiny_causal_lm(tokenizer, seed=42), tokenizer),
        reward_funcs=None,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=environment_factory or BitFlipper,
    )


def multi_turn_server_worker(rank, world_size, port, base_url, out_dir, overrides=None):
    """Train the multi-turn task through the server; save the log history."""
    join_world(rank, world_size, port)
    trainer = multi_turn_trainer(server_config(out_dir, base_url, world_size, **{"max_steps": 2, **(overrides or {})}))
    trainer.train()
    with open(os.path.join(out_dir, f"history_rank{rank}.json"), "w") as file:
        json.dump(trainer.state.log_history, file)
    leave_without_teardown()


class SaveWeightsEachStep(TrainerCallback):
    """The policy's weights after every optimiser step, to compare with what the engine holds."""

    def __init__(self, trainer, out_dir, rank):
        self.trainer, self.out_dir, self.rank = trainer, out_dir, rank

    def on_step_end(self, args, state, control, **kwargs):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        state_dict = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        torch.save(state_dict, os.path.join(self.out_dir, f"weights_step{state.global_step}_rank{self.rank}.pt"))


def server_training_worker(rank, world_size, port, base_url, out_dir, overrides):
    """Train through the server; save the log history and the weights after each step."""
    join_world(rank, world_size, port)
    trainer = make_trainer(server_config(out_dir, base_url, world_size, **overrides))
    trainer.add_callback(SaveWeightsEachStep(trainer, out_dir, rank))
    trainer.train()
    with open(os.path.join(out_dir, f"history_rank{rank}.json"), "w") as file:
        json.dump(trainer.state.log_history, file)
    leave_without_teardown()


class KillTheServerAfterStepOne(TrainerCallback):
    """Process 0 kills every process of the server (SIGKILL on its process group) once step 1 ends."""

    def __init__(self, rank, server_group, out_dir):
        self.rank, self.server_group, self.out_dir = rank, server_group, out_dir

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and self.rank == 0:
            os.killpg(self.server_group, signal.SIGKILL)
            with open(os.path.join(self.out_dir, "killed_at.json"), "w") as file:
                json.dump(time.time(), file)


def server_lost_worker(rank, world_size, port, base_url, out_dir, server_group, overrides):
    """Train through the server, which process 0 kills after step 1; record what each process raised, and when."""
    join_world(rank, world_size, port)
    trainer = make_trainer(server_config(out_dir, base_url, world_size, **overrides))
    trainer.add_callback(KillTheServerAfterStepOne(rank, server_group, out_dir))
    try:
        trainer.train()
        outcome = {"raised": None}
    except Exception as error:  # noqa: BLE001 (recorded for the test to check)
        outcome = {"raised": type(error).__name__, "message": str(error), "at": time.time()}
    outcome["global_step"] = trainer.state.global_step
    with open(os.path.join(out_dir, f"outcome_rank{rank}.json"), "w") as file:
        json.dump(outcome, file)
    leave_without_teardown()


def server_down_worker(rank, world_size, port, base_url, out_dir):
    """Build a trainer whose server never answers; record what each process raised."""
    construction_worker(rank, world_size, port, base_url, out_dir, {"vllm_server_timeout": 3})


def construction_worker(rank, world_size, port, base_url, out_dir, overrides):
    """Build a trainer with ``overrides``; record what each process raised, if anything."""
    join_world(rank, world_size, port)
    try:
        make_trainer(server_config(out_dir, base_url, world_size, **overrides))
        outcome = {"raised": None}
    except Exception as error:  # noqa: BLE001 (recorded for the test to check)
        outcome = {
            "raised": type(error).__name__,
            "is_timeout": isinstance(error, TimeoutError),
            "message": str(error),
            "traceback": traceback.format_exc(),
        }
    with open(os.path.join(out_dir, f"outcome_rank{rank}.json"), "w") as file:
        json.dump(outcome, file)
    leave_without_teardown()
