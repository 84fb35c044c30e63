"""The output head's token log-probs, forward and backward: targetpo's torch head, its Triton head
(``logps_head_kernel="triton"``) and TRL's head, on the hidden states of a batch of completion positions.

Each head computes, from ``(N, hidden)`` final hidden states and the ``(V, hidden)`` output head, the log-prob of each
position's token and its entropy (a metric, without gradient) at a sampling temperature, and back-propagates a
weighted sum of the log-probs to the hidden states and the head's weight:

* ``torch``: targetpo's chunked head (``logps_chunk_size`` positions at a time), float32 logits and a written-out
  backward pass (``_LinearHeadLogps``); its matrix products run in the head's dtype (autocast's under autocast).
* ``triton``: the same chunks through ``targetpo/modeling/triton_head.py``: the logits in the head's dtype (autocast's
  under autocast), read by fused kernels with float32 arithmetic, in forward and backward.
* ``trl``: the full ``(N, V)`` logits by ``nn.Linear``, divided by the temperature, then TRL's
  ``selective_log_softmax`` and ``entropy_from_logits`` (``trl.trainer.utils``), as its GRPO trainer called them
  before 1.16. TRL is a benchmark-only dependency: without it (``pip install trl``) this row is skipped.
* ``trl_fused``: TRL 1.16's own chunked head, ``trl.kernels.ChunkedLogProbFunction`` (cuBLAS tiles folded by a
  Triton kernel; torch operations without a GPU), at the vocabulary chunk its GRPO trainer uses: what TRL 1.16's
  trainer computes its log-probs and entropies with (``add_fused_lm_head``). Skipped where TRL lacks it.

Two settings: ``bf16`` (weights and hidden states in bf16, as a model loaded in bf16) and
``fp32_master_bf16_autocast`` (float32 weights and hidden states under ``torch.autocast(bfloat16)``, as
``bf16=True`` with float32 master weights, where every head's matrix products run in bf16). For each: the median time of forward +
backward, the peak memory above what was allocated before (CUDA), their ratios to TRL's, and how far each head's
log-probs, entropies and gradients are from the torch head's.

On one GPU (a 151,936-token vocabulary, hidden size 896: Qwen2.5-0.5B's head; 8,192 positions):

    python benchmarks/head_kernel.py --device cuda --output docs/benchmarks/head_kernel_h200.json

A smoke test of the script on the CPU, the Triton head in Triton's interpreter (tiny sizes; no timings to keep):

    TRITON_INTERPRET=1 python benchmarks/head_kernel.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from machine import environment, report
from torch import nn

from targetpo.modeling import logps as kernels

HEADS = ("torch", "triton", "trl", "trl_fused")
SETTINGS = ("bf16", "fp32_master_bf16_autocast")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab_size", type=int, default=151936)
    parser.add_argument("--hidden_size", type=int, default=896)
    parser.add_argument("--positions", type=int, default=8192, help="completion positions in the batch (N)")
    parser.add_argument("--chunk_size", type=int, default=512, help="targetpo's logps_chunk_size")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--heads", nargs="+", choices=HEADS, default=list(HEADS))
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks that the script runs")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    if args.smoke:
        args.device, args.vocab_size, args.hidden_size, args.positions, args.chunk_size = "cpu", 300, 32, 64, 16
        args.repeats = 1
    return args


def trl_head_or_problem():
    """TRL's two functions, or why they cannot be had."""
    try:
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax
    except ImportError as error:
        return f"TRL is not installed or lacks the functions ({error}): pip install trl"
    return selective_log_softmax, entropy_from_logits


def trl_fused_problem() -> str | None:
    """Why TRL's own chunked head cannot be had, or None."""
    try:
        from trl.kernels import ChunkedLogProbFunction  # noqa: F401
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE  # noqa: F401
    except ImportError as error:
        return f"this TRL has no chunked head ({error}): pip install 'trl>=1.16'"
    return None


def triton_problem(device: torch.device) -> str | None:
    """Why the Triton head cannot run here, or None."""
    try:
        from targetpo.modeling.triton_head import device_problem
    except ImportError as error:
        return f"Triton is not installed ({error})"
    return device_problem(device)


