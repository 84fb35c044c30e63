"""The sampling settings of a run, defined once and read by every backend in its own terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from transformers import GenerationConfig

from ..modeling.vision import placeholder_token_ids

#: The config's sampling fields and their defaults (each default leaves the model's tempered distribution as it is).
SAMPLING_FIELD_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "repetition_penalty": 1.0,
}
#: generation_kwargs spellings of max_completion_length (transformers, vLLM).
LENGTH_KEYS = ("max_new_tokens", "max_tokens")
#: generation_kwargs spellings of extra stop tokens (transformers, vLLM): they join the completion-ending token ids.
STOP_TOKEN_KEYS = ("eos_token_id", "stop_token_ids")


def _is_unset(value: Any) -> bool:
    """None, False or empty: a setting that asks for nothing."""
    return value is None or value is False or (isinstance(value, (list, tuple, dict, str)) and not value)


#: generation_kwargs that contradict what the trainer assumes: key -> (whether a value is compatible, why not).
#: A compatible value changes nothing and is dropped.
CONTRADICTING_KEYS: dict[str, tuple[Any, str]] = {
    "do_sample": (
        lambda value: value is None or value is True,
        "decodes greedily, while the trainer's log-probs, its targets and every ratio describe sampling. Leave it "
        "out (rollouts always sample; a lower temperature samples more sharply)",
    ),
    **dict.fromkeys(
        ("num_return_sequences", "n", "best_of"),
        (
            lambda value: value in (None, 1),
            "samples several completions per prompt, while the trainer repeats each prompt num_generations times "
            "itself. Set num_generations instead",
        ),
    ),
    **dict.fromkeys(
        ("num_beams", "num_beam_groups"),
        (lambda value: value in (None, 1), "searches beams instead of sampling. Leave it out"),
    ),
    **dict.fromkeys(
        ("penalty_alpha", "dola_layers"),
        (
            lambda value: not value,
            "selects a decoding strategy other than sampling (contrastive search, DoLa), while the trainer's "
            "log-probs describe sampling. Leave it out",
        ),
    ),
    "logprobs": (
        lambda value: value == 0,
        "is set by the trainer, which asks vLLM for each sampled token's own log-prob (logprobs=0). Leave it out",
    ),
    "max_length": (
        _is_unset,
        "counts the prompt's tokens too, while the trainer pads, masks truncated completions and sizes vLLM's "
        "context by the completion's budget. Set max_completion_length instead",
    ),
    "seed": (
        _is_unset,
        "would give every completion the same seed; the trainer seeds each completion from the config's seed. Set "
        "seed instead",
    ),
    "ignore_eos": (
        _is_unset,
        "samples past EOS, while the trainer ends each completion at its first EOS. Leave it out",
    ),
    **dict.fromkeys(
        ("stop", "stop_strings"),
        (
            _is_unset,
            "stops on text, which the trainer never sees (it reads token ids). List the stop tokens' ids in "
            "stop_token_ids (or eos_token_id) instead",
        ),
    ),
    "return_dict_in_generate": (
        _is_unset,
        "changes what model.generate returns, while the trainer reads the token ids itself. Leave it out",
    ),
}
#: generation_kwargs that never change which tokens are sampled or with what probability.
DISTRIBUTION_NEUTRAL_KEYS = frozenset(
    {
        "suppress_tokens",  # left out of the trainer's log-probs too, so both sides describe the same distribution
        "use_cache",
        "cache_implementation",
        "cache_config",
        "max_time",
        "low_memory",
        "renormalize_logits",
        "remove_invalid_values",
        "output_scores",
        "output_logits",
        "output_attentions",
        "output_hidden_states",
        "bos_token_id",
        "pad_token_id",
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "output_kind",
        "prompt_logprobs",
    }
)
#: The value at which a generation_kwargs setting leaves the distribution as it is, where that is not None or empty.
NEUTRAL_VALUES: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "typical_p": 1,
    "epsilon_cutoff": 0,
    "eta_cutoff": 0,
    "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1,
    "guidance_scale": 1,
    "min_new_tokens": 0,
    "min_length": 0,
    "min_tokens": 0,
}


def _normalized(name: str, value: Any) -> Any:
    """A sampling field's value in one spelling: vLLM's top_k=-1 and None are 0 (off), min_p=0 is None (off)."""
    if name == "top_k":
        return 0 if value is None or value == -1 else int(value)
    if name == "min_p":
        return None if not value else float(value)
    return value


def _check_range(name: str, value: Any, setting: str) -> None:
    """A ValueError naming ``setting`` when a sampling field's value is outside its range."""
    valid = {
        "temperature": lambda v: v > 0,
        "top_p": lambda v: 0 < v <= 1,
        "top_k": lambda v: v >= 0,
        "min_p": lambda v: v is None or 0 <= v <= 1,
        "repetition_penalty": lambda v: v > 0,
    }[name]
    try:
        ok = valid(value)
    except TypeError:
        ok = False
    if not ok:
        hint = " (0 is greedy decoding, which the trainer's log-probs do not describe)" if name == "temperature" else ""
        raise ValueError(f"{setting}={value!r} is out of range for {name}{hint}.")


