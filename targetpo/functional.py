"""The math of Target Policy Optimization, as pure torch functions.

Nothing here knows about trainers, models or tokenizers, so the functions can be dropped into any RL loop.
Every function works on flat batches of ``G * K`` samples laid out group after group: the ``K = num_generations``
completions of one prompt are contiguous.

For one group with scores ``s``, rollout-time sequence log-probs ``l_old`` and current ones ``l``:

* ``u = (s - mean(s)) / std_pop(s)`` over the valid members (:func:`tpo_scores`),
* ``q = softmax(l_old + u / eta)`` over the valid members (:func:`tpo_targets`),
* ``loss = -sum_i q_i * log_softmax(l)_i`` averaged over groups (:func:`tpo_loss`), whose gradient with respect to
  ``l_i`` is ``(softmax(l)_i - q_i) / G``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "grpo_loss",
    "informative_groups",
    "rollout_diagnostics",
    "rows_with_gradient",
    "scale_token_gradients",
    "sequence_logps",
    "token_kl",
    "tpo_loss",
    "tpo_scores",
    "tpo_target_diagnostics",
    "tpo_targets",
    "truncated_importance_weights",
]


def _group(values: torch.Tensor, num_generations: int, name: str) -> torch.Tensor:
    """Reshape a flat ``(G * K,)`` tensor into ``(G, K)``, with a clear error when it does not fit."""
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
    if values.dim() != 1:
        raise ValueError(f"`{name}` must be a 1-D tensor of shape (num_groups * num_generations,), got {tuple(values.shape)}.")
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

    ``scores`` are the whitened ``u`` (the advantages). For both losses an invalid member never has a gradient. For
    ``"grpo"`` neither has a member with ``u = 0``: its surrogate is 0 at any ratio. For ``"tpo"``, a group with at
    most one valid member never does (that member holds all of ``q`` and of the policy's group softmax ``p``), and,
    while the policy is still the one ``p_old`` was computed with (``policy_is_old``: the same weights and no
    dropout), neither does a group whose ``u`` are all 0: its target is ``q = p_old = p``. Such rows contribute
    nothing to the gradient, so the loss over the remaining rows (with their groups still counted in the averages)
    has the full gradient, up to rounding.
    """
    u = _group(_as_float(scores), num_generations, "scores")
    valid = _group_valid(valid_mask, scores, num_generations)
    if loss_type == "grpo":
        return (valid & (u != 0)).reshape(-1)
    if loss_type != "tpo":
        raise ValueError(f"loss_type must be 'tpo' or 'grpo', got {loss_type!r}.")
    live = valid.sum(dim=-1, keepdim=True) >= 2
    if policy_is_old:
        live = live & (valid & (u != 0)).any(dim=-1, keepdim=True)
    return (valid & live).reshape(-1)


def _deviations_from_group_mean(grouped: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, 1)`` valid-member counts (at least 1) and ``(G, K)`` deviations from the valid members' mean (0 where
    invalid)."""
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1)
    zero = torch.zeros((), dtype=grouped.dtype, device=grouped.device)
    mean = torch.where(valid, grouped, zero).sum(dim=-1, keepdim=True) / count
    return count, torch.where(valid, grouped - mean, zero)


def tpo_scores(
    scores: torch.Tensor, num_generations: int, valid_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Whiten scores into ``u`` by a population z-score inside each group, over its valid members only.

    A group whose valid scores are all equal, and every invalid member, gets ``u = 0``.
    """
    grouped = _group(_as_float(scores), num_generations, "scores")
    valid = _group_valid(valid_mask, scores, num_generations)
    _require_finite(grouped, valid, "scores")
    count, deviation = _deviations_from_group_mean(grouped, valid)
    zero = torch.zeros((), dtype=grouped.dtype, device=grouped.device)
    informative = _informative_groups(grouped, valid).unsqueeze(-1)
    # Scale by the largest deviation before squaring: the z-score is unchanged and huge scores cannot overflow.
    scale = deviation.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(informative, scale, torch.ones_like(scale))
    scaled = deviation / scale
    std = (scaled.square().sum(dim=-1, keepdim=True) / count).sqrt()
    u = scaled / torch.where(informative, std, torch.ones_like(std))
    return torch.where(valid & informative, u, zero).reshape(-1)


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
    logps = _group(_as_float(sequence_logps), num_generations, "sequence_logps")
    q = _group(targets.detach(), num_generations, "targets").to(logps.dtype)
    valid = _group_valid(valid_mask, sequence_logps, num_generations)
    # A finite fill rather than -inf: a group with no valid member then has a finite log-softmax, so neither the
    # value nor the gradient (routed to nobody by `where`) can become NaN.
    floor = torch.tensor(torch.finfo(logps.dtype).min, dtype=logps.dtype, device=logps.device)
    log_policy = torch.log_softmax(torch.where(valid, logps, floor), dim=-1)
    cross_entropy = -torch.where(valid, q * log_policy, torch.zeros_like(log_policy)).sum(dim=-1)
    return cross_entropy.mean()


