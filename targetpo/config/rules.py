"""The config's rules beyond each field's own range: dict fields given as JSON, an output_dir that can be a directory,
the combinations of settings that need or contradict one another (a table of small named checks, each returning the
message it refuses with, in the order they are checked), and the vLLM settings a run leaves unused."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

#: Fields never shown in printed or logged configs.
SECRET_FIELDS = ("vllm_server_api_key",)
#: The vLLM settings only one vllm_mode reads: the server connection's, and the engine the trainer builds.
VLLM_MODE_SETTINGS = {
    "server": (
        "vllm_server_base_url",
        "vllm_server_host",
        "vllm_server_port",
        "vllm_server_timeout",
        "vllm_server_stall_timeout",
        "vllm_server_restart_grace_period",
        "vllm_server_api_key",
        "vllm_weight_transfer_backend",
    ),
    "colocate": (
        "vllm_gpu_memory_utilization",
        "vllm_tensor_parallel_size",
        "vllm_model_impl",
        "vllm_enable_sleep_mode",
        "vllm_max_model_length",
    ),
}
VLLM_MODE_SETTINGS_WHY = {
    "server": "the server's engine is set up by its own command line (targetpo-vllm-serve or vllm serve: "
    "--gpu-memory-utilization, --tensor-parallel-size, --max-model-len, ...).",
    "colocate": "the engine runs in the training processes, with no server to connect to.",
}
#: transformers_continuous_batching_config keys the trainer sets itself (ContinuousBatchingConfig fields).
TRAINER_SET_ENGINE_FIELDS = (
    "return_logprobs",
    "seed",
    "drop_unsupported_processors",
    "per_request_processors",
    "max_queue_size",
)
#: Dict-valued fields, which arrive as JSON strings from the command line.
JSON_FIELDS = (
    "model_init_kwargs",
    "generation_kwargs",
    "chat_template_kwargs",
    "transformers_continuous_batching_config",
)


#: Dict-valued fields that may also name a JSON file.
JSON_FILE_FIELDS = ("transformers_continuous_batching_config",)


def parse_json_fields(config: Any) -> None:
    """Each dict-valued field given as a JSON string (or, where allowed, a JSON file's path), parsed in place."""
    for name in JSON_FIELDS:
        value = getattr(config, name)
        if isinstance(value, str) and name in JSON_FILE_FIELDS and os.path.isfile(value):
            with open(value, encoding="utf-8") as file:
                value = file.read()
        if isinstance(value, str):
            try:
                setattr(config, name, json.loads(value))
            except json.JSONDecodeError as error:
                raise ValueError(f"`{name}` must be a dict or a JSON object string, got {value!r}: {error}") from error


def check_output_dir(config: Any) -> None:
    """Refuse an output_dir that cannot be a directory (an existing file, or below one) before any work."""
    if config.output_dir is None:
        return
    path = os.path.abspath(config.output_dir)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)  # the deepest part that exists must be a directory
    if not os.path.isdir(path):
        raise ValueError(
            f"output_dir={config.output_dir!r} cannot be a directory: {path!r} is an existing file. Checkpoints, logs "
            "and the saved model go in output_dir: choose a directory path (it is created if missing)."
        )


class Rule(NamedTuple):
    """A check of settings that relate to one another: ``check(config)`` is the message to refuse with, or None."""

    name: str
    check: Callable[[Any], str | None]


def use_former_names(config: Any) -> None:
    """A field set by its former name sets the field (use_transformers_paged: use_transformers_continuous_batching)."""
    if config.use_transformers_paged:
        config.use_transformers_continuous_batching = True


def _continuous_batching_or_vllm(config: Any) -> str | None:
    if config.use_transformers_continuous_batching and config.use_vllm:
        return (
            "use_transformers_continuous_batching=True generates with transformers' continuous-batching engine and "
            "use_vllm=True with vLLM: choose one."
        )
    return None


def _continuous_batching_sampling(config: Any) -> str | None:
    if not config.use_transformers_continuous_batching:
        return None
    penalty = (config.generation_kwargs or {}).get("repetition_penalty", 1.0) if config.repetition_penalty == 1 else 0
    if config.repetition_penalty != 1 or penalty != 1:
        return (
            "use_transformers_continuous_batching=True cannot honour repetition_penalty: the engine gives a logits "
            "processor only each request's last token, not the tokens it penalises. Set repetition_penalty=1.0, or "
            "set use_transformers_continuous_batching=False (model.generate honours it)."
        )
    if config.cache_implementation is not None:
        return (
            f"cache_implementation={config.cache_implementation!r} chooses model.generate's KV cache, and "
            "use_transformers_continuous_batching=True generates over the engine's own paged cache: unset "
            "cache_implementation, or set use_transformers_continuous_batching=False."
        )
    return None


