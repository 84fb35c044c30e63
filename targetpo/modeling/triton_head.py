"""The output head's log-probs in Triton kernels (``logps_head_kernel="triton"``): from a chunk's logits, each
position's token log-prob, log-sum-exp and entropy, and in backward the logits' gradient, all in one pass over the
vocabulary with float32 arithmetic but no float32 copy of the logits; and a linear head built on them.

The kernels read the logits in their own dtype (bf16 stays bf16 in memory) a block of the vocabulary at a time,
keeping a running maximum, sum of exponentials and sum of ``exp · (z − max)`` in float32 (an online log-sum-exp that
gives the entropy too). A ``-inf`` logit is out of the softmax: the head sets suppressed tokens to ``-inf``.

Importing this module imports Triton. Its kernels run on a GPU, or on the CPU in Triton's interpreter, which must be
switched on (``TRITON_INTERPRET=1``) before Triton is first imported.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn
from triton.runtime.interpreter import InterpretedFunction

from .loading import matmul_dtype

#: The most vocabulary entries one kernel step reads from a row.
MAX_BLOCK = 4096
#: Devices whose tensors Triton's compiled kernels take (ROCm GPUs are "cuda" devices in torch).
TRITON_DEVICES = ("cuda", "xpu")
#: A fault on the device, after which its context is unusable (torch >= 2.8 tells it apart; before, nothing does).
DEVICE_FAULTS = (torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()


class LogitsStats(NamedTuple):
    """Per position of ``(N, V)`` logits at a temperature: the given token's log-prob, the log-sum-exp of the tempered
    logits, and the entropy of their softmax; three float32 ``(N,)`` tensors."""

    logps: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor


@triton.jit
def _stats_kernel(
    logits_ptr,
    row_stride,
    token_ids_ptr,
    logps_ptr,
    lse_ptr,
    entropy_ptr,
    vocab_size,
    inv_temperature,
    BLOCK: tl.constexpr,
):
    """One row: log p of its token, log-sum-exp and entropy, in one pass over the vocabulary.

    With ``m`` the running maximum, ``s = Σ exp(z − m)`` and ``t = Σ exp(z − m)(z − m)``: ``lse = m + log s`` and
    ``H = log s − t / s``, two terms that are never negative, so no digits cancel.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    columns = tl.arange(0, BLOCK)
    running_max = float("-inf")
    total = 0.0
    shifted = 0.0
    for start in range(0, vocab_size, BLOCK):
        offsets = start + columns
        z = tl.load(row_ptr + offsets, mask=offsets < vocab_size, other=float("-inf")).to(tl.float32)
        z = z * inv_temperature
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        pivot = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing in the softmax yet: any finite pivot
        rescale = tl.exp(running_max - pivot)
        moved = tl.where(running_max == float("-inf"), 0.0, running_max - pivot)
        shifted = rescale * (shifted + total * moved)
        total = rescale * total
        in_softmax = z > float("-inf")
        below_pivot = tl.where(in_softmax, z - pivot, 0.0)  # not -inf: exp(-inf) * -inf would be NaN
        weights = tl.where(in_softmax, tl.exp(below_pivot), 0.0)
        total += tl.sum(weights, axis=0)
        shifted += tl.sum(weights * below_pivot, axis=0)
        running_max = new_max
    log_total = tl.log(total)
    row_lse = running_max + log_total
    token = tl.load(token_ids_ptr + row)
    token_logit = tl.load(row_ptr + token).to(tl.float32) * inv_temperature
    tl.store(logps_ptr + row, token_logit - row_lse)
    tl.store(lse_ptr + row, row_lse)
    tl.store(entropy_ptr + row, log_total - shifted / total)


