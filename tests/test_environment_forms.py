"""Every form of environment a TRL script passes: one factory, a dict of named factories chosen per row by the
``environment`` column, environments that make up their own prompts (no train_dataset), environments that score
themselves (no reward_funcs), and the errors when something is missing.

The model's turns come from ``ScriptedPolicy`` on Qwen3's template (``test_chat_templates``): a random tiny model
does not make tool calls. The environments, their tools and rewards, the template and the trainer are real.
"""

import re

import pytest
from conftest import make_config
from datasets import Dataset
from multi_turn_workers import ScriptedPolicy
from test_chat_templates import EOS, qwen3_call, qwen3_halving_search, qwen3_tokenizer, think, tiny_qwen3

from targetpo import TargetPOTrainer
from targetpo.demo import GuessingGame


class Counter:
    """Count up to a target: a call of ``increment`` adds one. Scores 1 for stopping exactly at the target."""

    def reset(self, target, **row):
        self.columns = set(row)  # what reset was given beside the target
        self.target, self.count = int(target), 0
        return f" Count to {target}."

    def increment(self) -> int:
        """Add one to the count and return it."""
        self.count += 1
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.target)


def counting(context):
    """Call ``increment`` until the count the tool returns reaches the target the prompt names."""
    target = int(re.search(r"Count to (\d)\.", context).group(1))
    counts = [int(count) for count in re.findall(r"<tool_response>\n(\d)\n</tool_response>", context)]
    return "done" if counts and counts[-1] >= target else think("one more") + qwen3_call("increment")


def two_environment_rows(names=("game", "counter") * 4):
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": "Play."}] for _ in names],
        "environment": list(names),
        "secret": [index % 8 for index in range(len(names))],
        "target": [1 + index % 3 for index in range(len(names))],
    })


def qwen3_trainer(tmp_path, environment_factory, train_dataset=None, reward_funcs=None, policy=None, **overrides):
    settings = dict(max_completion_length=600, max_prompt_length=None, max_tool_calling_iterations=3,
                    per_device_train_batch_size=8, num_generations=2, max_steps=1, shuffle_dataset=False)
    settings.update(overrides)
    tokenizer = qwen3_tokenizer()
    trainer = TargetPOTrainer(
        tiny_qwen3(tokenizer), reward_funcs, args=make_config(tmp_path, **settings), train_dataset=train_dataset,
        processing_class=tokenizer, environment_factory=environment_factory,
    )
    if policy is not None:
        trainer.rollout_backend = ScriptedPolicy(tokenizer, policy, max_new_tokens=200)
    return trainer


def test_a_dict_of_environments_gives_each_row_its_own_environment_tools_and_reward(tmp_path):
    contexts, seen = {}, []

    def policy(context):
        first = context[: context.index("<|im_start|>assistant")]
        contexts.setdefault(first, context)
        return counting(context) if "Count to" in context else qwen3_halving_search(context)

    def record(completions, environments, environment, **kwargs):
        seen.append((completions, environments, environment))
        return [0.0] * len(completions)

    trainer = qwen3_trainer(tmp_path, {"game": GuessingGame, "counter": Counter}, two_environment_rows(),
                            reward_funcs=[record], policy=policy)
    trainer.train()
    # Each prompt shows its own environment's tools alone (the two games' prompts are the same).
    assert len(contexts) == 3
    for context in contexts.values():
        shows_guess, shows_increment = '"name": "guess"' in context, '"name": "increment"' in context
        assert shows_guess != shows_increment and shows_increment == ("Count to" in context)
    conversations, environments, names = seen[0]
    assert names == ["game"] * 2 + ["counter"] * 2 + ["game"] * 2 + ["counter"] * 2  # the first 4 rows, K = 2
    for conversation, environment, name in zip(conversations, environments, names):
        assert type(environment) is {"game": GuessingGame, "counter": Counter}[name]
        calls = [m["tool_calls"][0]["function"]["name"] for m in conversation if m.get("tool_calls")]
        assert set(calls) == {"guess" if name == "game" else "increment"}
        if name == "counter":
            assert environment.count == environment.target  # its own tool moved its own state
            assert "environment" not in environment.columns  # the column that chose it is not passed to reset
    # Each class scores its own samples; the other environment's samples are left out of its mean.
    logs = trainer.state.log_history[0]
    games = [environment.found for environment in environments if isinstance(environment, GuessingGame)]
    assert logs["rewards/GuessingGame/mean"] == pytest.approx(sum(games) / len(games))
    assert logs["rewards/Counter/mean"] == 1.0


class NumberStore:
    """Stores what its one tool is given; the tool's name is the same in every subclass, its parameter's type not."""

    def reset(self, **row):
        self.stored = []
        return " Store 7."

    def get_reward(self) -> float:
        return float(bool(self.stored))


class IntegerStore(NumberStore):
    def store(self, value: int) -> str:
        """Store a value.

        Args:
            value: The value, a whole number.
        """
        self.stored.append(value)
        return "stored"


class TextStore(NumberStore):
    def store(self, value: str) -> str:
        """Store a value.

        Args:
            value: The value, as text.
        """
        self.stored.append(value)
        return "stored"


