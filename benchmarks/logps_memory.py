"""Peak memory of the training step's log-prob computation: targetpo (chunked and full-logits paths), TRL's
GRPOTrainer and the naive full-logits computation, on the same model and batch.

Each variant runs forward + backward of the completion tokens' log-probs (and their entropies, as both trainers
compute them) in a fresh process; the peak resident memory above what the process held after building the model
and the batch is reported, with each variant's ratio to TRL's. Measured on the CPU (ru_maxrss), so it counts every
byte the computation allocates. TRL is a benchmark-only dependency: `pip install trl` (without it that row is skipped).

    python benchmarks/logps_memory.py --output docs/benchmarks/logps_memory.json

With ``--device cuda`` the model and batch live on the GPU and the peak is the GPU memory allocated above what was
allocated before the computation (``torch.cuda.max_memory_allocated``); each variant is then also timed (median of
``--repeats`` forward + backward passes after the measured one), and, with Liger Kernel installed, targetpo's
``use_liger_kernel`` path (Liger's fused linear cross-entropy) is one more variant:

    python benchmarks/logps_memory.py --device cuda --dtype bfloat16 --vocab_size 151936 --hidden_size 896 \
        --num_layers 12 --num_heads 14 --num_kv_heads 2 --intermediate_size 4864 --completion_length 1024 \
        --output docs/benchmarks/logps_memory_h100.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import resource
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = ("naive", "targetpo_full_logits", "targetpo_chunked", "targetpo_liger", "trl")
#: Settings added for GPUs: saved with the results only where they differ from these defaults.
GPU_DEFAULTS = {"device": "cpu", "dtype": "float32", "num_heads": 4, "num_kv_heads": 4, "intermediate_size": None,
                "repeats": 3}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab_size", type=int, default=32768)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--completion_length", type=int, default=512)
    parser.add_argument("--chunk_size", type=int, default=512, help="targetpo's logps_chunk_size")
    parser.add_argument("--num_heads", type=int, default=GPU_DEFAULTS["num_heads"])
    parser.add_argument("--num_kv_heads", type=int, default=GPU_DEFAULTS["num_kv_heads"])
    parser.add_argument("--intermediate_size", type=int, default=None, help="Default: 4 x hidden_size.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=GPU_DEFAULTS["device"])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=GPU_DEFAULTS["dtype"], help="The model's weights.")
    parser.add_argument("--repeats", type=int, default=GPU_DEFAULTS["repeats"], help="Timed passes per variant (GPU).")
    parser.add_argument("--variant", choices=VARIANTS, help="Measure one variant in this process (internal).")
    parser.add_argument("--output", default=None)
    return parser.parse_args()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def current_rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def measure(args: argparse.Namespace) -> dict:
    """Build the model and batch, then run one variant's forward + backward; return its memory above the baseline."""
    import gc

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size or 4 * args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    on_gpu = args.device == "cuda"
    if on_gpu or args.dtype != "float32":
        model = model.to(args.device, getattr(torch, args.dtype))
    prompt_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.prompt_length)).to(args.device)
    completion_ids = torch.randint(0, args.vocab_size, (args.batch_size, args.completion_length)).to(args.device)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)

    if args.variant == "naive":

        def run():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
            log_probs = torch.log_softmax(logits[:, args.prompt_length - 1 : -1], dim=-1)
            logps = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
            with torch.no_grad():
                entropy = -(log_probs.exp() * log_probs).sum(-1)
            return logps, entropy

    elif args.variant.startswith("targetpo"):
        from targetpo.modeling.logps import completion_logps

        chunk_size = None if args.variant == "targetpo_full_logits" else args.chunk_size
        liger = args.variant == "targetpo_liger"  # the log-probs through Liger's kernel, the entropies chunked

        def run():
            return completion_logps(
                model, prompt_ids, prompt_mask, completion_ids, completion_mask, with_entropy=True, chunk_size=chunk_size,
                liger=liger,
            )

    else:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=GRPOConfig(
                output_dir="/tmp/trl_memory_benchmark", per_device_train_batch_size=args.batch_size,
                num_generations=args.batch_size, max_completion_length=args.completion_length, report_to="none",
                use_cpu=not on_gpu,
                # TRL's default is bf16 autocast; every variant here runs in the model's dtype (float32 on the CPU)
                bf16=args.dtype == "bfloat16",
                gradient_checkpointing=False,
            ),
            train_dataset=Dataset.from_dict({"prompt": ["x"] * 16}),
            processing_class=_any_tokenizer(args.vocab_size),
        )
        model = trainer.model

        def run():
            logps, entropy, *_ = trainer._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, args.completion_length, compute_entropy=True
            )
            return logps, entropy

    gc.collect()
    if on_gpu:
        return measure_gpu(args, run)
    baseline = current_rss_mb()  # what the process holds now (its earlier peak may have been higher)
    logps, _ = run()
    logps.sum().backward()
    return {"variant": args.variant, "peak_above_baseline_mb": round(peak_rss_mb() - baseline, 1)}


def measure_gpu(args: argparse.Namespace, run) -> dict:
    """The peak GPU memory allocated above what was allocated before one forward + backward, then the median time
    of ``args.repeats`` more."""
    import statistics
    import time

    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logps, _ = run()
    logps.sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    del logps
    seconds = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logps, _ = run()
        logps.sum().backward()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        del logps
    return {
        "variant": args.variant, "peak_above_baseline_mb": round(peak / 2**20, 1),
        "median_ms": round(1000 * statistics.median(seconds), 1),
    }


def _any_tokenizer(vocab_size: int):
    """A word-level tokenizer with the benchmark's vocabulary size (TRL's trainer needs one to exist)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t1", pad_token="t2")


def _version(module: str) -> str | None:
    try:
        return importlib.metadata.version(module.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    args = parse_args()
    if args.variant:
        print(json.dumps(measure(args)))
        return
    shared = [arg for arg in sys.argv[1:] if not arg.startswith("--output")]
    if "--output" in sys.argv:
        index = sys.argv.index("--output")
        shared = sys.argv[1:index] + sys.argv[index + 2 :]
    results = []
    for variant in VARIANTS:
        if variant == "targetpo_liger" and (args.device != "cuda" or importlib.util.find_spec("liger_kernel") is None):
            continue  # Liger's kernels need a GPU
        if variant == "trl":
            try:
                import trl  # noqa: F401
            except ImportError:
                print("trl is not installed: skipping its row (pip install trl)")
                continue
        command = [sys.executable, __file__, *shared, "--variant", variant]
        result = subprocess.run(command, check=False, capture_output=True, text=True)
        if result.returncode != 0:  # reported, and the other variants still run
            print(result.stdout[-2000:] + result.stderr[-4000:], flush=True)
            results.append({"variant": variant, "error": (result.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        results.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    reference = next((r.get("peak_above_baseline_mb") for r in results if r["variant"] == "trl"), None)
    for result in results:
        if reference and "peak_above_baseline_mb" in result:
            result["ratio_to_trl"] = round(result["peak_above_baseline_mb"] / reference, 2)
    setting = {
        k: v for k, v in vars(args).items()
        if k not in ("variant", "output") and (k not in GPU_DEFAULTS or GPU_DEFAULTS[k] != v)
    }
    if args.device == "cuda":
        import torch
        import transformers

        setting["environment"] = {
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": _version("trl"), "liger_kernel": _version("liger_kernel"),
        }
    print(json.dumps({"setting": setting, "results": results}, indent=2))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump({"setting": setting, "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
