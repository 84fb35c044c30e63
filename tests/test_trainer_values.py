"""Every optimiser step of the trainer, checked by value against a hand-built reference.

The runs use plain SGD (no momentum, no weight decay, no gradient clipping, a constant learning rate), so one
optimiser step moves the weights by exactly ``-lr`` times the gradient. The reference gradient is built in
``reference.py`` without the library: token log-probs from the model's full logits, the group z-score, ``q`` from
the weights each rollout was made with, and the loss over exactly the rows each micro-step of the step held, divided
by the gradient-accumulation steps. Which rows a micro-step holds is derived here from the documented schedule (a
rollout serves its step batches in turn, ``num_iterations`` times over), never read from what the trainer used.
"""

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
import reference as ref
import torch
from conftest import make_config
from datasets import Dataset
from scripted_policies import script_ended_or_cut

from targetpo import TargetPOTrainer
from targetpo.demo import build_tiny_causal_lm
from targetpo.generation import Completions, RolloutBackend

PROMPTS = ["Say cat:", "Say dog:", "Say sun:", "Say map:", "Say pen:", "Say cup:", "Say box:", "Say hat:"]
ROLLOUT_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_attention_mask", "completion_mask")


def letter_score(completions, **kwargs):
    """A dense reward: almost every group's completions score differently."""
    return [float(sum(ord(character) % 5 for character in text)) for text in completions]


def distinct_letter_score(completions, **kwargs):
    """letter_score plus the row's position over the batch size: integers apart by less than 1, so the scores differ
    within every group whatever was sampled."""
    return [score + index / len(completions) for index, score in enumerate(letter_score(completions))]


def two_at_the_group_mean(completions, **kwargs):
    """0, 1, 1, 2 by place in each group of 4: two members of every group at its mean (u = 0)."""
    return [float((0, 1, 1, 2)[index % 4]) for index in range(len(completions))]


def ended_or_cut_model(tokenizer):
    """The tiny model scripted so that each completion of few_letters' sampling is "a", "c" or "e" then EOS (valid),
    or runs on "b"s to the length limit (cut off, invalid when truncated completions are masked): about 3 in 4 end.
    Which comes is still sampled, so a group of 4 has 2 or more valid members with probability 0.95 and a step of
    4 groups trains with probability 1 - 7e-6; 32 completions are all valid with probability 1e-4."""
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    return script_ended_or_cut(model, tokenizer, ending="ace", running="b")


@dataclass
class RecordedRun:
    """What a training run did, recorded from the outside: rollouts, their rewards and the weights over time."""

    rollouts: list = field(default_factory=list)  # (copy of the model when the rollout was made, its tensors)
    rewards: list = field(default_factory=list)  # what the reward function returned, call by call
    step_weights: dict = field(default_factory=dict)  # global step -> copy of the model at its start
    trainer: TargetPOTrainer | None = None


def train_and_record(
    tmp_path, tokenizer, monkeypatch, model=None, peft_config=None, dataset=None, rollout_backend=None, score=None,
    trainer_kwargs=None, **overrides
):
    run = RecordedRun()
    original_rollout = TargetPOTrainer._rollout
    original_loss = TargetPOTrainer.compute_loss

    # Everything is recorded on the CPU, where the reference is built: on a GPU this checks the GPU's steps.
    def recording_rollout(self, rows, mode):
        weights = copy.deepcopy(self.accelerator.unwrap_model(self.model)).cpu()
        batch = original_rollout(self, rows, mode)
        if mode == "train":
            run.rollouts.append((weights, {key: batch[key].clone().cpu() for key in ROLLOUT_TENSORS}))
        return batch

    def recording_loss(self, model, inputs, *args, **kwargs):
        if model.training and self.state.global_step not in run.step_weights:
            run.step_weights[self.state.global_step] = copy.deepcopy(self.accelerator.unwrap_model(model)).cpu()
        return original_loss(self, model, inputs, *args, **kwargs)

    def recording_reward(completions, **kwargs):
        scores = (score or letter_score)(completions)
        run.rewards.append(scores)
        return scores

    monkeypatch.setattr(TargetPOTrainer, "_rollout", recording_rollout)
    monkeypatch.setattr(TargetPOTrainer, "compute_loss", recording_loss)
    if model is None:
        model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    settings = dict(
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, learning_rate=0.2, logging_steps=1,
        max_completion_length=5,
    )
    settings.update(overrides)
    trainer = TargetPOTrainer(
        model, recording_reward, args=make_config(tmp_path, **settings),
        train_dataset=dataset or Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
        peft_config=peft_config, **(trainer_kwargs or {}),
    )
    run.trainer = trainer
    if rollout_backend is not None:
        trainer.rollout_backend = rollout_backend(trainer)
    trainer.train()
    run.step_weights[trainer.state.global_step] = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model)).cpu()
    return run


def suppressed_ids(args):
    return tuple((args.generation_kwargs or {}).get("suppress_tokens", ()))


def sampling_temperature(args):
    """The documented rule: generation_kwargs' temperature, when given, with the field at its default."""
    return (args.generation_kwargs or {}).get("temperature", args.temperature)


