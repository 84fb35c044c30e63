"""Liger Kernel: the fused kernel that computes the training log-probs, and the checks around `use_liger_kernel`.

Liger's kernels are Triton GPU kernels. On a CPU, Triton's interpreter (`TRITON_INTERPRET=1`, which must be set
before triton is first imported) runs the very same kernel code, so the numerical test runs in a subprocess with it;
on a CUDA GPU the subprocess runs the real kernels.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import count_letters_reward, make_config

from targetpo import TargetPOTrainer
from targetpo.modeling.logps import liger_head_problem

ROOT = Path(__file__).resolve().parents[1]
needs_liger = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None, reason="needs Liger Kernel: pip install 'targetpo[liger]'"
)


@pytest.mark.slow
@needs_liger
def test_liger_log_probs_equal_the_full_logits_path_and_train():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run(
        [sys.executable, "tests/scripts/liger_logps.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for dtype, atol in (("float32", 1e-5), ("bfloat16", 3e-2)):
        numbers = out[dtype]
        assert numbers["dtype"] == "torch.float32" and numbers["padding_zero"]
        assert numbers["logps_max_diff"] <= atol and numbers["entropy_max_diff"] <= atol
        assert numbers["grad_max_diff"] <= atol * max(1.0, numbers["grad_scale"])
    train = out["train"]
    assert train["liger_logps"] and train["entropy_logged"] and train["weights_changed"]
    assert train["kernel_calls"] == 2  # one training forward per step, each through the kernel
    assert len(train["losses"]) == 2 and all(math.isfinite(loss) for loss in train["losses"])


@needs_liger
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU Liger's kernels run: nothing to refuse")
def test_liger_needs_a_gpu_or_the_interpreter(tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a GPU"):
        TargetPOTrainer(
            tiny_model, count_letters_reward, args=make_config(tmp_path, use_liger_kernel=True),
            train_dataset=prompt_dataset, processing_class=tokenizer,
        )


@needs_liger
def test_liger_is_not_used_where_it_cannot_stand_in_for_the_head(tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # passes the device check; no kernel runs in this test
    args = make_config(tmp_path, use_liger_kernel=True, generation_kwargs={"suppress_tokens": [5]})
    with pytest.warns(UserWarning, match="suppresses tokens"):
        trainer = TargetPOTrainer(
            tiny_model, count_letters_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
        )
    assert not trainer._step.logps.liger and trainer._step.logps.chunk_size == 512


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_liger_head_problems(tiny_model):
    from peft import LoraConfig, get_peft_model

    assert liger_head_problem(tiny_model) is None
    adapted = get_peft_model(tiny_model, LoraConfig(r=2, target_modules=["lm_head"]))
    assert "not a plain torch.nn.Linear" in liger_head_problem(adapted)
    tiny_model.config.final_logit_softcapping = 30.0
    assert "post-processes its logits" in liger_head_problem(tiny_model)
