"""Every configuration check, with its message, and command-line parsing."""

import math
import typing
import warnings

import pytest
from conftest import make_config
from transformers import HfArgumentParser

from targetpo import GRPOConfig, TargetPOConfig
from targetpo.config.fields import OneOf, Range, field_rules
from targetpo.config.preflight import resolve_config
from targetpo.generation.sampling import SamplingSettings, resolve_generation_kwargs
from targetpo.objectives.regularisers import importance_sampling_applies


def config(tmp_path, **kwargs):
    kwargs.setdefault("report_to", "none")
    return TargetPOConfig(output_dir=str(tmp_path), **kwargs)


def test_defaults_suit_rl(tmp_path):
    args = config(tmp_path)
    assert isinstance(args, GRPOConfig)
    assert args.loss_type == "tpo" and args.tpo_target_temperature == 1.0 and args.tpo_length_normalize_logps
    assert args.remove_unused_columns is False
    assert args.steps_per_generation == 1
    assert args.generation_batch_size == args.per_device_train_batch_size == 8
    assert args.num_generations == 8 and args.num_iterations == 1 and args.beta == 0.0
    assert args.learning_rate == 1e-6
    assert GRPOConfig(output_dir=str(tmp_path), report_to="none").loss_type == "dapo"  # as TRL


def test_generation_batch_size_and_steps_per_generation_derive_each_other(tmp_path):
    args = config(tmp_path, per_device_train_batch_size=8, num_generations=4, steps_per_generation=3)
    assert args.generation_batch_size == 24
    args = config(tmp_path, per_device_train_batch_size=8, num_generations=4, generation_batch_size=32)
    assert args.steps_per_generation == 4


@pytest.mark.parametrize(
    "settings, steps_per_generation, generation_batch_size",
    [
        # Neither set: one rollout per optimiser step, gradient_accumulation_steps micro-steps of it.
        (dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, num_generations=8), 4, 8),
        (dict(per_device_train_batch_size=8, num_generations=8), 1, 8),
        (dict(per_device_train_batch_size=4, gradient_accumulation_steps=3, num_generations=4, num_iterations=2), 3, 12),
        # One of them set: the other follows from it, whatever gradient_accumulation_steps is.
        (dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, num_generations=8, steps_per_generation=8),
         8, 16),
        (dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, num_generations=8, generation_batch_size=16),
         8, 16),
        (dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4, steps_per_generation=1),
         1, 8),
    ],
)
@pytest.mark.parametrize("config_class", [TargetPOConfig, GRPOConfig])
def test_steps_per_generation_defaults_to_gradient_accumulation_steps(
    tmp_path, config_class, settings, steps_per_generation, generation_batch_size
):
    args = config_class(output_dir=str(tmp_path), report_to="none", **settings)
    assert (args.steps_per_generation, args.generation_batch_size) == (steps_per_generation, generation_batch_size)


