"""Learning efficiency under a terminal reward: success rate over training for TPO, a GRPO baseline in targetpo's own
rollout path, and TRL's GRPOTrainer.

The task is the paper's: reverse a binary string of length H; the reward is 1 only for an exact reversal; only '0'
and '1' can be emitted, so every completion has exactly H tokens and a random policy succeeds 2^-H of the time.
Each run trains the embedded demo model from scratch with K = 8 completions for 16 prompts per step. targetpo's TPO
and GRPO runs are paired: same seed, same rollout code, only `loss_type` differs. TRL runs with the same settings
and its defaults otherwise, except bf16 and gradient checkpointing, which its config turns on
and targetpo's does not (both run float32 without checkpointing). The success rate is the mean reward of the sampled completions, logged every
`--log_every` steps. Results are appended to the JSON file after every run, so an interrupted sweep keeps what it
finished; `--plot_only` redraws the figure and table from that file.

    python benchmarks/learning_efficiency.py --output docs/benchmarks/learning_efficiency.json

With ``--task guess`` the task is the multi-turn guessing game (``targetpo.demo.GuessingGame``): find a hidden digit
0-7 with a `guess` tool answering higher/lower, reward 1 only if a guess hits within three calls (optimum 7/8 with
halving guesses). TPO and the GRPO loss run paired, as above; the rollouts are multi-turn, tool tokens out of the loss.

    python benchmarks/learning_efficiency.py --task guess --steps 1000 --output docs/benchmarks/multi_turn_learning.json

With ``--task lock`` it is the sparse multi-turn task (``targetpo.demo.Lock``): press the prompt's H bits in reverse
order, one `press` tool call per key, every press answered "." and the reward 1 only for the whole code. TPO, the
GRPO loss and the DAPO loss run paired on the same rollout code:

    python benchmarks/learning_efficiency.py --task lock --lengths 4 --steps 600 --log_every 25 \\
        --methods targetpo-tpo targetpo-grpo targetpo-dapo --seeds 0 1 2 3 4 --output docs/benchmarks/lock_learning.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

METHODS = ("targetpo-tpo", "targetpo-grpo", "targetpo-dapo", "trl-grpo")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("reverse", "guess", "lock"), default="reverse")
    parser.add_argument("--lengths", type=int, nargs="+", default=[6, 8], help="reverse: string lengths; lock: keys")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--log_every", type=int, default=50)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--num_iterations", type=int, default=1,
                        help="Optimiser steps per rollout (each rollout trained on this many times).")
    parser.add_argument("--output", default="docs/benchmarks/learning_efficiency.json")
    parser.add_argument("--plot_only", action="store_true")
    return parser.parse_args()


def make_trainer(method: str, settings: dict, **trainer_kwargs):
    """The trainer of ``method`` (one of METHODS) with ``settings`` as its config fields: TRL's GRPOTrainer for
    ``trl-grpo``, else targetpo's trainer with the loss the method names."""
    if method == "trl-grpo":
        from trl import GRPOConfig, GRPOTrainer

        # TRL's config turns on bf16 and gradient checkpointing by default; targetpo's (TrainingArguments') does not.
        return GRPOTrainer(args=GRPOConfig(bf16=False, gradient_checkpointing=False, **settings), **trainer_kwargs)
    from targetpo import TargetPOConfig, TargetPOTrainer

    loss_type = method.removeprefix("targetpo-")
    return TargetPOTrainer(args=TargetPOConfig(loss_type=loss_type, **settings), **trainer_kwargs)


