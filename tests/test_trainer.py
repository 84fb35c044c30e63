"""End-to-end training on real tiny models: every path the trainer offers, and the errors it raises."""

import json
import math
import os

import pytest
import torch
from conftest import changed, count_letters_reward, length_reward, letters_then_position_reward, make_config, snapshot
from datasets import Dataset
from scripted_policies import script_ended_or_cut
from transformers import Qwen2Config, Qwen2ForSequenceClassification

import targetpo.step.forward as policy_logps_module
from targetpo import TargetPOTrainer
from targetpo import functional as F
from targetpo.batch import StepBatch
from targetpo.demo import build_tiny_causal_lm
from targetpo.modeling.logps import completion_logps, packed_completion_logps
from targetpo.objectives.registry import TargetObjective


def metric_names(trainer):
    return {key for entry in trainer.state.log_history for key in entry}


def test_standard_dataset_trains_every_parameter_and_logs_metrics(tmp_path, tiny_model, tokenizer, prompt_dataset):
    seen_kwargs = {}

    def reward_with_columns(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
        seen_kwargs.update(answer=answer, trainer_state=trainer_state, completion_ids=completion_ids, prompts=prompts)
        return count_letters_reward(completions)

    args = make_config(tmp_path, max_steps=3)
    trainer = TargetPOTrainer(
        tiny_model, [reward_with_columns, length_reward], args=args, train_dataset=prompt_dataset,
        processing_class=tokenizer,
    )
    before = snapshot(tiny_model)
    trainer.train()

    assert changed(before, tiny_model) == set(before), "every trainable parameter must move"
    names = metric_names(trainer)
    for expected in [
        "loss", "reward", "reward_std", "rewards/reward_with_columns/mean", "rewards/reward_with_columns/std",
        "rewards/length_reward/mean", "completions/mean_length", "completions/min_length", "completions/max_length",
        "completions/clipped_ratio", "entropy", "tpo/target_entropy", "tpo/informative_group_fraction",
        "tpo/best_completion_target_mass",
    ]:
        assert expected in names, expected
    assert "kl" not in names  # beta = 0
    # Reward functions get the extra columns, the trainer state and token ids, one per completion.
    assert len(seen_kwargs["answer"]) == 8 and set(seen_kwargs["answer"]) <= set(prompt_dataset["answer"])
    assert seen_kwargs["trainer_state"] is trainer.state
    assert all(isinstance(ids, list) and all(isinstance(i, int) for i in ids) for ids in seen_kwargs["completion_ids"])
    # Groups are contiguous: each prompt appears num_generations times in a row.
    prompts = seen_kwargs["prompts"]
    assert prompts[:4] == [prompts[0]] * 4 and prompts[4:] == [prompts[4]] * 4


def test_conversational_dataset_gets_message_completions(tmp_path, tiny_model, tokenizer, chat_dataset):
    received = []

    def reward(completions, **kwargs):
        received.extend(completions)
        return letters_then_position_reward(completions)

    trainer = TargetPOTrainer(
        tiny_model, reward, args=make_config(tmp_path), train_dataset=chat_dataset, processing_class=tokenizer
    )
    before = snapshot(tiny_model)
    trainer.train()
    assert changed(before, tiny_model) == set(before)
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in received)
    assert "reward" in metric_names(trainer)


def test_reward_model_path(tmp_path, tiny_model, tokenizer, prompt_dataset):
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    reward_model = Qwen2ForSequenceClassification(config)
    args = make_config(tmp_path, reward_weights=[0.5, 1.0])
    trainer = TargetPOTrainer(
        tiny_model, [reward_model, count_letters_reward], args=args, train_dataset=prompt_dataset,
        processing_class=tokenizer, reward_processing_classes=[tokenizer, None],
    )
    trainer.train()
    names = metric_names(trainer)
    assert "rewards/Qwen2ForSequenceClassification/mean" in names
    assert "reward" in names
    assert not any(p.requires_grad for p in reward_model.parameters())


def constant_score(completions, value, **kwargs):
    return [value] * len(completions)