def _reshapes(key: str, value: Any) -> bool:
    """Whether a generation_kwargs setting changes the sampled distribution (anything not known to leave it alone)."""
    if key in DISTRIBUTION_NEUTRAL_KEYS or value is None or (isinstance(value, (list, tuple, dict)) and not value):
        return False
    return not (key in NEUTRAL_VALUES and value == NEUTRAL_VALUES[key])


class ResolvedSampling(NamedTuple):
    """The sampling settings of :func:`resolve_generation_kwargs`: one value per typed field, and what is left."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float | None
    repetition_penalty: float
    generation_kwargs: dict[str, Any]  # the other settings, in the backend's terms
    stop_token_ids: tuple[int, ...]  # beyond the tokenizer's and the model's EOS
    from_generation_kwargs: tuple[str, ...]  # the typed fields whose value generation_kwargs gave


def resolve_generation_kwargs(args: Any) -> ResolvedSampling:
    """The run's sampling settings from the config's typed fields and ``generation_kwargs``, resolved once.

    A ``generation_kwargs`` key that spells a typed field (``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty``) wins when that field is at its default and must agree with it otherwise; a length key
    (``max_new_tokens``, ``max_tokens``) must equal ``max_completion_length``; ``eos_token_id`` and
    ``stop_token_ids`` join the stop tokens; a key that contradicts what the trainer assumes is refused. Every
    ``ValueError`` names both settings.
    """
    extra = dict(args.generation_kwargs or {})
    stop_token_ids = _pop_length_and_stop_keys(extra, args.max_completion_length)
    resolved, from_generation_kwargs = _typed_fields_with_generation_kwargs(args, extra)
    if not getattr(args, "use_vllm", False):
        _refuse_keys_generate_ignores(extra)
    return ResolvedSampling(
        **resolved,
        generation_kwargs=extra,
        stop_token_ids=tuple(sorted(stop_token_ids)),
        from_generation_kwargs=tuple(from_generation_kwargs),
    )


def _pop_length_and_stop_keys(extra: dict[str, Any], max_completion_length: int) -> set[int]:
    """Take out of ``extra`` the keys that contradict the trainer (refused unless compatible), the length keys (which
    must equal ``max_completion_length``) and the stop-token keys; returns the stop tokens."""
    for key, (compatible, why) in CONTRADICTING_KEYS.items():
        if key in extra:
            value = extra.pop(key)
            if not compatible(value):
                raise ValueError(f"generation_kwargs['{key}']={value!r} is refused: it {why}.")
    for key in LENGTH_KEYS:
        value = extra.pop(key, None)
        if value is not None and value != max_completion_length:
            raise ValueError(
                f"generation_kwargs['{key}']={value!r} contradicts max_completion_length={max_completion_length}: "
                "the trainer pads, masks truncated completions and sizes vLLM's context by max_completion_length. Set "
                f"max_completion_length={value!r} and leave {key} out of generation_kwargs."
            )
    stop_token_ids: set[int] = set()
    for key in STOP_TOKEN_KEYS:
        value = extra.pop(key, None)
        tokens = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
        stop_token_ids.update(int(token) for token in tokens)
    return stop_token_ids


def _typed_fields_with_generation_kwargs(args: Any, extra: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Each typed sampling field's one value, taking out of ``extra`` a key that spells it (it wins over a field at
    its default, and must agree otherwise); and the fields whose value ``generation_kwargs`` gave."""
    resolved: dict[str, Any] = {}
    from_generation_kwargs = []
    for name, default in SAMPLING_FIELD_DEFAULTS.items():
        typed = _normalized(name, getattr(args, name))
        resolved[name] = typed
        if name not in extra:
            continue
        raw = extra.pop(name)
        _check_range(name, _normalized(name, raw), f"generation_kwargs['{name}']")
        given = _normalized(name, raw)
        if given == typed:
            continue
        if typed != default:
            raise ValueError(
                f"generation_kwargs['{name}']={raw!r} contradicts {name}={getattr(args, name)!r}: the sampling "
                f"settings must have one value. Set {name} alone (or leave {name} at its default, "
                f"{default!r}, and keep generation_kwargs['{name}'])."
            )
        resolved[name] = given
        from_generation_kwargs.append(name)
    return resolved, from_generation_kwargs


