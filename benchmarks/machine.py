"""How busy the machine is: timings taken beside other work measure that work too, so benchmarks wait for quiet."""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Any


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
