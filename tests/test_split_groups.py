"""TPO groups larger than a micro-batch: a group spread over the micro-steps of one optimiser step trains exactly as
the whole group in one micro-batch does, at the rollout's weights (p = p_old) and after they have moved (p from a pass
without gradient), with zero-gradient rows skipped, and over two processes.

Plain SGD (no momentum, clipping or weight decay, a constant learning rate): equal weights after every optimiser step
mean equal gradients. The completions are fixed (``split_group_workers.FixedCompletions``), so the runs compared
train the same rollouts whatever the machine samples.
"""

import pytest
import torch
import torch.multiprocessing as mp
from split_group_workers import NUM_GENERATIONS, FixedCompletions, train, two_process_worker
from test_distributed import free_port

from targetpo.demo import build_char_tokenizer
from targetpo.rollout import scheduler as scheduler_module

WHOLE = dict(per_device_train_batch_size=NUM_GENERATIONS)
# One group of 8 in micro-batches of 2: the 4 micro-steps of one optimiser step.
SPREAD = dict(per_device_train_batch_size=2, steps_per_generation=4, gradient_accumulation_steps=4)


def assert_same_weights_after_every_step(spread, whole):
    assert len(spread) == len(whole) > 0
    for step, (got, expected) in enumerate(zip(spread, whole)):
        for name in expected:
            torch.testing.assert_close(
                got[name], expected[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name, step=step: f"step {step + 1}, {name}: {m}"
            )


def assert_steps_move_the_weights(weights, initial_like):
    """Each step changes the weights measurably: the comparison above then compares real gradients."""
    previous = initial_like
    for step in weights:
        largest = max((step[name] - previous[name]).abs().max().item() for name in step)
        assert largest > 1e-3
        previous = step


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_steps=2),
        # The second optimiser step of each rollout trains after the weights moved: p from a pass without gradient.
        dict(max_steps=4, num_iterations=2),
        # Length sums, another target temperature and invalid (truncated) members.
        dict(max_steps=2, num_iterations=2, tpo_length_normalize_logps=False, tpo_target_temperature=0.5,
             mask_truncated_completions=True),
        # Every pass packed, the one for p included (a pass left padded would warn, which fails the test).
        pytest.param(dict(max_steps=4, num_iterations=2, padding_free=True),
                     marks=pytest.mark.filterwarnings("error:padding_free")),
    ],
    ids=["one-step-per-rollout", "two-epochs", "sums-and-invalid-members", "packed"],
)
def test_a_group_spread_over_four_micro_steps_trains_as_the_whole_group(tmp_path, settings):
    whole = train(str(tmp_path / "whole"), **WHOLE, **settings)
    spread = train(str(tmp_path / "spread"), **SPREAD, **settings)
    assert spread.args.generation_batch_size == whole.args.generation_batch_size == NUM_GENERATIONS
    assert spread.state.global_step == whole.state.global_step == settings["max_steps"]
    assert_same_weights_after_every_step(spread.recorded, whole.recorded)
    assert_steps_move_the_weights(whole.recorded[1:], whole.recorded[0])
    # Each micro-step's value is its rows' part of the groups' cross-entropy: the same loss is logged.
    assert logged_losses(spread) == pytest.approx(logged_losses(whole), rel=1e-5)


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_a_rollout_over_two_optimiser_steps_trains_each_spread_group_as_whole(tmp_path, num_iterations):
    """Two groups per rollout, one per optimiser step: each group's 8 rows in two micro-steps of 4, so p is refreshed
    at every optimiser step after the rollout's first, whose weights have moved (num_iterations = 1 too)."""
    settings = dict(max_steps=4 * num_iterations, num_iterations=num_iterations)
    whole = train(str(tmp_path / "whole"), per_device_train_batch_size=NUM_GENERATIONS, steps_per_generation=2,
                  gradient_accumulation_steps=1, **settings)
    spread = train(str(tmp_path / "spread"), per_device_train_batch_size=4, steps_per_generation=4,
                   gradient_accumulation_steps=2, **settings)
    assert spread.args.generation_batch_size == whole.args.generation_batch_size == 2 * NUM_GENERATIONS
    assert_same_weights_after_every_step(spread.recorded, whole.recorded)
    assert_steps_move_the_weights(whole.recorded[1:], whole.recorded[0])