def head_step(head_name, head, hidden, token_ids, upstream, args, autocast, trl_functions):
    """One forward + backward of a head; its log-probs, entropies and the two gradients, in float32."""
    head.zero_grad(set_to_none=True)
    hidden.grad = None
    context = torch.autocast(hidden.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        if head_name == "trl_fused":
            from trl.kernels import ChunkedLogProbFunction
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

            logps, entropies = ChunkedLogProbFunction.apply(
                hidden, head.weight, None, token_ids, args.temperature, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                ("entropy",),
            )[:2]
            entropies = entropies.detach()
        elif head_name == "trl":
            selective_log_softmax, entropy_from_logits = trl_functions
            logits = head(hidden) / args.temperature
            logps = selective_log_softmax(logits, token_ids)
            with torch.no_grad():
                entropies = entropy_from_logits(logits)
        else:
            logps, entropies = kernels._head_in_chunks(
                head, hidden, token_ids, args.temperature, None, args.chunk_size, True, False, head_kernel=head_name
            )
    (logps.float() * upstream).sum().backward()
    return logps.detach().float(), entropies.float(), hidden.grad.float(), head.weight.grad.float()


def timed(step, repeats: int, device: torch.device) -> dict:
    """Median milliseconds of ``step()`` over ``repeats`` runs, and on CUDA the peak memory above the start's."""

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    synchronize()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        synchronize()
        started = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - started)
    measured = {"median_ms": round(1000 * statistics.median(times), 2)}
    if device.type == "cuda":
        measured["peak_above_baseline_mb"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
    return measured


def differences(outputs, reference) -> dict:
    """How far a head's log-probs, entropies and gradients are from the reference head's."""
    logps, entropies, grad_hidden, grad_weight = outputs
    return {
        "logps_max_abs_diff_vs_torch": (logps - reference[0]).abs().max().item(),
        "entropy_max_abs_diff_vs_torch": (entropies - reference[1]).abs().max().item(),
        "grad_hidden_rel_l2_vs_torch": ((grad_hidden - reference[2]).norm() / reference[2].norm()).item(),
        "grad_weight_rel_l2_vs_torch": ((grad_weight - reference[3]).norm() / reference[3].norm()).item(),
    }


def measure_setting(setting, heads, args, device, trl_functions) -> list[dict]:
    """Every head in one setting: time, peak memory, differences from the torch head, ratios to TRL's."""
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if setting == "bf16" else torch.float32
    head = nn.Linear(args.hidden_size, args.vocab_size, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        weight = torch.randn(args.vocab_size, args.hidden_size, device=device, generator=generator)
        head.weight.copy_(weight / args.hidden_size**0.5)
        del weight
    hidden = 3 * torch.randn(args.positions, args.hidden_size, device=device, generator=generator)
    hidden = hidden.to(dtype).requires_grad_()
    token_ids = torch.randint(0, args.vocab_size, (args.positions,), device=device, generator=generator)
    upstream = torch.rand(args.positions, device=device, generator=generator)
    autocast = setting == "fp32_master_bf16_autocast"

    rows, outputs = [], {}
    for head_name in heads:

        def step(name=head_name):
            return head_step(name, head, hidden, token_ids, upstream, args, autocast, trl_functions)

        outputs[head_name] = step()  # also the warm-up (compilation, the allocator's pools)
        rows.append({"setting": setting, "head": head_name, **timed(step, args.repeats, device)})
    trl_row = next((row for row in rows if row["head"] == "trl"), None)
    for row in rows:
        if "torch" in outputs and row["head"] != "torch":
            row.update(differences(outputs[row["head"]], outputs["torch"]))
        if trl_row is not None:
            row["time_over_trl"] = round(row["median_ms"] / trl_row["median_ms"], 2)
            if "peak_above_baseline_mb" in row:
                row["peak_over_trl"] = round(
                    row["peak_above_baseline_mb"] / max(1, trl_row["peak_above_baseline_mb"]), 2
                )
    return rows


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    problems = {"triton": triton_problem(device), "trl": None, "trl_fused": trl_fused_problem()}
    trl_functions = trl_head_or_problem()
    if isinstance(trl_functions, str):
        problems["trl"], trl_functions = trl_functions, None
    for head_name, problem in problems.items():
        if head_name in args.heads and problem is not None:
            print(f"skipping the {head_name} head: {problem}", flush=True)
    heads = [name for name in args.heads if problems.get(name) is None]
    results = []
    for setting in args.settings:
        for row in measure_setting(setting, heads, args, device, trl_functions):
            print(row, flush=True)
            results.append(row)
    extra = {"gpu": torch.cuda.get_device_name()} if device.type == "cuda" else {}
    report(environment(**extra, settings=vars(args), skipped=problems), results, args.output)


if __name__ == "__main__":
    main()