def test_the_default_layout_counts_every_process_and_refuses_only_partial_groups(tmp_path, monkeypatch):
    monkeypatch.setattr(TargetPOConfig, "world_size", property(lambda self: 2))
    # 2 rows x 2 processes x 2 micro-steps: one group of 8 per optimiser step, over both processes.
    args = config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=8)
    assert (args.steps_per_generation, args.generation_batch_size) == (2, 8)
    # 2 x 2 x 3 = 12 completions cannot be whole groups of 8.
    with pytest.raises(ValueError, match="Each rollout must hold whole prompt groups: generation_batch_size = 12"):
        config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=3, num_generations=8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_generations=1, per_device_train_batch_size=8), "num_generations must be at least 2"),
        (dict(tpo_target_temperature=0.0), "tpo_target_temperature \\(eta\\) must be > 0"),
        (dict(tpo_target_temperature=-1.0), "tpo_target_temperature \\(eta\\) must be > 0"),
        (dict(per_device_train_batch_size=6, num_generations=4), "whole prompt groups"),
        (dict(generation_batch_size=32, steps_per_generation=2), "either generation_batch_size or steps_per_generation"),
        (dict(steps_per_generation=0), "steps_per_generation must be >= 1"),
        (dict(generation_batch_size=12, per_device_train_batch_size=8), "positive multiple of"),
        (dict(num_iterations=0), "num_iterations must be >= 1"),
        (dict(logps_chunk_size=-1), "logps_chunk_size must be >= 0"),
        (dict(vllm_mode="remote"), "vllm_mode must be one of"),
        (dict(vllm_importance_sampling_cap=0.5), "vllm_importance_sampling_correction=False"),
        (dict(vllm_gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization must be in"),
        (dict(vllm_tensor_parallel_size=0), "vllm_tensor_parallel_size must be >= 1"),
        (dict(max_completion_length=0), "max_completion_length must be >= 1"),
        (dict(temperature=0.0), "temperature must be > 0"),
        (dict(top_p=0.0), "top_p must be in"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(min_p=1.5), "min_p must be in"),
        (dict(beta=-0.1), "beta must be >= 0"),
        (dict(loss_type="dpo"), "loss_type must be one of"),
        (dict(generation_kwargs="{not json"), "generation_kwargs` must be a dict or a JSON object"),
        (dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=6, num_generations=4), "Evaluation batches"),
        (dict(num_completions_to_print=0), "num_completions_to_print must be >= 1"),
        (dict(scale_rewards="global"), "scale_rewards must be one of"),
        (dict(multi_objective_aggregation="mean"), "multi_objective_aggregation must be one of"),
        (dict(importance_sampling_level="group"), "importance_sampling_level must be one of"),
        (dict(epsilon=1.0), "epsilon must be in \\[0, 1\\)"),
        (dict(epsilon_high=-0.1), "epsilon_high must be >= 0"),
        (dict(delta=0.0), "delta must be > 0"),
        (dict(sapo_temperature_neg=0.0), "sapo_temperature_neg must be > 0"),
        (dict(vespo_lambda_pos=-1.0), "vespo_lambda_pos must be > 0"),
        (dict(vespo_k_neg=-1.0), "vespo_k_neg must be >= 0"),
        (dict(vllm_importance_sampling_mode="token"), "vllm_importance_sampling_mode must be one of"),
        (dict(vllm_importance_sampling_clip_min=3.0), "must be >= 0 and below the upper bound \\(2.0\\)"),
        (dict(vllm_importance_sampling_clip_max=0.0), "vllm_importance_sampling_clip_max must be > 0"),
        (dict(num_generations_eval=0), "num_generations_eval must be >= 1"),
        (dict(pad_to_multiple_of=0), "pad_to_multiple_of must be >= 1"),
        (dict(use_transformers_continuous_batching=True, repetition_penalty=1.1), "cannot honour repetition_penalty"),
        (dict(use_transformers_paged=True, repetition_penalty=1.1), "cannot honour repetition_penalty"),
        (dict(transformers_continuous_batching_config={"pagesize": 64}), "keys \\['pagesize'\\] are not Continuous"),
        (dict(transformers_continuous_batching_config="{not json"), "must be a dict or a JSON object"),
        (dict(vllm_structured_outputs_regex="[01]+"), "set use_vllm=True"),
        (dict(log_completions_hub_repo="me/completions"), "set log_completions=True"),
        (dict(top_entropy_quantile=1.5), "top_entropy_quantile must be in"),
        (dict(off_policy_mask_threshold=0.0), "off_policy_mask_threshold must be > 0"),
        (dict(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1), "must not exceed entropy_coef_max"),
        (dict(router_aux_loss_coef=-1.0), "router_aux_loss_coef must be >= 0"),
    ],
)
def test_bad_settings_are_refused_with_a_message(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **kwargs)


def test_whole_groups_message_explains_the_numbers(tmp_path):
    with pytest.raises(ValueError) as error:
        config(tmp_path, per_device_train_batch_size=6, num_generations=4)
    assert "generation_batch_size = 6 completions" in str(error.value)
    assert "num_generations=4" in str(error.value)


@pytest.fixture
def two_processes(monkeypatch):
    """Pretend to run on two processes: no real process group is needed to check batch arithmetic."""
    monkeypatch.setattr(TargetPOConfig, "world_size", property(lambda self: 2))


def test_groups_may_span_processes_with_one_step_per_generation(tmp_path, two_processes):
    args = config(tmp_path, per_device_train_batch_size=2, num_generations=4)  # 2 x 2 = one group over 2 ranks
    assert args.generation_batch_size == 4 and args.steps_per_generation == 1


