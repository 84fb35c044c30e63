"""A group larger than a micro-batch: K long completions, trained in micro-batches of a few rows spread over the
micro-steps of one optimiser step, against the whole group in one micro-batch.

The training pass is what is measured, so the rollout is a ``rollout_func`` that returns random completions at once,
of exactly ``--completion_length`` tokens (no EOS: truncated, which the default ``mask_truncated_completions=False``
trains on) or, with ``--spread uniform``, of lengths drawn up to it (below it they end in EOS): generating thousands
of tokens with ``model.generate`` would take minutes per step and says nothing about memory. The model is the Qwen2-shaped one of ``step_time.py``
(random weights, a 151,936-token vocabulary) with the dense reward of that script, so no completion's gradient is
zero. Each variant runs in a process of its own (an out-of-memory error leaves the allocator unusable), trains
``--steps`` optimiser steps of one rollout each, and reports the peak GPU memory and the seconds of the steps after
the first. ``--memory_gib`` caps what the process may allocate (``torch.cuda.set_per_process_memory_fraction``),
to stand for a smaller card on a larger one.

    python benchmarks/large_group.py --device cuda --num_generations 16 --completion_length 4096 \
        --micro_batches 2 16 --output docs/benchmarks/large_group_h200_4096.json

``--spread uniform`` draws each completion's length evenly from ``--min_completion_length`` to
``--completion_length`` (the shorter ones end in EOS), as long rollouts spread; ``--padding_free`` packs each pass's
rows, under the model's ``--attn_implementation``:

    python benchmarks/large_group.py --device cuda --num_generations 16 --completion_length 8192 --spread uniform \
        --micro_batches 16 2 --padding_free --attn_implementation flex_attention \
        --output docs/benchmarks/large_group_h200_8192_uniform_packed_flex.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch
from step_time import (
    StepTimer,
    add_qwen2_shape_arguments,
    build_qwen2,
    even_token_fraction,
    random_prompts_dataset,
    word_tokenizer,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_generations", type=int, default=16)
    parser.add_argument("--completion_length", type=int, default=4096, help="Every completion's length, or the longest.")
    parser.add_argument(
        "--spread",
        choices=("fixed", "uniform"),
        default="fixed",
        help="fixed: every completion --completion_length tokens; uniform: lengths drawn evenly from "
        "--min_completion_length to --completion_length, the shorter ones ending in EOS.",
    )
    parser.add_argument("--min_completion_length", type=int, default=16)
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument(
        "--micro_batches",
        type=int,
        nargs="+",
        default=[2, 16],
        help="Rows per micro-batch, one run each; a value below --num_generations spreads the group "
        "over num_generations / value micro-steps of one optimiser step.",
    )
    parser.add_argument(
        "--num_iterations",
        type=int,
        default=1,
        help="Above 1, the steps after a rollout need the no-grad pass over the group's log-probs.",
    )
    parser.add_argument("--steps", type=int, default=3, help="Optimiser steps per run; the first is dropped.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--logps_head_kernel", choices=("auto", "torch", "triton"), default="auto")
    parser.add_argument("--attn_implementation", default="sdpa")
    parser.add_argument("--padding_free", action="store_true", help="Pack each pass's rows into one row.")
    parser.add_argument("--memory_gib", type=float, default=None, help="Cap on the process's GPU memory.")
    add_qwen2_shape_arguments(parser)
    parser.add_argument("--output", default=None)
    parser.add_argument("--one_run", type=int, default=None, help=argparse.SUPPRESS)  # a child's micro-batch size
    return parser.parse_args()


def random_completions(args: argparse.Namespace, eos_token_id: int, seed: int):
    """A ``rollout_func``: each prompt's ids and random non-special tokens as its completion, of
    ``--completion_length`` tokens or (``--spread uniform``) of a length drawn up to it, ending in EOS if shorter."""
    rng = random.Random(seed)
    longest = args.completion_length

    def completion() -> list[int]:
        length = longest if args.spread == "fixed" else rng.randint(args.min_completion_length, longest)
        tokens = [rng.randrange(3, args.vocab_size) for _ in range(length)]
        return tokens if length == longest else [*tokens[:-1], eos_token_id]

    def rollout(prompts, trainer):
        # The prompts are words "t<id>" of the word-level tokenizer: their ids are read off directly.
        prompt_ids = [[int(word[1:]) for word in prompt.split()] for prompt in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": [completion() for _ in prompts]}

    return rollout


def one_run(args: argparse.Namespace, micro_batch: int) -> dict:
    from targetpo import TargetPOConfig, TargetPOTrainer

    on_gpu = args.device == "cuda"
    if on_gpu and args.memory_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gib * 2**30 / total))
    tokenizer = word_tokenizer(args.vocab_size)
    model = build_qwen2(args, tokenizer)
    micro_steps = args.num_generations // micro_batch
    config = TargetPOConfig(
        output_dir="/tmp/large_group",
        per_device_train_batch_size=micro_batch,
        num_generations=args.num_generations,
        steps_per_generation=micro_steps,
        gradient_accumulation_steps=micro_steps,
        num_iterations=args.num_iterations,
        max_completion_length=args.completion_length,
        gradient_checkpointing=args.gradient_checkpointing,
        logps_head_kernel=args.logps_head_kernel,
        padding_free=args.padding_free,
        bf16=args.dtype == "bfloat16",
        use_cpu=not on_gpu,
        learning_rate=1e-5,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    timer = StepTimer(synchronize=on_gpu)
    trainer = TargetPOTrainer(
        model=model,
        reward_funcs=even_token_fraction,
        args=config,
        train_dataset=random_prompts_dataset(args.vocab_size, args.prompt_length, num_prompts=64, seed=0),
        processing_class=tokenizer,
        rollout_func=random_completions(args, tokenizer.eos_token_id, seed=0),
        callbacks=[timer],
    )
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated() if on_gpu else 0
    result = {"micro_batch": micro_batch, "micro_steps": micro_steps}
    try:
        trainer.train()
    except torch.OutOfMemoryError as error:
        result["out_of_memory"] = str(error).split("\n")[0][:300]
    else:
        result["seconds"] = timer.seconds[1:]
        result["losses"] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    if on_gpu:
        result["peak_gib"] = (torch.cuda.max_memory_allocated() - baseline) / 2**30
        result["weights_gib"] = baseline / 2**30
    return result


def main() -> None:
    args = parse_args()
    if args.one_run is not None:
        print(json.dumps(one_run(args, args.one_run)))
        return
    if args.spread == "uniform" and not 1 <= args.min_completion_length <= args.completion_length:
        raise SystemExit(f"--min_completion_length {args.min_completion_length}: from 1 to --completion_length.")
    for micro_batch in args.micro_batches:
        if args.num_generations % micro_batch:
            raise SystemExit(f"--micro_batches: {micro_batch} does not divide --num_generations {args.num_generations}")
    results = []
    for micro_batch in args.micro_batches:
        started = time.perf_counter()
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--one_run", str(micro_batch)],
            capture_output=True,
            text=True,
            check=False,  # a failed run is reported with its output
        )
        lines = child.stdout.strip().splitlines()
        if child.returncode or not lines:
            result = {"micro_batch": micro_batch, "failed": child.stderr[-2000:]}
        else:
            result = json.loads(lines[-1])
        result["wall_seconds"] = time.perf_counter() - started
        results.append(result)
        print(json.dumps(result), flush=True)
    environment = {"torch": torch.__version__}
    if args.device == "cuda":
        environment.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    if args.output:
        settings = {key: value for key, value in vars(args).items() if key not in ("output", "one_run")}
        with open(args.output, "w") as handle:
            json.dump({"settings": settings, "environment": environment, "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
