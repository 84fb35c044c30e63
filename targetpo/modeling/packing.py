"""Packed (padding-free) rows: a batch's prompts and completions as one row of their read tokens, each sequence's
position ids restarting at 0, and whether a model's forward pass keeps sequences packed that way apart.

Transformers reads packed sequences from the position ids when no attention mask is given: flash attention runs its
variable-length kernels on them, and sdpa, eager and flex attention get a block-diagonal causal mask
(``masking_utils.find_packed_sequence_indices``). Not every model passes its position ids to that mask, so whether a
model packs exactly is checked once on the model itself (:func:`model_packing_problem`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from .loading import forward_accepts_position_ids, is_peft_model

#: Attention implementations that transformers keeps packed sequences apart in; a flash-attention kernel from the
#: Hub ("kernels-community/flash-attn...") is any other name containing "flash".
PACKING_ATTENTIONS = ("eager", "sdpa", "flex_attention")
#: Attention implementations that see a packed row whole, through a block-diagonal mask, where flash and flex
#: attention skip the blocks between sequences: on a GPU their packed pass does more work than the padded one.
MASKED_PACKING_ATTENTIONS = ("eager", "sdpa")
#: Layer types whose attention depends only on the positions within a sequence; others (chunked attention, whose
#: chunks start at fixed offsets of the row, and recurrent or convolutional layers, whose state runs on from one
#: sequence into the next) would mix the sequences of a packed row.
PACKING_LAYER_TYPES = ("full_attention", "sliding_attention")
#: The probe's two sequences: the second, alone and after the first, must give the same logits to this relative
#: tolerance (rounding only; a forward pass that lets the second attend to the first misses by far more).
_PROBE_LENGTHS = (12, 3)
_PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
_PROBE_TOLERANCE_16_BIT = 5e-2


class PackedRows(NamedTuple):
    """Rows' read tokens as one row, and where the outputs that predict their completion tokens are."""

    input_ids: torch.Tensor  # (1, N): each row's prompt, then its completion, without padding
    position_ids: torch.Tensor  # (1, N): each row's from 0
    predicting: torch.Tensor  # (M,) the positions of the packed row whose outputs predict the completion tokens read
    completion_mask: torch.Tensor  # (B, C) bool: the completion tokens read, row by row in the order of `predicting`


def pack_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_attention_mask: torch.Tensor,
) -> PackedRows:
    """Left-padded prompts and right-padded completions (:func:`rows_packing_problem` is None) as one packed row."""
    mask = torch.cat([prompt_mask, completion_attention_mask], dim=1).bool()
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    positions = mask.long().cumsum(dim=1) - 1  # counting read tokens, exactly as the padded pass and generate number
    # Each read completion token is predicted by the read token before it, the one just before it in the packed row.
    slots = torch.full_like(positions, -1)
    slots[mask] = torch.arange(int(mask.sum()), device=mask.device)
    completion_mask = completion_attention_mask.bool()
    predicting = slots[:, prompt_ids.size(1) :][completion_mask] - 1
    return PackedRows(ids[mask].unsqueeze(0), positions[mask].unsqueeze(0), predicting, completion_mask)


def rows_packing_problem(prompt_mask: torch.Tensor, completion_attention_mask: torch.Tensor) -> str | None:
    """Why rows cannot be packed exactly, or None: each must read one run of tokens, its prompt (left-padded, at least
    one token: it predicts the first completion token) then its completion (right-padded)."""
    starts_read = prompt_mask.size(1) > 0 and bool(prompt_mask[:, -1].all())
    prompt_runs = starts_read and bool((prompt_mask.diff(dim=1) >= 0).all())
    completion_runs = bool((completion_attention_mask.diff(dim=1) <= 0).all())
    if prompt_runs and completion_runs:
        return None
    return (
        "a row does not read one run of tokens (a left-padded prompt of at least one token, then a right-padded "
        "completion)"
    )