@pytest.mark.parametrize(
    "settings",
    [
        # A group of 8 over the 4 micro-steps of one optimiser step, also trained twice (num_iterations).
        dict(per_device_train_batch_size=2, num_generations=8, steps_per_generation=4, gradient_accumulation_steps=4),
        dict(per_device_train_batch_size=2, num_generations=8, steps_per_generation=4, gradient_accumulation_steps=8,
             num_iterations=2),
        dict(per_device_train_batch_size=2, num_generations=8, steps_per_generation=4, gradient_accumulation_steps=4,
             num_iterations=2),
        # Two optimiser steps per pass over the rollout: groups of 6 over micro-steps of 3 rows, two micro-steps (one
        # group) per optimiser step.
        dict(per_device_train_batch_size=3, num_generations=6, steps_per_generation=4, gradient_accumulation_steps=2),
    ],
)
def test_tpo_groups_may_spread_over_the_micro_steps_of_one_optimiser_step(tmp_path, settings):
    args = config(tmp_path, **settings)
    assert args.generation_batch_size == settings["per_device_train_batch_size"] * 4


@pytest.mark.parametrize(
    "settings, where",
    [
        # The one group's 4 micro-steps fall in two optimiser steps of 2 micro-steps each.
        (dict(per_device_train_batch_size=2, num_generations=8, steps_per_generation=4, gradient_accumulation_steps=2),
         "step batches \\[0, 1, 2, 3\\]"),
        (dict(per_device_train_batch_size=4, num_generations=6, steps_per_generation=3, gradient_accumulation_steps=1),
         "step batches \\[0, 1\\]"),
        (dict(per_device_train_batch_size=2, num_generations=4, steps_per_generation=2, gradient_accumulation_steps=3),
         "neither divides nor is a multiple"),
    ],
)
def test_tpo_refuses_a_group_spread_over_optimiser_steps_and_says_why(tmp_path, settings, where):
    with pytest.raises(ValueError, match=f"whole prompt groups per optimiser step.*{where}"):
        config(tmp_path, **settings)


def test_policy_gradient_losses_need_whole_groups_per_rollout_only(tmp_path):
    """Their advantages are whitened over the whole rollout; a step batch may hold any of its rows."""
    args = config(
        tmp_path, loss_type="grpo", per_device_train_batch_size=2, num_generations=8, steps_per_generation=4
    )
    assert args.generation_batch_size == 8
    with pytest.raises(ValueError, match="Each rollout must hold whole prompt groups"):
        config(tmp_path, loss_type="grpo", per_device_train_batch_size=2, num_generations=8, steps_per_generation=3)


def test_several_steps_per_generation_over_processes_spread_groups_within_an_optimiser_step(
    tmp_path, two_processes
):
    # Process 0 holds rows 0-3 of the rollout in step batches [0, 1], [2, 3]: group 0 spans both micro-steps.
    with pytest.raises(ValueError, match="step batches \\[0, 1\\], which different optimiser steps train"):
        config(tmp_path, per_device_train_batch_size=2, num_generations=4, steps_per_generation=2)
    args = config(
        tmp_path, per_device_train_batch_size=2, num_generations=4, steps_per_generation=2,
        gradient_accumulation_steps=2,
    )
    assert args.generation_batch_size == 8
    args = config(tmp_path, per_device_train_batch_size=4, num_generations=4, steps_per_generation=2)
    assert args.generation_batch_size == 16


def test_whole_groups_check_counts_every_process(tmp_path, two_processes):
    with pytest.raises(ValueError, match="whole prompt groups"):
        config(tmp_path, per_device_train_batch_size=3, num_generations=4)  # 3 x 2 = 6 per rollout


def test_command_line_parsing(tmp_path):
    parser = HfArgumentParser(TargetPOConfig)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir", str(tmp_path), "--report_to", "none",
            "--tpo_target_temperature", "0.5", "--no_tpo_length_normalize_logps",
            "--num_generations", "4", "--per_device_train_batch_size", "8", "--steps_per_generation", "2",
            "--generation_kwargs", '{"suppress_tokens": [1, 2]}', "--reward_weights", "1.0", "0.5",
            "--model_init_kwargs", '{"dtype": "float32"}', "--loss_type", "grpo",
        ]
    )
    assert args.tpo_target_temperature == 0.5 and args.tpo_length_normalize_logps is False
    assert args.generation_kwargs == {"suppress_tokens": [1, 2]}
    assert args.model_init_kwargs == {"dtype": "float32"}
    assert args.reward_weights == [1.0, 0.5]
    assert args.generation_batch_size == 16 and args.loss_type == "grpo"
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--loss_type", "dpo"])