def token_kl(
    per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor, completion_mask: torch.Tensor
) -> torch.Tensor:
    """The non-negative KL estimate ``exp(r) - r - 1``, ``r = logp_ref - logp``, averaged over completion tokens."""
    mask = completion_mask.bool()
    log_ratio = torch.where(mask, ref_per_token_logps - per_token_logps, torch.zeros_like(per_token_logps))
    per_token = torch.exp(log_ratio) - log_ratio - 1
    return per_token.sum() / mask.sum().clamp(min=1)


def grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
) -> torch.Tensor:
    """The clipped-surrogate policy-gradient loss, token-averaged per sequence and then averaged over sequences.

    Per token: ``-min(ratio * A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) * A)`` with
    ``ratio = exp(logp - logp_old)``. A sequence with an empty mask contributes 0.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = completion_mask.bool()
    log_ratio = torch.where(mask, per_token_logps - old_per_token_logps.detach(), torch.zeros_like(per_token_logps))
    ratio = torch.exp(log_ratio)
    advantage = advantages.detach().to(ratio.dtype).unsqueeze(-1)
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * advantage)
    per_sequence = sequence_logps(-surrogate, mask, length_normalize=True)
    return per_sequence.mean()


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
    mask = completion_mask.bool()
    log_ratio = torch.where(mask, trainer_logps.detach() - sampler_logps.detach(), torch.zeros_like(trainer_logps))
    return torch.exp(log_ratio.clamp(max=math.log(cap)))


def scale_token_gradients(per_token_logps: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The same values, with the gradient through each token multiplied by ``weights`` (treated as constants).

    Weighting gradients rather than values keeps every loss value, the policy's group softmax ``p`` and therefore
    TPO's fixed point ``p = q`` unchanged: the gradient on a completion is still ``(p_i - q_i)`` times its tokens'
    (now weighted) log-prob gradients, and it vanishes when the policy matches the target.
    """
    weights = weights.detach().to(per_token_logps.dtype)
    return per_token_logps + (weights - 1) * (per_token_logps - per_token_logps.detach())


def rollout_diagnostics(
    scores: torch.Tensor, num_generations: int, valid_mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Summary statistics of a rollout's scores, as 0-d tensors.

    * ``reward``: mean score over every completion sampled (invalid ones included: they were sampled and scored).
    * ``reward_std``: mean, over groups with a valid member, of the population std of the group's valid scores —
      the spread the whitening into ``u`` divides by; NaN when no group has a valid member.
    * ``informative_group_fraction``: fraction of groups whose valid scores vary (see :func:`informative_groups`).
    """
    grouped = _group(_as_float(scores.detach()), num_generations, "scores")
    valid = _group_valid(valid_mask, scores, num_generations)
    count, deviation = _deviations_from_group_mean(grouped, valid)
    variance = (deviation.square().sum(dim=-1, keepdim=True) / count).squeeze(-1)
    has_valid = valid.any(dim=-1)
    nan = torch.tensor(float("nan"), dtype=grouped.dtype, device=grouped.device)
    return {
        "reward": grouped.mean(),
        "reward_std": variance.sqrt()[has_valid].mean() if has_valid.any() else nan,
        "informative_group_fraction": _informative_groups(grouped, valid).float().mean(),
    }


def tpo_target_diagnostics(
    targets: torch.Tensor,
    scores: torch.Tensor,
    num_generations: int,
    valid_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The paper's diagnostics of a batch of targets, as 0-d tensors.

    * ``target_entropy``: mean entropy of ``q`` over groups with a valid member.
    * ``informative_group_fraction``: fraction of groups whose valid raw scores vary.
    * ``best_completion_target_mass``: mean, over informative groups, of the target mass on the group's
      highest-scoring completions (ties share it); NaN when no group is informative.
    """
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
    return {
        "target_entropy": entropy[has_valid].mean() if has_valid.any() else nan,
        "informative_group_fraction": informative.float().mean(),
        "best_completion_target_mass": best_mass[informative].mean() if informative.any() else nan,
    }
