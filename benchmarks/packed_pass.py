"""Seconds of the training log-prob pass (forward + backward of one micro-batch's completion log-probs and entropies):
targetpo's packed rows (``padding_free=True``) vs its padded rows vs TRL's GRPOTrainer, alternated in one run.

The batch has prompts of different lengths (left-padded) and completions whose lengths spread from a few tokens to
``--completion_length`` (right-padded; one row always reaches it, so the padded width is the maximum): ``uniform``
draws each length uniformly, ``long_tail`` from an exponential of mean ``--completion_length / 6`` (most short, a
few long). Each variant runs the same model (a Qwen2 shape with random weights) and rows: ``padded`` is
``completion_logps`` (the trainer's default pass), ``packed`` is ``packed_completion_logps`` (one row of the real
tokens, position ids restarting at 0 per sequence, the head only at completion positions), both with the
``--chunk_size`` head (0: whole logits); ``trl`` is ``GRPOTrainer._get_per_token_logps_and_entropies`` on the
concatenated padded rows, as its ``_compute_loss`` calls it. Rounds alternate the variants (padded, packed, trl, ...)
so drifts in machine speed hit all of them; the first round is dropped as warm-up and the median over the rest is
reported with the ratios to the padded pass and to TRL, and the largest difference of each variant's log-probs from
the padded pass's. TRL is a benchmark-only dependency: ``pip install -e ".[bench]"`` (without it that row is skipped).

``shared_prompts`` (named in ``--variants``) reads each prompt once for the consecutive rows that share it
(``share_prompt_forward``, ``shared_prompt_completion_logps``); ``--group_size K`` gives K consecutive rows one prompt,
as a rollout's groups have, which is where it pays: long prompts, short completions.

    python benchmarks/packed_pass.py --group_size 8 --prompt_length 512 --completion_length 64 \
        --variants padded packed shared_prompts trl --output docs/benchmarks/shared_prompts_long_prompts.json

``padded_budget`` and ``packed_budget`` train the same rows in passes of at most ``--max_tokens`` tokens, as
``max_tokens_per_micro_batch`` cuts a micro-step (``token_budget.plan_passes``: padded passes take rows longest first),
each pass back-propagated before the next; their peak memory is the largest pass's, reported on a GPU.

    python benchmarks/packed_pass.py --spread uniform --output docs/benchmarks/packed_pass_uniform.json
    python benchmarks/packed_pass.py --spread long_tail --output docs/benchmarks/packed_pass_long_tail.json

On a GPU (each pass timed after ``torch.cuda.synchronize()``), a Qwen2-0.5B shape in bfloat16; packing pays most
under flash attention (``--attn_implementation flash_attention_2`` needs the flash-attn package), whose
variable-length kernels skip the other sequences, while sdpa and eager attention compute the packed row's whole
block-diagonal mask:

    python benchmarks/packed_pass.py --device cuda --dtype bfloat16 --vocab_size 151936 --hidden_size 896 \\
        --num_layers 24 --num_heads 14 --num_kv_heads 2 --intermediate_size 4864 --batch_size 16 \\
        --prompt_length 256 --completion_length 2048 --attn_implementation sdpa --rounds 6 \\
        --output docs/benchmarks/packed_pass_h100.json

Training's micro-batches differ in their lengths, and a compiled attention (flex attention) can compile again for a
new shape: ``--fresh_rows`` draws a new batch of the same spread every round. ``--head_kernel triton`` runs targetpo's
variants with the Triton head (a GPU's default), and ``--profile packed packed_budget`` prints, after the rounds, the
costliest operations of one pass of each named variant with its host and device time:

    python benchmarks/packed_pass.py --device cuda --dtype bfloat16 --vocab_size 151936 --hidden_size 896 \\
        --num_layers 24 --num_heads 14 --num_kv_heads 2 --intermediate_size 4864 --batch_size 16 \\
        --prompt_length 256 --completion_length 2048 --attn_implementation flex_attention --rounds 5 --fresh_rows \\
        --head_kernel triton --profile packed packed_budget \\
        --output docs/benchmarks/packed_pass_h200_flex_fresh_triton_head.json

A smoke run (seconds): ``python benchmarks/packed_pass.py --hidden_size 32 --num_layers 1 --vocab_size 256
--batch_size 4 --prompt_length 8 --completion_length 16 --rounds 2``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# This checkout's targetpo when no other is on the path.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch

VARIANTS = ("padded", "packed", "trl", "padded_budget", "packed_budget")
#: Run only when named in ``--variants``: each prompt read once for its group's rows (``share_prompt_forward``).
OPTIONAL_VARIANTS = ("shared_prompts",)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--spread",
        choices=("uniform", "long_tail"),
        default="uniform",
        help="How completion lengths spread between --min_completion_length and --completion_length.",
    )
    parser.add_argument("--batch_size", type=int, default=16, help="Rows of the micro-batch.")
    parser.add_argument(
        "--prompt_length", type=int, default=64, help="The longest prompt; the others are 1/2 to 1 of it."
    )
    parser.add_argument("--completion_length", type=int, default=512, help="The longest completion.")
    parser.add_argument("--min_completion_length", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=32768)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--num_kv_heads", type=int, default=4)
    parser.add_argument("--intermediate_size", type=int, default=None, help="Default: 4 x hidden_size.")
    parser.add_argument("--chunk_size", type=int, default=512, help="targetpo's logps_chunk_size (0: whole logits).")
    parser.add_argument(
        "--head_kernel", choices=("torch", "triton"), default="torch",
        help="targetpo's logps_head_kernel for its variants (triton: GPU only, with --chunk_size).",
    )
    parser.add_argument("--attn_implementation", default="sdpa")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="The model's weights.")
    parser.add_argument("--rounds", type=int, default=6, help="Alternations of the variants (the first is warm-up).")
    parser.add_argument("--variants", nargs="+", choices=(*VARIANTS, *OPTIONAL_VARIANTS), default=list(VARIANTS))
    parser.add_argument("--group_size", type=int, default=1,
                        help="Consecutive rows that share a prompt (a rollout's K completions of one prompt).")
    parser.add_argument(
        "--max_tokens", type=int, default=None,
        help="The budget variants' max_tokens_per_micro_batch (default: two longest sequences).",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fresh_rows",
        action="store_true",
        help="Draw new lengths and tokens every round (as training's micro-batches differ), not one batch throughout; "
        "row 0 still reaches the longest prompt and completion, so the padded width stays.",
    )
    parser.add_argument(
        "--profile",
        nargs="*",
        default=(),
        choices=(*VARIANTS, *OPTIONAL_VARIANTS),
        metavar="VARIANT",
        help="After the rounds, profile one pass of each named variant (among --variants) and print its costliest "
        "operations.",
    )
    parser.add_argument("--output", default=None)
    return parser.parse_args()


def lengths(args: argparse.Namespace, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """Prompt and completion lengths of the rows: completions spread as ``--spread`` says, one at the maximum."""
    rows, longest, shortest = args.batch_size, args.completion_length, args.min_completion_length
    if args.spread == "uniform":
        completions = torch.randint(shortest, longest + 1, (rows,), generator=generator)
    else:
        draws = torch.empty(rows).exponential_(6.0 / longest, generator=generator)
        completions = (shortest + draws).round().long().clamp(max=longest)
    completions[0] = longest
    groups = -(-rows // args.group_size)
    prompts = torch.randint(max(1, args.prompt_length // 2), args.prompt_length + 1, (groups,), generator=generator)
    prompts[0] = args.prompt_length
    return prompts.repeat_interleave(args.group_size)[:rows].tolist(), completions.tolist()


def padded_rows(args: argparse.Namespace, prompt_lengths: list[int], completion_lengths: list[int], generator):
    """Left-padded prompts and right-padded completions of random tokens (ids 3 and up; 2 pads)."""
    width_p, width_c = max(prompt_lengths), max(completion_lengths)
    rows = len(prompt_lengths)
    prompt_ids = torch.randint(3, args.vocab_size, (rows, width_p), generator=generator)
    prompt_ids = prompt_ids[torch.arange(rows) // args.group_size * args.group_size]  # a group's rows: one prompt
    completion_ids = torch.randint(3, args.vocab_size, (rows, width_c), generator=generator)
    prompt_mask = (torch.arange(width_p) >= width_p - torch.tensor(prompt_lengths).unsqueeze(1)).long()
    completion_mask = (torch.arange(width_c) < torch.tensor(completion_lengths).unsqueeze(1)).long()
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 2)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 2)
    return [tensor.to(args.device) for tensor in (prompt_ids, prompt_mask, completion_ids, completion_mask)]


def build_model(args: argparse.Namespace):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    config = Qwen2Config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size or 4 * args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.prompt_length + args.completion_length,
        tie_word_embeddings=True,
        attn_implementation=args.attn_implementation,
    )
    return Qwen2ForCausalLM(config).to(args.device, getattr(torch, args.dtype)).train()


def trl_pass(args: argparse.Namespace, model):
    """TRL's training log-prob pass (and the model as its trainer holds it), or None without TRL."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        print("trl is not installed: skipping its row (pip install trl)")
        return None, model
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=GRPOConfig(
            output_dir="/tmp/trl_packed_pass_benchmark",
            per_device_train_batch_size=args.batch_size,
            num_generations=args.batch_size,
            max_completion_length=args.completion_length,
            report_to="none",
            use_cpu=args.device == "cpu",
            bf16=args.dtype == "bfloat16",
            gradient_checkpointing=False,
        ),
        train_dataset=Dataset.from_dict({"prompt": ["x"] * (2 * args.batch_size)}),
        processing_class=word_tokenizer(args.vocab_size),
    )

    def run(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
        )
        return logps, entropies

    return run, trainer.model


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer of ``vocab_size`` tokens (TRL's trainer needs one to exist): no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", eos_token="t1", pad_token="t2")


def targetpo_passes(args: argparse.Namespace) -> dict:
    from targetpo.modeling.logps import completion_logps, packed_completion_logps, shared_prompt_completion_logps

    chunk_size = args.chunk_size or None

    head = {"head_kernel": args.head_kernel}

    def shared_prompts(model, *rows):
        return shared_prompt_completion_logps(model, *rows, with_entropy=True, chunk_size=chunk_size or 512, **head)

    def padded(model, *rows):
        return completion_logps(model, *rows, with_entropy=True, chunk_size=chunk_size, **head)

    def packed(model, *rows):
        return packed_completion_logps(model, *rows, with_entropy=True, chunk_size=chunk_size, **head)

    budget = args.max_tokens
    return {
        "padded": padded,
        "packed": packed,
        "padded_budget": in_passes(padded, budget, packed=False),
        "packed_budget": in_passes(packed, budget, packed=True),
        "shared_prompts": shared_prompts,
    }


def in_passes(run, budget: int, packed: bool):
    """``run`` over the rows in passes of at most ``budget`` tokens, each back-propagated at once; the log-probs of
    every row, detached (``timed`` then runs no backward of its own)."""
    from targetpo.step.token_budget import plan_passes

    def passes(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        prompt_lengths, completion_lengths = prompt_mask.sum(-1).tolist(), completion_mask.sum(-1).tolist()
        plan = plan_passes(prompt_lengths, completion_lengths, range(len(prompt_lengths)), budget, packed)
        logps = torch.zeros(completion_ids.shape, device=completion_ids.device)
        for members in plan:
            index = torch.tensor(members, device=completion_ids.device)
            rows = [tensor[index] for tensor in (prompt_ids, prompt_mask, completion_ids, completion_mask)]
            part, _ = run(model, *rows)
            (part * rows[3]).sum().backward()
            logps[index] = part.detach().float()
        return logps, None

    return passes


def timed(run, model, rows, synchronize: bool) -> tuple[float, torch.Tensor, float | None]:
    """Seconds of one forward + backward of the masked log-probs' sum, the log-probs, and on a GPU the peak memory
    allocated meanwhile (MiB)."""
    model.zero_grad(set_to_none=True)
    if synchronize:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    logps, _ = run(model, *rows)
    if logps.requires_grad:  # the budget variants back-propagate each pass themselves
        (logps * rows[3]).sum().backward()
    peak = None
    if synchronize:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    return time.perf_counter() - start, logps.detach().float(), peak


def main() -> None:
    args = parse_args()
    if set(args.profile) - set(args.variants):
        raise SystemExit(f"--profile {sorted(set(args.profile) - set(args.variants))}: not among --variants.")
    if args.head_kernel == "triton" and not args.chunk_size:
        raise SystemExit("--head_kernel triton computes the chunked head: set --chunk_size above 0.")
    args.max_tokens = args.max_tokens or 2 * (args.prompt_length + args.completion_length)
    from targetpo.modeling.packing import model_packing_problem

    generator = torch.Generator().manual_seed(args.seed)  # the rows' own stream: the model's is apart from it
    batches = []
    model = build_model(args)
    runs = targetpo_passes(args)
    if "trl" in args.variants:
        trl_run, model = trl_pass(args, model)
        if trl_run is not None:
            runs["trl"] = trl_run
    runs = {name: run for name, run in runs.items() if name in args.variants}
    if set(args.profile) - set(runs):  # trl named but not installed
        raise SystemExit(f"--profile {sorted(set(args.profile) - set(runs))}: that variant cannot run here.")
    problem = model_packing_problem(model)
    if problem is not None:
        raise SystemExit(f"This model cannot be packed: {problem}.")
    seconds = {name: [] for name in runs}
    peaks = {}
    difference = {}
    for round_index in range(args.rounds):
        if round_index == 0 or args.fresh_rows:
            prompt_lengths, completion_lengths = lengths(args, generator)
            rows = padded_rows(args, prompt_lengths, completion_lengths, generator)
            batches.append((prompt_lengths, completion_lengths))
        mask = rows[3].bool()
        timings = []
        reference = None
        for name, run in runs.items():
            elapsed, logps, peak = timed(run, model, rows, args.device == "cuda")
            timings.append(f"{name} {1000 * elapsed:.1f} ms")
            if round_index > 0 or args.rounds == 1:
                seconds[name].append(elapsed)
            if peak is not None:  # the largest over the rounds' batches
                peaks[name] = max(peak, peaks.get(name, 0.0))
            if round_index == 0 or args.fresh_rows:  # the same log-probs as the padded pass, up to rounding
                reference = logps if name == "padded" else reference
                if reference is not None:
                    gap = float((logps[mask] - reference[mask]).abs().max())
                    difference[name] = max(gap, difference.get(name, 0.0))
        print(f"round {round_index + 1}{' (warm-up)' if round_index == 0 else ''}: {', '.join(timings)}", flush=True)
    for name in args.profile:
        profile(runs[name], model, rows, name, args.device == "cuda")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    results = []
    for name, median in medians.items():
        result = {"variant": name, "median_ms": round(1000 * median, 2)}
        if "padded" in medians:
            result["ratio_to_padded"] = round(median / medians["padded"], 3)
        if "trl" in medians:
            result["ratio_to_trl"] = round(median / medians["trl"], 3)
        if name in difference:
            result["max_abs_logp_difference_to_padded"] = difference[name]
        if name in peaks:
            result["peak_memory_mib"] = round(peaks[name], 1)
        results.append(result)
    setting = {key: value for key, value in vars(args).items() if key not in ("output", "variants")}
    tokens = [token_counts(*batch) for batch in batches]
    setting["tokens"] = tokens if args.fresh_rows else tokens[0]
    setting["environment"] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "trl": _version("trl"),
    }
    report = {"setting": setting, "results": results}
    print(json.dumps(results, indent=2))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(report, handle, indent=2)


def token_counts(prompt_lengths: list[int], completion_lengths: list[int]) -> dict:
    """A batch's tokens read and padded, and its lengths."""
    read = sum(prompt_lengths) + sum(completion_lengths)
    padded = len(prompt_lengths) * (max(prompt_lengths) + max(completion_lengths))
    return {
        "read": read,
        "padded": padded,
        "padding_fraction": round(1 - read / padded, 3),
        "completion_lengths": completion_lengths,
        "prompt_lengths": prompt_lengths,
    }


def profile(run, model, rows, name: str, on_gpu: bool) -> None:
    """One pass of ``run`` under torch's profiler: its costliest operations by their own time on the device."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profiler(activities=activities) as recorded:
        timed(run, model, rows, on_gpu)
    sort_by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    print(f"profile of one {name} pass:\n{recorded.key_averages().table(sort_by=sort_by, row_limit=15)}", flush=True)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
