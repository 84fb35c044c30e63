"""The Triton head's kernels (``targetpo/modeling/triton_head.py``) against float64 references in plain torch, and
the trainer with ``logps_head_kernel="triton"`` against the torch head.

Run by tests/test_triton_head.py in a process of its own: on a CUDA GPU with the compiled kernels, on the CPU in
Triton's interpreter, which must be on before Triton is first imported (``TRITON_INTERPRET=1 python -m pytest
tests/scripts/triton_head_checks.py``). Sizes are small, for the interpreter, but span several vocabulary blocks
(300 entries in blocks of 64, the last one partial).
"""

import copy
import math

import pytest
import torch
from conftest import letters_then_position_reward, make_config
from datasets import Dataset

from targetpo import TargetPOTrainer
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm
from targetpo.modeling import triton_head
from targetpo.modeling.logps import _head_in_chunks, completion_logps

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and not triton_head.runs_interpreted():
    raise RuntimeError("Run with TRITON_INTERPRET=1 set before Python starts (Triton's interpreter), or on a GPU.")

ROWS, VOCAB, WIDTH, BLOCK = 24, 300, 32, 64
SUPPRESSED = torch.tensor([0, 77, 150, 299])  # the first and last columns, and one inside a block
TEMPERATURE = 0.7  # the gradient tests take this one only: dividing by 1 is no case of its own


def random_case(dtype, seed=0, scale=1.0):
    """Logits ``(ROWS, VOCAB)`` in ``dtype`` and token ids: the first a suppressed token (its log p is -inf), the
    next two the first and last columns that are not."""
    generator = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(ROWS, VOCAB, generator=generator)).to(dtype)
    token_ids = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    token_ids[:3] = torch.tensor([SUPPRESSED[1], 1, VOCAB - 2])
    return logits, token_ids


def reference_stats(logits, token_ids, temperature, suppressed):
    """Log p of each token, log-sum-exp and entropy in float64 (``-inf`` logits out of the softmax): plain torch."""
    z = logits.double() / temperature
    if suppressed is not None:
        z = z.index_fill(-1, suppressed, -math.inf)
    log_p = z.log_softmax(-1)
    p = log_p.exp()
    entropy = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    return log_p.gather(-1, token_ids[:, None]).squeeze(-1), z.logsumexp(-1), entropy


def finite_weighted_sum(logps, entropy, grad_logps, grad_entropy):
    """``Σ g · log p`` over the finite log-probs, plus ``Σ g_H · H`` when ``grad_entropy`` is given."""
    loss = (torch.where(torch.isfinite(logps), logps, torch.zeros_like(logps)) * grad_logps).sum()
    return loss if grad_entropy is None else loss + (entropy * grad_entropy).sum()


def upstream_gradients(seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, ROWS, generator=generator, dtype=torch.float64)


def to_device(*tensors):
    return tuple(None if tensor is None else tensor.to(DEVICE) for tensor in tensors)


# ------------------------------------------------------------------------------------------------------ the kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
@pytest.mark.parametrize("suppressed", [None, SUPPRESSED], ids=["all-tokens", "suppressed"])
def test_log_probs_log_sum_exp_and_entropy_of_logits(dtype, temperature, suppressed):
    logits, token_ids = random_case(dtype, scale=3.0)
    expected = reference_stats(logits, token_ids, temperature, suppressed)
    given = logits.clone() if suppressed is None else logits.index_fill(-1, suppressed, -math.inf)
    stats = triton_head.logits_stats(*to_device(given, token_ids), temperature, block_size=BLOCK)
    # The logits are the kernel's input as they are: float32 arithmetic on them is all that parts it from float64.
    for name, actual, wanted in zip(stats._fields, stats, expected):
        assert actual.dtype == torch.float32, name
        finite = torch.isfinite(wanted)
        assert torch.equal(torch.isfinite(actual.cpu()), finite), name  # -inf exactly where the token is suppressed
        torch.testing.assert_close(actual.cpu()[finite].double(), wanted[finite], rtol=1e-5, atol=1e-5, msg=name)
    if suppressed is not None:
        assert stats.logps[0] == -math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entropy_grad", [False, True], ids=["entropy-metric", "entropy-bonus"])
