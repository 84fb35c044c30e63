"""Run examples/target_po.py's main() in each process, then save this process's weights for comparison."""

import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("target_po_example", ROOT / "examples" / "target_po.py")
example = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = example
spec.loader.exec_module(example)

first_completions = []


def recording_reward(completions, **kwargs):
    """The example's reward, remembering this process's first rollout."""
    if not first_completions:
        first_completions.extend(completions)
    return example.exact_reversal_reward(completions, **kwargs)


example.BUILTIN_REWARDS["exact_reversal"] = recording_reward
trainer = example.main(sys.argv[1:])
rank = trainer.accelerator.process_index
weights = torch.cat([p.detach().flatten() for p in trainer.accelerator.unwrap_model(trainer.model).parameters()])
out = Path(trainer.args.output_dir)
torch.save(weights, out / f"weights_rank{rank}.pt")
(out / f"world_rank{rank}.json").write_text(
    json.dumps({"num_processes": trainer.accelerator.num_processes, "first_completions": first_completions})
)
