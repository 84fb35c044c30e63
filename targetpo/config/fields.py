"""Configuration: the GRPO-family rollout settings and the Target Policy Optimization settings.

Field names follow the ones GRPO users already know, so that a GRPO script moves over by changing its imports.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import typing
from dataclasses import KW_ONLY, dataclass, field
from typing import Annotated, Any

from transformers import TrainingArguments

from ..functional import IMPORTANCE_SAMPLING_LEVELS, IMPORTANCE_SAMPLING_MODES, POLICY_GRADIENT_LOSSES, SCALE_REWARDS
from ..objectives.settings import warn_about_loss_settings
from ..step.layout import check_eval_batch_size, resolve_batch_layout
from .rules import (
    SECRET_FIELDS,
    check_combinations,
    check_output_dir,
    parse_json_fields,
    use_former_names,
    warn_about_unused_vllm_settings,
)

LOSS_TYPES = ("tpo", *POLICY_GRADIENT_LOSSES)
VLLM_MODES = ("server", "colocate")
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
VLLM_WEIGHT_TRANSFER_BACKENDS = ("auto", "nccl", "gloo")
#: What computes the chunked output head's log-probs and entropies from its logits.
LOGPS_HEAD_KERNELS = ("auto", "torch", "triton")


# --- Allowed values as data ---------------------------------------------------------------------------------------
# A field's range sits in its annotation, `Annotated[int, Range(at_least=1)]`, and its choices in its metadata's
# "choices" (which the command line checks too). They live outside the metadata's other keys because
# `HfArgumentParser` hands every metadata key to argparse, and it strips `Annotated` before reading the type.
@dataclass(frozen=True)
class Allowed:
    """What a field accepts; `why` is said after it in the error, `symbol` after the field's name."""

    _: KW_ONLY
    why: str = ""
    symbol: str = ""

    def admits(self, value: Any) -> bool:
        """Whether the field may hold `value`."""
        raise NotImplementedError

    def refusal(self, name: str, value: Any, optional: bool) -> str:
        """The error message for `value`: the field, what it accepts (and why), and the value given."""
        named = f"{name} ({self.symbol})" if self.symbol else name
        allowed = f"{self} or None" if optional else str(self)
        why = f" ({self.why})" if self.why else ""
        return f"{named} must be {allowed}{why}, got {value!r}."


@dataclass(frozen=True)
class Range(Allowed):
    """Numbers within bounds: `at_least` and `at_most` include the edge, `above` and `below` leave it out."""

    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    says: str = ""  # the range in words, where a message has always worded it so

    def __post_init__(self):
        lows, highs = (self.at_least, self.above), (self.at_most, self.below)
        if None not in lows or None not in highs or lows == highs == (None, None):
            raise ValueError(f"Range{lows + highs}: give one bound or two, at most one on each side.")

    def admits(self, value: Any) -> bool:
        """Whether `value` lies within every bound (NaN lies within none, and an infinity is refused: no field is
        boundless, and None is how a field says "no limit")."""
        return (
            math.isfinite(value)
            and (self.at_least is None or value >= self.at_least)
            and (self.above is None or value > self.above)
            and (self.at_most is None or value <= self.at_most)
            and (self.below is None or value < self.below)
        )

    def __str__(self) -> str:
        if self.says:
            return self.says
        low = self.above if self.at_least is None else self.at_least
        high = self.below if self.at_most is None else self.at_most
        if low is not None and high is not None:
            return f"in {'(' if self.at_least is None else '['}{low}, {high}{')' if self.at_most is None else ']'}"
        if low is not None:
            return f"> {low}" if self.at_least is None else f">= {low}"
        return f"< {high}" if self.at_most is None else f"<= {high}"


@dataclass(frozen=True)
class OneOf(Allowed):
    """One of a few values; for a field whose command-line spelling argparse's `choices` cannot check."""

    values: tuple

    def admits(self, value: Any) -> bool:
        """Whether `value` is one of the values."""
        return value in self.values

    def __str__(self) -> str:
        return f"one of {self.values}"


class FieldRules(typing.NamedTuple):
    """What one field accepts: each rule, and whether None is accepted besides (its type is optional)."""

    rules: tuple[Allowed, ...]
    optional: bool


@functools.cache
def field_rules(config_class: type) -> dict[str, FieldRules]:
    """The rules of each field of a config class that has any: `Allowed` annotations and metadata choices.

    `TrainingArguments`' own fields are left to its own checks (some take values beside their listed choices).
    """
    hints = typing.get_type_hints(config_class, include_extras=True)
    trainer_fields = {trainer_field.name for trainer_field in dataclasses.fields(TrainingArguments)}
    table = {}
    for config_field in dataclasses.fields(config_class):
        hint = hints[config_field.name]
        rules = [extra for extra in getattr(hint, "__metadata__", ()) if isinstance(extra, Allowed)]
        if "choices" in config_field.metadata and config_field.name not in trainer_fields:
            rules.append(OneOf(tuple(config_field.metadata["choices"])))
        if rules:
            value_type = typing.get_args(hint)[0] if hasattr(hint, "__metadata__") else hint
            table[config_field.name] = FieldRules(tuple(rules), type(None) in typing.get_args(value_type))
    return table


