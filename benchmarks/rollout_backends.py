"""Rollout throughput without vLLM: transformers' continuous batching (targetpo's backend) vs padded `model.generate`
(targetpo's default backend) vs TRL's continuous-batching call, side by side in one run, on the CPU or a GPU.

Completions end at EOS at lengths spread between `--min_tokens` and `--max_new_tokens`, fixed for every backend: a
logits processor forces each next token from the last one (a counter that ends in EOS), and each prompt's last token
sets where its counter starts, drawn from a seeded RNG. The model still runs every forward pass; only the choice of
token is forced. Padded `generate` keeps every row's positions running until the longest row ends; the engine gives a
finished row's slot to no one but stops computing it. Generated tokens (up to and including EOS) per second, the
median of `--repeats` runs after a warm-up, and the ratios are reported.

    python benchmarks/rollout_backends.py --output docs/benchmarks/rollout_backends.json

On a GPU, a Qwen2-shaped model of Qwen2.5-0.5B's width and vocabulary in bfloat16, 32 prompts x K = 8, completions of
16 to 1,024 tokens:

    python benchmarks/rollout_backends.py --device cuda --dtype bfloat16 --model qwen2 --prompts 32 \
        --prompt_tokens 64 --max_new_tokens 1024 --repeats 1 --output docs/benchmarks/rollout_backends_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from machine import MODEL_SIZES, environment, report  # noqa: E402
from step_time import add_qwen2_shape_arguments  # noqa: E402
from transformers import GenerationConfig, LogitsProcessor, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.generation import ContinuousBatchingConfig  # noqa: E402

from targetpo.generation import SamplingSettings, TransformersBackend  # noqa: E402
from targetpo.generation.continuous_batching import ContinuousBatchingBackend  # noqa: E402

PAD, EOS, FIRST_COUNTER = 0, 1, 2  # token ids; the counter's tokens follow FIRST_COUNTER


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", choices=[*MODEL_SIZES, "qwen2"],
                        help="qwen2: the shape --hidden_size ... --vocab_size give (by default Qwen2.5-0.5B's width "
                        "and vocabulary at half its depth); the others: the benchmarks' small models.")
    add_qwen2_shape_arguments(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--prompt_tokens", type=int, default=32)
    parser.add_argument("--min_tokens", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="Also write the results as JSON here.")
    return parser.parse_args()


class CountToEOS(LogitsProcessor):
    """Forces the token after counter token k to be k + 1, and EOS after the last one: a row's length is set by where
    its prompt leaves the counter. Reads only each row's last token, so the engine applies it as `generate` does."""

    supports_continuous_batching = True

    def __init__(self, last_counter: int):
        self.last_counter = last_counter

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        last = input_ids if input_ids.dim() == 1 else input_ids[:, -1]
        following = torch.where(last >= self.last_counter, EOS, last + 1)
        forced = torch.full_like(scores, -float("inf"))
        return forced.scatter(1, following.unsqueeze(1).to(scores.device), 0.0)


def with_processor(model: torch.nn.Module, processor: LogitsProcessor) -> None:
    """Every generation path of ``model`` (generate, the engine) builds its processors here: ``processor`` joins."""
    build = model._get_logits_processor

    def extended(*args, **kwargs):
        processors = build(*args, **kwargs)
        processors.append(processor)
        return processors

    model._get_logits_processor = extended


def model_config(args: argparse.Namespace, last_counter: int) -> Qwen2Config:
    """A Qwen2 model whose vocabulary holds the counter: the qwen2 shape's (a real model's size), else just the
    counter's tokens."""
    positions = args.prompt_tokens + args.max_new_tokens
    special = dict(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, tie_word_embeddings=True)
    if args.model == "qwen2":
        if args.vocab_size <= last_counter:
            raise ValueError(f"--vocab_size {args.vocab_size} cannot hold the counter: it must exceed {last_counter}.")
        return Qwen2Config(
            vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
            num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
            num_key_value_heads=args.num_kv_heads, max_position_embeddings=positions, **special,
        )
    hidden, layers, heads = MODEL_SIZES[args.model]
    return Qwen2Config(
        vocab_size=last_counter + 1, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max(1024, positions), **special,
    )


