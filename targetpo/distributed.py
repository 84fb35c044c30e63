"""Distributed plumbing: collectives for prompt groups split over processes, failures that stop every process, the
process group's teardown at exit, and the engine-specific handling of sharded models (DeepSpeed ZeRO, FSDP2) for
generation and for frozen models."""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils.memory import clear_device_cache
from torch import nn


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


# ---------------------------------------------------------------------------------------------------- failures
class PeerProcessError(RuntimeError):
    """Raised on every other process when one process failed in work that all of them pass through together."""


class PeerFloatingPointError(PeerProcessError, FloatingPointError):
    """A :class:`PeerProcessError` for a non-finite value: code that stops on FloatingPointError sees it everywhere."""


class PeerTimeoutError(PeerProcessError, TimeoutError):
    """A :class:`PeerProcessError` for a timeout (a server that never answered): code that handles TimeoutError sees
    it everywhere."""


#: The error each process raises when every failing process failed with the same kind of error.
_PEER_ERRORS = {"non-finite": PeerFloatingPointError, "timeout": PeerTimeoutError}


#: How much of a failing process's message the others repeat.
_MAX_REPORT_CHARS = 2000


@contextlib.contextmanager
def failures_reach_every_process(what: str, device: torch.device | str | None = None) -> Iterator[None]:
    """Stop every process, with a clear error, when the block raises on any of them.

    Wrap purely local work that precedes a collective: a process failing there alone would otherwise leave the others
    waiting in that collective until its timeout. The block must not run collectives itself (a failure inside one
    leaves the others waiting in it whatever happens next). On leaving the block every process takes part in one
    all-reduce of a failure flag (plus, only when a flag is set, a gather of short reports). The failing process then
    re-raises its own exception; every other process raises :class:`PeerProcessError` naming the failing process,
    ``what`` it was doing and its error. ``device`` holds the flag: the accelerator's device (NCCL needs it on the
    GPU). With one process nothing is exchanged and exceptions pass straight through.
    """
    if _world_size() == 1:
        yield
        return
    failure: Exception | None = None
    try:
        yield
    except Exception as error:  # noqa: BLE001 (not KeyboardInterrupt and the like: those stop every process anyway)
        failure = error
    _raise_if_any_process_failed(failure, what, device)


class ProcessGuard:
    """``guard(what, local=True)``: :func:`failures_reach_every_process` on this process's device, for local work.

    Work that runs collectives itself (``local=False``) is not guarded: after a failure inside it the other processes
    wait in its collectives whatever follows, and the failing one must not wait in another.
    """

    def __init__(self, device: torch.device | str | None):
        self.device = device

    def __call__(self, what: str, local: bool = True) -> contextlib.AbstractContextManager:
        return failures_reach_every_process(what, self.device) if local else contextlib.nullcontext()


def _raise_if_any_process_failed(failure: Exception | None, what: str, device: torch.device | str | None) -> None:
    """The collective half of :func:`failures_reach_every_process`; every process calls it at the same point."""
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=device)
    reports: list[tuple[str | None, str] | None] = [None] * dist.get_world_size()
    try:
        dist.all_reduce(flag)
        if flag.item() > 0:
            own = None if failure is None else (_kind(failure), _describe(failure))
            dist.all_gather_object(reports, own)
    except Exception:
        if failure is None:
            raise
        # The exchange broke (a peer died meanwhile): this process's own error is still the one to show.
    if failure is not None:
        raise failure
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    ranks = ", ".join(str(rank) for rank, _ in failed)
    details = "".join(f"\n  process {rank}: {text}" for rank, (_, text) in failed)
    kinds = {kind for _, (kind, _) in failed}
    error_type = _PEER_ERRORS.get(kinds.pop(), PeerProcessError) if len(kinds) == 1 else PeerProcessError
    raise error_type(
        f"Process{'es' if len(failed) > 1 else ''} {ranks} (of {len(reports)}) failed while {what}, so process "
        f"{dist.get_rank()} stops too (the traceback is in the failing process's output):{details}"
    )


