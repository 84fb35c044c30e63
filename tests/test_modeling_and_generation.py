"""Completion masks, rollouts and the trainer's log-probs against a naive, one-sequence-at-a-time computation."""

import contextlib
import math

import pytest
import torch
from logps_cases import logps_entropies_and_gradients, padded_batch

from targetpo.generation import SamplingSettings, TransformersBackend, completion_masks
from targetpo.modeling.loading import forward_accepts_position_ids
from targetpo.modeling.logps import (
    _head_in_chunks,
    _is_plain_linear_head,
    completion_logps,
    entropy_from_logits,
    supports_chunked_head,
)


def test_completion_masks_stop_after_first_eos():
    eos = 9
    ids = torch.tensor([[1, 2, eos, 0, 0], [1, eos, eos, 3, 0], [1, 2, 3, 4, 5], [eos, 0, 0, 0, 0]])
    masks = completion_masks(ids, [eos])
    assert masks.attention_mask.tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
    ]
    assert masks.truncated.tolist() == [False, False, True, False]
    assert masks.lengths.tolist() == [3, 2, 5, 1]
    assert completion_masks(torch.tensor([[4, 7, 1]]), [7, 4]).lengths.tolist() == [1]  # several EOS ids


def _naive_logps(model, prompt, completion, temperature=1.0, suppressed=()):
    """Log-probs of one unpadded sequence's completion tokens, full vocabulary, positions 0..n-1."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
    if suppressed:
        logits[:, list(suppressed)] = -math.inf
    logps = torch.log_softmax(logits.double(), dim=-1)
    return logps.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def test_batched_logps_match_each_sequence_alone(tiny_model, tokenizer):
    tiny_model.eval()
    pad = tokenizer.pad_token_id
    prompts = [[5, 6, 7, 8], [9, 10]]
    completions = [[11, 12, 13], [14, 15]]
    # Left-padded prompts with a padding column no row uses, right-padded completions with an unused column.
    prompt_ids = torch.tensor([[pad] + prompts[0], [pad, pad, pad] + prompts[1]])
    prompt_mask = (prompt_ids != pad).long()
    completion_ids = torch.tensor([completions[0] + [pad, pad], completions[1] + [pad, pad, pad]])
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])

    with torch.no_grad():
        logps, entropies = completion_logps(
            tiny_model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=0.7, with_entropy=True
        )
        assert logps.shape == entropies.shape == (2, 5)
        for row in range(2):
            n = len(completions[row])
            expected = _naive_logps(tiny_model, prompts[row], completions[row], temperature=0.7)
            assert torch.allclose(logps[row, :n].double(), expected, atol=1e-5)
        assert torch.all(entropies[completion_mask.bool()] > 0)
        assert torch.all(entropies[completion_mask.bool()] <= math.log(len(tokenizer)) + 1e-5)


def test_suppressed_tokens_get_no_probability(tiny_model):
    tiny_model.eval()
    allowed = [5, 6]
    suppressed = [i for i in range(tiny_model.config.vocab_size) if i not in allowed]
    prompt_ids = torch.tensor([[7, 8, 9]])
    completion_ids = torch.tensor([[5, 6, 6]])
    mask = torch.ones_like(completion_ids)
    with torch.no_grad():
        logps, entropies = completion_logps(
            tiny_model, prompt_ids, torch.ones_like(prompt_ids), completion_ids, mask, with_entropy=True,
            suppressed_token_ids=torch.tensor(suppressed),
        )
        expected = _naive_logps(tiny_model, [7, 8, 9], [5, 6, 6], suppressed=suppressed)
    assert torch.allclose(logps[0].double(), expected, atol=1e-5)
    assert torch.all(entropies <= math.log(2) + 1e-6) and torch.isfinite(entropies).all()


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_chunked_logps_equal_the_full_logits_path(tiny_model, dtype, atol, chunk_size):
    model = tiny_model.to(dtype)
    batch = padded_batch(torch.Generator().manual_seed(0))
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch
    kwargs = dict(temperature=0.7, with_entropy=True, suppressed_token_ids=torch.tensor([4, 9, 11]))
    mask = completion_mask.bool()
    weights = torch.rand(completion_mask.shape, generator=torch.Generator().manual_seed(1)) * completion_mask

    full_logps, full_entropy, full_grads = logps_entropies_and_gradients(model, batch, weights, chunk_size=None, **kwargs)
    logps, entropies, grads = logps_entropies_and_gradients(model, batch, weights, chunk_size=chunk_size, **kwargs)
    assert logps.dtype == torch.float32 and logps.shape == completion_ids.shape
    assert torch.allclose(logps[mask], full_logps[mask], atol=atol)
    assert torch.allclose(entropies[mask], full_entropy[mask], atol=atol)
    assert torch.equal(logps[~mask], torch.zeros_like(logps[~mask]))  # padding positions are skipped, read as 0
    assert torch.allclose(grads, full_grads, atol=atol * max(1.0, full_grads.abs().max().item()))

    # Without autograd (old and reference log-probs) the values are the same.
    with torch.no_grad():
        no_grad_logps, _ = completion_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                            chunk_size=chunk_size, **kwargs)
    assert torch.equal(no_grad_logps, logps)


def test_chunked_head_only_where_logits_are_the_plain_head_output(tiny_model):
    assert supports_chunked_head(tiny_model)
    tiny_model.config.final_logit_softcapping = 30.0  # logits post-processed after the head: not chunkable
    assert not supports_chunked_head(tiny_model)


def tiny_bert_family_decoder(tokenizer, architecture):
    """A BERT-family ``*ForCausalLM`` model from a config: its prediction head transforms the final hidden states
    (dense, activation, LayerNorm) before the ``Linear`` that ``get_output_embeddings()`` gives."""
    from transformers import BertConfig, BertLMHeadModel, RobertaConfig, RobertaForCausalLM

    config_class, model_class = {"bert": (BertConfig, BertLMHeadModel), "roberta": (RobertaConfig, RobertaForCausalLM)}[
        architecture
    ]
    config = config_class(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=160, is_decoder=True, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return model_class(config)


@pytest.mark.parametrize("architecture", ["bert", "roberta"])
def test_a_head_that_transforms_the_hidden_states_first_gets_the_full_logits_with_a_warning(
    tmp_path, tokenizer, architecture
):
    """The chunked, Triton and Liger heads apply only ``get_output_embeddings()`` to the final hidden states, which
    skips a BERT-family prediction head's transform: a probe of the model's own logits (once per model) finds it,
    the trainer computes its log-probs from the full logits, as ``log_softmax(model(...).logits)``, and says so."""
    import reference as ref
    from conftest import count_letters_reward, make_config
    from datasets import Dataset

    from targetpo import TargetPOTrainer
    from targetpo.modeling.logps import liger_head_problem, triton_head_problem

    model = tiny_bert_family_decoder(tokenizer, architecture)
    name = type(model).__name__
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    assert not supports_chunked_head(model) and not supports_chunked_head(model)
    assert len(calls) == 1  # the probe's forward pass runs once per model, whatever asks
    assert "not its output head (Linear) applied to its final hidden states" in triton_head_problem(model)
    assert "not its output head" in liger_head_problem(model)

    args = make_config(tmp_path, logps_chunk_size=512)  # asked for: the default
    dataset = Dataset.from_dict({"prompt": ["Say cat:", "Say dog:"]})
    announced = rf"logps_chunk_size=512: {name}'s log-probs are computed from one full logits tensor.*not its output"
    with pytest.warns(UserWarning, match=announced):
        trainer = TargetPOTrainer(
            model, count_letters_reward, args=args, train_dataset=dataset, processing_class=tokenizer
        )
    assert trainer._step.logps.chunk_size is None
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    inputs = [batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_attention_mask")]
    mask = inputs[3].bool()
    model.eval()  # no dropout: the two computations see the same network
    with torch.no_grad():
        got = trainer._step.logps(model, batch).per_token
        expected, _ = ref.token_logps(model, *inputs)
        chunked, _ = completion_logps(model, *inputs, chunk_size=512)  # what the chunked head would have given
    assert torch.allclose(got[mask], expected[mask], atol=1e-5)
    assert (chunked[mask] - expected[mask]).abs().max() > 0.05  # the values the probe keeps out


def test_a_plain_head_keeps_the_chunked_head_without_a_warning(tmp_path, tiny_model, tokenizer):
    import warnings

    import reference as ref
    from conftest import count_letters_reward, make_config
    from datasets import Dataset

    from targetpo import TargetPOTrainer

    args = make_config(tmp_path, logps_chunk_size=512)
    dataset = Dataset.from_dict({"prompt": ["Say cat:", "Say dog:"]})
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*logps_chunk_size")
        trainer = TargetPOTrainer(
            tiny_model, count_letters_reward, args=args, train_dataset=dataset, processing_class=tokenizer
        )
    assert trainer._step.logps.chunk_size == 512
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    inputs = [batch[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_attention_mask")]
    mask = inputs[3].bool()
    with torch.no_grad():
        got = trainer._step.logps(tiny_model, batch).per_token
        expected, _ = ref.token_logps(tiny_model, *inputs)
    assert torch.allclose(got[mask], expected[mask], atol=1e-5)


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["entropy-metric", "entropy-bonus"])
def test_the_linear_heads_gradient_is_the_closed_form(entropy_grad):
    """The chunked head's hand-written backward pass against d log p_y / dz = onehot(y) - p and
    dH / dz = -p (log p + H), divided by the temperature, none for suppressed tokens (worked out in float64)."""
    generator = torch.Generator().manual_seed(0)
    rows, width, vocab, temperature, suppressed = 9, 6, 11, 0.7, torch.tensor([2, 7])
    head = torch.nn.Linear(width, vocab)
    hidden = torch.randn(rows, width, generator=generator, requires_grad=True)
    tokens = torch.tensor([0, 1, 3, 4, 5, 6, 8, 9, 7])  # the last one suppressed: log p = -inf, no gradient
    logp_grad, entropy_grad_in = torch.randn(2, rows, generator=generator)
    assert _is_plain_linear_head(head)

    # Chunks of 4 rows, through the path training takes: the written-out backward pass.
    logps, entropies = _head_in_chunks(head, hidden, tokens, temperature, suppressed, 4, True, entropy_grad)
    assert logps.grad_fn.next_functions[0][0].name() == "_LinearHeadLogpsBackward"
    loss = (torch.where(torch.isfinite(logps), logps, 0) * logp_grad).sum()
    (loss + ((entropies * entropy_grad_in).sum() if entropy_grad else 0)).backward()

    with torch.no_grad():
        weight, bias, x = head.weight.double(), head.bias.double(), hidden.double()
        z = (x @ weight.T + bias) / temperature
        z[:, suppressed] = -math.inf
        log_p = z.log_softmax(-1)
        p = log_p.exp()
        entropy = -(p * log_p.nan_to_num(neginf=0.0)).sum(-1)
        g = logp_grad.double()
        g[-1] = 0  # the suppressed token's -inf left out of the loss
        dz = g[:, None] * (torch.nn.functional.one_hot(tokens, vocab) - p)
        if entropy_grad:
            dz -= entropy_grad_in.double()[:, None] * p * (log_p.nan_to_num(neginf=0.0) + entropy[:, None])
        dz[:, suppressed] = 0
        dz /= temperature

    def close(actual, expected):
        torch.testing.assert_close(actual, expected.float(), rtol=1e-5, atol=1e-6)

    close(logps[:-1], log_p.gather(-1, tokens[:, None]).squeeze(-1)[:-1])
    assert logps[-1] == -math.inf
    close(entropies, entropy)
    close(hidden.grad, dz @ weight)
    close(head.weight.grad, dz.T @ x)
    close(head.bias.grad, dz.sum(0))


def test_under_autocast_the_written_out_head_computes_as_the_linear_layer_would():
    """Float32 master weights under bf16 autocast (``bf16=True``): the head's matrix products run in bf16, as
    ``nn.Linear``'s do, forward and backward; its log-probs, entropies and gradients (float32, in the weights' dtype)
    equal autograd's through the layer under the same autocast."""
    generator = torch.Generator().manual_seed(0)
    rows, width, vocab, temperature, suppressed = 24, 16, 300, 0.7, torch.tensor([2, 7])
    head = torch.nn.Linear(width, vocab)
    torch.nn.init.normal_(head.weight, generator=generator)  # logits of a few units: bf16 rounding shows in them
    torch.nn.init.normal_(head.bias, generator=generator)
    hidden = torch.randn(rows, width, generator=generator)
    tokens = torch.tensor([token + 1 if token in (2, 7) else token for token in range(0, 10 * rows, 10)])
    logp_grad, entropy_grad_in = torch.randn(2, rows, generator=generator)

    def computed(by_hand):
        head.zero_grad()
        x = hidden.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if by_hand:  # autograd through the layer, as the model's own forward computes its head
                log_p = (head(x).float() / temperature).index_fill(-1, suppressed, -math.inf).log_softmax(-1)
                logps = log_p.gather(-1, tokens[:, None]).squeeze(-1)
                entropies = -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)
            else:  # the written-out backward pass, in chunks of 8 rows
                logps, entropies = _head_in_chunks(head, x, tokens, temperature, suppressed, 8, True, True)
                assert logps.grad_fn.next_functions[0][0].name() == "_LinearHeadLogpsBackward"
        ((logps * logp_grad).sum() + (entropies * entropy_grad_in).sum()).backward()
        return logps.detach(), entropies.detach(), x.grad, head.weight.grad.clone(), head.bias.grad.clone()

    logps, entropies, hidden_grad, weight_grad, bias_grad = computed(by_hand=False)
    expected = computed(by_hand=True)
    assert weight_grad.dtype == bias_grad.dtype == hidden_grad.dtype == torch.float32
    torch.testing.assert_close(logps, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies, expected[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden_grad, expected[2], rtol=1e-5, atol=1e-5)
    for actual, reference in ((weight_grad, expected[3]), (bias_grad, expected[4])):
        # Each chunk's gradient is rounded to bf16 before they add up (autograd rounds the sum once): one bf16 step
        # apart. A float32 backward pass is tens of steps off.
        assert (actual - reference).abs().max() < 1e-2 * reference.abs().max()
    with torch.no_grad():  # the same head in float32 (autocast ignored) is far off
        logits = (hidden @ head.weight.T + head.bias) / temperature
        in_float32 = logits.index_fill(-1, suppressed, -math.inf).log_softmax(-1).gather(-1, tokens[:, None])
    assert (in_float32.squeeze(-1) - logps).abs().max() > 1e-2


def test_the_written_out_head_keeps_float32_entropies_of_sharp_distributions_exact():
    # Large logits over a large vocabulary: lse - sum(p z) would cancel away float32 digits; -sum(p log p) does not.
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 20000, bias=False)
    torch.nn.init.normal_(head.weight, std=3.0, generator=generator)
    hidden = torch.randn(6, 8, generator=generator, requires_grad=True)
    _, entropies = _head_in_chunks(head, hidden, torch.zeros(6, dtype=torch.long), 1.0, None, 6, True, False)
    with torch.no_grad():
        log_p = (hidden.double() @ head.weight.double().T).log_softmax(-1)
        expected = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(entropies, expected.float(), rtol=1e-5, atol=2e-6)


