"""max_tokens_per_micro_batch: a micro-step trained in several passes of bounded tokens gives the gradient of one pass.

The plan's closed forms first (``token_budget.plan_passes``), then training: plain SGD on fixed completions
(``split_group_workers``), each run with and without a budget; equal weights after every optimiser step mean equal
gradients. Each budgeted run is checked to have run several passes per micro-step (the forward passes with gradient
are counted), so the comparison is not between two single-pass runs.
"""

import dataclasses
import time

import pytest
import split_group_workers
import torch
import torch.multiprocessing as mp
from datasets import Dataset
from split_group_workers import NUM_GENERATIONS, PROMPTS, FixedCompletions, letter_score, train, two_process_worker
from test_coming_from_trl import tiny_moe
from test_distributed import free_port
from test_split_groups import assert_same_weights_after_every_step, assert_steps_move_the_weights, logged_losses

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm
from targetpo.generation import Completions
from targetpo.step.split_groups import SplitGroups
from targetpo.step.token_budget import check_budget_fits, pass_token_shares, pass_tokens, plan_passes

# Prompts of at most 12 tokens and completions of at most 5 (split_group_workers): one sequence is at most 17 tokens.
PROMPT_LIMIT = dict(max_prompt_length=12)


# ------------------------------------------------------------------------------------------------------ the plan
def test_a_pass_costs_its_tokens_packed_or_its_padded_rectangle():
    assert pass_tokens([3, 5], [4, 1], packed=True) == 3 + 5 + 4 + 1
    assert pass_tokens([3, 5], [4, 1], packed=False) == 2 * (5 + 4)
    assert pass_tokens([], [], packed=False) == 0


def test_rows_fill_passes_until_the_next_would_not_fit_in_order_when_packed_longest_first_when_padded():
    prompts, completions = [2, 2, 2, 2, 2], [3, 3, 6, 1, 3]  # sequences of 5, 5, 8, 3, 5 tokens
    assert plan_passes(prompts, completions, range(5), budget=13, packed=True) == [[0, 1], [2, 3], [4]]
    # Padded, longest first (2, 0, 1, 4, 3): [2, 0] would be 2 x 8 = 16; [0, 1, 4] 3 x 5 = 15; [4, 3] 2 x 5 = 10.
    assert plan_passes(prompts, completions, range(5), budget=13, packed=False) == [[2], [0, 1], [3, 4]]
    # Only the rows asked for, still in order.
    assert plan_passes(prompts, completions, [1, 3, 4], budget=13, packed=True) == [[1, 3, 4]]


def test_a_groups_rows_share_a_pass():
    prompts, completions = [1] * 6, [1] * 6  # 2 tokens per row; groups of 3 rows (6 tokens)
    assert plan_passes(prompts, completions, range(6), budget=8, packed=True) == [[0, 1, 2, 3], [4, 5]]
    assert plan_passes(prompts, completions, range(6), budget=8, packed=True, group_size=3) == [[0, 1, 2], [3, 4, 5]]
    # Padded, groups go longest first as units: group 1 (a row of 4 tokens) before group 0.
    prompts[4] = 3
    assert plan_passes(prompts, completions, range(6), budget=12, packed=False, group_size=3) == [[3, 4, 5], [0, 1, 2]]
    # Rows left out do not move the others: group 0 keeps rows 0 and 2.
    assert plan_passes(prompts, completions, [0, 2, 3, 4, 5], 8, True, group_size=3) == [[0, 2], [3, 4, 5]]


def test_a_unit_the_budget_cannot_hold_is_refused():
    with pytest.raises(ValueError, match=r"cannot hold the row 1 \(10 tokens\)"):
        plan_passes([1, 9], [1, 1], range(2), budget=8, packed=True)
    with pytest.raises(ValueError, match=r"prompt group of rows \[0, 1, 2, 3\] \(8 tokens\)"):
        plan_passes([1] * 4, [1] * 4, range(4), budget=6, packed=True, group_size=4)


def test_a_passs_share_is_the_tokens_it_reads_over_those_all_passes_read():
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])  # 2, 3 and 1 prompt tokens
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]])  # 2, 2 and 3 completion tokens
    passes = [torch.tensor([True, False, True]), torch.tensor([False, True, False]), torch.zeros(3, dtype=torch.bool)]
    # Rows read 4, 5 and 4 tokens: the passes 8, 5 and none (a pass without rows) of 13.
    assert pass_token_shares(prompt_mask, completion_mask, passes).tolist() == pytest.approx([8 / 13, 5 / 13, 0.0])


