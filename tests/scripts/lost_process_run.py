"""One of two gloo training processes on the reverse task: ``RANK PORT OUT_DIR KILL RESUME``.

``KILL`` (on rank 1 only) kills this process with SIGKILL, as the kernel's out-of-memory killer would, at step 3:
``step`` inside the policy's forward pass, ``rollout`` inside the reward function, ``checkpoint`` while the
checkpoint of step 4 is being written; ``none`` never. ``RESUME`` is ``resume`` to resume from the last checkpoint.
Each process saves its final weights (``weights_rank{rank}.pt``).
"""

import os
import signal
import sys
import time

import torch
from transformers import TrainerCallback

rank, port, out_dir, kill, resume = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] == "resume"
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")

from targetpo import TargetPOConfig, TargetPOTrainer  # noqa: E402
from targetpo.demo import build_tiny_causal_lm, reverse_task_dataset, reverse_task_tokenizer  # noqa: E402

KILL_STEP = 3
killing = rank == 1 and kill != "none"
step = {"now": 0}


def die():
    with open(os.path.join(out_dir, "killed_at"), "w") as clock:  # when, for the survivor's time to its error
        clock.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def leading_ones(completions, **kwargs):
    if killing and kill == "rollout" and step["now"] == KILL_STEP - 1:
        die()
    return [float(len(c) - len(c.lstrip("1"))) for c in completions]


class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        step["now"] = state.global_step


tokenizer = reverse_task_tokenizer()
model = build_tiny_causal_lm(tokenizer, seed=0)
if killing and kill == "step":
    model.register_forward_hook(
        lambda module, inputs, output: die() if module.training and step["now"] == KILL_STEP - 1 else None
    )
args = TargetPOConfig(
    output_dir=out_dir, per_device_train_batch_size=4, num_generations=8, max_completion_length=6, max_steps=6,
    learning_rate=1e-2, save_steps=2, report_to="none", use_cpu=True, ddp_backend="gloo", ddp_timeout=60,
    disable_tqdm=True, logging_steps=1, seed=0,
)  # fmt: skip
trainer = TargetPOTrainer(
    model, leading_ones, args=args, train_dataset=reverse_task_dataset(num_prompts=32), processing_class=tokenizer,
    callbacks=[Clock()],
)  # fmt: skip
if killing and kill == "checkpoint":
    save_rng_state = trainer._save_rng_state

    def dying_save_rng_state(output_dir):  # the model is written by then; this process's random state is not
        if step["now"] == KILL_STEP:
            die()
        save_rng_state(output_dir)

    trainer._save_rng_state = dying_save_rng_state
trainer.train(resume_from_checkpoint=True if resume else None)
torch.save(torch.cat([p.detach().flatten() for p in model.parameters()]), os.path.join(out_dir, f"weights_rank{rank}.pt"))
