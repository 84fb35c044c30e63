"""The math of Target Policy Optimization, as pure torch functions.

Nothing here knows about trainers, models or tokenizers, so the functions can be dropped into any RL loop.
Every function works on flat batches of ``G * K`` samples laid out group after group: the ``K = num_generations``
completions of one prompt are contiguous.

For one group with scores ``s``, rollout-time sequence log-probs ``l_old`` and current ones ``l``:

* ``u = (s - mean(s)) / std_pop(s)`` over the valid members (:func:`tpo_scores`),
* ``q = softmax(l_old + u / eta)`` over the valid members (:func:`tpo_targets`),
* ``loss = -sum_i q_i * log_softmax(l)_i`` averaged over groups (:func:`tpo_loss`), whose gradient with respect to
  ``l_i`` is ``(softmax(l)_i - q_i) / G``.

The GRPO family is a table, :data:`POLICY_GRADIENT_FAMILY`: each loss is a per-token surrogate, a normaliser that
turns token losses into one number, and where its clipping bites. A new one is its line there, and a function of its
own for the piece no other loss has. Nothing here compares loss names: the functions that take a ``loss_type`` look
it up in that table (``"tpo"``'s rows with gradient beside it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "POLICY_GRADIENT_FAMILY",
    "POLICY_GRADIENT_LOSSES",
    "SCALE_REWARDS",
    "PolicyGradientLoss",
    "PolicyGradientSettings",
    "RolloutDiagnostics",
    "TargetDiagnostics",
    "advantage_rows_with_gradient",
    "aggregate_policy_loss",
    "capped_weight_fractions",
    "cispo_surrogate",
    "clip_fractions",
    "clipped_ratio_fractions",
    "clipped_surrogate",
    "decoupled_advantages",
    "group_advantages",
    "group_log_softmax",
    "grpo_loss",
    "high_entropy_mask",
    "importance_sampling_weights",
    "informative_groups",
    "log_importance_ratios",
    "off_policy_sequence_mask",
    "policy_gradient_loss",
    "policy_gradient_token_losses",
    "quantile",
    "rollout_diagnostics",
    "rows_with_gradient",
    "sapo_surrogate",
    "scale_token_gradients",
    "sequence_logps",
    "sequence_token_mean",
    "sequence_token_sum",
    "token_kl",
    "token_sum_over_count",
    "token_sum_over_length_budget",
    "tpo_loss",
    "tpo_loss_of_members",
    "tpo_rows_with_gradient",
    "tpo_scores",
    "tpo_target_diagnostics",
    "tpo_targets",
    "truncated_importance_weights",
    "vespo_surrogate",
    "vespo_weights",
]


IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
#: How vLLM's sampling log-probs correct the trainer's (:func:`importance_sampling_weights`).
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
#: How group-centred scores are scaled into advantages (:func:`group_advantages`).
SCALE_REWARDS = ("group", "batch", "none")


def _group(values: torch.Tensor, num_generations: int, name: str) -> torch.Tensor:
    """Reshape a flat ``(G * K,)`` tensor into ``(G, K)``, with a clear error when it does not fit."""
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
    if values.dim() != 1:
        raise ValueError(
            f"`{name}` must be a 1-D tensor of shape (num_groups * num_generations,), got {tuple(values.shape)}."
        )
    if values.numel() % num_generations != 0:
        raise ValueError(
            f"`{name}` has {values.numel()} entries, which is not a whole number of groups of "
            f"num_generations={num_generations}."
        )
    return values.view(-1, num_generations)


def _group_valid(valid_mask: torch.Tensor | None, like: torch.Tensor, num_generations: int) -> torch.Tensor:
    """The grouped boolean validity mask; every member is valid when no mask is given."""
    if valid_mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device).view(-1, num_generations)
    if valid_mask.shape != like.shape:
        raise ValueError(f"`valid_mask` has shape {tuple(valid_mask.shape)} but the values have {tuple(like.shape)}.")
    return valid_mask.to(device=like.device, dtype=torch.bool).view(-1, num_generations)


def _as_float(values: torch.Tensor) -> torch.Tensor:
    """Promote to at least float32, so that integer or half-precision scores are whitened accurately."""
    return values.to(torch.promote_types(values.dtype, torch.float32))


def _require_finite(values: torch.Tensor, valid: torch.Tensor, name: str) -> None:
    """Refuse NaN or infinite values on valid members: they would spread NaN into the weights."""
    bad = valid & ~torch.isfinite(values)
    if bad.any():
        first = int(bad.reshape(-1).nonzero()[0])
        raise ValueError(
            f"`{name}` holds a non-finite value ({values.reshape(-1)[first].item()}) at index {first} on a valid "
            "member; every valid member needs a finite value."
        )


def _informative_groups(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(G,)`` bool: the group's valid scores are not all equal (their variance is > 0).

    Compared exactly (max > min) rather than as ``std > eps``: equal scores such as ``[0.1, 0.1, 0.1]`` can give a
    rounding-level std that a z-score would blow up into large, meaningless values.
    """
    inf = torch.tensor(float("inf"), dtype=scores.dtype, device=scores.device)
    highest = torch.where(valid, scores, -inf).amax(dim=-1)
    lowest = torch.where(valid, scores, inf).amin(dim=-1)
    return highest > lowest


