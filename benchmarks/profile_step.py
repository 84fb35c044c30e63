"""Where a training step's time goes: ``torch.profiler`` tables of targetpo's and TRL's steps that reuse a rollout.

Takes ``step_time.py``'s settings (the same model, task and trainers) and trains each trainer named in
``--trainers`` for 7 steps at ``num_iterations=4``, profiling steps 6 and 7, which reuse the rollout of step 5: one
forward, backward and optimiser step each. Prints each trainer's operators and kernels, sorted by their GPU time
(their CPU time on the CPU).

    python benchmarks/profile_step.py --device cuda --dtype bfloat16 --model qwen2 --trainers targetpo trl \
        > docs/benchmarks/profile_training_step_h200.txt
"""

from __future__ import annotations

import sys

import step_time
import torch
from transformers import TrainerCallback

#: Steps (counted from 0, as ``state.global_step`` before each) profiled: neither generates at num_iterations=4.
PROFILED_STEPS = (5, 6)


class StepProfiler(TrainerCallback):
    """Runs ``torch.profiler`` over the optimiser steps ``PROFILED_STEPS``."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.profile = None

    def _synchronize(self):
        if self.on_gpu:
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == PROFILED_STEPS[0]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.on_gpu:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._synchronize()
            self.profile = torch.profiler.profile(activities=activities)
            self.profile.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.profile is not None and state.global_step == PROFILED_STEPS[-1] + 1:
            self._synchronize()
            self.profile.__exit__(None, None, None)


def main() -> None:
    from trl import GRPOConfig, GRPOTrainer

    from targetpo import TargetPOConfig, TargetPOTrainer

    sys.argv += ["--num_iterations", "4", "--steps", str(PROFILED_STEPS[-1] + 1)]  # the last given wins
    args = step_time.parse_args()
    task = step_time.Task(args)
    on_gpu = args.device == "cuda"
    runs = {
        "targetpo": (TargetPOTrainer, TargetPOConfig, {}),
        "targetpo_torch_head": (TargetPOTrainer, TargetPOConfig, {"logps_head_kernel": "torch"}),
        "trl": (GRPOTrainer, GRPOConfig, {"bf16": False, "gradient_checkpointing": False}),
    }
    for name in args.trainers:
        trainer_class, config_class, overrides = runs[name]
        if args.dtype == "bfloat16":
            overrides = {**overrides, "bf16": True}
        profiler = StepProfiler(on_gpu)
        settings = step_time.shared_settings(args, task, 4, f"/tmp/profile_step_{name}")
        trainer = trainer_class(
            model=task.model(), reward_funcs=task.reward, args=config_class(**settings, **overrides),
            train_dataset=task.dataset, processing_class=task.tokenizer, callbacks=[profiler],
        )  # fmt: skip
        trainer.train()
        print(f"##### {name}: steps {PROFILED_STEPS[0] + 1} and {PROFILED_STEPS[-1] + 1} (no rollout)")
        sort = "cuda_time_total" if on_gpu else "cpu_time_total"
        print(profiler.profile.key_averages().table(sort_by=sort, row_limit=28, max_name_column_width=70))
        del trainer


if __name__ == "__main__":
    main()
