"""Naming the training process that was lost, when a collective fails because a peer went away.

A process killed by the kernel (out of memory, a preempted node) leaves no Python error behind: its peers' next
collective fails with the backend's own words (gloo: "Connection closed by peer [address]:port"), which name an
address, not a process. The survivors then meet at the rendezvous store every process group has: each says it is
alive, and those that do not answer within a few seconds are the lost ones. When the store itself is gone, so is
process 0, which hosts it.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed as dist
from transformers.trainer_utils import get_last_checkpoint

#: What the collective backends say when a peer went away (gloo; NCCL with its async error handling; the store).
LOST_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker crashing",
    "NCCL communicator was aborted",
    "remote process exited",
    "Broken pipe",
)
#: Seconds the survivors wait for each other at the store.
ROLL_CALL_SECONDS = 5.0
_KEY = "targetpo/alive/{rank}"


class LostProcessError(RuntimeError):
    """A training process went away (killed, out of memory, its machine lost) while the others trained."""


def is_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed because another process went away."""
    if isinstance(error, LostProcessError):
        return False
    text = str(error)
    return isinstance(error, (RuntimeError, ConnectionError, OSError)) and any(sign in text for sign in LOST_PEER_SIGNS)


def lost_processes(store: Any, rank: int, world_size: int, wait: float = ROLL_CALL_SECONDS) -> list[int]:
    """The processes that do not say they are alive at ``store`` within ``wait`` seconds (this one says it is)."""
    others = [other for other in range(world_size) if other != rank]
    try:
        store.set(_KEY.format(rank=rank), "1")
        deadline = time.monotonic() + wait
        while True:
            silent = [other for other in others if not store.check([_KEY.format(rank=other)])]
            if not silent or time.monotonic() >= deadline:
                return silent
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store answers no more: its host, process 0, is gone
        return [0]


def raise_if_a_process_was_lost(error: BaseException, step: int, output_dir: str) -> None:
    """Raise :class:`LostProcessError`, naming the lost processes and the checkpoint in ``output_dir`` to resume
    from, if ``error`` (met while training after ``step`` optimiser steps) is a collective that failed because a
    peer went away; otherwise return."""
    if not is_lost_peer(error) or not dist.is_available() or not dist.is_initialized():
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = _default_store()
    lost = lost_processes(store, rank, world_size) if store is not None else []
    who = f"Process{'es' if len(lost) > 1 else ''} {', '.join(map(str, lost))}" if lost else "Another process"
    last_checkpoint = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    resume = (
        f"resume from {last_checkpoint} (resume_from_checkpoint=True finds it)"
        if last_checkpoint
        else "no checkpoint was saved yet: start again (save_steps sets how often one is)"
    )
    raise LostProcessError(
        f"{who} (of {world_size}) went away while training (step {step}), so process {rank} stops too. A process "
        "that leaves no error of its own was killed from outside: the kernel's out-of-memory killer (see `dmesg`), a "
        f"preempted or lost machine, a signal. Once it can run again, {resume}. The backend said: {error}"
    ) from error


def _default_store() -> Any:
    """The process group's rendezvous store (torch keeps it private; None where a release has moved it)."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:  # noqa: BLE001 - no store to ask: the error names no process then
        return None
