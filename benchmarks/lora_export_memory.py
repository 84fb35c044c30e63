"""Peak memory of one LoRA weight export into a vLLM engine: the former export (every merged weight built before the
engine loads any) vs the streamed one (merge one layer, hand it over, free it, next layer).

What the trainer does before each rollout in colocate mode (and, through the weight transfer, in server mode): export
the policy's weights with the adapters merged in, under checkpoint names, and load them into the engine. The engine
here is a stand-in that holds its own copy of every weight (allocated before the measurement) and copies each
exported tensor into it as it arrives, as vLLM's reload does; the former trainer handed the engine a list, the
current one the export's iterator. The model is a Qwen2 built from a config (bf16 by default, a few hundred MB) with
LoRA adapters on every linear layer of its decoder (PEFT keeps their weights in float32, as it does by default).

Each variant runs in a fresh process, once the model and the engine are built. The peak is counted two ways: the
most bytes torch's allocator held at once above what it held at the start (from the memory events of torch's
profiler: exact and repeatable), and the process's peak resident memory above its resident memory at the start
(VmHWM, reset through /proc/self/clear_refs: every byte, the C library's own keeping included, but it varies by tens
of MB from run to run). The former code runs from a temporary `git worktree` of its commit, first on PYTHONPATH.
Linux only.

    python benchmarks/lora_export_memory.py --output docs/benchmarks/lora_export_memory.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import REPOSITORY, environment, old_checkout, report

OLD_COMMIT = "595b3c6"  # the last commit whose export built every merged weight first
VARIANTS = ("former", "streamed")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden_size", type=int, default=1024)
    parser.add_argument("--intermediate_size", type=int, default=2816)
    parser.add_argument("--num_layers", type=int, default=8)
    parser.add_argument("--num_heads", type=int, default=16)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="The model's weights.")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank.")
    parser.add_argument("--variant", choices=VARIANTS, help="Measure one variant in this process (internal).")
    parser.add_argument("--output", default=None)
    return parser.parse_args()


def memory_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(args: argparse.Namespace) -> dict:
    """Build the model and the engine's copy, then export + load once; the peak memory above the start."""
    import torch
    from peft import LoraConfig, get_peft_model
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from targetpo.generation.vllm_backend import export_for_engine  # this checkout's, or the former one's

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_heads,
        max_position_embeddings=256, tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).to(getattr(torch, args.dtype))
    engine = {name: tensor.detach().clone() for name, tensor in model.named_parameters(remove_duplicate=False)}
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    policy = get_peft_model(model, LoraConfig(r=args.rank, target_modules=targets, init_lora_weights=False))
    adapted_bytes = sum(
        module.get_base_layer().weight.nbytes for name, module in policy.named_modules() if hasattr(module, "lora_A")
    )
    model_bytes = sum(tensor.nbytes for tensor in engine.values() if tensor is not engine.get("lm_head.weight"))
    gc.collect()

    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak resident memory starts again from the current
    start_kib = memory_kib("VmRSS")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        for name, tensor in export_for_engine(policy):  # a list (former) or a generator (streamed)
            engine[name].copy_(tensor)
        del tensor
    peak_kib = memory_kib("VmHWM")
    allocations = sorted(
        (event.start_ns(), event.nbytes()) for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    held = peak_bytes = 0
    for _, change in allocations:  # positive: allocated, negative: freed
        held += change
        peak_bytes = max(peak_bytes, held)

    base = policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(engine["model.layers.0.self_attn.q_proj.weight"], base), "the adapters were not merged in"
    return {
        "variant": args.variant,
        "model_bytes": model_bytes,
        "adapted_bytes": adapted_bytes,
        "peak_extra_bytes": peak_bytes,
        "peak_extra_resident_bytes": (peak_kib - start_kib) * 1024,
    }


def run_variant(variant: str, checkout: Path, argv: list[str]) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        [str(checkout), str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(Path(__file__).resolve()), *argv, "--variant", variant]
    finished = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{finished.stderr[-4000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.variant is not None:
        print(json.dumps(measure(args)))
        return
    settings = {key: value for key, value in vars(args).items() if key not in ("variant", "output")}
    argv = [f"--{key}={value}" for key, value in settings.items()]
    with tempfile.TemporaryDirectory(prefix="targetpo-former-") as work:
        with old_checkout(Path(work) / "former", OLD_COMMIT) as former:
            results = {variant: run_variant(variant, former if variant == "former" else REPOSITORY, argv)
                       for variant in VARIANTS}
    former, streamed = results["former"], results["streamed"]
    mib = 2**20
    print(f"model {former['model_bytes'] / mib:.0f} MiB, adapted weights {former['adapted_bytes'] / mib:.0f} MiB")
    for variant, result in results.items():
        print(f"{variant:>9}: peak extra {result['peak_extra_bytes'] / mib:7.1f} MiB allocated by torch "
              f"({result['peak_extra_bytes'] / result['adapted_bytes']:.2f}x the adapted weights), "
              f"{result['peak_extra_resident_bytes'] / mib:7.1f} MiB resident")
    for counted in ("peak_extra_bytes", "peak_extra_resident_bytes"):
        print(f"former / streamed, {counted}: {former[counted] / streamed[counted]:.1f}x")
    report(environment(old_commit=OLD_COMMIT, **settings), results, args.output)


if __name__ == "__main__":
    main()
