"""Rollouts through transformers' continuous batching (use_transformers_continuous_batching): the completions and
their sampling log-probs, weights that change in place, multi-turn tool rollouts, LoRA, the engine's cache across
rollouts, every refusal, and a short training run."""

import contextlib
import gc
import json
import math

import pytest
import torch
from conftest import make_config, snapshot
from scripted_policies import place_tokens, script_ended_or_cut
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.generation.logits_process import MinPLogitsWarper, TemperatureLogitsWarper, TopPLogitsWarper

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm
from targetpo.generation import SamplingSettings, TransformersBackend, build_rollout_backend
from targetpo.generation.continuous_batching import ContinuousBatchingBackend


def settings_for(tokenizer, **overrides):
    fields = dict(max_new_tokens=8, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id)
    return SamplingSettings(**{**fields, **overrides})


def padded_backend(model, settings):
    """Padded ``model.generate`` over ``model``: what the engine's completions are compared with."""
    return TransformersBackend(settings, lambda: contextlib.nullcontext(model))


def backends(model, settings):
    """The continuous-batching backend and the padded one, over the same policy."""
    return ContinuousBatchingBackend(settings, lambda: contextlib.nullcontext(model), model), padded_backend(
        model, settings)


def prompts(tokenizer, texts=("Say cat:", "hi:", "Say a much longer thing:", "x:")):
    encoded = tokenizer(list(texts), padding=True, padding_side="left", return_tensors="pt")
    return encoded.input_ids, encoded.attention_mask


def completion_logits(model, prompt_ids, prompt_mask, completion_ids):
    """The model's next-token logits at each completion token, from one padded forward pass."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    return logits[:, prompt_ids.size(1) - 1 : -1]


def model_logps(model, prompt_ids, prompt_mask, completion_ids, temperature):
    """Each completion token's log-prob under the model at ``temperature``, from one padded forward pass."""
    logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids) / temperature
    return logits.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def written(ids, mask):
    """Each row's tokens within its mask, as lists: completions of any padded width compare."""
    return [row[row_mask.bool()].tolist() for row, row_mask in zip(ids, mask)]


@pytest.fixture
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def model(tokenizer):
    return build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=2, num_heads=2, max_positions=128, seed=0)


# ------------------------------------------------------------------------------------------------ completions
def test_with_one_token_left_to_choose_from_the_completions_are_model_generates(tokenizer, model):
    """top_k=1 leaves each step one token: both backends must write the same tokens, masks and truncation flags, and
    the engine's log-prob of a token it could not miss is 0."""
    cb, padded = backends(model, settings_for(tokenizer, top_k=1))
    prompt_ids, prompt_mask = prompts(tokenizer)
    ours, theirs = cb.generate(prompt_ids, prompt_mask), padded.generate(prompt_ids, prompt_mask)
    assert torch.equal(ours.ids * ours.attention_mask, theirs.ids * theirs.attention_mask)
    assert torch.equal(ours.attention_mask, theirs.attention_mask) and torch.equal(ours.truncated, theirs.truncated)
    assert torch.equal(ours.sampler_logps, torch.zeros_like(ours.sampler_logps))
    assert model.training and model.config._attn_implementation == "sdpa"  # as the engine found them


def test_a_completion_ends_at_its_first_eos_and_one_without_runs_to_the_limit_truncated(tokenizer, model):
    """Scripted weights: after ':' an ending letter (then EOS) or a running one (then more of them), the model's
    own even choice; 16 rows hold both kinds whatever the stream. Every other token is suppressed."""
    script_ended_or_cut(model, tokenizer, ending="ab", running="cd")
    allowed = {tokenizer.convert_tokens_to_ids(token) for token in "abcd"} | {tokenizer.eos_token_id}
    suppressed = [token for token in range(len(tokenizer)) if token not in allowed]
    cb, _ = backends(model, settings_for(tokenizer, max_new_tokens=6, generation_kwargs={"suppress_tokens": suppressed}))
    out = cb.generate(*prompts(tokenizer, ["Say:", "Say it:", "Go:", "Now then:"] * 4))
    assert set(out.ids[out.attention_mask.bool()].tolist()) <= allowed
    ended = out.ids[:, 1] == tokenizer.eos_token_id
    assert ended.any() and (~ended).any()
    assert torch.equal(out.lengths, torch.where(ended, 2, 6)) and torch.equal(out.truncated, ~ended)
    assert not (out.ids[~ended] == tokenizer.eos_token_id).any()
    assert torch.equal(out.sampler_logps != 0, out.attention_mask.bool() & (out.sampler_logps != 0))


