"""What every rollout backend returns, and how a completion's mask is read off its tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Completions:
    """Generated completions, right-padded to a common length ``C``.

    ``attention_mask`` covers each completion up to and including its first EOS; ``truncated`` marks completions that
    reached the length limit without one.
    """

    ids: torch.Tensor  # (N, C) long
    attention_mask: torch.Tensor  # (N, C) long
    truncated: torch.Tensor  # (N,) bool

    @property
    def lengths(self) -> torch.Tensor:
        return self.attention_mask.sum(dim=1)


def completion_masks(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> Completions:
    """Mask each completion up to and including its first EOS; one without EOS is truncated and kept whole."""
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), device=completion_ids.device))
    has_eos = is_eos.any(dim=1)
    length = completion_ids.size(1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, length, dtype=torch.long))
    positions = torch.arange(length, device=completion_ids.device).unsqueeze(0)
    attention_mask = (positions <= first_eos.unsqueeze(1)).long()
    return Completions(ids=completion_ids, attention_mask=attention_mask, truncated=~has_eos)
