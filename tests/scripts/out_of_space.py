"""Train into a disk too small for two checkpoints, then resume from the one that fitted (run on a small tmpfs).

Usage: ``python out_of_space.py DISK RESULT``. DISK is the small filesystem: the run saves every 2 steps of 4, so its
second checkpoint runs out of space. RESULT (on another disk) receives what was seen: the error, the folders left on
DISK, and the weights of the run resumed from the first checkpoint.
"""

import json
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's helpers
from conftest import letters_then_position_reward, make_config  # noqa: E402

from targetpo import TargetPOTrainer  # noqa: E402
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm  # noqa: E402
from targetpo.faults.checkpoints import CheckpointWriteError  # noqa: E402

WORDS = ["cat", "dog", "sun", "map", "pen", "cup", "box", "hat"]


def trainer(out: Path, **overrides) -> TargetPOTrainer:
    """The run of tests/test_checkpoint_faults.py: the tiny model, its prompts and reward."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    dataset = Dataset.from_dict({"prompt": [f"Say {word}:" for word in WORDS], "answer": WORDS})
    args = make_config(out, max_steps=4, **overrides)
    return TargetPOTrainer(
        model, letters_then_position_reward, args=args, train_dataset=dataset, processing_class=tokenizer
    )


def main(disk: Path, result: Path) -> None:
    seen = {}
    try:
        trainer(disk / "a", save_strategy="steps", save_steps=2).train()
    except CheckpointWriteError as error:
        seen.update(error=str(error), errno=error.errno)
    seen["left"] = sorted(os.listdir(disk / "a" / "out"))
    checkpoint = disk / "a" / "out" / "checkpoint-2"
    resumed = trainer(disk / "b")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    torch.save({name: value.detach() for name, value in resumed.model.named_parameters()}, result / "weights.pt")
    (result / "seen.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
