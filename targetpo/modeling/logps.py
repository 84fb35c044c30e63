"""Token log-probs and entropies of completions from one forward pass, and the output head's kernels.

The log-probs are those of the distribution generation sampled from (:func:`_sampled_logits`). The head's logits
come whole from the model, or a chunk of positions at a time from its final hidden states (a plain linear head with a
hand-written backward pass in torch or in Triton kernels, ``triton_head``; any other head under activation
checkpointing), or from Liger's fused kernel. The rows go through the model padded (:func:`completion_logps`),
packed into one row (:func:`packed_completion_logps`), or with each prompt read once for the rows that share it
(:func:`shared_prompt_completion_logps`).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import warnings
from typing import Any

import torch
from packaging.version import Version
from torch import nn

from .loading import Float32OutputHead, matmul_dtype
from .output_head import chunked_head_problem
from .packing import pack_rows
from .shared_prompt import prompt_runs, shared_prompt_hidden_states


def _nonempty(token_ids: torch.Tensor | None) -> torch.Tensor | None:
    """``token_ids``, or None when there are none."""
    return token_ids if token_ids is not None and token_ids.numel() > 0 else None


def _sampled_logits(
    logits: torch.Tensor, temperature: float, suppressed_token_ids: torch.Tensor | None, in_place: bool = False
) -> torch.Tensor:
    """The logits of the distribution generation samples from: divided by ``temperature``, suppressed tokens at -inf.

    ``in_place`` overwrites ``logits``: only where no gradient flows through them.
    """
    if temperature != 1.0:
        logits = logits.div_(temperature) if in_place else logits / temperature
    suppressed_token_ids = _nonempty(suppressed_token_ids)
    if suppressed_token_ids is not None:
        fill = logits.index_fill_ if in_place else logits.index_fill
        logits = fill(-1, suppressed_token_ids, float("-inf"))
    return logits


def selective_log_softmax(logits: torch.Tensor, token_ids: torch.Tensor, chunk_rows: int = 4) -> torch.Tensor:
    """``log_softmax(logits).gather(token_ids)`` computed a few rows at a time, in float32.

    Avoids materialising a float32 copy of the whole ``(B, T, V)`` logits tensor.
    """
    out = []
    for rows, ids in zip(logits.split(chunk_rows), token_ids.split(chunk_rows)):
        rows = rows.float()
        picked = rows.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(out)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of ``softmax(logits)``, differentiable also where logits are -inf (suppressed tokens).

    Written out rather than ``torch.special.entr``, whose gradient at a zero probability is NaN.
    """
    log_probs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    probs = log_probs.exp()
    return -(probs * torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))).sum(-1)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = 4, differentiable: bool = False) -> torch.Tensor:
    """Per-position entropy of ``softmax(logits)``, a few rows at a time; without gradient unless ``differentiable``."""
    with contextlib.nullcontext() if differentiable else torch.no_grad():
        return torch.cat([token_entropy(rows) for rows in logits.split(chunk_rows)])


#: Output-head dtypes whose hidden states take the head's dtype (mixed precision returns them in float32); others
#: (quantised or float8 heads) compute in their own way from what they are given.
HEAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports_chunked_head(model: nn.Module) -> bool:
    """Whether the model's logits are exactly ``output_embeddings(last hidden state)``, so they can be computed a
    chunk of positions at a time from the hidden states (:func:`~targetpo.modeling.output_head.chunked_head_problem`:
    its configuration, then a probe of its forward pass once per model)."""
    return chunked_head_problem(model) is None


#: Earlier releases scale every token's gradient by one token's upstream gradient under ``reduction="none"``.
LIGER_MIN_VERSION = "0.8.2"


