"""Fuzzed inputs (hypothesis): reward outputs, reward matrices through the math, tool-call text and tool results,
dataset rows and config values. Each is a clear error or a documented handling; never NaN or inf in a loss, its
gradient or the weights, never an exception of another kind, never a hang. Examples are drawn from a fixed seed
(``derandomize``), so a run is reproducible."""

import contextlib
import itertools
import json
import math

import numpy as np
import pytest
import torch
from conftest import make_config
from datasets import Dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_multi_turn import add, hermes_tokenizer
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo import functional as F
from targetpo.data import validate_prompt_dataset
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm
from targetpo.episodes.async_runner import AsyncRunner
from targetpo.episodes.chat_template import ConversationTemplate
from targetpo.episodes.tools import Toolbox, run_tool_calls
from targetpo.modeling.loading import PromptLimit
from targetpo.rewards import LARGEST_SCORE, RewardScorer, check_reward_output
from targetpo.rollout.prompts import PromptEncoder


def fuzz(max_examples):
    """Hypothesis settings for this file: a fixed seed, no deadline (CI machines are slow), few examples."""
    return settings(
        max_examples=max_examples, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )


HUGE = [1e300, -1e300, 3.4e38, -3.4e38, 1e38, -1e38, 1e30, 1e-45, -1e-300]
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.sampled_from(HUGE + [math.nan, math.inf, -math.inf, 0.0, True]),
)
entries = st.one_of(
    numbers,
    st.none(),
    st.text(max_size=4),
    st.lists(st.floats(), max_size=2),
    numbers.map(lambda value: np.float64(value) if not isinstance(value, int) or abs(value) < 2**63 else value),
    st.floats(width=32).map(torch.tensor),
)


def what_an_entry_gives(value):
    """The documented handling of one returned entry: its float, NaN for None, or None where it must be refused."""
    if value is None:
        return math.nan
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()
    if isinstance(value, (str, list)):
        return None
    number = float(value)
    return number if math.isfinite(number) and abs(number) <= LARGEST_SCORE else None


# ------------------------------------------------------------------------------------------------- reward outputs
@fuzz(300)
@given(st.lists(entries, max_size=6), st.integers(min_value=0, max_value=6))
def test_a_reward_output_is_its_numbers_or_a_value_error_naming_the_function(output, expected):
    wanted = [what_an_entry_gives(value) for value in output]
    if len(output) != expected or None in wanted:
        with pytest.raises(ValueError, match="Reward function 'judge'"):
            check_reward_output(output, "judge", expected)
        return
    got = check_reward_output(output, "judge", expected)
    assert len(got) == expected
    assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(got, wanted))
    # What a scorer stores (float32) is what it was given: NaN only where the function returned None.
    stored = torch.tensor(got, dtype=torch.float32)
    assert torch.equal(torch.isnan(stored), torch.tensor([value is None for value in output], dtype=torch.bool))
    assert not torch.isinf(stored).any()


@fuzz(60)
@given(st.one_of(numbers, st.text(max_size=4), st.none(), st.dictionaries(st.text(max_size=2), numbers, max_size=2)))
def test_a_reward_output_that_is_no_list_is_refused_by_name(output):
    with pytest.raises(ValueError, match="Reward function 'judge' must return a list"):
        check_reward_output(output, "judge", 1)


@fuzz(60)
@given(st.lists(entries, min_size=4, max_size=4))
def test_the_scorer_scores_or_refuses_naming_the_function(output):
    def judge(completions, **kwargs):
        return output

    scorer = RewardScorer([judge])
    arguments = (["p"] * 4, ["c"] * 4, [[1]] * 4, {}, None, torch.device("cpu"))
    if None in [what_an_entry_gives(value) for value in output]:
        with pytest.raises(ValueError, match="Reward function 'judge'"):
            scorer.score(*arguments)
        return
    scores = scorer.score(*arguments)
    assert scores.shape == (4, 1) and not torch.isinf(scores).any()
    assert torch.isnan(scores[:, 0]).tolist() == [value is None for value in output]


