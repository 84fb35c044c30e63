"""The trainer's own cross-process loss path, on 2 real gloo processes, against a single-process reference."""

import pytest
import reference as ref
import torch
import torch.multiprocessing as mp
from distributed_workers import NUM_GENERATIONS, tiny_model
from test_distributed import free_port
from trainer_workers import CASES, full_batch, trainer_loss_worker

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