def require_liger(device: torch.device) -> None:
    """Refuse ``use_liger_kernel`` where Liger cannot run, before any work: not installed, too old, or no GPU."""
    try:
        version = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError("use_liger_kernel=True needs Liger Kernel: pip install 'targetpo[liger]'.") from None
    if Version(version) < Version(LIGER_MIN_VERSION):
        raise ImportError(
            f"liger-kernel {version} computes wrong per-token gradients; targetpo needs >= {LIGER_MIN_VERSION}: "
            f"pip install -U 'liger-kernel>={LIGER_MIN_VERSION}'."
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "use_liger_kernel=True needs a GPU: Liger's kernels are Triton GPU kernels and this run is on the CPU. "
            "Drop use_liger_kernel (the log-probs are chunked without it), or, only to test, set TRITON_INTERPRET=1 "
            "before Python starts to run the kernels (slowly) in Triton's interpreter."
        )


def require_triton(device: torch.device) -> None:
    """Refuse ``logps_head_kernel="triton"`` where its kernels cannot run, before any work: no Triton, or no GPU
    (and no interpreter)."""
    if importlib.util.find_spec("triton") is None:
        raise ImportError(
            "logps_head_kernel='triton' needs Triton, which comes with PyTorch's CUDA builds: pip install triton."
        )
    from .triton_head import device_problem  # imports Triton

    problem = device_problem(device)
    if problem is not None:
        raise ValueError(
            f"logps_head_kernel='triton' cannot run here: {problem}. Use logps_head_kernel='torch', or 'auto' (the "
            "default), which picks torch here."
        )


def triton_head_problem(model: nn.Module) -> str | None:
    """Why the Triton kernels cannot compute this model's head (:func:`_head_in_chunks`), or None when they can."""
    problem = chunked_head_problem(model)
    if problem is not None:
        return problem
    head = _output_head(model)
    if type(head) is not nn.Linear:  # e.g. a LoRA-adapted or quantised head, or cast_lm_head_to_fp32's
        return f"the output head is a {type(head).__name__}, not a plain torch.nn.Linear"
    if head.weight.dtype not in HEAD_DTYPES:
        return f"the output head's weights are {head.weight.dtype}, which the kernels would round to float32"
    if not _is_plain_linear_head(head):
        return "the output head has hooks or a replaced forward (offloading, sharding) or a weight held elsewhere"
    return None


def liger_head_problem(model: nn.Module) -> str | None:
    """Why Liger's fused kernel cannot stand in for this model's output head, or None when it can."""
    problem = chunked_head_problem(model)
    if problem is not None:
        return problem
    head = _output_head(model)
    if type(head) not in (nn.Linear, Float32OutputHead):  # e.g. a LoRA-adapted or quantised head, which it would bypass
        return f"the output head is a {type(head).__name__}, not a plain torch.nn.Linear"
    return None


def _output_head(model: nn.Module) -> nn.Module:
    model = getattr(model, "module", model)
    return model.get_output_embeddings()  # a PEFT model forwards this to its (adapted) base model