@fuzz(40)
@given(st.lists(st.one_of(numbers, st.text(max_size=3), st.none()), min_size=2, max_size=2))
def test_reward_weights_are_finite_float32_numbers_or_refused(weights):
    usable = all(
        isinstance(weight, (int, float)) and math.isfinite(float(weight)) and abs(float(weight)) <= LARGEST_SCORE
        for weight in weights
    )
    funcs = [lambda completions, **kwargs: [1.0] * len(completions)] * 2
    if not usable:
        with pytest.raises(ValueError, match="reward_weights"):
            RewardScorer(funcs, reward_weights=weights)
        return
    assert torch.isfinite(RewardScorer(funcs, reward_weights=weights).weights).all()


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_reward_model_scoring_nan_or_inf_is_refused_by_name(tokenizer, bad):
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )
    reward_model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        reward_model.score.weight.fill_(bad)
    scorer = RewardScorer([reward_model], [tokenizer])
    with pytest.raises(ValueError, match="Reward model 'Qwen2ForSequenceClassification' scored completion 0 (nan|inf)"):
        scorer.score(["p"] * 2, ["c"] * 2, [[1]] * 2, {}, None, torch.device("cpu"))


# ------------------------------------------------------------------------------------- rewards through the math
K, GROUPS = 4, 2
score_entries = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.sampled_from([3.4e38, -3.4e38, 1e38, -1e38, 1e-45, 0.0, 1.0, math.nan]),
)
reward_matrices = st.lists(st.lists(score_entries, min_size=2, max_size=2), min_size=K * GROUPS, max_size=K * GROUPS)


def advantages_or_refusal(scores_per_func, weights, valid, aggregation, scale):
    """The rollout's advantages as the trainer makes them (`RolloutScorer.combine_rewards` and `advantages`), or None
    where a ValueError refuses the scores."""
    if aggregation == "normalize_then_sum":
        return F.decoupled_advantages(scores_per_func, weights, K, valid)
    combined = (scores_per_func * weights).nansum(dim=1)
    if not torch.isfinite(combined).all():  # combine_rewards refuses this (test below)
        return None
    try:
        return F.group_advantages(combined, K, valid, scale)
    except ValueError as error:
        assert scale == "none" and "scale_rewards='none'" in str(error)
        return None


@fuzz(150)
@given(
    reward_matrices,
    st.lists(st.sampled_from([1.0, 0.5, -2.0, 1e30, 3e38]), min_size=2, max_size=2),
    st.lists(st.booleans(), min_size=K * GROUPS, max_size=K * GROUPS),
    st.sampled_from(["sum_then_normalize", "normalize_then_sum"]),
    st.sampled_from(F.SCALE_REWARDS),
    st.sampled_from(["tpo", *F.POLICY_GRADIENT_LOSSES]),
    st.floats(min_value=0.05, max_value=4.0),
)
def test_rewards_of_any_size_give_finite_advantages_targets_losses_and_gradients(
    matrix, weights, valid, aggregation, scale, loss_type, eta
):
    """NaN stands for None (not scored); every other value is a finite float32, as `check_reward_output` lets
    through: the advantages, TPO's targets, every loss and its gradient are finite, or the scores are refused."""
    scores_per_func, weights = torch.tensor(matrix), torch.tensor(weights)
    valid = torch.tensor(valid)
    u = advantages_or_refusal(scores_per_func, weights, valid, aggregation, scale)
    if u is None:
        return
    assert torch.isfinite(u).all(), u
    if scale != "none" or aggregation == "normalize_then_sum":
        assert u.abs().max() <= math.sqrt(K * GROUPS) + 1e-3  # a z-score: at most sqrt(n) for n values
    generator = torch.Generator().manual_seed(0)
    per_token_logps = (-torch.rand(K * GROUPS, 3, generator=generator)).requires_grad_()
    old_logps = per_token_logps.detach() - 0.1 * torch.rand(K * GROUPS, 3, generator=generator)
    mask = torch.ones(K * GROUPS, 3)
    if loss_type == "tpo":
        old_sequence = F.sequence_logps(old_logps, mask)
        try:
            q = F.tpo_targets(old_sequence, u, K, valid, eta)
        except ValueError as error:  # u / eta overflows: refused, naming the temperature
            assert "temperature" in str(error)
            return
        assert torch.isfinite(q).all()
        loss = F.tpo_loss(F.sequence_logps(per_token_logps, mask), q, K, valid)
    else:
        loss = F.policy_gradient_loss(per_token_logps, old_logps, u, mask, loss_type, max_completion_length=3)
    if scale == "none" and not torch.isfinite(loss):
        return  # advantages in the rewards' units overflow the loss: the trainer stops on a non-finite loss
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(per_token_logps.grad).all()