def _refuse_keys_generate_ignores(extra: dict[str, Any]) -> None:
    """Without vLLM, every key left must be a ``GenerationConfig`` field, which ``model.generate`` reads."""
    blank = GenerationConfig()
    unknown = sorted(key for key in extra if not hasattr(blank, key))
    if unknown:
        raise ValueError(
            f"generation_kwargs keys {unknown} are not GenerationConfig fields, so model.generate would ignore "
            "them. Sampling with model.generate (use_vllm=False) takes GenerationConfig fields; vllm.SamplingParams "
            "fields need use_vllm=True."
        )


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled: the config's settings plus the token ids that end or pad a completion.

    Build it with :meth:`from_config`, which resolves the typed fields and ``generation_kwargs`` into one value each:
    every consumer (the trainer's log-prob temperature, the importance-sampling switch, both backends, the saved
    ``generation_config``) reads these fields, never the config. ``generation_kwargs`` holds what is left: extra
    settings in the backend's own terms (``GenerationConfig`` fields for transformers, ``vllm.SamplingParams`` fields
    for vLLM), except ``suppress_tokens``, which every backend honours.
    """

    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] = field(default_factory=dict)
    cache_implementation: str | None = None  # model.generate's KV cache; vLLM manages its own
    structured_outputs_regex: str | None = None  # vLLM only: every completion matches this regular expression
    from_generation_kwargs: tuple[str, ...] = ()  # the typed fields whose value generation_kwargs gave
    added_stop_token_ids: tuple[int, ...] = ()  # the eos_token_ids generation_kwargs added

    @classmethod
    def from_config(cls, args: Any, tokenizer: Any, model: Any) -> SamplingSettings:
        """The config's sampling (:func:`resolve_generation_kwargs`); a completion ends at the tokenizer's EOS, any
        the model's generation config names, or any ``generation_kwargs`` adds."""
        resolved = resolve_generation_kwargs(args)._asdict()
        added_stop_token_ids = resolved.pop("stop_token_ids")
        eos_ids = {tokenizer.eos_token_id, *added_stop_token_ids}
        model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos_ids.update(model_eos if isinstance(model_eos, (list, tuple)) else [model_eos])
        generation_kwargs = resolved.pop("generation_kwargs")
        placeholders = placeholder_token_ids(model)
        if placeholders:  # a vision-language model's image tokens: never sampled (and so never in the log-probs)
            suppressed = {int(token) for token in generation_kwargs.get("suppress_tokens") or []}
            generation_kwargs["suppress_tokens"] = sorted(suppressed | placeholders)
        return cls(
            max_new_tokens=args.max_completion_length,
            eos_token_ids=tuple(sorted(token for token in eos_ids if token is not None)),
            pad_token_id=tokenizer.pad_token_id,
            generation_kwargs=generation_kwargs,
            cache_implementation=getattr(args, "cache_implementation", None),
            structured_outputs_regex=getattr(args, "vllm_structured_outputs_regex", None),
            added_stop_token_ids=added_stop_token_ids,
            **resolved,
        )

    @property
    def reshaping_settings(self) -> tuple[str, ...]:
        """The settings that truncate, penalise or constrain the tempered distribution (top-p, top-k, min-p,
        penalties, a regular expression, any generation_kwargs not known to leave it alone), by the name the user
        gave them."""
        names = [
            f"generation_kwargs['{name}']" if name in self.from_generation_kwargs else name
            for name in ("top_p", "top_k", "min_p", "repetition_penalty")
            if _normalized(name, getattr(self, name)) != SAMPLING_FIELD_DEFAULTS[name]
        ]
        extra = self.generation_kwargs.items()
        names += [f"generation_kwargs['{key}']" for key, value in extra if _reshapes(key, value)]
        if self.structured_outputs_regex is not None:
            names.append("vllm_structured_outputs_regex")
        return tuple(names)

    @property
    def reshapes_distribution(self) -> bool:
        """Whether sampling is not the tempered distribution the trainer's log-probs describe
        (:attr:`reshaping_settings`)."""
        return bool(self.reshaping_settings)

    @property
    def suppressed_token_ids(self) -> list[int]:
        return [int(token) for token in self.generation_kwargs.get("suppress_tokens") or []]

    def generation_config(self) -> GenerationConfig:
        """For ``model.generate``."""
        return GenerationConfig(**self.generation_config_fields())

    def generation_config_fields(self) -> dict[str, Any]:
        """The ``GenerationConfig`` settings that sample as rollouts do: for ``model.generate``, and to save with a
        trained model. ``vllm.SamplingParams`` fields that ``GenerationConfig`` lacks (``presence_penalty``, ...)
        are left out: the config refuses them without vLLM, and ``model.generate`` has no counterpart for them."""
        settings: dict[str, Any] = dict(
            max_new_tokens=self.max_new_tokens,
            do_sample=True,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )
        if self.cache_implementation is not None:
            settings["cache_implementation"] = self.cache_implementation
        blank = GenerationConfig()
        settings.update({key: value for key, value in self.generation_kwargs.items() if hasattr(blank, key)})
        return settings

    def vllm_fields(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.SamplingParams`` as plain JSON-able values (no seed).

        ``suppress_tokens`` becomes a -100 logit bias, so one config samples the same way with either backend; a
        ``logit_bias`` of ``generation_kwargs`` is kept beside it (a suppressed token stays suppressed, as with
        ``model.generate``, whose suppression comes after any bias).
        """
        extra = dict(self.generation_kwargs)
        fields: dict[str, Any] = {
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p or 0.0,
            "repetition_penalty": self.repetition_penalty,
            "stop_token_ids": list(self.eos_token_ids),
            "logprobs": 0,  # the sampled token's log-prob only
            "detokenize": False,  # the trainer decodes with its own tokenizer
        }
        bias = {int(token): float(value) for token, value in (extra.pop("logit_bias", None) or {}).items()}
        bias |= {int(token): -100.0 for token in extra.pop("suppress_tokens", None) or []}
        if bias:
            fields["logit_bias"] = bias
        if self.structured_outputs_regex is not None:
            fields["structured_outputs"] = {"regex": self.structured_outputs_regex}
        fields.update(extra)
        return fields
