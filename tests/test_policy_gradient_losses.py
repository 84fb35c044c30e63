"""The GRPO-family losses and the advantage options against values worked out by hand.

One batch serves every loss: two completions, the old log-probs all -1 and the current ones chosen so that the token
ratios are round numbers, with A = +1 for the first completion (its third token masked out) and A = -2 for the second.

    ratios   row 0: 1.5, 0.5, (2.0 masked)      row 1: 1.1, 0.7, 2.0
    clip range with epsilon 0.2 / epsilon_high 0.3: [0.8, 1.3]
"""

import math

import pytest
import torch

from targetpo import functional as F


def t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


OLD = torch.full((2, 3), -1.0, dtype=torch.float64)
RATIOS = t([[1.5, 0.5, 2.0], [1.1, 0.7, 2.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADVANTAGES = t([1.0, -2.0])
CLIP = dict(epsilon_low=0.2, epsilon_high=0.3)


def current():
    return (OLD + RATIOS.log()).requires_grad_(True)


# Clipped token losses -min(r A, clip(r) A), by hand:
#   row 0 (A = 1):  r 1.5 -> -min(1.5, 1.3) = -1.3;   r 0.5 -> -min(0.5, 0.8) = -0.5
#   row 1 (A = -2): r 1.1 -> 2.2;   r 0.7 -> -min(-1.4, -1.6) = 1.6;   r 2.0 -> -min(-4.0, -2.6) = 4.0
# Row sums -1.8 and 7.8 over 2 and 3 tokens; 5 tokens in all.
@pytest.mark.parametrize(
    "loss_type, settings, expected",
    [
        ("grpo", {}, (-1.8 / 2 + 7.8 / 3) / 2),
        ("bnpo", {}, (-1.8 + 7.8) / 5),
        ("dapo", {}, (-1.8 + 7.8) / 5),  # the batch's own token count unless a trainer passes one
        ("dapo", {"token_count": 10}, (-1.8 + 7.8) / 10),
        ("dr_grpo", {"max_completion_length": 4}, (-1.8 + 7.8) / (2 * 4)),
        ("luspo", {}, (-1.8 + 7.8) / 2),  # each sequence's mean times its length, averaged
        # delta = 1.4 caps the unclipped 2.0 of row 1: -min(-2 * 1.4, -2.6) = 2.8 instead of 4.0.
        ("grpo", {"delta": 1.4}, (-1.8 / 2 + (2.2 + 1.6 + 2.8) / 3) / 2),
    ],
)
def test_clipped_surrogates_closed_form(loss_type, settings, expected):
    loss = F.policy_gradient_loss(current(), OLD, ADVANTAGES, MASK, loss_type, **CLIP, **settings)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_sequence_level_ratios_are_gspo():
    # One ratio per sequence, the exp of the mean token log-ratio: sqrt(0.75) = 0.866 (in the clip range) and
    # 1.54^(1/3) = 1.1548 (in range): -0.866 * 1 and -(-2 * 1.1548), each counted once per sequence.
    r0, r1 = math.sqrt(1.5 * 0.5), (1.1 * 0.7 * 2.0) ** (1 / 3)
    loss = F.policy_gradient_loss(current(), OLD, ADVANTAGES, MASK, "grpo", importance_sampling_level="sequence", **CLIP)
    assert loss.item() == pytest.approx((-r0 + 2 * r1) / 2, abs=1e-12)
    # Summed over tokens (bnpo) a sequence weighs by its length: (-2 r0 + 3 * 2 r1) / 5.
    loss = F.policy_gradient_loss(current(), OLD, ADVANTAGES, MASK, "bnpo", importance_sampling_level="sequence", **CLIP)
    assert loss.item() == pytest.approx((-2 * r0 + 6 * r1) / 5, abs=1e-12)
    # With the range [0.9, 1.1] both sequence ratios are outside it, on the side where the unclipped term is the
    # minimum (0.866 with A > 0, 1.1548 with A < 0): nothing counts as clipped. With A flipped both are clipped, on
    # every token of their sequence.
    fractions = F.clip_fractions(current(), OLD, ADVANTAGES, MASK, "grpo", "sequence", 0.1, 0.1)
    assert fractions["low"].sum() == 0 and fractions["high"].sum() == 0
    fractions = F.clip_fractions(current(), OLD, -ADVANTAGES, MASK, "grpo", "sequence", 0.1, 0.1)
    assert fractions["low"][0].tolist() == [1, 1, 1] and fractions["high"][1].tolist() == [1, 1, 1]


def test_clipped_surrogate_gradient_vanishes_where_the_clip_bites():
    logps = current()
    F.policy_gradient_loss(logps, OLD, ADVANTAGES, MASK, "bnpo", **CLIP).backward()
    # d/dlogp of -r A is -r A where unclipped; 0 where the clipped branch is the minimum; /5 tokens.
    expected = t([[0.0, -0.5 * 1, 0.0], [2 * 1.1, 0.0, 2 * 2.0]]) / 5
    assert torch.allclose(logps.grad, expected, atol=1e-12)


def test_clip_fractions_closed_form():
    fractions = F.clip_fractions(current(), OLD, ADVANTAGES, MASK, "grpo", **CLIP)
    # Low: r < 0.8 with A < 0 (row 1's 0.7). High: r > 1.3 with A > 0 (row 0's 1.5). Row 0's 0.5 (A > 0) and row 1's
    # 2.0 (A < 0) are outside the range on the side where the unclipped term is the minimum: not clipped.
    assert fractions["low"].tolist() == [[0, 0, 0], [0, 1, 0]]
    assert fractions["high"].tolist() == [[1, 0, 0], [0, 0, 0]]
    assert fractions["region"].tolist() == [[1, 0, 0], [0, 1, 0]]
    cispo = F.clip_fractions(current(), OLD, ADVANTAGES, MASK, "cispo", epsilon_high=1.2)
    assert cispo["high"].tolist() == [[1, 0, 0], [0, 0, 0]]  # r > 1.2 with A > 0
    assert F.clip_fractions(current(), OLD, ADVANTAGES, MASK, "sapo") == {}


def test_cispo_weights_the_log_probs_by_the_capped_ratio():
    logps = current()
    loss = F.policy_gradient_loss(logps, OLD, ADVANTAGES, MASK, "cispo", epsilon_high=1.2)
    # Per token -min(r, 1.2) * A * log p, summed over the 5 tokens and divided by 5; the weight is a constant.
    weights = [[1.2, 0.5], [1.1, 0.7, 1.2]]
    values = [[-w * 1.0 * (math.log(r) - 1) for w, r in zip(weights[0], (1.5, 0.5))]]
    values.append([-w * -2.0 * (math.log(r) - 1) for w, r in zip(weights[1], (1.1, 0.7, 2.0))])
    assert loss.item() == pytest.approx(sum(map(sum, values)) / 5, abs=1e-12)
    loss.backward()
    assert torch.allclose(logps.grad, t([[-1.2, -0.5, 0.0], [2.2, 1.4, 2.4]]) / 5, atol=1e-12)


def test_sapo_soft_gate_closed_form():
    loss = F.policy_gradient_loss(
        current(), OLD, ADVANTAGES, MASK, "sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=2.0
    )
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # -sigmoid(tau (r - 1)) * 4 / tau * A, tau = 1 for A > 0 and 2 for A <= 0; token mean per sequence, then mean.
    row0 = [-sigmoid(1.0 * (r - 1)) * 4 / 1.0 * 1.0 for r in (1.5, 0.5)]
    row1 = [-sigmoid(2.0 * (r - 1)) * 4 / 2.0 * -2.0 for r in (1.1, 0.7, 2.0)]
    assert loss.item() == pytest.approx((sum(row0) / 2 + sum(row1) / 3) / 2, abs=1e-12)


def test_sapo_gate_has_slope_one_on_policy():
    # At r = 1 the gate's gradient is that of r A: -A / (tokens) per token for the grpo-style mean.
    logps = OLD.clone().requires_grad_(True)
    F.policy_gradient_loss(logps, OLD, ADVANTAGES, MASK, "sapo", sapo_temperature_pos=0.5).backward()
    expected = t([[-1.0 / 2, -1.0 / 2, 0.0], [2.0 / 3, 2.0 / 3, 2.0 / 3]]) / 2
    assert torch.allclose(logps.grad, expected, atol=1e-12)


def test_vespo_sequence_weights_closed_form():
    logps = current()
    loss = F.policy_gradient_loss(logps, OLD, ADVANTAGES, MASK, "vespo")
    # w is the product of the sequence's token ratios: 0.75 and 1.54. phi = w^k exp(lambda (1 - w)) with
    # (k, lambda) = (2, 3) for A >= 0 and (3, 2) for A < 0.
    phi0 = 0.75**2 * math.exp(3 * (1 - 0.75))
    phi1 = 1.54**3 * math.exp(2 * (1 - 1.54))
    values = [-phi0 * 1.0 * (math.log(r) - 1) for r in (1.5, 0.5)]
    values += [-phi1 * -2.0 * (math.log(r) - 1) for r in (1.1, 0.7, 2.0)]
    assert loss.item() == pytest.approx(sum(values) / 5, rel=1e-12)
    loss.backward()  # phi is a constant weight
    assert torch.allclose(logps.grad, t([[-phi0, -phi0, 0.0], [2 * phi1, 2 * phi1, 2 * phi1]]) / 5, atol=1e-12)
    weights = F.vespo_weights(torch.zeros(2, 3), ADVANTAGES, MASK)
    assert weights.flatten().tolist() == [1.0, 1.0]  # on policy every sequence weighs 1


@pytest.mark.parametrize("loss_type", F.POLICY_GRADIENT_LOSSES)
@pytest.mark.parametrize("level", F.IMPORTANCE_SAMPLING_LEVELS)
def test_rows_without_gradient_leave_every_loss_and_gradient_unchanged(loss_type, level):
    """Rows ``rows_with_gradient`` leaves out (invalid, or u = 0) change neither the loss nor any gradient, given the
    token count of the whole batch (as the trainer passes it)."""
    torch.manual_seed(0)
    u = t([1.2, -1.2, 0.0, 0.0, 0.0, 0.0, 0.7, -0.7, 0.0])
    valid = torch.tensor([True, True, True, True, True, True, True, True, False])
    mask = torch.ones(9, 4)
    mask[~valid] = 0
    mask[0, 3] = 0
    old = torch.randn(9, 4, dtype=torch.float64) - 2
    policy = old + 0.4 * torch.randn(9, 4, dtype=torch.float64)  # some ratios beyond the clip range
    rows = F.rows_with_gradient(u, 3, valid, loss_type)
    assert rows.tolist() == [True, True, False, False, False, False, True, True, False]
    results = []
    for kept_mask in (mask, mask * rows.unsqueeze(-1)):
        logps = policy.clone().requires_grad_(True)
        loss = F.policy_gradient_loss(
            logps, old, u, kept_mask, loss_type, importance_sampling_level=level, max_completion_length=4,
            token_count=mask.sum(), epsilon_high=1.5 if loss_type == "cispo" else None,
        )
        loss.backward()
        results.append((loss.item(), logps.grad))
    (full, full_grad), (kept, kept_grad) = results
    assert kept == pytest.approx(full, abs=1e-12)
    assert torch.allclose(full_grad, kept_grad, atol=1e-12) and full_grad[rows].abs().max() > 0


# ------------------------------------------------------------------------------------------------ advantages
def test_group_advantages_scalings_closed_form():
    scores = t([1.0, 3.0, 100.0, 0.0, 4.0, 4.0])
    valid = torch.tensor([True, True, False, True, True, True])
    # Group 1 (valid 1, 3): deviations -1, 1; group 2 (0, 4, 4): mean 8/3, deviations -8/3, 4/3, 4/3.
    none = F.group_advantages(scores, 3, valid, "none")
    assert torch.allclose(none, t([-1.0, 1.0, 0.0, -8 / 3, 4 / 3, 4 / 3]))
    # Batch: the population std of the valid scores 1, 3, 0, 4, 4 around their mean 2.4.
    batch_std = math.sqrt(sum((x - 2.4) ** 2 for x in (1, 3, 0, 4, 4)) / 5)
    assert torch.allclose(F.group_advantages(scores, 3, valid, "batch"), none / batch_std)
    # Group: each group's own population std, 1 and sqrt(32/9).
    group = F.group_advantages(scores, 3, valid, "group")
    assert torch.allclose(group, t([-1.0, 1.0, 0.0, -8 / 3, 4 / 3, 4 / 3]) / t([1, 1, 1] + [math.sqrt(32 / 9)] * 3))
    # Equal scores give exactly 0 in every scaling, rounding or not.
    for scale in F.SCALE_REWARDS:
        assert F.group_advantages(t([0.1, 0.1, 0.1, 0.3, 0.3, 0.3]), 3, scale=scale).abs().max() == 0
    with pytest.raises(ValueError, match="scale_rewards"):
        F.group_advantages(scores, 3, scale="global")


def test_decoupled_advantages_closed_form():
    # Two rewards over two groups of two; the second reward does not score sample 3 (NaN), sample 2 is invalid.
    per_func = t([[0.0, 5.0], [2.0, 1.0], [7.0, 3.0], [1.0, float("nan")]])
    valid = torch.tensor([True, True, False, True])
    weights = t([1.0, 0.5])
    # Per reward z-scores in the groups over the samples it scored: reward 1 -> -1, 1 | 0 (invalid), 0 (alone);
    # reward 2 -> 1, -1 | 0, 0. Weighted sums: -0.5, 0.5, 0 (invalid), 0. Then over the valid samples (-0.5, 0.5,
    # 0): mean 0, population std sqrt(1/6).
    expected = t([-0.5, 0.5, 0.0, 0.0]) / math.sqrt(1 / 6)
    assert torch.allclose(F.decoupled_advantages(per_func, weights, 2, valid), expected)
    # No spread anywhere: all zeros, never NaN.
    flat = F.decoupled_advantages(t([[1.0], [1.0], [2.0], [2.0]]), t([1.0]), 2)
    assert flat.tolist() == [0.0] * 4


# ------------------------------------------------------------------------------------------------ regularisers
def test_high_entropy_mask_keeps_the_top_quantile():
    entropies = t([[0.1, 0.9, 0.5, 7.0], [0.3, 0.7, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # the 7.0 is padding: neither ranked nor kept
    # 7 tokens: 0.0 0.1 0.2 0.3 0.5 0.7 0.9; the 0.5-quantile is 0.3, so 0.3 and above are kept.
    kept = F.high_entropy_mask(entropies, mask, 0.5)
    assert kept.tolist() == [[False, True, True, False], [True, True, False, False]]
    assert F.high_entropy_mask(entropies, mask, 1.0).equal(mask.bool())
    assert F.high_entropy_mask(entropies, mask, 0.0).sum() == 1  # only the highest
    # Ranked against a wider pool (other processes' tokens), fewer of these may qualify.
    assert F.high_entropy_mask(entropies, mask, 0.5, pool=t([0.8, 0.85, 0.9, 0.95])).sum() == 1


def test_off_policy_sequence_mask_drops_far_negative_completions_only():
    sampler = t([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    current_logps = t([[-2.0, -2.0], [-2.0, -2.0], [-1.1, -1.0]])  # mean KL 1.0, 1.0 and 0.05
    advantages = t([-1.0, 1.0, -1.0])
    keep = F.off_policy_sequence_mask(advantages, current_logps, sampler, torch.ones(3, 2), threshold=0.5)
    # Far and negative: dropped; far but positive: kept; negative but close: kept.
    assert keep.flatten().tolist() == [0.0, 1.0, 1.0]


def test_token_weights_drop_token_losses_and_keep_the_normalisers():
    weights = t([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    loss = F.policy_gradient_loss(current(), OLD, ADVANTAGES, MASK, "grpo", token_weights=weights, **CLIP)
    # Row 0 keeps -1.3 of its 2 tokens, row 1 keeps 2.2 + 1.6 of its 3.
    assert loss.item() == pytest.approx((-1.3 / 2 + 3.8 / 3) / 2, abs=1e-12)


def test_bias_corrected_kl_weights_each_token_by_its_ratio():
    logps = t([[-1.0, -2.0, -9.0]])
    reference = t([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    ratios = t([[2.0, 0.5, 100.0]])
    # (exp(-0.5) + 0.5 - 1) * 2 and (e - 1 - 1) * 0.5, over the 2 tokens.
    expected = ((math.exp(-0.5) - 0.5) * 2 + (math.e - 2) * 0.5) / 2
    assert F.token_kl(logps, reference, mask, ratios).item() == pytest.approx(expected, abs=1e-12)


def test_differentiable_entropy_survives_suppressed_tokens():
    from targetpo.modeling.logps import token_entropy

    logits = t([[0.5, -1.0, float("-inf"), 2.0]]).requires_grad_(True)
    entropy = token_entropy(logits)
    p = torch.softmax(t([0.5, -1.0, 2.0]), dim=0)
    assert entropy.item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-12)
    entropy.sum().backward()
    # dH/dz_i = -p_i (log p_i + H) for the live tokens, 0 for the suppressed one: finite everywhere.
    expected = -p * (p.log() + entropy.item())
    assert torch.allclose(logits.grad, t([expected[0], expected[1], 0.0, expected[2]]), atol=1e-12)


# ------------------------------------------------------------------------------------------------ vLLM importance weights
@pytest.mark.parametrize(
    "mode, clip_min, clip_max, expected",
    [
        # Token ratios e^0.5, e^-1, e^1.2 | e^0.2, e^-0.1 (the third is masked: 1).
        ("token_truncate", 0.5, 2.0, [[math.exp(0.5), 0.5, 2.0], [math.exp(0.2), math.exp(-0.1), 1.0]]),
        ("token_mask", 0.5, 2.0, [[math.exp(0.5), 0.0, 0.0], [math.exp(0.2), math.exp(-0.1), 1.0]]),
        ("token_mask", None, None, [[math.exp(0.5), math.exp(-1), math.exp(1.2)], [math.exp(0.2), math.exp(-0.1), 1.0]]),
        # Sequence ratios e^0.7 (2.01) and e^0.1 on every token of their completion.
        ("sequence_truncate", None, 1.5, [[1.5] * 3, [math.exp(0.1)] * 2 + [1.0]]),
        ("sequence_mask", None, 2.0, [[0.0] * 3, [math.exp(0.1)] * 2 + [1.0]]),
        ("sequence_mask", 1.2, 3.0, [[math.exp(0.7)] * 3, [0.0] * 2 + [1.0]]),
    ],
)
def test_importance_sampling_weights_closed_form(mode, clip_min, clip_max, expected):
    trainer = t([[-1.0, -2.0, -0.1], [-3.0, -1.0, float("-inf")]])
    sampler = t([[-1.5, -1.0, -1.3], [-3.2, -0.9, -1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    weights = F.importance_sampling_weights(trainer, sampler, mask, mode, clip_min, clip_max)
    assert torch.allclose(weights, t(expected), atol=1e-12)