def _continuous_batching_settings(config: Any) -> str | None:
    settings = config.transformers_continuous_batching_config
    if settings is None:
        return None
    if not isinstance(settings, dict):
        return f"transformers_continuous_batching_config must be a dict, got {type(settings).__name__}."
    from transformers.generation import ContinuousBatchingConfig

    known = {spec.name for spec in dataclasses.fields(ContinuousBatchingConfig)}
    unknown = sorted(key for key in settings if key not in known)
    if unknown:
        return (
            f"transformers_continuous_batching_config keys {unknown} are not ContinuousBatchingConfig fields "
            f"(page_size, num_blocks, max_batch_tokens, max_memory_percent, max_requests_per_batch, ...): remove them."
        )
    owned = sorted(key for key in settings if key in TRAINER_SET_ENGINE_FIELDS)
    if owned:
        return (
            f"transformers_continuous_batching_config keys {owned} are set by the trainer (the sampled tokens' "
            "log-probs are always returned, the engine samples from the run's seed, and a sampling setting the engine "
            "cannot honour is refused, never dropped): remove them."
        )
    return None


def _regex_needs_vllm(config: Any) -> str | None:
    if config.vllm_structured_outputs_regex is not None and not config.use_vllm:
        return (
            "vllm_structured_outputs_regex constrains vLLM's sampling: set use_vllm=True (model.generate has no "
            "regular-expression constraint)."
        )
    return None


def _hub_table_needs_completions(config: Any) -> str | None:
    if config.log_completions_hub_repo is not None and not config.log_completions:
        return (
            "log_completions_hub_repo pushes the completions table, which log_completions=False does not build: "
            "set log_completions=True or unset log_completions_hub_repo."
        )
    return None


def _synced_reference_needs_kl(config: Any) -> str | None:
    if config.sync_ref_model and config.beta == 0:
        return (
            "sync_ref_model=True updates the reference model of the KL term, which beta=0 does not load: set "
            "beta > 0 or sync_ref_model=False."
        )
    return None


def _importance_sampling_bounds(config: Any) -> str | None:
    low, high = config.vllm_importance_sampling_clip_min, config.importance_sampling_clip_max
    if low is not None and not low < high:
        return f"vllm_importance_sampling_clip_min ({low}) must be >= 0 and below the upper bound ({high})."
    return None


def _async_needs_a_server(config: Any) -> str | None:
    if config.async_rollouts and not (config.use_vllm and config.vllm_mode == "server"):
        return (
            "async_rollouts=True generates on a vLLM server while training goes on: set use_vllm=True and "
            "vllm_mode='server' (or async_rollouts=False)."
        )
    return None


def _one_head_kernel(config: Any) -> str | None:
    if config.use_liger_kernel and config.logps_head_kernel == "triton":
        return (
            f"use_liger_kernel=True computes the training log-probs with Liger's fused kernel, and "
            f"logps_head_kernel={config.logps_head_kernel!r} with another one: choose one (logps_head_kernel='torch' "
            "or 'auto' with Liger)."
        )
    return None


def _shared_prompts_or_packing(config: Any) -> str | None:
    if config.share_prompt_forward and config.padding_free:
        return (
            "share_prompt_forward=True reads each prompt once for its completions, padding_free=True packs every "
            "row's prompt and completion into one row: choose one."
        )
    return None


def _shared_prompts_keep_activations(config: Any) -> str | None:
    if config.share_prompt_forward and config.gradient_checkpointing:
        return (
            "share_prompt_forward=True continues the completions from the prompts' keys and values, which "
            "transformers does not keep under gradient checkpointing: set gradient_checkpointing=False or "
            "share_prompt_forward=False."
        )
    return None


# With max_tokens_per_micro_batch a micro-step trains in passes, each seeing part of its tokens; these need them all.
def _passes_and_entropy_ranking(config: Any) -> str | None:
    if config.max_tokens_per_micro_batch is not None and config.top_entropy_quantile < 1:
        return (
            f"max_tokens_per_micro_batch trains a micro-step in several passes, and top_entropy_quantile="
            f"{config.top_entropy_quantile} ranks each token's entropy against all of the micro-step's tokens at "
            "once. Unset one of them."
        )
    return None


