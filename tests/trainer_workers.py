"""Worker processes that run the trainer's own loss path with prompt groups split over processes, and train on a
stream and on a map-style dataset of the same prompts (gloo, CPU)."""

import os

import torch
from datasets import Dataset
from distributed_workers import NUM_GENERATIONS, leave_without_teardown, make_batch, tiny_model

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
    leave_without_teardown()


#: Ten distinct prompts: in the runs below a stream of them runs out, drops its trailing partial rollout and starts
#: again.
STREAM_PROMPTS = [f"Say {word}:" for word in ("cat", "dog", "sun", "map", "pen", "cup", "box", "hat", "cow", "owl")]
#: (name, per_device_train_batch_size, steps_per_generation, max_steps), with 4 completions per prompt.
STREAM_CASES = [
    # 2 x 6 completions: 3 prompts per rollout, the middle one's group split over the two processes.
    ("split-groups", 6, 1, 4),
    # 2 x 4 x 2 completions: 4 prompts per rollout, 2 per process, one per step.
    ("two-steps-per-rollout", 4, 2, 6),
]


def varied_reward(completions, **kwargs):
    """Scores that differ within groups, so that every step trains."""
    return [float(len(set(completion))) for completion in completions]


#: Evaluated with 8 completions per device: 4 prompts per evaluation step of the two processes together, 4 steps
#: (16 prompts: a map-style dataset's last step is whole, see test_a_stream_passed_to_evaluate_... in
#: test_coming_from_trl.py).
EVAL_PROMPTS = STREAM_PROMPTS + [f"Say {word}:" for word in ("ant", "bee", "elk", "fox", "gnu", "yak")]


def save_late_evaluations(trainer, seen, path):
    """Evaluate the trainer (built with map-style data) on a stream passed to `evaluate()` and on the same prompts as
    a map-style dataset, from the same seed; save the prompts this process scored and the metrics of each."""
    from accelerate.utils import set_seed
    from datasets import IterableDataset

    def eval_stream():
        yield from ({"prompt": prompt} for prompt in EVAL_PROMPTS)

    results = {}
    for kind, dataset in (("map", Dataset.from_dict({"prompt": EVAL_PROMPTS})),
                          ("stream", IterableDataset.from_generator(eval_stream))):
        seen.clear()
        set_seed(0, device_specific=True)
        metrics = trainer.evaluate(eval_dataset=dataset)
        timings = ("runtime", "per_second", "_seconds", "preparation_time")
        results[kind] = {"seen": list(seen), "metrics": {k: v for k, v in metrics.items() if not k.endswith(timings)}}
    torch.save(results, path)


def stream_share_worker(rank, world_size, port, out_dir):
    """In a 2-process gloo world, for each case: train once on a map-style dataset (in order) and once on a stream of
    the same prompts, and save the prompts this process's reward function saw per rollout and the final weights."""
    from datasets import IterableDataset

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    tokenizer = build_char_tokenizer()

    def stream():
        yield from ({"prompt": prompt} for prompt in STREAM_PROMPTS)

    sources = {
        "map": lambda: Dataset.from_dict({"prompt": STREAM_PROMPTS}),
        "stream": lambda: IterableDataset.from_generator(stream),
    }
    for name, per_device, steps_per_generation, max_steps in STREAM_CASES:
        for kind, make_dataset in sources.items():
            seen = []

            def recording_reward(prompts, completions, seen=seen, **kwargs):
                seen.append(list(prompts))  # this process's share of the rollout
                return varied_reward(completions)

            args = TargetPOConfig(
                output_dir=out_dir, per_device_train_batch_size=per_device, num_generations=NUM_GENERATIONS,
                steps_per_generation=steps_per_generation, max_steps=max_steps, shuffle_dataset=False,
                max_prompt_length=16, max_completion_length=4, learning_rate=1e-2, report_to="none",
                save_strategy="no", disable_tqdm=True, seed=0, use_cpu=True, ddp_backend="gloo", ddp_timeout=60,
            )
            model = tiny_model()
            initial = torch.cat([p.detach().flatten() for p in model.parameters()])
            trainer = TargetPOTrainer(
                model, recording_reward, args=args, train_dataset=make_dataset(), processing_class=tokenizer
            )
            assert trainer.accelerator.num_processes == world_size
            trainer.train()
            torch.save(
                {
                    "seen": seen,
                    "is_stream": isinstance(trainer.train_dataset, IterableDataset),
                    "dispatched": type(trainer.get_train_dataloader()).__name__ == "DataLoaderDispatcher",
                    "global_step": trainer.state.global_step,
                    "initial": initial,
                    "weights": torch.cat([p.detach().flatten() for p in model.parameters()]),
                },
                os.path.join(out_dir, f"{name}_{kind}_rank{rank}.pt"),
            )
            if kind == "map" and name == STREAM_CASES[0][0]:
                save_late_evaluations(trainer, seen, os.path.join(out_dir, f"evaluate_rank{rank}.pt"))
    leave_without_teardown()


#: Eight prompts: with 2 processes × 4 rows a rollout holds 2 prompts, so an epoch is 4 rollouts (4 optimiser steps).
RESUME_PROMPTS = [f"Say {word}:" for word in ("cat", "dog", "sun", "map", "pen", "cup", "box", "hat")]


def resume_in_second_epoch_worker(rank, world_size, port, out_dir):
    """Train 7 steps straight (a checkpoint at step 5, inside the second epoch), then resume a fresh trainer from that
    checkpoint; save the prompts this process scored per rollout and the final weights of both runs."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    runs = {}
    for name, resume in (("straight", None), ("resumed", os.path.join(out_dir, "straight", "checkpoint-5"))):
        seen = []

        def recording_reward(prompts, completions, seen=seen, **kwargs):
            seen.append(prompts[0])  # this process's prompt of the rollout (a group of 4 per process)
            return varied_reward(completions)

        args = TargetPOConfig(
            output_dir=os.path.join(out_dir, name), per_device_train_batch_size=NUM_GENERATIONS,
            num_generations=NUM_GENERATIONS, max_steps=7, max_prompt_length=16, max_completion_length=4,
            learning_rate=1e-2, report_to="none", save_strategy="steps", save_steps=5, disable_tqdm=True, seed=0,
            use_cpu=True, ddp_backend="gloo", ddp_timeout=60,
        )  # fmt: skip
        model = tiny_model()
        trainer = TargetPOTrainer(
            model, recording_reward, args=args, train_dataset=Dataset.from_dict({"prompt": RESUME_PROMPTS}),
            processing_class=build_char_tokenizer(),
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        runs[name] = {"seen": seen, "weights": torch.cat([p.detach().flatten() for p in model.parameters()])}
        torch.distributed.barrier()  # the checkpoint is whole on every process before the resumed run reads it
    torch.save(runs, os.path.join(out_dir, f"resume_rank{rank}.pt"))
    leave_without_teardown()