def micro_steps(run):
    """(optimiser step, rollout index, rows, whether the weights are still the rollout's) of every micro-step, from
    the documented schedule."""
    args = run.trainer.args
    uses_per_rollout = args.steps_per_generation * args.num_iterations
    rows_per_step = args.per_device_train_batch_size
    schedule = []
    for index in range(run.trainer.state.global_step * args.gradient_accumulation_steps):
        rollout, use = divmod(index, uses_per_rollout)
        step = index // args.gradient_accumulation_steps
        made_at = rollout * uses_per_rollout // args.gradient_accumulation_steps
        start = (use % args.steps_per_generation) * rows_per_step
        schedule.append((step, rollout, slice(start, start + rows_per_step), step == made_at))
    return schedule


def trained_groups(u, valid, num_generations, at_rollout_weights):
    """The groups a step trains (the rest have no gradient): two or more valid members and, while the weights are
    still the rollout's (so p = p_old = q for equal scores), scores that differ."""
    groups = []
    for start in range(0, len(u), num_generations):
        members = range(start, start + num_generations)
        live = sum(bool(valid[i]) for i in members) >= 2
        if at_rollout_weights:
            live = live and any(u[i] != 0 for i in members if valid[i])
        groups.append(live)
    return groups


def reference_step(run, step, reference_model=None):
    """The loss, gradient (by parameter name) and metrics of optimiser step ``step``, built by hand."""
    args = run.trainer.args
    loss_type = args.loss_type
    K = args.num_generations
    model = copy.deepcopy(run.step_weights[step]).train()
    model.zero_grad()
    total, entropies, kls, losses, clipped, built_targets = 0, [], [], [], [], []
    for _, rollout, rows, at_rollout_weights in [entry for entry in micro_steps(run) if entry[0] == step]:
        rollout_model, tensors = run.rollouts[rollout]
        batch = {key: value[rows] for key, value in tensors.items()}
        inputs = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_attention_mask"])
        mask = batch["completion_mask"].float()
        valid = mask.any(dim=1)
        u = ref.whitened(run.rewards[rollout], tensors["completion_mask"].any(dim=1), K)[rows]
        # Rows without gradient are left out unless a term other than the policy loss trains on them too.
        skips = args.beta == 0 and not args.entropy_coef and args.top_entropy_quantile == 1
        if loss_type == "tpo":
            trained = trained_groups(u, valid, K, at_rollout_weights) if skips else [True] * (len(u) // K)
            trained_rows = torch.tensor(trained).repeat_interleave(K) & valid
        else:  # each row on its own: a policy-gradient row without advantage has no gradient
            trained_rows = valid & (u != 0) if skips else valid
        logps, entropy = ref.token_logps(model, *inputs, sampling_temperature(args), suppressed_ids(args))
        with torch.no_grad():
            old, _ = ref.token_logps(rollout_model, *inputs, sampling_temperature(args), suppressed_ids(args))
        # The tokens the policy loss trains on: the top entropy quantile of the micro-step's tokens, and not the
        # completions with a negative advantage that are too far off-policy (mean KL from the rollout's policy).
        kept = mask.clone()
        if args.top_entropy_quantile < 1:
            cut = torch.quantile(entropy.detach()[mask.bool()], 1 - args.top_entropy_quantile)
            kept = kept * (entropy.detach() >= cut)
        if args.off_policy_mask_threshold is not None:
            for i in range(len(u)):
                on = mask[i].bool()
                if on.any() and u[i] < 0 and (old[i][on] - logps.detach()[i][on]).mean() > args.off_policy_mask_threshold:
                    kept[i] = 0
        if loss_type == "tpo":
            normalize = args.tpo_length_normalize_logps
            q = ref.targets(ref.sequence_logps(old, mask, normalize), u, valid, K, args.tpo_target_temperature)
            built_targets.append((q, trained))
            # Left-out tokens keep their values (so p and q) but get no gradient.
            logps_for_loss = logps.detach() + kept * (logps - logps.detach())
            sequence = ref.sequence_logps(logps_for_loss, mask, normalize)
            loss = ref.tpo_loss(sequence, q, valid, K)
            # The logged loss leaves out the skipped groups' constant cross-entropy (0 gradient either way).
            logged_loss = ref.tpo_loss(sequence, q, valid, K, counted_groups=trained).item()
        token_count = tensors["completion_mask"].sum().item() / args.steps_per_generation
        if loss_type != "tpo":
            # dapo, cispo, vespo: each token weighs 1 / (the rollout's tokens / steps_per_generation), the documented
            # tokens of one optimiser step's accumulated batch; the micro-step's loss is then divided by the
            # accumulation steps like every other loss.
            loss = ref.policy_gradient_loss(args, logps, old, u, mask, token_count, kept)
            if loss_type == "grpo" and args.importance_sampling_level == "token":
                clipped.append(ref.grpo_loss(logps, old, u, mask, args.epsilon)[1].item())
            logged_loss = loss.item()
        if args.beta > 0:
            with torch.no_grad():
                reference_logps, _ = ref.token_logps(reference_model, *inputs, sampling_temperature(args), suppressed_ids(args))
            ratio = torch.exp(logps - old) if args.use_bias_correction_kl else None
            kl = ref.kl(logps, reference_logps, mask, ratio)
            loss = loss + args.beta * kl
            kls.append(kl.item())
            logged_loss += args.beta * kl.item()
        if args.entropy_coef:
            token_normalized = loss_type in ("dapo", "cispo", "vespo")
            bonus = args.entropy_coef * (entropy * kept).sum() / (token_count if token_normalized else kept.sum())
            loss = loss - bonus
            logged_loss -= bonus.item()
        total = total + loss / args.gradient_accumulation_steps
        losses.append(logged_loss)
        trained_mask = mask * trained_rows.unsqueeze(-1)
        if trained_mask.any():
            entropies.append(((entropy * trained_mask).sum() / trained_mask.sum()).item())
    total.backward()
    gradients = {name: param.grad for name, param in model.named_parameters() if param.grad is not None}
    return {
        "loss": losses, "gradients": gradients, "entropy": entropies, "kl": kls, "clipped": clipped,
        "targets": built_targets,
    }


def weight_change(run, step):
    before = dict(run.step_weights[step].named_parameters())
    return {name: param.detach() - before[name].detach() for name, param in run.step_weights[step + 1].named_parameters()}


def assert_step_matches(run, step, expected):
    lr = run.trainer.args.learning_rate
    change = weight_change(run, step)
    assert set(expected["gradients"]) == {name for name, param in run.step_weights[step].named_parameters() if param.requires_grad}
    largest = max(gradient.abs().max().item() for gradient in expected["gradients"].values())
    assert largest * lr > 1e-3, "the reference step must move the weights measurably"
    for name, gradient in expected["gradients"].items():
        torch.testing.assert_close(change[name], -lr * gradient, atol=2e-6, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def logged(run, step, name):
    return next(entry[name] for entry in run.trainer.state.log_history if entry.get("step") == step + 1 and name in entry)


#: Sampling that allows only a few letters and EOS: completions of varied lengths, and suppressed tokens whose
#: probability must be left out of the trainer's log-probs.
def few_letters(tokenizer):
    allowed = {tokenizer.convert_tokens_to_ids(c) for c in "abce"} | {tokenizer.eos_token_id}
    return {"suppress_tokens": [i for i in range(len(tokenizer)) if i not in allowed]}


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(temperature=0.7, tpo_target_temperature=0.5, tpo_length_normalize_logps=False),
        # The full-logits path rather than the chunked head.
        dict(temperature=1.3, logps_chunk_size=0),
        # Two micro-steps of one rollout in one optimiser step: the loss is divided by the accumulation steps and
        # each micro-step gets its own step batch.
        dict(steps_per_generation=2, gradient_accumulation_steps=2, tpo_target_temperature=2.0),
        # One rollout serves two optimiser steps: the second fits q built from the rollout's weights.
        dict(steps_per_generation=2, max_steps=4),
        # Two epochs over each rollout: q stays the one built from the rollout's weights.
        dict(num_iterations=2, max_steps=4, tpo_length_normalize_logps=False),
        # Two rollouts in one optimiser step, with invalid (truncated) members.
        dict(gradient_accumulation_steps=2, steps_per_generation=1, mask_truncated_completions=True,
             max_completion_length=3),
    ],
    ids=["default", "temperatures-and-sums", "full-logits-path", "accumulated-step-batches", "rollout-serves-two-steps",
         "two-epochs", "two-rollouts-with-invalid-members"],
)
def test_each_sgd_step_is_minus_lr_times_the_hand_built_tpo_gradient(tmp_path, tokenizer, monkeypatch, settings):
    settings = {"max_steps": 2, "generation_kwargs": few_letters(tokenizer), **settings}
    if settings.get("mask_truncated_completions"):
        # Forced: both valid and invalid members, and scores that differ, so every step trains.
        settings |= dict(model=ended_or_cut_model(tokenizer), score=distinct_letter_score)
    run = train_and_record(tmp_path, tokenizer, monkeypatch, **settings)
    for step in range(run.trainer.state.global_step):
        expected = reference_step(run, step)
        assert_step_matches(run, step, expected)
        assert logged(run, step, "entropy") == pytest.approx(sum(expected["entropy"]) / len(expected["entropy"]), rel=1e-5)
        assert logged(run, step, "loss") == pytest.approx(sum(expected["loss"]) / len(expected["loss"]), rel=1e-4)
    if settings.get("mask_truncated_completions"):
        # Rollouts may be padded to different lengths: each row's validity first.
        valid = torch.cat([tensors["completion_mask"].any(1) for _, tensors in run.rollouts])
        assert not valid.all(), "the run must have invalid members to test"


