"""Continuing the KV cache from one turn of a multi-turn rollout to the next, for ``model.generate``.

Within a session (the turns of one rollout) each row a turn generates from extends a row of the turn before: the
sample's prompt, its turns and tool turns so far. :class:`TurnCache` keeps the cache ``generate`` returned and the
tokens each of its rows holds; the next call takes, for each of its rows, the keys and values of the longest cached
prefix of its context, and ``generate`` prefills only the rest (``past_key_values``, with the whole context as
``input_ids``).

The continued batch is laid out as re-prefilling lays it out: contexts left-padded to the longest, positions counted
from the attention mask. Its first ``L`` columns come from the cache, ``L`` leaving room for the longest uncached
tail; a row with a shorter tail prefills a few of its cached tokens again. So columns, positions and masks are the
re-prefill's own (a sliding-window mask too), and what differs is float rounding of keys and values computed in
another batch, some of them one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer
from transformers.generation.configuration_utils import GenerationMode


@dataclass
class CacheReuse:
    """What continuing caches saved over a backend's life; ``fallback`` says why the latest call could not continue
    one (None when it could, or had nothing to continue)."""

    continued_turns: int = 0  # calls that took part of their contexts from the cache
    reused_tokens: int = 0  # context tokens taken from the cache
    prefilled_tokens: int = 0  # context tokens prefilled (padding aside), in every call
    fallback: str | None = None


def continuation_problem(
    model: Any, generation_config: GenerationConfig, with_images: bool, synced_gpus: bool
) -> str | None:
    """Why a call cannot continue (or keep) a cache, so it re-prefills; None when it can. The model's cache layers are
    checked on the cache ``generate`` returns (:func:`cache_problem`)."""
    if with_images:
        return (
            "prompts with images: the image features and a vision-language model's positions (M-RoPE) come from the "
            "first forward pass over the whole prompt"
        )
    if model.config.get_text_config(decoder=True) is not model.config:
        # A composite config is a vision-language model: even without images, its positions are its own scheme (and
        # Qwen2-VL keeps position offsets from the last prefill on the model).
        return "a vision-language model, whose positions are not counted from the attention mask alone"
    if synced_gpus:
        return (
            "sharded weights generating collectively (synced_gpus): every process steps together, stand-in rows "
            "included; continuing caches there is not verified"
        )
    peft_config = getattr(model, "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):
        return "a PEFT prompt-learning adapter, whose virtual tokens generate puts in the cache itself"
    if generation_config.use_cache is False:  # None is generate's default, which caches
        return "use_cache=False"
    if generation_config.cache_implementation is not None:
        return f"cache_implementation={generation_config.cache_implementation!r}, a cache of another layout"
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        return "prefill_chunk_size: chunked prefill starts from the first column whatever the cache holds"
    if generation_config.get_generation_mode() not in (GenerationMode.SAMPLE, GenerationMode.GREEDY_SEARCH):
        return f"{generation_config.get_generation_mode().value}, not plain sampling"
    return None


def cache_problem(cache: Any) -> str | None:
    """Why a cache ``generate`` returned cannot be continued row by row; None when every layer is a full-attention
    :class:`DynamicLayer`. A sliding-window layer has dropped the tokens before its window, a linear-attention or
    recurrent state sums a whole padded row (the tokens past its EOS included), and quantized or offloaded layers
    store their tensors otherwise."""
    if type(cache) is not DynamicCache:
        return f"the model's cache is a {type(cache).__name__}, not a DynamicCache"
    kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer})
    if kinds or getattr(cache, "offloading", False):
        return f"the model's cache has {', '.join(kinds) or 'offloaded'} layers, not only full-attention DynamicLayers"
    return None


def _unpadded(row_ids: torch.Tensor, row_mask: torch.Tensor) -> torch.Tensor | None:
    """A left-padded row's tokens, or None when its mask is not one run of ones at the end (no cache fits it)."""
    start = row_mask.size(0) - int(row_mask.sum())
    if not bool(row_mask[start:].all()):
        return None
    return row_ids[start:]


