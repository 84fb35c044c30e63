"""Rollout backends behind one interface (``base.py``): ``model.generate``, transformers' continuous batching, a vLLM
engine in each training process, or a ``vllm serve`` process. :func:`build_rollout_backend` picks the one the config
asks for."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn

from .base import (
    Completions,
    PendingCompletions,
    PromptImages,
    RolloutBackend,
    close_at_exit,
    completion_masks,
    pad_completions,
    unpadded_prompts,
)
from .sampling import SamplingSettings
from .server_auth import resolve_api_key
from .transformers_backend import TransformersBackend

__all__ = [
    "Completions",
    "PendingCompletions",
    "PromptImages",
    "RolloutBackend",
    "SamplingSettings",
    "TransformersBackend",
    "build_rollout_backend",
    "close_at_exit",
    "completion_masks",
    "pad_completions",
    "unpadded_prompts",
]


def build_rollout_backend(
    args: Any,
    accelerator: Any,
    policy: nn.Module,
    settings: SamplingSettings,
    generation_model: Callable[[], contextlib.AbstractContextManager[nn.Module]],
    sharded: bool,
    max_model_len: int | None,
    tokenizer: Any = None,
) -> RolloutBackend:
    """The backend the config asks for: ``use_vllm`` and ``vllm_mode`` choose among vLLM's two, and
    ``use_transformers_continuous_batching`` between transformers' two."""
    if not args.use_vllm and args.use_transformers_continuous_batching:
        return _continuous_batching_backend(args, accelerator, policy, settings, generation_model, sharded)
    if not args.use_vllm:
        return TransformersBackend(settings, generation_model, synced_gpus=sharded and accelerator.num_processes > 1)
    if args.vllm_mode == "server":
        return _server_backend(args, accelerator, policy, settings, generation_model)
    return _colocate_backend(args, accelerator, policy, settings, max_model_len, tokenizer)


def _continuous_batching_backend(
    args: Any,
    accelerator: Any,
    policy: nn.Module,
    settings: SamplingSettings,
    generation_model: Callable[[], contextlib.AbstractContextManager[nn.Module]],
    sharded: bool,
) -> RolloutBackend:
    """transformers' continuous-batching engine over the policy, refused where the policy's weights are sharded."""
    from .continuous_batching import ContinuousBatchingBackend

    if sharded and accelerator.num_processes > 1:
        raise ValueError(
            "use_transformers_continuous_batching=True cannot generate from sharded weights (DeepSpeed ZeRO-3, FSDP): "
            "the engine runs the model's forward passes on a thread of its own, as many as each process's requests "
            "need, while sharded weights make every forward pass a collective that all processes must run together. "
            "Set use_transformers_continuous_batching=False (model.generate steps the processes together), or use "
            "use_vllm=True."
        )
    return ContinuousBatchingBackend(
        settings, generation_model, policy, engine_settings=args.transformers_continuous_batching_config
    )


def _server_backend(
    args: Any,
    accelerator: Any,
    policy: nn.Module,
    settings: SamplingSettings,
    generation_model: Callable[[], contextlib.AbstractContextManager[nn.Module]],
) -> RolloutBackend:
    """A connection to a ``vllm serve`` process, refused where the served model would sample with the wrong head."""
    from .vllm_backend import head_apart_from_embeddings
    from .vllm_server import VLLMServerBackend

    if head_apart_from_embeddings(policy):
        raise ValueError(
            "The policy computes its output head with other weights than its input embeddings (PEFT trains a copy "
            "of one, modules_to_save, or adapts one of them), but its config ties the two "
            "(tie_word_embeddings=True): a vLLM server started from this model ties them too, and would sample "
            "with the wrong head. Use vllm_mode='colocate' (its engine holds both), or train from and serve a "
            "copy of the model saved with tie_word_embeddings=False (see docs/vllm.md)."
        )
    base_url = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
    return VLLMServerBackend(
        accelerator,
        settings,
        base_url,
        args.vllm_server_timeout,
        args.vllm_weight_transfer_backend,
        api_key=resolve_api_key(args.vllm_server_api_key),
        stall_timeout=args.vllm_server_stall_timeout,
        generation_model=generation_model,
        restart_grace_period=args.vllm_server_restart_grace_period,
    )


def _colocate_backend(
    args: Any,
    accelerator: Any,
    policy: nn.Module,
    settings: SamplingSettings,
    max_model_len: int | None,
    tokenizer: Any,
) -> RolloutBackend:
    """A vLLM engine in this process (one per training process), refused where it cannot run beside the trainer."""
    from .vllm_backend import VLLMColocateBackend

    if args.vllm_model_impl == "transformers":
        raise ValueError(
            "vllm_model_impl='transformers' cannot run in colocate mode: vLLM's transformers implementation wraps the "
            "transformers model classes of the whole process, and the trainer's own model (the same classes) then "
            "fails in its forward pass. Use vllm_model_impl='vllm', or serve the model with `--model-impl "
            "transformers` and vllm_mode='server'."
        )
    engine_kwargs: dict[str, Any] = {"model_impl": args.vllm_model_impl}
    if accelerator.num_processes > 1:
        if args.vllm_tensor_parallel_size > 1:
            # The processes of one tensor-parallel engine would have to submit identical requests.
            raise ValueError(
                "vllm_tensor_parallel_size > 1 in colocate mode is supported with one training process only; with "
                f"{accelerator.num_processes} processes use vllm_tensor_parallel_size=1 (one engine per process) or "
                "vllm_mode='server'."
            )
        # One engine per training process, joining the processes' existing torch.distributed world.
        engine_kwargs["distributed_executor_backend"] = "external_launcher"
    return VLLMColocateBackend(
        policy,
        settings,
        tokenizer,
        max_model_len=args.vllm_max_model_length or max_model_len,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        seed=args.seed + accelerator.process_index,
        **engine_kwargs,
    )
