"""The warning for rollouts whose groups carry no signal: once, after warn_after_uninformative_rollouts of them in a
row, naming the reward functions; never while groups differ, never with 0."""

import json
import os
import warnings

import pytest
import torch.multiprocessing as mp
from conftest import letters_then_position_reward, make_config
from datasets import Dataset
from distributed_workers import leave_without_teardown, tiny_model
from test_distributed import free_port

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import build_char_tokenizer

NO_SIGNAL = "No informative group in the last"


def always_one(completions, **kwargs):
    """The same reward for every completion: no group can tell its completions apart."""
    return [1.0] * len(completions)


def signal_at_step_one(completions, trainer_state, **kwargs):
    """Equal rewards, except in the rollout made at optimiser step 1, whose groups all differ."""
    if trainer_state.global_step == 1:
        return letters_then_position_reward(completions)
    return [0.0] * len(completions)


def warnings_of_training(tmp_path, model, tokenizer, dataset, reward, **settings):
    """Train (one rollout per optimiser step) and return the no-signal warnings it gave, and the trainer."""
    args = make_config(tmp_path, **settings)
    trainer = TargetPOTrainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return [str(warning.message) for warning in caught if NO_SIGNAL in str(warning.message)], trainer


def test_a_constant_reward_warns_once_after_the_given_number_of_rollouts(
    tmp_path, tiny_model, tokenizer, prompt_dataset
):
    found, trainer = warnings_of_training(
        tmp_path, tiny_model, tokenizer, prompt_dataset, always_one, max_steps=5, warn_after_uninformative_rollouts=3
    )
    assert trainer.state.global_step == 5  # five rollouts, the limit reached at the third: one warning
    assert len(found) == 1
    message = found[0]
    assert "in the last 3 training rollouts" in message
    assert "always_one" in message  # the reward function to check
    assert "mean reward: 1" in message and "num_generations=4" in message and "max_completion_length=6" in message


def test_fewer_rollouts_than_the_limit_do_not_warn(tmp_path, tiny_model, tokenizer, prompt_dataset):
    found, _ = warnings_of_training(
        tmp_path, tiny_model, tokenizer, prompt_dataset, always_one, max_steps=2, warn_after_uninformative_rollouts=3
    )
    assert found == []


def test_a_rollout_with_signal_starts_the_count_again(tmp_path, tiny_model, tokenizer, prompt_dataset):
    # Rollouts at steps 0..3: none, signal, none, none; three in a row never happen.
    found, _ = warnings_of_training(
        tmp_path, tiny_model, tokenizer, prompt_dataset, signal_at_step_one, max_steps=4,
        warn_after_uninformative_rollouts=3,
    )
    assert found == []


def test_a_reward_with_signal_does_not_warn(tmp_path, tiny_model, tokenizer, prompt_dataset):
    found, _ = warnings_of_training(
        tmp_path, tiny_model, tokenizer, prompt_dataset, letters_then_position_reward, max_steps=2,
        warn_after_uninformative_rollouts=1,
    )
    assert found == []


def test_zero_never_warns(tmp_path, tiny_model, tokenizer, prompt_dataset):
    found, _ = warnings_of_training(
        tmp_path, tiny_model, tokenizer, prompt_dataset, always_one, max_steps=2, warn_after_uninformative_rollouts=0
    )
    assert found == []


def test_the_setting_is_a_count(tmp_path):
    assert TargetPOConfig.warn_after_uninformative_rollouts == 20
    with pytest.raises(ValueError, match=r"warn_after_uninformative_rollouts must be >= 0 \(0 never warns\), got -1"):
        TargetPOConfig(output_dir=str(tmp_path), warn_after_uninformative_rollouts=-1)


def signal_on_the_second_process_only(completions, **kwargs):
    """Equal rewards on the first process's rows, rewards that differ in every group on the second's."""
    if os.environ["RANK"] == "1":
        return letters_then_position_reward(completions)
    return [0.0] * len(completions)


def two_process_worker(rank, world_size, port, out_dir):
    """One training rollout over two gloo processes, one whole group on each; record what each process counted and
    the warnings it gave."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    record = {}
    for name, reward in (("signal_on_one_process", signal_on_the_second_process_only), ("constant", always_one)):
        args = TargetPOConfig(
            output_dir=out_dir, per_device_train_batch_size=4, num_generations=4, max_steps=1, max_prompt_length=16,
            max_completion_length=4, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
            ddp_backend="gloo", ddp_timeout=60, warn_after_uninformative_rollouts=1,
        )
        trainer = TargetPOTrainer(
            tiny_model(), reward, args=args, train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}),
            processing_class=build_char_tokenizer(),
        )
        assert trainer.accelerator.num_processes == world_size
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        record[name] = {
            "in_a_row": trainer._rollout_scorer.no_signal.in_a_row,
            "warnings": [str(w.message) for w in caught if NO_SIGNAL in str(w.message)],
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(record, file)
    leave_without_teardown()


@pytest.mark.slow
def test_informative_is_decided_over_every_process_groups(tmp_path):
    mp.spawn(two_process_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    # The first process's own group is uninformative, the second's is not: the rollout has signal, on both.
    assert [rank["signal_on_one_process"] for rank in ranks] == [{"in_a_row": 0, "warnings": []}] * 2
    # No signal anywhere: both count it, the main process alone says so.
    assert [rank["constant"]["in_a_row"] for rank in ranks] == [1, 1]
    assert len(ranks[0]["constant"]["warnings"]) == 1 and ranks[1]["constant"]["warnings"] == []
