"""Completion log-probs with each prompt run through the model once for the rows that share it.

A group's K completions follow one prompt. The padded pass reads that prompt K times; here consecutive rows with the
same prompt form a run, the run's prompt goes through the model once (its keys and values kept, with their gradient),
and the completions go through a second forward pass that attends to their prompt's keys and values as ``generate``
attends to a prefilled cache. The first completion token is predicted by the prompt's last position, shared by the
run; the others by the completion's own positions. The log-probs are the padded pass's, and so are the gradients:
the prompt's activations receive the sum of what its rows send back.

It pays where prompts are long next to completions (a system prompt, tool schemas, a few-shot prefix). Whether a
model computes this exactly is checked once on the model itself (:func:`model_sharing_problem`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from .loading import is_peft_model

#: Rotary embeddings whose frequencies depend on the longest position of the forward pass (transformers'
#: ``dynamic_rope_update``): the prompts' keys would be rotated for the prompts' length, not the whole sequence's.
LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}
#: A prompt and its completion, alone and split into prompt pass and completion pass, must give the same logits to
#: this relative tolerance (rounding only).
_PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_PROBE_TOLERANCE_16_BIT = 5e-2


class SharingProblem(ValueError):
    """Why a model's forward pass cannot continue exactly from the keys and values it returned."""


class PromptRuns(NamedTuple):
    """Consecutive rows with the same prompt, and each row's run."""

    firsts: torch.Tensor  # (G,) the first row of each run
    run_of_row: torch.Tensor  # (B,) each row's run, 0 .. G - 1


def prompt_runs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> PromptRuns:
    """The runs of consecutive rows whose prompts (tokens and padding) are the same."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(dim=1) & (prompt_mask[1:] == prompt_mask[:-1]).all(dim=1)
    starts = torch.cat([same.new_ones(1), ~same])
    return PromptRuns(starts.nonzero().squeeze(1), starts.long().cumsum(0) - 1)


def shared_prompt_hidden_states(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_attention_mask: torch.Tensor,
    runs: PromptRuns,
) -> torch.Tensor:
    """The final hidden states that predict each completion token, ``(B, C, H)``, each run's prompt read once.

    Prompts are left-padded, each ending in a read token (it predicts the first completion token); completions are
    right-padded. ``model`` may be wrapped (DDP): the prompt pass goes through the module it wraps, so the wrapper sees
    one forward pass per backward pass, and its gradients reach the same weights.
    """
    inner = getattr(model, "module", model)
    first_column = int(prompt_mask.any(dim=0).float().argmax()) if prompt_mask.any() else prompt_mask.size(1)
    prompt_ids, prompt_mask = prompt_ids[:, first_column:], prompt_mask[:, first_column:]
    run_ids, run_mask = prompt_ids[runs.firsts], prompt_mask[runs.firsts]
    prompt_positions = (run_mask.cumsum(-1) - 1).clamp(min=0)
    prompt_pass = inner(
        input_ids=run_ids,
        attention_mask=run_mask,
        position_ids=prompt_positions,
        use_cache=True,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    cache = prompt_pass.past_key_values
    if cache is None:
        raise SharingProblem("its forward pass returns no keys and values (use_cache=True)")
    if any(type(layer) is not DynamicLayer for layer in getattr(cache, "layers", [None])):
        # A sliding window keeps only some positions' keys and values, a recurrent or linear-attention layer a state:
        # what the completions then read depends on lengths that a short probe cannot check.
        raise SharingProblem(
            "its cache keeps other than every position's keys and values (sliding-window, recurrent or "
            "linear-attention layers)"
        )
    cache.batch_select_indices(runs.run_of_row)  # each row reads its run's keys and values (gradients add up)
    last_prompt_hidden = prompt_pass.hidden_states[-1][:, -1][runs.run_of_row]
    read_prompt_tokens = prompt_mask.sum(dim=1, keepdim=True)
    positions = read_prompt_tokens + torch.arange(completion_ids.size(1), device=completion_ids.device)
    completion_pass = model(
        input_ids=completion_ids,
        attention_mask=torch.cat([prompt_mask, completion_attention_mask], dim=1),
        position_ids=positions,
        past_key_values=cache,
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    completion_hidden = completion_pass.hidden_states[-1][:, :-1]
    return torch.cat([last_prompt_hidden.unsqueeze(1), completion_hidden], dim=1)


def model_sharing_problem(model: nn.Module) -> str | None:
    """Why ``model`` cannot read a prompt once for its completions and give the padded pass's logits, or None.

    Its configuration is read first (gradient checkpointing, rotary embeddings that rescale with the length); then
    small forward passes without gradient check it on the model itself: two prompts (one left-padded) and three
    completions, read whole and split into a prompt pass and a completion pass.
    """
    model = getattr(model, "module", model)  # DDP
    base = model.get_base_model() if is_peft_model(model) else model
    if not hasattr(getattr(base, "config", None), "get_text_config"):
        return "it is not a transformers model, whose forward pass continues from the keys and values it returned"
    if getattr(base, "is_gradient_checkpointing", False):
        return "gradient checkpointing is on, under which transformers keeps no keys and values"
    rope_types = {getattr(module, "rope_type", None) for module in base.modules()} & LENGTH_DEPENDENT_ROPE
    if rope_types:
        return (
            f"its rotary embedding ({', '.join(sorted(rope_types))}) rescales with the longest position of a forward "
            "pass, which the prompts' pass does not reach"
        )
    embeddings = base.get_input_embeddings()
    device = embeddings.weight.device
    vocab_size = getattr(embeddings, "num_embeddings", None) or base.config.get_text_config(decoder=True).vocab_size
    # Two rows share a prompt of 7 tokens; a third reads 5, left-padded, as a batch's shorter prompts are.
    prompt = torch.arange(1, 8, device=device).expand(3, -1) % vocab_size
    prompt_mask = torch.tensor([[1] * 7, [1] * 7, [0, 0, 1, 1, 1, 1, 1]], device=device)
    prompt = prompt * prompt_mask
    completion = torch.tensor([[3, 5, 7], [4, 6, 0], [2, 3, 4]], device=device) % vocab_size
    completion_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], device=device)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # without dropout, the two ways compute the same thing
    try:
        with torch.no_grad():
            ids, mask = torch.cat([prompt, completion], dim=1), torch.cat([prompt_mask, completion_mask], dim=1)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # counting read tokens, as the padded pass does
            whole = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, output_hidden_states=True
            )
            expected = whole.hidden_states[-1][:, prompt.size(1) - 1 : -1]
            runs = prompt_runs(prompt, prompt_mask)
            shared = shared_prompt_hidden_states(model, prompt, prompt_mask, completion, completion_mask, runs)
    except SharingProblem as problem:
        return str(problem)
    except Exception as error:  # noqa: BLE001 - any failure means the model cannot share prompts
        return f"its forward pass fails to continue from a prompt's keys and values ({type(error).__name__}: {error})"
    finally:
        for module, training in modes:
            module.training = training
    read = completion_mask.bool()
    expected, shared = expected.float()[read], shared.float()[read]
    tolerance = _PROBE_TOLERANCE.get(embeddings.weight.dtype, _PROBE_TOLERANCE_16_BIT)
    if shared.shape == expected.shape and (shared - expected).abs().max() <= tolerance * expected.abs().max().clamp(
        min=1.0
    ):
        return None
    return "its forward pass gives other hidden states when it continues from a prompt's keys and values"
