"""Hand-built references for the trainer's computations, written from the method's definition.

Nothing here calls ``targetpo``: token log-probs come from the model's full logits, and the whitening, the target,
the losses and the metrics are written out directly, so a test comparing the trainer with them compares two
independent computations.
"""

import math

import torch


def token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=1.0, suppressed=()):
    """``(B, C)`` log-probs of the completion tokens under ``model``, at ``temperature`` and with ``suppressed``
    token ids given no probability (as sampling saw them), 0 outside ``completion_mask``; and ``(B, C)`` entropies
    of those distributions (with their gradient)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([prompt_mask, completion_mask], dim=1)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # left padding takes no position, as in generate
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
    logits = logits[:, prompt_ids.size(1) - 1 : -1].float() / temperature
    if len(suppressed):
        logits[..., list(suppressed)] = float("-inf")
    log_probs = torch.log_softmax(logits, dim=-1)
    picked = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    # Padding after EOS may be a suppressed token (-inf): it is outside every mask, so it reads 0.
    picked = torch.where(completion_mask.bool(), picked, torch.zeros_like(picked))
    entropy = -(log_probs.exp() * log_probs.nan_to_num(neginf=0.0)).sum(-1)
    return picked, entropy


def sequence_logps(per_token, mask, length_normalize):
    """Mean (or sum) of the token log-probs over the mask."""
    # Tokens out of the mask may hold -inf (a tool-written token generation would never sample): they read 0.
    total = torch.where(mask.bool(), per_token, torch.zeros_like(per_token)).sum(-1)
    return total / mask.sum(-1).clamp(min=1) if length_normalize else total


def whitened(scores, valid, num_generations):
    """Population z-score per group over the valid members; 0 for invalid members and equal-score groups."""
    u = torch.zeros(len(scores), dtype=torch.float64)
    for start in range(0, len(scores), num_generations):
        members = [i for i in range(start, start + num_generations) if valid[i]]
        values = torch.tensor([float(scores[i]) for i in members], dtype=torch.float64)
        if len(members) and values.std(unbiased=False) > 0:
            u[members] = (values - values.mean()) / values.std(unbiased=False)
    return u


def targets(old_sequence, u, valid, num_generations, eta):
    """q = softmax(l_old + u / eta) over each group's valid members, 0 elsewhere."""
    q = torch.zeros(len(u), dtype=torch.float64)
    for start in range(0, len(u), num_generations):
        members = [i for i in range(start, start + num_generations) if valid[i]]
        if members:
            logits = old_sequence.detach().double()[members] + u[members] / eta
            q[members] = torch.softmax(logits, dim=0)
    return q


def tpo_loss(sequence, q, valid, num_generations, counted_groups=None):
    """Mean over groups of -sum_i q_i log_softmax(l)_i over the valid members; ``counted_groups`` (bools) gives 0
    to the groups left out of a step while they still count in the mean."""
    losses = []
    for group, start in enumerate(range(0, len(q), num_generations)):
        members = [i for i in range(start, start + num_generations) if valid[i]]
        if not members or (counted_groups is not None and not counted_groups[group]):
            losses.append(sequence.sum() * 0)
            continue
        log_policy = torch.log_softmax(sequence[members], dim=0)
        losses.append(-(q[members].to(log_policy.dtype) * log_policy).sum())
    return torch.stack(losses).mean()


def grpo_loss(per_token, old_per_token, u, mask, epsilon):
    """Clipped surrogate, token mean per sequence, mean over sequences; also the fraction of tokens it clipped."""
    ratio = torch.exp(per_token - old_per_token.detach())
    advantage = u.to(ratio.dtype).unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon) * advantage
    per_token_loss = -torch.minimum(unclipped, clipped)
    was_clipped = (clipped < unclipped) & mask.bool()
    per_sequence = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sequence.mean(), was_clipped.float().sum() / mask.sum()


def kl(per_token, ref_per_token, mask, ratio=None):
    """Token mean of exp(r) - r - 1, r = logp_ref - logp, over the completion tokens; each times ``ratio`` if given."""
    r = torch.where(mask.bool(), ref_per_token - per_token, torch.zeros_like(per_token))
    estimate = torch.exp(r) - r - 1
    if ratio is not None:
        estimate = estimate * ratio
    return (estimate * mask).sum() / mask.sum()


CLIPPED_SURROGATES = ("grpo", "dapo", "dr_grpo", "bnpo", "luspo")


def policy_gradient_loss(args, per_token, old_per_token, u, mask, token_count=None, kept=None):
    """The GRPO-family loss ``args.loss_type`` with ``args``' settings, written out one completion at a time.

    Token losses: clipped surrogates -min(r A, clip(r) A) (r capped at delta first, if set); cispo
    -sg(min(r, epsilon_high)) A log p; sapo -sigmoid(tau (r - 1)) 4 / tau A; vespo -phi(w) A log p with w the product
    of the token ratios and phi(w) = w^k exp(lambda (1 - w)). r is per token, or the exp of the mean log-ratio with
    importance_sampling_level="sequence". Reductions: grpo/sapo token mean per completion then mean; bnpo all tokens'
    mean; dapo/cispo/vespo the sum over ``token_count``; dr_grpo the sum over rows * max_completion_length; luspo the
    mean over completions of their token sums. ``kept`` (0/1 per token) drops tokens' losses, normalisers unchanged.
    """
    loss_type = args.loss_type
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    sums, counts = [], []
    for i in range(len(u)):
        on = mask[i].bool()
        logp, old, advantage = per_token[i][on], old_per_token[i][on].detach(), float(u[i])
        counts.append(int(on.sum()))
        if counts[-1] == 0:
            sums.append(per_token.sum() * 0)
            continue
        if args.importance_sampling_level == "sequence":
            ratio = torch.exp((logp - old).mean()).expand(counts[-1])
        else:
            ratio = torch.exp(logp - old)
        if loss_type in CLIPPED_SURROGATES:
            unclipped = ratio if args.delta is None else ratio.clamp(max=args.delta)
            token = -torch.minimum(unclipped * advantage, ratio.clamp(1 - args.epsilon, 1 + epsilon_high) * advantage)
        elif loss_type == "cispo":
            token = -ratio.detach().clamp(max=epsilon_high) * advantage * logp
        elif loss_type == "sapo":
            tau = args.sapo_temperature_pos if advantage > 0 else args.sapo_temperature_neg
            token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * advantage
        elif loss_type == "vespo":
            w = torch.exp((logp - old).sum()).item()
            k, lam = (
                (args.vespo_k_pos, args.vespo_lambda_pos) if advantage >= 0 else (args.vespo_k_neg, args.vespo_lambda_neg)
            )
            token = -(w**k) * math.exp(lam * (1 - w)) * advantage * logp
        else:
            raise ValueError(loss_type)
        if kept is not None:
            token = token * kept[i][on]
        sums.append(token.sum())
    total = torch.stack(sums).sum()
    if loss_type in ("grpo", "sapo"):
        return torch.stack([s / max(n, 1) for s, n in zip(sums, counts)]).mean()
    if loss_type == "bnpo":
        return total / max(sum(counts), 1)
    if loss_type in ("dapo", "cispo", "vespo"):
        return total / token_count
    if loss_type == "dr_grpo":
        return total / (len(u) * args.max_completion_length)
    return total / len(u)  # luspo
