"""What this process holds open, read from /proc: the counts a leak grows (tests/test_long_run.py and
benchmarks/long_run.py read them alike)."""

import os


def descriptors() -> tuple[int, int]:
    """This process's open file descriptors, and how many of them are sockets."""
    opened = os.listdir("/proc/self/fd")
    sockets = 0
    for descriptor in opened:
        try:
            sockets += os.readlink(f"/proc/self/fd/{descriptor}").startswith("socket:")
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return len(opened), sockets


def os_threads() -> int:
    """This process's threads as the OS counts them (Python's and those of native libraries)."""
    return len(os.listdir("/proc/self/task"))