@pytest.mark.parametrize("loss_type", ["tpo", "grpo"])
def test_a_generation_kwargs_temperature_is_the_one_rollouts_and_every_log_prob_use(
    tmp_path, tokenizer, monkeypatch, loss_type
):
    """generation_kwargs={"temperature": 0.5} with the field at its default: rollouts sample at 0.5, and the token
    log-probs, p_old, q, the ratios (a second epoch) and so every gradient are those at 0.5, built by hand."""
    generation_kwargs = {**few_letters(tokenizer), "temperature": 0.5}
    run = train_and_record(
        tmp_path, tokenizer, monkeypatch, loss_type=loss_type, max_steps=2, num_iterations=2, learning_rate=2.0,
        generation_kwargs=generation_kwargs,
    )
    trainer = run.trainer
    assert trainer.args.temperature == 1.0 and trainer.sampling.temperature == 0.5
    assert trainer.rollout_backend.generation_config.temperature == 0.5  # what model.generate samples with
    for step in range(trainer.state.global_step):
        assert_step_matches(run, step, reference_step(run, step))
    # The check can tell the temperatures apart: at 1.0 the same rollout's log-probs differ.
    model, tensors = run.rollouts[0]
    inputs = [tensors[key] for key in ROLLOUT_TENSORS[:4]]
    with torch.no_grad():
        at_half, _ = ref.token_logps(model, *inputs, 0.5, suppressed_ids(trainer.args))
        at_one, _ = ref.token_logps(model, *inputs, 1.0, suppressed_ids(trainer.args))
        trainer_logps, _ = trainer._token_logps(model, {key: tensors[key] for key in ROLLOUT_TENSORS[:4]})
    mask = tensors["completion_mask"].bool()
    torch.testing.assert_close(trainer_logps[mask], at_half[mask], atol=1e-5, rtol=1e-5)
    assert (at_half - at_one)[mask].abs().max() > 0.05