def _unwrapped(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``model`` without its DDP wrapper, and its base model without PEFT's."""
    model = getattr(model, "module", model)  # DDP
    return model, model.get_base_model() if is_peft_model(model) else model


def _text_config(base: nn.Module) -> Any | None:
    """The text (decoder) configuration of a transformers model, or None for another model."""
    config = getattr(base, "config", None)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None


def _attention_implementation(text_config) -> str:
    """The attention implementation transformers runs for ``text_config`` (eager where none is set)."""
    return getattr(text_config, "_attn_implementation", None) or "eager"


def model_packing_problem(model: nn.Module) -> str | None:
    """Why ``model``'s forward pass cannot take packed rows and give what it gives them padded, or None.

    Its configuration is read first; then one small forward pass without gradient (every process of a sharded model
    runs it together, as it runs the passes that follow) checks that a sequence gives the same logits after another
    in a packed row as alone.
    """
    model, base = _unwrapped(model)
    if not forward_accepts_position_ids(base):
        return "its forward pass takes no position ids, which tell the sequences of a packed row apart"
    config = _text_config(base)
    if config is None:
        return "it is not a transformers model, whose forward pass reads packed sequences from the position ids"
    attention = _attention_implementation(config)
    if attention not in PACKING_ATTENTIONS and "flash" not in attention:
        return (
            f"its attention implementation {attention!r} is not one transformers packs sequences for (eager, sdpa, "
            "flex_attention, flash attention)"
        )
    other_layers = sorted(set(getattr(config, "layer_types", None) or ()) - set(PACKING_LAYER_TYPES))
    if getattr(config, "attention_chunk_size", None) is not None:
        other_layers = sorted({*other_layers, "chunked_attention"})
    if other_layers:
        return f"it has {', '.join(other_layers)} layers, which would run from one packed sequence into the next"
    return _probe_problem(model, base)


def _probe_problem(model: nn.Module, base: nn.Module) -> str | None:
    """Why a short sequence does not give the same logits after another in a packed row as alone, or None."""
    first, second = _PROBE_LENGTHS
    embeddings = base.get_input_embeddings()
    device = embeddings.weight.device
    vocab_size = getattr(embeddings, "num_embeddings", None) or base.config.get_text_config(decoder=True).vocab_size
    ids = torch.arange(1, first + second + 1, device=device) % vocab_size
    positions = torch.cat([torch.arange(first, device=device), torch.arange(second, device=device)])
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # without dropout, the two passes compute the same thing
    try:
        with torch.no_grad():
            alone = model(input_ids=ids[first:].unsqueeze(0), use_cache=False).logits.float()
            packed = model(
                input_ids=ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                logits_to_keep=torch.arange(first, first + second, device=device),
                use_cache=False,
            ).logits.float()
    except Exception as error:  # noqa: BLE001 - any failure means the model cannot be packed
        return f"its forward pass fails on a packed row ({type(error).__name__}: {error})"
    finally:
        for module, training in modes:
            module.training = training
    tolerance = _PROBE_TOLERANCE.get(embeddings.weight.dtype, _PROBE_TOLERANCE_16_BIT)
    if packed.shape == alone.shape and (packed - alone).abs().max() <= tolerance * alone.abs().max().clamp(min=1.0):
        return None
    return (
        "its forward pass lets a packed sequence attend to the one before it (it masks attention without the "
        "position ids)"
    )


def gpu_packing_cost(model: nn.Module, device: torch.device) -> str | None:
    """Why packing would slow ``model``'s pass on ``device`` instead of speeding it up, or None.

    Under sdpa or eager attention a packed row of n tokens is attended as one n x n block-diagonal mask, so its
    attention costs grow with the square of the whole row; on one H200 the packed pass of 16 sequences took 2.0x the
    padded pass's time under sdpa, and 0.57x under flex attention (docs/benchmarks.md). On the CPU, where the
    alternatives were not measured, packing under sdpa pays where most of a padded batch is padding and costs a third
    more where lengths spread evenly, so no note is given there."""
    if device.type != "cuda":
        return None
    config = _text_config(_unwrapped(model)[1])
    if config is None:
        return None
    attention = _attention_implementation(config)
    if attention not in MASKED_PACKING_ATTENTIONS:
        return None
    return (
        f"padding_free=True with attn_implementation={attention!r} on a GPU: {attention} attention reads each packed "
        "row through one block-diagonal mask over all of its tokens, so the packed pass can take longer than the "
        "padded one (2.0x on one H200 in docs/benchmarks.md). Load the model with "
        "attn_implementation='flex_attention' (0.57x the padded pass there) or a flash-attention kernel, which skip "
        "the other sequences."
    )