def test_the_budget_must_hold_the_longest_sequence():
    check_budget_fits(17, 17)
    with pytest.raises(ValueError, match="at least 17"):
        check_budget_fits(16, 17)
    with pytest.raises(ValueError, match="set max_prompt_length"):
        check_budget_fits(100, None)


# ------------------------------------------------------------------------------------------------------ training
def count_forward_passes_with_gradient(trainer):
    trainer.forwards_with_gradient = 0

    def count(module, args, kwargs):
        trainer.forwards_with_gradient += torch.is_grad_enabled()

    trainer.model.register_forward_pre_hook(count, with_kwargs=True)


def assert_same_training(budgeted, reference):
    assert budgeted.state.global_step == reference.state.global_step
    assert_same_weights_after_every_step(budgeted.recorded, reference.recorded)
    assert_steps_move_the_weights(reference.recorded[1:], reference.recorded[0])
    # The passes' losses add up to the micro-step's: the same loss is logged, and metrics measured over the
    # micro-step's tokens are measured once over all of them.
    assert logged_losses(budgeted) == pytest.approx(logged_losses(reference), rel=1e-5, abs=1e-7)
    assert_same_metrics(budgeted, reference)
    assert budgeted.forwards_with_gradient >= 2 * reference.forwards_with_gradient


TIMINGS = {"rollout/generation_wait_seconds", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def assert_same_metrics(budgeted, reference):
    """Every metric the one-pass run logs (the timings aside), the budgeted run logs in the same entry, equal: the
    loss, the KL, the entropy, the clip ratios and their extremes, the router loss, q's diagnostics."""
    assert len(budgeted.state.log_history) == len(reference.state.log_history)
    for index, (got, expected) in enumerate(zip(budgeted.state.log_history, reference.state.log_history)):
        names = set(expected) - TIMINGS
        assert set(got) - TIMINGS == names, f"log entry {index}"
        for name in names:
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), f"log entry {index}: {name}"


def logged(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


CASES = {
    # The KL to the reference divides by the micro-step's tokens, not a pass's.
    "grpo-kl": dict(loss_type="grpo", beta=0.04, per_device_train_batch_size=8, max_steps=2, budget=40),
    # Divided by the rollout's tokens, and by the local batch's; packed passes are cut by their real tokens.
    "dapo-packed": dict(loss_type="dapo", padding_free=True, per_device_train_batch_size=8, max_steps=2, budget=40),
    # Clipped in the second epoch (epsilon 0.05): the clip ratios of the passes' rows make the micro-step's.
    "bnpo-two-epochs": dict(loss_type="bnpo", epsilon=0.05, per_device_train_batch_size=8, max_steps=4,
                            num_iterations=2, budget=40),
    # Divided by the rows times max_completion_length: the micro-step's rows, not a pass's.
    "dr-grpo": dict(loss_type="dr_grpo", per_device_train_batch_size=8, max_steps=2, budget=40),
    # Each sequence's token sum, averaged over the micro-step's sequences.
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence", per_device_train_batch_size=8, max_steps=2,
                  budget=40),
    # Divided by the rollout's tokens; its own clip ratio, which bites in the second epoch.
    "cispo-two-epochs": dict(loss_type="cispo", epsilon_high=1.02, per_device_train_batch_size=8, max_steps=4,
                             num_iterations=2, budget=40),
    # 8 x 17 tokens fit the budget: each group in one pass, q built by the pass and kept for the second epoch.
    "tpo-whole-groups": dict(per_device_train_batch_size=16, max_steps=4, num_iterations=2, budget=140),
    # A group may outgrow the budget: the groups' softmax is known ahead (p_old, then a pass at moved weights).
    "tpo-groups-over-passes": dict(per_device_train_batch_size=8, max_steps=4, num_iterations=2, budget=40),
    "tpo-groups-over-passes-packed": dict(per_device_train_batch_size=8, max_steps=4, num_iterations=2, budget=40,
                                          padding_free=True),
}