@triton.jit
def _grad_kernel(
    logits_ptr,
    row_stride,
    token_ids_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logps_ptr,
    grad_entropy_ptr,
    vocab_size,
    inv_temperature,
    BLOCK: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
):
    """One row: overwrite the logits with the gradient ``g (onehot(y) − p) − g_H p (log p + H)``, divided by the
    temperature, 0 where a logit is ``-inf``."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    columns = tl.arange(0, BLOCK)
    token = tl.load(token_ids_ptr + row)
    row_lse = tl.load(lse_ptr + row)
    grad_logp = tl.load(grad_logps_ptr + row)
    if ENTROPY_GRAD:
        row_entropy = tl.load(entropy_ptr + row)
        grad_entropy = tl.load(grad_entropy_ptr + row)
    for start in range(0, vocab_size, BLOCK):
        offsets = start + columns
        inside = offsets < vocab_size
        z = tl.load(row_ptr + offsets, mask=inside, other=float("-inf")).to(tl.float32) * inv_temperature
        in_softmax = z > float("-inf")  # a logit set to -inf has p = 0 and no gradient (not 0 * -inf)
        log_p = tl.where(in_softmax, z - row_lse, 0.0)
        p = tl.where(in_softmax, tl.exp(log_p), 0.0)
        if ENTROPY_GRAD:
            grad = -p * (grad_logp + grad_entropy * (log_p + row_entropy))
        else:
            grad = -p * grad_logp
        grad = tl.where((offsets == token) & in_softmax, grad + grad_logp, grad) * inv_temperature
        tl.store(row_ptr + offsets, grad.to(logits_ptr.dtype.element_ty), mask=inside)


def runs_interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter: ``TRITON_INTERPRET=1`` was set before it was imported."""
    return isinstance(tl.max, InterpretedFunction)  # the language's own functions are made when Triton is imported


def device_problem(device: torch.device) -> str | None:
    """Why the kernels cannot run on ``device`` in this process, or None when they can."""
    if runs_interpreted() or device.type in TRITON_DEVICES:
        return None
    if device.type != "cpu":
        return f"Triton's kernels do not run on a {device.type!r} device"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return (
            "TRITON_INTERPRET=1 was set after Triton was imported, too late for its interpreter: set it before Python "
            "starts"
        )
    return (
        "Triton's kernels need a GPU and this run is on the CPU; only to test, set TRITON_INTERPRET=1 before Python "
        "starts to run them (slowly) in Triton's interpreter"
    )


def launch_problem(device: torch.device) -> str | None:
    """Why the kernels fail to compile, launch or compute right on ``device``, or None once they have. Triton
    compiles each kernel, and its launcher, when first called: a missing C compiler or Python headers, or a GPU its
    compiler does not support, show up only then. Both kernels run once on bf16 logits as wide as a block, twice
    over, and their log-probs are checked against torch's."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(2, 2 * MAX_BLOCK, device=device, generator=generator).to(torch.bfloat16)
    token_ids = torch.tensor([0, 2 * MAX_BLOCK - 1], device=device)
    ones = torch.ones(2, device=device)
    try:
        stats = logits_stats(logits, token_ids, 1.0)
        for grad_entropy in (None, ones):
            logits_grad_(logits.clone(), token_ids, stats.lse, stats.entropy, ones, grad_entropy, 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except DEVICE_FAULTS:
        raise  # the kernel faulted on the device, whose context is now unusable: nothing can fall back
    except Exception as error:  # noqa: BLE001 -- whatever else stops the kernels; the caller uses torch instead
        first_line = (str(error).strip().splitlines() or [""])[0]
        return f"{type(error).__name__}: {first_line}"
    expected = torch.log_softmax(logits.float(), dim=-1).gather(1, token_ids.unsqueeze(1)).squeeze(1)
    error = (stats.logps - expected).abs().max().item()
    if not error < 1e-3:
        return f"their log-probs were {error:.3g} off torch's on a test batch"
    return None


def _launch_settings(logits: torch.Tensor, block_size: int | None) -> dict:
    """The block and warps of a launch over ``logits``, after checking that the kernels can run on its device."""
    problem = device_problem(logits.device)
    if problem is not None:
        raise RuntimeError(f"logps_head_kernel='triton': {problem}.")
    if logits.stride(-1) != 1:
        raise ValueError("The logits' vocabulary dimension must be contiguous.")
    block = block_size or min(MAX_BLOCK, triton.next_power_of_2(logits.size(-1)))
    return {"BLOCK": block, "num_warps": 8 if block >= 2048 else 4}


def logits_stats(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float, block_size: int | None = None
) -> LogitsStats:
    """Log-prob of ``token_ids``, log-sum-exp and entropy of each row of ``(N, V)`` logits divided by
    ``temperature``; a ``-inf`` logit is out of the softmax. ``block_size`` (a power of two) overrides the block."""
    rows, vocab_size = logits.shape
    logps, lse, entropy = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    if rows == 0:
        return LogitsStats(logps, lse, entropy)
    settings = _launch_settings(logits, block_size)
    _stats_kernel[(rows,)](
        logits, logits.stride(0), token_ids.contiguous(), logps, lse, entropy, vocab_size, 1.0 / temperature,
        **settings,
    )  # fmt: skip
    return LogitsStats(logps, lse, entropy)


def logits_grad_(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logps: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    block_size: int | None = None,
) -> torch.Tensor:
    """Overwrite ``(N, V)`` logits with the gradient of ``Σ grad_logps · log p_y + Σ grad_entropy · H`` with respect
    to them (``lse`` and ``entropy`` from :func:`logits_stats` of the same logits), in their dtype; return them.

    ``d log p_y / dz = onehot(y) − p`` and ``dH / dz = −p (log p + H)``, divided by ``temperature``; ``-inf`` logits
    get 0. No ``grad_entropy``: the entropy carries no gradient.
    """
    rows, vocab_size = logits.shape
    if rows == 0:
        return logits
    settings = _launch_settings(logits, block_size)
    grad_logps = grad_logps.float().contiguous()  # a sum's gradient arrives expanded, with stride 0
    entropy_grad = grad_entropy is not None
    grad_entropy = grad_entropy.float().contiguous() if entropy_grad else grad_logps
    _grad_kernel[(rows,)](
        logits, logits.stride(0), token_ids.contiguous(), lse, entropy, grad_logps, grad_entropy,
        vocab_size, 1.0 / temperature, ENTROPY_GRAD=entropy_grad, **settings,
    )  # fmt: skip
    return logits


def _head_logits(hidden, weight, bias, dtype, suppressed) -> torch.Tensor:
    """The head's ``(N, V)`` logits in ``dtype``, suppressed tokens at ``-inf``: a fresh tensor, outside autograd."""
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if bias is None else bias.to(dtype)
        logits = nn.functional.linear(hidden.to(dtype), weight.to(dtype), bias)
    if suppressed is not None:
        logits.index_fill_(-1, suppressed, float("-inf"))
    return logits


