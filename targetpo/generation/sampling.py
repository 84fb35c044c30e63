"""The sampling settings of a run, defined once and read by every backend in its own terms."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import GenerationConfig

from ..vision import placeholder_token_ids


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled: the config's settings plus the token ids that end or pad a completion.

    ``generation_kwargs`` are extra settings in the backend's own terms (``GenerationConfig`` fields for
    transformers, ``vllm.SamplingParams`` fields for vLLM), except ``suppress_tokens``, which every backend honours.
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

    @classmethod
    def from_config(cls, args: Any, tokenizer: Any, model: Any) -> SamplingSettings:
        """The config's sampling; a completion ends at the tokenizer's EOS or any the model's generation config
        names."""
        eos_ids = {tokenizer.eos_token_id}
        model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos_ids.update(model_eos if isinstance(model_eos, (list, tuple)) else [model_eos])
        generation_kwargs = dict(args.generation_kwargs or {})
        placeholders = placeholder_token_ids(model)
        if placeholders:  # a vision-language model's image tokens: never sampled (and so never in the log-probs)
            suppressed = {int(token) for token in generation_kwargs.get("suppress_tokens") or []}
            generation_kwargs["suppress_tokens"] = sorted(suppressed | placeholders)
        return cls(
            max_new_tokens=args.max_completion_length,
            eos_token_ids=tuple(sorted(token for token in eos_ids if token is not None)),
            pad_token_id=tokenizer.pad_token_id,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            generation_kwargs=generation_kwargs,
            cache_implementation=getattr(args, "cache_implementation", None),
            structured_outputs_regex=getattr(args, "vllm_structured_outputs_regex", None),
        )

    @property
    def reshapes_distribution(self) -> bool:
        """Whether sampling truncates, penalises or constrains the tempered distribution (top-p, top-k, min-p,
        repetition, a regular expression)."""
        truncated = self.top_p < 1 or self.top_k > 0 or bool(self.min_p) or self.repetition_penalty != 1
        return truncated or self.structured_outputs_regex is not None

    @property
    def suppressed_token_ids(self) -> list[int]:
        return [int(token) for token in self.generation_kwargs.get("suppress_tokens") or []]

    def generation_config(self) -> GenerationConfig:
        """For ``model.generate``."""
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
        settings.update(self.generation_kwargs)
        return GenerationConfig(**settings)

    def vllm_fields(self) -> dict[str, Any]:
        """Keyword arguments of ``vllm.SamplingParams`` as plain JSON-able values (no seed).

        ``suppress_tokens`` becomes a -100 logit bias, so one config samples the same way with either backend.
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
        suppressed = extra.pop("suppress_tokens", None)
        if suppressed:
            fields["logit_bias"] = {int(token): -100.0 for token in suppressed}
        if self.structured_outputs_regex is not None:
            fields["structured_outputs"] = {"regex": self.structured_outputs_regex}
        fields.update(extra)
        return fields
