"""The TPO math against values worked out by hand, and its gradient against (p - q) / G."""

import math

import pytest
import torch

from targetpo import TargetPOTrainer
from targetpo import functional as F


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


# ------------------------------------------------------------------------------------------------ tpo_scores
def test_scores_use_population_std():
    # mean 2.5, population variance (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25 (the sample variance would be 5/3).
    u = F.tpo_scores(t([1.0, 2.0, 3.0, 4.0]), num_generations=4)
    std = math.sqrt(1.25)
    assert torch.allclose(u, t([-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std]))
    assert not torch.allclose(u, t([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(5 / 3))


def test_scores_are_whitened_per_group():
    u = F.tpo_scores(t([0.0, 2.0, 10.0, 30.0]), num_generations=2)
    assert torch.allclose(u, t([-1.0, 1.0, -1.0, 1.0]))


def test_zero_variance_group_gets_zero_even_with_rounding():
    # 0.1 * 3 / 3 != 0.1 in floating point: a std-threshold would see a tiny variance and blow it up.
    u = F.tpo_scores(t([0.1, 0.1, 0.1, 1.0, 0.0, 1.0]), num_generations=3)
    assert torch.equal(u[:3], torch.zeros(3, dtype=torch.float64))
    assert torch.allclose(u[3:], t([1.0, -2.0, 1.0]) / math.sqrt(2.0))


def test_invalid_members_are_left_out_and_get_zero():
    # Valid scores 1 and 3: mean 2, population std 1. The invalid 100 must not move either.
    u = F.tpo_scores(t([1.0, 100.0, 3.0]), num_generations=3, valid_mask=torch.tensor([True, False, True]))
    assert torch.allclose(u, t([-1.0, 0.0, 1.0]))


def test_single_valid_member_and_empty_group_get_zero():
    valid = torch.tensor([True, False, False, False, False, False])
    u = F.tpo_scores(t([5.0, 1.0, 2.0, 3.0, 4.0, 5.0]), num_generations=3, valid_mask=valid)
    assert torch.equal(u, torch.zeros(6, dtype=torch.float64))


def test_integer_scores_are_promoted():
    u = F.tpo_scores(torch.tensor([0, 1]), num_generations=2)
    assert u.dtype == torch.float32
    assert torch.allclose(u, torch.tensor([-1.0, 1.0]))


def test_non_finite_score_on_valid_member_is_refused():
    with pytest.raises(ValueError, match="non-finite"):
        F.tpo_scores(t([1.0, float("nan")]), num_generations=2)
    # ... but is fine on an invalid member, which is never read.
    u = F.tpo_scores(t([1.0, float("nan"), 2.0, 0.0]), 2, valid_mask=torch.tensor([True, False, True, True]))
    assert torch.allclose(u, t([0.0, 0.0, 1.0, -1.0]))


def test_batch_that_is_not_whole_groups_is_refused():
    with pytest.raises(ValueError, match="whole number of groups"):
        F.tpo_scores(t([1.0, 2.0, 3.0]), num_generations=2)


# ------------------------------------------------------------------------------------------------ tpo_targets
def test_targets_closed_form():
    # q ∝ p_old * exp(u / eta) with p_old = (0.5, 0.3, 0.2), u = (1, 0, -1).
    old = torch.log(t([0.5, 0.3, 0.2]))
    u = t([1.0, 0.0, -1.0])
    unnormalised = [0.5 * math.e, 0.3, 0.2 / math.e]
    expected = t([value / sum(unnormalised) for value in unnormalised])
    assert torch.allclose(F.tpo_targets(old, u, 3), expected)
    assert torch.allclose(expected, t([0.784405, 0.173141, 0.042463]), atol=1e-6)

    unnormalised = [0.5 * math.e**2, 0.3, 0.2 / math.e**2]  # eta = 0.5 doubles the tilt
    expected = t([value / sum(unnormalised) for value in unnormalised])
    assert torch.allclose(F.tpo_targets(old, u, 3, temperature=0.5), expected)


def test_targets_ignore_the_scale_of_old_logps():
    # Only p_old's ratios inside the group matter: the group's normaliser cancels.
    old = t([-1.0, -2.0, -0.5, -3.0])
    u = t([0.3, -0.3, 1.0, -1.0])
    assert torch.allclose(F.tpo_targets(old, u, 2), F.tpo_targets(old + t([7.0, 7.0, -4.0, -4.0]), u, 2))


def test_zero_scores_give_the_old_policy():
    old = torch.log(t([0.6, 0.4]))
    assert torch.allclose(F.tpo_targets(old, t([0.0, 0.0]), 2), t([0.6, 0.4]))


def test_targets_with_invalid_members_and_empty_group():
    old = torch.log(t([0.5, 0.25, 0.25, 0.2, 0.3, 0.5]))
    valid = torch.tensor([True, False, True, False, False, False])
    q = F.tpo_targets(old, torch.zeros(6, dtype=torch.float64), 3, valid_mask=valid)
    # Renormalised over the two valid members: 0.5 / 0.75 and 0.25 / 0.75; the empty group is all zeros.
    assert torch.allclose(q, t([2 / 3, 0.0, 1 / 3, 0.0, 0.0, 0.0]))
    assert torch.isfinite(q).all()


def test_targets_are_detached_and_refuse_bad_temperature():
    old = torch.zeros(2, requires_grad=True)
    assert not F.tpo_targets(old, torch.tensor([1.0, -1.0]), 2).requires_grad
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="must be > 0"):
            F.tpo_targets(old, torch.tensor([1.0, -1.0]), 2, temperature=bad)


def test_trainer_static_aliases_are_the_functionals():
    assert TargetPOTrainer.get_tpo_scores is F.tpo_scores
    assert TargetPOTrainer.get_tpo_targets is F.tpo_targets
    assert torch.allclose(TargetPOTrainer.get_tpo_scores(t([0.0, 1.0]), 2), t([-1.0, 1.0]))


# ------------------------------------------------------------------------------------------------ sequence_logps
def test_sequence_logps_mean_and_sum():
    logps = t([[-1.0, -2.0, -3.0], [-0.5, float("-inf"), float("nan")], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert torch.allclose(F.sequence_logps(logps, mask, length_normalize=True), t([-1.5, -0.5, 0.0]))
    assert torch.allclose(F.sequence_logps(logps, mask, length_normalize=False), t([-3.0, -0.5, 0.0]))


# ------------------------------------------------------------------------------------------------ tpo_loss
def test_loss_closed_form():
    # Group 1: p = (0.2, 0.3, 0.5), q = (0.5, 0.25, 0.25). Group 2: p = q = (1/3, 1/3, 1/3).
    logps = torch.log(t([0.2, 0.3, 0.5, 1.0, 1.0, 1.0]))
    q = t([0.5, 0.25, 0.25, 1 / 3, 1 / 3, 1 / 3])
    group1 = -(0.5 * math.log(0.2) + 0.25 * math.log(0.3) + 0.25 * math.log(0.5))
    group2 = math.log(3.0)
    assert abs(group1 - 1.278999) < 1e-6
    loss = F.tpo_loss(logps, q, 3)
    assert loss.item() == pytest.approx((group1 + group2) / 2, abs=1e-12)


def _check_gradient(logps, q, k, valid=None):
    logps = logps.clone().requires_grad_(True)
    F.tpo_loss(logps, q, k, valid).backward()
    groups = logps.numel() // k
    grouped = logps.detach().view(groups, k)
    valid_g = torch.ones_like(grouped, dtype=torch.bool) if valid is None else valid.view(groups, k)
    p = torch.softmax(grouped.masked_fill(~valid_g, float("-inf")), dim=-1).nan_to_num(0.0) * valid_g
    expected = ((p - q.view(groups, k)) / groups) * valid_g
    assert torch.allclose(logps.grad, expected.reshape(-1), atol=1e-12)
    return logps.grad


def test_gradient_is_p_minus_q_over_groups():
    torch.manual_seed(0)
    logps = torch.randn(12, dtype=torch.float64)
    q = torch.softmax(torch.randn(3, 4, dtype=torch.float64), dim=-1).reshape(-1)
    _check_gradient(logps, q, 4)


def test_gradient_with_invalid_members_and_an_empty_group():
    torch.manual_seed(1)
    logps = torch.randn(9, dtype=torch.float64)
    valid = torch.tensor([True, False, True, True, True, True, False, False, False])
    q = F.tpo_targets(torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64), 3, valid)
    grad = _check_gradient(logps, q, 3, valid)
    assert torch.equal(grad[6:], torch.zeros(3, dtype=torch.float64))


def test_gradient_vanishes_when_policy_matches_target():
    logps = torch.randn(8, dtype=torch.float64, requires_grad=True)
    q = torch.softmax(logps.detach().view(2, 4), dim=-1).reshape(-1)
    F.tpo_loss(logps, q, 4).backward()
    assert logps.grad.abs().max() < 1e-15


def test_group_without_valid_member_contributes_exactly_zero():
    logps = torch.tensor([0.1, -0.2, 5.0, -7.0], dtype=torch.float32, requires_grad=True)
    valid = torch.tensor([True, True, False, False])
    q = torch.tensor([0.7, 0.3, 0.0, 0.0])
    loss = F.tpo_loss(logps, q, 2, valid)
    p = torch.softmax(torch.tensor([0.1, -0.2]), dim=0)
    assert loss.item() == pytest.approx(-(0.7 * p[0].log() + 0.3 * p[1].log()).item() / 2, rel=1e-6)
    loss.backward()
    assert torch.isfinite(logps.grad).all()
    assert torch.equal(logps.grad[2:], torch.zeros(2))
    all_invalid = F.tpo_loss(logps.detach(), torch.zeros(4), 2, torch.zeros(4, dtype=torch.bool))
    assert all_invalid.item() == 0.0


def test_group_log_softmax_closed_form():
    # Sequence log-probs log 1, log 2, log 1 (+ any constant): p = 1/4, 1/2, 1/4; the invalid member is left out.
    logps = t([0.0, math.log(2.0), 0.0, 7.0]) - 3.0
    valid = torch.tensor([True, True, True, False])
    log_p = F.group_log_softmax(torch.cat([logps, t([1.0, 1.0, 1.0, 1.0])]), 4, torch.cat([valid, valid]))
    assert torch.allclose(log_p[:3].exp(), t([0.25, 0.5, 0.25]))
    assert torch.allclose(log_p[4:7].exp(), t([1 / 3, 1 / 3, 1 / 3]))
    empty = F.group_log_softmax(t([1.0, 2.0]), 2, torch.tensor([False, False]))
    assert torch.isfinite(empty).all()


def test_members_of_a_group_split_over_backward_passes_add_up_to_the_whole_groups_loss():
    """Two groups of 4 cut into micro-batches of 3, 3 and 2 rows: each part's gradient with respect to l_i is
    (p_i - q_i) / G from the whole groups' p, and values and gradients add up to tpo_loss on the whole groups."""
    torch.manual_seed(2)
    logps = torch.randn(8, dtype=torch.float64)
    valid = torch.tensor([True, True, False, True, True, True, True, True])
    q = F.tpo_targets(torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), 4, valid)
    whole = logps.clone().requires_grad_()
    whole_loss = F.tpo_loss(whole, q, 4, valid)
    whole_loss.backward()
    log_p = F.group_log_softmax(logps, 4, valid)  # known beforehand, at the same weights
    parts, total = logps.clone().requires_grad_(), 0.0
    for rows in (slice(0, 3), slice(3, 6), slice(6, 8)):
        # Each micro-batch is divided by the groups per micro-batch (2 / 3), and the micro-steps' losses by their
        # number, as gradient accumulation does: (p - q) / (2 / 3) / 3 = (p - q) / 2.
        part = F.tpo_loss_of_members(parts[rows], log_p[rows], q[rows], 2 / 3, valid[rows]) / 3
        part.backward()
        total += part.item()
    p = log_p.exp()
    expected = torch.where(valid, (p - q) / 2, torch.zeros_like(p))
    assert torch.allclose(parts.grad, expected, atol=1e-12)
    assert torch.allclose(parts.grad, whole.grad, atol=1e-12)
    assert total == pytest.approx(whole_loss.item(), rel=1e-12)


def test_loss_of_members_needs_one_entry_per_member():
    with pytest.raises(ValueError, match="one entry per member"):
        F.tpo_loss_of_members(t([0.0, 1.0]), t([0.0]), t([0.5, 0.5]), 1.0)


@pytest.mark.parametrize("length_normalize", [True, False])
def test_gradient_through_length_normalisation(length_normalize):
    # d loss / d logp_t = (p - q) / G, divided by the completion's token count when normalised.
    per_token = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    sequence = F.sequence_logps(per_token, mask, length_normalize)
    q = t([0.25, 0.75])
    F.tpo_loss(sequence, q, 2).backward()
    p = torch.softmax(sequence.detach(), dim=0)
    per_sequence = p - q
    counts = t([3.0, 2.0]) if length_normalize else t([1.0, 1.0])
    expected = (per_sequence / counts).unsqueeze(1) * mask
    assert torch.allclose(per_token.grad, expected)


# ------------------------------------------------------------------------------------------------ kl and grpo
def test_token_kl_closed_form():
    logps = t([[-1.0, -2.0, -9.0]])
    ref = t([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # r = (-0.5, 1): (e^-0.5 + 0.5 - 1 + e - 1 - 1) / 2
    expected = (math.exp(-0.5) - 0.5 + math.e - 2) / 2
    assert F.token_kl(logps, ref, mask).item() == pytest.approx(expected, abs=1e-12)
    assert F.token_kl(logps, logps, mask).item() == 0.0


def test_grpo_clipped_surrogate_closed_form():
    old = t([[-1.0, -1.0], [-1.0, -1.0]])
    logps = old + torch.log(t([[1.5, 0.5], [1.5, 0.5]]))
    advantages = t([1.0, -1.0])
    mask = torch.ones(2, 2)
    # A = +1: min(1.5, 1.2) = 1.2 and min(0.5, 0.8) = 0.5 -> -(1.2 + 0.5) / 2 = -0.85
    # A = -1: min(-1.5, -1.2) = -1.5 and min(-0.5, -0.8) = -0.8 -> (1.5 + 0.8) / 2 = 1.15
    loss = F.grpo_loss(logps, old, advantages, mask, epsilon_low=0.2)
    assert loss.item() == pytest.approx((-0.85 + 1.15) / 2, abs=1e-12)


# ------------------------------------------------------------------------------------------------ quantile
@pytest.mark.parametrize("size", [1, 2, 3, 7, 100, 4097])
@pytest.mark.parametrize("q", [0.0, 0.1, 0.25, 1 / 3, 0.5, 0.8, 0.999, 1.0])
def test_quantile_is_torch_quantile(size, q):
    values = torch.randn(size, generator=torch.Generator().manual_seed(size), dtype=torch.float64)
    values[: size // 3] = values[size // 3 : 2 * (size // 3)]  # ties too
    assert torch.equal(F.quantile(values, q), torch.quantile(values, q))
    # On float32 it interpolates the same two order statistics, with a rank free of float32 rounding.
    single = values.float()
    expected = torch.quantile(single.double(), q).float()
    assert torch.allclose(F.quantile(single, q), expected, rtol=1e-6, atol=1e-6)


def test_quantile_and_entropy_mask_beyond_torch_quantiles_limit():
    import numpy as np

    size, q = 2**24 + 7, 0.3
    # Shuffled integers shifted so that the quantile, q * (size - 1) - shift, is a fraction near 0: every value is
    # exact in float32 and a rank off by one would be off by 1.0.
    shift = round(q * (size - 1))
    values = (torch.randperm(size, generator=torch.Generator().manual_seed(0)) - shift).float()
    exact = q * (size - 1) - shift  # torch.quantile raises "input tensor is too large" here
    cut = F.quantile(values, q).item()
    # numpy in float64 (on float32 data it takes the rank in float32 too: 5033166.6 becomes 5033167).
    assert cut == pytest.approx(exact, abs=1e-6)
    assert cut == pytest.approx(np.quantile(values.numpy().astype(np.float64), q), abs=1e-6)
    assert F.quantile(values, 0.0).item() == -shift and F.quantile(values, 1.0).item() == size - 1 - shift
    # The mask ranks a batch's entropies against such a pool: kept are those at or above the cut.
    entropies = t([[-1.0, exact - 1e-3, exact + 1e-3, 5.0]], dtype=torch.float32)
    kept = F.high_entropy_mask(entropies, torch.ones(1, 4), 1 - q, pool=values)
    assert kept.tolist() == [[False, False, True, True]]


# ------------------------------------------------------------------------------------------------ importance sampling
def test_truncated_importance_weights_closed_form():
    trainer = t([[-1.0, -2.0, -0.1], [-3.0, -1.0, float("-inf")]])
    sampler = t([[-1.5, -1.0, -5.0], [-3.0, -1.2, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights = F.truncated_importance_weights(trainer, sampler, mask, cap=2.0)
    # exp(0.5), exp(-1), exp(4.9) capped at 2; exp(0), exp(0.2); a masked -inf position gets 1.
    expected = t([[math.exp(0.5), math.exp(-1.0), 2.0], [1.0, math.exp(0.2), 1.0]])
    assert torch.allclose(weights, expected, atol=1e-12)
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="cap must be >= 1"):
        F.truncated_importance_weights(trainer, sampler, mask, cap=0.5)


def test_scaled_token_gradients_keep_values_and_the_fixed_point():
    per_token = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    weights = t([[0.5, 2.0, 1.0], [1.5, 1.0, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    scaled = F.scale_token_gradients(per_token, weights)
    assert torch.equal(scaled, per_token)  # the same values: loss, p and diagnostics do not change
    sequence = F.sequence_logps(scaled, mask, length_normalize=True)
    q = t([0.25, 0.75])
    F.tpo_loss(sequence, q, 2).backward()
    # d loss / d logp_t = (p - q) / G * w_t / n for the unmasked tokens of a completion of n tokens.
    p = torch.softmax(sequence.detach(), dim=0)
    expected = ((p - q) / t([3.0, 2.0])).unsqueeze(1) * weights * mask
    assert torch.allclose(per_token.grad, expected)

    # At the target (p = q) the weighted gradient still vanishes.
    per_token.grad = None
    sequence = F.sequence_logps(F.scale_token_gradients(per_token, weights), mask, length_normalize=True)
    F.tpo_loss(sequence, torch.softmax(sequence.detach(), dim=0), 2).backward()
    assert torch.allclose(per_token.grad, torch.zeros_like(per_token.grad))


# ------------------------------------------------------------------------------------------------ diagnostics
def test_target_diagnostics_closed_form():
    q = t([0.5, 0.5, 0.0, 0.9, 0.1, 0.0, 1 / 3, 1 / 3, 1 / 3])
    scores = t([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    d = F.tpo_target_diagnostics(q, scores, 3)
    entropies = [math.log(2), -(0.9 * math.log(0.9) + 0.1 * math.log(0.1)), math.log(3)]
    assert d.target_entropy.item() == pytest.approx(sum(entropies) / 3, rel=1e-9)
    assert d.informative_group_fraction.item() == pytest.approx(2 / 3)
    # Best completions: the two tied 1.0s in group 1 (mass 1.0) and the 1.0 in group 2 (mass 0.9).
    assert d.best_completion_target_mass.item() == pytest.approx((1.0 + 0.9) / 2)
    assert torch.equal(F.informative_groups(scores, 3), torch.tensor([True, True, False]))


def test_rollout_diagnostics_closed_form():
    # Group 1: valid scores 1, 3, 5 (the 100 is invalid); group 2: all equal; group 3: valid 4 and 0; group 4: none
    # valid, so it has no spread to average.
    scores = t([1.0, 3.0, 100.0, 5.0, 2.0, 2.0, 2.0, 2.0, 7.0, 4.0, 0.0, 9.0, 6.0, 6.0, 1.0, 1.0])
    valid = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    d = F.rollout_diagnostics(scores, 4, valid)
    assert d.reward.item() == pytest.approx(sum(scores.tolist()) / 16)  # every sampled completion
    # Population std over the valid members, as the whitening uses: sqrt(8/3), 0 and 2.
    assert d.reward_std.item() == pytest.approx((math.sqrt(8 / 3) + 0.0 + 2.0) / 3, rel=1e-12)
    assert d.informative_group_fraction.item() == pytest.approx(2 / 4)
    assert math.isnan(F.rollout_diagnostics(scores, 4, torch.zeros(16, dtype=torch.bool)).reward_std.item())


def test_huge_scores_do_not_overflow():
    u = F.tpo_scores(torch.tensor([1e30, -1e30, 3e30, -3e30]), num_generations=4)
    expected = torch.tensor([1.0, -1.0, 3.0, -3.0]) / math.sqrt(5.0)
    assert torch.allclose(u, expected)


def test_target_temperature_too_small_for_the_scores():
    with pytest.raises(ValueError, match="too small"):
        F.tpo_targets(torch.zeros(2), torch.tensor([1.0, -1.0]), 2, temperature=1e-39)


# Four groups of three: informative; all scores equal; a single valid member; informative with an invalid member.
SIGNAL_U = torch.tensor([1.2, -1.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.7, -0.7, 0.0])
SIGNAL_VALID = torch.tensor([True, True, True, True, True, True, True, False, False, True, True, False])


def test_rows_with_gradient_closed_form():
    rows = lambda **kw: F.rows_with_gradient(SIGNAL_U, 3, SIGNAL_VALID, **kw).tolist()  # noqa: E731
    T, f = True, False
    assert rows(loss_type="tpo", policy_is_old=False) == [T, T, T, T, T, T, f, f, f, T, T, f]
    assert rows(loss_type="tpo", policy_is_old=True) == [T, T, T, f, f, f, f, f, f, T, T, f]
    # GRPO: only the advantage matters, at any ratio; the u = 0 member of an informative group has none either.
    assert rows(loss_type="grpo") == [T, T, f, f, f, f, f, f, f, T, T, f]
    with pytest.raises(ValueError, match="loss_type"):
        F.rows_with_gradient(SIGNAL_U, 3, SIGNAL_VALID, loss_type="ppo")


def test_tpo_rows_left_out_change_the_loss_by_a_constant_only():
    torch.manual_seed(0)
    old = torch.randn(12, dtype=torch.float64)
    targets = F.tpo_targets(old, SIGNAL_U, 3, SIGNAL_VALID)
    for policy_is_old, logps in ((True, old.clone()), (False, old + torch.randn(12, dtype=torch.float64))):
        rows = F.rows_with_gradient(SIGNAL_U, 3, SIGNAL_VALID, "tpo", policy_is_old)
        full_logps = logps.clone().requires_grad_(True)
        full = F.tpo_loss(full_logps, targets, 3, SIGNAL_VALID)
        full.backward()
        kept_logps = logps.clone().requires_grad_(True)
        kept = F.tpo_loss(kept_logps, targets, 3, SIGNAL_VALID & rows)
        kept.backward()
        assert torch.allclose(kept_logps.grad, full_logps.grad, atol=1e-12)
        assert kept_logps.grad[~rows].abs().max() == 0
        # What is left out is the groups' cross-entropy at p = q: the entropy of q, over the 4 groups.
        q = targets.view(4, 3)
        left_out = ~rows.view(4, 3).any(dim=1)
        entropy = -(torch.special.xlogy(q, q)).sum(dim=1)
        assert full.item() - kept.item() == pytest.approx(entropy[left_out].sum().item() / 4, abs=1e-12)
    # Once the policy has moved, the equal-score group pulls p back towards p_old: it may not be left out.
    moved = old + torch.randn(12, dtype=torch.float64)
    moved.requires_grad_(True)
    F.tpo_loss(moved, targets, 3, SIGNAL_VALID).backward()
    assert moved.grad[3:6].abs().max() > 1e-3


def test_grpo_rows_left_out_change_nothing():
    torch.manual_seed(0)
    mask = torch.ones(12, 4)
    mask[SIGNAL_VALID.logical_not()] = 0
    old = torch.randn(12, 4, dtype=torch.float64)
    rows = F.rows_with_gradient(SIGNAL_U, 3, SIGNAL_VALID, "grpo")
    policy = old + 0.5 * torch.randn(12, 4, dtype=torch.float64)  # some ratios beyond the clip range
    losses, grads = [], []
    for kept_mask in (mask, mask * rows.unsqueeze(-1)):
        logps = policy.clone().requires_grad_(True)
        loss = F.grpo_loss(logps, old, SIGNAL_U, kept_mask)
        loss.backward()
        losses.append(loss.item())
        grads.append(logps.grad)
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)
    assert torch.allclose(grads[0], grads[1], atol=1e-12) and grads[0][rows].abs().max() > 0
