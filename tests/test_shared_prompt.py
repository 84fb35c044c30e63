"""share_prompt_forward: each prompt read once for the rows that share it gives the padded pass's log-probs and
gradients, and trains to the same weights.

The closed form of the runs first, then the log-probs and gradients against the padded pass on a tiny Qwen2, then
training: plain SGD on fixed completions (``split_group_workers``), with and without sharing, one process and two
(gloo, DDP). Every training comparison checks that the prompts were shared (a forward pass that continued from
returned keys and values), so it is not between two padded runs.
"""

import warnings

import pytest
import torch
import torch.multiprocessing as mp
from datasets import Dataset
from split_group_workers import PROMPTS, count_shared_passes, train, two_process_worker
from test_distributed import free_port
from test_split_groups import assert_same_weights_after_every_step, assert_steps_move_the_weights
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from targetpo import TargetPOConfig
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm
from targetpo.modeling.logps import completion_logps, shared_prompt_completion_logps
from targetpo.modeling.shared_prompt import model_sharing_problem, prompt_runs
from targetpo.step.forward import PolicyLogps


def test_runs_are_consecutive_rows_with_the_same_prompt_and_padding():
    prompt_ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 5, 6], [7, 5, 6], [7, 5, 6], [0, 5, 6], [0, 0, 6]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1]])
    runs = prompt_runs(prompt_ids, prompt_mask)
    # The sixth row repeats the first prompt after others: a run of its own. The last has the same ids as the one
    # before it with another padding: another prompt.
    assert runs.firsts.tolist() == [0, 2, 5, 6]
    assert runs.run_of_row.tolist() == [0, 0, 1, 1, 1, 2, 3]


@pytest.fixture
def rows():
    """Three prompts of 5, 9 and 7 tokens (left-padded to 9) with 3, 2 and 3 completions of 1 to 6 tokens."""
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 5, 5, 9, 9, 7, 7, 7]
    prompts = {length: torch.randint(3, 40, (length,), generator=generator) for length in set(lengths)}
    prompt_ids, prompt_mask = torch.zeros(8, 9, dtype=torch.long), torch.zeros(8, 9, dtype=torch.long)
    for row, length in enumerate(lengths):
        prompt_ids[row, 9 - length :], prompt_mask[row, 9 - length :] = prompts[length], 1
    completion_lengths = torch.tensor([6, 3, 1, 4, 6, 2, 5, 6])
    completion_mask = (torch.arange(7) < completion_lengths[:, None]).long()  # a column no row reads, cut and put back
    completion_ids = torch.randint(3, 40, (8, 7), generator=generator) * completion_mask
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64, bos_token_id=1,
                                      eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


MODELS = {
    "qwen2": lambda: build_tiny_causal_lm(build_char_tokenizer(), hidden_size=32, num_layers=2, num_heads=2,
                                          max_positions=128, seed=0),
    "gpt2": tiny_gpt2,  # learned positions, its own attention and cache classes
}


@pytest.mark.parametrize("entropy_grad", [False, True], ids=["entropy-metric", "entropy-bonus"])
@pytest.mark.parametrize("architecture", MODELS)
def test_shared_prompts_give_the_padded_passs_log_probs_entropies_and_gradients(rows, entropy_grad, architecture):
    model = MODELS[architecture]()
    assert model_sharing_problem(model) is None
    mask = rows[3].bool()
    weights = torch.linspace(-1.0, 1.0, int(mask.sum()))
    settings = dict(temperature=0.8, with_entropy=True, suppressed_token_ids=torch.tensor([4]), chunk_size=5,
                    entropy_grad=entropy_grad)
    results = {}
    for name, compute in (("padded", completion_logps), ("shared", shared_prompt_completion_logps)):
        model.zero_grad()
        logps, entropies = compute(model, *rows, **settings)
        loss = (logps[mask] * weights).sum() + (entropies[mask].sum() if entropy_grad else 0)
        loss.backward()
        grads = {name: param.grad.clone() for name, param in model.named_parameters()}
        results[name] = (logps.detach(), entropies.detach(), grads)
    (padded_logps, padded_entropies, padded_grads), (logps, entropies, grads) = results["padded"], results["shared"]
    assert logps.shape == padded_logps.shape
    torch.testing.assert_close(logps[mask], padded_logps[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies[mask], padded_entropies[mask], rtol=1e-5, atol=1e-5)
    assert not logps[~mask].any()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()), msg=name)
    assert all(grad.abs().sum() > 0 for name, grad in padded_grads.items() if "embed" in name or "wte" in name)


