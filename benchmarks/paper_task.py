"""The TPO paper's terminal-reward task as its JAX reference sets it up, built from Hugging Face parts: the prompts,
the exact-match error, the model and its initialisation, and the optimiser. Nothing here knows a trainer.

The reference (JeanKaddour/tpo, ``src/tpo``) and what each piece follows:

- Task (``experiments/_trial.py``): a prompt is H bits drawn uniformly and independently, fed with no separator; the
  target is the prompt reversed; V = 2, so the model reads and writes only the two bits; reward 1 only for the exact
  reversal (terminal).
- Exact-match error: the share of a step's B x K sampled completions (temperature 1) with any wrong bit
  (``1 - reward.mean()`` per step); the paper reports it at the last step.
- Model (``models.py``, ``config.py``): a pre-norm causal transformer, d_model 64, 2 layers, 2 heads, MLP 4 x 64 with
  tanh-approximated GELU, learned positions for the 2H tokens, LayerNorm (epsilon 1e-6), a final LayerNorm and a
  dense output head over the 2 tokens; Flax's initialisers.
- Optimiser (``_trial.py``: ``optax.contrib.muon(learning_rate=1e-4 * 10)``, optax 0.2.8): Muon on every 2-D
  parameter, Adam with Nesterov momentum on the rest, both at 1e-3, no weight decay, no clipping, no schedule. The
  2-D parameters of the Flax model are the embeddings, the positions, the MLP and output kernels and the attention's
  q, k and v biases (heads x head size); its attention kernels are 3-D, so Adam's.

The model is a ``GPT2LMHeadModel``, the Hugging Face architecture with this shape (pre-norm, learned positions, tanh
GELU, biases in attention and MLP), with a vocabulary of the two bits and re-initialised as Flax initialises the
reference. With the reference's weights copied in, its log-probs are the reference's (within 2e-6), and after a few
steps of :class:`OptaxMuon` from :func:`reference_optimizer` they still are (within 1e-4) those of the Flax model
after as many steps of optax's Muon (the head's bias held at 0). What differs: its output head has no bias (the
reference's has one, 2 parameters, initialised at 0) and its attention projects q, k, v with one fused matrix. The
tokenizer also holds <pad>, <eos> and <unk>, after the bits, for the trainers' bookkeeping; the model never reads or
writes them (every prompt has H tokens, every completion H bits).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
from datasets import Dataset
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from transformers.pytorch_utils import Conv1D

from targetpo.demo import build_char_tokenizer, reverse_task_dataset

BITS = "01"  # the token ids of the bits are their values: "0" is 0, "1" is 1
D_MODEL, NUM_LAYERS, NUM_HEADS, MLP_MULTIPLE = 64, 2, 2, 4
LEARNING_RATE = 1e-3
#: A teacher-forced pass over every prompt while there are at most this many (H <= 12).
MAX_EVAL_PROMPTS = 4096


# ------------------------------------------------------------------------------------------------ task and metric
def bit_tokenizer() -> PreTrainedTokenizerFast:
    """One token per bit, with ids 0 and 1; <pad>, <eos> and <unk> after them."""
    return build_char_tokenizer(BITS, chat_template=None, special_tokens_last=True)


def paper_prompts(length: int, num_prompts: int, seed: int) -> Dataset:
    """``num_prompts`` prompts of ``length`` uniform bits, no separator, with the reversed bits as ``target``."""
    return reverse_task_dataset(length, num_prompts, seed=seed, separator="")


def exact_match_error(completions: Sequence[str], targets: Sequence[str]) -> float:
    """Exact-match error (%): the share of completions that differ from their target anywhere."""
    wrong = sum(completion != target for completion, target in zip(completions, targets, strict=True))
    return 100.0 * wrong / len(completions)


def bit_strings(length: int, max_count: int = MAX_EVAL_PROMPTS, seed: int = 0) -> torch.Tensor:
    """``(N, length)`` token ids: every string of ``length`` bits while there are at most ``max_count``, else
    ``max_count`` strings drawn uniformly."""
    if 2**length <= max_count:
        powers = 2 ** torch.arange(length - 1, -1, -1)
        return (torch.arange(2**length)[:, None] // powers) % 2
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (max_count, length), generator=generator)


@torch.no_grad()
def expected_exact_match_error(
    model: nn.Module,
    length: int,
    logits_processor: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    max_prompts: int = MAX_EVAL_PROMPTS,
) -> float:
    """The exact-match error (%) that one completion sampled at temperature 1 for a uniform prompt has in expectation:
    100 x (1 - the mean over prompts of the probability of the exact reversal), from one teacher-forced pass.

    This is what the paper's per-step error estimates from B x K samples, without the sampling noise. Every prompt
    is used up to ``max_prompts`` of them (H <= 12), else that many drawn uniformly. ``logits_processor`` (a
    ``transformers`` LogitsProcessor) reshapes each step's logits as it would in ``generate``.
    """
    prompts = bit_strings(length, max_prompts).to(model.device)
    sequences = torch.cat([prompts, prompts.flip(1)], dim=1)
    logits = model(input_ids=sequences).logits[:, length - 1 : -1].float()
    if logits_processor is not None:
        steps = [logits_processor(sequences[:, : length + t], logits[:, t]) for t in range(length)]
        logits = torch.stack(steps, dim=1)
    logps = logits.log_softmax(-1).gather(-1, sequences[:, length:, None]).squeeze(-1)
    return 100.0 * (1.0 - logps.sum(-1).exp().mean().item())


# ------------------------------------------------------------------------------------------------ model
def reference_model(length: int, seed: int) -> GPT2LMHeadModel:
    """The reference's transformer for strings of ``length`` bits, with weights drawn as Flax draws them."""
    config = GPT2Config(
        vocab_size=len(BITS),
        n_positions=2 * length,
        n_embd=D_MODEL,
        n_layer=NUM_LAYERS,
        n_head=NUM_HEADS,
        n_inner=MLP_MULTIPLE * D_MODEL,
        activation_function="gelu_pytorch_tanh",  # Flax's nn.gelu approximates with tanh by default; one fused op
        layer_norm_epsilon=1e-6,  # Flax's LayerNorm default
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
        initialise_as_flax(model)
    return model


def _lecun_normal_(weight: torch.Tensor, fan_in: int) -> None:
    """Flax's default kernel initialiser: a normal truncated at 2 sigma, rescaled to variance 1 / fan_in."""
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # the std of a unit normal truncated at +-2
    nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


@torch.no_grad()
def initialise_as_flax(model: GPT2LMHeadModel) -> None:
    """Draw the weights as the reference's Flax modules do: token embeddings N(0, 1/d), positions N(0, 0.02^2),
    kernels LeCun normal, biases 0, LayerNorm scale 1 and offset 0."""
    embeddings, positions = model.transformer.wte.weight, model.transformer.wpe.weight
    nn.init.normal_(embeddings, std=1.0 / math.sqrt(embeddings.shape[1]))
    nn.init.normal_(positions, std=0.02)
    for module in model.modules():
        if isinstance(module, Conv1D):  # weight (in, out)
            _lecun_normal_(module.weight, fan_in=module.weight.shape[0])
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Linear):  # weight (out, in)
            _lecun_normal_(module.weight, fan_in=module.weight.shape[1])
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