def logged_losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_skipped_zero_gradient_rows_stay_exact_with_groups_spread_over_micro_steps(tmp_path):
    """Two groups per rollout, one of them with equal scores: at the rollout's weights its rows have no gradient and
    are skipped; in the second epoch (moved weights) they train. Skipping or not, the weights are the whole groups'."""
    settings = dict(max_steps=4, num_iterations=2, per_device_train_batch_size=4, steps_per_generation=4,
                    gradient_accumulation_steps=4)
    whole = train(str(tmp_path / "whole"), "letter_score_but_cat_ties", max_steps=4, num_iterations=2,
                  per_device_train_batch_size=2 * NUM_GENERATIONS, skip_zero_gradient_completions=False)
    skipping = train(str(tmp_path / "skipping"), "letter_score_but_cat_ties", **settings)
    assert skipping.args.skip_zero_gradient_completions
    assert_same_weights_after_every_step(skipping.recorded, whole.recorded)


@pytest.mark.slow
def test_groups_spread_over_micro_steps_on_two_processes_train_as_one_process_with_whole_groups(tmp_path):
    """Two processes, 2 rows per micro-step each: each group's 8 rows are spread over 2 micro-steps on each of the 2
    processes. The weights after every optimiser step are the one-process run's with the whole group per micro-batch."""
    spread = dict(per_device_train_batch_size=2, steps_per_generation=2, gradient_accumulation_steps=2)
    cases = [
        ("two_epochs", "letter_score", dict(max_steps=4, num_iterations=2, **spread)),
        ("skipping", "letter_score_but_cat_ties",
         dict(max_steps=2, num_iterations=2, **{**spread, "per_device_train_batch_size": 4})),
    ]
    mp.spawn(two_process_worker, args=(2, free_port(), str(tmp_path), cases), nprocs=2, join=True)
    references = {
        "two_epochs": train(str(tmp_path / "whole"), max_steps=4, num_iterations=2, **WHOLE),
        "skipping": train(str(tmp_path / "whole_skipping"), "letter_score_but_cat_ties", max_steps=2,
                          num_iterations=2, per_device_train_batch_size=2 * NUM_GENERATIONS),
    }
    for name, reference in references.items():
        for rank in range(2):
            recorded = torch.load(tmp_path / f"{name}_rank{rank}.pt")
            assert_same_weights_after_every_step(recorded, reference.recorded)


def test_a_group_spread_over_micro_steps_trains_exactly_with_rollouts_generated_ahead(tmp_path, monkeypatch):
    """async_rollouts: each rollout is generated while the one before it trains. Its old log-probs, and so p_old, are
    still computed when it is first trained, at the weights that train it, so a group spread over micro-steps trains
    as the whole group does without generating ahead. No vLLM server here (test_vllm.py runs one): the fixed
    completions stand in for it, without engine log-probs, so no importance weights enter either run."""
    # The server backend async_rollouts builds at set-up; train() then generates with the fixed completions.
    stand_in = FixedCompletions(build_char_tokenizer(), process_index=0)
    monkeypatch.setattr(scheduler_module, "build_rollout_backend", lambda *args, **kwargs: stand_in)
    generated_ahead = []

    def count_rollouts_taken_ahead(trainer):
        scheduler = trainer._scheduler
        take_upcoming = scheduler.take_upcoming

        def taking(*args, **kwargs):
            pending = take_upcoming(*args, **kwargs)
            generated_ahead.append(pending is not None)
            return pending

        scheduler.take_upcoming = taking

    settings = dict(max_steps=6, num_iterations=2)
    whole = train(str(tmp_path / "whole"), **WHOLE, **settings)
    spread = train(str(tmp_path / "spread"), on_trainer=count_rollouts_taken_ahead, **SPREAD, **settings,
                   use_vllm=True, vllm_mode="server", async_rollouts=True)
    assert generated_ahead == [False, True, True]  # the first rollout has nothing before it to be generated during
    assert_same_weights_after_every_step(spread.recorded, whole.recorded)
    assert_steps_move_the_weights(whole.recorded[1:], whole.recorded[0])
