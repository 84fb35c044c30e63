"""Liger's fused kernel for the training log-probs, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1), or
by the real Triton kernels on a CUDA GPU when TRITON_INTERPRET is not set.

1. ``completion_logps(liger=True)`` against the full-logits path: values, entropies and gradients, float32 and
   bfloat16, with padding positions.
2. A few TargetPOTrainer steps with ``use_liger_kernel=True``: the model is patched with Liger's kernels by the
   Trainer and the log-probs go through the fused kernel.
Prints one JSON line of results for tests/test_liger.py to check (on a GPU: ``python tests/scripts/liger_logps.py``).
"""

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
assert INTERPRETED or torch.cuda.is_available(), "run with TRITON_INTERPRET=1 set before Python starts, or on a GPU"
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")

from datasets import Dataset  # noqa: E402
from liger_kernel.transformers import functional as liger_functional  # noqa: E402

from targetpo import TargetPOConfig, TargetPOTrainer  # noqa: E402
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the helpers the in-process tests use
from logps_cases import logps_entropies_and_gradients, padded_batch  # noqa: E402

calls = []
original_kernel = liger_functional.liger_fused_linear_cross_entropy


def counting_kernel(*args, **kwargs):
    calls.append(args[0].shape[0])
    return original_kernel(*args, **kwargs)


liger_functional.liger_fused_linear_cross_entropy = counting_kernel


def compare(dtype):
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=64, seed=0)
    model = model.to(DEVICE, dtype)
    batch = tuple(part.to(DEVICE) for part in padded_batch(torch.Generator().manual_seed(0)))
    mask = batch[3].bool()
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) * mask
    options = dict(temperature=0.7, with_entropy=True)
    full, full_entropy, full_grads = logps_entropies_and_gradients(model, batch, weights, **options)
    liger, liger_entropy, liger_grads = logps_entropies_and_gradients(
        model, batch, weights, chunk_size=3, liger=True, **options
    )
    return {
        "logps_max_diff": (liger[mask] - full[mask]).abs().max().item(),
        "entropy_max_diff": (liger_entropy[mask] - full_entropy[mask]).abs().max().item(),
        "grad_max_diff": (liger_grads - full_grads).abs().max().item(),
        "grad_scale": full_grads.abs().max().item(),
        "padding_zero": bool(torch.all(liger[~mask] == 0)),
        "dtype": str(liger.dtype),
    }


def train():
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=64, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    dataset = Dataset.from_dict({"prompt": ["Say cat:", "Say dog:"]})
    args = TargetPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_generations=4, max_completion_length=4,
        max_steps=2, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        use_liger_kernel=True, skip_zero_gradient_completions=False, seed=0,
        # Liger's RMSNorm and SwiGLU kernels pass Python floats where the interpreter needs tensors: GPU only.
        liger_kernel_config={"rms_norm": False, "swiglu": False} if INTERPRETED else None,
    )
    reward = lambda completions, **kwargs: [float(c.count("a")) + 0.1 * len(c) for c in completions]  # noqa: E731
    trainer = TargetPOTrainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    history = trainer.state.log_history
    return {
        "device": str(next(trainer.model.parameters()).device),
        "liger_logps": trainer._step.logps.liger,
        "kernel_calls": len(calls),
        "losses": [entry["loss"] for entry in history if "loss" in entry],
        "entropy_logged": any("entropy" in entry for entry in history),
        "weights_changed": any(not torch.equal(a, b.cpu()) for a, b in zip(before, trainer.model.parameters())),
    }


if __name__ == "__main__":
    out = {"float32": compare(torch.float32), "bfloat16": compare(torch.bfloat16)}
    calls.clear()
    out["train"] = train()
    print(json.dumps(out))
    sys.stdout.flush()
