"""Worker processes that run the trainer's own loss path with prompt groups split over processes (gloo, CPU)."""

import os

import torch
from datasets import Dataset
from distributed_workers import NUM_GENERATIONS, make_batch, tiny_model

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo import functional as F
from targetpo.demo import build_char_tokenizer


def full_batch(total_rows, with_invalid):
    """The rollout every process shares: a fixed batch, its whitened scores and q built from the old log-probs."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, old_sequence, scores = make_batch(total_rows, with_invalid)
    valid = completion_mask.any(dim=1)
    u = F.tpo_scores(scores, NUM_GENERATIONS, valid)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_attention_mask": completion_mask,
        "completion_mask": completion_mask,
        "valid": valid,
        "scores": scores,
        "advantages": u,
        "sample_index": torch.arange(total_rows),
        "old_targets": F.tpo_targets(old_sequence, u, NUM_GENERATIONS, valid),
    }


#: (name, rows per process, with invalid members, q built at rollout rather than at the step)
CASES = [
    ("split-groups", 2, False, False),
    ("split-groups-invalid-members", 6, True, False),
    ("split-groups-q-at-rollout", 6, True, True),
    ("whole-groups", 4, True, False),
]


def trainer_loss_worker(rank, world_size, port, out_dir):
    """In a 2-process gloo world, for each case: build the trainer, run its compute_loss on this process's share,
    back-propagate through DDP, and save the loss and the all-reduced gradients."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    tokenizer = build_char_tokenizer()
    for name, per_device, with_invalid, q_at_rollout in CASES:
        args = TargetPOConfig(
            output_dir=out_dir, per_device_train_batch_size=per_device, num_generations=NUM_GENERATIONS,
            max_prompt_length=16, max_completion_length=8, report_to="none", use_cpu=True, ddp_backend="gloo",
            ddp_timeout=60, logps_chunk_size=3,
        )
        trainer = TargetPOTrainer(
            tiny_model(), lambda completions, **kwargs: [0.0] * len(completions), args=args,
            train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}), processing_class=tokenizer,
        )
        assert trainer.accelerator.num_processes == world_size and trainer.accelerator.distributed_type == "MULTI_CPU"
        batch = full_batch(per_device * world_size, with_invalid)
        own = slice(rank * per_device, (rank + 1) * per_device)
        inputs = {key: value[own] for key, value in batch.items() if key != "old_targets"}
        inputs["rollout"] = 1
        if q_at_rollout:
            inputs["targets"] = batch["old_targets"][own]
        model = trainer.accelerator.prepare_model(trainer.model)
        model.train()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.accelerator.unwrap_model(model).named_parameters()}
        torch.save({"loss": loss.detach(), "grads": grads}, os.path.join(out_dir, f"{name}_rank{rank}.pt"))
    torch.distributed.barrier()
    os._exit(0)  # no teardown of the gloo group at exit (see distributed_workers.gradient_worker)