class TurnCache:
    """The cache one ``generate`` call returned, and for each of its rows the tokens it holds keys and values of
    (without padding) and the column they start at."""

    def __init__(self, cache: DynamicCache, rows: list[torch.Tensor], starts: list[int]):
        self.cache = cache
        self.rows = rows
        self.starts = starts

    @classmethod
    def after_generation(
        cls, cache: DynamicCache, prompt_mask: torch.Tensor, sequences: torch.Tensor, lengths: torch.Tensor
    ) -> TurnCache:
        """The rows of a call's cache: each prompt and its completion up to its end (``lengths`` tokens). Tokens past
        a completion's EOS are in the cache as padding ``generate`` fed on; they are left out. The last sampled token
        of the longest completions was never fed, so it is not cached."""
        cached_columns = cache.get_seq_length()
        width = prompt_mask.size(1)
        rows, starts = [], []
        for row_ids, row_mask, length in zip(sequences, prompt_mask, lengths.tolist()):
            prompt = _unpadded(row_ids[:width], row_mask)
            start = width - (0 if prompt is None else prompt.size(0))
            end = min(width + int(length), cached_columns)
            rows.append(row_ids[start:end] if prompt is not None else row_ids[:0])
            starts.append(start)
        return cls(cache, rows, starts)

    def _longest_prefixes(self, contexts: list[torch.Tensor | None]) -> tuple[list[int], list[int]]:
        """For each context, the cached row holding the longest prefix of it, and that prefix's length (at most the
        context's length less one: ``generate`` must feed a token to sample the next)."""
        longest = max((row.size(0) for row in self.rows), default=0)
        table = torch.full((len(self.rows), longest), -1, dtype=torch.long, device=self.rows[0].device)
        for index, row in enumerate(self.rows):
            table[index, : row.size(0)] = row
        sources, lengths = [], []
        for context in contexts:
            usable = 0 if context is None else min(context.size(0) - 1, longest)
            if usable <= 0:
                sources.append(0)
                lengths.append(0)
                continue
            matches = table[:, :usable] == context[:usable].to(table.device)
            prefix = matches.long().cumprod(dim=1).sum(dim=1)  # each cached row's common prefix with the context
            best = int(prefix.argmax())
            sources.append(best)
            lengths.append(int(prefix[best]))
        return sources, lengths

    def continuation(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[DynamicCache, int] | None:
        """The cache of the first columns of left-padded ``prompt_ids``, built from the cached rows they extend, and
        how many context tokens it holds; None when no column can come from the cache. It uses this cache up: each
        layer is released once copied, so the two are never both held whole."""
        width = prompt_ids.size(1)
        contexts = [_unpadded(ids, mask) for ids, mask in zip(prompt_ids, prompt_mask)]
        if not self.rows or any(context is None for context in contexts):
            return None
        sources, cached = self._longest_prefixes(contexts)
        sizes = [context.size(0) for context in contexts]
        columns = width - max(size - length for size, length in zip(sizes, cached))
        if columns <= 0:
            return None
        device = self.cache.layers[0].keys.device
        # Row r's context starts at column width - size; its first `taken` tokens fill the cached columns' end.
        taken = torch.tensor([max(0, columns - (width - size)) for size in sizes], device=device)
        target = torch.arange(columns, device=device).unsqueeze(0)
        first = columns - taken.unsqueeze(1)
        inside = target >= first
        starts = torch.tensor(self.starts, device=device)[torch.tensor(sources, device=device)]
        source_columns = torch.where(inside, starts.unsqueeze(1) + target - first, 0)
        source_rows = torch.tensor(sources, device=device).unsqueeze(1)
        continued = DynamicCache()
        for index, layer in enumerate(self.cache.layers):
            # Advanced indices around a slice go first: (rows, columns, heads, dim) -> (rows, heads, columns, dim).
            keys = layer.keys[source_rows, :, source_columns].transpose(1, 2)
            values = layer.values[source_rows, :, source_columns].transpose(1, 2)
            padding = ~inside.view(inside.size(0), 1, columns, 1)
            continued.update(keys.masked_fill(padding, 0), values.masked_fill(padding, 0), index)
            layer.keys = layer.values = None
        self.rows = []
        return continued, int(taken.sum())
