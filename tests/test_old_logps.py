"""The rollout's old log-probs where each step batch is first used at the rollout's weights: that use computes the
rows it trains, and the rollout records only the rows it leaves out (no second forward pass over the same rows).

Plain SGD on fixed completions (``split_group_workers``), so runs compare by their weights after every step.
"""

import torch
from split_group_workers import NUM_GENERATIONS, train
from test_split_groups import assert_same_weights_after_every_step

#: Two groups a step, each rollout trained twice (num_iterations): the second step runs at moved weights, so it needs
#: the rollout's old log-probs.
TWO_EPOCHS = dict(per_device_train_batch_size=2 * NUM_GENERATIONS, num_iterations=2, max_steps=4)


class ForwardRows:
    """The rows of every forward pass of a model without gradient (the old log-probs; beta=0 and fixed completions
    leave no other)."""

    def __init__(self):
        self.rows = []

    def __call__(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            self.rows.append(kwargs["input_ids"].size(0))


def train_counting(tmp_path, name, reward, **settings):
    counter = ForwardRows()

    def with_counter(trainer):
        trainer.model.register_forward_pre_hook(counter, with_kwargs=True)

    trainer = train(str(tmp_path / name), reward, on_trainer=with_counter, **settings)
    return trainer, counter.rows


def test_the_first_use_computes_the_old_log_probs_of_the_rows_it_trains(tmp_path):
    """Without skipping, the first step over each rollout trains every row at the rollout's weights: no pass without
    gradient at all. With skipping, the rollout's pass covers only the group left out (equal scores, 8 rows), which
    the second step trains at moved weights; the weights are the same either way."""
    everything, passes = train_counting(
        tmp_path, "all", "letter_score_but_cat_ties", skip_zero_gradient_completions=False, **TWO_EPOCHS
    )
    assert passes == []
    skipping, skipping_passes = train_counting(tmp_path, "skipping", "letter_score_but_cat_ties", **TWO_EPOCHS)
    # The first rollout (prompts "Say cat:" and "Say dog:") holds the tied group; the second (sun, map) none.
    assert skipping_passes == [NUM_GENERATIONS]
    assert_same_weights_after_every_step(skipping.recorded, everything.recorded)
