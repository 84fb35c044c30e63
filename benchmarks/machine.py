"""How busy the machine is: timings taken beside other work measure that work too, so benchmarks wait for quiet."""

from __future__ import annotations

import time


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