def _kind(error: Exception) -> str | None:
    if isinstance(error, FloatingPointError):
        return "non-finite"
    if isinstance(error, TimeoutError):
        return "timeout"
    return None


def _describe(error: Exception) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_REPORT_CHARS else text[: _MAX_REPORT_CHARS - 3] + "..."


# ---------------------------------------------------------------------------------------------------- engines
def _uses_deepspeed(accelerator: Any) -> bool:
    return getattr(accelerator.state, "deepspeed_plugin", None) is not None


def _deepspeed_zero_stage(accelerator: Any) -> int:
    return int(accelerator.state.deepspeed_plugin.zero_stage or 0) if _uses_deepspeed(accelerator) else 0


def _uses_fsdp(accelerator: Any) -> bool:
    return getattr(accelerator.state, "fsdp_plugin", None) is not None


def shards_parameters(accelerator: Any) -> bool:
    """Whether each process holds only a shard of every weight (ZeRO-3, FSDP)."""
    return _deepspeed_zero_stage(accelerator) == 3 or _uses_fsdp(accelerator)


def check_engine_supported(accelerator: Any, passes_per_micro_step: bool = False) -> None:
    """Refuse engines whose sharded weights rollouts cannot use, before any work is done; with
    ``passes_per_micro_step`` (``max_tokens_per_micro_batch``), engines not set up for several backward passes in one
    micro-step."""
    if _uses_fsdp(accelerator) and not accelerator.is_fsdp2:
        raise ValueError(
            "FSDP version 1 is not supported: its flat-sharded parameters cannot be used by `generate`. Set "
            "`fsdp_version: 2` in the accelerate config (see accelerate_configs/fsdp2.yaml)."
        )
    if passes_per_micro_step and (_uses_deepspeed(accelerator) or _uses_fsdp(accelerator)):
        engine = "DeepSpeed" if _uses_deepspeed(accelerator) else "FSDP2"
        raise ValueError(
            f"max_tokens_per_micro_batch is not supported with {engine} yet: it runs several backward passes in one "
            "micro-step, and DeepSpeed's engine steps the optimiser at the backward of an accumulation boundary "
            "while FSDP2's gradient reduction is not checked for it here. Unset max_tokens_per_micro_batch (bound "
            "memory with per_device_train_batch_size instead), or train with DDP."
        )


def destroy_gloo_group_at_exit() -> None:
    """Have the default gloo process group destroyed when the interpreter exits, if the script has not done it.

    Left to the interpreter's own teardown, the group's C++ worker threads can still be releasing the tensors of
    the last collectives while Python finalises; a thread that needs Python then is ended mid-way, and the process
    aborts ("terminate called without an active exception") after a run that succeeded, now and then. atexit
    handlers run before that teardown, and destroying the group joins those threads. Only gloo (CPU runs): NCCL's
    destruction at exit is torch's own business. Registered once per process; does nothing if the group is gone.
    """
    global _destroy_registered
    if not _destroy_registered:
        atexit.register(_destroy_gloo_group)
        _destroy_registered = True


_destroy_registered = False


def _destroy_gloo_group() -> None:
    if dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend()):
        dist.destroy_process_group()


def prepare_frozen_model(accelerator: Any, model: nn.Module, micro_batch_size: int) -> nn.Module:
    """Place a frozen model (the reference, a reward model) for the policy's engine.

    Under ZeRO-3 and FSDP2 it is sharded like the policy, so its memory is split over the processes too; under ZeRO-1/2
    it is a DeepSpeed inference engine in the training precision; otherwise it is simply moved to the device.
    """
    model.eval()
    if _uses_deepspeed(accelerator):
        import deepspeed

        config = _deepspeed_frozen_config(accelerator, micro_batch_size)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine
    if _uses_fsdp(accelerator):
        plugin = accelerator.state.fsdp_plugin
        return fsdp2_shard_frozen(model, plugin.mixed_precision_policy, plugin.cpu_offload)
    return accelerator.prepare_model(model, evaluation_mode=True)