@pytest.mark.parametrize(
    "reshaping, masks_negative_rows",
    [({}, True), ({"top_k": 3}, False), ({"no_repeat_ngram_size": 2}, False)],
    ids=["tempered", "top_k", "no_repeat_ngram_size"],
)
def test_the_off_policy_mask_measures_from_vllms_log_probs_only_where_they_describe_the_trainers_distribution(
    tmp_path, tokenizer, reshaping, masks_negative_rows
):
    """Under top-k (or any reshaping, here given through generation_kwargs) vLLM reports each sampled token's log-prob
    in the reshaped distribution: above the trainer's by the log of the mass cut away. The mask then measures how far
    the policy moved from the trainer's own rollout-time log-probs, as the importance weights are switched off: an
    on-policy completion is kept whatever its advantage. The engine's log-probs are set by hand, as such an engine
    reports them (the real engine is in test_vllm.py)."""
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    args = make_config(tmp_path, off_policy_mask_threshold=0.1, generation_kwargs={**few_letters(tokenizer), **reshaping})
    trainer = TargetPOTrainer(
        model, letter_score, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer
    )
    assert trainer.sampling.reshapes_distribution == bool(reshaping)
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert "old_per_token_logps" not in batch  # one step per rollout: the policy is the rollout's
    mask = batch["completion_mask"].float()
    logps, entropies = trainer._token_logps(trainer.model, batch)
    batch = batch.replaced(sampler_per_token_logps=(logps.detach() + 0.5) * mask)  # a kept mass of exp(-0.5) per token
    keep = trainer._step.loss.token_filter(logps, entropies, batch, mask)
    negative = batch["advantages"] < 0
    assert negative.any() and (~negative).any()
    expected = (~negative | (mask.sum(1) == 0)).float() if masks_negative_rows else torch.ones(len(negative))
    torch.testing.assert_close(keep.squeeze(1), expected)


@pytest.mark.parametrize(
    "settings",
    [
        dict(entropy_coef=0.3),
        dict(entropy_coef=0.3, loss_type="dapo", steps_per_generation=2, gradient_accumulation_steps=2),
        dict(top_entropy_quantile=0.4, num_iterations=2),
        dict(top_entropy_quantile=0.4, loss_type="grpo", num_iterations=2, entropy_coef=0.1),
        dict(off_policy_mask_threshold=0.02, num_iterations=2, learning_rate=2.0),
        dict(off_policy_mask_threshold=0.02, loss_type="dapo", num_iterations=2, learning_rate=2.0),
        dict(beta=0.5, use_bias_correction_kl=True, num_iterations=2),
        dict(beta=0.5, use_bias_correction_kl=True, loss_type="grpo", num_iterations=2),
    ],
    ids=["entropy-bonus-tpo", "entropy-bonus-dapo", "entropy-quantile-tpo", "entropy-quantile-and-bonus-grpo",
         "off-policy-mask-tpo", "off-policy-mask-dapo", "bias-corrected-kl-tpo", "bias-corrected-kl-grpo"],
)
def test_regularisers_and_filters_match_the_hand_built_gradient(tmp_path, tokenizer, monkeypatch, settings):
    settings = {"max_steps": 2, "generation_kwargs": few_letters(tokenizer), **settings}
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    initial = copy.deepcopy(model)
    run = train_and_record(tmp_path, tokenizer, monkeypatch, model=model, **settings)
    for step in range(run.trainer.state.global_step):
        expected = reference_step(run, step, reference_model=initial)
        assert_step_matches(run, step, expected)
        expected_loss = sum(expected["loss"]) / len(expected["loss"])
        assert logged(run, step, "loss") == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("target, applied", [(100.0, [0.0, 0.15, 0.2]), (0.0, [0.0, 0.0, 0.0])])
def test_adaptive_entropy_coefficient_follows_each_steps_entropy(tmp_path, tokenizer, monkeypatch, target, applied):
    """Entropy at or below the target raises the coefficient by entropy_coef_delta after each optimiser step (and the
    bonus acts from the next step on); above it, the coefficient falls (to entropy_coef_min) and the bonus is off."""
    run = train_and_record(
        tmp_path, tokenizer, monkeypatch, max_steps=3, use_adaptive_entropy=True, entropy_coef=0.1,
        entropy_coef_delta=0.05, entropy_target=target, generation_kwargs=few_letters(tokenizer),
    )
    assert [logged(run, step, "entropy_coef") for step in range(3)] == pytest.approx(applied)
    assert run.trainer._step.loss.entropy_bonus.coefficient == pytest.approx(0.25 if target > 1 else 0.0)
    # The first step has no previous entropy to compare: no bonus, the plain TPO gradient.
    run.trainer.args.entropy_coef = 0.0  # what the reference then builds
    assert_step_matches(run, 0, reference_step(run, 0))