@pytest.mark.parametrize("case", CASES)
def test_a_micro_step_in_passes_trains_as_one_pass(tmp_path, case):
    settings = dict(CASES[case], **PROMPT_LIMIT)
    budget = settings.pop("budget")
    reference = train(str(tmp_path / "one_pass"), on_trainer=count_forward_passes_with_gradient, **settings)
    budgeted = train(
        str(tmp_path / "passes"), on_trainer=count_forward_passes_with_gradient, max_tokens_per_micro_batch=budget,
        **settings,
    )
    assert_same_training(budgeted, reference)
    if settings.get("num_iterations", 1) > 1 and settings.get("loss_type", "tpo") != "tpo":
        clipped = [value for entry in reference.state.log_history for name, value in entry.items() if "clip" in name]
        assert max(clipped) > 0  # the clip ratios compared are not all 0


def test_optimiser_steps_across_rollouts_train_groups_over_passes_exactly(tmp_path, monkeypatch):
    """Rollouts of 3 micro-steps, optimiser steps of 2, two rollouts an epoch: the second optimiser step ends one
    rollout and starts the next. Groups outgrow the passes, so their softmax is known ahead: p_old at each rollout, a
    pass at the moved weights for a later micro-step, over its own step batch only (each holds whole groups)."""
    rollout_steps, passes_for_p = [], []
    at_rollout, sequence_logps = SplitGroups.at_rollout, SplitGroups._sequence_logps

    def recording_rollout(self, batch, valid_all, step):
        rollout_steps.append(step)
        return at_rollout(self, batch, valid_all, step)

    def counting_passes(self, model, batch):
        passes_for_p.append(batch)
        return sequence_logps(self, model, batch)

    monkeypatch.setattr(SplitGroups, "at_rollout", recording_rollout)
    monkeypatch.setattr(SplitGroups, "_sequence_logps", counting_passes)
    settings = dict(per_device_train_batch_size=8, steps_per_generation=3, gradient_accumulation_steps=2, max_steps=3,
                    prompts=PROMPTS + ["Say hat:", "Say cup:"], **PROMPT_LIMIT)
    reference = train(str(tmp_path / "one_pass"), on_trainer=count_forward_passes_with_gradient, **settings)
    budgeted = train(str(tmp_path / "passes"), on_trainer=count_forward_passes_with_gradient,
                     max_tokens_per_micro_batch=40, **settings)
    assert rollout_steps == [0, 1]  # the second rollout begins inside the second optimiser step
    assert_same_training(budgeted, reference)
    assert len(passes_for_p) == 3  # the last micro-step of rollout 1, the last two of rollout 2: weights had moved


@pytest.mark.parametrize("budget", [140, 40], ids=["whole-groups", "groups-over-passes"])
def test_skipped_rows_stay_exact_in_passes(tmp_path, budget):
    """One group scores equal: skipped at the rollout's weights, trained at moved ones, in passes or not."""
    settings = dict(per_device_train_batch_size=16, max_steps=4, num_iterations=2, **PROMPT_LIMIT)
    reference = train(str(tmp_path / "one_pass"), "letter_score_but_cat_ties", skip_zero_gradient_completions=False,
                      on_trainer=count_forward_passes_with_gradient, **settings)
    budgeted = train(str(tmp_path / "passes"), "letter_score_but_cat_ties", max_tokens_per_micro_batch=budget,
                     on_trainer=count_forward_passes_with_gradient, **settings)
    assert budgeted.args.skip_zero_gradient_completions
    assert logged(budgeted, "completions/skipped_fraction")[0] > 0
    assert_same_weights_after_every_step(budgeted.recorded, reference.recorded)
    assert budgeted.forwards_with_gradient > reference.forwards_with_gradient


class FixedCompletionsWithSamplerLogps(FixedCompletions):
    """The fixed completions with the sampling engine's log-probs of their tokens, as vLLM reports them (values that
    differ from the trainer's, so the importance weights are not 1)."""

    def generate(self, prompt_ids, prompt_mask):
        completions = super().generate(prompt_ids, prompt_mask)
        positions = torch.arange(completions.ids.size(1), dtype=torch.float32)
        logps = -(1.0 + 0.3 * positions + 0.1 * (completions.ids % 3)).float()
        return dataclasses.replace(completions, sampler_logps=logps * completions.attention_mask)


def with_sampler_logps(trainer):
    """vLLM is the boundary here: its engine cannot run in these tests, so its log-probs come from the fixed
    completions and the correction is switched on by hand, as use_vllm=True with vllm_importance_sampling_correction
    would."""
    trainer.rollout_backend = FixedCompletionsWithSamplerLogps(trainer.processing_class, 0)
    trainer._step.importance_sampling = True


