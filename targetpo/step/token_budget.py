"""Passes of at most ``max_tokens_per_micro_batch`` tokens: how one micro-step's rows are cut for the model.

A pass costs the tokens the model computes on: its rows' prompt and completion tokens laid end to end when they go
through it packed (``padding_free``), or its rows times the longest prompt plus the longest completion among them when
padded (each pass is trimmed to its own longest). A unit is one row, or one prompt group's rows where a loss needs
whole groups in a pass (TPO's cross-entropy when its groups are not trained from a softmax known ahead,
``split_groups.py``). Units fill a pass until the next would not fit: in order when packed, longest first when padded,
so that a padded pass holds rows of like lengths (every loss adds up over rows, so their order is free).

``plan_passes`` is plain Python on lists of lengths; ``pass_row_masks`` turns a batch's masks into the passes' row
masks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pass_tokens(prompt_lengths: Sequence[int], completion_lengths: Sequence[int], packed: bool) -> int:
    """The tokens the model computes on for a pass of these rows."""
    if not prompt_lengths:
        return 0
    if packed:
        return sum(prompt_lengths) + sum(completion_lengths)
    return len(prompt_lengths) * (max(prompt_lengths) + max(completion_lengths))


def plan_passes(
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    rows: Sequence[int],
    budget: int,
    packed: bool,
    group_size: int | None = None,
) -> list[list[int]]:
    """``rows`` (indices into the lengths, in order) cut into passes of at most ``budget`` tokens.

    With ``group_size``, the rows of one group (``row // group_size``) always share a pass. A unit larger than the
    budget on its own is a ValueError: the caller makes sure none can be (``check_budget_fits``).
    """
    units: list[list[int]] = []
    for row in rows:
        same_group = group_size is not None and units and units[-1][-1] // group_size == row // group_size
        if same_group:
            units[-1].append(row)
        else:
            units.append([row])
    if not packed:
        units.sort(key=lambda unit: -max(prompt_lengths[row] + completion_lengths[row] for row in unit))
    passes: list[list[int]] = []
    for unit in units:
        tokens = _tokens(prompt_lengths, completion_lengths, unit, packed)
        if tokens > budget:
            what = f"prompt group of rows {unit}" if group_size is not None and len(unit) > 1 else f"row {unit[0]}"
            raise ValueError(
                f"max_tokens_per_micro_batch={budget} cannot hold the {what} ({tokens} tokens): a pass never cuts a "
                "sequence, nor a group where the loss needs it whole. Raise max_tokens_per_micro_batch, or keep the "
                "sequences within max_prompt_length + max_completion_length (a rollout_func's are bounded only by "
                "the model's positions)."
            )
        if passes and _tokens(prompt_lengths, completion_lengths, passes[-1] + unit, packed) <= budget:
            passes[-1].extend(unit)
        else:
            passes.append(list(unit))
    return [sorted(rows) for rows in passes]


def _tokens(prompt_lengths: Sequence[int], completion_lengths: Sequence[int], rows: list[int], packed: bool) -> int:
    return pass_tokens([prompt_lengths[row] for row in rows], [completion_lengths[row] for row in rows], packed)


def check_budget_fits(budget: int, max_sequence_tokens: int | None) -> None:
    """Refuse a budget that one sequence may not fit in: a pass holds whole sequences."""
    if max_sequence_tokens is None:
        raise ValueError(
            "max_tokens_per_micro_batch needs a bound on each sequence's tokens, and prompts are not limited here: "
            "set max_prompt_length (prompts longer than it are cut, keeping their last tokens)."
        )
    if budget < max_sequence_tokens:
        raise ValueError(
            f"max_tokens_per_micro_batch={budget} cannot hold one whole sequence of up to {max_sequence_tokens} tokens "
            "(max_prompt_length + max_completion_length): a pass never cuts a sequence. Raise it to at least "
            f"{max_sequence_tokens}, or lower max_prompt_length or max_completion_length."
        )


def pass_row_masks(
    prompt_mask: torch.Tensor,
    completion_attention_mask: torch.Tensor,
    rows: torch.Tensor | None,
    budget: int,
    packed: bool,
    group_size: int | None = None,
) -> list[torch.Tensor]:
    """The passes over ``rows`` (bool; None: every row) as bool row masks; one without rows when there are none (a
    pass with no rows still runs the model, see ``PolicyLogps``)."""
    prompt_lengths = prompt_mask.sum(dim=-1).tolist()
    completion_lengths = completion_attention_mask.sum(dim=-1).tolist()
    chosen = range(len(prompt_lengths)) if rows is None else rows.nonzero().squeeze(-1).tolist()
    plan = plan_passes(prompt_lengths, completion_lengths, chosen, budget, packed, group_size)
    plan = plan or [[]]
    masks = []
    for members in plan:
        mask = torch.zeros(len(prompt_lengths), dtype=torch.bool, device=prompt_mask.device)
        mask[members] = True
        masks.append(mask)
    return masks


def joined_by_rows(values: Sequence[torch.Tensor | None], passes: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """Per-row values of several passes (each ``(rows, ...)`` over the whole batch, only its own rows meaningful) as
    one tensor: each row's from the pass that holds it (``passes``: bool row masks), 0 for rows in none; detached.
    None if no pass gave values."""
    joined = None
    for rows, value in zip(passes, values):
        if value is not None:
            value = value.detach()
            keep = rows.view(-1, *[1] * (value.dim() - 1))
            joined = torch.where(keep, value, torch.zeros_like(value) if joined is None else joined)
    return joined


def pass_token_shares(
    prompt_mask: torch.Tensor, completion_attention_mask: torch.Tensor, passes: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Each pass's share of the tokens the model reads over all of them (prompt and completion, padding aside): the
    weight of a mean over a pass's tokens, such as a router's load-balancing loss. A pass without rows has none."""
    read = prompt_mask.sum(dim=-1) + completion_attention_mask.sum(dim=-1)
    tokens = torch.stack([read[rows].sum() for rows in passes]).float()
    return tokens / tokens.sum().clamp(min=1)
