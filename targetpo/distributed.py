"""Collectives for prompt groups that are split over data-parallel processes."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's ``tensor`` concatenated along dim 0, in rank order, keeping the autograd graph.

    The backward pass sums each part's gradient over all processes and returns it to the process that owns the part.
    When every process computes the same loss on the gathered tensor, that sum is ``world_size`` times the part's
    gradient, which DDP's averaging over processes divides back out: the parameters receive exactly the gradient of
    the single-process loss on the whole batch.
    """
    if _world_size() == 1:
        return tensor
    # Not accelerate's gather: that one is not differentiable.
    return torch.cat(torch.distributed.nn.functional.all_gather(tensor.contiguous()))


def groups_span_processes(per_device_batch_size: int, num_generations: int, num_processes: int) -> bool:
    """Whether a step's prompt groups can be split over processes (each process then lacks whole groups)."""
    return num_processes > 1 and per_device_batch_size % num_generations != 0
