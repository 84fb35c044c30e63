"""Code that runs inside the worker processes of the multi-process tests (importable by spawned children)."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from targetpo import functional as F
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm
from targetpo.distributed import all_gather_with_grad, fsdp2_shard_frozen, fsdp2_unsharded, groups_span_processes
from targetpo.modeling.logps import completion_logps

NUM_GENERATIONS = 4
#: (name, rows per process, length-normalise, with invalid members)
CASES = [
    ("split_mean", 2, True, False),
    ("split_sum", 2, False, False),
    ("split_mean_invalid", 6, True, True),
    ("split_sum_invalid", 6, False, True),
    ("whole_groups", 4, True, True),
]


def tiny_model():
    return build_tiny_causal_lm(build_char_tokenizer(), hidden_size=32, num_layers=1, num_heads=2, max_positions=64)


def make_batch(total_rows, with_invalid, seed=0):
    """A fixed batch of prompts and completions, old log-probs and scores, identical in every process."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 60, (total_rows, 5), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[::3, :2] = 0  # some left padding
    completion_ids = torch.randint(3, 60, (total_rows, 4), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1::2, 3] = 0  # some shorter completions
    if with_invalid:
        completion_mask[[1, 6, 7]] = 0  # empty masks: invalid members (rows 6 and 7 sit in a split group)
    old_sequence_logps = -torch.rand(total_rows, generator=generator) * 5
    scores = torch.randint(0, 3, (total_rows,), generator=generator).float()
    return prompt_ids, prompt_mask, completion_ids, completion_mask, old_sequence_logps, scores


def loss_and_sequence_logps(model, rows, normalize, span, chunk_size=None):
    """The trainer's computation: local sequence log-probs, gathered when groups span processes, then the loss."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, old_sequence_logps, scores = rows
    per_token, _ = completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, chunk_size=chunk_size)
    sequence = F.sequence_logps(per_token, completion_mask, normalize)
    sequence.retain_grad()
    valid = completion_mask.any(dim=1)
    if span:
        gathered = all_gather_with_grad(sequence)
        valid, old_sequence_logps, scores = (all_gather_with_grad(t) for t in (valid, old_sequence_logps, scores))
    else:
        gathered = sequence
    u = F.tpo_scores(scores, NUM_GENERATIONS, valid)
    targets = F.tpo_targets(old_sequence_logps, u, NUM_GENERATIONS, valid)
    return F.tpo_loss(gathered, targets, NUM_GENERATIONS, valid), sequence


def gradient_worker(rank, world_size, port, out_dir):
    """Each process takes its share of every case's batch, trains through DDP, and saves what it got."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A short timeout: a broken collective fails the test instead of hanging it.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    for name, per_device, normalize, with_invalid in CASES:
        batch = make_batch(per_device * world_size, with_invalid)
        share = [t[rank * per_device : (rank + 1) * per_device] for t in batch]
        model = DistributedDataParallel(tiny_model())
        span = groups_span_processes(per_device, NUM_GENERATIONS, world_size)
        # The chunked log-prob path (the trainer's default) through DDP; the single-process reference uses one
        # full logits tensor, so the comparison also covers the output head running outside DDP's forward.
        loss, sequence = loss_and_sequence_logps(model, share, normalize, span, chunk_size=3)
        loss.backward()
        torch.save(
            {
                "span": span,
                "loss": loss.detach(),
                "sequence_grad": sequence.grad.clone(),
                "grads": {n: p.grad.clone() for n, p in model.module.named_parameters()},
            },
            os.path.join(out_dir, f"{name}_rank{rank}.pt"),
        )
    leave_without_teardown()


def leave_without_teardown():
    """Exit once every process has written its results, without tearing the gloo group down: freeing a DDP reducer
    and its gloo group at interpreter exit can deadlock (the group's worker thread waits for the GIL its destructor
    holds) or abort the process ("terminate called without an active exception")."""
    dist.barrier()
    os._exit(0)


def fsdp2_generation_worker(rank, world_size, port, out_dir):
    """Shard a model with FSDP2, generate inside ``fsdp2_unsharded``, then take a training step; save what happened."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    model = tiny_model()
    prompt = torch.randint(3, 60, (3, 5), generator=torch.Generator().manual_seed(rank))  # different on each process
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)

    # A frozen copy (a reference model) sharded by the library, one unit per decoder layer plus the root.
    frozen = tiny_model().requires_grad_(False).eval()
    with torch.no_grad():
        frozen_expected = frozen(prompt).logits
    fsdp2_shard_frozen(frozen)
    from torch.distributed.fsdp import FSDPModule

    frozen_units = sum(isinstance(module, FSDPModule) for module in frozen.modules())
    with torch.no_grad():
        frozen_logits = frozen(prompt).logits
    frozen_sharded = all(isinstance(p, DTensor) for p in frozen.parameters())

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = lambda: all(isinstance(p, DTensor) for p in model.parameters())  # noqa: E731
    sharded_before = sharded()
    with fsdp2_unsharded(model, reshard_after_forward=True):
        generated = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        full_after_generating = not any(isinstance(p, DTensor) for p in model.parameters())
    sharded_after = sharded()
    # Training still works afterwards, and resharding after forward is back on.
    model(prompt, labels=prompt).loss.backward()
    sharded_after_step = sharded()
    torch.save(
        {
            "expected": expected,
            "generated": generated,
            "sharded_before": sharded_before,
            "full_after_generating": full_after_generating,
            "sharded_after": sharded_after,
            "sharded_after_step": sharded_after_step,
            "grads_are_shards": all(isinstance(p.grad, DTensor) for p in model.parameters()),
            "frozen_units": frozen_units,
            "frozen_layers": len(frozen.model.layers),
            "frozen_sharded": frozen_sharded,
            "frozen_logits_match": torch.allclose(frozen_logits, frozen_expected, atol=1e-5),
        },
        os.path.join(out_dir, f"fsdp2_rank{rank}.pt"),
    )
    leave_without_teardown()