class _TritonLinearHeadLogps(torch.autograd.Function):
    """Token log-probs and entropies of ``(N, H)`` hidden states through a linear head: the logits by one matrix
    product in the head's dtype (autocast's under autocast), their statistics by :func:`logits_stats`.

    Backward recomputes the logits, overwrites them with their gradient (:func:`logits_grad_`), and multiplies it
    back through the head: nothing of size ``(N, V)`` is kept between the passes, and none is float32 unless the head
    is.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, token_ids, temperature, suppressed, with_entropy, entropy_grad, block_size):
        dtype = matmul_dtype(hidden.device, weight)
        logits = _head_logits(hidden, weight, bias, dtype, suppressed)
        stats = logits_stats(logits, token_ids, temperature, block_size)
        del logits
        entropy = stats.entropy if with_entropy else torch.zeros_like(stats.logps)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, bias, token_ids, suppressed, stats.lse, stats.entropy)
        ctx.temperature, ctx.entropy_grad, ctx.dtype = temperature, with_entropy and entropy_grad, dtype
        ctx.block_size = block_size
        return stats.logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, token_ids, suppressed, lse, entropy = ctx.saved_tensors
        logits = _head_logits(hidden, weight, bias, ctx.dtype, suppressed)
        grad_entropy = grad_entropy if ctx.entropy_grad else None
        grad = logits_grad_(logits, token_ids, lse, entropy, grad_logps, grad_entropy, ctx.temperature, ctx.block_size)
        with torch.autocast(hidden.device.type, enabled=False):
            grad_hidden = (grad @ weight.to(ctx.dtype)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
            grad_weight = (grad.t() @ hidden.to(ctx.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = grad.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def linear_head_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    temperature: float,
    suppressed: torch.Tensor | None,
    with_entropy: bool,
    entropy_grad: bool,
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs and entropies (zeros unless ``with_entropy``; a gradient only with ``entropy_grad``) of
    ``(N, H)`` hidden states through the linear head ``weight``, ``bias`` at ``temperature``, the ``suppressed`` token
    ids out of the softmax: two float32 ``(N,)`` tensors, differentiable in ``hidden``, ``weight`` and ``bias``."""
    return _TritonLinearHeadLogps.apply(
        hidden, weight, bias, token_ids, temperature, suppressed, with_entropy, entropy_grad, block_size
    )
