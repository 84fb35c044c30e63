"""One process of a two-process gloo run of the trainer, in which process 1 alone fails at the second step.

Started directly (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment), not
through a launcher that would kill the other process. Usage: ``fail_on_one_rank.py KIND OUTPUT_DIR``, KIND one of
``FAILURES``. Process 1 writes the time of its failure to ``OUTPUT_DIR/failed_at``.
"""

import os
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import TrainerCallback

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import (
    binary_only_generation_kwargs,
    build_tiny_causal_lm,
    reverse_task_dataset,
    reverse_task_tokenizer,
)

FAILURES = (
    "reward_raises",  # a reward function raises
    "reward_wrong_length",  # a reward function returns one score too few: a bad batch
    "nonfinite_logps",  # the policy's activations become NaN in training (not in generation)
    "nonfinite_loss",  # finite log-probs, but so far from the reference's that the KL term overflows
    "forward_raises",  # the training forward pass raises
)
KIND, OUT = sys.argv[1], Path(sys.argv[2])
assert KIND in FAILURES, KIND
FAILING_PROCESS, FAILING_STEP = 1, 1  # global_step 1: the second optimiser step, each step with its own rollout
RANK = int(os.environ["RANK"])


def failing_now(global_step):
    """Whether this process fails at this step; if so, records when."""
    if RANK != FAILING_PROCESS or global_step != FAILING_STEP:
        return False
    (OUT / "failed_at").write_text(repr(time.time()))
    return True


def count_ones(completions, trainer_state, **kwargs):
    """A dense reward, so that every group has signal; misbehaves on process 1 for the reward kinds."""
    scores = [float(completion.count("1")) for completion in completions]
    if KIND.startswith("reward_") and failing_now(trainer_state.global_step):
        if KIND == "reward_raises":
            raise KeyError("no reference answer for this prompt on process 1")
        return scores[:-1]
    return scores


class BreakTrainingForward(TrainerCallback):
    """For the training kinds: a hook on the policy's final norm that acts in training mode only (not in generate)."""

    def on_step_begin(self, args, state, control, **kwargs):
        if KIND.startswith("reward_") or not failing_now(state.global_step):
            return

        def hook(module, inputs, output):
            if not module.training:
                return output
            if KIND == "forward_raises":
                raise RuntimeError("the forward pass broke on process 1")
            return output * (float("nan") if KIND == "nonfinite_logps" else 1e4)

        trainer.accelerator.unwrap_model(trainer.model).model.norm.register_forward_hook(hook)


tokenizer = reverse_task_tokenizer()
config = TargetPOConfig(
    output_dir=str(OUT),
    use_cpu=True,
    per_device_train_batch_size=4,  # whole groups on each process: its loss is its own, so only process 1's breaks
    num_generations=4,
    max_completion_length=4,
    max_steps=3,
    learning_rate=1e-2,
    beta=0.1 if KIND == "nonfinite_loss" else 0.0,
    skip_zero_gradient_completions=False,
    generation_kwargs=binary_only_generation_kwargs(tokenizer),
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    seed=0,
)
trainer = TargetPOTrainer(
    model=build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=64),
    reward_funcs=count_ones,
    args=config,
    train_dataset=reverse_task_dataset(length=4, num_prompts=16),
    processing_class=tokenizer,
    callbacks=[BreakTrainingForward()],
)
assert trainer.accelerator.num_processes == 2 and trainer.accelerator.process_index == RANK, "not a 2-process run"
assert torch.distributed.get_backend() == "gloo"
try:
    trainer.train()
except Exception:  # noqa: BLE001 (printed, then exit 1)
    traceback.print_exc()
    (OUT / f"raised_rank{RANK}").write_text(repr(time.time()))
    if RANK == FAILING_PROCESS:
        # Stay alive, connections open, until the other process has raised (60 s at most): it must stop because it was
        # told, not because this process's exit closed its connections (gloo notices that; NCCL does not).
        deadline = time.time() + 60
        while not (OUT / "raised_rank0").exists() and time.time() < deadline:
            time.sleep(0.1)
    sys.exit(1)