@pytest.mark.parametrize("given, meaning", [(True, "group"), (False, "none"), ("True", "group"), ("false", "none"),
                                            ("batch", "batch"), ("none", "none")])
def test_scale_rewards_takes_booleans_as_group_and_none(tmp_path, given, meaning):
    assert config(tmp_path, scale_rewards=given).scale_rewards == meaning


@pytest.mark.parametrize(
    "kwargs, warning",
    [
        (dict(loss_type="luspo"), "set importance_sampling_level='sequence'"),
        (dict(loss_type="vespo", importance_sampling_level="sequence"), "has no effect on it"),
        (dict(loss_type="dapo", importance_sampling_level="sequence"), "weighting each sequence by its length"),
        (dict(loss_type="tpo", importance_sampling_level="sequence"), "they have no effect"),
        (dict(loss_type="tpo", delta=2.0), "they have no effect"),
        (dict(loss_type="sapo", delta=2.0), "so delta has no effect"),
        (dict(loss_type="grpo", delta=1.1), "expects delta > 1 \\+ epsilon_high"),
        (dict(loss_type="cispo"), "recommends epsilon_high=5.0"),
    ],
)
def test_incoherent_loss_settings_warn(tmp_path, kwargs, warning):
    with pytest.warns(UserWarning, match=warning):
        config(tmp_path, **kwargs)


def test_coherent_loss_settings_do_not_warn(tmp_path, recwarn):
    for kwargs in (dict(loss_type="luspo", importance_sampling_level="sequence"), dict(loss_type="cispo", epsilon_high=5.0),
                   dict(loss_type="grpo", importance_sampling_level="sequence", delta=1.5), dict(loss_type="tpo")):
        config(tmp_path, **kwargs)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning) and "loss" in str(w.message)]


