"""Whether a model's logits are its output head (``get_output_embeddings()``) applied to its final hidden states, so
the head may run on them a chunk of positions at a time, outside the model's forward pass (``logps_chunk_size``, the
Triton head, Liger's kernel).

Its configuration is read first (soft-capping, logit scales); then one small forward pass, once per model, compares
the model's own logits with its head applied to its final hidden states. That catches what no setting names: a
prediction head that transforms the hidden states before the output embeddings (dense, activation and LayerNorm in the
BERT family's ``*ForCausalLM`` models), or logits scaled inside a model's own forward.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .loading import is_peft_model

#: Config attributes that change logits after the output head; models with them take the full-logits path.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")
#: The probe's length in tokens: enough positions for a head's transform to show, a negligible forward pass.
_PROBE_LENGTH = 8
#: Relative tolerance between the model's logits and its head applied to its hidden states: the same computation
#: gives the same values up to rounding; a skipped transform misses by a fraction of the logits themselves.
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8}
_PROBE_TOLERANCE_16_BIT = 1e-2
#: What the probe found for each model (its base model under DDP and PEFT): str or None.
_probed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chunked_head_problem(model: nn.Module) -> str | None:
    """Why ``model``'s logits are not ``output_embeddings(final hidden states)``, or None where they are (PEFT and
    distributed wrappers are looked through).

    Its configuration is read each time; the forward pass that checks the rest runs once per model, without
    gradient. Not for sharded weights (ZeRO-3, FSDP2): their head cannot run outside the forward pass anyway.
    """
    model = getattr(model, "module", model)  # DDP
    if is_peft_model(model):
        model = model.get_base_model()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(model, "config", None)
    if not isinstance(head, nn.Module) or config is None:
        return "the model has no output head module (get_output_embeddings()) and configuration to read it by"
    configs = {id(config): config}
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text_config is not None:
        configs[id(text_config)] = text_config  # composite models keep the language model's settings here
    for each in configs.values():
        for name in LOGIT_TRANSFORMS:
            value = getattr(each, name, None)
            if value not in (None, 1, 1.0):
                return f"the model post-processes its logits after the output head (its config's {name}={value})"
    if model not in _probed:
        _probed[model] = _probe_problem(model, head)
    return _probed[model]


def _probe_problem(model: nn.Module, head: nn.Module) -> str | None:
    """Why the model's logits of a short sequence differ from its head applied to its final hidden states, or None."""
    embeddings = model.get_input_embeddings()
    weight = embeddings.weight
    vocab_size = getattr(embeddings, "num_embeddings", None) or model.config.get_text_config(decoder=True).vocab_size
    ids = (torch.arange(1, _PROBE_LENGTH + 1, device=weight.device) % vocab_size).unsqueeze(0)
    modes = [(module, module.training) for module in model.modules()]
    model.eval()  # without dropout, the head computes the same thing inside the forward pass and outside it
    try:
        with torch.no_grad():
            outputs = model(input_ids=ids, output_hidden_states=True, use_cache=False)
            logits = outputs.logits.float()
            from_head = head(outputs.hidden_states[-1]).float()
    except Exception as error:  # noqa: BLE001 - a head that cannot be checked is not run outside the forward pass
        return f"its forward pass failed on a probe of its output head ({type(error).__name__}: {error})"
    finally:
        for module, training in modes:
            module.training = training
    tolerance = _PROBE_TOLERANCE.get(weight.dtype, _PROBE_TOLERANCE_16_BIT)
    scale = logits.abs().max().clamp(min=1.0)
    if from_head.shape == logits.shape and (from_head - logits).abs().max() <= tolerance * scale:
        return None
    difference = (from_head - logits).abs().max().item() if from_head.shape == logits.shape else float("nan")
    return (
        f"its logits are not its output head ({type(head).__name__}) applied to its final hidden states (they differ "
        f"by up to {difference:.3g} on a probe): its forward pass transforms the hidden states before the head, or the "
        "logits after it (as the BERT family's prediction head does: dense, activation and LayerNorm before the head)"
    )
