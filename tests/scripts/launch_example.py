"""Run examples/target_po.py's main() in each process, then save this process's weights for comparison."""

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import torch

from targetpo.step.run import StepRunner

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("target_po_example", ROOT / "examples" / "target_po.py")
example = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = example
spec.loader.exec_module(example)

first_completions = []


def recording(reward):
    """``reward``, remembering this process's first rollout."""

    def recording_reward(completions, **kwargs):
        if not first_completions:
            first_completions.extend(completions)
        return reward(completions=completions, **kwargs)

    return recording_reward


def ones_after_a_leading_one(prompts, completions, **kwargs):
    """Scores that vary only for prompts starting with '1': the other groups have nothing to learn from."""
    return [float(c.count("1")) if p.startswith("1") else 0.0 for p, c in zip(prompts, completions)]


example.BUILTIN_REWARDS["exact_reversal"] = recording(example.exact_reversal_reward)
example.BUILTIN_REWARDS["ones_after_a_leading_one"] = recording(ones_after_a_leading_one)

rows_trained = []  # per training micro-step: how many of this process's rows went through the model for the loss
original_rows_to_train = StepRunner.rows_to_train


def recording_rows_to_train(self, inputs, mode):
    rows = original_rows_to_train(self, inputs, mode)
    if mode == "train":
        rows_trained.append(len(inputs["valid"]) if rows is None else int(rows.sum()))
    return rows


StepRunner.rows_to_train = recording_rows_to_train


def zero_stage(trainer):
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else plugin.zero_stage


def full_weights(model, stage):
    """The flattened parameters; ZeRO-3 keeps only a shard on each process, so gather them first."""
    params = list(model.parameters())
    gathered = contextlib.nullcontext()
    if stage == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with gathered:
        return torch.cat([p.detach().flatten().clone() for p in params])


trainer = example.main(sys.argv[1:])
rank = trainer.accelerator.process_index
stage = zero_stage(trainer)
out = Path(trainer.args.output_dir)
torch.save(full_weights(trainer.accelerator.unwrap_model(trainer.model), stage), out / f"weights_rank{rank}.pt")
ref = trainer.ref_model
record = {
    "num_processes": trainer.accelerator.num_processes,
    "distributed_type": str(trainer.accelerator.distributed_type),
    "zero_stage": stage,
    "reference": None if ref is None else type(ref).__name__,
    # ZeRO-3 partitions a parameter in place: it keeps a `ds_tensor` shard and an empty full tensor.
    "reference_partitioned": ref is not None and all(hasattr(p, "ds_tensor") for p in ref.parameters()),
    "first_completions": first_completions,
    "rows_trained": rows_trained,
}
(out / f"world_rank{rank}.json").write_text(json.dumps(record))
# The process leaves through the interpreter's normal exit, where the trainer has the process group destroyed first
# (targetpo.distributed.destroy_gloo_group_at_exit): a clean exit code is part of what the tests check.
