"""What every rollout backend returns, and how a completion's mask is read off its tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Completions:
    """Generated completions, right-padded to a common length ``C``.

    ``attention_mask`` covers each completion up to and including its first EOS; ``truncated`` marks completions that
    reached the length limit without one. ``sampler_logps`` holds the sampling engine's own log-prob of each token
    when the engine reports them (vLLM), for the importance-sampling correction.
    """

    ids: torch.Tensor  # (N, C) long
    attention_mask: torch.Tensor  # (N, C) long
    truncated: torch.Tensor  # (N,) bool
    sampler_logps: torch.Tensor | None = None  # (N, C) float32, 0 past each completion's end

    @property
    def lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(dim=1)


def completion_masks(
    completion_ids: torch.Tensor, eos_token_ids: Sequence[int], lengths: torch.Tensor | None = None
) -> Completions:
    """Mask each completion up to and including its first EOS; one without EOS is truncated and kept whole.

    ``lengths`` gives each row's own token count when the rows are padded (padding may use an EOS id): tokens past
    it are never part of the completion.
    """
    width = completion_ids.size(1)
    positions = torch.arange(width, device=completion_ids.device).unsqueeze(0)
    if lengths is None:
        lengths = torch.full((completion_ids.size(0),), width, device=completion_ids.device)
    within = positions < lengths.to(completion_ids.device).unsqueeze(1)
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), device=completion_ids.device)) & within
    has_eos = is_eos.any(dim=1)
    end = torch.where(has_eos, is_eos.int().argmax(dim=1), lengths.to(completion_ids.device) - 1)
    attention_mask = (positions <= end.unsqueeze(1)).long()
    return Completions(ids=completion_ids, attention_mask=attention_mask, truncated=~has_eos)


def unpadded_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Each prompt's own token ids, without its padding, as engines that take token-id lists want them."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]


def pad_completions(
    token_ids: Sequence[Sequence[int]],
    token_logps: Sequence[Sequence[float]],
    pad_token_id: int,
    eos_token_ids: Sequence[int],
    device: torch.device | str = "cpu",
) -> Completions:
    """Right-pad per-completion token ids and the engine's log-probs of them into :class:`Completions`."""
    width = max(1, max((len(ids) for ids in token_ids), default=1))
    ids = torch.full((len(token_ids), width), pad_token_id, dtype=torch.long)
    logps = torch.zeros((len(token_ids), width), dtype=torch.float32)
    for row, (row_ids, row_logps) in enumerate(zip(token_ids, token_logps)):
        ids[row, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        logps[row, : len(row_logps)] = torch.tensor(row_logps, dtype=torch.float32)
    lengths = torch.tensor([len(row) for row in token_ids], dtype=torch.long)
    completions = completion_masks(ids.to(device), eos_token_ids, lengths)
    completions.sampler_logps = logps.to(device) * completions.attention_mask
    return completions