class ToolWrittenTokens(RolloutBackend):
    """The default backend's completions, as if a tool had written some of their tokens: the 2nd and 3rd token of
    every completion, and the whole of every completion that starts with "a", are in the attention mask but not in
    the loss mask."""

    def __init__(self, inner, tokenizer):
        self.inner, self.first_letter = inner, tokenizer.convert_tokens_to_ids("a")

    def generate(self, prompt_ids, prompt_mask):
        made = self.inner.generate(prompt_ids, prompt_mask)
        return Completions(made.ids, made.attention_mask, made.truncated, loss_mask=tool_free(made, self.first_letter))


def tool_free(completions, first_letter):
    loss_mask = completions.attention_mask.clone()
    loss_mask[:, 1:3] = 0
    loss_mask[completions.ids[:, 0] == first_letter] = 0
    return loss_mask


def test_tokens_out_of_the_loss_mask_get_no_gradient_and_fully_masked_completions_are_invalid(
    tmp_path, tokenizer, monkeypatch
):
    letter_a = tokenizer.convert_tokens_to_ids("a")
    run = train_and_record(
        tmp_path, tokenizer, monkeypatch, max_steps=2, beta=0.3, generation_kwargs=few_letters(tokenizer),
        rollout_backend=lambda trainer: ToolWrittenTokens(trainer.rollout_backend, tokenizer),
        model=build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0),
    )
    for _, tensors in run.rollouts:
        # The rollout's training mask is the backend's loss mask, worked out here from the completions alone.
        made = Completions(tensors["completion_ids"], tensors["completion_attention_mask"], torch.zeros(0))
        assert torch.equal(tensors["completion_mask"], tool_free(made, letter_a))
    valid = torch.cat([tensors["completion_mask"].any(1) for _, tensors in run.rollouts])  # lengths may differ
    assert not valid.all(), "some completions must be wholly tool-written (invalid) to test"
    initial = run.step_weights[0]
    for step in range(2):
        assert_step_matches(run, step, reference_step(run, step, reference_model=initial))


def test_kl_term_trains_towards_the_frozen_reference(tmp_path, tokenizer, monkeypatch):
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    initial = copy.deepcopy(model)
    run = train_and_record(
        tmp_path, tokenizer, monkeypatch, model=model, beta=0.5, max_steps=3, generation_kwargs=few_letters(tokenizer)
    )
    for step in range(3):
        expected = reference_step(run, step, reference_model=initial)
        assert_step_matches(run, step, expected)
        assert logged(run, step, "kl") == pytest.approx(expected["kl"][0], rel=1e-4, abs=1e-9)
    assert logged(run, 2, "kl") > 1e-4  # by the last step the policy has left the reference


def test_peft_reference_is_the_adapter_free_base_and_kl_trains_the_adapters(tmp_path, tokenizer, monkeypatch):
    from peft import LoraConfig

    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    base = copy.deepcopy(model)
    # Random adapters (not the usual B = 0), so the policy differs from its base from the first step.
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    run = train_and_record(
        tmp_path, tokenizer, monkeypatch, model=model, peft_config=lora, beta=2.0, max_steps=2,
        generation_kwargs=few_letters(tokenizer),
    )
    for step in range(2):
        expected = reference_step(run, step, reference_model=base)
        assert_step_matches(run, step, expected)
        assert all("lora_" in name for name in expected["gradients"])
        assert logged(run, step, "kl") == pytest.approx(expected["kl"][0], rel=1e-4)
    assert logged(run, 0, "kl") > 1e-3  # the adapters already move the policy off the base at step 1


def test_grpo_steps_use_the_rollout_log_probs_and_clip(tmp_path, tokenizer, monkeypatch):
    run = train_and_record(
        tmp_path, tokenizer, monkeypatch, loss_type="grpo", num_iterations=2, max_steps=2, learning_rate=2.0,
        epsilon=0.05, generation_kwargs=few_letters(tokenizer),
    )  # at 2 half the second step's tokens clip; at 20 nearly all can, leaving it no gradient to compare
    first, second = reference_step(run, 0), reference_step(run, 1)
    assert first["clipped"] == [0.0]  # at the rollout's weights every ratio is 1
    assert second["clipped"][0] > 0.05, "the second epoch must clip some tokens for this test to mean anything"
    assert_step_matches(run, 0, first)
    assert_step_matches(run, 1, second)


