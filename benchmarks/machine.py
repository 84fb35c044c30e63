"""How busy the machine is: timings taken beside other work measure that work too, so benchmarks wait for quiet."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: The model sizes the rollout and weight-sync benchmarks build: name -> (hidden size, layers, attention heads). Every
#: head is 32 or 64 wide, which vLLM's CPU attention accepts.
MODEL_SIZES = {
    "demo": (64, 2, 2),
    "small": (256, 4, 4),
    "medium": (512, 8, 8),
    "large": (768, 8, 12),
}


def cpu_busy(seconds: float) -> float:
    """The fraction of the machine's CPU time spent busy over the next ``seconds``, by anything running on it."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(field) for field in stat.readline().split()[1:9]]  # user .. steal
        return sum(ticks), ticks[3] + ticks[4]  # idle and iowait

    total, idle = sample()
    time.sleep(seconds)
    total_after, idle_after = sample()
    return 1 - (idle_after - idle) / max(1, total_after - total)


def wait_until_quiet(threshold: float, timeout: float) -> float:
    """Wait, at most ``timeout`` seconds, until the busy fraction is at most ``threshold``; return the last seen."""
    deadline = time.monotonic() + timeout
    while True:
        busy = cpu_busy(5.0)
        if busy <= threshold or time.monotonic() > deadline:
            return busy


def add_quiet_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings of :func:`run_when_quiet`."""
    parser.add_argument("--quiet", type=float, default=0.15,
                        help="Busy fraction of the machine's CPUs (ours idle) above which a run waits, then is redone.")
    parser.add_argument("--quiet_timeout", type=float, default=900, help="Seconds to wait for a quiet machine.")
    parser.add_argument("--retries", type=int, default=2, help="Times a run disturbed by other work is redone.")


def run_when_quiet(
    run: Callable[[int], dict[str, Any]], args: argparse.Namespace, disturbed: list[dict[str, Any]],
    busy_while: str | None = None,
) -> dict[str, Any]:
    """``run(attempt)`` once the machine is quiet, redone (``args.retries`` times at most) while other work kept the
    machine busy just before or after it, or during it as its result's ``busy_while`` field says. The runs redone go
    to ``disturbed``; the result kept records the busy fractions seen around it."""
    for attempt in range(args.retries + 1):
        busy_before = wait_until_quiet(args.quiet, args.quiet_timeout)
        result = run(attempt)
        result.update(busy_before=busy_before, busy_after=cpu_busy(5.0))
        busiest = max(busy_before, result["busy_after"], result[busy_while] if busy_while else 0.0)
        if busiest <= args.quiet or attempt == args.retries:
            return result
        disturbed.append(result)
    raise ValueError(f"--retries must be >= 0, got {args.retries}.")


def environment(**extra: Any) -> dict[str, Any]:
    """The package versions and the machine a benchmark ran on, for its results."""
    import torch
    import transformers

    described = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": _version("vllm"),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }
    return {**described, **extra}


def report(environment: dict[str, Any], results: Any, output: str | None) -> None:
    """Print the environment; with ``output``, also write it and the results there as JSON."""
    print(json.dumps(environment))
    if output:
        with open(output, "w") as handle:
            json.dump({"environment": environment, "results": results}, handle, indent=2)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


#: The repository these benchmarks belong to: the new side of a before-and-after comparison.
REPOSITORY = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def old_checkout(directory: Path, commit: str) -> Iterator[Path]:
    """A detached worktree of ``commit`` at ``directory`` (the old side of a comparison), removed and unregistered
    whatever happens."""
    subprocess.run(["git", "-C", str(REPOSITORY), "worktree", "add", "--detach", str(directory), commit],
                   check=True, capture_output=True)
    try:
        yield directory
    finally:
        git = ["git", "-C", str(REPOSITORY), "worktree"]
        subprocess.run([*git, "remove", "--force", str(directory)], check=False, capture_output=True)
        subprocess.run([*git, "prune"], check=False, capture_output=True)