def check_field_values(config: Any) -> None:
    """Raise a ValueError for the first field whose value its rules do not accept; changes nothing."""
    for name, (rules, optional) in field_rules(type(config)).items():
        value = getattr(config, name)
        if value is None and optional:
            continue
        for rule in rules:
            try:
                admitted = rule.admits(value)
            except TypeError:  # a value of the wrong type, such as None for a required number
                admitted = False
            if not admitted:
                raise ValueError(rule.refusal(name, value, optional))


def scale_rewards_name(scale: str | bool) -> str | bool:
    """scale_rewards as TRL takes it: True and False (also as command-line strings) name 'group' and 'none'."""
    if isinstance(scale, str):
        scale = {"true": True, "false": False}.get(scale.lower(), scale)
    if isinstance(scale, bool):
        return "group" if scale else "none"
    return scale


def close_names(given: str, known: typing.Iterable[str], limit: int = 3) -> list[str]:
    """The known names a misspelt `given` most likely meant, best first: names whose words' initials spell it (lr:
    learning_rate), names that begin with it (what an abbreviation would have matched), then close spellings."""
    known = list(known)
    initials = [name for name in known if "".join(word[:1] for word in name.split("_")) == given]
    extended = [name for name in known if name.startswith(given)]
    spelled = difflib.get_close_matches(given, known, n=limit)
    return list(dict.fromkeys([*initials, *extended, *spelled]))[:limit]