# ------------------------------------------------------------------------------------------------ optimiser
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(matrices: torch.Tensor, steps: int = 5, eps: float = 1e-8) -> torch.Tensor:
    """Muon's approximate orthogonalisation of each matrix in ``(..., rows, columns)``: scaled to Frobenius norm 1,
    then ``steps`` quintic Newton-Schulz iterations (on the wide orientation)."""
    a, b, c = NS_COEFFICIENTS
    tall = matrices.shape[-2] > matrices.shape[-1]
    x = matrices.mT if tall else matrices
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def _nesterov(momentum: torch.Tensor, grad: torch.Tensor, beta: float, step: int) -> torch.Tensor:
    """Optax's bias-corrected Nesterov moment: beta m / (1 - beta^(t+1)) + (1 - beta) g / (1 - beta^t)."""
    return beta * momentum / (1 - beta ** (step + 1)) + (1 - beta) * grad / (1 - beta**step)


class OptaxMuon(torch.optim.Optimizer):
    """``optax.contrib.muon`` (0.2.8) with its defaults: on a group with a ``muon_scale``, Muon (momentum 0.95,
    Nesterov, 5 Newton-Schulz steps on the parameter viewed as ``muon_shape``, a batch of matrices, the update times
    ``muon_scale``); on the others, Adam with Nesterov momentum (0.9, 0.999, eps 1e-8). No weight decay.

    Written out rather than ``torch.optim.Muon``: that one takes 2-D parameters only, with its own learning-rate
    scaling, bias correction and no Adam for the rest, while the paper's runs depend on optax's choices (its bias-
    corrected Nesterov moment, its scale, the q/k/v biases orthogonalised per head, Nesterov Adam elsewhere)."""

    def __init__(self, groups: Iterable[dict], lr: float = LEARNING_RATE):
        defaults = dict(lr=lr, muon_scale=None, muon_shape=None, beta=0.95, adam_betas=(0.9, 0.999), eps=1e-8,
                        ns_steps=5)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(self._update(param, group), alpha=-group["lr"])

    def _update(self, param: torch.Tensor, group: dict) -> torch.Tensor:
        grad, state = param.grad.float(), self.state[param]
        if not state:
            state["step"], state["momentum"] = 0, torch.zeros_like(grad)
            if group["muon_scale"] is None:
                state["second_moment"] = torch.zeros_like(grad)
        state["step"] += 1
        step, momentum = state["step"], state["momentum"]
        if group["muon_scale"] is not None:
            momentum.lerp_(grad, 1 - group["beta"])
            direction = _nesterov(momentum, grad, group["beta"], step).view(group["muon_shape"] or grad.shape)
            orthogonal = newton_schulz(direction, group["ns_steps"], group["eps"]).view(grad.shape)
            return group["muon_scale"] * orthogonal
        beta1, beta2 = group["adam_betas"]
        momentum.lerp_(grad, 1 - beta1)
        second = state["second_moment"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        return _nesterov(momentum, grad, beta1, step) / ((second / (1 - beta2**step)).sqrt() + group["eps"])


def _muon_group(name: str, module: nn.Module, param: torch.Tensor) -> dict:
    """The optimiser group of one parameter, as optax's Muon treats the reference's counterpart: Muon where that is a
    matrix, scaled by sqrt(max(1, fan_out / fan_in)) of its (in, out) layout; Adam where it is not."""
    group = {"params": [param], "name": name}
    if name.endswith("attn.c_attn.bias"):  # the reference's q, k and v biases are (heads, head size) matrices
        head_size = D_MODEL // NUM_HEADS
        group.update(muon_shape=(3, NUM_HEADS, head_size), muon_scale=math.sqrt(max(1.0, head_size / NUM_HEADS)))
    elif param.ndim == 2 and ".attn." not in name:  # attention kernels are 3-D there: Adam's
        fan_out, fan_in = param.shape if isinstance(module, nn.Linear) else param.shape[::-1]
        group.update(muon_scale=math.sqrt(max(1.0, fan_out / fan_in)))
    return group


def reference_optimizer(model: GPT2LMHeadModel, learning_rate: float = LEARNING_RATE) -> OptaxMuon:
    """The reference's optimiser on this model. Muon on what the reference holds as matrices: the embeddings, the
    positions, the MLP and output kernels, and the attention's q, k, v biases (heads x head size); Adam on the rest,
    including the attention kernels, which the reference's Flax attention holds as 3-D arrays."""
    groups = [
        _muon_group(f"{name}.{param_name}", module, param)
        for name, module in model.named_modules()
        for param_name, param in module.named_parameters(recurse=False)
    ]
    return OptaxMuon(groups, lr=learning_rate)