def test_the_logits_gradient(dtype, entropy_grad):
    temperature = TEMPERATURE
    logits, token_ids = random_case(dtype, scale=3.0)
    given = logits.index_fill(-1, SUPPRESSED, -math.inf)
    grad_logps, grad_entropy = upstream_gradients()
    grad_entropy = grad_entropy if entropy_grad else None

    # The reference: float64 autograd through the softmax, not the closed form the kernel writes out.
    z = logits.double().requires_grad_()
    logps, _, entropy = reference_stats(z, token_ids, temperature, SUPPRESSED)
    finite_weighted_sum(logps, entropy, grad_logps, grad_entropy).backward()
    grad_logps = torch.where(torch.isfinite(logps), grad_logps, 0)  # a -inf log-prob is left out of the loss

    device_logits, device_ids = to_device(given, token_ids)
    stats = triton_head.logits_stats(device_logits, device_ids, temperature, block_size=BLOCK)
    upstream = to_device(grad_logps.float(), None if grad_entropy is None else grad_entropy.float())
    grad = triton_head.logits_grad_(
        device_logits, device_ids, stats.lse, stats.entropy, *upstream, temperature, block_size=BLOCK
    )
    assert grad.data_ptr() == device_logits.data_ptr() and grad.dtype == dtype  # in place, in the logits' dtype
    grad = grad.cpu().double()
    assert torch.equal(grad[:, SUPPRESSED], torch.zeros_like(grad[:, SUPPRESSED]))
    # float32: its arithmetic's rounding. bf16: within one bf16 step (2^-7 relative) of the float64 gradient, as
    # Triton's interpreter truncates to bf16 where a GPU rounds to nearest (half a step).
    rtol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(grad, z.grad, rtol=rtol, atol=1e-6)


