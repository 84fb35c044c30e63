"""A padded batch and the log-prob/gradient routine that every log-prob path is compared with the full-logits path on.

Shared by tests/test_modeling_and_generation.py and tests/scripts/liger_logps.py (which runs in its own process).
"""

import torch

from targetpo.modeling.logps import completion_logps


def padded_batch(generator):
    """Four rows with left-padded prompts and right-padded completions of different lengths."""
    prompt_ids = torch.randint(3, 60, (4, 6), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :3] = 0  # left padding
    prompt_mask[2, :1] = 0
    completion_ids = torch.randint(3, 60, (4, 7), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 4:] = 0  # right padding: shorter completions
    completion_mask[2, 2:] = 0
    completion_mask[3, 6:] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def logps_entropies_and_gradients(model, batch, weights, **options):
    """Log-probs and entropies of ``batch``, and the flat parameter gradient of their weighted sum over the mask."""
    mask = batch[3].bool()
    model.zero_grad()
    logps, entropies = completion_logps(model, *batch, **options)
    (torch.where(mask, logps, torch.zeros_like(logps)) * weights).sum().backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return logps.detach(), entropies, grads