def test_importance_weights_of_rows_a_first_use_skips_reach_their_later_uses(tmp_path):
    """TPO, one group of equal scores: skipped at the rollout's weights, trained at moved ones (second epoch) with the
    importance weights the first use built from the rollout's old log-probs for every row."""
    settings = dict(per_device_train_batch_size=16, max_steps=4, num_iterations=2, **PROMPT_LIMIT)
    runs = {}
    for name, budget in (("one_pass", None), ("passes", 40)):
        runs[name] = train(str(tmp_path / name), "letter_score_but_cat_ties", max_tokens_per_micro_batch=budget,
                           on_trainer=with_sampler_logps, **settings)
    assert logged(runs["passes"], "completions/skipped_fraction")[0] > 0
    assert logged(runs["one_pass"], "vllm/importance_weight_mean")[0] != pytest.approx(1.0)
    assert_same_weights_after_every_step(runs["passes"].recorded, runs["one_pass"].recorded)
    for name in ("vllm/importance_weight_mean", "vllm/logp_abs_diff"):
        assert logged(runs["passes"], name) == pytest.approx(logged(runs["one_pass"], name), rel=1e-5)


def count_forward_passes(trainer):
    """Counts the model's forward passes with and without gradient."""
    trainer.forwards_with_gradient = trainer.forwards_without_gradient = 0

    def count(module, args, kwargs):
        if torch.is_grad_enabled():
            trainer.forwards_with_gradient += 1
        else:
            trainer.forwards_without_gradient += 1

    trainer.model.register_forward_pre_hook(count, with_kwargs=True)


@pytest.mark.parametrize("case", ["bnpo-two-epochs", "tpo-whole-groups"])
def test_the_first_use_completes_the_old_log_probs_pass_by_pass(tmp_path, case):
    """num_iterations = 2: the rollout runs no pass of its own for the old log-probs (every row trains at its first
    use, at the rollout's weights); each of the first use's passes fills its rows', and the second epoch's ratios and
    q come from them, as in one pass."""
    settings = dict(CASES[case], **PROMPT_LIMIT)
    budget = settings.pop("budget")
    reference = train(str(tmp_path / "one_pass"), on_trainer=count_forward_passes, **settings)
    budgeted = train(str(tmp_path / "passes"), on_trainer=count_forward_passes, max_tokens_per_micro_batch=budget,
                     **settings)
    assert budgeted._plan.old_logps_at_first_use
    assert reference.forwards_without_gradient == budgeted.forwards_without_gradient == 0
    assert budgeted.forwards_with_gradient >= 2 * reference.forwards_with_gradient
    assert_same_weights_after_every_step(budgeted.recorded, reference.recorded)


def test_importance_weights_built_pass_by_pass_at_the_first_use_serve_the_later_uses(tmp_path):
    """BNPO, two epochs, passes of at most 40 tokens: the first use's passes each fill their rows' old log-probs, and
    the importance weights the second epoch reuses are every row's (built by the pass that completed them)."""
    settings = dict(loss_type="bnpo", per_device_train_batch_size=8, max_steps=4, num_iterations=2, **PROMPT_LIMIT)
    runs = {}
    for name, budget in (("one_pass", None), ("passes", 40)):
        runs[name] = train(str(tmp_path / name), max_tokens_per_micro_batch=budget, on_trainer=with_sampler_logps,
                           **settings)
    assert runs["passes"]._plan.old_logps_at_first_use
    assert logged(runs["one_pass"], "vllm/importance_weight_mean")[0] != pytest.approx(1.0)
    assert_same_weights_after_every_step(runs["passes"].recorded, runs["one_pass"].recorded)
    for name in ("vllm/importance_weight_mean", "vllm/logp_abs_diff"):
        assert logged(runs["passes"], name) == pytest.approx(logged(runs["one_pass"], name), rel=1e-5)


