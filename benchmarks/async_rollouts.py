"""Rollout throughput in server mode with and without `async_rollouts`, through one `vllm serve` process.

The same short training run (same model, seed, prompts and settings) is trained with `async_rollouts=False` (each
rollout is generated after the previous optimiser step, with its weights) and `async_rollouts=True` (the next
rollout is generated while the current one trains, by the weights of the step before), alternately, against one
server, each run in a fresh process. Reported: completion tokens generated (and trained on) per second of
wall-clock training time, the total time, and from the trainer's log the mean seconds it waited for each rollout
and the mean staleness of the weights that sampled it, with the ratio async / sync. Only '0' and '1' can be sampled
(EOS is suppressed), so every completion has exactly `--completion_length` tokens, and the reward is dense (the
fraction of the reversed string matched), so every step trains on every completion.

On a CPU vLLM binds its worker's threads to all cores but one, which it leaves to its other processes. Two layouts
of the trainer are compared: `shared` (the trainer's torch threads on every core, as by default) and `split` (the
trainer pinned, with one thread, to the core the worker leaves free), where generating ahead has a core to itself.

With ``--task lock`` the rollouts are agent episodes: the embedded lock (``targetpo.demo.Lock``), one ``press`` call
per turn, each call taking ``--tool_seconds`` on average (a tool's own latency, drawn per call between 0 and twice
that), the samples' calls side by side (``tool_call_concurrency``). Asynchronous rollouts then play the next
rollout's episodes (turns and tool calls) on a thread of their own. Reported as well: episodes per second.

    python benchmarks/async_rollouts.py --output docs/benchmarks/async_rollouts.json
    python benchmarks/async_rollouts.py --task lock --output docs/benchmarks/async_agent_rollouts.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import add_quiet_arguments, environment, report, run_when_quiet

REPOSITORY = Path(__file__).resolve().parents[1]
LAYOUTS = ("shared", "split")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--num_heads", type=int, default=4, help="hidden_size / num_heads must be a head size vLLM's "
                        "CPU attention accepts (32, 64, 80, 96, 112, 128, ...).")
    parser.add_argument("--task", choices=("reverse", "lock"), default="reverse",
                        help="reverse: one completion per prompt; lock: multi-turn episodes with tool calls.")
    parser.add_argument("--lock_keys", type=int, default=4, help="lock: keys to press, one tool call per turn.")
    parser.add_argument("--tool_seconds", type=float, default=0.1, help="lock: a tool call's mean latency.")
    parser.add_argument("--prompts", type=int, default=8, help="Prompts per rollout (one rollout per optimiser step).")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--completion_length", type=int, default=48)
    parser.add_argument("--steps", type=int, default=10, help="Optimiser steps per run.")
    parser.add_argument("--warmup_steps", type=int, default=2, help="Steps left out of the steady-state rate.")
    parser.add_argument("--rounds", type=int, default=2, help="Runs per setting and layout (sync and async alternate).")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    add_quiet_arguments(parser)
    parser.add_argument("--output", default=None, help="Also write the results as JSON here.")
    # Internal: one training run, in a process of its own.
    parser.add_argument("--run", choices=("sync", "async"), help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args()


def reversal_fraction_reward(completions: list[str], target: list[str], **kwargs) -> list[float]:
    """The fraction of the reversed string's characters in place: dense, so every group has a gradient."""
    return [sum(a == b for a, b in zip(text, expected)) / len(expected) for text, expected in zip(completions, target)]


class SlowLock:
    """The lock, whose ``press`` takes a tool's time: drawn per call between 0 and twice ``seconds``."""

    seconds = 0.1

    def __init__(self) -> None:
        import random

        from targetpo.demo import Lock

        self.lock, self.random = Lock(), random.Random(0)

    def reset(self, **row) -> None:
        self.random.seed(row["code"])  # each prompt's calls take the same times in every run
        self.lock.reset(**row)

    def press(self, number: int) -> str:
        """Press one key of the lock.

        Args:
            number: the key, 0 or 1.
        """
        time.sleep(self.random.uniform(0, 2 * self.seconds))
        return self.lock.press(number)

    def get_reward(self) -> float:
        return self.lock.get_reward()