def fsdp2_shard_frozen(model: nn.Module, mp_policy: Any = None, offload_policy: Any = None) -> nn.Module:
    """Shard a frozen model with FSDP2: one unit per block its class declares unsplittable, plus the root.

    Not accelerate's preparation, which would also fix the shared plugin's wrap policy to this model's layer classes
    before the policy is wrapped (a reward model of another architecture would then decide how the policy is cut).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = {
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": offload_policy if isinstance(offload_policy, OffloadPolicy) else OffloadPolicy(),
    }
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules())[1:]:
        if type(module).__name__ in block_classes and not isinstance(module, FSDPModule):
            fully_shard(module, **options)
    fully_shard(model, **options)
    # FSDP2 leaves the root's weights gathered after forward, for the backward pass a frozen model never runs.
    model.set_reshard_after_forward(True)
    return model


def _deepspeed_frozen_config(accelerator: Any, micro_batch_size: int) -> dict[str, Any]:
    """An inference-only DeepSpeed config matching the policy's: ZeRO-3 stays ZeRO-3, other stages need no sharding."""
    train_zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
    }
    if accelerator.mixed_precision in ("bf16", "fp16"):
        config[accelerator.mixed_precision] = {"enabled": True}
    if train_zero.get("stage") == 3:
        config["zero_optimization"] = {"stage": 3}
        # Keep the policy's parameter offload; drop "auto" values, which only the training engine resolves.
        for key in ("offload_param", "stage3_param_persistence_threshold", "stage3_prefetch_bucket_size"):
            value = train_zero.get(key)
            if value is not None and value != "auto":
                config["zero_optimization"][key] = value
    return config


@contextlib.contextmanager
def full_model_for_generation(accelerator: Any, model: nn.Module, gather: bool = True) -> Iterator[nn.Module]:
    """The policy unwrapped from its engine, holding its full weights for as long as the context lasts.

    ``model`` is the engine-wrapped policy. Under ZeRO-3 and FSDP2 the weights are sharded; with ``gather`` they are
    gathered once for the whole ``generate`` call instead of layer by layer at every decoding step. Without it, or on
    other engines, the unwrapped policy is returned as it is (its own hooks gather what each forward needs).
    """
    unwrapped = accelerator.unwrap_model(model)
    if gather and _deepspeed_zero_stage(accelerator) == 3 and getattr(model, "optimizer", None) is not None:
        # DeepSpeed's own helper: gathers every parameter and lifts the per-layer fetch hooks meanwhile. It needs the
        # training engine (the hooks live on its optimizer); an evaluation-only engine generates layer by layer.
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(model):
            yield unwrapped
    elif gather and _uses_fsdp(accelerator):
        with fsdp2_unsharded(unwrapped, reshard_after_forward=accelerator.state.fsdp_plugin.reshard_after_forward):
            yield unwrapped
    else:
        yield unwrapped


@contextlib.contextmanager
def fsdp2_unsharded(model: nn.Module, reshard_after_forward: bool | int = True) -> Iterator[None]:
    """All of an FSDP2 model's parameters unsharded and kept so through any number of forward passes.

    On exit they are resharded and every FSDP unit reshards after forward as configured
    (``reshard_after_forward``, the plugin's setting; an int means resharding to a smaller group, which only the
    wrapping can set up, so it maps to True here).
    """
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    handles = [unit.unshard(async_op=True) for unit in units]
    for handle in handles:
        if handle is not None:
            handle.wait()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(bool(reshard_after_forward), recurse=False)


def empty_device_cache_if_due(every: int | None, global_step: int) -> None:
    """``torch_empty_cache_steps``: release the device's cached memory every ``every`` optimiser steps, as the
    Trainer's own training step does."""
    if every is not None and global_step % every == 0:
        clear_device_cache()
        if torch.backends.mps.is_available() and hasattr(torch.mps, "clear_graph_cache"):
            torch.mps.clear_graph_cache()