def test_tpo_on_two_processes_completes_old_log_probs_in_different_passes(tmp_path):
    """The cat group scores equal and is skipped at the rollout's weights: one process's first use trains in 1 pass,
    the other's in 2, so each completes its old log-probs in another pass. q is built from them without a collective
    (a gather there would pair with nothing on the other process, and both would wait for ever): the weights are one
    pass's. And 3 groups of 8 over 2 processes of 12 rows, so that the middle group spans the processes while a pass
    could hold it: TPO trains them from their softmax known ahead, as one process with all 24 rows in one pass."""
    settings = dict(per_device_train_batch_size=16, max_steps=4, num_iterations=2, **PROMPT_LIMIT)
    spanning = dict(max_steps=1, **PROMPT_LIMIT)
    cases = [("tpo_passes", "letter_score_but_cat_ties", dict(max_tokens_per_micro_batch=140, **settings)),
             ("tpo_one_pass", "letter_score_but_cat_ties", settings),
             ("tpo_spanning_passes", "letter_score",
              dict(per_device_train_batch_size=12, max_tokens_per_micro_batch=140, **spanning))]
    context = mp.spawn(two_process_worker, args=(2, free_port(), str(tmp_path), cases), nprocs=2, join=False)
    deadline = time.monotonic() + 180
    while not context.join(timeout=5):
        if time.monotonic() > deadline:  # a hang is the failure this test guards against
            for process in context.processes:
                process.kill()
            pytest.fail("the two processes did not finish: their collectives no longer pair up")
    whole_groups = train(str(tmp_path / "whole_groups"), per_device_train_batch_size=24, **spanning)
    for rank in range(2):
        weights = {name: torch.load(tmp_path / f"{name}_rank{rank}.pt") for name, _, _ in cases}
        assert_steps_move_the_weights(weights["tpo_one_pass"][1:], weights["tpo_one_pass"][0])
        assert_same_weights_after_every_step(weights["tpo_passes"], weights["tpo_one_pass"])
        assert_same_weights_after_every_step(weights["tpo_spanning_passes"], whole_groups.recorded)