def test_only_a_plain_linear_head_without_hooks_takes_the_written_out_backward_pass(tiny_model):
    # Adapters, quantised layers, sharded or offloaded weights and hooks change what the module computes from its
    # weight, or where the weight is: such heads are called as modules, under activation checkpointing.
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    head = tiny_model.get_output_embeddings()
    assert _is_plain_linear_head(head)
    for register in (head.register_forward_pre_hook, head.register_full_backward_hook):
        handle = register(lambda *args: None)  # as DeepSpeed ZeRO-3 gathers weights in forward hooks
        assert not _is_plain_linear_head(head)
        handle.remove()
    add_hook_to_module(head, ModelHook())  # accelerate's dispatch and offloading replace forward
    assert not _is_plain_linear_head(head)
    remove_hook_from_module(head)
    assert _is_plain_linear_head(head)

    class Adapted(torch.nn.Linear):
        pass

    assert not _is_plain_linear_head(Adapted(4, 5))
    hidden = torch.randn(3, 4, requires_grad=True)
    logps, _ = _head_in_chunks(Adapted(4, 5), hidden, torch.tensor([0, 1, 2]), 1.0, None, 3, True, False)
    assert logps.grad_fn.next_functions[0][0].name() != "_LinearHeadLogpsBackward"


def test_entropy_of_uniform_and_peaked_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, -math.inf]]])
    entropy = entropy_from_logits(logits)
    assert torch.allclose(entropy, torch.tensor([[math.log(4), 0.0]]), atol=1e-6)


def test_generator_samples_from_allowed_tokens_and_respects_length(tiny_model, tokenizer):
    allowed = {tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b"), tokenizer.eos_token_id}
    settings = SamplingSettings(
        max_new_tokens=5,
        eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        generation_kwargs={"suppress_tokens": [i for i in range(len(tokenizer)) if i not in allowed]},
    )
    generator = TransformersBackend(settings, lambda: contextlib.nullcontext(tiny_model))
    encoded = tokenizer(["Say:", "Say it:"] * 4, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(0)
    tiny_model.train()
    completions = generator.generate(encoded["input_ids"], encoded["attention_mask"])
    assert tiny_model.training  # the mode is restored
    assert completions.ids.shape[0] == 8 and completions.ids.shape[1] <= 5
    for row, length in zip(completions.ids, completions.lengths):
        assert set(row[:length].tolist()) <= allowed
    assert torch.equal(completions.loss_mask, completions.attention_mask)  # every generated token is trained on
    assert forward_accepts_position_ids(tiny_model)


# ------------------------------------------------------------------------------ logps_head_kernel="auto"
# No GPU here: the CUDA device's capability and the kernels' launch are stood in for (monkeypatched); the choice
# around them is what is checked. Whether the kernels run on a GPU is tests/scripts/triton_head_checks.py's part.
def test_auto_picks_the_triton_head_only_on_an_nvidia_gpu_where_it_runs_and_applies(monkeypatch):
    import importlib.util

    import targetpo.step.forward as policy_logps_module
    from targetpo.step.forward import auto_head_kernel

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    capability, launch = (9, 0), None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    triton_found = importlib.util.find_spec("triton") is not None
    if triton_found:
        from targetpo.modeling import triton_head

        monkeypatch.setattr(triton_head, "launch_problem", lambda device: launch)
    assert auto_head_kernel(cuda, liger=False, triton_problem=None) == ("triton" if triton_found else "torch")
    assert auto_head_kernel(cpu, liger=False, triton_problem=None) == "torch"  # the interpreter would be far slower
    assert auto_head_kernel(cuda, liger=True, triton_problem=None) == "torch"  # Liger computes the log-probs
    assert auto_head_kernel(cuda, liger=False, triton_problem="the weights are sharded") == "torch"
    capability = (7, 5)  # before Ampere: never measured
    assert auto_head_kernel(cuda, liger=False, triton_problem=None) == "torch"
    capability = (8, 0)
    if triton_found:
        launch = "RuntimeError: Failed to find C compiler"
        with pytest.warns(UserWarning, match="'auto': torch computes the output head .*Failed to find C compiler"):
            assert auto_head_kernel(cuda, liger=False, triton_problem=None) == "torch"
        launch = None
    monkeypatch.setattr(policy_logps_module.importlib.util, "find_spec", lambda name: None)  # no Triton installed
    assert auto_head_kernel(cuda, liger=False, triton_problem=None) == "torch"
    monkeypatch.undo()
    monkeypatch.setattr(torch.version, "hip", "6.4")  # ROCm: the kernels were never measured on AMD GPUs
    assert auto_head_kernel(cuda, liger=False, triton_problem=None) == "torch"


def test_the_trainer_resolves_auto_from_the_model_and_the_settings(tiny_model, monkeypatch):
    import warnings

    import targetpo.step.forward as policy_logps_module
    from targetpo.step.forward import PolicyLogps

    asked = []

    def spy(device, liger, triton_problem):
        asked.append((device.type, liger, triton_problem))
        return "torch"

    monkeypatch.setattr(policy_logps_module, "auto_head_kernel", spy)

    def settings(chunk_size=512, liger=False, head_kernel="auto"):
        return PolicyLogps.for_model(
            tiny_model, tiny_model, 1.0, set(), torch.device("cpu"), False, liger, chunk_size, rows_per_pass=8,
            head_kernel=head_kernel,
        )  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" choosing torch says nothing
        settings()
        settings(chunk_size=0)
        settings(liger=True)
        settings(head_kernel="torch")  # a named kernel is not "auto"'s to choose
    assert asked == [
        ("cpu", False, None),
        ("cpu", False, "logps_chunk_size=0 asks for one full logits tensor, computed by the model"),
        ("cpu", True, None),
    ]
    monkeypatch.undo()
    assert settings().head_kernel == "torch"  # the real choice on the CPU


def test_the_default_trainer_computes_the_head_with_torch_on_the_cpu(tmp_path, tiny_model, tokenizer):
    from conftest import count_letters_reward, make_config
    from datasets import Dataset

    from targetpo import TargetPOConfig, TargetPOTrainer

    assert TargetPOConfig(output_dir=str(tmp_path)).logps_head_kernel == "auto"
    make_config(tmp_path, use_liger_kernel=True)  # "auto" leaves the head to Liger; "triton" is refused with it
    dataset = Dataset.from_dict({"prompt": ["Say cat:", "Say dog:"]})
    trainer = TargetPOTrainer(
        tiny_model, count_letters_reward, args=make_config(tmp_path), train_dataset=dataset, processing_class=tokenizer
    )
    assert trainer._step.logps.head_kernel == "torch"