def task_settings(args: argparse.Namespace) -> dict:
    """The task's tokenizer, its config settings and the trainer's data, reward or environment."""
    from targetpo.demo import (
        binary_only_generation_kwargs,
        digits_only_generation_kwargs,
        lock_dataset,
        lock_tokenizer,
        reverse_task_dataset,
        reverse_task_tokenizer,
    )

    prompts = max(256, args.prompts * args.steps)
    if args.task == "reverse":
        tokenizer = reverse_task_tokenizer()
        return {
            "tokenizer": tokenizer,
            "settings": {
                "max_completion_length": args.completion_length,
                # '0' and '1' only: EOS never ends a completion
                "generation_kwargs": binary_only_generation_kwargs(tokenizer),
            },
            "trainer": {
                "reward_funcs": reversal_fraction_reward,
                "train_dataset": reverse_task_dataset(length=6, num_prompts=prompts, seed=0),
            },
        }
    tokenizer = lock_tokenizer()
    SlowLock.seconds = args.tool_seconds
    return {
        "tokenizer": tokenizer,
        "settings": {
            "max_completion_length": 4 * args.lock_keys + 4,
            "max_tool_calling_iterations": args.lock_keys,
            "tool_call_concurrency": args.prompts * args.num_generations,  # every sample's call side by side
            "generation_kwargs": digits_only_generation_kwargs(tokenizer, "01"),
        },
        "trainer": {"environment_factory": SlowLock, "train_dataset": lock_dataset(args.lock_keys, prompts, seed=0)},
    }


def trainer_cpu() -> int:
    """The core vLLM's CPU worker leaves to other processes: the last one this process may use."""
    return max(os.sched_getaffinity(0))