# ------------------------------------------------------------------------------------------------ sampling settings
def test_generation_kwargs_spelling_a_sampling_field_at_its_default_wins(tmp_path):
    args = config(tmp_path, max_completion_length=6, generation_kwargs={
        "temperature": 0.7, "top_k": 5, "max_new_tokens": 6, "do_sample": True, "num_return_sequences": 1,
        "eos_token_id": [3], "suppress_tokens": [4],
    })
    resolved = resolve_generation_kwargs(args)
    assert resolved.temperature == 0.7 and resolved.top_k == 5
    assert resolved.from_generation_kwargs == ("temperature", "top_k")
    assert resolved.stop_token_ids == (3,)
    # What is left goes to the backend; what the trainer resolved (or what changes nothing) is not passed twice.
    assert resolved.generation_kwargs == {"suppress_tokens": [4]}
    # Equal values in both places, and vLLM's spelling of "no top-k", agree with the field.
    agreeing = config(tmp_path, temperature=0.5, top_k=0, use_vllm=True, generation_kwargs={"temperature": 0.5, "top_k": -1})
    resolved = resolve_generation_kwargs(agreeing)
    assert resolved.temperature == 0.5 and resolved.top_k == 0 and resolved.from_generation_kwargs == ()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=0.9, generation_kwargs={"temperature": 0.7}),
         r"generation_kwargs\['temperature'\]=0.7 contradicts temperature=0.9"),
        (dict(top_p=0.8, generation_kwargs={"top_p": 0.9}), r"generation_kwargs\['top_p'\]=0.9 contradicts top_p=0.8"),
        (dict(min_p=0.1, generation_kwargs={"min_p": 0.2}), r"generation_kwargs\['min_p'\]=0.2 contradicts min_p=0.1"),
        (dict(repetition_penalty=1.2, generation_kwargs={"repetition_penalty": 1.1}),
         r"generation_kwargs\['repetition_penalty'\]=1.1 contradicts repetition_penalty=1.2"),
        (dict(max_completion_length=6, generation_kwargs={"max_new_tokens": 8}),
         r"generation_kwargs\['max_new_tokens'\]=8 contradicts max_completion_length=6.*Set max_completion_length=8"),
        (dict(max_completion_length=6, use_vllm=True, generation_kwargs={"max_tokens": 4}),
         r"generation_kwargs\['max_tokens'\]=4 contradicts max_completion_length=6"),
        (dict(generation_kwargs={"temperature": 0.0}), r"generation_kwargs\['temperature'\]=0.0 is out of range.*greedy"),
        (dict(generation_kwargs={"top_p": 1.5}), r"generation_kwargs\['top_p'\]=1.5 is out of range for top_p"),
        (dict(generation_kwargs={"do_sample": False}), r"generation_kwargs\['do_sample'\]=False is refused.*greedily"),
        (dict(generation_kwargs={"num_return_sequences": 4}),
         r"generation_kwargs\['num_return_sequences'\]=4 is refused.*Set num_generations"),
        (dict(use_vllm=True, generation_kwargs={"n": 2}), r"generation_kwargs\['n'\]=2 is refused.*Set num_generations"),
        (dict(generation_kwargs={"num_beams": 4}), r"generation_kwargs\['num_beams'\]=4 is refused.*beams"),
        (dict(use_vllm=True, generation_kwargs={"logprobs": 5}), r"generation_kwargs\['logprobs'\]=5 is refused"),
        (dict(generation_kwargs={"max_length": 40}), r"generation_kwargs\['max_length'\]=40 is refused.*max_completion_length"),
        (dict(use_vllm=True, generation_kwargs={"seed": 3}), r"generation_kwargs\['seed'\]=3 is refused.*Set seed"),
        (dict(use_vllm=True, generation_kwargs={"ignore_eos": True}), r"generation_kwargs\['ignore_eos'\]=True is refused"),
        (dict(use_vllm=True, generation_kwargs={"stop": ["\n"]}), r"generation_kwargs\['stop'\]=\['\\n'\] is refused.*stop_token_ids"),
        # model.generate would silently ignore a setting GenerationConfig does not have.
        (dict(generation_kwargs={"presence_penalty": 0.5}),
         r"generation_kwargs keys \['presence_penalty'\] are not GenerationConfig fields.*use_vllm=True"),
    ],
    ids=["temperature", "top_p", "min_p", "repetition_penalty", "max_new_tokens", "max_tokens", "greedy-temperature",
         "top_p-range", "do_sample", "num_return_sequences", "n", "num_beams", "logprobs", "max_length", "seed",
         "ignore_eos", "stop", "vllm-field-without-vllm"],
)
def test_sampling_settings_that_contradict_each_other_or_the_trainer_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_generation_kwargs(config(tmp_path, **kwargs))