def test_evaluation_in_passes_gives_the_one_pass_loss(tmp_path):
    settings = dict(per_device_train_batch_size=8, per_device_eval_batch_size=8, max_steps=1, **PROMPT_LIMIT)
    losses = []
    for name, budget in (("one_pass", None), ("passes", 40)):
        trainer = train(str(tmp_path / name), max_tokens_per_micro_batch=budget, **settings)
        losses.append(trainer.evaluate(Dataset.from_dict({"prompt": PROMPTS[:2]}))["eval_loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def record_every_forward(trainer):
    """Records each forward pass of the policy and of the reference: the phase (``trainer.phase``), its kind, and the
    tokens it computed on (its input ids, padding included)."""
    trainer.phase, trainer.forwards = "train", []

    def record(module, args, kwargs):
        kind = "with gradient" if torch.is_grad_enabled() else "without gradient"
        kind = "reference" if module is trainer.ref_model else kind
        trainer.forwards.append((trainer.phase, kind, kwargs["input_ids"].numel()))

    for model in (trainer.model, trainer.ref_model):
        model.register_forward_pre_hook(record, with_kwargs=True)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_no_forward_pass_computes_on_more_tokens_than_the_budget(tmp_path, padding_free):
    """The training passes, the old log-probs' (the second step batch is first used after the weights moved), the
    reference's and evaluation's: every one within 40 tokens, where a micro-step's 8 rows of up to 13 are 104."""
    settings = dict(loss_type="grpo", beta=0.04, per_device_train_batch_size=8, per_device_eval_batch_size=8,
                    steps_per_generation=2, max_steps=2, padding_free=padding_free, **PROMPT_LIMIT)
    trainer = train(str(tmp_path), max_tokens_per_micro_batch=40, on_trainer=record_every_forward, **settings)
    trainer.phase = "evaluation"
    trainer.evaluate(Dataset.from_dict({"prompt": PROMPTS[:2]}))
    kinds = {(phase, kind) for phase, kind, _ in trainer.forwards}
    assert kinds == {("train", "with gradient"), ("train", "without gradient"), ("train", "reference"),
                     ("evaluation", "without gradient"), ("evaluation", "reference")}
    assert max(tokens for _, _, tokens in trainer.forwards) <= 40
    for phase, kind in kinds:  # each cut into passes: more than one forward per batch of 8 rows
        assert sum(1 for forward in trainer.forwards if forward[:2] == (phase, kind)) > 2, (phase, kind)


def test_a_micro_step_whose_rows_are_all_skipped_runs_a_pass_without_rows(tmp_path):
    """The cat group scores equal: the first micro-step (its 8 rows) has no row to train, and runs one pass without
    rows and zero loss; the next one's passes train as one pass. Weights and metrics as without a budget."""
    settings = dict(loss_type="grpo", per_device_train_batch_size=8, max_steps=2, **PROMPT_LIMIT)
    reference = train(str(tmp_path / "one_pass"), "letter_score_but_cat_ties", **settings)
    budgeted = train(str(tmp_path / "passes"), "letter_score_but_cat_ties", max_tokens_per_micro_batch=40, **settings)
    assert logged(budgeted, "completions/skipped_fraction") == [1.0, 0.0]
    assert_same_weights_after_every_step(budgeted.recorded, reference.recorded)
    assert_same_metrics(budgeted, reference)


def record_router_losses(trainer):
    """Records each training forward pass's tokens read (its attention mask's) and the router loss the model gave."""
    trainer.router_losses = []

    def record(module, args, kwargs, output):
        if torch.is_grad_enabled():
            trainer.router_losses.append((kwargs["attention_mask"].sum().item(), output.aux_loss.item()))

    trainer.model.register_forward_hook(record, with_kwargs=True)


def test_a_routers_loss_is_each_passs_weighted_by_its_share_of_the_tokens_read(tmp_path, monkeypatch):
    """A mixture-of-experts router loss is a mean over the tokens a forward pass routes: the micro-step's is each
    pass's weighted by the tokens it reads over those all passes read, in the logged router loss and in the loss."""
    monkeypatch.setattr(split_group_workers, "build_tiny_causal_lm", lambda tokenizer, **sizes: tiny_moe(tokenizer))
    settings = dict(loss_type="grpo", per_device_train_batch_size=8, max_steps=1, max_tokens_per_micro_batch=40,
                    **PROMPT_LIMIT)
    with_router = train(str(tmp_path / "router"), router_aux_loss_coef=0.5, on_trainer=record_router_losses,
                        **settings)
    without = train(str(tmp_path / "none"), router_aux_loss_coef=0.0, **settings)
    tokens, losses = zip(*with_router.router_losses)
    assert len(tokens) >= 2 and len(set(tokens)) > 1  # passes of unequal tokens: unequal shares
    expected = sum(read * loss for read, loss in zip(tokens, losses)) / sum(tokens)
    assert logged(with_router, "aux_loss") == [pytest.approx(expected, rel=1e-6)]
    router_part = logged_losses(with_router)[0] - logged_losses(without)[0]
    assert router_part == pytest.approx(0.5 * expected, rel=1e-5)


@pytest.mark.parametrize("loss_type", ["tpo", "grpo"])
def test_a_budget_below_one_sequence_is_refused_before_training(tmp_path, loss_type):
    with pytest.raises(ValueError, match="cannot hold one whole sequence of up to 17 tokens"):
        train(str(tmp_path), max_tokens_per_micro_batch=16, per_device_train_batch_size=8, max_steps=1,
              loss_type=loss_type, **PROMPT_LIMIT)


class LongerCompletions(FixedCompletions):
    """Completions 10 tokens longer than max_completion_length, as a rollout_func may return them (bounded only by
    the model's positions)."""

    def generate(self, prompt_ids, prompt_mask):
        completions = super().generate(prompt_ids, prompt_mask)
        extra = torch.full((completions.ids.size(0), 10), self.letters[0])
        ids = torch.cat([extra, completions.ids], dim=1)
        mask = torch.cat([torch.ones_like(extra), completions.attention_mask], dim=1)
        return Completions(ids, mask, completions.truncated)


def test_a_rollout_with_a_sequence_the_budget_cannot_hold_stops_at_the_rollout(tmp_path):
    def longer(trainer):
        trainer.rollout_backend = LongerCompletions(trainer.processing_class, 0)

    with pytest.raises(ValueError, match=r"cannot hold the row \d+ \(2\d tokens\)") as raised:
        train(str(tmp_path), loss_type="grpo", max_tokens_per_micro_batch=20, per_device_train_batch_size=8,
              max_steps=1, on_trainer=longer, **PROMPT_LIMIT)
    assert any(entry.name == "prepare_rollout" for entry in raised.traceback)  # before any pass


def test_an_overridden_compute_loss_is_refused_with_a_budget(tmp_path):
    class OwnLoss(TargetPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    tokenizer = build_char_tokenizer()
    args = TargetPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2,
                          max_completion_length=4, max_prompt_length=8, max_tokens_per_micro_batch=64,
                          report_to="none", use_cpu=True)
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=0)
    with pytest.raises(ValueError, match="OwnLoss overrides compute_loss, which max_tokens_per_micro_batch"):
        OwnLoss(model, letter_score, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                processing_class=tokenizer)


@pytest.mark.parametrize(
    "settings, refused",
    [
        (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5 ranks"),
        (dict(entropy_coef=0.01, off_policy_mask_threshold=0.5), "off_policy_mask_threshold decides pass by pass"),
        (dict(optim="lomo"), "optim=lomo updates the weights inside each backward pass"),
        (dict(optim="galore_adamw_layerwise", optim_target_modules=["mlp"]),
         "optim=galore_adamw_layerwise updates the weights inside each backward pass"),
    ],
)
def test_settings_that_need_the_whole_micro_step_at_once_are_refused(tmp_path, settings, refused):
    with pytest.raises(ValueError, match=refused):
        TargetPOConfig(output_dir=str(tmp_path), max_tokens_per_micro_batch=64, report_to="none", **settings)


def test_the_entropy_bonus_alone_divides_by_the_micro_steps_tokens(tmp_path):
    settings = dict(loss_type="grpo", entropy_coef=0.05, per_device_train_batch_size=8, max_steps=2, **PROMPT_LIMIT)
    reference = train(str(tmp_path / "one_pass"), on_trainer=count_forward_passes_with_gradient, **settings)
    budgeted = train(str(tmp_path / "passes"), on_trainer=count_forward_passes_with_gradient,
                     max_tokens_per_micro_batch=40, **settings)
    assert_same_training(budgeted, reference)


@pytest.mark.slow
def test_passes_on_two_processes_train_as_one_pass(tmp_path):
    """Two processes with 4 rows each, cut into passes whose number the processes agree on (a DDP forward pass is a
    collective): in the first step process 0's rows fit in 2 packed passes of 24 tokens and process 1's need 3. GRPO with the KL: as the same two processes in one pass each (each process's KL is a mean over its
    own tokens). TPO: its groups span processes and passes, trained from their softmax known ahead, as one process
    with the whole group in one pass. BNPO over two epochs: each process's first use fills its old log-probs pass by
    pass (its empty passes fill nothing). TPO with two step batches of whole groups per process, cut by the passes:
    as the same two processes in one pass each."""
    two_processes = dict(per_device_train_batch_size=4, **PROMPT_LIMIT)
    grpo, tpo = dict(loss_type="grpo", beta=0.04, max_steps=2), dict(max_steps=4, num_iterations=2)
    bnpo = dict(loss_type="bnpo", max_steps=4, num_iterations=2)
    tpo_batches = dict(per_device_train_batch_size=8, steps_per_generation=2, **tpo, **PROMPT_LIMIT)
    cases = [
        ("grpo_passes", "letter_score", dict(max_tokens_per_micro_batch=24, padding_free=True, **grpo, **two_processes)),
        ("grpo_one_pass", "letter_score", dict(**grpo, **two_processes)),
        ("tpo_passes", "letter_score", dict(max_tokens_per_micro_batch=24, padding_free=True, **tpo, **two_processes)),
        ("bnpo_passes", "letter_score", dict(max_tokens_per_micro_batch=24, padding_free=True, **bnpo, **two_processes)),
        ("bnpo_one_pass", "letter_score", dict(**bnpo, **two_processes)),
        # Two step batches of whole groups per process, the passes cutting them: p from each micro-step's own batch.
        ("tpo_batches_passes", "letter_score", dict(max_tokens_per_micro_batch=40, **tpo_batches)),
        ("tpo_batches_one_pass", "letter_score", tpo_batches),
    ]
    mp.spawn(two_process_worker, args=(2, free_port(), str(tmp_path), cases), nprocs=2, join=True)
    tpo_reference = train(str(tmp_path / "tpo"), per_device_train_batch_size=NUM_GENERATIONS, **tpo, **PROMPT_LIMIT)
    for rank in range(2):
        weights = {name: torch.load(tmp_path / f"{name}_rank{rank}.pt") for name, _, _ in cases}
        assert_same_weights_after_every_step(weights["grpo_passes"], weights["grpo_one_pass"])
        assert_same_weights_after_every_step(weights["tpo_passes"], tpo_reference.recorded)
        assert_same_weights_after_every_step(weights["bnpo_passes"], weights["bnpo_one_pass"])
        assert_same_weights_after_every_step(weights["tpo_batches_passes"], weights["tpo_batches_one_pass"])