def train_once(args: argparse.Namespace) -> None:
    """One training run against the server at ``args.url``; its measurements go to ``args.result``."""
    if args.layout == "split":
        os.sched_setaffinity(0, {trainer_cpu()})  # before torch starts its threads, which inherit it
    import torch
    from transformers import TrainerCallback

    from targetpo import TargetPOConfig, TargetPOTrainer
    from targetpo.demo import build_tiny_causal_lm

    if args.layout == "split":
        torch.set_num_threads(1)

    class StepClock(TrainerCallback):
        """Wall-clock time at the start of training and at the end of each optimiser step."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.times = [time.perf_counter()]

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    task = task_settings(args)
    tokenizer = task["tokenizer"]
    config = TargetPOConfig(
        output_dir=str(Path(args.result).with_suffix("")),
        per_device_train_batch_size=args.prompts * args.num_generations,
        num_generations=args.num_generations,
        max_prompt_length=32,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=args.url,
        vllm_server_timeout=180,
        skip_zero_gradient_completions=False,  # the same work every step, whatever the rewards
        async_rollouts=args.run == "async",
        **task["settings"],
    )
    trainer = TargetPOTrainer(
        model=build_tiny_causal_lm(tokenizer, args.hidden_size, args.num_layers, args.num_heads, seed=0),
        args=config,
        processing_class=tokenizer,
        **task["trainer"],
    )
    clock = StepClock()
    trainer.add_callback(clock)
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started

    def logged(name):
        return [entry[name] for entry in trainer.state.log_history if name in entry]

    rows = config.per_device_train_batch_size
    tokens = [length * rows for length in logged("completions/mean_length")]
    if len(tokens) != args.steps or len(clock.times) != args.steps + 1:
        raise RuntimeError(f"{args.steps} steps expected: {len(tokens)} rollouts, {len(clock.times) - 1} steps logged.")
    warmup = min(args.warmup_steps, args.steps - 1)
    result = {
        "async_rollouts": config.async_rollouts,
        "layout": args.layout,
        "affinity": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "total_seconds": total,
        "tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / total,
        "steady_tokens_per_s": sum(tokens[warmup:]) / (clock.times[-1] - clock.times[warmup]),
        "step_seconds": [b - a for a, b in zip(clock.times, clock.times[1:])],
        "generation_wait_seconds": logged("rollout/generation_wait_seconds"),
        "staleness_mean": logged("rollout/staleness_mean"),
        "mean_length": logged("completions/mean_length"),
        "reward_mean": logged("reward"),
        "episodes_per_s": rows * args.steps / total,
        "turns_per_sample": logged("multi_turn/turns_per_sample"),
    }
    Path(args.result).write_text(json.dumps(result))


def summary(runs: list[dict], warmup: int) -> dict:
    return {
        "tokens_per_s": round(statistics.mean(run["tokens_per_s"] for run in runs), 1),
        "steady_tokens_per_s": round(statistics.mean(run["steady_tokens_per_s"] for run in runs), 1),
        "total_seconds": round(statistics.mean(run["total_seconds"] for run in runs), 2),
        "mean_step_seconds": round(statistics.mean(s for run in runs for s in run["step_seconds"][warmup:]), 3),
        "mean_generation_wait_seconds": round(
            statistics.mean(w for run in runs for w in run["generation_wait_seconds"]), 3
        ),
        "mean_staleness": round(statistics.mean(s for run in runs for s in run["staleness_mean"]), 3),
        "episodes_per_s": round(statistics.mean(run["episodes_per_s"] for run in runs), 2),
    }


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the server is stopped on a kill too
    sys.path.insert(0, str(REPOSITORY))  # this checkout's targetpo, whatever else is installed
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.run:
        train_once(args)
        return
    sys.path.insert(1, str(REPOSITORY / "tests"))  # the tests' `vllm serve` launcher
    from vllm_serve import served_vllm

    from targetpo.demo import build_tiny_causal_lm

    tokenizer = task_settings(args)["tokenizer"]
    runs: dict[str, dict[str, list]] = {layout: {"sync": [], "async": []} for layout in args.layouts}
    disturbed: list[dict] = []  # runs redone because other work kept the machine busy around them
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="targetpo-async-rollouts-") as work:
        served = Path(work) / "served"
        # The server starts from other weights than the policy's: the first push gives it the policy.
        model = build_tiny_causal_lm(tokenizer, args.hidden_size, args.num_layers, args.num_heads, seed=1)
        parameters = sum(parameter.numel() for parameter in model.parameters())
        model.save_pretrained(served)
        tokenizer.save_pretrained(served)
        del model
        with served_vllm(served, Path(work) / "server.log") as base_url:

            def run(setting: str, layout: str, steps: int, label: str) -> dict:
                result = Path(work) / f"{label}.json"
                options = [f"--{name}={getattr(args, name)}" for name in
                           ("hidden_size", "num_layers", "num_heads", "prompts", "num_generations", "completion_length",
                            "warmup_steps", "task", "lock_keys", "tool_seconds")]
                subprocess.run([sys.executable, str(Path(__file__).resolve()), "--run", setting, "--layout", layout,
                                "--url", base_url, "--result", str(result), f"--steps={steps}", *options],
                               env=env, check=True, stdout=subprocess.DEVNULL)
                return json.loads(result.read_text())

            run("sync", args.layouts[0], 2, "warmup")  # the server's first pushes and generations, not timed
            for round_index in range(args.rounds):
                for layout in args.layouts:
                    for setting in ("sync", "async"):
                        label = f"{layout}-{setting}-{round_index}"
                        result = run_when_quiet(  # the run is made now, in this iteration
                            lambda attempt: run(setting, layout, args.steps, f"{label}-{attempt}"),  # noqa: B023
                            args,
                            disturbed,
                        )
                        result.update(round=round_index)
                        runs[layout][setting].append(result)
                        print(json.dumps({"layout": layout, "setting": setting, "round": round_index,
                                          "tokens_per_s": round(result["tokens_per_s"], 1),
                                          "steady_tokens_per_s": round(result["steady_tokens_per_s"], 1),
                                          "total_seconds": round(result["total_seconds"], 2)}), flush=True)
    layouts = {}
    for layout in args.layouts:
        sync = summary(runs[layout]["sync"], args.warmup_steps)
        asynchronous = summary(runs[layout]["async"], args.warmup_steps)
        layouts[layout] = {
            "sync": sync,
            "async": asynchronous,
            "async_over_sync_tokens_per_s": round(asynchronous["tokens_per_s"] / sync["tokens_per_s"], 2),
            "async_over_sync_steady_tokens_per_s": round(
                asynchronous["steady_tokens_per_s"] / sync["steady_tokens_per_s"], 2
            ),
        }
        print(json.dumps({"layout": layout, **layouts[layout]}), flush=True)
    result = {
        "model": {"hidden_size": args.hidden_size, "num_layers": args.num_layers, "num_heads": args.num_heads,
                  "parameters": parameters},
        "task": args.task,
        "lock_keys": args.lock_keys if args.task == "lock" else None,
        "tool_seconds": args.tool_seconds if args.task == "lock" else None,
        "completions_per_step": args.prompts * args.num_generations,
        "completion_length": args.completion_length,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "rounds": args.rounds,
        "layouts": layouts,
        "runs": runs,
        "disturbed_runs_redone": disturbed,
    }
    report(environment(), result, args.output)


if __name__ == "__main__":
    main()