@pytest.mark.parametrize(
    "use_vllm, generation_kwargs, reshaped_by",
    [
        (False, {"suppress_tokens": [3], "use_cache": True}, ()),  # suppressed tokens leave the log-probs too
        (False, {"top_k": 5}, ("generation_kwargs['top_k']",)),
        (False, {"typical_p": 0.9, "no_repeat_ngram_size": 3}, ("generation_kwargs['typical_p']",
                                                                 "generation_kwargs['no_repeat_ngram_size']")),
        (False, {"typical_p": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None}, ()),
        (False, {"bad_words_ids": [[5, 6]], "min_new_tokens": 2}, ("generation_kwargs['bad_words_ids']",
                                                                    "generation_kwargs['min_new_tokens']")),
        (True, {"presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0}, ()),
        (True, {"presence_penalty": 0.5, "logit_bias": {5: 1.0}}, ("generation_kwargs['presence_penalty']",
                                                                  "generation_kwargs['logit_bias']")),
        (True, {"min_p": 0.05, "epsilon_cutoff": 0.001}, ("generation_kwargs['min_p']",
                                                          "generation_kwargs['epsilon_cutoff']")),
        (True, {"an_unknown_field": 1}, ("generation_kwargs['an_unknown_field']",)),  # unknown: assumed to reshape
    ],
)
def test_every_setting_that_reshapes_sampling_is_named(tmp_path, use_vllm, generation_kwargs, reshaped_by):
    settings = resolved_settings(config(tmp_path, use_vllm=use_vllm, generation_kwargs=generation_kwargs))
    assert settings.reshaping_settings == reshaped_by
    assert settings.reshapes_distribution == bool(reshaped_by)
    typed = SamplingSettings(max_new_tokens=6, eos_token_ids=(1,), pad_token_id=0, top_p=0.9, repetition_penalty=1.1)
    assert typed.reshaping_settings == ("top_p", "repetition_penalty")


def test_vllm_settings_a_run_without_vllm_leaves_unused_are_named(tmp_path):
    with pytest.warns(UserWarning, match=r"^vllm_server_port=8001, vllm_gpu_memory_utilization=0.5 have no effect with "
                                         r"use_vllm=False"):
        config(tmp_path, vllm_server_port=8001, vllm_gpu_memory_utilization=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config(tmp_path, use_vllm=True, vllm_server_port=8001)  # used
        config(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.5)  # used
        config(tmp_path)  # nothing set
    # One mode's settings in the other: the server's engine has its own command line; colocate has no server.
    with pytest.warns(UserWarning, match=r"^vllm_gpu_memory_utilization=0.5, vllm_max_model_length=64 have no effect "
                                         r"with vllm_mode='server': the server's engine is set up by its own command"):
        config(tmp_path, use_vllm=True, vllm_gpu_memory_utilization=0.5, vllm_max_model_length=64)
    with pytest.warns(UserWarning, match=r"^vllm_server_port=8001, vllm_server_api_key=<hidden> have no effect with "
                                         r"vllm_mode='colocate': the engine runs in the training processes"):
        config(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_server_port=8001, vllm_server_api_key="secret")
    # A GRPOConfig the trainer converts says it once, not again when converted.
    with pytest.warns(UserWarning) as caught:
        resolve_config("model", GRPOConfig(output_dir=str(tmp_path), report_to="none", loss_type="tpo",
                                           vllm_server_port=9000))
    assert len([w for w in caught if "vllm_server_port" in str(w.message)]) == 1


def resolved_settings(args):
    """The run's sampling settings as the trainer resolves them (a tokenizer with EOS 1 and padding 0)."""
    resolved = resolve_generation_kwargs(args)
    fields = {key: value for key, value in resolved._asdict().items() if key != "stop_token_ids"}
    return SamplingSettings(max_new_tokens=args.max_completion_length, eos_token_ids=(1,), pad_token_id=0, **fields)


def test_the_importance_sampling_correction_is_switched_off_by_any_reshaping_setting(tmp_path):
    """The switch reads the resolved settings: a generation_kwargs temperature keeps the correction, a
    generation_kwargs top_k or penalty switches it off, saying why (no engine is needed to decide)."""
    tempered = config(tmp_path, use_vllm=True, generation_kwargs={"temperature": 0.7})
    assert importance_sampling_applies(tempered, resolved_settings(tempered))
    for generation_kwargs in ({"top_k": 5}, {"presence_penalty": 0.5}):
        args = config(tmp_path, use_vllm=True, generation_kwargs=generation_kwargs)
        with pytest.warns(UserWarning, match=r"correction is switched off: sampling is reshaped by generation_kwargs"):
            assert not importance_sampling_applies(args, resolved_settings(args))


# ------------------------------------------------------------------------------------------- ranges and choices as data
# Every field that declares what it accepts, written out by hand: a field losing its rule, or gaining one, fails here.
RULED_FIELDS = {
    "num_generations", "num_generations_eval", "steps_per_generation", "num_iterations", "max_prompt_length",
    "max_completion_length", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "max_tool_calling_iterations", "tool_call_timeout", "tool_call_concurrency", "logps_chunk_size", "logps_head_kernel",
    "max_tokens_per_micro_batch",
    "pad_to_multiple_of", "router_aux_loss_coef", "vllm_mode", "learning_rate", "vllm_server_stall_timeout",
    "vllm_server_restart_grace_period",
    "max_staleness", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_model_impl",
    "vllm_weight_transfer_backend", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap", "loss_type", "beta", "epsilon", "epsilon_high",
    "delta", "importance_sampling_level", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
    "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef_delta", "top_entropy_quantile",
    "off_policy_mask_threshold", "ref_model_mixup_alpha", "ref_model_sync_steps", "scale_rewards",
    "multi_objective_aggregation", "num_completions_to_print", "tpo_target_temperature",
    "warn_after_uninformative_rollouts",
}


def edge_cases(rule, integer):
    """(refused, accepted) values derived from a rule: each bound's edge and the nearest value past it."""
    def past(edge, direction):  # the nearest value beyond an edge, of the field's type
        return edge + direction if integer else math.nextafter(edge, direction * math.inf)

    if isinstance(rule, OneOf):
        return ["not-a-choice"], list(rule.values)
    refused, accepted = [], []
    for edge, direction, included in ((rule.at_least, -1, True), (rule.above, -1, False),
                                      (rule.at_most, 1, True), (rule.below, 1, False)):
        if edge is None:
            continue
        if included:
            accepted.append(edge)
            refused.append(past(edge, direction))
        else:
            refused.append(edge)
            accepted.append(past(edge, -direction))
    return refused, accepted


def test_every_declared_range_and_choice_refuses_just_past_its_edge_and_accepts_the_edge(tmp_path):
    rules = field_rules(TargetPOConfig)
    assert set(rules) == RULED_FIELDS
    types = typing.get_type_hints(TargetPOConfig)
    for name, (field_rule_list, optional) in rules.items():
        integer = int in (types[name], *typing.get_args(types[name]))
        for rule in field_rule_list:
            refused, accepted = edge_cases(rule, integer)
            assert refused and accepted, name
            for value in refused:
                with pytest.raises(ValueError) as error:
                    config(tmp_path, **{name: value})
                message = str(error.value)
                assert message.startswith(name) and f"got {value!r}" in message and str(rule) in message, message
            for value in accepted:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # some choices warn about the other settings; accepted is enough
                    assert getattr(config(tmp_path, **{name: value}), name) == value, (name, value)
        if optional:
            config(tmp_path, **{name: None})  # None is accepted (steps_per_generation then takes its default)
        else:
            with pytest.raises(ValueError, match=f"^{name}"):
                config(tmp_path, **{name: None})


@pytest.mark.parametrize(
    "name, refused, accepted",
    [  # Written out by hand, independently of the declarations above.
        ("num_generations", [1, 0, -3], [2, 4]),
        ("temperature", [0.0, -0.5, float("nan")], [1e-9, 5.0]),
        ("top_p", [0.0, 1.0000001, 2.0], [1e-6, 0.5, 1.0]),
        ("epsilon", [-1e-9, 1.0], [0.0, 0.999]),
        ("min_p", [-0.01, 1.01], [None, 0.0, 1.0]),
        ("vllm_importance_sampling_cap", [0.999], [1.0, 10.0]),
        ("vllm_gpu_memory_utilization", [0.0, 1.01], [0.01, 1.0]),
        ("max_tool_calling_iterations", [-1], [None, 0, 5]),
        ("steps_per_generation", [0], [None, 1]),
        ("tpo_target_temperature", [0.0, -1.0], [0.25, 2.0]),
        ("loss_type", ["dpo", "TPO", None], ["tpo", "grpo", "vespo"]),
        ("scale_rewards", ["global", None], ["group", "batch", "none", True, False]),
        ("vllm_weight_transfer_backend", ["tcp"], ["auto", "nccl", "gloo"]),
    ],
)
def test_hand_written_ranges(tmp_path, name, refused, accepted):
    for value in refused:
        with pytest.raises(ValueError, match=f"^{name}"):
            config(tmp_path, **{name: value})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for value in accepted:
            config(tmp_path, **{name: value})


def test_range_messages_say_the_bounds_as_written():
    assert [str(rule) for rule in (Range(at_least=1), Range(above=0), Range(above=0, at_most=1),
                                    Range(at_least=0, below=1), Range(at_most=3), Range(below=3))] == [
        ">= 1", "> 0", "in (0, 1]", "in [0, 1)", "<= 3", "< 3"]
    assert Range(above=0, symbol="eta", why="the target temperature").refusal("t", 0.0, optional=True) == (
        "t (eta) must be > 0 or None (the target temperature), got 0.0.")
    for bad in (dict(), dict(at_least=0, above=0), dict(at_most=1, below=1)):
        with pytest.raises(ValueError, match="give one bound or two"):
            Range(**bad)


@pytest.mark.parametrize(
    "config_class, given, meant",
    [(TargetPOConfig, "num_generation", "num_generations"), (GRPOConfig, "lr", "learning_rate"),
     (TargetPOConfig, "tpo_target_temprature", "tpo_target_temperature")],
)
def test_a_misspelt_field_is_refused_naming_the_field_meant(tmp_path, config_class, given, meant):
    with pytest.raises(TypeError) as error:
        config_class(output_dir=str(tmp_path), **{given: 1})
    # The dataclass's own message, as its generated __init__ words it, then the field meant, named first.
    with pytest.raises(TypeError) as bare:
        config_class.__init__(object.__new__(config_class), **{given: 1})
    assert str(error.value).startswith(f"{bare.value}. Did you mean '{meant}'")


def test_a_name_close_to_no_field_keeps_the_dataclass_message(tmp_path):
    with pytest.raises(TypeError) as error:
        config(tmp_path, zzyzx=1)
    with pytest.raises(TypeError) as bare:
        TargetPOConfig.__init__(object.__new__(TargetPOConfig), zzyzx=1)
    assert str(error.value) == str(bare.value)


#: For each of the config's combination rules (targetpo/config/rules.py), settings that break it alone, and its message.
BROKEN_RULES = {
    "continuous batching or vLLM": (
        dict(use_transformers_continuous_batching=True, use_vllm=True), "with vLLM: choose one"
    ),
    "continuous batching honours the sampling": (
        dict(use_transformers_continuous_batching=True, generation_kwargs={"repetition_penalty": 1.2}),
        "cannot honour repetition_penalty",
    ),
    "continuous batching's own settings": (
        dict(transformers_continuous_batching_config={"return_logprobs": False}),
        r"keys \['return_logprobs'\] are set by the trainer",
    ),
    "a sampling regex needs vLLM": (dict(vllm_structured_outputs_regex="a+"), "constrains vLLM's sampling"),
    "the Hub table needs the completions table": (
        dict(log_completions_hub_repo="me/table", log_completions=False), "which log_completions=False does not build"
    ),
    "a synced reference needs the KL term": (dict(sync_ref_model=True, beta=0.0), "which beta=0 does not load"),
    "importance-sampling bounds in order": (
        dict(vllm_importance_sampling_clip_min=3.0, vllm_importance_sampling_clip_max=2.0),
        r"vllm_importance_sampling_clip_min \(3.0\) must be >= 0 and below the upper bound \(2.0\)",
    ),
    "async rollouts need a vLLM server": (dict(async_rollouts=True), "generates on a vLLM server while training"),
    "one head kernel": (dict(use_liger_kernel=True, logps_head_kernel="triton"), "with another one: choose one"),
    "shared prompts or packed rows": (dict(share_prompt_forward=True, padding_free=True), "into one row: choose one"),
    "shared prompts keep their activations": (
        dict(share_prompt_forward=True, gradient_checkpointing=True), "does not keep under gradient checkpointing"
    ),
    "passes and the entropy ranking": (
        dict(max_tokens_per_micro_batch=200, top_entropy_quantile=0.5), "ranks each token's entropy"
    ),
    "passes and layer-wise optimisers": (
        dict(max_tokens_per_micro_batch=200, optim="adalomo"), "updates the weights inside each backward pass"
    ),
    "passes and the masked entropy bonus": (
        dict(max_tokens_per_micro_batch=200, entropy_coef=0.1, off_policy_mask_threshold=0.5),
        "which off_policy_mask_threshold decides pass by pass",
    ),
    "entropy coefficient bounds in order": (
        dict(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1),
        r"entropy_coef_min \(0.5\) must not exceed entropy_coef_max \(0.1\)",
    ),
    "dict fields": (dict(generation_kwargs=[1, 2]), "generation_kwargs must be a dict, got list"),
}


def test_every_combination_rule_has_a_case():
    from targetpo.config.rules import RULES

    assert [rule.name for rule in RULES] == list(BROKEN_RULES)


@pytest.mark.parametrize("rule", list(BROKEN_RULES))
def test_each_combination_rule_refuses_the_settings_that_break_it_with_its_message(tmp_path, rule):
    settings, message = BROKEN_RULES[rule]
    with pytest.raises(ValueError, match=message):
        make_config(tmp_path, **settings)