def test_whitening_huge_and_tiny_scores_gives_their_z_scores():
    """Scores near float32's largest overflowed the group's sum (NaN advantages); tiny ones underflowed."""
    for scale in ("group", "batch"):
        u = F.group_advantages(torch.tensor([3e38, 3e38, -3e38, 0.0]), 4, scale=scale)
        torch.testing.assert_close(u, F.group_advantages(torch.tensor([3.0, 3.0, -3.0, 0.0]), 4, scale=scale))
    torch.testing.assert_close(F.group_advantages(torch.tensor([1e-45, 0.0, 0.0, 0.0]), 4),
                               F.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4))
    # The batch's spread of 1e20-sized scores overflowed its square: every advantage was 0.
    u = F.group_advantages(torch.tensor([1e20, 0.0, 0.0, 0.0]), 4, scale="batch")
    torch.testing.assert_close(u, F.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, scale="batch"))
    with pytest.raises(ValueError, match="scale_rewards='none'.*overflows"):
        F.group_advantages(torch.tensor([3e38, 3e38, 3e38, -3e38]), 4, scale="none")
    # Huge reward weights in normalize_then_sum no longer overflow the weighted sum.
    columns = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [2.0, 0.0]])
    torch.testing.assert_close(F.decoupled_advantages(columns, torch.tensor([3e38, 3e38]), 4),
                               F.decoupled_advantages(columns, torch.tensor([1.0, 1.0]), 4))


