"""The records passed between the rollout side and the step: a rollout's facts are frozen once made, the step writes
only its own state, and both read through a step batch as attributes and under TRL's dict names."""

import dataclasses

import pytest
import torch

from targetpo.batch import RolloutBatch, StepBatch


def record(rows=4):
    ids = torch.arange(rows * 3).view(rows, 3)
    return RolloutBatch(
        prompt_ids=ids,
        prompt_mask=torch.ones_like(ids),
        completion_ids=ids + 1,
        completion_attention_mask=torch.ones_like(ids),
        completion_mask=torch.ones_like(ids),
        valid=torch.ones(rows, dtype=torch.bool),
        scores=torch.arange(rows, dtype=torch.float32),
        advantages=torch.arange(rows, dtype=torch.float32) - 1.5,
        sample_index=torch.arange(rows),
    )


def test_a_rollouts_facts_are_frozen_and_the_step_writes_only_its_state():
    facts = record()
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.advantages = torch.zeros(4)
    batch = StepBatch(facts)
    with pytest.raises(AttributeError, match="fact of the rollout, frozen once made"):
        batch.advantages = torch.zeros(4)
    with pytest.raises(KeyError, match=r"batch.replaced\(advantages=...\)"):
        batch["advantages"] = torch.zeros(4)
    batch.rollout_step = 3  # the step's own state
    batch["targets"] = torch.full((4,), 0.25)  # its cache, under TRL's name
    assert batch.state.rollout_step == 3 and torch.equal(batch.state.cache.targets, torch.full((4,), 0.25))
    assert batch["rollout_step"] == 3 and torch.equal(batch["advantages"], facts.advantages)
    assert "old_per_token_logps" not in batch and batch.get("old_per_token_logps") is None


def test_step_batches_cut_facts_and_state_by_rows_and_a_new_fact_makes_a_new_record():
    batch = StepBatch(record(4))
    batch.rows_with_gradient = torch.tensor([True, False, True, True])
    first, second = batch.step_batches(2)
    assert torch.equal(second.sample_index, torch.tensor([2, 3]))
    assert torch.equal(second.rows_with_gradient, torch.tensor([True, True]))
    first.cache.targets = torch.ones(2)  # each step batch has a state of its own
    assert second.cache.targets is None and batch.cache.targets is None
    weighted = first.replaced(sampler_per_token_logps=torch.zeros(2, 3))
    assert weighted.state is first.state and first.sampler_per_token_logps is None
    assert torch.equal(weighted["sampler_per_token_logps"], torch.zeros(2, 3))


def test_a_batch_built_by_hand_from_trl_names_reads_back_the_same():
    facts = record(2)
    inputs = {
        **{name: getattr(facts, name) for name in ("prompt_ids", "prompt_mask", "completion_ids")},
        **{name: getattr(facts, name) for name in ("completion_attention_mask", "completion_mask", "valid")},
        "scores": facts.scores,
        "advantages": facts.advantages,
        "sample_index": facts.sample_index,
        "old_per_token_logps": torch.full((2, 3), -1.0),
        "targets": torch.tensor([0.5, 0.5]),
    }
    batch = StepBatch.from_mapping(inputs)
    assert set(batch.keys()) == set(inputs) | {"rollout"}
    assert all(torch.equal(batch[key], value) for key, value in inputs.items())
    with pytest.raises(KeyError, match="'advantage' is not a rollout field"):
        StepBatch.from_mapping({**inputs, "advantage": facts.advantages})
