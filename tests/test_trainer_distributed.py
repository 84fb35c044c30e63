"""The trainer on 2 real gloo processes: its own cross-process loss path against a single-process reference, and
streamed train and evaluation datasets read by each process, which keeps its share of every rollout."""

import pytest
import reference as ref
import torch
import torch.multiprocessing as mp
from distributed_workers import NUM_GENERATIONS, tiny_model
from test_distributed import free_port
from trainer_workers import (
    CASES,
    EVAL_PROMPTS,
    RESUME_PROMPTS,
    STREAM_CASES,
    STREAM_PROMPTS,
    full_batch,
    resume_in_second_epoch_worker,
    stream_share_worker,
    trainer_loss_worker,
)

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def two_process_losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_loss")
    mp.spawn(trainer_loss_worker, args=(WORLD_SIZE, free_port(), str(out)), nprocs=WORLD_SIZE, join=True)
    return out


@pytest.mark.parametrize("name, per_device, with_invalid, q_at_rollout", CASES, ids=[case[0] for case in CASES])
def test_compute_loss_over_processes_equals_the_single_process_loss(
    two_process_losses, name, per_device, with_invalid, q_at_rollout
):
    # The reference: one process, the whole batch, written out by hand from the model's full logits.
    batch = full_batch(per_device * WORLD_SIZE, with_invalid)
    model = tiny_model()
    mask = batch["completion_mask"].float()
    logps, _ = ref.token_logps(model, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], mask.long())
    sequence = ref.sequence_logps(logps, mask, True)
    valid = batch["valid"]
    q = batch["old_targets"] if q_at_rollout else ref.targets(sequence, batch["advantages"].double(), valid, NUM_GENERATIONS, 1.0)
    loss = ref.tpo_loss(sequence, q, valid, NUM_GENERATIONS)
    loss.backward()
    split = per_device % NUM_GENERATIONS != 0
    for rank in range(WORLD_SIZE):
        result = torch.load(two_process_losses / f"{name}_rank{rank}.pt")
        if split:  # every process computes the loss of the whole gathered batch
            torch.testing.assert_close(result["loss"], loss.detach().float(), atol=1e-6, rtol=1e-5)
        for param_name, param in model.named_parameters():  # after DDP's all-reduce: the single-process gradient
            torch.testing.assert_close(
                result["grads"][param_name], param.grad, atol=1e-6, rtol=1e-4, msg=lambda m, param_name=param_name: f"{param_name}: {m}"
            )


def rollouts_in_order(prompts_per_rollout, num_rollouts):
    """Each rollout's completions when the prompts are read in order: a rollout's prompts, each ``NUM_GENERATIONS``
    times in a row; a trailing partial rollout is dropped and the next epoch starts again from the first prompt."""
    size = prompts_per_rollout
    epoch = [STREAM_PROMPTS[start : start + size] for start in range(0, len(STREAM_PROMPTS) - size + 1, size)]
    rollouts = (epoch * num_rollouts)[:num_rollouts]
    return [[prompt for prompt in rollout for _ in range(NUM_GENERATIONS)] for rollout in rollouts]


@pytest.mark.slow
def test_a_stream_over_two_processes_gives_each_its_share_in_order(tmp_path):
    """Each process reads the whole stream and keeps its share of every rollout: the same rows, in the same order,
    as the same prompts from a map-style dataset (shuffle_dataset=False), and so the same trained weights."""
    mp.spawn(stream_share_worker, args=(WORLD_SIZE, free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    for name, per_device, steps_per_generation, max_steps in STREAM_CASES:
        share = per_device * steps_per_generation  # completions per process and rollout
        rollouts = rollouts_in_order(share * WORLD_SIZE // NUM_GENERATIONS, max_steps // steps_per_generation)
        runs = [{kind: torch.load(tmp_path / f"{name}_{kind}_rank{rank}.pt") for kind in ("map", "stream")}
                for rank in range(WORLD_SIZE)]
        for rank, run in enumerate(runs):
            stream, mapped = run["stream"], run["map"]
            assert stream["is_stream"] and not mapped["is_stream"]
            assert not stream["dispatched"]  # each process reads the stream itself
            assert stream["global_step"] == mapped["global_step"] == max_steps
            # Process `rank` keeps the rank-th share of each rollout, as from the map-style dataset.
            own = [rollout[rank * share : (rank + 1) * share] for rollout in rollouts]
            assert stream["seen"] == own, (name, rank, stream["seen"])
            assert mapped["seen"] == own, (name, rank, mapped["seen"])
            assert (stream["weights"] - stream["initial"]).abs().max() > 1e-3  # it trained
            assert torch.equal(stream["weights"], mapped["weights"]), (name, rank)
        # Together the two processes trained on each rollout whole, in stream order, and stayed in step.
        shares = zip(runs[0]["stream"]["seen"], runs[1]["stream"]["seen"])
        assert [first + second for first, second in shares] == rollouts
        assert torch.equal(runs[0]["stream"]["weights"], runs[1]["stream"]["weights"])
    # A stream passed to evaluate() on a trainer built with map-style data: each process scores its share of every
    # evaluation step (8 completions, 2 prompts), as from the same prompts map-style, with the same metrics.
    for rank in range(WORLD_SIZE):
        evaluated = torch.load(tmp_path / f"evaluate_rank{rank}.pt")
        firsts = [EVAL_PROMPTS[4 * step + 2 * rank] for step in range(4)]
        seconds = [EVAL_PROMPTS[4 * step + 2 * rank + 1] for step in range(4)]
        expected = [[first] * 4 + [second] * 4 for first, second in zip(firsts, seconds)]
        assert evaluated["stream"]["seen"] == evaluated["map"]["seen"] == expected, rank
        assert evaluated["stream"]["metrics"] == evaluated["map"]["metrics"], rank
        assert "eval_loss" in evaluated["stream"]["metrics"]


@pytest.mark.slow
def test_a_run_resumed_in_its_second_epoch_over_two_processes_trains_as_the_run_straight_through(tmp_path):
    """Resumed inside epoch 1, the loader's wrappers (process shards, the skipped batches) hide the sampler from the
    epoch it is handed: the rest of the epoch must still come in epoch 1's order, not epoch 0's."""
    mp.spawn(resume_in_second_epoch_worker, args=(WORLD_SIZE, free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    for rank in range(WORLD_SIZE):
        runs = torch.load(tmp_path / f"resume_rank{rank}.pt")
        straight, resumed = runs["straight"], runs["resumed"]
        # Steps 6 and 7 in epoch 1's order, which differs from epoch 0's there (what a resume in epoch 0's would serve).
        assert len(straight["seen"]) == 7 and straight["seen"][5:] != straight["seen"][1:3]
        assert resumed["seen"] == straight["seen"][5:], rank
        torch.testing.assert_close(resumed["weights"], straight["weights"], rtol=0, atol=1e-7)
    # Each epoch served every prompt once: each process half of them, the two halves apart.
    seen = [torch.load(tmp_path / f"resume_rank{rank}.pt")["straight"]["seen"] for rank in range(WORLD_SIZE)]
    assert sorted(seen[0][:4] + seen[1][:4]) == sorted(RESUME_PROMPTS)