def test_entropies_of_sharp_distributions_keep_their_float32_digits():
    # Large logits over a large vocabulary: lse - Σ p z would cancel away float32 digits; the kernel's two terms,
    # log Σ exp(z - m) and -Σ exp(z - m)(z - m) / Σ exp(z - m), are never negative and do not.
    generator = torch.Generator().manual_seed(0)
    logits = 40 * torch.randn(6, 3000, generator=generator)
    token_ids = torch.zeros(6, dtype=torch.long)
    stats = triton_head.logits_stats(*to_device(logits, token_ids), 1.0, block_size=256)
    _, _, expected = reference_stats(logits, token_ids, 1.0, None)
    torch.testing.assert_close(stats.entropy.cpu().double(), expected, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------------- the linear head
def head_case(dtype, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, WIDTH, generator=generator)
    weight = torch.randn(VOCAB, WIDTH, generator=generator) / math.sqrt(WIDTH)
    bias_values = 0.5 * torch.randn(VOCAB, generator=generator) if bias else None
    _, token_ids = random_case(torch.float32, seed)
    return (*(None if t is None else t.to(dtype) for t in (hidden, weight, bias_values)), token_ids)


def reference_head(hidden, weight, bias, token_ids, temperature, suppressed, grad_logps, grad_entropy):
    """Values and (hidden, weight, bias) gradients in float64 autograd, from the same (rounded) inputs."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    logits = leaves[0] @ leaves[1].T + (0 if leaves[2] is None else leaves[2])
    logps, _, entropy = reference_stats(logits, token_ids, temperature, suppressed)
    finite_weighted_sum(logps, entropy, grad_logps, grad_entropy).backward()
    return logps.detach(), entropy.detach(), [None if leaf is None else leaf.grad for leaf in leaves]


def triton_head_run(hidden, weight, bias, token_ids, temperature, suppressed, grad_logps, grad_entropy, **options):
    leaves = [None if t is None else t.detach().to(DEVICE).requires_grad_() for t in (hidden, weight, bias)]
    token_ids, suppressed = to_device(token_ids, suppressed)
    entropy_grad = grad_entropy is not None
    logps, entropy = triton_head.linear_head_logps(
        *leaves, token_ids, temperature, suppressed, True, entropy_grad, block_size=BLOCK, **options
    )
    upstream = to_device(grad_logps.float(), None if grad_entropy is None else grad_entropy.float())
    finite_weighted_sum(logps, entropy, *upstream).backward()
    return logps.detach().cpu(), entropy.detach().cpu(), [None if leaf is None else leaf.grad for leaf in leaves]


# bf16: the head's logits are rounded to bf16 (2^-9 of their size, here up to ~5) before the kernel reads them;
# a log-prob takes that error from its own logit and from the log-sum-exp, gradients the same relative error.
HEAD_TOLERANCES = {torch.float32: {"rtol": 1e-5, "atol": 2e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 3e-2}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("entropy_grad", [False, True], ids=["entropy-metric", "entropy-bonus"])
def test_the_linear_heads_values_and_gradients(dtype, entropy_grad):
    temperature = TEMPERATURE
    case = head_case(dtype)
    grad_logps, grad_entropy = upstream_gradients()
    grad_entropy = grad_entropy if entropy_grad else None
    expected = reference_head(*case, temperature, SUPPRESSED, grad_logps, grad_entropy)
    logps, entropy, grads = triton_head_run(*case, temperature, SUPPRESSED, grad_logps, grad_entropy)
    tolerance = HEAD_TOLERANCES[dtype]
    assert logps[0] == -math.inf and logps.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logps[1:].double(), expected[0][1:], **tolerance)
    torch.testing.assert_close(entropy.double(), expected[1], **tolerance)
    for name, grad, wanted, leaf in zip(("hidden", "weight", "bias"), grads, expected[2], case):
        assert grad.dtype == leaf.dtype, name
        scale = wanted.abs().max().item()
        torch.testing.assert_close(grad.cpu().double(), wanted, rtol=tolerance["rtol"], atol=tolerance["atol"] * scale)


def test_an_entropy_without_gradient_is_a_metric_and_no_entropy_reads_zero():
    hidden, weight, _, token_ids = head_case(torch.float32, bias=False)
    hidden, weight = (t.to(DEVICE).requires_grad_() for t in (hidden, weight))
    token_ids = token_ids.to(DEVICE)
    logps, entropy = triton_head.linear_head_logps(hidden, weight, None, token_ids, 0.7, None, True, False, BLOCK)
    assert logps.requires_grad and not entropy.requires_grad and entropy.gt(0).all()
    _, expected = triton_head.linear_head_logps(hidden, weight, None, token_ids, 0.7, None, True, True, BLOCK)
    torch.testing.assert_close(entropy, expected.detach())  # the same values, with or without gradient
    _, no_entropy = triton_head.linear_head_logps(hidden, weight, None, token_ids, 0.7, None, False, False, BLOCK)
    assert torch.equal(no_entropy, torch.zeros_like(no_entropy)) and not no_entropy.requires_grad


def test_under_autocast_the_head_computes_as_autocast_would():
    # float32 master weights under bf16 autocast: the matrix products run in bf16, gradients return in float32.
    hidden, weight, bias, token_ids = head_case(torch.float32)
    grad_logps, grad_entropy = upstream_gradients()
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        logps, entropy, grads = triton_head_run(
            hidden, weight, bias, token_ids, 0.7, SUPPRESSED, grad_logps, grad_entropy
        )
    as_bf16 = triton_head_run(
        *(t.to(torch.bfloat16) for t in (hidden, weight, bias)), token_ids, 0.7, SUPPRESSED, grad_logps, grad_entropy
    )
    assert torch.equal(logps, as_bf16[0]) and torch.equal(entropy, as_bf16[1])
    for grad, bf16_grad in zip(grads, as_bf16[2]):
        assert grad.dtype == torch.float32 and torch.equal(grad, bf16_grad.float())  # bf16's, in float32


def test_the_chunked_head_takes_the_triton_kernels_with_and_without_gradient():
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(WIDTH, VOCAB).to(DEVICE)
    hidden = torch.randn(ROWS, WIDTH, generator=generator).to(DEVICE).requires_grad_()
    tokens = torch.randint(0, VOCAB, (ROWS,), generator=generator).to(DEVICE)
    suppressed = SUPPRESSED.to(DEVICE)
    logps, entropies = _head_in_chunks(head, hidden, tokens, 0.7, suppressed, 10, True, True, head_kernel="triton")
    assert logps.grad_fn.next_functions[0][0].name() == "_TritonLinearHeadLogpsBackward"
    torch_logps, torch_entropies = _head_in_chunks(head, hidden, tokens, 0.7, suppressed, 10, True, True)
    torch.testing.assert_close(logps, torch_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies, torch_entropies, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # old and reference log-probs: the same kernels, the same values
        no_grad_logps, _ = _head_in_chunks(head, hidden, tokens, 0.7, suppressed, 10, True, False, "triton")
    assert torch.equal(no_grad_logps, logps.detach())


def test_completion_logps_with_the_triton_head_equal_the_full_logits_path():
    from logps_cases import logps_entropies_and_gradients, padded_batch

    model = build_tiny_causal_lm(build_char_tokenizer(), hidden_size=32, num_layers=1, num_heads=2, seed=0)
    model = model.to(DEVICE)
    batch = tuple(part.to(DEVICE) for part in padded_batch(torch.Generator().manual_seed(0)))
    mask = batch[3].bool()
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) * mask
    suppressed = torch.tensor([5, 9], device=DEVICE)
    options = {"temperature": 0.7, "with_entropy": True, "suppressed_token_ids": suppressed}
    full, full_entropy, full_grads = logps_entropies_and_gradients(model, batch, weights, **options)
    fused, fused_entropy, fused_grads = logps_entropies_and_gradients(
        model, batch, weights, chunk_size=5, head_kernel="triton", **options
    )
    torch.testing.assert_close(fused[mask], full[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_entropy[mask], full_entropy[mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(fused[~mask], torch.zeros_like(fused[~mask]))
    torch.testing.assert_close(fused_grads, full_grads, rtol=1e-5, atol=1e-5 * full_grads.abs().max().item())
    with torch.no_grad():
        no_grad, _ = completion_logps(model, *batch, chunk_size=5, head_kernel="triton", **options)
    assert torch.equal(no_grad, fused)


# ------------------------------------------------------------------------------------------------------ the trainer
@pytest.mark.slow
def test_a_training_step_with_the_triton_head_gives_the_torch_heads_weights(tmp_path, monkeypatch):
    tokenizer = build_char_tokenizer()
    base = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    dataset = Dataset.from_dict({"prompt": ["Say cat:", "Say dog:"]})
    kernel_rows = []
    real_kernel = triton_head.logits_stats

    def counted_kernel(logits, *args, **kwargs):
        kernel_rows.append(len(logits))
        return real_kernel(logits, *args, **kwargs)

    monkeypatch.setattr(triton_head, "logits_stats", counted_kernel)
    weights = {}
    for kernel in ("torch", "triton"):
        # Plain SGD without clipping, whose step is linear in the gradient: equal gradients give equal weights (a
        # gradient scaled throughout, clipping would hide). A temperature and a suppressed token, which the kernels
        # must apply as generation did.
        args = make_config(
            tmp_path / kernel,
            max_steps=1,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,
            logps_head_kernel=kernel,
            temperature=0.8,
            generation_kwargs={"suppress_tokens": [tokenizer.convert_tokens_to_ids("e")]},
            seed=0,
        )
        trainer = TargetPOTrainer(
            copy.deepcopy(base).to(DEVICE),
            letters_then_position_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        assert trainer._step.logps.head_kernel == kernel and trainer._step.logps.chunk_size == 512
        trainer.train()
        weights[kernel] = {name: p.detach().cpu() for name, p in trainer.model.named_parameters()}
    assert kernel_rows  # the triton run's log-probs went through the kernels
    assert any(not torch.equal(p, weights["torch"][name]) for name, p in base.named_parameters())
    for name, torch_weight in weights["torch"].items():
        torch.testing.assert_close(weights["triton"][name], torch_weight, rtol=0, atol=1e-5, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="'auto' picks the Triton head on NVIDIA GPUs only")
def test_on_a_gpu_the_default_head_is_the_triton_one(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0).to(DEVICE)
    trainer = TargetPOTrainer(
        model, letters_then_position_reward, args=make_config(tmp_path), processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": ["Say cat:", "Say dog:"]}),
    )  # fmt: skip
    expected = "triton" if torch.cuda.get_device_capability() >= (8, 0) else "torch"
    assert trainer._step.logps.head_kernel == expected


def test_the_launch_probe_passes_working_kernels_and_names_failing_ones(monkeypatch):
    assert triton_head.launch_problem(DEVICE) is None
    real_stats = triton_head.logits_stats

    def off_by_one(logits, token_ids, temperature):
        stats = real_stats(logits, token_ids, temperature)
        return stats._replace(logps=stats.logps + 1.0)

    monkeypatch.setattr(triton_head, "logits_stats", off_by_one)
    assert "log-probs were 1 off torch's" in triton_head.launch_problem(DEVICE)
    monkeypatch.setattr(triton_head, "logits_stats", real_stats)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(triton_head, "logits_grad_", no_compiler)
    expected = "RuntimeError: Failed to find C compiler. Please specify via CC environment variable."
    assert triton_head.launch_problem(DEVICE) == expected
    # torch before 2.8 has no AcceleratorError (and the module then knows no device fault): the failure is still
    # named, not an AttributeError.
    assert triton_head.DEVICE_FAULTS == ((torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ())
    monkeypatch.delattr(torch, "AcceleratorError", raising=False)
    monkeypatch.setattr(triton_head, "DEVICE_FAULTS", ())
    assert triton_head.launch_problem(DEVICE) == expected
