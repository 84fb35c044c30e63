"""targetpo's output head with its written-out backward pass against autograd through a checkpointed head.

Forward and backward of ``completion_logps`` (chunked, with entropies) on a Qwen2-shaped model with random weights:
the time and peak memory of each path, and how far their gradients are apart next to how far two runs of the same
path are apart (bf16 kernels on a GPU are not deterministic). The checkpointed path is the one adapters and quantised
heads take; here it is forced on the plain head. On one H100:

    python benchmarks/head_backward.py --device cuda --output docs/benchmarks/head_backward_h100.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch
from machine import environment, report
from transformers import Qwen2Config, Qwen2ForCausalLM

from targetpo.modeling import logps as kernels


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--vocab_size", type=int, default=151936)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--completion_length", type=int, default=1024)
    parser.add_argument("--chunk_size", type=int, default=512, help="targetpo's logps_chunk_size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=None)
    return parser.parse_args()


@contextmanager
def checkpointed_head(on: bool):
    """Make every head take the checkpointed autograd path (``on``), as a non-plain head would."""
    plain = kernels._is_plain_linear_head
    if on:
        kernels._is_plain_linear_head = lambda head: False
    try:
        yield
    finally:
        kernels._is_plain_linear_head = plain


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = Qwen2Config(vocab_size=args.vocab_size, hidden_size=896, intermediate_size=4864, num_hidden_layers=12,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).to(device, dtype)
    shape = (args.batch_size, args.completion_length)
    prompt_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.prompt_length), device=device)
    completion_ids = torch.randint(0, args.vocab_size, shape, device=device)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, args.completion_length * 2 // 3 :] = 0  # one shorter row: padding is skipped
    weights = torch.rand(shape, device=device)

    def step(checkpointed: bool, entropy_bonus: bool) -> torch.Tensor:
        with checkpointed_head(checkpointed):
            model.zero_grad(set_to_none=True)
            logps, entropies = kernels.completion_logps(
                model, prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask, temperature=0.9,
                with_entropy=True, entropy_grad=entropy_bonus, chunk_size=args.chunk_size,
            )
            ((logps * weights).sum() + ((entropies * weights).sum() if entropy_bonus else 0)).backward()
        return torch.cat([p.grad.float().flatten() for p in model.parameters()])

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    results = []
    for entropy_bonus in (False, True):
        written, written_again, checkpointed = step(False, entropy_bonus), step(False, entropy_bonus), step(True, entropy_bonus)
        row = {
            "entropy_bonus": entropy_bonus,
            "grad_rel_l2_written_vs_checkpointed": ((written - checkpointed).norm() / checkpointed.norm()).item(),
            "grad_rel_l2_run_to_run": ((written - written_again).norm() / written.norm()).item(),
        }
        for name, checkpointed_path in (("written", False), ("checkpointed", True)):
            step(checkpointed_path, entropy_bonus)
            synchronize()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            times = []
            for _ in range(args.repeats):
                synchronize()
                started = time.perf_counter()
                step(checkpointed_path, entropy_bonus)
                synchronize()
                times.append(time.perf_counter() - started)
            row[f"{name}_median_ms"] = round(1000 * statistics.median(times), 1)
            if device.type == "cuda":
                row[f"{name}_peak_above_baseline_mb"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
        row["written_over_checkpointed_time"] = round(row["written_median_ms"] / row["checkpointed_median_ms"], 2)
        print(row, flush=True)
        results.append(row)
    extra = {"gpu": torch.cuda.get_device_name()} if device.type == "cuda" else {}
    report(environment(**extra, settings=vars(args)), results, args.output)


if __name__ == "__main__":
    main()
