"""Seconds per optimiser step: targetpo's TargetPOTrainer vs TRL's GRPOTrainer at equal settings, alternated in one run.

Three trainers train the same tiny model (same config and initial weights) with the same tokenizer, prompts, reward,
batch, K, completion length, sampling, learning rate and seed, with `model.generate` rollouts on the CPU: targetpo
as configured by default, targetpo with `skip_zero_gradient_completions=False` (what skipping saves), and TRL. The
runs alternate (targetpo, targetpo without skipping, TRL, ...) so drifts in machine speed hit all three; each
optimiser step is timed by a callback (rollout, rewards, forward and backward, optimiser), the first steps of every
run are dropped as warm-up, and the median over the rest is reported with the ratios to TRL. TRL is a benchmark-only dependency:
`pip install -e ".[bench]"`.

    python benchmarks/step_time.py --rounds 5 --output docs/benchmarks/step_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from targetpo import TargetPOConfig, TargetPOTrainer  # noqa: E402
from targetpo.demo import (  # noqa: E402
    binary_only_generation_kwargs,
    build_tiny_causal_lm,
    exact_reversal_reward,
    reverse_task_dataset,
    reverse_task_tokenizer,
)


class StepTimer(TrainerCallback):
    """Wall-clock seconds of every optimiser step."""

    def __init__(self):
        self.seconds: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_iterations", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=40, help="Optimiser steps per run.")
    parser.add_argument("--warmup", type=int, default=5, help="Steps dropped at the start of every run.")
    parser.add_argument("--rounds", type=int, default=3, help="Alternations of the two trainers.")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--reverse_length", type=int, default=6)
    parser.add_argument("--output", default=None)
    return parser.parse_args()


def shared_settings(args: argparse.Namespace, num_iterations: int, output_dir: str) -> dict:
    tokenizer = reverse_task_tokenizer()
    return dict(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.reverse_length,
        generation_kwargs=binary_only_generation_kwargs(tokenizer),
        num_iterations=num_iterations,
        # Each rollout feeds num_iterations optimiser steps, so old log-probs are needed (and computed) by both.
        steps_per_generation=1,
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        use_cpu=True,
    )


def timed_run(trainer_class, config_class, args, num_iterations, dataset, **config_overrides):
    """Train one trainer for ``args.steps`` steps; the seconds of every step after the warm-up, and its logs."""
    tokenizer = reverse_task_tokenizer()
    timer = StepTimer()
    settings = shared_settings(args, num_iterations, f"/tmp/step_time_{trainer_class.__name__}")
    trainer = trainer_class(
        model=build_tiny_causal_lm(tokenizer, seed=0),
        reward_funcs=exact_reversal_reward,
        args=config_class(**settings, **config_overrides),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    return timer.seconds[args.warmup :], trainer.state.log_history


def main() -> None:
    from trl import GRPOConfig, GRPOTrainer

    args = parse_args()
    dataset = reverse_task_dataset(args.reverse_length, num_prompts=4096, seed=0)
    results = []
    for num_iterations in args.num_iterations:
        seconds = {"targetpo": [], "targetpo_no_skipping": [], "trl": []}
        skipped_fractions = []
        for _ in range(args.rounds):
            timed, logs = timed_run(TargetPOTrainer, TargetPOConfig, args, num_iterations, dataset)
            seconds["targetpo"] += timed
            skipped_fractions += [entry["completions/skipped_fraction"] for entry in logs if "completions/skipped_fraction" in entry]
            # The same trainer putting every completion through the model, as TRL does: what skipping saves.
            seconds["targetpo_no_skipping"] += timed_run(
                TargetPOTrainer, TargetPOConfig, args, num_iterations, dataset, skip_zero_gradient_completions=False
            )[0]
            # TRL's config turns on bf16 and gradient checkpointing by default; targetpo's (TrainingArguments') does not.
            seconds["trl"] += timed_run(
                GRPOTrainer, GRPOConfig, args, num_iterations, dataset, bf16=False, gradient_checkpointing=False
            )[0]
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        result = {
            "num_iterations": num_iterations,
            "targetpo_median_s": round(medians["targetpo"], 4),
            "targetpo_no_skipping_median_s": round(medians["targetpo_no_skipping"], 4),
            "trl_median_s": round(medians["trl"], 4),
            "targetpo_over_trl": round(medians["targetpo"] / medians["trl"], 3),
            "targetpo_no_skipping_over_trl": round(medians["targetpo_no_skipping"] / medians["trl"], 3),
            "targetpo_skipped_fraction": round(statistics.mean(skipped_fractions), 3),
            "steps_timed_each": len(seconds["targetpo"]),
        }
        results.append(result)
        print(json.dumps(result), flush=True)
    import trl

    environment = {"torch": torch.__version__, "trl": trl.__version__, "cpu_threads": torch.get_num_threads()}
    print(json.dumps(environment))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"settings": vars(args), "environment": environment, "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