def either(names: typing.Sequence[str]) -> str:
    """`a`, `a or b`, `a, b or c`."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


#: The command line's sections (--help), in order, and the config fields each lists; `targetpo.cli.FlagParser` reads
#: it. TrainingArguments' own fields follow in a last section, the Trainer's.
# fmt: off
FLAG_GROUPS = {
    "TPO": ("loss_type", "tpo_target_temperature", "tpo_length_normalize_logps"),
    "model": (
        "model_init_kwargs", "trust_remote_code", "cast_lm_head_to_fp32", "router_aux_loss_coef", "disable_dropout",
    ),
    "data": ("shuffle_dataset",),
    "rollouts and sampling": (
        "num_generations", "num_generations_eval", "generation_batch_size", "steps_per_generation", "num_iterations",
        "max_prompt_length", "max_completion_length", "mask_truncated_completions", "temperature", "top_p", "top_k",
        "min_p", "repetition_penalty", "generation_kwargs", "chat_template_kwargs", "cache_implementation",
        "use_transformers_continuous_batching", "transformers_continuous_batching_config", "use_transformers_paged",
    ),
    "vLLM": (
        "use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
        "vllm_server_stall_timeout", "vllm_server_restart_grace_period", "vllm_server_api_key",
        "vllm_weight_transfer_backend", "async_rollouts", "max_staleness",
        "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_model_impl", "vllm_structured_outputs_regex",
        "vllm_group_port", "vllm_enable_sleep_mode", "vllm_max_model_length", "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_cap",
    ),
    "tools and environments": ("max_tool_calling_iterations", "tool_call_timeout", "tool_call_concurrency"),
    "rewards": ("reward_weights", "scale_rewards", "multi_objective_aggregation"),
    "KL, regularisers and the GRPO-family losses": (
        "beta", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "use_bias_correction_kl",
        "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
        "entropy_target", "top_entropy_quantile", "off_policy_mask_threshold", "epsilon", "epsilon_high", "delta",
        "importance_sampling_level", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
        "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
    ),
    "memory and speed": (
        "logps_chunk_size", "padding_free", "share_prompt_forward", "max_tokens_per_micro_batch", "logps_head_kernel",
        "skip_zero_gradient_completions", "pad_to_multiple_of", "ds3_gather_for_generation",
    ),
    "logging": (
        "log_completions", "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo",
        "log_multimodal", "warn_after_uninformative_rollouts",
    ),
}
# fmt: on


@dataclass
class GRPOConfig(TrainingArguments):
    """Training arguments for group-sampling RL trainers: rollout, sampling, reward and logging settings.

    Each optimisation step sees ``per_device_train_batch_size * world_size`` completions. A rollout generates
    ``generation_batch_size`` completions (``num_generations`` per prompt) and serves ``steps_per_generation``
    optimisation steps, each repeated ``num_iterations`` times.
    """

    # --- Defaults that suit RL fine-tuning rather than supervised training -------------------------------------
    learning_rate: Annotated[float, Range(at_least=0)] = field(
        default=1e-6, metadata={"help": "The initial learning rate for the optimizer."}
    )
    logging_steps: float = field(default=10, metadata={"help": "Log every X update steps."})
    dataloader_pin_memory: bool = field(
        default=False, metadata={"help": "Pin dataloader memory. Off: batches are raw rows, tokenised at rollout."}
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={
            "help": "Keep every dataset column: reward functions receive the extra columns as keyword arguments."
        },
    )

    # --- Model --------------------------------------------------------------------------------------------------
    model_init_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when the model is given as an id or path (JSON)."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Allow models and tokenizers (the policy's and reward models') whose repository ships its own "
            "Python code to run it. Off unless asked: that code runs with your permissions."
        },
    )
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Compute the output head (policy and reference) in float32 while the rest of the model runs in "
            "its own precision: more exact token log-probs under bf16. A head tied to the input embeddings keeps "
            "sharing them in their dtype and casts them inside each forward pass."
        },
    )
    router_aux_loss_coef: Annotated[float, Range(at_least=0)] = field(
        default=0.001,
        metadata={
            "help": "Mixture-of-experts models: weight of the router's load-balancing loss added to the training "
            "loss (0 switches it off). No effect on other models."
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={"help": "Set every dropout probability to 0 in the policy and the reference model."},
    )

    # --- Data ---------------------------------------------------------------------------------------------------
    shuffle_dataset: bool = field(
        default=True, metadata={"help": "Shuffle the training prompts (each epoch in a new order, from the seed)."}
    )
    pad_to_multiple_of: Annotated[int | None, Range(at_least=1)] = field(
        default=None,
        metadata={
            "help": "Pad prompt and completion token ids to a multiple of this length (e.g. 8 for tensor cores)."
        },
    )

    # --- Rollout ------------------------------------------------------------------------------------------------
    num_generations: Annotated[
        int, Range(at_least=2, says="at least 2", why="a group needs two completions to compare")
    ] = field(default=8, metadata={"help": "Completions sampled per prompt (K, the group size)."})
    num_generations_eval: Annotated[int | None, Range(at_least=1)] = field(
        default=None,
        metadata={"help": "Completions sampled per prompt in evaluation (fewer saves time). None: num_generations."},
    )
    generation_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Completions generated per rollout, over all processes. Defaults to "
            "per_device_train_batch_size * world_size * steps_per_generation. Set this or steps_per_generation; both "
            "only where they agree."
        },
    )
    steps_per_generation: Annotated[int | None, Range(at_least=1)] = field(
        default=None,
        metadata={
            "help": "Optimisation micro-steps served by one rollout (default gradient_accumulation_steps: one rollout "
            "per optimiser step). Set this or generation_batch_size; both only where they agree."
        },
    )
    num_iterations: Annotated[int, Range(at_least=1)] = field(
        default=1, metadata={"help": "Times each step batch of a rollout is optimised on (epochs per rollout)."}
    )
    max_prompt_length: Annotated[int | None, Range(at_least=1)] = field(
        default=512, metadata={"help": "Prompts longer than this many tokens keep their last tokens. None: no limit."}
    )
    max_completion_length: Annotated[int, Range(at_least=1)] = field(
        default=256, metadata={"help": "Maximum number of generated tokens."}
    )
    mask_truncated_completions: bool = field(
        default=False,
        metadata={"help": "Treat completions that hit max_completion_length without EOS as invalid (no loss, q = 0)."},
    )

    # --- Sampling -----------------------------------------------------------------------------------------------
    temperature: Annotated[float, Range(above=0)] = field(
        default=1.0, metadata={"help": "Sampling temperature; log-probs are computed at the same temperature."}
    )
    top_p: Annotated[float, Range(above=0, at_most=1)] = field(
        default=1.0, metadata={"help": "Nucleus sampling mass. 1.0 disables it."}
    )
    top_k: Annotated[int, Range(at_least=0, why="0 disables it")] = field(
        default=0, metadata={"help": "Top-k sampling. 0 disables it."}
    )
    min_p: Annotated[float | None, Range(at_least=0, at_most=1)] = field(
        default=None, metadata={"help": "Minimum token probability relative to the top one."}
    )
    repetition_penalty: Annotated[float, Range(above=0)] = field(
        default=1.0, metadata={"help": "Repetition penalty. 1.0 disables it."}
    )
    cache_implementation: str | None = field(
        default=None,
        metadata={
            "help": "Generation with `model.generate`: the KV-cache implementation (e.g. 'static'). None: default."
        },
    )
    use_transformers_continuous_batching: bool = field(
        default=False,
        metadata={
            "help": "Without vLLM: generate rollouts with transformers' continuous-batching engine (paged KV cache, "
            "each completion a request of its own) instead of padded `model.generate` batches. Refuses sampling "
            "settings the engine cannot honour (repetition_penalty, ...); see docs/backends.md."
        },
    )
    transformers_continuous_batching_config: dict | str | None = field(
        default=None,
        metadata={
            "help": "Settings of the continuous-batching engine: `ContinuousBatchingConfig` fields as a dict, a JSON "
            'string or a JSON file\'s path, e.g. \'{"page_size": 64, "num_blocks": 512}\'. Unset: a cache sized to '
            "each rollout's requests."
        },
    )
    use_transformers_paged: bool = field(
        default=False, metadata={"help": "Former name of use_transformers_continuous_batching (sets it)."}
    )
    generation_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra sampling settings for rollouts (JSON): `GenerationConfig` fields, or `vllm.SamplingParams` "
            "fields with use_vllm=True, e.g. '{\"suppress_tokens\": [3]}'. A key spelling a sampling field above "
            "(temperature, top_p, ...) is used everywhere when that field is at its default, and refused when they "
            "differ; see docs/trainer.md."
        },
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={
            "help": "Extra keyword arguments for every `apply_chat_template` call (JSON), e.g. "
            "'{\"enable_thinking\": false}'."
        },
    )
    max_tool_calling_iterations: Annotated[int | None, Range(at_least=0, why="None: no limit")] = field(
        default=None,
        metadata={
            "help": "With tools or an environment: the most rounds of tool calls per sample. A sample still calling "
            "tools after that many rounds ends there, truncated. None: no limit but max_completion_length."
        },
    )
    tool_call_timeout: Annotated[float | None, Range(above=0, why="None: no limit")] = field(
        default=None,
        metadata={
            "help": "With tools or an environment: seconds one tool call may take. A call that takes longer is "
            "answered with an error message the model reads (counted in tools/failure_frequency) and the rollout "
            "goes on; a sync tool's thread, which Python cannot stop, is left to finish beside later calls, so shared "
            "tools must then be thread-safe. None: no limit."
        },
    )
    tool_call_concurrency: Annotated[int, Range(at_least=1)] = field(
        default=1,
        metadata={
            "help": "With tools or an environment: how many sync tool calls of different samples may run at once, "
            "each on a thread of its own (a sample's own calls stay in order; different samples' async calls run "
            "side by side). "
            "1 runs them one after another. Above 1, tools shared by samples must be thread-safe."
        },
    )
    logps_chunk_size: Annotated[int, Range(at_least=0, why="0 disables chunking")] = field(
        default=512,
        metadata={
            "help": "Compute token log-probs from the final hidden states this many completion positions at a time, "
            "never materialising the (batch, length, vocab) logits, and skip padding positions. 0: one full logits "
            "tensor (always the case under ZeRO-3/FSDP2 and, with a warning, for models whose logits are not the "
            "output head applied to the final hidden states: post-processed logits, or a head that transforms the "
            "hidden states first, as BERT-family *ForCausalLM models do; a probe of the model's forward pass at "
            "start-up checks)."
        },
    )
    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Compute the training log-probs (the policy's, the old policy's, the reference's) with each "
            "micro-batch packed into one row of its real tokens, each sequence's position ids restarting at 0: no "
            "compute on padding, the output head only at completion positions, the same log-probs. Models and "
            "inputs that cannot be packed exactly (images, recurrent or chunked-attention layers, attention masks "
            "built without the position ids) keep the padded rows, with a warning saying why. Fastest under flash "
            "attention; sdpa and eager attention build the packed row's whole attention mask."
        },
    )
    share_prompt_forward: bool = field(
        default=False,
        metadata={
            "help": "Compute the training log-probs (the policy's, the old policy's, the reference's) with each prompt "
            "read once for the consecutive rows that share it (a group's completions): a forward pass over the "
            "prompts keeps their keys and values, and the completions continue from them, as generation does. The "
            "same log-probs and gradients as the padded rows, for less compute where prompts are long next to "
            "completions. Models that do not continue exactly from returned keys and values (sliding windows, "
            "rotary embeddings that rescale with the length, ...), images, "
            "mixture-of-experts router losses and logps_chunk_size=0 keep the padded rows, with a warning saying "
            "why. With dropout on (disable_dropout=False), the rows that share a prompt share its dropout masks. Not "
            "with padding_free or gradient checkpointing."
        },
    )
    max_tokens_per_micro_batch: Annotated[int | None, Range(at_least=1, why="None: one pass per micro-step")] = field(
        default=None,
        metadata={
            "help": "Train each micro-step's rows (per_device_train_batch_size of them) in forward and backward "
            "passes of at most this many tokens (prompt and completion tokens, packed with padding_free, else the "
            "rows times the longest prompt plus the longest completion), whose gradients add up to the micro-step's: "
            "a large per_device_train_batch_size with long completions of mixed lengths then fits in memory without "
            "padding every pass to the longest. The passes without gradient (old, reference log-probs) are cut the "
            "same way. Must hold one sequence of max_prompt_length + max_completion_length tokens. TPO keeps each "
            "prompt group in one pass when num_generations such sequences fit, and otherwise trains its groups "
            "across passes from their softmax computed ahead (one more pass without gradient per rollout, and, once "
            "the weights moved, one over each micro-step's rows before it trains them). Not with DeepSpeed, FSDP, "
            "top_entropy_quantile < 1, optimisers that step inside backward (LOMO, layer-wise GaLore), nor the "
            "entropy bonus together with off_policy_mask_threshold. None: one pass per micro-step."
        },
    )
    logps_head_kernel: str = field(
        default="auto",
        metadata={
            "help": "What computes a chunked plain linear output head's token log-probs and entropies from its "
            "logits: 'torch' (float32 logits, a written-out backward pass), 'triton' (fused Triton kernels that "
            "read the logits in the dtype the head computes them in, bf16 staying bf16 (bf16 weights, or bf16=True "
            "autocast over float32 weights), with float32 arithmetic, in the forward and backward passes; needs a "
            "GPU), or 'auto' (the default): 'triton' on an NVIDIA GPU of compute capability 8.0 or above where "
            "Triton is installed, its kernels run and they apply, 'torch' everywhere else, without a warning (but "
            "for kernels that fail to run on such a GPU). Where an explicit "
            "'triton' cannot apply (logps_chunk_size=0, sharded weights, an adapted, quantised, hooked or "
            "post-processed head, also one hooked after set-up) a warning says so and torch computes the head.",
            "choices": LOGPS_HEAD_KERNELS,
        },
    )
    skip_zero_gradient_completions: bool = field(
        default=True,
        metadata={
            "help": "Leave out of the training forward and backward passes the completions whose gradient is exactly "
            "zero: invalid ones, groups with fewer than two valid members, (GRPO) zero advantages and (TPO) groups "
            "whose scores are all equal while the weights are still those of the rollout (with disable_dropout). The "
            "gradient is unchanged up to rounding; the logged loss then leaves out those groups' constant terms. Only "
            "with beta=0, no entropy bonus, top_entropy_quantile=1 and no mixture-of-experts router loss (those terms "
            "reach every completion)."
        },
    )
    ds3_gather_for_generation: bool = field(
        default=True,
        metadata={
            "help": "Under DeepSpeed ZeRO-3 or FSDP2, gather the sharded weights once per rollout and generate with "
            "the full model (fast). False generates layer by layer, gathering each layer at every decoding step: "
            "much slower, but the full model never has to fit on one device."
        },
    )

    # --- vLLM rollouts ----------------------------------------------------------------------------------------
    use_vllm: bool = field(
        default=False,
        metadata={"help": "Generate rollouts with vLLM (pip install 'targetpo[vllm]') instead of `model.generate`."},
    )
    vllm_mode: str = field(
        default="server",
        metadata={
            "help": "'server': generate through a `vllm serve` process the user starts on other devices (see "
            "`targetpo-vllm-serve`); 'colocate': an in-process vLLM engine sharing each training process's device.",
            "choices": VLLM_MODES,
        },
    )
    vllm_server_base_url: str | None = field(
        default=None,
        metadata={"help": "Server mode: the server's URL, e.g. 'http://10.0.0.2:8000'. Overrides host and port."},
    )
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "Server mode: the server's host."})
    vllm_server_port: int = field(default=8000, metadata={"help": "Server mode: the server's port."})
    vllm_server_timeout: float = field(
        default=240.0, metadata={"help": "Server mode: seconds to wait for the server to come up before failing."}
    )
    vllm_server_stall_timeout: Annotated[float | None, Range(above=0, why="None: no limit")] = field(
        default=120.0,
        metadata={
            "help": "Server mode: seconds the server may leave its health check unanswered while the trainer waits "
            "on a generation or a weight update before every process stops with an error naming the server. Long "
            "generations of a live server are never cut off: it answers its health check meanwhile. None: wait "
            "for as long as it takes."
        },
    )
    vllm_server_restart_grace_period: Annotated[float, Range(at_least=0)] = field(
        default=0.0,
        metadata={
            "help": "Server mode: seconds to wait for a server that went away mid-run (killed, restarted, stalled "
            "past vllm_server_stall_timeout) to answer again. Once it does, the trainer opens a new weight transfer, "
            "pushes the current weights and sends the lost requests again, so nothing is sampled from other weights "
            "than the policy's. 0: every process stops at once with an error naming the server."
        },
    )
    vllm_server_api_key: str | None = field(
        default=None,
        repr=False,  # kept out of printed and logged configs (see to_dict)
        metadata={
            "help": "Server mode: the key the server requires (`targetpo-vllm-serve --api-key`, or VLLM_API_KEY in "
            "its environment), sent as `Authorization: Bearer <key>` on every request. None: VLLM_API_KEY from the "
            "training processes' environment, if set. Left out of pickled configs (training_args.bin)."
        },
    )
    vllm_weight_transfer_backend: str = field(
        default="auto",
        metadata={
            "help": "Server mode: vLLM's weight-transfer engine, as the server was started with "
            "(--weight-transfer-config): 'nccl' between GPUs, 'gloo' on CPUs; 'auto' picks 'nccl' when the trainer "
            "has a GPU.",
            "choices": VLLM_WEIGHT_TRANSFER_BACKENDS,
        },
    )
    async_rollouts: bool = field(
        default=False,
        metadata={
            "help": "Server mode: generate the next rollout while the current one trains (with tools, environments "
            "or rollout_func, its episodes play on a thread of their own). Weight pushes pause the in-flight "
            "requests, which go on with the new weights; the importance weights correct for samples drawn from older "
            "weights."
        },
    )
    max_staleness: Annotated[int, Range(at_least=1, why="in optimiser steps")] = field(
        default=1,
        metadata={
            "help": "With async_rollouts: the most optimiser steps a rollout's generation may start before it is "
            "trained on (>= 1)."
        },
    )
    vllm_gpu_memory_utilization: Annotated[float, Range(above=0, at_most=1)] = field(
        default=0.3,
        metadata={"help": "Colocate mode: fraction of the device's memory the engine may take (weights + KV cache)."},
    )
    vllm_tensor_parallel_size: Annotated[int, Range(at_least=1)] = field(
        default=1, metadata={"help": "Colocate mode: devices one engine spans (tensor parallelism)."}
    )
    vllm_model_impl: str = field(
        default="vllm",
        metadata={
            "help": "Colocate mode: vLLM's model implementation, 'vllm' (its own) or 'auto'. 'transformers' is refused "
            "in colocate mode (it would wrap the trainer's own model classes); with a server pass --model-impl "
            "transformers to `vllm serve` instead.",
            "choices": ("vllm", "transformers", "auto"),
        },
    )
    vllm_structured_outputs_regex: str | None = field(
        default=None,
        metadata={
            "help": "With vLLM: constrain every completion to match this regular expression (in multi-turn rollouts, "
            "every model turn: each turn is one request to the engine). None: free."
        },
    )
    vllm_group_port: int = field(
        default=51216,
        metadata={
            "help": "Not used: server-mode weight transfer goes through vLLM's own endpoints, which pick the port "
            "(see docs/vllm.md). Kept so GRPO configs that set it still load."
        },
    )
    vllm_enable_sleep_mode: bool = field(
        default=False,
        metadata={
            "help": "Colocate mode: free the engine's memory during the optimiser step. Refused on a platform where "
            "vLLM has no sleep mode (the CPU)."
        },
    )
    vllm_max_model_length: int | None = field(
        default=None,
        metadata={
            "help": "Colocate mode: the engine's context length. Defaults to max_prompt_length + max_completion_length."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Weight each token's gradient by the truncated ratio of the trainer's to vLLM's sampling "
            "probability (or transformers' continuous-batching engine's, with use_transformers_continuous_batching), "
            "correcting for the small differences between the two implementations. Switched off, with "
            "a warning, when sampling settings reshape the distribution (top-p, top-k, min-p, penalties, ...)."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="token_truncate",
        metadata={
            "help": "How the importance weights are formed: per token or per whole completion ('token_*', "
            "'sequence_*'), and kept within the bounds by clamping ('*_truncate') or by zeroing the weights outside "
            "them ('*_mask').",
            "choices": IMPORTANCE_SAMPLING_MODES,
        },
    )
    vllm_importance_sampling_clip_max: Annotated[float | None, Range(above=0)] = field(
        default=None,
        metadata={"help": "Upper bound of the importance weights. None: vllm_importance_sampling_cap."},
    )
    vllm_importance_sampling_clip_min: Annotated[float | None, Range(at_least=0)] = field(
        default=None, metadata={"help": "Lower bound of the importance weights. None: no lower bound."}
    )
    vllm_importance_sampling_cap: Annotated[
        float, Range(at_least=1, why="to switch the correction off set vllm_importance_sampling_correction=False")
    ] = field(
        default=2.0,
        metadata={
            "help": "Upper bound of the importance weights (>= 1) when vllm_importance_sampling_clip_max is None."
        },
    )

    # --- Loss ---------------------------------------------------------------------------------------------------
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "The policy loss: 'tpo' (cross-entropy to the target q) or a GRPO-family loss over the same "
            "rollouts: 'grpo' (clipped surrogate, token mean per sequence), 'dapo' (token sum over the rollout's mean "
            "valid-token count per micro-batch, all processes), 'dr_grpo' (token sum over a constant batch x max_completion_length), 'bnpo' (token "
            "mean of the local batch), 'cispo' (clipped importance weights on the log-probs), 'sapo' (soft gate), "
            "'luspo' (length-scaled sequence ratios) or 'vespo' (smooth sequence weights).",
            "choices": LOSS_TYPES,
        },
    )
    beta: Annotated[float, Range(at_least=0)] = field(
        default=0.0, metadata={"help": "Weight of the KL penalty to the reference model. 0 loads no reference model."}
    )
    epsilon: Annotated[float, Range(at_least=0, below=1, why="the ratio is clipped at 1 - epsilon")] = field(
        default=0.2, metadata={"help": "Lower clipping range of the importance ratio."}
    )
    epsilon_high: Annotated[float | None, Range(at_least=0, why="None: epsilon")] = field(
        default=None,
        metadata={
            "help": "Upper clipping range of the importance ratio; defaults to epsilon (DAPO recommends 0.28). With "
            "loss_type='cispo' it is the cap on the importance weights (5.0 is recommended)."
        },
    )
    delta: Annotated[float | None, Range(above=0)] = field(
        default=None,
        metadata={
            "help": "Two-sided clipping: also cap the unclipped ratio at delta (> 1 + epsilon_high). None: off. For "
            "the clipped surrogates ('grpo', 'dapo', 'dr_grpo', 'bnpo', 'luspo')."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "'token': one importance ratio per token; 'sequence': one per sequence, the exp of the mean token "
            "log-ratio (GSPO). For the GRPO-family losses; TPO has no ratio.",
            "choices": IMPORTANCE_SAMPLING_LEVELS,
        },
    )
    sapo_temperature_pos: Annotated[float, Range(above=0)] = field(
        default=1.0, metadata={"help": "loss_type='sapo': gate temperature of tokens with a positive advantage."}
    )
    sapo_temperature_neg: Annotated[float, Range(above=0)] = field(
        default=1.05, metadata={"help": "loss_type='sapo': gate temperature of tokens with a non-positive advantage."}
    )
    vespo_k_pos: Annotated[float, Range(at_least=0)] = field(
        default=2.0, metadata={"help": "loss_type='vespo': power k of the weight w^k exp(lambda (1 - w)), A >= 0."}
    )
    vespo_lambda_pos: Annotated[float, Range(above=0)] = field(
        default=3.0, metadata={"help": "loss_type='vespo': decay lambda of the weight w^k exp(lambda (1 - w)), A >= 0."}
    )
    vespo_k_neg: Annotated[float, Range(at_least=0)] = field(
        default=3.0, metadata={"help": "loss_type='vespo': power k of the weight w^k exp(lambda (1 - w)), A < 0."}
    )
    vespo_lambda_neg: Annotated[float, Range(above=0)] = field(
        default=2.0, metadata={"help": "loss_type='vespo': decay lambda of the weight w^k exp(lambda (1 - w)), A < 0."}
    )

    # --- Regularisers and filters ------------------------------------------------------------------------------
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Weight of an entropy bonus: the loss minus entropy_coef x the mean token entropy of the policy "
            "(over the tokens the policy loss uses). 0: none. With use_adaptive_entropy, the starting coefficient."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={
            "help": "Adapt entropy_coef after each optimiser step: up by entropy_coef_delta while the step's mean "
            "entropy is at or below entropy_target, down otherwise (within [entropy_coef_min, entropy_coef_max]); the "
            "bonus applies only while the last step's entropy was at or below the target."
        },
    )
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Adaptive entropy: lowest coefficient."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy: highest coefficient."})
    entropy_coef_delta: Annotated[float, Range(at_least=0)] = field(
        default=0.005, metadata={"help": "Adaptive entropy: change per optimiser step."}
    )
    entropy_target: float = field(
        default=0.2, metadata={"help": "Adaptive entropy: the mean token entropy (nats) below which the bonus acts."}
    )
    top_entropy_quantile: Annotated[float, Range(at_least=0, at_most=1)] = field(
        default=1.0,
        metadata={
            "help": "Train only on the completion tokens whose entropy is in this top fraction of the micro-step's "
            "tokens (over every process): 0.2 keeps the most uncertain fifth of the tokens, 1.0 keeps all."
        },
    )
    off_policy_mask_threshold: Annotated[float | None, Range(above=0)] = field(
        default=None,
        metadata={
            "help": "Leave out of the policy loss each completion with a negative advantage whose mean token KL from "
            "the policy that sampled it exceeds this threshold (e.g. 0.5): vLLM's log-probs, or the trainer's "
            "rollout-time ones without vLLM or when sampling is reshaped (top-k, penalties, ...). None: off."
        },
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={
            "help": "Move the reference model towards the policy every ref_model_sync_steps optimiser steps: "
            "ref <- ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * ref (TR-DPO). Needs beta > 0."
        },
    )
    ref_model_mixup_alpha: Annotated[float, Range(at_least=0, at_most=1)] = field(
        default=0.6, metadata={"help": "sync_ref_model: the policy's share in the new reference weights."}
    )
    ref_model_sync_steps: Annotated[int, Range(at_least=1)] = field(
        default=512, metadata={"help": "sync_ref_model: optimiser steps between two updates of the reference."}
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={
            "help": "Multiply each token's KL estimate by its importance ratio p / p_old, which makes the KL to the "
            "reference unbiased for the current policy when samples come from an older one (beta > 0)."
        },
    )

    # --- Rewards and advantages ----------------------------------------------------------------------------------
    reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "One weight per reward function, in order. Defaults to 1.0 each."},
    )
    scale_rewards: Annotated[str, OneOf(SCALE_REWARDS, why="or True for 'group', False for 'none'")] = field(
        default="group",
        metadata={
            "help": "How group-centred rewards are scaled into advantages (TPO's u): 'group' (or True) by the group's "
            "std, 'batch' by the std of the whole rollout, 'none' (or False) not at all.",
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "With several reward functions: 'sum_then_normalize' weights and sums the rewards, then scales "
            "them by scale_rewards; 'normalize_then_sum' (GDPO) z-scores each reward in its groups, sums them with "
            "the weights and z-scores the sum over the rollout (scale_rewards is not used).",
            "choices": MULTI_OBJECTIVE_AGGREGATIONS,
        },
    )

    # --- Logging ------------------------------------------------------------------------------------------------
    log_completions: bool = field(
        default=False, metadata={"help": "Print a table of prompts, completions, rewards and targets at each log."}
    )
    num_completions_to_print: Annotated[int | None, Range(at_least=1)] = field(
        default=None,
        metadata={
            "help": "Rows of the completions table printed: the first N (a group's completions in a row). None prints "
            "every completion of the rollout. Trackers and the Hub get every row."
        },
    )
    log_unique_prompts: bool = field(
        default=False,
        metadata={
            "help": "In the completions table (printed, sent to trackers, pushed to the Hub), write each prompt once, "
            "on its first completion's row."
        },
    )
    log_completions_hub_repo: str | None = field(
        default=None,
        metadata={
            "help": "Push the completions table to this Hub dataset repository at each log ('user/name'; private "
            "with hub_private_repo). Needs log_completions and access to the Hub."
        },
    )
    log_multimodal: bool = field(
        default=True,
        metadata={
            "help": "Accepted, no effect: the completions table shows the prompts' text (image parts as "
            "placeholders), never the images."
        },
    )
    warn_after_uninformative_rollouts: Annotated[int, Range(at_least=0, why="0 never warns")] = field(
        default=20,
        metadata={
            "help": "Warn once when this many training rollouts in a row had no informative group (every group's "
            "completions got equal rewards, so the rewards teach nothing), naming the reward functions and what to "
            "check. 0 never warns."
        },
    )

    def __new__(cls, *args, **kwargs):
        # Runs before the generated __init__, which would refuse a misspelt field without naming the one meant.
        fields = [spec.name for spec in dataclasses.fields(cls) if spec.init]
        for name in kwargs:
            if name not in fields:
                close = close_names(name, fields)
                hint = f". Did you mean {either([repr(known) for known in close])}?" if close else ""
                raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {name!r}{hint}")
        return super().__new__(cls)

    def __post_init__(self):
        parse_json_fields(self)  # dict-valued fields arrive as JSON strings from the command line
        use_former_names(self)
        super().__post_init__()
        check_output_dir(self)
        self.scale_rewards = scale_rewards_name(self.scale_rewards)
        check_field_values(self)
        check_combinations(self)  # the rules table (rules.py)
        warn_about_loss_settings(self)
        warn_about_unused_vllm_settings(self)
        resolve_batch_layout(self)  # where the batch layout lives (step/layout.py)

    def check_eval_batch_size(self) -> None:
        """Evaluation batches, like training steps, must hold whole prompt groups."""
        check_eval_batch_size(self)

    def to_dict(self) -> dict[str, Any]:
        """The fields as loggers and ``to_json_string`` record them, with the server's API key hidden."""
        values = super().to_dict()
        for name in SECRET_FIELDS:
            if values.get(name) is not None:
                values[name] = f"<{name.upper()}>"
        return values

    # The Trainer pickles the whole config into every checkpoint's and saved model's training_args.bin, as do
    # trackers that upload models: a pickled config leaves the secret fields (the server's API key) out. Copies made
    # in this process keep them. The rollout backend read the key when it was built.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in SECRET_FIELDS:
            state[name] = None
        return state

    def __copy__(self) -> TargetPOConfig:
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __deepcopy__(self, memo: dict) -> TargetPOConfig:
        copied = object.__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    def __str__(self) -> str:
        # TrainingArguments' own rendering, which hides only *_token fields.
        shown = {
            name: f"<{name.upper()}>" if name.endswith("_token") or name in SECRET_FIELDS else value
            for name, value in dataclasses.asdict(self).items()
        }
        return (
            f"{type(self).__name__}(\n" + "".join(f"{name}={value},\n" for name, value in sorted(shown.items())) + ")"
        )

    @property
    def importance_sampling_clip_max(self) -> float:
        """The importance weights' upper bound: vllm_importance_sampling_clip_max, else vllm_importance_sampling_cap."""
        clip_max = self.vllm_importance_sampling_clip_max
        return self.vllm_importance_sampling_cap if clip_max is None else clip_max


@dataclass
class TargetPOConfig(GRPOConfig):
    """Training arguments for :class:`~targetpo.TargetPOTrainer`: GRPO rollout settings plus the TPO target.

    The target over a group is ``q ∝ p_old · exp(u / tpo_target_temperature)``, where ``u`` are the group-whitened
    scores; the policy is fitted to it by cross-entropy.
    """

    loss_type: str = field(
        default="tpo",
        metadata={
            "help": "The policy loss: 'tpo' (cross-entropy to the target q), or a GRPO-family baseline on the same "
            "rollouts: 'grpo', 'dapo', 'dr_grpo', 'bnpo', 'cispo', 'sapo', 'luspo' or 'vespo' (see GRPOConfig).",
            "choices": LOSS_TYPES,
        },
    )
    tpo_target_temperature: Annotated[float, Range(above=0, symbol="eta")] = field(
        default=1.0,
        metadata={"help": "eta in q ∝ p_old · exp(u / eta). Smaller moves the target further from p_old. Must be > 0."},
    )
    tpo_length_normalize_logps: bool = field(
        default=True,
        metadata={"help": "Use the mean token log-prob of a completion as its sequence log-prob (False: the sum)."},
    )
