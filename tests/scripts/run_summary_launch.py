"""Train one step of a tiny model under whatever launcher started this script; record the processes the start-up
block saw and the warnings the run gave, in <out>/record.json."""

import json
import sys
import warnings
from pathlib import Path

from datasets import Dataset

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm

out = Path(sys.argv[1])
tokenizer = build_char_tokenizer()
args = TargetPOConfig(
    output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=4, max_steps=1,
    save_strategy="no", report_to="none", disable_tqdm=True,
)
trainer = TargetPOTrainer(
    build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, max_positions=64, seed=0),
    lambda completions, **kwargs: [float(len(text)) for text in completions],
    args=args,
    train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}),
    processing_class=tokenizer,
)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.train()
summary = trainer._run_summary()
record = {
    "processes": summary.processes,
    "processes_asked": summary.processes_asked,
    "warnings": [str(warning.message) for warning in caught],
}
if trainer.accelerator.is_main_process:
    (out / "record.json").write_text(json.dumps(record))