def test_each_rows_calls_are_read_against_its_own_environments_tools(tmp_path):
    """Two environments with a tool of the same name, one taking an integer, one text: the same call text reaches
    each with its own tool's type (arguments are cast to the calling tool's schema, not to the first one named so).
    A row whose environment has no tools was shown none: its turn is its answer, call-like text and all."""

    def store_once(context):
        return "done" if "<tool_response>" in context else think("store it") + qwen3_call("store", value="7")

    conversations = []

    def record(completions, **kwargs):
        conversations.extend(completions)
        return [0.0] * len(completions)

    rows = two_environment_rows(("integers", "texts", "plain", "integers") * 2)
    environments = {"integers": IntegerStore, "texts": TextStore, "plain": NumberStore}
    trainer = qwen3_trainer(tmp_path, environments, rows, reward_funcs=[record], policy=store_once)
    seen, original = [], trainer._environments.start

    def start(*args, **kwargs):
        environments, prompts, toolboxes = original(*args, **kwargs)
        seen.extend(environments)
        return environments, prompts, toolboxes

    trainer._environments.start = start
    trainer.train()
    kinds = [IntegerStore, TextStore, NumberStore, IntegerStore]
    assert [type(environment) for environment in seen] == [kind for kind in kinds for _ in range(2)]
    assert [environment.stored for environment in seen] == [[7], [7], ["7"], ["7"], [], [], [7], [7]]
    assert trainer.state.log_history[0]["rewards/TextStore/mean"] == 1.0
    for conversation, environment in zip(conversations, seen):
        if type(environment) is NumberStore:
            [answer] = conversation
            assert "tool_calls" not in answer and '"name": "store"' in answer["content"]
        else:
            assert [message["role"] for message in conversation] == ["assistant", "tool", "assistant"]


def test_an_environment_named_nowhere_or_an_unnamed_row_is_refused_before_any_work(tmp_path):
    environments = {"game": GuessingGame, "counter": Counter}
    with pytest.raises(ValueError, match=re.escape(
        "The `environment` column of the train dataset names ['maze'], which environment_factory does not have; its "
        "environments are ['game', 'counter']."
    )):
        qwen3_trainer(tmp_path, environments, two_environment_rows(("game", "maze") * 4))
    with pytest.raises(ValueError, match=r"each row of the train dataset names its environment in an `environment` "
                                         r"column, which it lacks"):
        qwen3_trainer(tmp_path, environments, two_environment_rows().remove_columns("environment"))
    with pytest.raises(ValueError, match=r"a train_dataset must name each row's environment"):
        qwen3_trainer(tmp_path, environments, None).train()
    with pytest.raises(ValueError, match=r"environment_factory\['counter'\]\) has no reset\(\) method"):
        qwen3_trainer(tmp_path, {"game": GuessingGame, "counter": object}, two_environment_rows())


def test_a_stream_naming_an_unknown_environment_is_refused_when_the_row_arrives(tmp_path):
    rows = two_environment_rows(("game", "maze") * 4).to_iterable_dataset()
    trainer = qwen3_trainer(tmp_path, {"game": GuessingGame, "counter": Counter}, rows, policy=qwen3_halving_search)
    with pytest.raises(ValueError, match=r"names \['maze'\], which environment_factory does not have"):
        trainer.train()


class MadeUpGame(GuessingGame):
    """The guessing game owning its data: reset picks the secret and writes the question."""

    resets = 0

    def reset(self, **row):
        MadeUpGame.resets += 1
        super().reset(secret=MadeUpGame.resets % 8)
        return "Guess my digit."


def test_an_environment_that_owns_the_data_and_the_reward_trains_without_a_dataset_or_reward_funcs(tmp_path):
    prompts = []

    def policy(context):
        prompts.append(context[: context.index("<|im_start|>assistant")])
        return qwen3_halving_search(context)

    trainer = qwen3_trainer(tmp_path, MadeUpGame, policy=policy, max_steps=2)
    trainer.train()
    assert len(trainer.train_dataset) == 4  # one rollout of prompts, read again for every rollout
    assert all(prompt.endswith(f"<|im_start|>user\nGuess my digit.{EOS}\n") for prompt in prompts)
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [1, 2]
    assert all("rewards/MadeUpGame/mean" in entry for entry in logs)


def test_without_a_dataset_max_steps_is_required_and_without_any_reward_source_the_trainer_says_so(tmp_path):
    trainer = qwen3_trainer(tmp_path, MadeUpGame, max_steps=-1, num_train_epochs=1)  # evaluate() may still be wanted
    with pytest.raises(ValueError, match=r"No train_dataset: the environment makes up each prompt in reset.*max_steps"):
        trainer.train()

    class Unscored:
        def reset(self, **row):
            return None

    with pytest.raises(ValueError, match=r"No reward source: pass reward_funcs .* or an environment_factory whose "
                                         r"environments define get_reward\(\)"):
        qwen3_trainer(tmp_path, Unscored, two_environment_rows())


def test_an_evaluate_only_trainer_needs_no_train_dataset_and_checks_what_evaluate_is_given(tmp_path):
    environments = {"game": GuessingGame, "counter": Counter}
    trainer = qwen3_trainer(tmp_path, environments, None, policy=qwen3_halving_search)  # no train_dataset: fine
    games = two_environment_rows(("game",) * 4)
    metrics = trainer.evaluate(games)
    assert 0 <= metrics["eval_rewards/GuessingGame/mean"] <= 1
    with pytest.raises(ValueError, match=r"each row of the eval dataset names its environment in an `environment` "
                                         r"column, which it lacks"):
        trainer.evaluate(games.remove_columns("environment"))
    # A row that arrives without the column (a stream's are checked as they arrive) is named too.
    with pytest.raises(ValueError, match=r"names \[None\].*\(None: a row without the column\)"):
        trainer._environments.start(list(games.remove_columns("environment")))