def rollout_prompts(args: argparse.Namespace, last_counter: int) -> tuple[list[list[int]], list[int]]:
    """Each completion's prompt (random tokens, then the counter's start) and the length it will have."""
    rng = random.Random(args.seed)
    prompts, lengths = [], []
    for _ in range(args.prompts):
        body = [rng.randrange(FIRST_COUNTER, last_counter + 1) for _ in range(args.prompt_tokens - 1)]
        for _ in range(args.num_generations):
            length = rng.randint(args.min_tokens, args.max_new_tokens)  # counter tokens then EOS: `length` tokens
            prompts.append(body + [last_counter - length + 1])
            lengths.append(length)
    return prompts, lengths


def left_padded(prompts: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= width - torch.tensor([[len(p)] for p in prompts])).long()
    return ids.to(device), mask.to(device)


def trl_style(model: torch.nn.Module, settings: SamplingSettings):
    """`generate_batch` as TRL's GRPOTrainer calls it (its GenerationConfig, max_memory_percent=0.5, no log-probs)."""
    generation_config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens, do_sample=True, pad_token_id=PAD, eos_token_id=[EOS],
        temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, disable_compile=True,
    )

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outputs = model.generate_batch(
            prompts, generation_config=generation_config,
            continuous_batching_config=ContinuousBatchingConfig(max_memory_percent=0.5), progress_bar=False,
        )
        return [output.generated_tokens for output in outputs.values()]

    return generate


def timed(generate, repeats: int) -> tuple[float, int]:
    """Median generated tokens per second over ``repeats`` runs after a warm-up, and the tokens of one run."""
    generate()
    rates, tokens = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = generate()
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates), tokens


def main() -> None:
    args = parse_args()
    last_counter = FIRST_COUNTER + args.max_new_tokens
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(model_config(args, last_counter)).eval().to(args.device, getattr(torch, args.dtype))
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens, eos_token_ids=(EOS,), pad_token_id=PAD)
    opened = lambda: contextlib.nullcontext(model)  # noqa: E731
    engine, padded = ContinuousBatchingBackend(settings, opened, model), TransformersBackend(settings, opened)
    with_processor(model, CountToEOS(last_counter))  # after the engine's check, which refuses processors it does not know
    prompts, lengths = rollout_prompts(args, last_counter)
    prompt_ids, prompt_mask = left_padded(prompts, args.device)
    trl = trl_style(model, settings)
    runs = {
        "continuous_batching": lambda: int(engine.generate(prompt_ids, prompt_mask).attention_mask.sum()),
        "generate": lambda: int(padded.generate(prompt_ids, prompt_mask).attention_mask.sum()),
        "trl_generate_batch": lambda: sum(map(len, trl(prompts))),
    }
    rates = {}
    for name, run in runs.items():
        rate, tokens = timed(run, args.repeats)
        assert tokens == sum(lengths), f"{name} generated {tokens} tokens, the counter sets {sum(lengths)}"
        rates[name] = rate
    result = {
        "model": args.model,
        "parameters": sum(p.numel() for p in model.parameters()),
        "completions": len(prompts),
        "lengths": [args.min_tokens, args.max_new_tokens],
        "generated_tokens": sum(lengths),
        **{f"{name}_tokens_per_s": round(rate) for name, rate in rates.items()},
        "continuous_batching_over_generate": round(rates["continuous_batching"] / rates["generate"], 2),
        "continuous_batching_over_trl": round(rates["continuous_batching"] / rates["trl_generate_batch"], 2),
    }
    print(json.dumps(result), flush=True)
    on_gpu = {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda} if args.device == "cuda" else {}
    report(environment(cpu_threads=torch.get_num_threads(), dtype=args.dtype, **on_gpu), [result], args.output)


if __name__ == "__main__":
    main()
