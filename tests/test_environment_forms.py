"""Every form of environment a TRL script passes: one factory, a dict of named factories chosen per row by the
``environment`` column, environments that make up their own prompts (no train_dataset, or rows that only name their
environment), environments that score themselves (no reward_funcs), and the errors when something is missing; a
``model.generate`` patched to force tool calls, as TRL scripts do; calls that cannot be read; TRL's documented
environment example with only its import changed.

The model's turns come from ``ScriptedPolicy`` on Qwen3's template (``test_chat_templates``), or from a patched
``model.generate`` writing fixed turns: a random tiny model does not make tool calls. The environments, their tools
and rewards, the template and the trainer are real.
"""

import copy
import itertools
import json
import math
import random
import re
from unittest.mock import patch

import pytest
import torch
from conftest import changed, make_config, snapshot
from datasets import Dataset
from multi_turn_workers import ScriptedPolicy
from test_chat_templates import EOS, qwen3_call, qwen3_halving_search, qwen3_tokenizer, think, tiny_qwen3

from targetpo import TargetPOTrainer
from targetpo.demo import GuessingGame
from targetpo.generation.transformers_backend import PLAIN_TENSOR_OUTPUT


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


def qwen3_trainer(tmp_path, environment_factory, train_dataset=None, reward_funcs=None, policy=None,
                  eval_dataset=None, tools=None, **overrides):
    settings = dict(max_completion_length=600, max_prompt_length=None, max_tool_calling_iterations=3,
                    per_device_train_batch_size=8, num_generations=2, max_steps=1, shuffle_dataset=False)
    settings.update(overrides)
    tokenizer = qwen3_tokenizer()
    trainer = TargetPOTrainer(
        tiny_qwen3(tokenizer), reward_funcs, args=make_config(tmp_path, **settings), train_dataset=train_dataset,
        eval_dataset=eval_dataset, processing_class=tokenizer, environment_factory=environment_factory, tools=tools,
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
        qwen3_trainer(tmp_path, environments, None)
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


class MadeUpCount(Counter):
    """The counter making up its own target."""

    def reset(self, **row):
        self.columns = set(row)
        self.target, self.count = 2, 0
        return "Count to 2."


@pytest.mark.parametrize("stream", [False, True], ids=["map-style", "stream"])
def test_rows_that_only_name_their_environment_take_their_prompts_from_reset(tmp_path, stream):
    """A dataset of one `environment` column and no `prompt`: each row's environment makes up its prompt in reset(),
    from an empty user message, as for an environment without a dataset."""
    prompts = []

    def policy(context):
        prompts.append(context[: context.index("<|im_start|>assistant")])
        return counting(context) if "Count to" in context else qwen3_halving_search(context)

    rows = Dataset.from_dict({"environment": ["game", "counter"] * 4})
    trainer = qwen3_trainer(tmp_path, {"game": MadeUpGame, "counter": MadeUpCount},
                            rows.to_iterable_dataset() if stream else rows, policy=policy)
    trainer.train()
    user_turns = {prompt.split("<|im_start|>user\n")[1] for prompt in prompts}
    assert user_turns == {f"Guess my digit.{EOS}\n", f"Count to 2.{EOS}\n"}  # reset's text alone
    # The first rollout's rows, K = 2 each: this process's environments, as they ended.
    assert [type(environment) for environment in trainer.environments] == [MadeUpGame, MadeUpGame, MadeUpCount,
                                                                           MadeUpCount] * 2
    counters = [environment for environment in trainer.environments if isinstance(environment, MadeUpCount)]
    assert all(counter.count == 2 and counter.columns == set() for counter in counters)  # no column reaches reset
    assert trainer.reward_func_names == ["MadeUpGame", "MadeUpCount"]
    logs = trainer.state.log_history[0]
    assert logs["rewards/MadeUpCount/mean"] == 1.0 and "rewards/MadeUpGame/mean" in logs


@pytest.mark.parametrize("case", ["one environment, no max_steps", "a dict of environments", "no environment"])
def test_set_ups_train_cannot_run_are_refused_when_the_trainer_is_built_unless_it_may_only_evaluate(tmp_path, case):
    """Without a train dataset, only one environment making up each prompt for max_steps steps can train. Anything
    else is refused when the trainer is built; given an eval dataset the trainer may still evaluate, and train()
    refuses the same way."""
    factory, message, evaluated = {
        "one environment, no max_steps": (
            MadeUpGame, r"No train_dataset: the environment makes up each prompt in reset.*max_steps", ["game"]
        ),
        "a dict of environments": (
            {"game": MadeUpGame, "counter": MadeUpCount}, r"a train_dataset must name each row's environment", ["game"]
        ),
        "no environment": (None, r"training requires a train_dataset", None),
    }[case]
    rewards = None if factory is not None else [lambda completions, **kwargs: [0.0] * len(completions)]
    with pytest.raises(ValueError, match=message):
        qwen3_trainer(tmp_path, factory, reward_funcs=rewards, max_steps=-1, num_train_epochs=1)
    eval_dataset = (Dataset.from_dict({"environment": evaluated * 2}) if evaluated
                    else Dataset.from_dict({"prompt": [[{"role": "user", "content": "Hi."}]] * 2}))
    trainer = qwen3_trainer(tmp_path, factory, reward_funcs=rewards, eval_dataset=eval_dataset, max_steps=-1,
                            num_train_epochs=1)
    with pytest.raises(ValueError, match=message):
        trainer.train()


def test_without_any_reward_source_the_trainer_says_so(tmp_path):
    class Unscored:
        def reset(self, **row):
            return None

    with pytest.raises(ValueError, match=r"No reward source: pass reward_funcs .* or an environment_factory whose "
                                         r"environments define get_reward\(\)"):
        qwen3_trainer(tmp_path, Unscored, two_environment_rows())


def test_an_evaluate_only_trainer_needs_no_train_dataset_and_checks_what_evaluate_is_given(tmp_path):
    environments = {"game": GuessingGame, "counter": Counter}
    games = two_environment_rows(("game",) * 4)
    trainer = qwen3_trainer(tmp_path, environments, None, policy=qwen3_halving_search, eval_dataset=games)
    metrics = trainer.evaluate(games)
    assert 0 <= metrics["eval_rewards/GuessingGame/mean"] <= 1
    with pytest.raises(ValueError, match=r"each row of the eval dataset names its environment in an `environment` "
                                         r"column, which it lacks"):
        trainer.evaluate(games.remove_columns("environment"))
    # A row that arrives without the column (a stream's are checked as they arrive) is named too.
    with pytest.raises(ValueError, match=r"names \[None\].*\(None: a row without the column\)"):
        trainer._environments.start(list(games.remove_columns("environment")))


# ---------------------------------------------------------------------------------- model.generate patched
def scripted_generate(tokenizer, turn):
    """A stand-in for ``model.generate`` as scripts patch it in to force tool calls: each row's context, then the
    turn ``turn(context, row)`` writes and EOS, right-padded; a plain tensor, whatever generate was asked for."""

    def generate(input_ids, attention_mask, **kwargs):
        turns = []
        for row, (ids, mask) in enumerate(zip(input_ids, attention_mask)):
            context = tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            turns.append(tokenizer(turn(context, row), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        width = max(len(ids) for ids in turns)
        padded = [ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids in turns]
        return torch.cat([input_ids, torch.tensor(padded, device=input_ids.device)], dim=-1)

    return generate


class StepCounter:
    """Counts the steps its tool is given; the count is the reward."""

    def reset(self, **row):
        self.count = 0
        return "Count."

    def increment(self, step: int) -> int:
        """Add to the count.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count)


def test_a_patched_generate_that_returns_bare_sequences_forces_tool_calls_and_trains(tmp_path):
    """The way scripts force tool calls: ``model.generate`` patched to return the context and a fixed turn, a plain
    tensor. Multi-turn rollouts read it as the sequences and, with no cache to continue, re-prefill each turn.
    Of each group of 3: a call that runs, a call of a tool that does not exist, no call."""
    first_turns = [qwen3_call("increment", step=1), qwen3_call("decrement", step=2), "No tools today."]

    def turn(context, row):
        return first_turns[row] if "<tool_response>" not in context else "Done."

    trainer = qwen3_trainer(tmp_path, StepCounter, per_device_train_batch_size=3, num_generations=3, max_steps=2,
                            learning_rate=0.1)
    assert trainer.reward_func_names == ["StepCounter"]
    assert trainer.environments is None  # before the first rollout
    before = snapshot(trainer.model)
    with patch.object(trainer.model, "generate", side_effect=scripted_generate(trainer.processing_class, turn)):
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [1, 2]
    for entry in logs:
        assert entry["tools/call_frequency"] == pytest.approx(2 / 3)
        assert entry["tools/failure_frequency"] == pytest.approx(1 / 2)
        assert entry["rewards/StepCounter/mean"] == pytest.approx(1 / 3)
    assert [environment.count for environment in trainer.environments] == [1, 0, 0]  # the last rollout's, reset
    assert trainer.rollout_backend.cache_reuse.fallback == PLAIN_TENSOR_OUTPUT
    assert changed(before, trainer.model)


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a * b


def test_a_call_that_cannot_be_read_is_answered_with_an_error_the_model_reads(tmp_path):
    """A turn that opens a call it does not write well (no tool name, arguments that are not JSON) is answered with
    a tool turn saying what is wrong, and the model writes another turn: a failed call, not the sample's end. Text
    that only looks like a call (a misspelt tag) is the model's answer."""
    first_turns = [
        '<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call>',
        '<toolcall>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</toolcall>',
        '<tool_call>\n{"name": "multiply", "arguments": {a: 3, b: 4}}\n</tool_call>',
    ]
    conversations = []

    def record(completions, **kwargs):
        conversations.extend(completions)
        return [0.0] * len(completions)

    def policy(context):
        return "Sorry." if "<tool_response>" in context else first_turns[int(re.search(r"Try (\d)", context)[1])]

    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Try {index}."}] for index in range(3)]})
    trainer = qwen3_trainer(tmp_path, None, rows, reward_funcs=[record], policy=policy, tools=[multiply],
                            per_device_train_batch_size=6)
    trainer.train()
    roles = [[message["role"] for message in conversation] for conversation in conversations]
    answered = ["assistant", "tool", "assistant"]
    assert roles == [answered] * 2 + [["assistant"]] * 2 + [answered] * 2
    answers = [conversation[1]["content"] for conversation in conversations if len(conversation) == 3]
    assert all(answer.startswith("Error: a tool call needs a function name") for answer in answers[:2])
    assert all(answer.startswith("Error: the tool call could not be read") for answer in answers[2:])
    logs = trainer.state.log_history[0]
    assert logs["tools/call_frequency"] == pytest.approx(4 / 6) and logs["tools/failure_frequency"] == 1.0


# ---------------------------------------------------------------------------------- a TRL script, ported
def test_trls_documented_environment_example_trains_with_only_the_import_changed(tmp_path, monkeypatch):
    """TRL's documented tool-environment example for GRPOTrainer, in its shape: an environment whose reset() makes
    up a target and returns the task, one public method as the tool, get_reward() as the reward; GRPOConfig with
    max_steps and chat_template_kwargs, no dataset, no reward functions, no output_dir. Only the import differs, the
    Hub model is a local stand-in, and its turns are scripted: every other sample steps straight to its target,
    the others overshoot it."""
    from targetpo import GRPOConfig, GRPOTrainer
    from targetpo.demo import save_tiny_chat_model

    monkeypatch.chdir(tmp_path)  # the config's default output_dir
    model = save_tiny_chat_model(tmp_path / "tiny-chat")

    class ReachTheTarget:
        def reset(self, **kwargs) -> str | None:
            self.total, self.target = 0, random.randint(1, 6)
            return f"Reach {self.target}."

        def get_reward(self) -> float:
            return float(self.total == self.target)

        def increment(self, step: int) -> int:
            """Add a step to the running total.

            Args:
                step: How much to add.

            Returns:
                The total so far.
            """
            self.total += step
            return self.total

    with pytest.warns(UserWarning, match=r"trains its loss_type='dapo'"):  # TRL's default loss, said out loud
        trainer = GRPOTrainer(
            model=model,
            args=GRPOConfig(max_steps=2, chat_template_kwargs={"enable_thinking": False}),
            environment_factory=ReachTheTarget,
        )

    first_turns = itertools.count()

    def policy(context):
        if "<tool>" in context:
            return "Done."
        target = int(re.search(r"Reach (\d)\.", context)[1])
        step = target + next(first_turns) % 2  # on target, or one past it
        return "<tool_call>" + json.dumps({"name": "increment", "arguments": {"step": step}}) + "</tool_call>"

    trainer.rollout_backend = ScriptedPolicy(trainer.processing_class, policy)
    trainer.train()
    assert trainer.state.global_step == 2 and math.isfinite(trainer.state.log_history[-1]["train_loss"])
    assert trainer.reward_func_names == ["ReachTheTarget"]
    environments = trainer.environments
    assert len(environments) == trainer.args.generation_batch_size  # the last rollout's, one per sample
    assert [environment.total - environment.target for environment in environments] == [0, 1] * 4
    assert [environment.get_reward() for environment in environments] == [1.0, 0.0] * 4


class Board:
    """A game that keeps the board its row gives it (a list of lists) and marks it in place."""

    def reset(self, board, **columns):
        self.board, self.given = board, copy.deepcopy(board)
        return " Mark a square."

    def mark(self, row: int, column: int) -> str:
        """Mark a square of the board.

        Args:
            row: The square's row.
            column: The square's column.
        """
        self.board[row][column] += 1
        return "marked"


class InMemoryRows(torch.utils.data.Dataset):
    """A torch Dataset that hands out the rows it holds, the same objects at every read, as most do."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]


@pytest.mark.parametrize("form", ["list", "torch"])
def test_each_sample_changes_its_own_copy_of_its_row(tmp_path, form):
    """An environment that changes a row value in place (a board) changes its own sample's copy: not its siblings'
    (the K samples of a prompt are served one dataset row), nor the dataset's, which later epochs and evaluation read
    again; a rollout's later uses (micro-steps) are still given the rows as they were read."""
    from targetpo.data import ROLLOUT_USE

    rows = [
        {"prompt": [{"role": "user", "content": f"Board {index}."}], "board": [[index, 0], [0, 0]]} for index in range(4)
    ]
    before = copy.deepcopy(rows)
    boards = [row["board"] for row in before]
    played, later_uses = [], []

    def record(completions, environments, **kwargs):
        played.extend((environment.given, copy.deepcopy(environment.board)) for environment in environments)
        return [0.0] * len(completions)

    def mark_once(context):
        return "done" if "<tool_response>" in context else think("mark") + qwen3_call("mark", row=0, column=1)

    # 4 prompts x K = 2 per rollout, over 2 micro-steps; 4 optimiser steps: 2 epochs.
    trainer = qwen3_trainer(
        tmp_path, Board, rows if form == "list" else InMemoryRows(rows), reward_funcs=[record], policy=mark_once,
        per_device_train_batch_size=4, steps_per_generation=2, max_steps=4, per_device_eval_batch_size=8,
    )  # fmt: skip
    prepare = trainer._prepare_inputs

    def recording(batch):
        later_uses.extend(copy.deepcopy(row["board"]) for row in batch if row.get(ROLLOUT_USE, 0) > 0)
        return prepare(batch)

    trainer._prepare_inputs = recording
    trainer.train()
    trainer.evaluate(rows if form == "list" else InMemoryRows(rows))
    assert len(played) == 3 * 8  # two epochs' rollouts, one evaluation's
    for given, marked in played:
        assert given in boards  # as the dataset holds it, in every epoch
        assert marked == [[given[0][0], 1], [0, 0]]  # its own mark only, none of its sibling's
    assert rows == before
    assert len(later_uses) == 2 * 8 and all(board in boards for board in later_uses)


def test_a_rows_images_and_values_that_cannot_be_copied_are_shared():
    """Images are only read (copying one costs milliseconds); a value deepcopy refuses is shared, and said so."""
    import threading

    from targetpo.rollout.sources import own_copies

    Image = pytest.importorskip("PIL.Image", reason="pillow makes the image")

    image, lock, board = Image.new("RGB", (4, 4)), threading.Lock(), [[0]]
    row = {"prompt": "p", "image": image, "board": board, "lock": lock}
    with pytest.warns(UserWarning, match="column 'lock' holds a value that cannot be deep-copied"):
        first, second = own_copies([row, row])
    assert first["image"] is image and first["lock"] is lock
    assert first["board"] == board and first["board"] is not board and first["board"] is not second["board"]


#: TRL's documented tool example for GRPOTrainer (its GRPO trainer docs, "Agent Training", "Tools"), as written there:
#: the ``...,`` stands for the rest of the trainer's arguments.
TRL_TOOL_EXAMPLE = '''\
from trl import GRPOTrainer

def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b

async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b

trainer = GRPOTrainer(
    tools=[multiply, async_add],
    ...,
)
'''


def test_trls_documented_tool_example_trains_with_only_trl_replaced(tmp_path):
    """The tool example with every ``trl`` made ``targetpo``, its ``...`` filled with a local model's path, a
    GRPOConfig, a dataset and a reward. Scripted turns call the sync tool, then the async one on its result; the reward reads the
    tool turns, so it is 1 only where both tools ran with the arguments the model wrote."""
    from targetpo import GRPOConfig

    code = TRL_TOOL_EXAMPLE.replace("trl", "targetpo")
    code = code.replace("    ...,\n", "    model=model, args=args, train_dataset=dataset, reward_funcs=reward,\n")
    tokenizer = qwen3_tokenizer()
    tiny_qwen3(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Use {index}."}] for index in range(4)]})

    def policy(context):
        product = re.findall(r"<tool_response>\n(\d+)\n</tool_response>", context)
        if not product:
            return think("multiply first") + qwen3_call("multiply", a=6, b=int(re.search(r"Use (\d)", context)[1]))
        return "Done." if len(product) == 2 else think("then add") + qwen3_call("async_add", a=int(product[0]), b=1)

    def reward(completions, prompts, **kwargs):
        sums = [[message["content"] for message in completion if message["role"] == "tool"] for completion in completions]
        wanted = [[str(6 * int(prompt[-1]["content"][4])), str(6 * int(prompt[-1]["content"][4]) + 1)] for prompt in prompts]
        return [float(got == want) for got, want in zip(sums, wanted)]

    namespace = {
        "model": str(tmp_path / "model"), "dataset": rows, "reward": reward,
        "args": GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8, num_generations=2,
                           max_completion_length=600, max_prompt_length=None, max_tool_calling_iterations=3,
                           report_to="none",
                           disable_tqdm=True, logging_steps=1),
    }  # fmt: skip
    with pytest.warns(UserWarning, match=r"trains its loss_type='dapo'"):
        exec(compile(code, "tool_example.py", "exec"), namespace)  # noqa: S102 - TRL's documented example, ported
    trainer = namespace["trainer"]
    trainer.rollout_backend = ScriptedPolicy(trainer.processing_class, policy, max_new_tokens=200)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["rewards/reward/mean"] == 1.0  # every sample: multiply's result, then async_add's on it
    assert logs["tools/call_frequency"] == 2.0 and logs["tools/failure_frequency"] == 0.0  # two calls a sample