# ----------------------------------------------------------------------------------------- a few training steps
@pytest.fixture(scope="module")
def fuzzed_reward_trainer(tmp_path_factory):
    """One trainer whose reward function returns whatever the test puts in `returns` (cycled over completions)."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    returns = {"values": [0.0]}

    def drawn(completions, **kwargs):
        values = itertools.cycle(returns["values"])
        return [next(values) for _ in completions]

    words = ["cat", "dog", "sun", "map", "pen", "cup", "box", "hat"]
    dataset = Dataset.from_dict({"prompt": [f"Say {word}:" for word in words]})
    args = make_config(tmp_path_factory.mktemp("fuzzed"), max_steps=1, max_completion_length=4)
    trainer = TargetPOTrainer(model, drawn, args=args, train_dataset=dataset, processing_class=tokenizer)
    return trainer, returns


@fuzz(5)
@given(st.lists(st.one_of(st.none(), st.sampled_from([3.4e38, -3.4e38, 1e30, -1e-45, 0.0, 7.0]), st.floats(
    width=32, allow_nan=False, allow_infinity=False)), min_size=1, max_size=8))
def test_training_on_any_finite_rewards_keeps_every_weight_finite(fuzzed_reward_trainer, values):
    trainer, returns = fuzzed_reward_trainer
    returns["values"] = values
    trainer.args.max_steps = trainer.state.global_step + 1
    trainer.train()
    assert all(torch.isfinite(parameter).all() for parameter in trainer.model.parameters())


@pytest.mark.parametrize(
    "values, message",
    [
        ([1e300], "returned 1e\\+300 for completion 0; scores are float32"),
        ([math.inf], "returned inf for completion 0; scores must be finite"),
        (["1"], "returned '1' \\(str\\)"),
    ],
)
def test_training_on_refused_rewards_stops_naming_the_function(fuzzed_reward_trainer, values, message):
    trainer, returns = fuzzed_reward_trainer
    returns["values"] = values
    trainer.args.max_steps = trainer.state.global_step + 1
    before = [parameter.detach().clone() for parameter in trainer.model.parameters()]
    with pytest.raises(ValueError, match=f"Reward function 'drawn' {message}"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_a_weighted_sum_of_rewards_that_overflows_is_refused(tmp_path, tiny_model, tokenizer, prompt_dataset):
    def huge(completions, **kwargs):
        return [3e38] * len(completions)

    args = make_config(tmp_path, max_steps=1)
    trainer = TargetPOTrainer(tiny_model, [huge, huge], args=args, train_dataset=prompt_dataset,
                              processing_class=tokenizer)
    with pytest.raises(ValueError, match="weighted sum of the rewards of completion 0 overflows float32"):
        trainer.train()


# ----------------------------------------------------------------------------------- tool calls and tool results
@pytest.fixture(scope="module")
def tool_parts():
    tokenizer = hermes_tokenizer()
    toolbox = Toolbox([add])
    template = ConversationTemplate(tokenizer, toolbox.schemas, [tokenizer.eos_token_id])
    runner = AsyncRunner()
    yield template, toolbox, runner
    runner.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
call_bodies = st.one_of(
    st.text(max_size=30),
    json_values.map(json.dumps),
    st.builds(
        lambda name, arguments: json.dumps({"name": name, "arguments": arguments}),
        st.sampled_from(["add", "nope", ""]) | st.text(max_size=5),
        json_values | st.fixed_dictionaries({"a": json_values, "b": json_values}),
    ),
)


@fuzz(200)
@given(st.text(max_size=10), call_bodies, st.booleans())
def test_any_turn_text_becomes_calls_or_an_error_the_model_reads(tool_parts, before, body, closed):
    template, toolbox, runner = tool_parts
    text = before + "<tool_call>" + body + ("</tool_call>" if closed else "")
    message, malformed = template.parse(text, "<user>x<assistant>")
    if malformed is not None:
        assert malformed.startswith("Error: the tool call could not be read")
        return
    for call in message.get("tool_calls", []):
        (outcome,) = run_tool_calls([(toolbox, call)], runner)
        content = outcome.message["content"]
        assert outcome.message["role"] == "tool" and isinstance(content, str)
        if outcome.failed:
            assert content.startswith("Error: ") and len(content) > len("Error: ")
        else:
            assert call["function"]["name"] == "add" and content == json.dumps(add(**call["function"]["arguments"]))


@fuzz(100)
@given(
    st.one_of(
        st.just(None),
        st.text(max_size=5),
        json_values,
        st.builds(dict, function=st.one_of(json_values, st.fixed_dictionaries({"name": json_values}))),
        st.builds(
            lambda name, arguments: {"type": "function", "function": {"name": name, "arguments": arguments}},
            st.sampled_from(["add", "nope"]),
            st.one_of(json_values, st.text(max_size=8), st.fixed_dictionaries({"a": json_values, "b": json_values})),
        ),
    )
)
def test_any_call_record_is_run_or_answered_with_what_is_wrong(tool_parts, call):
    _, toolbox, runner = tool_parts
    (outcome,) = run_tool_calls([(toolbox, call)], runner)
    content = outcome.message["content"]
    assert isinstance(content, str)
    if outcome.failed:
        assert any(
            problem in content
            for problem in ("needs a function name", "no tool named", "not valid JSON", "must be an object",
                            "wrong arguments", "add raised")
        ), content


class Unwritable:
    def __str__(self):
        raise RuntimeError("no text")

    __repr__ = __str__


class ErrorWithoutMessage(Exception):
    def __str__(self):
        raise RuntimeError("no text")


def nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


def circular():
    value = []
    value.append(value)
    return value


@fuzz(40)
@given(
    st.one_of(
        json_values,
        st.binary(max_size=8),
        st.sets(st.integers(), max_size=3),
        st.dictionaries(st.tuples(st.integers(), st.integers()), st.integers(), max_size=2),
        st.sampled_from(["x" * 200_000, math.nan, Unwritable(), nested(5000), circular(), ErrorWithoutMessage()]),
    )
)
def test_any_tool_result_becomes_a_tool_message(tool_parts, result):
    """A result that cannot be written as text (its str() fails, or it nests too deep) fails the call with an error
    the model reads, as does an exception whose message fails."""
    _, _, runner = tool_parts

    def tool(text: str) -> str:
        """Return the drawn result.

        Args:
            text: anything.
        """
        if isinstance(result, Exception):
            raise result
        return result

    call = {"type": "function", "function": {"name": "tool", "arguments": {"text": "a"}}}
    (outcome,) = run_tool_calls([(Toolbox([tool]), call)], runner)
    content = outcome.message["content"]
    assert isinstance(content, str) and content
    if isinstance(result, (Unwritable, list)) and outcome.failed:
        assert content.startswith("Error: tool returned a") and "cannot be written as text" in content
    if isinstance(result, ErrorWithoutMessage):
        assert outcome.failed and content.startswith("Error: tool raised ErrorWithoutMessage")


# ----------------------------------------------------------------------------------------------------------- rows
messages = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=8)}),
    st.dictionaries(st.sampled_from(["role", "content", "name"]), json_values, max_size=3),
    st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.lists(st.dictionaries(st.sampled_from(["type", "text"]),
                                                                      st.sampled_from(["text", "image", "x"])),
                                                      max_size=2)}
    ),
    json_values,
)
prompts = st.one_of(st.text(max_size=12), st.lists(messages, max_size=3), json_values)


@pytest.fixture(scope="module")
def prompt_encoder():
    tokenizer = build_char_tokenizer()
    limit = PromptLimit(64, 6, 128)
    return PromptEncoder(tokenizer, None, [], None, limit, tokenizer.pad_token_id, torch.device("cpu"),
                         lambda what: contextlib.nullcontext(), images_allowed=False)


@fuzz(150)
@given(st.lists(prompts, min_size=1, max_size=3))
def test_any_rows_are_refused_by_row_or_encoded(prompt_encoder, row_prompts):
    rows = [{"prompt": prompt} for prompt in row_prompts]
    tokenizer = prompt_encoder.tokenizer
    try:
        validate_prompt_dataset(rows, "train", tokenizer)
    except ValueError as error:
        assert str(error).startswith("The train dataset"), error
        return
    encoded = prompt_encoder.encode(rows)
    assert encoded.ids.shape[0] == len(rows) and encoded.mask.sum(dim=1).min() > 0


# -------------------------------------------------------------------------------------------------------- configs
FIELDS = ["tpo_target_temperature", "num_generations", "temperature", "learning_rate", "epsilon",
          "max_completion_length", "top_p", "beta", "num_iterations"]
values = st.one_of(
    st.integers(min_value=-3, max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 0.5, -1.0, math.inf, -math.inf, math.nan, True, None, "2", "x", [1]]),
)


@fuzz(150)
@given(st.sampled_from(FIELDS), values)
def test_a_config_value_builds_or_is_refused_naming_its_field(tmp_path_factory, field, value):
    settings = {"output_dir": str(tmp_path_factory.getbasetemp() / "config"), "report_to": "none",
                "per_device_train_batch_size": 8, "num_generations": 4, field: value}
    try:
        config = TargetPOConfig(**settings)
    except (ValueError, TypeError) as error:
        assert field in str(error), (field, value, error)
        return
    assert math.isfinite(getattr(config, field)), (field, value)
