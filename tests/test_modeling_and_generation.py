"""Completion masks, rollouts and the trainer's log-probs against a naive, one-sequence-at-a-time computation."""

import contextlib
import math

import pytest
import torch
from logps_cases import logps_entropies_and_gradients, padded_batch

from targetpo.generation import SamplingSettings, TransformersBackend, completion_masks
from targetpo.modeling import (
    completion_logps,
    entropy_from_logits,
    forward_accepts_position_ids,
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