def train_once(method: str, length: int, seed: int, args: argparse.Namespace) -> list[list[float]]:
    """One run; returns [step, success rate] at every log."""
    from targetpo.demo import (
        binary_only_generation_kwargs,
        build_tiny_causal_lm,
        exact_reversal_reward,
        reverse_task_dataset,
        reverse_task_tokenizer,
    )

    tokenizer = reverse_task_tokenizer()
    settings = dict(
        output_dir=f"/tmp/learning_efficiency/{args.task}-{method}-H{length}-i{args.num_iterations}-s{seed}",
        num_iterations=args.num_iterations,
        per_device_train_batch_size=128,
        num_generations=8,
        max_completion_length=length,
        generation_kwargs=binary_only_generation_kwargs(tokenizer),
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        logging_steps=args.log_every,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        use_cpu=True,
    )
    if args.task == "reverse":
        common = dict(
            model=build_tiny_causal_lm(tokenizer, seed=seed),
            reward_funcs=exact_reversal_reward,
            train_dataset=reverse_task_dataset(length, num_prompts=4096, seed=seed),
            processing_class=tokenizer,
        )
    elif args.task == "lock":
        from targetpo.demo import Lock, digits_only_generation_kwargs, lock_dataset, lock_tokenizer

        tokenizer = lock_tokenizer()
        settings.update(
            max_completion_length=4 * length + 4,  # every press, its tool turn, and the last turn
            max_tool_calling_iterations=length,
            generation_kwargs=digits_only_generation_kwargs(tokenizer, "01"),
        )
        common = dict(
            model=build_tiny_causal_lm(tokenizer, seed=seed),
            reward_funcs=None,  # the lock scores itself (get_reward)
            train_dataset=lock_dataset(length, num_prompts=4096, seed=seed),
            processing_class=tokenizer,
            environment_factory=Lock,
        )
    else:
        from targetpo.demo import GuessingGame, digits_only_generation_kwargs, guessing_dataset, guessing_tokenizer

        tokenizer = guessing_tokenizer()
        settings.update(
            max_completion_length=20,
            max_tool_calling_iterations=3,
            generation_kwargs=digits_only_generation_kwargs(tokenizer),
        )
        common = dict(
            model=build_tiny_causal_lm(tokenizer, seed=seed),
            reward_funcs=None,  # the game scores itself (get_reward)
            train_dataset=guessing_dataset(num_prompts=4096, seed=seed),
            processing_class=tokenizer,
            environment_factory=GuessingGame,
        )
    trainer = make_trainer(method, settings, **common)
    trainer.train()
    return [[entry["step"], entry["reward"]] for entry in trainer.state.log_history if "reward" in entry]


def summarise(runs: list[dict], steps_per_log: int) -> list[dict]:
    """Per method and H: final success (mean of the last 3 logs) and mean success over training, over seeds."""
    rows = []
    for length in sorted({run["length"] for run in runs}):
        for method in METHODS:
            chosen = [run for run in runs if run["length"] == length and run["method"] == method]
            if not chosen:
                continue
            finals = [statistics.mean(rate for _, rate in run["curve"][-3:]) for run in chosen]
            means = [statistics.mean(rate for _, rate in run["curve"]) for run in chosen]
            rows.append(
                {
                    "H": length,
                    "method": method,
                    "seeds": len(chosen),
                    "final_success_mean": round(statistics.mean(finals), 3),
                    "final_success_min": round(min(finals), 3),
                    "final_success_max": round(max(finals), 3),
                    "mean_success_over_training": round(statistics.mean(means), 3),
                }
            )
    return rows


def plot(runs: list[dict], path: Path, args_task: str = "reverse") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({run["length"] for run in runs})
    figure, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4), squeeze=False)
    colours = {"targetpo-tpo": "tab:blue", "targetpo-grpo": "tab:orange", "targetpo-dapo": "tab:red",
               "trl-grpo": "tab:green"}
    for axis, length in zip(axes[0], lengths):
        for method in METHODS:
            chosen = [run for run in runs if run["length"] == length and run["method"] == method]
            for index, run in enumerate(chosen):
                steps, rates = zip(*run["curve"])
                axis.plot(steps, rates, color=colours[method], alpha=0.8, label=method if index == 0 else None)
        if length == 0:
            axis.set_title("guess a hidden digit 0-7 with a tool, 3 calls (optimum 0.875)")
        elif args_task == "lock":
            axis.set_title(f"open a {length}-key lock, one tool call per key, reward at the end")
        else:
            axis.set_title(f"reverse a {length}-bit string (random: {2 ** -length:.4f})")
        axis.set_xlabel("optimiser step (128 completions each)")
        axis.set_ylabel("success rate of sampled completions")
        axis.set_ylim(0, 1)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    args = parse_args()
    output = Path(args.output)
    runs = json.loads(output.read_text())["runs"] if output.exists() else []
    if args.task == "guess":
        args.lengths = [0]  # one game: the runs are keyed H = 0
    if args.task != "reverse":  # TRL's multi-turn environments take another form of task: left out
        args.methods = [method for method in args.methods if method != "trl-grpo"]
    if not args.plot_only:
        for length in args.lengths:
            for seed in args.seeds:
                for method in args.methods:
                    if any(r["method"] == method and r["length"] == length and r["seed"] == seed for r in runs):
                        continue  # already measured
                    curve = train_once(method, length, seed, args)
                    runs.append({"method": method, "length": length, "seed": seed, "curve": curve})
                    print(json.dumps({"method": method, "H": length, "seed": seed, "final": curve[-1]}), flush=True)
                    output.write_text(json.dumps({"settings": vars(args), "runs": runs}, indent=1))
    table = summarise(runs, args.log_every)
    for row in table:
        print(json.dumps(row))
    output.write_text(json.dumps({"settings": vars(args), "runs": runs, "summary": table}, indent=1))
    plot(runs, output.with_suffix(".png"), args.task)


if __name__ == "__main__":
    main()