def test_a_model_whose_completions_do_not_continue_its_prompts_keys_is_found_out():
    """A forward pass that leaves out the keys and values it is given (as a model with its own cache handling might)
    lets the completions attend to themselves only: the probe names the problem."""
    model = build_tiny_causal_lm(build_char_tokenizer(), hidden_size=32, num_layers=1, num_heads=2, max_positions=128,
                                 seed=0)
    forward = model.forward

    def without_the_cache(input_ids, attention_mask=None, past_key_values=None, **kwargs):
        if past_key_values is not None:
            attention_mask = attention_mask[:, -input_ids.size(1) :]
        return forward(input_ids, attention_mask=attention_mask, **kwargs)

    model.forward = without_the_cache
    assert "gives other hidden states when it continues" in model_sharing_problem(model)


def tiny_qwen2(**settings):
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, **settings))


def test_models_whose_exactness_depends_on_lengths_keep_padded_rows():
    # A sliding window keeps the keys and values of the last positions only.
    sliding = tiny_qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert "cache keeps other than every position's keys and values" in model_sharing_problem(sliding)
    # A dynamic rotary embedding rescales once a forward pass passes max_position_embeddings: the prompts' pass
    # alone does not, the padded pass does (both below it in the probe, which would not see it).
    torch.manual_seed(0)
    dynamic = tiny_qwen2(max_position_embeddings=16, initializer_range=0.3,  # large weights: attention that matters
                         rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    assert "rotary embedding (dynamic) rescales" in model_sharing_problem(dynamic)
    prompt, completion = torch.arange(3, 15).expand(2, -1), torch.arange(20, 32).expand(2, -1)
    rows = (prompt, torch.ones_like(prompt), completion, torch.ones_like(completion))
    with torch.no_grad():
        padded, _ = completion_logps(dynamic.eval(), *rows, chunk_size=8)
        shared, _ = shared_prompt_completion_logps(dynamic, *rows, chunk_size=8)
    assert (padded - shared).abs().max() > 0.1  # what sharing would have computed: far off


# ------------------------------------------------------------------------------------------------------ training
CASES = {
    # Old log-probs of the second epoch, the reference's log-probs: every pass shares the prompts.
    "tpo-two-epochs": dict(per_device_train_batch_size=16, max_steps=4, num_iterations=2),
    "grpo-kl": dict(loss_type="grpo", beta=0.04, per_device_train_batch_size=8, max_steps=2),
    # Groups of equal scores skipped at the rollout's weights: the remaining rows share their prompts.
    "tpo-skipped-rows": dict(per_device_train_batch_size=16, max_steps=4, num_iterations=2, reward="cat_ties"),
    # A group's 8 rows over 2 micro-steps: each shares its prompt within its micro-step; p refreshed at moved weights.
    "tpo-groups-split": dict(per_device_train_batch_size=4, steps_per_generation=4, gradient_accumulation_steps=4,
                             max_steps=4, num_iterations=2),
    # Token-budget passes of at most 40 tokens (two or three rows): the rows of a pass that share a prompt share it.
    "grpo-token-budget": dict(loss_type="grpo", beta=0.04, per_device_train_batch_size=8, max_steps=2,
                              max_tokens_per_micro_batch=40),
}


@pytest.mark.parametrize("case", CASES)
def test_training_with_shared_prompts_trains_as_padded_rows(tmp_path, case):
    settings = dict(CASES[case], max_prompt_length=12)
    reward = "letter_score_but_cat_ties" if settings.pop("reward", None) else "letter_score"
    padded = train(str(tmp_path / "padded"), reward, on_trainer=count_shared_passes, **settings)
    shared = train(str(tmp_path / "shared"), reward, on_trainer=count_shared_passes, share_prompt_forward=True,
                   **settings)
    assert padded.shared_passes == 0 and shared.shared_passes >= shared.state.global_step  # every training pass
    assert_steps_move_the_weights(padded.recorded[1:], padded.recorded[0])
    assert_same_weights_after_every_step(shared.recorded, padded.recorded)


def test_shared_prompts_on_two_processes_train_as_padded_rows(tmp_path):
    """DDP: the prompt pass goes through the wrapped module, the completion pass through the wrapper, one backward
    pass; the gradients of both reach the weights and are averaged over the processes."""
    settings = dict(loss_type="grpo", beta=0.04, max_steps=2, per_device_train_batch_size=4, max_prompt_length=12)
    cases = [("shared", "letter_score", dict(share_prompt_forward=True, **settings)),
             ("padded", "letter_score", settings)]
    mp.spawn(two_process_worker, args=(2, free_port(), str(tmp_path), cases, "count_shared_passes"), nprocs=2,
             join=True)
    for rank in range(2):
        weights = {name: torch.load(tmp_path / f"{name}_rank{rank}.pt") for name, _, _ in cases}
        assert_steps_move_the_weights(weights["padded"][1:], weights["padded"][0])
        assert_same_weights_after_every_step(weights["shared"], weights["padded"])
        counted = {name: torch.load(tmp_path / f"{name}_rank{rank}_shared_passes.pt") for name, _, _ in cases}
        assert counted["padded"] == 0 and counted["shared"] >= 2  # the policy's and the reference's, every step


def test_evaluation_with_shared_prompts_gives_the_padded_loss(tmp_path):
    settings = dict(per_device_train_batch_size=8, per_device_eval_batch_size=8, max_steps=1, max_prompt_length=12,
                    on_trainer=count_shared_passes)
    losses, shared_passes = [], []
    for name, share in (("padded", False), ("shared", True)):
        trainer = train(str(tmp_path / name), share_prompt_forward=share, **settings)
        before = trainer.shared_passes
        losses.append(trainer.evaluate(Dataset.from_dict({"prompt": PROMPTS[:2]}))["eval_loss"])
        shared_passes.append(trainer.shared_passes - before)
    assert shared_passes[0] == 0 and shared_passes[1] > 0
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_rows_that_cannot_share_a_prompt_are_padded_with_the_reason(rows):
    model = MODELS["qwen2"]()
    logps = PolicyLogps(1.0, torch.tensor([], dtype=torch.long), True, 4, False, 8, share_prompts=True)
    prompt_ids, prompt_mask, completion_ids, completion_mask = rows
    assert logps._shares_prompts(model, list(rows), with_images=False, router_aux_loss=False)
    # Each row from another prompt: the padded pass is the same computation, and nothing is said.
    distinct = [prompt_ids[[0, 3, 5]], prompt_mask[[0, 3, 5]], completion_ids[:3], completion_mask[:3]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not logps._shares_prompts(model, distinct, with_images=False, router_aux_loss=False)
    right_padded = [prompt_ids, prompt_mask.flip(1), completion_ids, completion_mask]
    for call, reason in (
        (dict(rows_tensors=list(rows), with_images=True, router_aux_loss=False), "the prompts have images"),
        (dict(rows_tensors=list(rows), with_images=False, router_aux_loss=True), "router's load-balancing loss"),
        (dict(rows_tensors=right_padded, with_images=False, router_aux_loss=False), "does not read one run of tokens"),
    ):
        with pytest.warns(UserWarning, match=f"share_prompt_forward: these log-probs are computed from padded rows, "
                                             f"each reading its prompt, because .*{reason}"):
            assert not logps._shares_prompts(model, **call)


def test_where_prompts_cannot_be_shared_a_warning_says_why_and_the_rows_are_padded(tmp_path):
    with pytest.warns(UserWarning, match="share_prompt_forward: .* computed from padded rows, each reading its prompt, "
                                         r"because the output head cannot run on the final hidden states"):
        trainer = train(str(tmp_path / "full_logits"), on_trainer=count_shared_passes, share_prompt_forward=True,
                        logps_chunk_size=0, per_device_train_batch_size=8, max_steps=1, max_prompt_length=12)
    assert trainer.shared_passes == 0


@pytest.mark.parametrize("other, value, refused", [
    ("padding_free", True, "padding_free=True packs every row's prompt and completion into one row: choose one"),
    ("gradient_checkpointing", True, "which transformers does not keep under gradient checkpointing"),
])
def test_settings_that_cannot_share_prompts_are_refused(tmp_path, other, value, refused):
    with pytest.raises(ValueError, match=refused):
        TargetPOConfig(output_dir=str(tmp_path), share_prompt_forward=True, **{other: value})
