"""A long run stays flat: resident memory, threads, open files, sockets and trainer_state.json over thousands of steps.

Trains the embedded demo (``examples/target_po.py``: the 6-bit reversal, its defaults) for ``--steps`` steps, then the
multi-turn guessing game (``--task guess``, the model's own samples calling the ``guess`` tool) for ``--tool_steps``,
one after the other in one process. Every ``--every`` steps it records the process's resident memory (VmRSS), its
threads (Python's, by name, and the OS's), open file descriptors, sockets, the size trainer_state.json would have if
saved then, and the number of its log lines. The game's calls are given a timeout (``--tool_call_timeout``) so that
they run on the tools' event loop, the thread that must not multiply.

Reported per run: the growth of resident memory from the end of the warm-up (the first sample at or after
``--warmup_steps``, at most halfway through the run) to the end, and the counts then and at the end; the curves go to
the JSON file.

    python benchmarks/long_run.py --output docs/benchmarks/long_run.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from machine import REPOSITORY, environment, report

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: The tools' event loop thread (targetpo/episodes/async_runner.py).
TOOLS_THREAD = "targetpo-tools"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000, help="Optimiser steps of the reversal demo.")
    parser.add_argument("--tool_steps", type=int, default=500, help="Optimiser steps of the guessing game (0: none).")
    parser.add_argument("--every", type=int, default=50, help="Steps between samples.")
    parser.add_argument("--warmup_steps", type=int, default=100, help="Steps after which growth is counted.")
    parser.add_argument("--tool_call_timeout", type=float, default=30.0,
                        help="The game's tool_call_timeout: its calls then run on the tools' event loop.")
    parser.add_argument("--output", default="docs/benchmarks/long_run.json")
    return parser.parse_args()


def load_example():
    """examples/target_po.py as a module: the demo as its users run it."""
    spec = importlib.util.spec_from_file_location("target_po_example", REPOSITORY / "examples" / "target_po.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def process_resources() -> dict[str, Any]:
    """Resident memory (MiB), threads, open file descriptors and sockets of this process, now."""
    with open("/proc/self/status") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    from process_counts import descriptors, os_threads  # the tests' counts, read alike

    open_files, sockets = descriptors()
    names = [thread.name for thread in threading.enumerate()]
    return {
        "rss_mib": round(rss_kib / 1024, 1),
        "threads": len(names),
        "tools_threads": names.count(TOOLS_THREAD),
        "os_threads": os_threads(),
        "open_files": open_files,
        "sockets": sockets,
    }


def sampler(every: int, scratch: Path, samples: list[dict[str, Any]]):
    """A callback that appends a sample to ``samples`` at step 1, every ``every`` steps and at the end of training."""
    from transformers import TrainerCallback

    started = time.perf_counter()

    def sample(state) -> None:
        state_file = scratch / "trainer_state.json"
        state.save_to_json(str(state_file))  # what save_state() would write now
        samples.append({
            "step": state.global_step,
            "seconds": round(time.perf_counter() - started, 1),
            **process_resources(),
            "trainer_state_bytes": state_file.stat().st_size,
            "log_history_entries": len(state.log_history),
        })

    class Sample(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1 or state.global_step % every == 0:
                sample(state)

        def on_train_end(self, args, state, control, **kwargs):
            sample(state)  # after the last step's line and the run's summary, before train() lets anything go

    return Sample()


def train_sampled(example, argv: list[str], every: int) -> list[dict[str, Any]]:
    """Train the example with ``argv`` (its own defaults for the rest), sampled every ``every`` steps."""
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="targetpo-long-run-") as work:
        trainer = example.build_trainer([*argv, "--output_dir", work, "--disable_tqdm", "true"])
        trainer.add_callback(sampler(every, Path(work), samples))
        trainer.train()
        trainer.close()
    return samples


def growth(samples: list[dict[str, Any]], warmup_steps: int, logging_steps: int) -> dict[str, Any]:
    """Resident memory's growth from the end of the warm-up to the end, and the counts at both."""
    last = samples[-1]
    cap = last["step"] // 2  # a short run still has a stretch after its warm-up
    reference = next(sample for sample in samples if sample["step"] >= min(warmup_steps, cap))
    after = [sample for sample in samples if sample["step"] >= reference["step"]]
    counts = ("threads", "tools_threads", "os_threads", "open_files", "sockets")
    return {
        "warmup_step": reference["step"],
        "last_step": last["step"],
        "rss_mib_after_warmup": reference["rss_mib"],
        "rss_mib_at_end": last["rss_mib"],
        "rss_growth_percent": round(100 * (last["rss_mib"] - reference["rss_mib"]) / reference["rss_mib"], 2),
        "rss_max_growth_percent": round(
            100 * (max(sample["rss_mib"] for sample in after) - reference["rss_mib"]) / reference["rss_mib"], 2
        ),
        "counts_after_warmup": {name: reference[name] for name in counts},
        "counts_at_end": {name: last[name] for name in counts},
        "counts_flat": all(reference[name] == last[name] for name in counts),
        # One line per logging_steps steps, and the run's summary.
        "log_history_entries": last["log_history_entries"],
        "log_lines_expected": last["step"] // logging_steps + 1,
        "trainer_state_bytes_after_warmup": reference["trainer_state_bytes"],
        "trainer_state_bytes_at_end": last["trainer_state_bytes"],
        "trainer_state_bytes_per_new_log_line": round(
            (last["trainer_state_bytes"] - reference["trainer_state_bytes"])
            / max(1, last["log_history_entries"] - reference["log_history_entries"])
        ),
    }


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(REPOSITORY))  # this checkout's targetpo, whatever else is installed
    sys.path.insert(1, str(REPOSITORY / "tests"))  # the tests' process counts
    example = load_example()
    runs = {"reverse": (["--max_steps", str(args.steps)], args.steps, example.EMBEDDED_DEFAULTS["logging_steps"])}
    if args.tool_steps > 0:
        tools = ["--task", "guess", "--max_steps", str(args.tool_steps), "--tool_call_timeout", str(args.tool_call_timeout)]
        runs["guess"] = (tools, args.tool_steps, example.GUESS_DEFAULTS["logging_steps"])
    results = {}
    for task, (argv, steps, logging_steps) in runs.items():
        samples = train_sampled(example, argv, args.every)
        results[task] = {"steps": steps, "argv": argv, "summary": growth(samples, args.warmup_steps, logging_steps),
                         "samples": samples}
        print(json.dumps({"task": task, **results[task]["summary"]}), flush=True)
    results["after_both_runs"] = process_resources()  # both trainers closed
    print(json.dumps({"after_both_runs": results["after_both_runs"]}), flush=True)
    report(environment(every=args.every, warmup_steps=args.warmup_steps), results, args.output)


if __name__ == "__main__":
    main()