def test_reward_functions_of_one_name_log_apart(tmp_path, tiny_model, tokenizer, prompt_dataset):
    import functools

    rewards = [functools.partial(constant_score, value=1.0), functools.partial(constant_score, value=3.0)]
    args = make_config(tmp_path, max_steps=2, log_completions=True, num_completions_to_print=1)
    trainer = TargetPOTrainer(tiny_model, rewards, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    trainer.train()
    assert trainer.reward_scorer.names == ["constant_score_1", "constant_score_2"]
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2
    for entry in logged:  # merged under one name, the two would log a mean of 2.0 and a std of 1.0
        assert entry["rewards/constant_score_1/mean"] == 1.0 and entry["rewards/constant_score_1/std"] == 0.0
        assert entry["rewards/constant_score_2/mean"] == 3.0 and entry["rewards/constant_score_2/std"] == 0.0
        assert entry["reward"] == 4.0
    table = trainer._completions.table
    assert table.rewards == {"constant_score_1": [1.0] * 8, "constant_score_2": [3.0] * 8}


def test_peft_trains_only_adapters(tmp_path, tiny_model, tokenizer, prompt_dataset):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = make_config(tmp_path, beta=0.1)  # the reference is then the adapter-free base model
    trainer = TargetPOTrainer(
        tiny_model, letters_then_position_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer,
        peft_config=peft_config,
    )
    assert trainer.ref_model is None
    model = trainer.model
    before = snapshot(model)
    trainer.train()
    moved = changed(before, model)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    lora_b = {name for name in trainable if "lora_B" in name}
    assert lora_b <= moved, "the adapters must train"
    assert moved <= trainable, f"frozen base weights moved: {sorted(moved - trainable)[:3]}"
    assert "kl" in metric_names(trainer)


def test_kl_penalty_logs_kl_and_keeps_reference_frozen(tmp_path, tiny_model, tokenizer, prompt_dataset):
    args = make_config(tmp_path, beta=0.5, max_steps=3)
    trainer = TargetPOTrainer(
        tiny_model, letters_then_position_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    reference_before = snapshot(trainer.ref_model)
    policy_before = snapshot(tiny_model)
    trainer.train()
    assert changed(reference_before, trainer.ref_model) == set()
    assert changed(policy_before, tiny_model) == set(policy_before)
    kls = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert len(kls) == 3 and kls[0] == pytest.approx(0.0, abs=1e-9)  # step 1: the policy is still the reference
    assert kls[-1] > 0


class _Recorder:
    """Wraps the trainer's log-prob function to count forward passes, and records what each loss call saw."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = policy_logps_module.completion_logps

        def counting(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(policy_logps_module, "completion_logps", counting)


def test_single_use_rollout_makes_no_extra_forward(tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch):
    recorder = _Recorder(monkeypatch)
    args = make_config(tmp_path, max_steps=3)
    trainer = TargetPOTrainer(
        tiny_model, letters_then_position_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    assert not trainer._plan.needs_old_logps
    trainer.train()
    assert recorder.calls == 3  # one forward per step: old log-probs are the detached current ones


def test_gradient_accumulation_over_a_rollout_needs_no_old_logps(tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch):
    recorder = _Recorder(monkeypatch)
    args = make_config(tmp_path, steps_per_generation=2, gradient_accumulation_steps=2, max_steps=2)
    trainer = TargetPOTrainer(
        tiny_model, letters_then_position_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    assert args.generation_batch_size == 16 and not trainer._plan.needs_old_logps
    trainer.train()
    assert recorder.calls == 4  # 2 optimiser steps x 2 micro-steps, nothing at rollout


def test_several_iterations_freeze_q_at_rollout(tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch):
    recorder = _Recorder(monkeypatch)
    seen = []
    original_loss, original_target_loss = F.tpo_loss, TargetObjective.cross_entropy_to_targets

    def recording_target_loss(self, per_token_logps, inputs, *args):
        seen.append({"inputs": inputs, "current": F.sequence_logps(per_token_logps.detach(), inputs["completion_mask"])})
        return original_target_loss(self, per_token_logps, inputs, *args)

    def recording_loss(sequence_logps, targets, *args, **kwargs):
        seen[-1]["targets"] = targets.clone()  # the q the loss is really fitted to at this micro-step
        return original_loss(sequence_logps, targets, *args, **kwargs)

    monkeypatch.setattr(TargetObjective, "cross_entropy_to_targets", recording_target_loss)
    monkeypatch.setattr(F, "tpo_loss", recording_loss)
    args = make_config(tmp_path, num_iterations=2, max_steps=4, skip_zero_gradient_completions=False)
    trainer = TargetPOTrainer(
        tiny_model, letters_then_position_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    assert trainer._plan.needs_old_logps
    trainer.train()
    # 4 steps and no pass for old log-probs: the first step over each rollout trains every row at its weights.
    assert recorder.calls == 4
    assert len(seen) == 4
    for first, second in (seen[0], seen[1]), (seen[2], seen[3]):
        assert second["inputs"] is first["inputs"]  # the same step batch of the same rollout
        batch = first["inputs"]
        old = F.sequence_logps(batch["old_per_token_logps"], batch["completion_mask"], True)
        expected = F.tpo_targets(old, batch["advantages"], 4, batch["valid"], 1.0)
        assert torch.allclose(first["targets"], expected) and torch.allclose(second["targets"], expected)
        # The weights moved in between, so a q rebuilt from the current policy would differ: freezing matters.
        assert not torch.allclose(second["current"], old)
    assert not torch.equal(seen[0]["targets"], seen[2]["targets"])  # a new rollout, a new q


def test_checkpoint_resume_matches_an_uninterrupted_run(tmp_path, tokenizer, prompt_dataset):
    from targetpo.demo import build_tiny_causal_lm

    def fresh():
        return build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)

    straight = TargetPOTrainer(
        fresh(), letters_then_position_reward, args=make_config(tmp_path / "a", max_steps=4),
        train_dataset=prompt_dataset, processing_class=tokenizer,
    )
    straight.train()

    first = TargetPOTrainer(
        fresh(), letters_then_position_reward,
        args=make_config(tmp_path / "b", max_steps=4, save_strategy="steps", save_steps=2),
        train_dataset=prompt_dataset, processing_class=tokenizer,
    )
    first.train()
    checkpoint = tmp_path / "b" / "out" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").exists() and (checkpoint / "model.safetensors").exists()

    resumed = TargetPOTrainer(
        fresh(), letters_then_position_reward, args=make_config(tmp_path / "c", max_steps=4),
        train_dataset=prompt_dataset, processing_class=tokenizer,
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert [e["reward"] for e in resumed.state.log_history if "reward" in e][-1] == pytest.approx(
        [e["reward"] for e in straight.state.log_history if "reward" in e][-1]
    )


def test_evaluation_logs_eval_metrics(tmp_path, tiny_model, tokenizer, prompt_dataset):
    args = make_config(tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    trainer = TargetPOTrainer(
        tiny_model, count_letters_reward, args=args, train_dataset=prompt_dataset,
        eval_dataset=prompt_dataset.select(range(4)), processing_class=tokenizer,
    )
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and "eval_reward" in metrics and "eval_tpo/target_entropy" in metrics


def test_grpo_baseline_loss_trains(tmp_path, tiny_model, tokenizer, prompt_dataset):
    args = make_config(tmp_path, loss_type="grpo", num_iterations=2, max_steps=2)
    trainer = TargetPOTrainer(
        tiny_model, letters_then_position_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    before = snapshot(tiny_model)
    trainer.train()
    assert changed(before, tiny_model)
    assert "tpo/target_entropy" not in metric_names(trainer)


def test_log_completions_prints_a_table(tmp_path, tiny_model, tokenizer, prompt_dataset, capsys):
    args = make_config(tmp_path, log_completions=True, num_completions_to_print=4, max_steps=1)
    trainer = TargetPOTrainer(
        tiny_model, letters_then_position_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    trainer.train()
    out = capsys.readouterr().out
    assert "Completions at step" in out and "Target q" in out and "letters_then_position_reward" in out
    table = trainer._completions.table
    assert len(table.targets) == 8
    # A group gets its q when a step builds it; a group left out of the step (no gradient) shows none.
    groups = [table.targets[:4], table.targets[4:]]
    built = [group for group in groups if not any(math.isnan(value) for value in group)]
    assert built and all(sum(group) == pytest.approx(1.0, abs=1e-5) for group in built)
    for group, rewards in zip(groups, [table.total_rewards[:4], table.total_rewards[4:]]):
        if group not in built:
            assert all(math.isnan(value) for value in group) and len(set(rewards)) == 1


def test_saved_state_holds_logged_metrics(tmp_path, tiny_model, tokenizer, prompt_dataset):
    trainer = TargetPOTrainer(
        tiny_model, count_letters_reward, args=make_config(tmp_path), train_dataset=prompt_dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    out = tmp_path / "out"
    state = json.loads((out / "trainer_state.json").read_text())
    assert any("reward" in entry for entry in state["log_history"])
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


# ------------------------------------------------------------------------------------------------ bad input
def test_missing_prompt_column(tmp_path, tiny_model, tokenizer):
    data = Dataset.from_dict({"question": ["a", "b"]})
    with pytest.raises(ValueError, match="no 'prompt' column.*question"):
        TargetPOTrainer(tiny_model, length_reward, args=make_config(tmp_path), train_dataset=data, processing_class=tokenizer)


def test_empty_dataset(tmp_path, tiny_model, tokenizer):
    data = Dataset.from_dict({"prompt": []})
    with pytest.raises(ValueError, match="dataset is empty"):
        TargetPOTrainer(tiny_model, length_reward, args=make_config(tmp_path), train_dataset=data, processing_class=tokenizer)


def test_conversational_dataset_needs_chat_template(tmp_path, tiny_model, chat_dataset):
    from targetpo.demo import build_char_tokenizer

    no_template = build_char_tokenizer(chat_template=None)
    with pytest.raises(ValueError, match="no chat\\s+template"):
        TargetPOTrainer(
            tiny_model, length_reward, args=make_config(tmp_path), train_dataset=chat_dataset,
            processing_class=no_template,
        )


def test_dataset_smaller_than_a_rollout(tmp_path, tiny_model, tokenizer, prompt_dataset):
    with pytest.raises(ValueError, match="one rollout needs"):
        TargetPOTrainer(
            tiny_model, length_reward, args=make_config(tmp_path, per_device_train_batch_size=40),
            train_dataset=prompt_dataset, processing_class=tokenizer,
        )


def test_reward_weights_must_match_reward_functions(tmp_path, tiny_model, tokenizer, prompt_dataset):
    with pytest.raises(ValueError, match="reward_weights has 3 entries but there are 2"):
        TargetPOTrainer(
            tiny_model, [length_reward, count_letters_reward], args=make_config(tmp_path, reward_weights=[1, 2, 3]),
            train_dataset=prompt_dataset, processing_class=tokenizer,
        )


@pytest.mark.parametrize(
    "bad_reward, message",
    [
        (lambda completions, **kw: [1.0] * (len(completions) - 1), "'wrong_length' returned 7 scores for 8"),
        (lambda completions, **kw: ["good"] * len(completions), "'wrong_length' returned 'good'"),
        (lambda completions, **kw: 1 / 0, "'wrong_length' raised ZeroDivisionError"),
        (lambda completions, **kw: [float("nan")] * len(completions), "'wrong_length' returned nan"),
        (lambda completions, **kw: 3.0, "'wrong_length' must return a list"),
    ],
)
def test_bad_reward_function_output_is_named(tmp_path, tiny_model, tokenizer, prompt_dataset, bad_reward, message):
    bad_reward.__name__ = "wrong_length"
    trainer = TargetPOTrainer(
        tiny_model, bad_reward, args=make_config(tmp_path), train_dataset=prompt_dataset, processing_class=tokenizer
    )
    before = snapshot(tiny_model)
    with pytest.raises(ValueError, match=message):
        trainer.train()
    assert changed(before, tiny_model) == set()  # refused before any update


def test_model_from_config_needs_a_tokenizer(tmp_path, tiny_model, prompt_dataset):
    with pytest.raises(ValueError, match="pass `processing_class=`"):
        TargetPOTrainer(tiny_model, length_reward, args=make_config(tmp_path), train_dataset=prompt_dataset)


def test_unreachable_hub_model_gives_a_clear_error(tmp_path, prompt_dataset):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    with pytest.raises(OSError, match="Could not load the model 'no-such-org/no-such-model'.*Hugging Face Hub"):
        TargetPOTrainer("no-such-org/no-such-model", length_reward, args=make_config(tmp_path), train_dataset=prompt_dataset)


def test_non_config_args_are_refused(tmp_path, tiny_model, tokenizer, prompt_dataset):
    from transformers import TrainingArguments

    with pytest.raises(TypeError, match="TargetPOConfig"):
        TargetPOTrainer(
            tiny_model, length_reward, args=TrainingArguments(output_dir=str(tmp_path)), train_dataset=prompt_dataset,
            processing_class=tokenizer,
        )


def test_dataset_column_that_clashes_with_reward_arguments(tmp_path, tiny_model, tokenizer):
    data = Dataset.from_dict({"prompt": ["a"] * 4, "completions": ["x"] * 4})
    with pytest.raises(ValueError, match=r"\['completions'\] would collide"):
        TargetPOTrainer(tiny_model, length_reward, args=make_config(tmp_path), train_dataset=data, processing_class=tokenizer)


def test_eval_batches_must_hold_whole_groups(tmp_path, tiny_model, tokenizer, prompt_dataset):
    with pytest.raises(ValueError, match="per_device_eval_batch_size \\(6\\)"):
        TargetPOTrainer(
            tiny_model, length_reward, args=make_config(tmp_path, per_device_eval_batch_size=6),
            train_dataset=prompt_dataset, eval_dataset=prompt_dataset, processing_class=tokenizer,
        )


def test_resume_mid_rollout_serves_each_batch_its_own_rollout(tmp_path, tokenizer, monkeypatch):
    """Epochs whose micro-batches do not fill the last accumulation step, then a resume in the middle of it all."""
    from targetpo.demo import build_tiny_causal_lm

    data = Dataset.from_dict({"prompt": ["Say cat:", "Say dog:"]})
    served = []
    original = TargetPOTrainer._prepare_inputs

    def recording(self, rows):
        batch = original(self, rows)
        if self.model.training:
            rollout_prompt = self.processing_class.decode(batch["prompt_ids"][0], skip_special_tokens=True)
            served.append((rows[0]["prompt"], rollout_prompt))
        return batch

    monkeypatch.setattr(TargetPOTrainer, "_prepare_inputs", recording)

    def run(out, resume=None, **overrides):
        model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
        args = make_config(out, per_device_train_batch_size=4, num_iterations=2, gradient_accumulation_steps=5,
                           steps_per_generation=1, max_steps=3, **overrides)
        trainer = TargetPOTrainer(model, count_letters_reward, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    run(tmp_path / "a", save_strategy="steps", save_steps=1)
    served.clear()
    resumed = run(tmp_path / "b", resume=str(tmp_path / "a" / "out" / "checkpoint-1"))
    assert resumed.state.global_step == 3
    assert len(served) == 8  # two more epochs of 2 prompts x 2 uses
    assert all(row_prompt == rollout_prompt for row_prompt, rollout_prompt in served), served


def test_checkpoint_sampling_defaults_do_not_leak_into_rollouts(tmp_path, tiny_model, tokenizer, prompt_dataset):
    only_z = [i for i in range(len(tokenizer)) if i != tokenizer.convert_tokens_to_ids("z")]
    tiny_model.generation_config.suppress_tokens = only_z  # a checkpoint setting the config does not ask for
    seen = []

    def reward(completions, **kwargs):
        seen.extend(completions)
        return length_reward(completions)

    trainer = TargetPOTrainer(
        tiny_model, reward, args=make_config(tmp_path, max_steps=1), train_dataset=prompt_dataset,
        processing_class=tokenizer,
    )
    trainer.train()
    assert any(set(text) - {"z"} for text in seen)
    assert tiny_model.generation_config.suppress_tokens == only_z  # restored afterwards


def test_evaluate_checks_a_dataset_passed_late(tmp_path, tiny_model, tokenizer, prompt_dataset):
    trainer = TargetPOTrainer(
        tiny_model, length_reward, args=make_config(tmp_path), train_dataset=prompt_dataset, processing_class=tokenizer
    )
    with pytest.raises(ValueError, match="no 'prompt' column"):
        trainer.evaluate(eval_dataset=Dataset.from_dict({"text": ["a"] * 4}))


def test_resolved_config_can_be_copied(tmp_path):
    import dataclasses

    args = make_config(tmp_path, steps_per_generation=2)
    copy = dataclasses.replace(args, learning_rate=0.5)
    assert copy.generation_batch_size == 16 and copy.steps_per_generation == 2


def test_dropout_is_disabled_everywhere(tmp_path, tokenizer, prompt_dataset):
    from targetpo.demo import build_tiny_causal_lm

    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128)
    model.config.attention_dropout = 0.3
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.3
    TargetPOTrainer(model, length_reward, args=make_config(tmp_path), train_dataset=prompt_dataset, processing_class=tokenizer)
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in model.modules())
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_truncated_completions_are_invalid_when_masked(tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch):
    batches = []
    original = TargetObjective.cross_entropy_to_targets

    def recording(self, per_token_logps, inputs, mask, valid, mode):
        loss = original(self, per_token_logps, inputs, mask, valid, mode)
        batches.append(inputs)
        return loss

    monkeypatch.setattr(TargetObjective, "cross_entropy_to_targets", recording)
    # Only 'a', 'b' and EOS may be sampled, and the script makes "a" end and "b" run on to the 3-token limit: each
    # completion is one or the other about evenly, so 24 of them are all one kind with probability 1e-7.
    script_ended_or_cut(tiny_model, tokenizer, ending="a", running="b")
    allowed = {tokenizer.convert_tokens_to_ids(token) for token in "ab"} | {tokenizer.eos_token_id}
    args = make_config(
        tmp_path, max_completion_length=3, mask_truncated_completions=True, max_steps=3,
        generation_kwargs={"suppress_tokens": [i for i in range(len(tokenizer)) if i not in allowed]},
    )
    trainer = TargetPOTrainer(tiny_model, length_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer)
    trainer.train()
    truncated_seen = ended_seen = False
    for batch in batches:
        has_eos = (batch["completion_ids"] == tokenizer.eos_token_id).any(dim=1)
        assert torch.equal(batch["valid"], has_eos)
        assert torch.equal(batch["completion_mask"].any(dim=1), has_eos)
        assert torch.all(batch["targets"][~has_eos] == 0) and torch.all(batch["advantages"][~has_eos] == 0)
        truncated_seen |= bool((~has_eos).any())
        ended_seen |= bool(has_eos.any())
    assert truncated_seen and ended_seen
    fractions = [e["completions/valid_fraction"] for e in trainer.state.log_history if "completions/valid_fraction" in e]
    assert any(f < 1.0 for f in fractions)


def test_long_prompts_keep_their_last_tokens(tmp_path, tiny_model, tokenizer, prompt_dataset):
    trainer = TargetPOTrainer(
        tiny_model, length_reward, args=make_config(tmp_path, max_prompt_length=3), train_dataset=prompt_dataset,
        processing_class=tokenizer,
    )
    ids, mask = trainer._rollout_context.prompt_encoder.tokenize(["Say cat:", "Hi:"])
    assert ids.shape == (2, 3) and mask.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert tokenizer.decode(ids[0]) == "at:" and tokenizer.decode(ids[1]) == "Hi:"


def test_unscored_samples_are_left_out_of_the_sum(tmp_path, tiny_model, tokenizer, prompt_dataset):
    trainer = TargetPOTrainer(
        tiny_model, [length_reward, count_letters_reward], args=make_config(tmp_path, reward_weights=[2.0, 1.0]),
        train_dataset=prompt_dataset, processing_class=tokenizer,
    )
    nan = float("nan")
    per_func = torch.tensor([[1.0, 3.0], [nan, 3.0], [1.0, nan]])
    assert torch.equal(trainer._rollout_scorer.combine_rewards(per_func), torch.tensor([5.0, 3.0, 2.0]))
    with pytest.warns(UserWarning, match="scored by no reward function"):
        assert trainer._rollout_scorer.combine_rewards(torch.tensor([[nan, nan]])).tolist() == [0.0]


def test_remove_unused_columns_keeps_only_the_prompt(tmp_path, tiny_model, tokenizer, prompt_dataset):
    received = set()

    def reward(completions, **kwargs):
        received.update(kwargs)
        return length_reward(completions)

    args = make_config(tmp_path, remove_unused_columns=True, max_steps=1)
    TargetPOTrainer(tiny_model, reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer).train()
    assert received == {"prompts", "completion_ids", "trainer_state", "log_extra", "log_metric"}  # no "answer" column


def cat_only_reward(prompts, completions, **kwargs):
    """Scores that vary for the 'cat' prompt's completions and are all equal for every other prompt's."""
    return [float(ord(c[0]) % 3) if "cat" in p and c else 1.0 for p, c in zip(prompts, completions)]


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


class _RowCounter:
    """Counts the rows each training forward pass runs, through the trainer's real log-prob function."""

    def __init__(self, monkeypatch):
        self.rows = []
        original = policy_logps_module.completion_logps

        def counting(model, prompt_ids, *args, **kwargs):
            self.rows.append(prompt_ids.size(0))
            return original(model, prompt_ids, *args, **kwargs)

        monkeypatch.setattr(policy_logps_module, "completion_logps", counting)


def _first_rollout(trainer):
    trainer.model.train()
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def _loss_and_gradients(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", ["tpo", "grpo"])
def test_completions_without_gradient_are_left_out_exactly(tmp_path, tiny_model, tokenizer, loss_type, monkeypatch):
    dataset = Dataset.from_dict({"prompt": ["Say cat:", "Say dog:"]})
    args = make_config(tmp_path, loss_type=loss_type)
    trainer = TargetPOTrainer(tiny_model, cat_only_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    batch = _first_rollout(trainer)
    rows = batch["rows_with_gradient_at_rollout"]
    cat = torch.tensor(["cat" in trainer.processing_class.decode(ids) for ids in batch["prompt_ids"]])
    # The 'dog' group has nothing to learn from; GRPO also leaves out a 'cat' completion whose advantage is 0.
    assert torch.equal(rows, cat & (batch["advantages"] != 0) if loss_type == "grpo" else cat)
    assert rows.any() and not rows.all()

    everything = StepBatch.from_mapping(
        {key: value for key, value in batch.items() if not key.startswith("rows_with_gradient")}
    )
    counter = _RowCounter(monkeypatch)
    skipped_loss, skipped_grads = _loss_and_gradients(trainer, batch)
    full_loss, full_grads = _loss_and_gradients(trainer, everything)
    assert counter.rows == [int(rows.sum()), len(rows)]
    assert skipped_grads.keys() == full_grads.keys() and len(full_grads) == len(list(tiny_model.parameters()))
    for name, grad in full_grads.items():
        assert torch.allclose(skipped_grads[name], grad, atol=1e-7), name
    if loss_type == "grpo":
        assert skipped_loss == pytest.approx(full_loss, abs=1e-7)
    else:
        # The 'dog' group's cross-entropy at p = q is the entropy of its q, one of the two groups' average.
        q = everything["targets"][~cat]
        assert full_loss - skipped_loss == pytest.approx(-(q * q.log()).sum().item() / 2, abs=1e-6)
        assert torch.all(batch["targets"][~cat] == 0)  # no q was built for the group left out


def test_a_step_with_nothing_to_train_still_gives_every_parameter_a_zero_gradient(
    tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch
):
    trainer = TargetPOTrainer(
        tiny_model, constant_reward, args=make_config(tmp_path), train_dataset=prompt_dataset, processing_class=tokenizer
    )
    batch = _first_rollout(trainer)
    assert not batch["rows_with_gradient_at_rollout"].any()
    counter = _RowCounter(monkeypatch)
    loss, grads = _loss_and_gradients(trainer, batch)
    # One row still runs, so DDP and ZeRO get their gradients and the optimiser steps as it would on zeros.
    assert counter.rows == [1] and loss == 0
    assert len(grads) == len(list(tiny_model.parameters())) and all(not grad.any() for grad in grads.values())


def test_skipping_trains_like_the_full_computation(tmp_path, tokenizer):
    from targetpo.demo import build_tiny_causal_lm

    dataset = Dataset.from_dict({"prompt": ["Say cat:", "Say dog:"]})
    runs = {}
    for skip in (True, False):
        model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
        # Two uses of each rollout: the first is at the rollout's weights (the 'dog' group is left out), the second
        # is not (it trains). Plain SGD, whose step is linear in the gradient, so equal gradients give equal weights.
        args = make_config(
            tmp_path / str(skip), num_iterations=2, max_steps=4, optim="sgd", learning_rate=0.5,
            skip_zero_gradient_completions=skip,
        )
        trainer = TargetPOTrainer(model, cat_only_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
        before = snapshot(model)
        trainer.train()
        runs[skip] = (trainer, before)
    (skipping, before), (full, _) = runs[True], runs[False]
    assert changed(before, skipping.model)
    for (name, a), b in zip(skipping.model.named_parameters(), full.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name
    skipped = [e["completions/skipped_fraction"] for e in skipping.state.log_history if "completions/skipped_fraction" in e]
    assert skipped[0] >= 0.5 and skipped[1] == 0  # at the rollout's weights, then after a step
    assert "completions/skipped_fraction" not in metric_names(full)


def test_with_dropout_equal_score_groups_are_never_skipped(tmp_path, tiny_model, tokenizer):
    # Dropout makes two passes over the same weights differ, so p = q = p_old does not hold even at the rollout's
    # weights; only the rows without a gradient under any weights are left out.
    dataset = Dataset.from_dict({"prompt": ["Say cat:", "Say dog:"]})
    args = make_config(tmp_path, disable_dropout=False)
    trainer = TargetPOTrainer(tiny_model, cat_only_reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    batch = _first_rollout(trainer)
    assert batch["rows_with_gradient_at_rollout"].all()
    assert torch.equal(batch["rows_with_gradient_at_rollout"], batch["rows_with_gradient"])


@pytest.mark.parametrize("beta", [0.0, 0.1], ids=["no_reference", "reference"])
def test_bf16_weights_train_under_bf16_mixed_precision(tmp_path, tiny_model, tokenizer, prompt_dataset, beta):
    # Mixed precision hands back the model's outputs, hidden states too, in float32; the chunked bf16 head runs on them.
    model = tiny_model.to(torch.bfloat16)
    args = make_config(tmp_path, bf16=True, beta=beta, num_iterations=2, use_cpu=not torch.cuda.is_available())
    trainer = TargetPOTrainer(
        model, letters_then_position_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    before = snapshot(model)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert changed(before, model)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_under_bf16_mixed_precision_the_chunked_head_computes_as_the_models_own_head(
    tmp_path, tiny_model, tokenizer, prompt_dataset, padding_free
):
    # Float32 master weights under bf16=True: the model's forward, its output head included, runs under autocast. The
    # chunked head runs outside that forward, and computes in bf16 all the same: logps_chunk_size changes memory, not
    # precision.
    args = make_config(tmp_path, bf16=True, padding_free=padding_free, use_cpu=not torch.cuda.is_available())
    trainer = TargetPOTrainer(
        tiny_model, letters_then_position_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    assert trainer.accelerator.mixed_precision == "bf16" and trainer._step.logps.chunk_size == 512
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    rows = [batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_attention_mask")]
    settings = {"temperature": args.temperature, "suppressed_token_ids": trainer._step.logps.suppressed_token_ids}
    whole_logits = packed_completion_logps if padding_free else completion_logps
    with torch.no_grad():
        logps, _ = trainer._token_logps(trainer.model, batch)
        with trainer.accelerator.autocast():  # as accelerate wraps the forward of the model it prepares
            expected, _ = whole_logits(tiny_model, *rows, chunk_size=None, **settings)
        in_float32, _ = whole_logits(tiny_model, *rows, chunk_size=None, **settings)
    mask = batch["completion_attention_mask"].bool()
    torch.testing.assert_close(logps[mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert (in_float32[mask] - expected[mask]).abs().max() > 1e-3  # a float32 head is far off


# ------------------------------------------------------------------------------------------------ inputs refused early
def test_a_one_shot_iterator_is_refused_before_any_row_is_read(tmp_path, tiny_model, tokenizer):
    """A generator can be read once: the checks would consume its first rows and the next epoch would be empty."""
    rows = ({"prompt": f"Say {word}:"} for word in ("cat", "dog", "sun", "map"))
    for split in ("train", "eval"):
        datasets_ = {"train_dataset": rows} if split == "train" else {"train_dataset": Dataset.from_dict(
            {"prompt": ["Say cat:"] * 2}), "eval_dataset": rows}
        with pytest.raises(ValueError, match=rf"The {split} dataset is a one-shot iterator \(generator\): .* "
                                             r"`datasets.IterableDataset.from_generator\(make_rows\)`"):
            TargetPOTrainer(tiny_model, length_reward, args=make_config(tmp_path, max_steps=1), **datasets_,
                            processing_class=tokenizer)
    trainer = TargetPOTrainer(tiny_model, length_reward, args=make_config(tmp_path, max_steps=1),
                              train_dataset=Dataset.from_dict({"prompt": ["Say cat:"] * 2}), processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"The eval dataset is a one-shot iterator \(map\)"):
        trainer.evaluate(eval_dataset=map(lambda word: {"prompt": word}, ["a", "b"]))
    assert next(rows) == {"prompt": "Say cat:"}  # nothing was read from it


#: Renders a message's content parts as their texts, one after the other (as multimodal chat templates do).
CONTENT_PARTS_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_an_assistant_prefill_in_content_parts_is_continued_like_a_string_one(tmp_path, tokenizer):
    """TRL's multimodal message format for the prefill: the completion joins the prefill's text, as for a string."""
    tokenizer.chat_template = CONTENT_PARTS_TEMPLATE
    def message(role, *texts, parts):  # an Arrow column holds one content format: all strings or all parts
        return {"role": role, "content": [{"type": "text", "text": t} for t in texts] if parts else "".join(texts)}

    received = {}
    for kind in ("string", "parts"):
        dataset = Dataset.from_dict({"prompt": [
            [message("user", f"Say {word}", parts=kind == "parts"),
             message("assistant", "The word", " is", parts=kind == "parts")]
            for word in ("cat", "dog")
        ]})
        calls = received[kind] = []

        def reward(prompts, completions, completion_ids, calls=calls, **kwargs):
            calls.append((completions, completion_ids))
            return [float(len(completion[0]["content"])) for completion in completions]

        model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
        trainer = TargetPOTrainer(model, reward, args=make_config(tmp_path / kind, max_steps=1), train_dataset=dataset,
                                  processing_class=tokenizer)
        assert trainer._rollout_context.prompt_encoder.render([dataset[0]["prompt"]]) == ["<user>Say cat\n<assistant>The word is"]
        trainer.train()
        assert trainer.state.global_step == 1
    for completions, completion_ids in received["parts"]:
        assert len(completions) == 8
        for completion, ids in zip(completions, completion_ids):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            assert completion == [{"role": "assistant", "content": "The word is" + text}]
    assert received["parts"] == received["string"]  # same seed, same rendered prompts: the same completions


def needs_solution(completions, solution, **kwargs):
    return [float(completion == answer) for completion, answer in zip(completions, solution)]


def test_a_reward_function_needing_a_missing_column_is_refused_at_construction(tmp_path, tiny_model, tokenizer,
                                                                              prompt_dataset):
    import functools
    import re

    def build(reward, train=prompt_dataset, **kwargs):
        args = make_config(tmp_path, max_steps=1, **kwargs.pop("config", {}))
        return TargetPOTrainer(tiny_model, [length_reward, reward], args=args, train_dataset=train,
                               processing_class=tokenizer, **kwargs)

    with pytest.raises(ValueError, match=re.escape(
        "Reward function 'needs_solution' needs the argument(s) ['solution'], which the train dataset (its columns: "
        "['answer', 'prompt']) does not give."
    )):
        build(needs_solution)
    with_solution = prompt_dataset.rename_column("answer", "solution")
    with pytest.raises(ValueError, match=re.escape("which the eval dataset (its columns: ['answer', 'prompt'])")):
        build(needs_solution, train=with_solution, eval_dataset=prompt_dataset)
    with pytest.raises(ValueError, match=re.escape("with remove_unused_columns=True, which keeps only the prompt")):
        build(needs_solution, train=with_solution, config=dict(remove_unused_columns=True))
    with pytest.raises(ValueError, match=re.escape("['solution'], which the train dataset")):  # a stream too
        build(needs_solution, train=prompt_dataset.to_iterable_dataset())
    # Given by the dataset, bound beforehand, or with a default: accepted, and trained on.
    build(needs_solution, train=with_solution).train()
    build(functools.partial(needs_solution, solution=["cat"] * 8))
    build(lambda completions, solution=None, **kwargs: [0.0] * len(completions))


def test_an_output_dir_that_is_a_file_is_refused_naming_output_dir(tmp_path):
    existing = tmp_path / "results.txt"
    existing.write_text("not a directory")
    for output_dir in (existing, existing / "run1"):
        with pytest.raises(ValueError, match=rf"output_dir='{output_dir}' cannot be a directory: '{existing}' is an "
                                             "existing file"):
            make_config(tmp_path, output_dir=str(output_dir))
    assert make_config(tmp_path, output_dir=str(tmp_path / "new" / "run")).output_dir == str(tmp_path / "new" / "run")