@pytest.mark.parametrize(
    "settings",
    [
        # One optimiser step (2 accumulated micro-steps) spans each rollout: dapo's tokens are exactly its tokens.
        dict(loss_type="dapo", steps_per_generation=2, gradient_accumulation_steps=2, num_iterations=2, max_steps=2),
        # A rollout serves two optimiser steps: each divides by half the rollout's tokens.
        dict(loss_type="dapo", steps_per_generation=2, num_iterations=2, max_steps=4),
        # Members at their group's mean (u = 0) are left out, whatever was sampled, and bnpo still counts their tokens.
        dict(loss_type="bnpo", num_iterations=2, epsilon_high=0.1, score=two_at_the_group_mean),
        dict(loss_type="dr_grpo", num_iterations=2, delta=1.06),  # two-sided clipping
        dict(loss_type="cispo", num_iterations=2, epsilon_high=1.02),
        dict(loss_type="sapo", num_iterations=2, sapo_temperature_neg=2.0),
        # A smaller step for these two: at 5 the second epoch can be so far off-policy that every completion is
        # clipped (luspo) or weighted to nothing (vespo), leaving no gradient to compare.
        dict(loss_type="luspo", num_iterations=2, importance_sampling_level="sequence", learning_rate=1.0),
        dict(loss_type="vespo", num_iterations=2, learning_rate=1.0),
        dict(loss_type="grpo", num_iterations=2, importance_sampling_level="sequence"),  # GSPO
        # Micro-batches of 2 rows, groups of 4 spread over optimiser steps: the advantages are fixed at rollout, so the
        # GRPO family needs whole groups per rollout only.
        dict(loss_type="grpo", per_device_train_batch_size=2, steps_per_generation=4, gradient_accumulation_steps=2,
             num_iterations=2, max_steps=4, score=distinct_letter_score, learning_rate=1.0),
    ],
    ids=["dapo-step-spans-rollout", "dapo-rollout-spans-steps", "bnpo", "dr_grpo-two-sided", "cispo", "sapo", "luspo", "vespo",
         "gspo", "grpo-groups-over-optimiser-steps"],
)
def test_each_grpo_family_step_is_minus_lr_times_the_hand_built_gradient(tmp_path, tokenizer, monkeypatch, settings):
    """Every loss on real rollouts, off-policy from the second epoch on, against ``reference.policy_gradient_loss``;
    rows the trainer leaves out (u = 0) must change nothing."""
    settings = {"learning_rate": 5.0, "epsilon": 0.05, "generation_kwargs": few_letters(tokenizer), **settings}
    run = train_and_record(tmp_path, tokenizer, monkeypatch, **settings)
    if settings["loss_type"] == "bnpo":
        assert any(logged(run, step, "completions/skipped_fraction") > 0 for step in range(2)), "rows must be left out"
    for step in range(run.trainer.state.global_step):
        expected = reference_step(run, step)
        assert_step_matches(run, step, expected)
        expected_loss = sum(expected["loss"]) / len(expected["loss"])
        assert logged(run, step, "loss") == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    # The later steps are off-policy enough for the clipping to bite (where the loss clips).
    clip_metric = {"cispo": "cispo_clip_ratio", "sapo": None, "vespo": None}.get(settings["loss_type"], "clip_ratio/region_mean")
    if clip_metric is not None:
        assert max(logged(run, step, clip_metric) for step in range(1, run.trainer.state.global_step)) > 0.05


def test_logged_metrics_match_their_definitions(tmp_path, tokenizer, monkeypatch):
    """Each rollout and target metric of a real run, recomputed from what the run sampled and scored."""
    # Forced: every step has valid and (with high probability) invalid members, and groups that train (4 a step).
    run = train_and_record(
        tmp_path, tokenizer, monkeypatch, model=ended_or_cut_model(tokenizer), score=distinct_letter_score,
        max_steps=3, per_device_train_batch_size=16, mask_truncated_completions=True, max_completion_length=3,
        generation_kwargs=few_letters(tokenizer),
    )
    K = run.trainer.args.num_generations
    eos = tokenizer.eos_token_id
    saw_invalid = False
    for step, ((_, tensors), rewards) in enumerate(zip(run.rollouts, run.rewards)):
        lengths = tensors["completion_attention_mask"].sum(dim=1).float()
        ended = (tensors["completion_ids"] == eos).any(dim=1)
        valid = ended  # truncated completions are masked out
        saw_invalid |= bool((~valid).any())
        scores = torch.tensor(rewards, dtype=torch.float64)
        spreads, informative = [], []
        for start in range(0, len(scores), K):
            group = scores[start : start + K][valid[start : start + K]]
            if len(group):
                spreads.append(group.std(unbiased=False).item())
            informative.append(len(group) > 0 and bool(group.max() > group.min()))
        expected = {
            "reward": scores.mean().item(),
            "reward_std": sum(spreads) / len(spreads),
            "rewards/recording_reward/mean": scores.mean().item(),
            "rewards/recording_reward/std": scores.std(unbiased=False).item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": (~ended).float().mean().item(),
            "completions/valid_fraction": valid.float().mean().item(),
            "tpo/informative_group_fraction": sum(informative) / len(informative),
        }
        for name, value in expected.items():
            assert logged(run, step, name) == pytest.approx(value, rel=1e-6, abs=1e-9), name

        # q is built at the step (the default), for the groups the step trains.
        [(q, trained)] = reference_step(run, step)["targets"]
        entropies, best_masses = [], []
        for group, start in enumerate(range(0, len(q), K)):
            members = valid[start : start + K]
            if not trained[group]:
                continue
            group_q, group_scores = q[start : start + K][members], scores[start : start + K][members]
            entropies.append(-(group_q * group_q.clamp(min=1e-300).log()).sum().item())
            if group_scores.max() > group_scores.min():
                best_masses.append(group_q[group_scores == group_scores.max()].sum().item())
        assert logged(run, step, "tpo/target_entropy") == pytest.approx(sum(entropies) / len(entropies), rel=1e-5)
        assert logged(run, step, "tpo/best_completion_target_mass") == pytest.approx(
            sum(best_masses) / len(best_masses), rel=1e-5
        )
        # Every completion but the valid members of the trained groups is left out of the forward pass.
        trained_rows = sum(int(valid[g * K : (g + 1) * K].sum()) for g, group in enumerate(trained) if group)
        assert logged(run, step, "completions/skipped_fraction") == pytest.approx(1 - trained_rows / len(q))
    assert saw_invalid, "the run must have invalid completions for the valid-only definitions to matter"


