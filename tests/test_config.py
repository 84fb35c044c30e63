"""Every configuration check, with its message, and command-line parsing."""

import pytest
from transformers import HfArgumentParser

from targetpo import GRPOConfig, TargetPOConfig


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
        (dict(use_transformers_continuous_batching=True), "not supported yet"),
        (dict(use_transformers_paged=True), "not supported yet"),
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
    assert "generation_batch_size // steps_per_generation = 6" in str(error.value)
    assert "num_generations=4" in str(error.value)


@pytest.fixture
def two_processes(monkeypatch):
    """Pretend to run on two processes: no real process group is needed to check batch arithmetic."""
    monkeypatch.setattr(TargetPOConfig, "world_size", property(lambda self: 2))


def test_groups_may_span_processes_with_one_step_per_generation(tmp_path, two_processes):
    args = config(tmp_path, per_device_train_batch_size=2, num_generations=4)  # 2 x 2 = one group over 2 ranks
    assert args.generation_batch_size == 4 and args.steps_per_generation == 1


def test_several_steps_per_generation_need_whole_groups_per_process(tmp_path, two_processes):
    with pytest.raises(ValueError, match="per_device_train_batch_size \\(2\\) must be a multiple of num_generations \\(4\\)"):
        config(tmp_path, per_device_train_batch_size=2, num_generations=4, steps_per_generation=2)
    args = config(tmp_path, per_device_train_batch_size=4, num_generations=4, steps_per_generation=2)
    assert args.generation_batch_size == 16


def test_whole_groups_check_counts_every_process(tmp_path, two_processes):
    with pytest.raises(ValueError, match="whole prompt groups"):
        config(tmp_path, per_device_train_batch_size=3, num_generations=4)  # 3 x 2 = 6 per step


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