def test_a_completion_ends_at_its_first_stop_token_of_either_kind(tokenizer, model):
    """Two stop ids, EOS and "z", and scripted weights that fix each prompt's completion (by 24 nats a token or
    more): after "1" an "a" then EOS, after "2" a "b" then "z", after "b" a "z" at once, after "c" more "c"s up to
    the limit. Past a stop id the script writes it again, so an engine that stopped at one kind only runs on."""
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in "12abcz"}
    eos, z = tokenizer.eos_token_id, ids["z"]

    def at(degrees, radius):
        return radius * math.cos(math.radians(degrees)), radius * math.sin(math.radians(degrees))

    place_tokens(model, {ids["1"]: at(10, 0.6), ids["a"]: at(45, 4), eos: at(90, 8),
                         ids["2"]: at(-10, 0.6), ids["b"]: at(-45, 4), z: at(-90, 8), ids["c"]: at(180, 2)})
    cb, _ = backends(model, settings_for(tokenizer, max_new_tokens=6, eos_token_ids=(eos, z)))
    out = cb.generate(*prompts(tokenizer, ["Say 1", "Say 2", "Go c", "Say b"] * 2))
    assert written(out.ids, out.attention_mask) == [[ids["a"], eos], [ids["b"], z], [ids["c"]] * 6, [z]] * 2
    assert out.lengths.tolist() == [2, 2, 6, 1] * 2 and out.truncated.tolist() == [False, False, True, False] * 2
    assert (out.ids[out.attention_mask == 0] == tokenizer.pad_token_id).all()  # nothing written past a stop


def test_sampling_log_probs_are_the_models_own_at_the_sampling_temperature(tokenizer, model):
    cb, _ = backends(model, settings_for(tokenizer, temperature=0.7))
    prompt_ids, prompt_mask = prompts(tokenizer)
    out = cb.generate(prompt_ids, prompt_mask)
    expected = model_logps(model, prompt_ids, prompt_mask, out.ids, temperature=0.7) * out.attention_mask
    torch.testing.assert_close(out.sampler_logps, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cut", [dict(top_p=0.8), dict(min_p=0.1)], ids=["top_p", "min_p"])
def test_top_p_and_min_p_are_honoured_exactly(tokenizer, model, cut):
    """The engine's log-probs are those of transformers' own warpers (temperature, then the cut) over the model's
    logits, and every sampled token is one the cut kept. The final norm is scaled up: the random model's next-token
    distribution is nearly flat, and min_p=0.1 would keep every token of it."""
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
    cb, _ = backends(model, settings_for(tokenizer, temperature=0.7, **cut))
    prompt_ids, prompt_mask = prompts(tokenizer)
    out = cb.generate(prompt_ids, prompt_mask)
    logits = completion_logits(model, prompt_ids, prompt_mask, out.ids)
    warper = TopPLogitsWarper(cut["top_p"]) if "top_p" in cut else MinPLogitsWarper(cut["min_p"])
    warped = warper(None, TemperatureLogitsWarper(0.7)(None, logits.flatten(0, 1))).view_as(logits)
    within = out.attention_mask.bool()
    assert torch.isinf(warped[within]).any()  # the cut dropped tokens: its log-probs are not the tempered ones
    logps = warped.log_softmax(-1).gather(-1, out.ids.unsqueeze(-1)).squeeze(-1)
    assert torch.isfinite(logps[within]).all()  # no sampled token outside the kept set
    expected = torch.where(within, logps, 0.0)  # past a completion's end the padding may be cut (-inf)
    torch.testing.assert_close(out.sampler_logps, expected, atol=2e-5, rtol=1e-4)


def test_a_weight_change_in_place_reaches_the_next_rollout(tokenizer, model):
    cb, padded = backends(model, settings_for(tokenizer, top_k=1))
    prompt_ids, prompt_mask = prompts(tokenizer)
    before = cb.generate(prompt_ids, prompt_mask)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    after = cb.generate(prompt_ids, prompt_mask)
    assert not torch.equal(before.ids, after.ids)
    assert torch.equal(after.ids * after.attention_mask, (lambda c: c.ids * c.attention_mask)(padded.generate(
        prompt_ids, prompt_mask)))


def test_a_lora_policy_generates_with_its_adapters(tokenizer, model):
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    cb, padded = backends(adapted, settings_for(tokenizer, top_k=1))
    prompt_ids, prompt_mask = prompts(tokenizer)
    ours = cb.generate(prompt_ids, prompt_mask)
    assert torch.equal(ours.ids * ours.attention_mask, (lambda c: c.ids * c.attention_mask)(padded.generate(
        prompt_ids, prompt_mask)))
    with adapted.disable_adapter():
        without = cb.generate(prompt_ids, prompt_mask)
    assert not torch.equal(ours.ids, without.ids)


@pytest.mark.slow
def test_fifty_rollouts_leave_no_cache_behind_and_each_cache_is_the_same_size(tokenizer, model):
    cb, _ = backends(model, settings_for(tokenizer, max_new_tokens=4))
    prompt_ids, prompt_mask = prompts(tokenizer)
    for _ in range(50):
        cb.generate(prompt_ids, prompt_mask)
    gc.collect()
    assert len(set(cb.cache_sizes)) == 1 and len(cb.cache_sizes) == 50
    assert not [item for item in gc.get_objects() if isinstance(item, PagedAttentionCache)]


def test_the_cache_is_sized_to_the_calls_requests_unless_the_user_sizes_it(tokenizer, model):
    cb, _ = backends(model, settings_for(tokenizer))
    config = cb.engine_config([[1] * 10, [1] * 300], max_new_tokens=8)
    assert (config.num_blocks, config.max_batch_tokens, config.return_logprobs) == (1 + 2, 310, True)
    cb.engine_settings = {"num_blocks": 7, "page_size": 16}
    assert cb.engine_config([[1] * 10], max_new_tokens=8).num_blocks == 7


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "generation_kwargs, refused",
    [({"no_repeat_ngram_size": 2}, "NoRepeatNGramLogitsProcessor"), ({"min_new_tokens": 2}, "\\['min_new_tokens'\\] unread"),
     ({"max_time": 5.0}, "leaves generation_kwargs \\['max_time'\\] unread")],
)
def test_a_sampling_setting_the_engine_cannot_honour_is_refused_when_the_backend_is_built(
    tokenizer, model, generation_kwargs, refused
):
    with pytest.raises(ValueError, match=refused) as error:
        backends(model, settings_for(tokenizer, generation_kwargs=generation_kwargs))
    assert "use_transformers_continuous_batching=False" in str(error.value)