def sequence_mask_weights(offsets, mask, low=0.5, high=1.5):
    """One weight per completion, exp(sum of its token log-ratios), 0 outside [low, high]; 1 off the mask."""
    ratio = torch.exp(-(offsets * mask).sum(dim=1, keepdim=True)).expand_as(mask)
    return torch.where(mask.bool(), torch.where((ratio >= low) & (ratio <= high), ratio, 0.0), 1.0)


@pytest.mark.parametrize(
    "settings, expected_weights",
    [
        (dict(vllm_importance_sampling_cap=1.5), lambda offsets, mask: torch.exp(-offsets).clamp(max=1.5)),
        (
            dict(vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_min=0.5,
                 vllm_importance_sampling_clip_max=1.5),
            sequence_mask_weights,
        ),
    ],
    ids=["token-truncate", "sequence-mask"],
)
def test_importance_weights_scale_each_tokens_gradient(tmp_path, tokenizer, settings, expected_weights):
    """The truncated weights ``min(p_trainer / p_sampler, cap)`` multiply each token's gradient, not its value.

    The sampler that reports its own log-probs is a vLLM engine (covered end to end by the real-engine tests in
    test_vllm.py); here a real rollout gets sampler log-probs set by hand, so the weights are known exactly.
    """
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    args = make_config(tmp_path, generation_kwargs=few_letters(tokenizer), **settings)
    trainer = TargetPOTrainer(
        model, letter_score, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer
    )
    trainer._step.importance_sampling = True  # what use_vllm=True switches on, the engine being the sampler
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    inputs = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_attention_mask"])
    mask = batch["completion_mask"].float()
    with torch.no_grad():
        trainer_logps, _ = ref.token_logps(copy.deepcopy(model), *inputs, 1.0, suppressed_ids(args))
    # Offsets that give weights below 1, at 1, between 1 and the cap, and above it (capped).
    offsets = torch.tensor([0.3, 0.0, -0.2, -1.0])[torch.arange(mask.numel()) % 4].view_as(mask)
    batch = batch.replaced(sampler_per_token_logps=(trainer_logps + offsets) * mask)
    weights = expected_weights(offsets, mask)

    model.zero_grad()
    trainer.compute_loss(model, batch).backward()
    got = {name: param.grad.clone() for name, param in model.named_parameters()}

    hand = copy.deepcopy(model)
    hand.zero_grad()
    logps, _ = ref.token_logps(hand, *inputs, 1.0, suppressed_ids(args))
    weighted = logps.detach() + weights * (logps - logps.detach())  # value unchanged, gradient times the weight
    valid = mask.any(dim=1)
    u = ref.whitened(letter_score(trainer.processing_class.batch_decode(
        [ids[: int(n)] for ids, n in zip(batch["completion_ids"], batch["completion_attention_mask"].sum(1))],
        skip_special_tokens=True,
    )), valid, 4)
    q = ref.targets(ref.sequence_logps(logps, mask, True), u, valid, 4, 1.0)
    ref.tpo_loss(ref.sequence_logps(weighted, mask, True), q, valid, 4).backward()
    assert any(grad.abs().max() > 1e-4 for grad in got.values())
    for name, param in hand.named_parameters():
        torch.testing.assert_close(got[name], param.grad, atol=1e-7, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")

    on = mask.bool()
    metrics = {name: [mean.total] * mean.count for name, mean in trainer._metrics["train"].items()}  # recorded once
    assert metrics["vllm/logp_abs_diff"] == [pytest.approx(offsets[on].abs().mean().item(), rel=1e-5)]
    assert metrics["vllm/importance_weight_mean"] == [pytest.approx(weights[on].mean().item(), rel=1e-5)]
    assert metrics["vllm/importance_weight_min"] == [pytest.approx(weights[on].min().item(), rel=1e-5)]
    # Where the ratio (per token, or of the whole completion) left the bounds.
    sequence = "vllm_importance_sampling_mode" in settings
    raw = torch.exp(-(offsets * mask).sum(dim=1, keepdim=True)).expand_as(mask) if sequence else torch.exp(-offsets)
    outside = (raw[on] > 1.5) | (raw[on] < (0.5 if sequence else 0.0))
    assert 0 < outside.sum() < on.sum()
    assert metrics["vllm/importance_weight_capped_fraction"] == [pytest.approx(outside.float().mean().item())]


def importance_sampling_trainer(tmp_path, tokenizer, **overrides):
    """A TPO trainer on the tiny model whose rollouts carry the sampler log-probs a test sets (as vLLM's would)."""
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    args = make_config(tmp_path, generation_kwargs=few_letters(tokenizer), vllm_importance_sampling_cap=1.5,
                       skip_zero_gradient_completions=False, **overrides)
    trainer = TargetPOTrainer(
        model, letter_score, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer
    )
    trainer._step.importance_sampling = True  # what use_vllm=True switches on, the engine being the sampler
    trainer.model.train()
    return model, args, trainer


@dataclass
class SampledElsewhere:
    """A step batch whose sampler log-probs are set to the rollout policy's plus known offsets, and its hand-built q."""

    inputs: tuple
    mask: torch.Tensor
    valid: torch.Tensor
    rollout_logps: torch.Tensor
    offsets: torch.Tensor
    q: torch.Tensor
    batch: Any  # the step batch with these sampler log-probs

    @classmethod
    def set_on(cls, batch, trainer, model, args):
        inputs = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_attention_mask"])
        mask = batch["completion_mask"].float()
        valid = mask.any(dim=1)
        with torch.no_grad():
            rollout_logps, _ = ref.token_logps(copy.deepcopy(model), *inputs, 1.0, suppressed_ids(args))
        offsets = torch.tensor([0.3, 0.0, -0.2, -1.0])[torch.arange(mask.numel()) % 4].view_as(mask)
        batch = batch.replaced(sampler_per_token_logps=(rollout_logps + offsets) * mask)  # the state stays shared
        u = ref.whitened(letter_score(trainer.processing_class.batch_decode(
            [ids[: int(n)] for ids, n in zip(batch["completion_ids"], batch["completion_attention_mask"].sum(1))],
            skip_special_tokens=True,
        )), valid, 4)
        q = ref.targets(ref.sequence_logps(rollout_logps, mask, True), u, valid, 4, 1.0)
        return cls(inputs, mask, valid, rollout_logps, offsets, q, batch)

    def hand_gradients(self, model, args):
        """The gradient with each token weighted by ``min(p_rollout / p_sampler, 1.5)`` at the model's weights."""
        hand = copy.deepcopy(model)
        hand.zero_grad()
        logps, _ = ref.token_logps(hand, *self.inputs, 1.0, suppressed_ids(args))
        weights = torch.exp(-self.offsets).clamp(max=1.5)
        weighted = logps.detach() + weights * (logps - logps.detach())
        ref.tpo_loss(ref.sequence_logps(weighted, self.mask, True), self.q, self.valid, 4).backward()
        return {name: param.grad for name, param in hand.named_parameters()}

    def sgd_step(self, model, args):
        """Move the weights by their gradients (learning rate 2), far enough to move the token log-probs measurably."""
        with torch.no_grad():
            for param in model.parameters():
                param -= 2.0 * param.grad
            moved, _ = ref.token_logps(copy.deepcopy(model), *self.inputs, 1.0, suppressed_ids(args))
        assert ((moved - self.rollout_logps).abs() * self.mask).max() > 0.05


def test_importance_weights_come_from_the_rollouts_policy_in_every_epoch(tmp_path, tokenizer):
    """With num_iterations=2 the second epoch over a step batch, after the weights moved, still weights each token's
    gradient by ``min(p_old / p_sampler, cap)``, p_old the rollout's policy (the one q is built from), not the moved
    one; the weights are computed once per step batch, so their metrics are recorded once."""
    model, args, trainer = importance_sampling_trainer(tmp_path, tokenizer, num_iterations=2)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    sampled = SampledElsewhere.set_on(batch, trainer, model, args)
    batch = sampled.batch
    for epoch in range(2):
        model.zero_grad()
        trainer.compute_loss(model, batch).backward()
        got = {name: param.grad.clone() for name, param in model.named_parameters()}
        expected = sampled.hand_gradients(model, args)
        assert any(grad.abs().max() > 1e-4 for grad in got.values())
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, atol=1e-7, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
        if epoch == 0:  # an SGD step between the epochs; the policy's token log-probs move measurably
            sampled.sgd_step(model, args)
    assert trainer._metrics["train"]["vllm/importance_weight_mean"].count == 1


def test_importance_weights_of_a_step_batch_first_used_after_the_weights_moved_come_from_the_rollouts_policy(
    tmp_path, tokenizer
):
    """steps_per_generation=2: the rollout's second step batch is first used after an optimiser step. Its importance
    weights are still ``min(p_old / p_sampler, cap)`` with p_old the rollout's policy, not the moved one."""
    model, args, trainer = importance_sampling_trainer(tmp_path, tokenizer, steps_per_generation=2)
    uses = iter(trainer.get_train_dataloader())
    first = trainer._prepare_inputs(next(uses))
    second = trainer._prepare_inputs(next(uses))  # the same rollout's other step batch
    sampled = SampledElsewhere.set_on(second, trainer, model, args)
    second = sampled.batch
    model.zero_grad()
    trainer.compute_loss(model, first).backward()
    sampled.sgd_step(model, args)  # the optimiser step between the two step batches
    model.zero_grad()
    trainer.compute_loss(model, second).backward()
    for name, grad in sampled.hand_gradients(model, args).items():
        torch.testing.assert_close(
            model.get_parameter(name).grad, grad, atol=1e-7, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )
