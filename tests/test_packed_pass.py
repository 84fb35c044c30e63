"""padding_free: rows packed into one row give the padded pass's log-probs, entropies, gradients and training steps;
models and rows that cannot be packed exactly keep the padded rows, with a warning saying why."""

import copy
import warnings

import pytest
import torch
from conftest import make_config
from datasets import Dataset
from test_trainer_values import few_letters
from test_vision import image_dataset, letters_reward
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from vlm_models import build_tiny_idefics3

import targetpo.step.forward as policy_logps_module
from targetpo import TargetPOTrainer
from targetpo.demo import build_tiny_causal_lm
from targetpo.modeling.logps import completion_logps, packed_completion_logps
from targetpo.modeling.packing import gpu_packing_cost, model_packing_problem, pack_rows
from targetpo.step.forward import PolicyLogps

VOCAB = 64
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
#: Completion lengths from 1 token to the whole width, prompts from 1 token to the whole width.
COMPLETION_LENGTHS = [1, 12, 5, 2, 9, 7]
PROMPT_LENGTHS = [6, 1, 3, 6, 4, 2]


def tiny(architecture, attention="sdpa", seed=0):
    """A float32 model of a few thousand weights, built from its config."""
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        architecture
    ]
    torch.manual_seed(seed)
    return model_class(config_class(**SIZES, attn_implementation=attention)).float()


def spread_batch(seed=0):
    """Left-padded prompts and right-padded completions of the lengths above."""
    generator = torch.Generator().manual_seed(seed)
    rows, prompt_width, completion_width = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), max(COMPLETION_LENGTHS)
    prompt_ids = torch.randint(3, VOCAB, (rows, prompt_width), generator=generator)
    completion_ids = torch.randint(3, VOCAB, (rows, completion_width), generator=generator)
    columns = torch.arange(prompt_width)
    prompt_mask = (columns >= prompt_width - torch.tensor(PROMPT_LENGTHS).unsqueeze(1)).long()
    completion_mask = (torch.arange(completion_width) < torch.tensor(COMPLETION_LENGTHS).unsqueeze(1)).long()
    return prompt_ids * prompt_mask, prompt_mask, completion_ids * completion_mask, completion_mask


def logps_entropies_and_gradients(kernel, model, batch, **options):
    """Log-probs, entropies and the flat weight gradient of a loss on both (an entropy bonus's gradient included)."""
    weights = torch.rand(batch[3].shape, generator=torch.Generator().manual_seed(1))
    mask = batch[3].bool()
    model.zero_grad()
    logps, entropies = kernel(model, *batch, with_entropy=True, entropy_grad=True, **options)
    loss = torch.where(mask, weights * logps - 0.1 * entropies, torch.zeros_like(logps)).sum()
    loss.backward()
    grads = torch.cat([parameter.grad.flatten() for parameter in model.parameters()])
    return logps.detach(), entropies.detach(), grads


def test_a_packed_row_holds_each_rows_read_tokens_with_positions_from_zero():
    prompt_ids = torch.tensor([[0, 7, 8], [5, 6, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[11, 0, 0], [12, 13, 14]])
    completion_mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    packed = pack_rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert packed.input_ids.tolist() == [[7, 8, 11, 5, 6, 9, 12, 13, 14]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5]]
    assert packed.predicting.tolist() == [1, 5, 6, 7]  # the token before each completion token


@pytest.mark.parametrize("chunk_size", [None, 5], ids=["full-logits", "chunked-head"])
@pytest.mark.parametrize("architecture, attention", [("qwen2", "sdpa"), ("qwen2", "eager"), ("llama", "sdpa")])
def test_packed_logps_entropies_and_gradients_equal_the_padded_pass(architecture, attention, chunk_size):
    model = tiny(architecture, attention)
    batch = spread_batch()
    mask = batch[3].bool()
    # Tokens 1 and 2, never in the rows, as a sampler that suppressed them would have it.
    options = {"temperature": 0.7, "suppressed_token_ids": torch.tensor([1, 2]), "chunk_size": chunk_size}
    padded = logps_entropies_and_gradients(completion_logps, model, batch, **options)
    packed = logps_entropies_and_gradients(packed_completion_logps, model, batch, **options)
    for padded_values, packed_values in zip(padded[:2], packed[:2]):
        assert (packed_values[mask] - padded_values[mask]).abs().max() < 1e-5
        assert torch.equal(packed_values[~mask], torch.zeros_like(packed_values[~mask]))  # outside the mask: 0
    assert padded[2].abs().max() > 1e-2  # a gradient worth comparing
    assert (packed[2] - padded[2]).abs().max() < 1e-5
    # Without autograd (the old and reference log-probs), the same values.
    with torch.no_grad():
        no_grad_logps, _ = packed_completion_logps(model, *batch, **options)
    assert torch.equal(no_grad_logps, packed[0])


def test_a_routers_load_balancing_loss_is_the_padded_passs():
    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        **SIZES,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
    )
    model = Qwen2MoeForCausalLM(config)
    batch = spread_batch()
    padded = completion_logps(model, *batch, router_aux_loss=True)
    packed = packed_completion_logps(model, *batch, router_aux_loss=True)
    assert (packed[0] - padded[0])[batch[3].bool()].abs().max() < 1e-5
    assert padded[2] > 0 and abs(packed[2].item() - padded[2].item()) < 1e-5


def policy_logps(padding_free, chunk_size=None):
    return PolicyLogps(1.0, torch.tensor([], dtype=torch.long), True, chunk_size, False, 8, padding_free)


def cannot_pack_opt():
    torch.manual_seed(0)
    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            max_position_embeddings=64,
        )
    )


def cannot_pack_mamba():
    torch.manual_seed(0)
    return MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2))


def cannot_pack_qwen3_next():
    torch.manual_seed(0)
    return Qwen3NextForCausalLM(
        Qwen3NextConfig(
            **{**SIZES, "num_hidden_layers": 4},
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        )
    )


@pytest.mark.parametrize(
    "build, reason",
    [
        (cannot_pack_opt, "lets a packed sequence attend to the one before it"),  # its mask ignores the position ids
        (cannot_pack_mamba, "takes no position ids"),
        (cannot_pack_qwen3_next, "linear_attention layers"),
    ],
    ids=["opt", "mamba", "qwen3-next"],
)
def test_a_model_that_cannot_pack_keeps_the_padded_rows_and_says_why_once(build, reason):
    model = build().eval()  # without dropout: two passes compute the same
    batch = dict(zip(policy_logps_module.ROW_TENSORS, spread_batch()))
    padded = policy_logps(padding_free=False)
    packing = policy_logps(padding_free=True)
    with pytest.warns(UserWarning, match=f"padding_free: .* padded rows, not packed ones, because .*{reason}"):
        logps = packing(model, batch).per_token
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        again = packing(model, batch).per_token
    expected = padded(model, batch).per_token
    assert torch.equal(logps, expected) and torch.equal(again, expected)


def test_the_packing_check_leaves_each_modules_mode_as_it_was():
    model = tiny("llama").train()
    model.model.layers[0].eval()  # a part held in eval mode stays so
    modes = [module.training for module in model.modules()]
    assert model_packing_problem(model) is None
    assert [module.training for module in model.modules()] == modes
    assert all(parameter.grad is None for parameter in model.parameters())


def test_rows_that_do_not_read_one_run_of_tokens_keep_the_padded_rows():
    model = tiny("qwen2")
    prompt_ids, prompt_mask, completion_ids, completion_mask = spread_batch()
    prompt_mask = prompt_mask.clone()
    prompt_mask[1] = 0  # a prompt of no tokens: nothing predicts its first completion token
    batch = dict(zip(policy_logps_module.ROW_TENSORS, (prompt_ids, prompt_mask, completion_ids, completion_mask)))
    with pytest.warns(UserWarning, match="a row does not read one run of tokens"):
        logps = policy_logps(padding_free=True, chunk_size=4)(model, batch).per_token
    assert torch.equal(logps, policy_logps(padding_free=False, chunk_size=4)(model, batch).per_token)


def test_prompts_with_images_keep_the_padded_rows(tmp_path):
    model, processor = build_tiny_idefics3()
    args = make_config(
        tmp_path,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        max_prompt_length=None,
        padding_free=True,
    )
    dataset = image_dataset()
    trainer = TargetPOTrainer(model, letters_reward, args=args, train_dataset=dataset, processing_class=processor)
    batch = trainer._rollout([dataset[i] for i in (0, 0, 1, 1)], mode="train")
    assert model_packing_problem(trainer.model) is None  # its Llama text model packs: the images are the reason
    with pytest.warns(UserWarning, match="because the prompts have images"):
        logps, _ = trainer._token_logps(trainer.model, batch)
    trainer._step.logps.padding_free = False
    assert torch.equal(logps, trainer._token_logps(trainer.model, batch)[0])


PROMPTS = ["Hi:", "Say cat:", "Spell a dog:", "Name the sun, then:", "Go:", "Write map:", "Say a pen, then:", "Cup:"]


def a_count_but_the_first_group(completions, **kwargs):
    """The letters 'a' of each completion, but 0 for the rollout's first group (4 completions), whose scores are then
    all equal: with beta = 0 its rows are left out of the first step's passes."""
    return [float(completion.count("a")) if index >= 4 else 0.0 for index, completion in enumerate(completions)]


@pytest.mark.parametrize(
    "logps_chunk_size, beta",
    [(512, 0.1), (0, 0.0)],
    ids=["chunked-head-with-reference", "full-logits-skipping-rows"],
)
def test_a_training_step_with_padding_free_gives_the_padded_steps_weights(
    tmp_path, tokenizer, monkeypatch, logps_chunk_size, beta
):
    """Two optimiser steps of one rollout (the second needs the old log-probs), with a KL to a reference copy or
    (beta = 0) leaving out the rows without gradient: every log-prob pass is packed, and the weights end where the
    padded passes take them."""
    packed_passes = []
    packed_kernel = policy_logps_module.packed_completion_logps

    def counting(model, *rows, **kwargs):
        packed_passes.append(rows[3].sum(dim=1).tolist())  # the completion lengths
        return packed_kernel(model, *rows, **kwargs)

    monkeypatch.setattr(policy_logps_module, "packed_completion_logps", counting)
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=2, num_heads=2, max_positions=128, seed=0)
    weights = {}
    for padding_free in (False, True):
        args = make_config(
            tmp_path / str(padding_free),
            padding_free=padding_free,
            logps_chunk_size=logps_chunk_size,
            steps_per_generation=2,
            max_steps=2,
            beta=beta,
            max_completion_length=8,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
            learning_rate=0.5,
            generation_kwargs=few_letters(tokenizer),  # "abce" or EOS: completions of 1 token to the limit
        )
        trainer = TargetPOTrainer(
            copy.deepcopy(model),
            a_count_but_the_first_group,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=tokenizer,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        assert not [w for w in caught if "padding_free" in str(w.message)]
        weights[padding_free] = {name: value.detach().cpu() for name, value in trainer.model.named_parameters()}  # a GPU's too
    # Old log-probs (2 passes of 8 rows), reference log-probs (2, with beta), and the policy's (2 steps), of spread
    # lengths; with beta = 0 the first step leaves out rows.
    assert len(packed_passes) == (6 if beta else 4)
    assert beta or len(packed_passes[2]) < 8, packed_passes
    assert len({length for lengths in packed_passes for length in lengths}) >= 4, packed_passes
    moved = max((weights[False][name] - model.state_dict()[name]).abs().max() for name in weights[False])
    assert moved > 1e-3
    for name, value in weights[False].items():
        assert (weights[True][name] - value).abs().max() < 1e-5, name


def test_on_a_gpu_packing_under_masked_attention_is_named_as_slower(tiny_model, monkeypatch):
    # Only the attention implementation and the device's type are read: no GPU is needed to check the note.
    cuda = torch.device("cuda")
    note = gpu_packing_cost(tiny_model, cuda)
    assert "attn_implementation='sdpa' on a GPU" in note and "flex_attention" in note
    tiny_model.config._attn_implementation = "eager"
    assert "attn_implementation='eager'" in gpu_packing_cost(tiny_model, cuda)
    for attention in ("flex_attention", "flash_attention_2", "kernels-community/flash-attn3"):
        tiny_model.config._attn_implementation = attention
        assert gpu_packing_cost(tiny_model, cuda) is None, attention  # they skip the other sequences
    tiny_model.config._attn_implementation = "sdpa"
    assert gpu_packing_cost(tiny_model, torch.device("cpu")) is None

    def settings(padding_free):
        return PolicyLogps.for_model(
            tiny_model, tiny_model, 1.0, set(), torch.device("cpu"), False, False, 512, rows_per_pass=8,
            padding_free=padding_free,
        )  # fmt: skip

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on the CPU, packing under sdpa gives no such warning
        settings(padding_free=True)
    # The trainer's settings give the note as a warning, when padding_free is on (the GPU stood in for).
    monkeypatch.setattr(policy_logps_module, "gpu_packing_cost", lambda model, device: "packing costs more here")
    with pytest.warns(UserWarning, match="packing costs more here"):
        settings(padding_free=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings(padding_free=False)