def test_sharded_weights_over_several_processes_are_refused(tmp_path, tokenizer, model):
    class TwoProcesses:
        num_processes = 2

    args = make_config(tmp_path, use_transformers_continuous_batching=True)
    with pytest.raises(ValueError, match="cannot generate from sharded weights"):
        build_rollout_backend(args, TwoProcesses(), model, settings_for(tokenizer), contextlib.nullcontext, True, None)
    backend = build_rollout_backend(args, TwoProcesses(), model, settings_for(tokenizer), contextlib.nullcontext,
                                    False, None)
    assert isinstance(backend, ContinuousBatchingBackend)


def test_prompts_with_images_are_refused(tokenizer, model):
    from targetpo.generation import PromptImages

    cb, _ = backends(model, settings_for(tokenizer))
    with pytest.raises(ValueError, match="cannot generate from prompts with images"):
        cb.generate(*prompts(tokenizer), images=PromptImages({}, [[]], [[]]))


def test_the_former_name_and_a_json_file_of_engine_settings_are_taken(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"page_size": 32}))
    config = TargetPOConfig(output_dir=str(tmp_path), report_to="none", use_transformers_paged=True,
                            transformers_continuous_batching_config=str(path))
    assert config.use_transformers_continuous_batching
    assert config.transformers_continuous_batching_config == {"page_size": 32}
    with pytest.raises(ValueError, match=r"keys \['num_block'\] are not ContinuousBatchingConfig fields"):
        TargetPOConfig(output_dir=str(tmp_path), report_to="none",
                       transformers_continuous_batching_config={"num_block": 8})


# ------------------------------------------------------------------------------------------ evaluation and rollout_func
def test_evaluation_generates_through_the_engine_what_model_generate_writes(tmp_path, tokenizer, model,
                                                                             prompt_dataset):
    """evaluate() samples with the engine too: one engine call per evaluation batch, and under top_k=1 each batch's
    completions are what the padded backend writes for the batch's prompts."""
    args = make_config(tmp_path, use_transformers_continuous_batching=True, top_k=1, per_device_eval_batch_size=8,
                       vllm_importance_sampling_correction=False)
    trainer = TargetPOTrainer(model, lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                              eval_dataset=prompt_dataset.select(range(4)), processing_class=tokenizer)
    batches = []
    original = trainer._rollout
    trainer._rollout = lambda rows, mode: batches.append((mode, original(rows, mode))) or batches[-1][1]
    trainer.evaluate()
    engine = trainer.rollout_backend
    assert isinstance(engine, ContinuousBatchingBackend)
    assert [mode for mode, _ in batches] == ["eval", "eval"] and len(engine.cache_sizes) == 2
    padded = padded_backend(trainer.model, trainer.sampling)
    for _, batch in batches:
        theirs = padded.generate(batch.prompt_ids, batch.prompt_mask)
        assert written(batch.completion_ids, batch.completion_attention_mask) == written(theirs.ids,
                                                                                          theirs.attention_mask)


