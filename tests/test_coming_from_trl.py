"""The GRPO surface a TRL script relies on: its config class, and how rewards become advantages."""

import dataclasses
import math

import pytest
from conftest import make_config
from datasets import Dataset
from test_trainer_values import few_letters

from targetpo import GRPOConfig, TargetPOConfig, TargetPOTrainer

PROMPTS = ["Say cat:", "Say dog:", "Say sun:", "Say map:", "Say pen:", "Say cup:", "Say box:", "Say hat:"]


def test_a_grpo_config_trains_the_grpo_loss_it_names(tmp_path, tiny_model, tokenizer):
    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=4, max_prompt_length=64, epsilon_high=0.28, scale_rewards="batch", max_steps=1,
        logging_steps=1, save_strategy="no",
    )
    trainer = TargetPOTrainer(
        tiny_model, lambda completions, **kw: [float(sum(map(ord, c)) % 7) for c in completions], args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=tokenizer,
    )
    assert type(trainer.args) is TargetPOConfig
    for f in dataclasses.fields(GRPOConfig):
        assert getattr(trainer.args, f.name) == getattr(args, f.name), f.name
    assert trainer.args.loss_type == "dapo" and trainer.args.tpo_target_temperature == 1.0
    trainer.train()
    logs = trainer.state.log_history[0]
    assert "clip_ratio/region_mean" in logs and "tpo/target_entropy" not in logs  # a clipped-surrogate step


def recorded_rewards(record):
    def first(completions, **kwargs):
        scores = [float(len(text)) for text in completions]
        record.append(scores)
        return scores

    def second(completions, **kwargs):
        # Leaves every fourth completion unscored (None), so a reward's statistics cover only what it scored.
        scores = [float(text.count("a") + 2 * text.count("b")) if index % 4 else None for index, text in enumerate(completions)]
        record.append(scores)
        return scores

    return [first, second]


def hand_advantages(per_func, weights, valid, num_generations, scale, aggregation):
    """The advantages as the config fields document them, written out group by group."""
    n = len(valid)
    if aggregation == "normalize_then_sum":
        total = [0.0] * n
        for column, weight in zip(zip(*per_func), weights):
            for start in range(0, n, num_generations):
                members = [i for i in range(start, start + num_generations) if valid[i] and column[i] is not None]
                values = [column[i] for i in members]
                if len(values) and max(values) > min(values):
                    mean = sum(values) / len(values)
                    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
                    for i in members:
                        total[i] += weight * (column[i] - mean) / std
        kept = [total[i] for i in range(n) if valid[i]]
        mean = sum(kept) / len(kept)
        std = math.sqrt(sum((v - mean) ** 2 for v in kept) / len(kept))
        return [(total[i] - mean) / std if valid[i] and std > 0 else 0.0 for i in range(n)]
    scores = [sum(w * s for w, s in zip(weights, row) if s is not None) for row in per_func]
    kept = [scores[i] for i in range(n) if valid[i]]
    batch_mean = sum(kept) / len(kept)
    batch_std = math.sqrt(sum((v - batch_mean) ** 2 for v in kept) / len(kept))
    advantages = [0.0] * n
    for start in range(0, n, num_generations):
        members = [i for i in range(start, start + num_generations) if valid[i]]
        values = [scores[i] for i in members]
        if not values or max(values) == min(values):
            continue
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        divisor = {"group": std, "batch": batch_std, "none": 1.0}[scale]
        for i in members:
            advantages[i] = (scores[i] - mean) / divisor
    return advantages


@pytest.mark.parametrize(
    "scale, aggregation",
    [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"), (False, "sum_then_normalize"),
     ("group", "normalize_then_sum")],
)
def test_advantages_follow_scale_rewards_and_multi_objective_aggregation(tmp_path, tiny_model, tokenizer, scale, aggregation):
    record = []
    args = make_config(
        tmp_path, scale_rewards=scale, multi_objective_aggregation=aggregation, reward_weights=[1.0, 0.5],
        mask_truncated_completions=True, max_completion_length=4, per_device_train_batch_size=16,
        generation_kwargs=few_letters(tokenizer),
    )
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    trainer = TargetPOTrainer(
        tiny_model, recorded_rewards(record), args=args, train_dataset=dataset, processing_class=tokenizer
    )
    trainer.model.train()
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    per_func = list(zip(record[0], record[1]))
    valid = batch["valid"].tolist()
    assert not all(valid) and any(valid), "the rollout needs valid and invalid members to test"
    expected = hand_advantages(per_func, [1.0, 0.5], valid, 4, args.scale_rewards, aggregation)
    assert any(abs(value) > 0.1 for value in expected)
    assert batch["advantages"].tolist() == pytest.approx(expected, abs=1e-6)
    # The combined score the table and metrics show is the weighted sum either way.
    sums = [sum(w * s for w, s in zip([1.0, 0.5], row) if s is not None) for row in per_func]
    assert batch["scores"].tolist() == pytest.approx(sums)