def _head_logps_and_entropy(
    head: nn.Module,
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float,
    suppressed_token_ids: torch.Tensor | None,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs and entropies of a chunk of positions: ``(N, H)`` hidden states -> two ``(N,)``."""
    logits = _sampled_logits(head(hidden).float(), temperature, suppressed_token_ids)
    logps = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if not with_entropy:
        return logps, torch.zeros_like(logps)
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():  # a metric, unless an entropy bonus trains
        entropy = token_entropy(logits)
    return logps, entropy


def _head_change(head: nn.Module, hidden_rows: torch.Tensor) -> str:
    """What keeps a head that was plain at set-up from the Triton kernels now."""
    if not _is_plain_linear_head(head):
        return "it has hooks or a replaced forward, or is no plain torch.nn.Linear"
    if head.weight.device != hidden_rows.device:
        return f"its weight is on {head.weight.device}, the hidden states on {hidden_rows.device}"
    return f"its weights are {head.weight.dtype}, which the kernels would round to float32"


def _is_plain_linear_head(head: nn.Module) -> bool:
    """Whether ``head`` is an ``nn.Linear`` whose weight is all here, with nothing hooked into its forward pass.

    Only such a head may be computed from its weight directly (:class:`_LinearHeadLogps`). Adapters (PEFT), quantised
    layers and sharded weights (DeepSpeed ZeRO-3 gathers them in forward hooks, FSDP2 holds DTensors) are called as
    modules instead.
    """
    weight = getattr(head, "weight", None)
    hooks = (head._forward_hooks, head._forward_pre_hooks, head._backward_hooks, head._backward_pre_hooks)
    module = nn.modules.module
    global_hooks = (
        module._global_forward_hooks,
        module._global_forward_pre_hooks,
        module._global_backward_hooks,
        module._global_backward_pre_hooks,
    )
    return (
        type(head) is nn.Linear
        and weight.dtype in (*HEAD_DTYPES, torch.float64)
        and type(weight.data) is torch.Tensor
        and not hasattr(weight, "ds_id")  # DeepSpeed ZeRO-3
        and not hasattr(head, "_hf_hook")  # accelerate's dispatch and offloading replace forward
        and getattr(vars(head).get("forward", head.forward), "__func__", None) is nn.Linear.forward
        and not any(hooks)
        and not any(global_hooks)
    )


class _LinearHeadLogps(torch.autograd.Function):
    """Token log-probs and entropies of ``(N, H)`` hidden states through a linear head, at temperature ``T``, with
    ``suppressed`` tokens out of the softmax: what :func:`_head_logps_and_entropy` computes, with a hand-written
    backward pass that keeps nothing of size ``(N, V)``.

    Backward recomputes the logits ``z`` from the saved hidden states (one matrix product, as activation checkpointing
    would) and writes their gradient directly: ``d log p_y / dz = onehot(y) - p`` and ``dH / dz = -p (log p + H)``,
    both divided by ``T``. Autograd through the same operations keeps several float32 ``(N, V)`` intermediates and,
    under checkpointing, recomputes all of them, the logged entropy included; on a GPU those elementwise passes, not
    the matrix products, take most of the head's time. The matrix products run in autocast's dtype under autocast,
    as ``nn.Linear``'s would (:func:`matmul_dtype`).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, temperature, suppressed, with_entropy, entropy_grad):
        ctx.dtype = matmul_dtype(hidden.device, weight)
        logits = _linear_head_logits(hidden, weight, bias, ctx.dtype, temperature, suppressed)
        lse = torch.logsumexp(logits, dim=-1)
        logps = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - lse
        if with_entropy:
            # H = -sum_j p_j log p_j (not lse - sum_j p_j z_j, which loses float32 digits to cancellation); a suppressed
            # token has p = 0, log p = -inf, and adds nothing.
            log_probs = logits.sub_(lse.unsqueeze(-1))
            weighted = log_probs.exp().mul_(log_probs)
            if suppressed is not None:
                weighted.index_fill_(-1, suppressed, 0.0)
            entropy = -weighted.sum(-1)
            del weighted, log_probs
        else:
            entropy = torch.zeros_like(logps)
        del logits
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, bias, token_ids, suppressed, lse, entropy)
        ctx.temperature, ctx.entropy_grad = temperature, with_entropy and entropy_grad
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, token_ids, suppressed, lse, entropy = ctx.saved_tensors
        logits = _linear_head_logits(hidden, weight, bias, ctx.dtype, ctx.temperature, suppressed)
        log_probs = logits.sub_(lse.unsqueeze(-1))
        if ctx.entropy_grad and grad_entropy is not None:
            # -p (g_logp + g_H (log p + H))
            factor = log_probs + entropy.unsqueeze(-1)
            factor.mul_(grad_entropy.unsqueeze(-1)).add_(grad_logps.unsqueeze(-1))
            grad = log_probs.exp_().mul_(factor).neg_()
            del factor
        else:
            grad = log_probs.exp_().mul_(-grad_logps.unsqueeze(-1))
        grad.scatter_add_(-1, token_ids.unsqueeze(-1), grad_logps.unsqueeze(-1))
        if suppressed is not None:  # their logits were set, not computed: no gradient (nor 0 * inf, a NaN)
            grad.index_fill_(-1, suppressed, 0.0)
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        grad = grad.to(ctx.dtype)  # as autograd hands the float32 cast's gradient back to the product's dtype
        with torch.autocast(hidden.device.type, enabled=False):
            grad_hidden = (grad @ weight.to(ctx.dtype)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
            grad_weight = (grad.t() @ hidden.to(ctx.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = grad.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _linear_head_logits(hidden, weight, bias, dtype, temperature, suppressed) -> torch.Tensor:
    """The float32 :func:`_sampled_logits` of a linear head whose matrix product runs in ``dtype`` (fixed in forward:
    backward, where no autocast applies, recomputes them in the same one)."""
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if bias is None else bias.to(dtype)
        logits = nn.functional.linear(hidden.to(dtype), weight.to(dtype), bias).float()
    return _sampled_logits(logits, temperature, suppressed, in_place=True)  # a fresh tensor, outside autograd


def _liger_head_logps(head: nn.Module, hidden_rows: torch.Tensor, token_rows: torch.Tensor, temperature: float):
    """Token log-probs of ``(N, H)`` hidden states through Liger's fused linear cross-entropy kernel.

    The kernel computes the head and the log-softmax together, a block of rows at a time, in the forward and the
    backward pass: the log-prob of the given token is minus its per-token cross-entropy. It computes in the weight's
    dtype, outside autocast: its kernels take the weight as they are given it.
    """
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    weight, bias = head.weight, head.bias
    if isinstance(head, Float32OutputHead):  # cast_lm_head_to_fp32: float32, from a tied head's shared weight too
        weight, bias = weight.float(), None if bias is None else bias.float()
    hidden_rows = hidden_rows.to(weight.dtype)  # a float32 head (cast_lm_head_to_fp32) gets float32 inputs
    if temperature != 1.0:  # (W h + b) / T == W (h / T) + b / T
        hidden_rows = hidden_rows / temperature
        bias = bias / temperature if bias is not None else None
    with torch.autocast(hidden_rows.device.type, enabled=False):
        losses = liger_fused_linear_cross_entropy(hidden_rows, weight, token_rows, bias=bias, reduction="none")
    return -losses.float()


def _head_in_chunks(
    head: nn.Module,
    hidden_rows: torch.Tensor,
    token_rows: torch.Tensor,
    temperature: float,
    suppressed_token_ids: torch.Tensor | None,
    chunk_size: int,
    with_entropy: bool,
    entropy_grad: bool = False,
    head_kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of ``(N, H)`` hidden states, the head running on ``chunk_size`` rows at a time.

    ``head_kernel="triton"`` computes a plain linear head (float16, bfloat16 or float32) with Triton's kernels
    (:func:`.triton_head.linear_head_logps`), with or without gradient; any other head as with ``"torch"``.
    """
    logps, entropies = [], []
    weight = getattr(head, "weight", None)
    training = torch.is_grad_enabled() and (
        hidden_rows.requires_grad or (isinstance(weight, torch.Tensor) and weight.requires_grad)
    )
    plain = _is_plain_linear_head(head) and weight.device == hidden_rows.device
    in_triton = head_kernel == "triton" and plain and weight.dtype in HEAD_DTYPES
    if (
        head_kernel == "triton" and not in_triton
    ):  # the head was plain at set-up (else torch was chosen there, with a warning)
        warnings.warn(
            "logps_head_kernel='triton': torch computes the output head because it changed after the trainer was set "
            f"up: {_head_change(head, hidden_rows)}. The same log-probs, in more time and memory.",
            stacklevel=2,
        )
    fused = training and plain
    suppressed_token_ids = _nonempty(suppressed_token_ids)
    head_weight, head_bias = weight, getattr(head, "bias", None)
    if (in_triton or fused) and matmul_dtype(hidden_rows.device, weight) != weight.dtype:
        # Under autocast, the weight in autocast's dtype once for all chunks (autograd takes its gradient back to the
        # weight's dtype), not once per chunk in forward and twice in backward: a whole-vocabulary cast each time.
        dtype = matmul_dtype(hidden_rows.device, weight)
        head_weight, head_bias = weight.to(dtype), None if head_bias is None else head_bias.to(dtype)
    kind = "triton" if in_triton else "fused" if fused else "checkpointed" if training else "plain"
    settings = (temperature, suppressed_token_ids, with_entropy, entropy_grad)
    for start in range(0, hidden_rows.size(0), chunk_size):
        part = (hidden_rows[start : start + chunk_size], token_rows[start : start + chunk_size])
        chunk_logps, chunk_entropy = _chunk_logps(kind, head, head_weight, head_bias, *part, *settings)
        logps.append(chunk_logps)
        entropies.append(chunk_entropy)
    empty = hidden_rows.new_zeros(0, dtype=torch.float32)
    return (torch.cat(logps) if logps else empty), (torch.cat(entropies) if entropies else empty)


def _chunk_logps(
    kind: str,
    head: nn.Module,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    suppressed_token_ids: torch.Tensor | None,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's log-probs and entropies: in Triton's kernels, in the fused linear head (a written-out backward),
    checkpointed (the chunk's logits recomputed in backward instead of kept: the point of chunking), or plainly."""
    settings = (temperature, suppressed_token_ids, with_entropy, entropy_grad)
    if kind == "triton":
        from .triton_head import linear_head_logps  # imports Triton

        return linear_head_logps(hidden, weight, bias, tokens, *settings)
    if kind == "fused":
        return _LinearHeadLogps.apply(hidden, weight, bias, tokens, *settings)
    if kind == "checkpointed":
        return torch.utils.checkpoint.checkpoint(
            _head_logps_and_entropy, head, hidden, tokens, *settings, use_reentrant=False
        )
    return _head_logps_and_entropy(head, hidden, tokens, *settings)


def _chunked_head_logps(
    head: nn.Module,
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
    suppressed_token_ids: torch.Tensor | None,
    chunk_size: int,
    with_entropy: bool = True,
    liger: bool = False,
    entropy_grad: bool = False,
    head_kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of the masked positions of ``(B, T, H)`` hidden states, ``chunk_size`` at a time
    (:func:`_head_logps_of_positions`); positions outside ``mask`` are skipped and read as 0."""
    flat_logps, flat_entropy = _head_logps_of_positions(
        head,
        hidden[mask],
        token_ids[mask],
        temperature,
        suppressed_token_ids,
        chunk_size,
        with_entropy,
        liger,
        entropy_grad,
        head_kernel,
    )
    return _scattered(flat_logps, mask), _scattered(flat_entropy, mask)


def _head_logps_of_positions(
    head: nn.Module,
    hidden_rows: torch.Tensor,
    token_rows: torch.Tensor,
    temperature: float,
    suppressed_token_ids: torch.Tensor | None,
    chunk_size: int,
    with_entropy: bool,
    liger: bool,
    entropy_grad: bool,
    head_kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of ``(N, H)`` hidden states, ``chunk_size`` positions at a time: two ``(N,)``.

    Only one chunk's ``(chunk_size, V)`` logits exist at a time, in the forward pass and in the backward pass too,
    which recomputes them (for a plain linear head :class:`_LinearHeadLogps`, or Triton's kernels with
    ``head_kernel="triton"``; activation checkpointing for any other). With ``liger`` the log-probs come from Liger's
    fused kernel instead (no suppressed tokens), and the entropies, a metric, from chunks computed without gradient.
    """
    if liger and _nonempty(suppressed_token_ids) is not None:
        raise ValueError("Liger's fused kernel cannot leave suppressed tokens out of the softmax; use liger=False.")
    weight = getattr(head, "weight", None)
    if weight is not None and weight.dtype in HEAD_DTYPES and hidden_rows.dtype != weight.dtype:
        # Mixed precision (bf16=True) hands back the model's outputs, hidden states too, in float32: the head runs
        # outside the model's forward, so its inputs take its own dtype (and, under autocast, autocast's after that).
        hidden_rows = hidden_rows.to(weight.dtype)
    if liger and hidden_rows.size(0) > 0:
        flat_logps = _liger_head_logps(head, hidden_rows, token_rows, temperature)
        flat_entropy = torch.zeros_like(flat_logps)
        if with_entropy:
            with contextlib.nullcontext() if entropy_grad else torch.no_grad():
                _, flat_entropy = _head_in_chunks(
                    head, hidden_rows, token_rows, temperature, None, chunk_size, True, entropy_grad
                )
        return flat_logps, flat_entropy
    return _head_in_chunks(
        head,
        hidden_rows,
        token_rows,
        temperature,
        suppressed_token_ids,
        chunk_size,
        with_entropy,
        entropy_grad,
        head_kernel,
    )


def _scattered(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A float32 tensor shaped like ``mask`` holding ``values`` at its positions, in order, and 0 elsewhere."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=values.device).masked_scatter(mask, values.float())


def completion_logps(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    use_position_ids: bool = True,
    suppressed_token_ids: torch.Tensor | None = None,
    chunk_size: int | None = None,
    liger: bool = False,
    entropy_grad: bool = False,
    head_kernel: str = "torch",
    router_aux_loss: bool = False,
    image_inputs: dict[str, torch.Tensor] | None = None,
    prompt_aligned: dict[str, torch.Tensor] | None = None,
    completion_aligned: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Log-probs (and optionally entropies) of the completion tokens under ``model``: two ``(B, C)`` tensors.

    Prompts are left-padded and completions right-padded; columns no row uses are cut before the forward pass, and
    position ids count only attended tokens, exactly as ``generate`` numbered them (``use_position_ids=False`` for a
    model whose forward takes none; see :func:`forward_accepts_position_ids`). Logits are divided by the sampling
    temperature, and tokens that generation suppresses get no probability, so the log-probs are those of the
    distribution that was sampled from.

    With ``chunk_size`` (for models where :func:`supports_chunked_head`), the ``(B, C, V)`` logits are never
    materialised: the output head runs on ``chunk_size`` completion positions at a time, padding positions are
    skipped (their log-probs read 0), and the backward pass recomputes each chunk; ``head_kernel="triton"`` computes
    a plain linear head's chunks with Triton's kernels; ``liger`` (for a plain linear head and no suppressed tokens)
    Liger's fused linear cross-entropy kernel. Otherwise the model computes the completion positions' logits in one
    piece. The entropies carry a gradient only with ``entropy_grad`` (an entropy bonus in the loss). With
    ``router_aux_loss`` (mixture-of-experts models) the router's load-balancing loss is returned as a third value. Prompts with images bring the model's per-image inputs (``image_inputs``: pixel
    values, image grids, ...) and per-token inputs aligned with ``prompt_ids`` (``prompt_aligned``: token type ids),
    which read 0 over the completion, except where ``completion_aligned`` gives them (images in tool results).
    """
    inputs, kept_columns = _trimmed_inputs(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_attention_mask,
        image_inputs,
        prompt_aligned,
        completion_aligned,
    )
    if use_position_ids:  # counting only attended tokens, exactly as generate numbered them
        inputs["position_ids"] = (inputs["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    if router_aux_loss:
        inputs["output_router_logits"] = True
    kept_ids = completion_ids[:, :kept_columns]
    suppressed = None if suppressed_token_ids is None else _nonempty(suppressed_token_ids.to(kept_ids.device))
    if chunk_size is None:
        head = _logps_from_logits(model, inputs, kept_ids, temperature, suppressed, with_entropy, entropy_grad)
    else:
        kept_mask = completion_attention_mask[:, :kept_columns].bool()
        settings = (temperature, suppressed, chunk_size, with_entropy, liger, entropy_grad, head_kernel)
        head = _logps_from_hidden_states(model, inputs, kept_ids, kept_mask, *settings)
    logps, entropies = _with_cut_columns(*head[:2], completion_ids.size(1))
    return (logps, entropies, head[2]) if router_aux_loss else (logps, entropies)


def _with_cut_columns(
    logps: torch.Tensor, entropies: torch.Tensor | None, width: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cut right-hand columns put back (they are masked everywhere), so shapes match the completion tensors."""
    pad = width - logps.size(1)
    if pad > 0:
        logps = nn.functional.pad(logps, (0, pad))
        entropies = nn.functional.pad(entropies, (0, pad)) if entropies is not None else None
    return logps, entropies


def _trimmed_inputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_attention_mask: torch.Tensor,
    image_inputs: dict[str, torch.Tensor] | None,
    prompt_aligned: dict[str, torch.Tensor] | None,
    completion_aligned: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, Any], int]:
    """The model's inputs for prompt + completion without the columns no row uses (the prompts' left padding, the
    completions' right padding), and how many completion columns they keep (at least 1)."""
    first_prompt_column = int(prompt_mask.any(dim=0).float().argmax()) if prompt_mask.any() else prompt_mask.size(1)
    used_completion = completion_attention_mask.any(dim=0)
    kept_columns = int(used_completion.nonzero().max()) + 1 if used_completion.any() else 1
    input_ids = torch.cat([prompt_ids[:, first_prompt_column:], completion_ids[:, :kept_columns]], dim=1)
    attention_mask = torch.cat(
        [prompt_mask[:, first_prompt_column:], completion_attention_mask[:, :kept_columns]], dim=1
    ).long()
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, **(image_inputs or {})}
    prompt_aligned, completion_aligned = prompt_aligned or {}, completion_aligned or {}
    for key in dict.fromkeys([*prompt_aligned, *completion_aligned]):
        prompt_part = prompt_aligned.get(key)
        prompt_part = prompt_ids.new_zeros(prompt_ids.shape) if prompt_part is None else prompt_part
        completion_part = completion_aligned.get(key)
        if completion_part is None:
            completion_part = prompt_part.new_zeros(prompt_part.size(0), kept_columns)
        inputs[key] = torch.cat([prompt_part[:, first_prompt_column:], completion_part[:, :kept_columns]], dim=1)
    return inputs, kept_columns


def _logps_from_logits(
    model: nn.Module,
    inputs: dict[str, Any],
    completion_ids: torch.Tensor,
    temperature: float,
    suppressed_token_ids: torch.Tensor | None,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs, entropies (or None) and router loss (or None), the model computing the completion's logits whole."""
    # Logits for the positions that predict completion tokens only: the prompt's logits are never needed.
    outputs = model(**inputs, logits_to_keep=completion_ids.size(1) + 1, use_cache=False)
    logits = _sampled_logits(outputs.logits[:, :-1], temperature, suppressed_token_ids)
    logps = selective_log_softmax(logits, completion_ids)
    entropies = entropy_from_logits(logits, differentiable=entropy_grad) if with_entropy else None
    return logps, entropies, getattr(outputs, "aux_loss", None)


def _logps_from_hidden_states(
    model: nn.Module,
    inputs: dict[str, Any],
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float,
    suppressed_token_ids: torch.Tensor | None,
    chunk_size: int,
    with_entropy: bool,
    liger: bool,
    entropy_grad: bool,
    head_kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-probs, entropies (or None) and router loss (or None), the output head running on ``chunk_size`` of the
    final hidden states' completion positions at a time (:func:`_chunked_head_logps`)."""
    # Through the (possibly wrapped) model, so distributed wrappers see the forward pass; it computes one position's
    # logits, and the head then runs chunk by chunk on the final hidden states.
    outputs = model(**inputs, logits_to_keep=1, output_hidden_states=True, use_cache=False)
    hidden = outputs.hidden_states[-1][:, -(completion_ids.size(1) + 1) : -1]
    logps, entropies = _chunked_head_logps(
        _output_head(model),
        hidden,
        completion_ids,
        completion_mask,
        temperature,
        suppressed_token_ids,
        chunk_size,
        with_entropy,
        liger=liger,
        entropy_grad=entropy_grad,
        head_kernel=head_kernel,
    )
    return logps, entropies if with_entropy else None, getattr(outputs, "aux_loss", None)


def packed_completion_logps(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_attention_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    suppressed_token_ids: torch.Tensor | None = None,
    chunk_size: int | None = None,
    liger: bool = False,
    entropy_grad: bool = False,
    router_aux_loss: bool = False,
    head_kernel: str = "torch",
) -> tuple[torch.Tensor, ...]:
    """:func:`completion_logps` of the rows packed into one (:func:`~targetpo.modeling.packing.pack_rows`): the same
    log-probs, entropies and router loss, with no padding in the forward pass and the output head run only where a
    completion token is predicted; positions outside the completion attention mask read 0.

    The rows and the model must allow packing (:func:`~targetpo.modeling.packing.rows_packing_problem`,
    :func:`~targetpo.modeling.packing.model_packing_problem`): without an attention mask, transformers keeps the
    sequences apart by their position ids, which restart at 0 for each row.
    """
    packed = pack_rows(prompt_ids, prompt_mask, completion_ids, completion_attention_mask)
    inputs: dict[str, Any] = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "use_cache": False}
    if router_aux_loss:
        inputs["output_router_logits"] = True
    token_ids = completion_ids[packed.completion_mask]
    suppressed = None if suppressed_token_ids is None else _nonempty(suppressed_token_ids.to(token_ids.device))
    if chunk_size is None:
        outputs = model(**inputs, logits_to_keep=packed.predicting)
        logits = _sampled_logits(outputs.logits[0], temperature, suppressed)
        positions_per_chunk = 4 * max(1, completion_ids.size(1))  # as many as the padded pass's chunks of 4 rows
        flat_logps = selective_log_softmax(logits, token_ids, positions_per_chunk)
        flat_entropy = entropy_from_logits(logits, positions_per_chunk, entropy_grad) if with_entropy else None
    else:
        # The head runs chunk by chunk on the final hidden states; the model computes one position's logits.
        outputs = model(**inputs, logits_to_keep=1, output_hidden_states=True)
        hidden = outputs.hidden_states[-1][0, packed.predicting]
        flat_logps, flat_entropy = _head_logps_of_positions(
            _output_head(model),
            hidden,
            token_ids,
            temperature,
            suppressed,
            chunk_size,
            with_entropy,
            liger,
            entropy_grad,
            head_kernel,
        )
    logps = _scattered(flat_logps, packed.completion_mask)
    entropies = _scattered(flat_entropy, packed.completion_mask) if with_entropy else None
    if router_aux_loss:
        return logps, entropies, getattr(outputs, "aux_loss", None)
    return logps, entropies


def shared_prompt_completion_logps(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_attention_mask: torch.Tensor,
    chunk_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    suppressed_token_ids: torch.Tensor | None = None,
    liger: bool = False,
    entropy_grad: bool = False,
    head_kernel: str = "torch",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`completion_logps` with each prompt read once for the consecutive rows that share it
    (:func:`~targetpo.modeling.shared_prompt.shared_prompt_hidden_states`): the same log-probs and entropies, the
    output head run ``chunk_size`` completion positions at a time.

    Each prompt must end in a read token (left padding); the model must continue exactly from the keys and values
    its forward pass returns (:func:`~targetpo.modeling.shared_prompt.model_sharing_problem`).
    """
    used_completion = completion_attention_mask.any(dim=0)
    kept_columns = int(used_completion.nonzero().max()) + 1 if used_completion.any() else 1
    kept_ids, kept_mask = completion_ids[:, :kept_columns], completion_attention_mask[:, :kept_columns]
    runs = prompt_runs(prompt_ids, prompt_mask)
    hidden = shared_prompt_hidden_states(model, prompt_ids, prompt_mask, kept_ids, kept_mask, runs)
    suppressed = None if suppressed_token_ids is None else _nonempty(suppressed_token_ids.to(kept_ids.device))
    logps, entropies = _chunked_head_logps(
        _output_head(model),
        hidden,
        kept_ids,
        kept_mask.bool(),
        temperature,
        suppressed,
        chunk_size,
        with_entropy,
        liger=liger,
        entropy_grad=entropy_grad,
        head_kernel=head_kernel,
    )
    pad = completion_ids.size(1) - kept_columns  # the cut right-hand columns, masked everywhere, put back
    logps, entropies = (nn.functional.pad(values, (0, pad)) for values in (logps, entropies))
    return logps, entropies if with_entropy else None