def test_a_rollout_funcs_turns_go_through_the_engine_and_are_what_model_generate_writes(tmp_path, tokenizer, model,
                                                                                         prompt_dataset):
    """A rollout_func generating two turns with trainer.rollout_backend in one session(), each with its own
    max_new_tokens: each turn is one engine call, and under top_k=1 writes what the padded backend writes for the
    same inputs at the same weights."""
    args = make_config(tmp_path, use_transformers_continuous_batching=True, top_k=1, max_steps=1,
                       max_completion_length=8, vllm_importance_sampling_correction=False)
    reply = tokenizer("=", add_special_tokens=False)["input_ids"]
    turns = []

    def generate_turn(trainer, contexts, max_new_tokens):
        encoded = tokenizer.pad({"input_ids": contexts}, padding_side="left", return_tensors="pt")
        ours = trainer.rollout_backend.generate(encoded.input_ids, encoded.attention_mask,
                                                max_new_tokens=max_new_tokens)
        theirs = padded_backend(trainer.model, trainer.sampling).generate(encoded.input_ids, encoded.attention_mask, max_new_tokens=max_new_tokens)
        turns.append((written(ours.ids, ours.attention_mask), written(theirs.ids, theirs.attention_mask)))
        return turns[-1][0]

    def rollout_func(prompts, trainer):
        prompt_ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        with trainer.rollout_backend.session():
            first = generate_turn(trainer, prompt_ids, max_new_tokens=3)
            contexts = [ids + turn + reply for ids, turn in zip(prompt_ids, first)]
            second = generate_turn(trainer, contexts, max_new_tokens=4)
        return {"prompt_ids": prompt_ids, "completion_ids": [a + reply + b for a, b in zip(first, second)],
                "env_mask": [[1] * len(a) + [0] * len(reply) + [1] * len(b) for a, b in zip(first, second)]}

    trainer = TargetPOTrainer(model, lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                              train_dataset=prompt_dataset, processing_class=tokenizer, rollout_func=rollout_func)
    trainer.train()
    assert isinstance(trainer.rollout_backend, ContinuousBatchingBackend)
    assert len(turns) == 2 and len(trainer.rollout_backend.cache_sizes) == 2
    assert [ours for ours, _ in turns] == [theirs for _, theirs in turns]
    assert [max(map(len, ours)) for ours, _ in turns] == [3, 4]  # each turn's own max_new_tokens


# ------------------------------------------------------------------------------------------------ training
def test_a_short_run_trains_with_the_engines_completions_and_its_log_probs_match_the_trainers(
    tmp_path, tokenizer, prompt_dataset
):
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    before = snapshot(model)
    args = make_config(tmp_path, use_transformers_continuous_batching=True, max_steps=2, temperature=0.8,
                       skip_zero_gradient_completions=False,
                       transformers_continuous_batching_config={"page_size": 32})
    trainer = TargetPOTrainer(model, lambda completions, **kw: [float(len(c)) for c in completions], args=args,
                              train_dataset=prompt_dataset, processing_class=tokenizer)
    assert trainer.rollout_backend.describe() == "transformers continuous batching"
    trainer.train()
    assert snapshot(model).keys() == before.keys() and any(
        not torch.equal(before[name], param) for name, param in model.named_parameters()
    )
    differences = [entry["vllm/logp_abs_diff"] for entry in trainer.state.log_history if "vllm/logp_abs_diff" in entry]
    assert len(differences) == 2 and max(differences) < 1e-4


def test_multi_turn_tool_rollouts_go_through_the_engine_turn_by_turn(tmp_path):
    """The scripted bits environment (two rounds of calls, three turns a sample) on the engine: every sample makes
    both calls, and on every token the model wrote, over all turns, the engine's log-prob is the trainer's."""
    from vllm_workers import multi_turn_trainer

    args = TargetPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=8, max_steps=2,
                          max_prompt_length=32, learning_rate=5e-3, logging_steps=1, save_strategy="no",
                          report_to="none", disable_tqdm=True, skip_zero_gradient_completions=False,
                          use_transformers_continuous_batching=True)
    trainer = multi_turn_trainer(args)
    trainer.train()
    rollouts = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    assert len(rollouts) == 2
    assert all(entry["tools/call_frequency"] == 2 and entry["multi_turn/turns_per_sample"] == 3 for entry in rollouts)
    differences = [entry["vllm/logp_abs_diff"] for entry in trainer.state.log_history if "vllm/logp_abs_diff" in entry]
    assert len(differences) == 2 and max(differences) < 1e-4