def informative_groups(
    scores: torch.Tensor, num_generations: int, valid_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``(G,)`` bool: which groups carry signal, i.e. have valid scores that are not all equal."""
    grouped = _group(_as_float(scores), num_generations, "scores")
    return _informative_groups(grouped, _group_valid(valid_mask, scores, num_generations))


def rows_with_gradient(
    scores: torch.Tensor,
    num_generations: int,
    valid_mask: torch.Tensor | None = None,
    loss_type: str = "tpo",
    policy_is_old: bool = False,
) -> torch.Tensor:
    """``(G * K,)`` bool: the completions whose policy-loss gradient can be non-zero; the rest may be left out.

    ``scores`` are the whitened ``u`` (the advantages); ``loss_type`` is ``"tpo"`` (:func:`tpo_rows_with_gradient`)
    or one of ``POLICY_GRADIENT_LOSSES`` (:func:`advantage_rows_with_gradient`). Such rows contribute nothing to the
    gradient, so the loss over the remaining rows (with their groups still counted in the averages) has the full
    gradient, up to rounding.
    """
    rows = _ROWS_WITH_GRADIENT.get(loss_type)
    if rows is None:
        raise ValueError(f"loss_type must be 'tpo' or one of {POLICY_GRADIENT_LOSSES}, got {loss_type!r}.")
    return rows(scores, num_generations, valid_mask, policy_is_old)


def tpo_rows_with_gradient(
    scores: torch.Tensor, num_generations: int, valid_mask: torch.Tensor | None = None, policy_is_old: bool = False
) -> torch.Tensor:
    """``(G * K,)`` bool: TPO's rows whose gradient can be non-zero.

    Not an invalid member, nor a member of a group with at most one valid member (that member holds all of ``q`` and
    of the policy's group softmax ``p``), nor, while the policy is still the one ``p_old`` was computed with
    (``policy_is_old``: the same weights and no dropout), a member of a group whose ``u`` are all 0: its target is
    ``q = p_old = p``.
    """
    u = _group(_as_float(scores), num_generations, "scores")
    valid = _group_valid(valid_mask, scores, num_generations)
    live = valid.sum(dim=-1, keepdim=True) >= 2
    if policy_is_old:
        live = live & (valid & (u != 0)).any(dim=-1, keepdim=True)
    return (valid & live).reshape(-1)


def advantage_rows_with_gradient(
    scores: torch.Tensor, num_generations: int, valid_mask: torch.Tensor | None = None, policy_is_old: bool = False
) -> torch.Tensor:
    """``(G * K,)`` bool: the rows with gradient of a loss that multiplies each row by its advantage (the GRPO
    family): the valid members with ``u != 0``, at any ratio, so whether the policy has moved (``policy_is_old``)
    does not matter."""
    u = _group(_as_float(scores), num_generations, "scores")
    valid = _group_valid(valid_mask, scores, num_generations)
    return (valid & (u != 0)).reshape(-1)


def _unit_exponent(values: torch.Tensor, valid: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The exponent of a power of two near the valid values' largest magnitude (per row along ``dim``, or over all).

    Divided by it, with :func:`torch.ldexp`, the values lie within [-2, 2], so their sums and squares neither overflow
    (scores near the dtype's largest) nor underflow (tiny ones); dividing by a power of two is exact, so a z-score of
    the divided values is the z-score of the values.
    """
    magnitude = torch.where(valid, values.abs(), torch.zeros_like(values))
    magnitude = magnitude.amax() if dim is None else magnitude.amax(dim=dim, keepdim=True)
    limit = int(math.log2(torch.finfo(values.dtype).max))
    return (torch.frexp(magnitude).exponent - 1).clamp(-limit, limit)


def _deviations_from_group_mean(grouped: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, 1)`` valid-member counts (at least 1) and ``(G, K)`` deviations from the valid members' mean (0 where
    invalid)."""
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1)
    zero = torch.zeros((), dtype=grouped.dtype, device=grouped.device)
    mean = torch.where(valid, grouped, zero).sum(dim=-1, keepdim=True) / count
    return count, torch.where(valid, grouped - mean, zero)


def tpo_scores(scores: torch.Tensor, num_generations: int, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Whiten scores into ``u`` by a population z-score inside each group, over its valid members only.

    A group whose valid scores are all equal, and every invalid member, gets ``u = 0``.
    """
    grouped = _group(_as_float(scores), num_generations, "scores")
    valid = _group_valid(valid_mask, scores, num_generations)
    _require_finite(grouped, valid, "scores")
    # Centred on a power-of-two scale: scores near the dtype's largest cannot overflow the group's sum.
    count, deviation = _deviations_from_group_mean(torch.ldexp(grouped, -_unit_exponent(grouped, valid, -1)), valid)
    zero = torch.zeros((), dtype=grouped.dtype, device=grouped.device)
    informative = _informative_groups(grouped, valid).unsqueeze(-1)
    # Scale by the largest deviation before squaring: the z-score is unchanged and tiny deviations cannot underflow.
    scale = deviation.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(informative, scale, torch.ones_like(scale))
    scaled = deviation / scale
    std = (scaled.square().sum(dim=-1, keepdim=True) / count).sqrt()
    u = scaled / torch.where(informative, std, torch.ones_like(std))
    return torch.where(valid & informative, u, zero).reshape(-1)


def _batch_std(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The population std of the valid entries of ``values`` (any shape), around their own mean; 0 without two."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    count = valid.sum().clamp(min=1)
    mean = torch.where(valid, values, zero).sum() / count
    return (torch.where(valid, values - mean, zero).square().sum() / count).sqrt()


def group_advantages(
    scores: torch.Tensor, num_generations: int, valid_mask: torch.Tensor | None = None, scale: str = "group"
) -> torch.Tensor:
    """Scores centred on their group's valid mean, then scaled: the advantages ``u`` of every loss.

    * ``"group"``: divided by the group's population std (:func:`tpo_scores`, the default);
    * ``"batch"``: divided by the population std of every valid score of the batch (around the batch mean);
    * ``"none"``: not scaled (``u`` is in the rewards' units).

    A group whose valid scores are all equal, and every invalid member, gets ``u = 0`` exactly.
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS} (or True/False), got {scale!r}.")
    if scale == "group":
        return tpo_scores(scores, num_generations, valid_mask)
    grouped = _group(_as_float(scores), num_generations, "scores")
    valid = _group_valid(valid_mask, scores, num_generations)
    _require_finite(grouped, valid, "scores")
    # On a power-of-two scale (exact) so that huge scores overflow neither the sums nor the squares.
    exponent = _unit_exponent(grouped, valid)
    unit = torch.ldexp(grouped, -exponent)
    _, deviation = _deviations_from_group_mean(unit, valid)
    informative = _informative_groups(grouped, valid).unsqueeze(-1)
    if scale == "batch":
        std = _batch_std(unit, valid)
        deviation = deviation / torch.where(std > 0, std, torch.ones_like(std))
    else:  # "none": back in the rewards' units, where a deviation may not fit
        deviation = torch.ldexp(deviation, exponent)
        _require_finite_deviations(deviation, valid)
    return torch.where(valid & informative, deviation, torch.zeros_like(deviation)).reshape(-1)


def _require_finite_deviations(deviation: torch.Tensor, valid: torch.Tensor) -> None:
    """Refuse unscaled advantages that overflow: scores near the dtype's largest, apart by more than it holds."""
    if not torch.isfinite(deviation[valid]).all():
        raise ValueError(
            f"With scale_rewards='none' the advantages are the scores' deviations from their group's mean, and one "
            f"overflows {deviation.dtype}: scale the rewards down, or set scale_rewards to 'group' or 'batch'."
        )


def decoupled_advantages(
    scores_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    valid_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages for several rewards, normalised one reward at a time (``multi_objective_aggregation=
    "normalize_then_sum"``, GDPO).

    Each reward column of ``(N, F)`` ``scores_per_func`` is z-scored in its groups over the samples it scored (NaN: not
    scored) as in :func:`tpo_scores`; the weighted sum is then z-scored over the whole batch's valid samples (population
    std; 0 everywhere when it has no spread). Invalid members get 0.
    """
    if scores_per_func.dim() != 2 or weights.shape != scores_per_func.shape[1:]:
        raise ValueError(
            f"`scores_per_func` must be (N, F) and `weights` (F,), got {tuple(scores_per_func.shape)} and "
            f"{tuple(weights.shape)}."
        )
    scores_per_func = _as_float(scores_per_func)
    valid = torch.ones(scores_per_func.size(0), dtype=torch.bool, device=scores_per_func.device)
    if valid_mask is not None:
        valid = valid_mask.to(device=valid.device, dtype=torch.bool)
    columns = []
    for column in scores_per_func.unbind(dim=1):
        scored = valid & ~torch.isnan(column)
        columns.append(tpo_scores(torch.nan_to_num(column), num_generations, scored))
    # Weights on a power-of-two scale (exact, the z-score below is unchanged): huge weights cannot overflow the sum.
    weights = weights.to(scores_per_func)
    weights = torch.ldexp(weights, -_unit_exponent(weights, torch.ones_like(weights, dtype=torch.bool)))
    total = (torch.stack(columns, dim=1) * weights).sum(dim=1)
    zero = torch.zeros((), dtype=total.dtype, device=total.device)
    count = valid.sum().clamp(min=1)
    centred = torch.where(valid, total - torch.where(valid, total, zero).sum() / count, zero)
    std = _batch_std(total, valid)
    return centred / std if std > 0 else torch.zeros_like(centred)


def tpo_targets(
    old_sequence_logps: torch.Tensor,
    scores: torch.Tensor,
    num_generations: int,
    valid_mask: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Build the detached target ``q ∝ p_old · exp(u / temperature)`` over each group's valid members.

    ``scores`` are the whitened ``u`` from :func:`tpo_scores`. Invalid members get ``q = 0``; a group without a valid
    member is all zeros.
    """
    if not temperature > 0:
        raise ValueError(f"The target temperature must be > 0, got {temperature}.")
    if scores.shape != old_sequence_logps.shape:
        raise ValueError(
            f"`scores` has shape {tuple(scores.shape)} but `old_sequence_logps` has {tuple(old_sequence_logps.shape)}."
        )
    old = _group(_as_float(old_sequence_logps.detach()), num_generations, "old_sequence_logps")
    u = _group(_as_float(scores.detach()), num_generations, "scores").to(old.dtype)
    valid = _group_valid(valid_mask, old_sequence_logps, num_generations)
    _require_finite(old, valid, "old_sequence_logps")
    _require_finite(u, valid, "scores")
    # softmax(log_softmax(l_old) + u/eta) == softmax(l_old + u/eta): the group's normaliser cancels.
    tilted = old + u / temperature
    if not torch.isfinite(tilted[valid]).all():
        raise ValueError(
            f"The target temperature {temperature} is too small for these scores: u / temperature overflows. Use a "
            "larger temperature (0.25 to 2 works well)."
        )
    logits = torch.where(valid, tilted, torch.tensor(float("-inf"), dtype=old.dtype, device=old.device))
    has_valid = valid.any(dim=-1, keepdim=True)
    logits = torch.where(has_valid, logits, torch.zeros_like(logits))  # an all -inf row would softmax to NaN
    return (torch.softmax(logits, dim=-1) * valid).reshape(-1)


def sequence_logps(
    per_token_logps: torch.Tensor, completion_mask: torch.Tensor, length_normalize: bool = True
) -> torch.Tensor:
    """Reduce ``(B, T)`` token log-probs to ``(B,)`` sequence log-probs over the mask: a mean or a sum.

    A row with an empty mask gives 0. Masked positions are ignored even if they hold ``-inf`` or NaN.
    """
    if per_token_logps.shape != completion_mask.shape:
        raise ValueError(
            f"`per_token_logps` has shape {tuple(per_token_logps.shape)} but `completion_mask` has "
            f"{tuple(completion_mask.shape)}."
        )
    mask = completion_mask.bool()
    total = torch.where(mask, per_token_logps, torch.zeros_like(per_token_logps)).sum(dim=-1)
    if not length_normalize:
        return total
    return total / mask.sum(dim=-1).clamp(min=1).to(total.dtype)


def group_log_softmax(
    sequence_logps: torch.Tensor, num_generations: int, valid_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``log p``: the log-softmax of the sequence log-probs over each group's valid members (its policy softmax).

    Invalid members read a finite, meaningless value; a group without a valid member is finite too (never NaN).
    """
    logps = _group(_as_float(sequence_logps), num_generations, "sequence_logps")
    valid = _group_valid(valid_mask, sequence_logps, num_generations)
    # A finite fill rather than -inf: a group with no valid member then has a finite log-softmax, so neither the
    # value nor the gradient (routed to nobody by `where`) can become NaN.
    floor = torch.tensor(torch.finfo(logps.dtype).min, dtype=logps.dtype, device=logps.device)
    return torch.log_softmax(torch.where(valid, logps, floor), dim=-1).reshape(-1)


def tpo_loss(
    sequence_logps: torch.Tensor,
    targets: torch.Tensor,
    num_generations: int,
    valid_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy from the target ``q`` to the policy's group softmax, averaged over groups.

    The log-softmax runs over each group's valid members. A group without a valid member contributes exactly 0 and
    still counts in the average, so the gradient with respect to ``l_i`` is ``(p_i - q_i) / G`` everywhere.
    """
    log_policy = _group(group_log_softmax(sequence_logps, num_generations, valid_mask), num_generations, "logps")
    q = _group(targets.detach(), num_generations, "targets").to(log_policy.dtype)
    valid = _group_valid(valid_mask, sequence_logps, num_generations)
    cross_entropy = -torch.where(valid, q * log_policy, torch.zeros_like(log_policy)).sum(dim=-1)
    return cross_entropy.mean()


def tpo_loss_of_members(
    sequence_logps: torch.Tensor,
    group_log_probs: torch.Tensor,
    targets: torch.Tensor,
    num_groups: float,
    valid_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """TPO's loss over some members of groups whose softmax at the current weights is known: ``log p`` from
    :func:`group_log_softmax` of the whole groups, computed beforehand.

    The gradient with respect to ``l_i`` is ``(p_i - q_i) / num_groups``, as :func:`tpo_loss`'s over the whole groups
    (``num_groups`` of them); the value is these members' part ``-sum_i q_i log p_i / num_groups`` of its value. So
    the members of a group may be spread over several backward passes at the same weights: their losses add up to
    the whole groups' loss, value and gradient. Invalid members contribute 0.
    """
    if not sequence_logps.shape == group_log_probs.shape == targets.shape:
        raise ValueError(
            f"`sequence_logps` {tuple(sequence_logps.shape)}, `group_log_probs` {tuple(group_log_probs.shape)} and "
            f"`targets` {tuple(targets.shape)} must have one entry per member."
        )
    logps = _as_float(sequence_logps)
    log_policy = group_log_probs.detach().to(logps.dtype)
    q = targets.detach().to(logps.dtype)
    valid = torch.ones_like(logps, dtype=torch.bool) if valid_mask is None else valid_mask.bool()
    zero = torch.zeros_like(logps)
    value = -torch.where(valid, q * log_policy, zero).sum()
    # Value 0, gradient (p - q): the whole groups' gradient reaches each member through its own l_i.
    pull = torch.where(valid, (log_policy.exp() - q) * (logps - logps.detach()), zero).sum()
    return (value + pull) / num_groups


def token_kl(
    per_token_logps: torch.Tensor,
    ref_per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    importance_ratios: torch.Tensor | None = None,
    token_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The non-negative KL estimate ``exp(r) - r - 1``, ``r = logp_ref - logp``, averaged over completion tokens.

    With ``importance_ratios`` (``p / p_old`` per token or per sequence) each token's estimate is multiplied by its
    ratio: the estimate is then unbiased for the current policy although the tokens were sampled from the old one.
    ``token_count`` divides the sum instead of the mask's count (a pass's part of a larger batch's mean).
    """
    mask = completion_mask.bool()
    log_ratio = _masked_log_ratio(ref_per_token_logps, per_token_logps, mask)
    per_token = torch.exp(log_ratio) - log_ratio - 1
    if importance_ratios is not None:
        per_token = torch.where(mask, per_token * importance_ratios, torch.zeros_like(per_token))
    count = mask.sum().clamp(min=1) if token_count is None else token_count
    return per_token.sum() / count


def high_entropy_mask(
    entropies: torch.Tensor,
    completion_mask: torch.Tensor,
    top_quantile: float,
    pool: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(B, T)`` bool: the completion tokens among the ``top_quantile`` fraction with the highest entropy.

    The cut is the ``1 - top_quantile`` quantile of ``pool`` (1-D: the entropies to rank against, e.g. every process's
    completion tokens; default: this batch's). ``top_quantile = 1`` keeps every token, ``0`` only the highest ones.
    """
    mask = completion_mask.bool()
    pool = entropies.detach()[mask] if pool is None else pool.detach()
    if pool.numel() == 0:
        return torch.zeros_like(mask)
    cut = quantile(_as_float(pool), 1 - top_quantile)
    return mask & (entropies.detach() >= cut)


def quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q`` quantile of 1-D ``values``, interpolated linearly between order statistics as ``torch.quantile``
    does by default, at any size (``torch.quantile`` refuses more than 2**24 values; a gathered pool exceeds that).

    The rank ``q * (n - 1)`` is taken in float64, so it stays exact for any ``n``; on float64 values the result is
    ``torch.quantile``'s bit for bit.
    """
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"quantile needs a non-empty 1-D tensor, got shape {tuple(values.shape)}.")
    if not 0 <= q <= 1:
        raise ValueError(f"quantile needs q in [0, 1], got {q}.")
    rank = q * (values.numel() - 1)
    below = math.floor(rank)
    lower = torch.kthvalue(values, below + 1).values  # kthvalue counts from 1
    if rank == below:
        return lower
    upper = torch.kthvalue(values, below + 2).values
    return torch.lerp(lower, upper, rank - below)


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    per_token_logps: torch.Tensor,
    sampler_per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """``(B, 1)`` float: 0 for a completion with a negative advantage whose mean token KL from the sampling policy,
    ``mean(log p_sampler - log p)``, exceeds ``threshold`` (it is too far off-policy to push down); 1 otherwise."""
    # The mean token log ratio log(p / p_sampler), negated.
    mean_divergence = -log_importance_ratios(
        per_token_logps.detach(), sampler_per_token_logps, completion_mask, "sequence"
    )
    keep = (advantages.detach().reshape(-1, 1) >= 0) | (mean_divergence <= threshold)
    return keep.to(per_token_logps.dtype)


def log_importance_ratios(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    level: str = "token",
) -> torch.Tensor:
    """``log(p / p_old)`` per token ``(B, T)`` (0 where masked), or per sequence ``(B, 1)``: the masked token mean (GSPO)."""
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}.")
    mask = completion_mask.bool()
    log_ratio = _masked_log_ratio(per_token_logps, old_per_token_logps.detach(), mask)
    if level == "token":
        return log_ratio
    return (log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).unsqueeze(-1)


def _masked_log_ratio(logps: torch.Tensor, other_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logps - other_logps`` per token, 0 where ``mask`` is False (the masked side may hold anything, even -inf)."""
    difference = logps - other_logps
    return torch.where(mask, difference, torch.zeros_like(difference))


def _importance_ratios(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, completion_mask: torch.Tensor, level: str
) -> torch.Tensor:
    """``p / p_old`` per token ``(B, T)`` or per sequence ``(B, 1)`` (:func:`log_importance_ratios`)."""
    return torch.exp(log_importance_ratios(per_token_logps, old_per_token_logps, completion_mask, level))


def vespo_weights(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> torch.Tensor:
    """VESPO's detached ``(B, 1)`` sequence weights ``phi(w) = exp(lambda * (1 - w)) * w^k``, with ``w`` the product of
    the sequence's token ratios and ``(k, lambda)`` chosen by the sign of the advantage (``A >= 0``: the positive pair).

    ``phi(1) = 1``: on-policy samples are weighted 1, samples far off-policy in either direction fade to 0. Token log
    ratios are clipped to ±20 and ``log w`` to ``[log 1e-8, 20]`` so that ``w`` stays finite.
    """
    log_w = (log_ratio.detach().clamp(-20.0, 20.0) * completion_mask).sum(dim=-1, keepdim=True)
    log_w = log_w.clamp(math.log(1e-8), 20.0)
    positive = advantages.detach().reshape(-1, 1) >= 0
    k = torch.where(positive, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(positive, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
    phi = torch.exp(lam * (1 - torch.exp(log_w)) + k * log_w)
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


class PolicyGradientSettings(NamedTuple):
    """What shapes a GRPO-family surrogate; each loss reads the settings it has (the defaults are TRL's)."""

    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float | None = None  # None: epsilon_low
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_parameters: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)

    @property
    def upper_epsilon(self) -> float:
        """``epsilon_high``, or ``epsilon_low`` when it is not set."""
        return self.epsilon_low if self.epsilon_high is None else self.epsilon_high


def _advantage_column(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``(B, 1)`` detached advantages in ``like``'s dtype, to multiply token losses by."""
    return advantages.detach().to(like.dtype).unsqueeze(-1)


def clipped_surrogate(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    settings: PolicyGradientSettings,
) -> torch.Tensor:
    """``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` per token (or per sequence); with ``delta`` the unclipped
    ``r`` is also capped at ``delta`` (two-sided clipping)."""
    level = settings.importance_sampling_level
    ratio = _importance_ratios(per_token_logps, old_per_token_logps, completion_mask, level)
    advantage = _advantage_column(advantages, per_token_logps)
    clipped = ratio.clamp(1 - settings.epsilon_low, 1 + settings.upper_epsilon)
    if settings.delta is not None:
        ratio = ratio.clamp(max=settings.delta)
    return -torch.minimum(ratio * advantage, clipped * advantage)


def cispo_surrogate(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    settings: PolicyGradientSettings,
) -> torch.Tensor:
    """``-sg(min(r, eps_high)) A log p``: the clipped ratio is a constant weight on the log-prob."""
    level = settings.importance_sampling_level
    ratio = _importance_ratios(per_token_logps, old_per_token_logps, completion_mask, level)
    advantage = _advantage_column(advantages, per_token_logps)
    return -ratio.clamp(max=settings.upper_epsilon).detach() * advantage * per_token_logps


def sapo_surrogate(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    settings: PolicyGradientSettings,
) -> torch.Tensor:
    """``-sigmoid(tau (r - 1)) * 4 / tau * A``, ``tau`` by the sign of ``A``: a soft gate, slope 1 at ``r = 1``."""
    level = settings.importance_sampling_level
    ratio = _importance_ratios(per_token_logps, old_per_token_logps, completion_mask, level)
    advantage = _advantage_column(advantages, per_token_logps)
    positive, negative = settings.sapo_temperature_pos, settings.sapo_temperature_neg
    temperature = torch.where(advantage > 0, positive, negative).to(ratio.dtype)
    return -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * advantage


def vespo_surrogate(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    settings: PolicyGradientSettings,
) -> torch.Tensor:
    """``-phi(w) A log p`` with :func:`vespo_weights`; its ratio is always the whole sequence's, whatever
    ``importance_sampling_level`` says."""
    token_log_ratio = log_importance_ratios(per_token_logps, old_per_token_logps, completion_mask, "token")
    phi = vespo_weights(token_log_ratio, advantages, completion_mask, *settings.vespo_parameters)
    return -phi * _advantage_column(advantages, per_token_logps) * per_token_logps


def sequence_token_mean(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    max_completion_length: int | None = None,
    token_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The token mean of each sequence, averaged over sequences (grpo, sapo)."""
    return (per_token.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).mean()


def token_sum_over_count(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    max_completion_length: int | None = None,
    token_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The sum over every token divided by ``token_count`` (default: the batch's token count); a trainer passes the
    global token count it wants each token weighted by (bnpo, dapo, cispo, vespo)."""
    count = mask.sum() if token_count is None else token_count
    return per_token.sum() / torch.as_tensor(count, dtype=per_token.dtype, device=per_token.device).clamp(min=1)


def token_sum_over_length_budget(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    max_completion_length: int | None = None,
    token_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The sum over every token divided by ``B * max_completion_length``, a constant (dr_grpo)."""
    if max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' divides by max_completion_length: pass it.")
    return per_token.sum() / (per_token.size(0) * max_completion_length)


def sequence_token_sum(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    max_completion_length: int | None = None,
    token_count: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Each sequence's token sum (its mean scaled by its length), averaged over sequences (luspo)."""
    return per_token.sum(dim=-1).mean()


def clipped_ratio_fractions(
    ratio: torch.Tensor, advantage: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> dict[str, torch.Tensor]:
    """Where a clipped surrogate's clip bites: ``low`` (``r < 1 - eps_low`` with ``A < 0``), ``high``
    (``r > 1 + eps_high`` with ``A > 0``) and ``region`` (either)."""
    low = (ratio < 1 - epsilon_low) & (advantage < 0)
    high = (ratio > 1 + epsilon_high) & (advantage > 0)
    return {"low": low.float(), "high": high.float(), "region": (low | high).float()}


def capped_weight_fractions(
    ratio: torch.Tensor, advantage: torch.Tensor, epsilon_low: float, epsilon_high: float
) -> dict[str, torch.Tensor]:
    """Where CISPO's cap on the weight bites: ``high`` (``r > eps_high`` with ``A > 0``)."""
    return {"high": ((ratio > epsilon_high) & (advantage > 0)).float()}


#: (per_token_logps, old_per_token_logps, advantages, completion_mask, settings) -> token losses, as
#: :func:`clipped_surrogate`.
Surrogate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, PolicyGradientSettings], torch.Tensor]
#: (masked token losses, mask, max_completion_length, token_count) -> the loss, as :func:`sequence_token_mean`.
Normaliser = Callable[[torch.Tensor, torch.Tensor, int | None, float | torch.Tensor | None], torch.Tensor]
#: (ratio, advantage, epsilon_low, epsilon_high) -> indicators by name, as :func:`clipped_ratio_fractions`.
ClipIndicators = Callable[[torch.Tensor, torch.Tensor, float, float], dict[str, torch.Tensor]]


class PolicyGradientLoss(NamedTuple):
    """One GRPO-family loss as its pieces: the per-token loss, how the token losses become one number, and where its
    clipping bites (None: it has no clip to measure)."""

    surrogate: Surrogate
    normaliser: Normaliser
    clipping: ClipIndicators | None = None


#: The GRPO family under TRL's names, each loss's pieces. The functions below that take a ``loss_type`` take a name
#: of this table or the pieces themselves (as the trainer's objectives pass them).
POLICY_GRADIENT_FAMILY: dict[str, PolicyGradientLoss] = {
    "grpo": PolicyGradientLoss(clipped_surrogate, sequence_token_mean, clipped_ratio_fractions),
    "dapo": PolicyGradientLoss(clipped_surrogate, token_sum_over_count, clipped_ratio_fractions),
    "dr_grpo": PolicyGradientLoss(clipped_surrogate, token_sum_over_length_budget, clipped_ratio_fractions),
    "bnpo": PolicyGradientLoss(clipped_surrogate, token_sum_over_count, clipped_ratio_fractions),
    "cispo": PolicyGradientLoss(cispo_surrogate, token_sum_over_count, capped_weight_fractions),
    "sapo": PolicyGradientLoss(sapo_surrogate, sequence_token_mean),
    "luspo": PolicyGradientLoss(clipped_surrogate, sequence_token_sum, clipped_ratio_fractions),
    "vespo": PolicyGradientLoss(vespo_surrogate, token_sum_over_count),
}
#: The clipped or weighted policy-gradient losses, beside TPO's target cross-entropy (``"tpo"``).
POLICY_GRADIENT_LOSSES = tuple(POLICY_GRADIENT_FAMILY)
#: Each loss's rows with gradient (:func:`rows_with_gradient`).
_ROWS_WITH_GRADIENT = {
    "tpo": tpo_rows_with_gradient,
    **dict.fromkeys(POLICY_GRADIENT_LOSSES, advantage_rows_with_gradient),
}


def _family_member(loss_type: str | PolicyGradientLoss) -> PolicyGradientLoss:
    """The pieces of a GRPO-family loss given by name or already as its pieces."""
    if isinstance(loss_type, PolicyGradientLoss):
        return loss_type
    member = POLICY_GRADIENT_FAMILY.get(loss_type)
    if member is None:
        raise ValueError(f"loss_type must be one of {POLICY_GRADIENT_LOSSES}, got {loss_type!r}.")
    return member


def policy_gradient_token_losses(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    loss_type: str | PolicyGradientLoss = "grpo",
    importance_sampling_level: str = "token",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_parameters: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
) -> torch.Tensor:
    """The per-token loss of a policy-gradient ``loss_type``: ``(B, T)``, or ``(B, 1)`` with sequence-level ratios.

    With ``r`` the importance ratio (token or sequence, :func:`log_importance_ratios`) and ``A`` the advantage:

    * ``grpo``, ``dapo``, ``dr_grpo``, ``bnpo``, ``luspo``: ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``;
      with ``delta`` the unclipped ``r`` is also capped at ``delta`` (two-sided clipping) (:func:`clipped_surrogate`);
    * ``cispo``: ``-sg(min(r, eps_high)) A log p``: the clipped ratio is a constant weight on the log-prob;
    * ``sapo``: ``-sigmoid(tau (r - 1)) * 4 / tau * A``, ``tau`` by the sign of ``A`` (a soft gate, slope 1 at r = 1);
    * ``vespo``: ``-phi(w) A log p`` with :func:`vespo_weights` (its ratio is always the whole sequence's).
    """
    surrogate = _family_member(loss_type).surrogate
    settings = PolicyGradientSettings(
        importance_sampling_level,
        epsilon_low,
        epsilon_high,
        delta,
        sapo_temperature_pos,
        sapo_temperature_neg,
        vespo_parameters,
    )
    return surrogate(per_token_logps, old_per_token_logps, advantages, completion_mask, settings)


def aggregate_policy_loss(
    token_losses: torch.Tensor,
    completion_mask: torch.Tensor,
    loss_type: str | PolicyGradientLoss = "grpo",
    max_completion_length: int | None = None,
    token_count: float | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token losses ``(B, T)`` or ``(B, 1)`` to the scalar loss of ``loss_type``.

    ``token_weights`` (``(B, T)`` or ``(B, 1)``, constants) multiply the token losses first, leaving every normaliser
    as it is: a weight of 0 drops a token's loss (an entropy or off-policy mask) without changing the others' weight.

    * ``grpo``, ``sapo``: the token mean of each sequence, averaged over sequences;
    * ``bnpo``, ``dapo``, ``cispo``, ``vespo``: the sum over every token divided by ``token_count`` (default: the
      batch's token count); a trainer passes the global token count it wants each token weighted by;
    * ``dr_grpo``: the sum divided by ``B * max_completion_length``, a constant;
    * ``luspo``: each sequence's token sum (its mean scaled by its length), averaged over sequences.

    A sequence-level ``(B, 1)`` loss counts once per token of its sequence. A sequence with an empty mask gives 0.
    """
    normaliser = _family_member(loss_type).normaliser
    mask = completion_mask.to(token_losses.dtype)
    if token_weights is not None:
        token_losses = token_losses * token_weights.detach().to(token_losses.dtype)
    per_token = token_losses.expand_as(mask) * mask
    per_token = torch.where(completion_mask.bool(), per_token, torch.zeros_like(per_token))  # no 0 * inf = NaN
    return normaliser(per_token, mask, max_completion_length, token_count)


def policy_gradient_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    loss_type: str | PolicyGradientLoss = "grpo",
    max_completion_length: int | None = None,
    token_count: float | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    **settings: Any,
) -> torch.Tensor:
    """A GRPO-family loss: :func:`policy_gradient_token_losses` reduced by :func:`aggregate_policy_loss`."""
    token_losses = policy_gradient_token_losses(
        per_token_logps, old_per_token_logps, advantages, completion_mask, loss_type, **settings
    )
    return aggregate_policy_loss(
        token_losses, completion_mask, loss_type, max_completion_length, token_count, token_weights
    )


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
) -> torch.Tensor:
    """The clipped-surrogate loss, token-averaged per sequence and then averaged over sequences (``loss_type="grpo"``).

    Per token: ``-min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)`` with
    ``ratio = exp(logp - logp_old)``. A sequence with an empty mask contributes 0.
    """
    return policy_gradient_loss(
        per_token_logps,
        old_per_token_logps,
        advantages,
        completion_mask,
        "grpo",
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
    )


def clip_fractions(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    loss_type: str | PolicyGradientLoss = "grpo",
    importance_sampling_level: str = "token",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token ``(B, T)`` float indicators of where the clipping bites, for the clip-ratio metrics.

    Clipped surrogates: ``low`` (``r < 1 - eps_low`` with ``A < 0``), ``high`` (``r > 1 + eps_high`` with ``A > 0``)
    and ``region`` (either); ``cispo``: ``high`` where ``r > eps_high`` with ``A > 0``. Other losses: none.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    member = loss_type if isinstance(loss_type, PolicyGradientLoss) else POLICY_GRADIENT_FAMILY.get(loss_type)
    if member is None or member.clipping is None:
        return {}
    ratio = _importance_ratios(per_token_logps, old_per_token_logps, completion_mask, importance_sampling_level)
    ratio = ratio.detach().expand_as(per_token_logps)
    return member.clipping(ratio, advantages.detach().reshape(-1, 1), epsilon_low, epsilon_high)


def truncated_importance_weights(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    cap: float,
) -> torch.Tensor:
    """Per-token truncated importance weights ``min(exp(trainer - sampler), cap)``, detached; 1 at masked positions.

    They correct for tokens having been sampled by a different implementation of the same policy (a vLLM engine)
    whose probabilities differ slightly from the trainer's.
    """
    if cap < 1:
        raise ValueError(f"The importance-sampling cap must be >= 1, got {cap}.")
    return importance_sampling_weights(trainer_logps, sampler_logps, completion_mask, "token_truncate", None, cap)


def importance_sampling_weights(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    completion_mask: torch.Tensor,
    mode: str = "token_truncate",
    clip_min: float | None = None,
    clip_max: float | None = 2.0,
) -> torch.Tensor:
    """Detached ``(B, T)`` importance weights ``p_trainer / p_sampler`` bounded by ``[clip_min, clip_max]``; 1 at masked
    positions.

    ``token_*``: one ratio per token; ``sequence_*``: the ratio of the whole completion (the product of its tokens'),
    on each of its tokens. ``*_truncate`` clamps the ratio into the bounds; ``*_mask`` sets it to 0 outside them.
    A bound of None is no bound.
    """
    if mode not in IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"The importance-sampling mode must be one of {IMPORTANCE_SAMPLING_MODES}, got {mode!r}.")
    mask = completion_mask.bool()
    log_ratio = log_importance_ratios(trainer_logps.detach(), sampler_logps, completion_mask, "token")
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    low = -math.inf if clip_min is None else math.log(clip_min) if clip_min > 0 else -math.inf
    high = math.inf if clip_max is None else math.log(clip_max)
    if mode.endswith("truncate"):
        weights = torch.exp(log_ratio.clamp(min=low, max=high))
    else:
        inside = (log_ratio >= low) & (log_ratio <= high)
        weights = torch.where(inside, torch.exp(log_ratio.clamp(max=high)), torch.zeros_like(log_ratio))
    return torch.where(mask, weights, torch.ones_like(weights))


def scale_token_gradients(per_token_logps: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The same values, with the gradient through each token multiplied by ``weights`` (treated as constants).

    Weighting gradients rather than values keeps every loss value, the policy's group softmax ``p`` and therefore
    TPO's fixed point ``p = q`` unchanged: the gradient on a completion is still ``(p_i - q_i)`` times its tokens'
    (now weighted) log-prob gradients, and it vanishes when the policy matches the target.
    """
    weights = weights.detach().to(per_token_logps.dtype)
    return per_token_logps + (weights - 1) * (per_token_logps - per_token_logps.detach())


class RolloutDiagnostics(NamedTuple):
    """Summary statistics of a rollout's scores, as 0-d tensors."""

    reward: torch.Tensor  # mean score over every completion sampled (invalid ones included: they were scored)
    # Mean, over groups with a valid member, of the population std of the group's valid scores: the spread the
    # whitening into u divides by; NaN when no group has a valid member.
    reward_std: torch.Tensor
    informative_group_fraction: torch.Tensor  # fraction of groups whose valid scores vary (informative_groups)


def rollout_diagnostics(
    scores: torch.Tensor, num_generations: int, valid_mask: torch.Tensor | None = None
) -> RolloutDiagnostics:
    """Summary statistics of a rollout's scores (:class:`RolloutDiagnostics`)."""
    grouped = _group(_as_float(scores.detach()), num_generations, "scores")
    valid = _group_valid(valid_mask, scores, num_generations)
    count, deviation = _deviations_from_group_mean(grouped, valid)
    variance = (deviation.square().sum(dim=-1, keepdim=True) / count).squeeze(-1)
    has_valid = valid.any(dim=-1)
    nan = torch.tensor(float("nan"), dtype=grouped.dtype, device=grouped.device)
    return RolloutDiagnostics(
        reward=grouped.mean(),
        reward_std=variance.sqrt()[has_valid].mean() if has_valid.any() else nan,
        informative_group_fraction=_informative_groups(grouped, valid).float().mean(),
    )


class TargetDiagnostics(NamedTuple):
    """The paper's diagnostics of a batch of targets, as 0-d tensors."""

    target_entropy: torch.Tensor  # mean entropy of q over groups with a valid member
    informative_group_fraction: torch.Tensor  # fraction of groups whose valid raw scores vary
    # Mean, over informative groups, of the target mass on the group's highest-scoring completions (ties share it);
    # NaN when no group is informative.
    best_completion_target_mass: torch.Tensor


def tpo_target_diagnostics(
    targets: torch.Tensor,
    scores: torch.Tensor,
    num_generations: int,
    valid_mask: torch.Tensor | None = None,
) -> TargetDiagnostics:
    """The paper's diagnostics of a batch of targets (:class:`TargetDiagnostics`)."""
    q = _group(_as_float(targets.detach()), num_generations, "targets")
    raw = _group(_as_float(scores.detach()), num_generations, "scores")
    valid = _group_valid(valid_mask, targets, num_generations)
    has_valid = valid.any(dim=-1)
    informative = _informative_groups(raw, valid)
    entropy = -(q * torch.log(q.clamp(min=torch.finfo(q.dtype).tiny))).sum(dim=-1)
    best_score = torch.where(valid, raw, torch.tensor(float("-inf"), dtype=raw.dtype, device=raw.device)).amax(
        dim=-1, keepdim=True
    )
    best_mass = (q * (valid & (raw == best_score))).sum(dim=-1)
    nan = torch.tensor(float("nan"), device=q.device)
    return TargetDiagnostics(
        target_entropy=entropy[has_valid].mean() if has_valid.any() else nan,
        informative_group_fraction=informative.float().mean(),
        best_completion_target_mass=best_mass[informative].mean() if informative.any() else nan,
    )