def _passes_and_layerwise_optimisers(config: Any) -> str | None:
    optim = getattr(config.optim, "value", config.optim)
    if config.max_tokens_per_micro_batch is not None and (optim in ("lomo", "adalomo") or optim.endswith("_layerwise")):
        return (
            f"max_tokens_per_micro_batch runs several backward passes per micro-step, and optim={optim} "
            "updates the weights inside each backward pass. Choose another optimiser or unset "
            "max_tokens_per_micro_batch."
        )
    return None


def _passes_and_masked_entropy_bonus(config: Any) -> str | None:
    bonus = config.entropy_coef != 0 or config.use_adaptive_entropy
    if config.max_tokens_per_micro_batch is not None and bonus and config.off_policy_mask_threshold is not None:
        return (
            "max_tokens_per_micro_batch trains a micro-step in several passes, and the entropy bonus divides "
            "by the micro-step's trained tokens, which off_policy_mask_threshold decides pass by pass. Unset "
            "one of max_tokens_per_micro_batch, the entropy bonus (entropy_coef, use_adaptive_entropy) or "
            "off_policy_mask_threshold."
        )
    return None


def _entropy_coefficient_bounds(config: Any) -> str | None:
    if config.use_adaptive_entropy and not config.entropy_coef_min <= config.entropy_coef_max:
        return f"entropy_coef_min ({config.entropy_coef_min}) must not exceed entropy_coef_max ({config.entropy_coef_max})."
    return None


def _dict_fields(config: Any) -> str | None:
    for name in ("generation_kwargs", "model_init_kwargs"):
        value = getattr(config, name)
        if value is not None and not isinstance(value, dict):
            return f"{name} must be a dict, got {type(value).__name__}."
    return None


#: The combinations of settings the config refuses, checked in this order (each field's own range first).
RULES = (
    Rule("continuous batching or vLLM", _continuous_batching_or_vllm),
    Rule("continuous batching honours the sampling", _continuous_batching_sampling),
    Rule("continuous batching's own settings", _continuous_batching_settings),
    Rule("a sampling regex needs vLLM", _regex_needs_vllm),
    Rule("the Hub table needs the completions table", _hub_table_needs_completions),
    Rule("a synced reference needs the KL term", _synced_reference_needs_kl),
    Rule("importance-sampling bounds in order", _importance_sampling_bounds),
    Rule("async rollouts need a vLLM server", _async_needs_a_server),
    Rule("one head kernel", _one_head_kernel),
    Rule("shared prompts or packed rows", _shared_prompts_or_packing),
    Rule("shared prompts keep their activations", _shared_prompts_keep_activations),
    Rule("passes and the entropy ranking", _passes_and_entropy_ranking),
    Rule("passes and layer-wise optimisers", _passes_and_layerwise_optimisers),
    Rule("passes and the masked entropy bonus", _passes_and_masked_entropy_bonus),
    Rule("entropy coefficient bounds in order", _entropy_coefficient_bounds),
    Rule("dict fields", _dict_fields),
)


def check_combinations(config: Any) -> None:
    """Refuse settings that need or contradict other settings: the first of :data:`RULES` that fails."""
    for rule in RULES:
        message = rule.check(config)
        if message is not None:
            raise ValueError(message)


def warn_about_unused_vllm_settings(config: Any) -> None:
    """Name the vLLM settings the run leaves unused: every one without vLLM (e.g. a server's address with
    use_vllm=False), and one mode's settings in the other (the colocated engine's memory share in server mode)."""
    if not config.use_vllm:
        names = [spec.name for spec in dataclasses.fields(config) if spec.name.startswith("vllm_") and spec.init]
        if config.use_transformers_continuous_batching:  # its engine reports sampling log-probs too
            names = [name for name in names if not name.startswith("vllm_importance_sampling")]
        why = "with use_vllm=False: rollouts are generated with model.generate. Set use_vllm=True to generate "
        why += "with vLLM."
    else:
        other = "colocate" if config.vllm_mode == "server" else "server"
        names = list(VLLM_MODE_SETTINGS[other])
        why = f"with vllm_mode={config.vllm_mode!r}: {VLLM_MODE_SETTINGS_WHY[config.vllm_mode]}"
    defaults = {spec.name: spec.default for spec in dataclasses.fields(config)}
    unused = [
        f"{name}={'<hidden>' if name in SECRET_FIELDS else repr(getattr(config, name))}"
        for name in names
        if getattr(config, name) != defaults[name]
    ]
    if unused:
        # Here, the config's __post_init__, its __init__, the line that built it.
        warnings.warn(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect {why}", stacklevel=4)
