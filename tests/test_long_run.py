"""A long run stays flat, at a small scale: train()/evaluate() cycles in one process, and trainers built and closed
(or dropped) in turn, leave no rollout backend, thread, open file or socket behind; trainer_state.json grows only by
its logged lines. ``benchmarks/long_run.py`` records the same counts, and resident memory, over thousands of steps.

Counts are taken after a warm-up cycle: the first one starts threads that then stay (torch's, the tools' event loop
while a trainer that evaluated lives), and each later cycle must leave exactly as many.
"""

import gc
import json
import threading
import time

import pytest
from conftest import make_config
from multi_turn_workers import ScriptedPolicy, halving_search
from process_counts import descriptors, os_threads

from targetpo import TargetPOTrainer
from targetpo.demo import (
    GuessingGame,
    binary_only_generation_kwargs,
    build_tiny_causal_lm,
    digits_only_generation_kwargs,
    exact_reversal_reward,
    guessing_dataset,
    guessing_tokenizer,
    reverse_task_dataset,
    reverse_task_tokenizer,
)
from targetpo.generation import TransformersBackend

#: The tools' event loop thread (episodes/async_runner.py).
TOOLS_THREAD = "targetpo-tools"


@pytest.fixture
def open_backends(monkeypatch):
    """The rollout backends built during the test and not closed yet (a trainer closes what it built at close(), or
    when it is collected)."""
    opened = set()
    build, close = TransformersBackend.__init__, TransformersBackend.close

    def counted_build(self, *args, **kwargs):
        build(self, *args, **kwargs)
        opened.add(self)

    def counted_close(self):
        opened.discard(self)
        close(self)

    monkeypatch.setattr(TransformersBackend, "__init__", counted_build)
    monkeypatch.setattr(TransformersBackend, "close", counted_close)
    return opened


def resources(open_backends: set) -> dict:
    """What a leak would grow: Python threads by name, the OS's threads, open files, sockets, open rollout backends."""
    gc.collect()  # trainers let go of are collected, and close what they built
    open_files, sockets = descriptors()
    return {
        "threads": sorted(thread.name for thread in threading.enumerate()),
        "os_threads": os_threads(),
        "open_files": open_files,
        "sockets": sockets,
        "open_backends": len(open_backends),
    }


def settled(expected: dict, open_backends: set, timeout: float = 10.0) -> dict:
    """The resources once they equal ``expected``, or as they are after ``timeout`` seconds: a loop stopped by a
    finalizer (a trainer collected) ends its thread a moment later."""
    deadline = time.monotonic() + timeout
    while (now := resources(open_backends)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def reverse_trainer(tmp_path, **overrides):
    tokenizer = reverse_task_tokenizer()
    settings = dict(
        max_completion_length=4, max_prompt_length=5, generation_kwargs=binary_only_generation_kwargs(tokenizer),
        per_device_eval_batch_size=4, use_cpu=True,
    )
    settings.update(overrides)
    return TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=32),
        exact_reversal_reward,
        args=make_config(tmp_path, **settings),
        train_dataset=reverse_task_dataset(4, num_prompts=64),
        eval_dataset=reverse_task_dataset(4, num_prompts=4, seed=1),
        processing_class=tokenizer,
    )


def guessing_trainer(tmp_path):
    """The guessing game played by the halving search, so every game calls the tool; a timeout runs the calls on the
    tools' event loop, the thread that must not multiply."""
    tokenizer = guessing_tokenizer()
    trainer = TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128),
        None,
        args=make_config(
            tmp_path, max_completion_length=20, max_tool_calling_iterations=3, tool_call_timeout=30,
            generation_kwargs=digits_only_generation_kwargs(tokenizer), per_device_eval_batch_size=4, use_cpu=True,
        ),
        train_dataset=guessing_dataset(num_prompts=64),
        eval_dataset=guessing_dataset(num_prompts=4, seed=1),
        processing_class=tokenizer,
        environment_factory=GuessingGame,
    )
    trainer.rollout_backend = ScriptedPolicy(tokenizer, halving_search)
    return trainer


def cycle(trainer) -> None:
    """One train() of max_steps steps, then one evaluate(); the log holds exactly their lines."""
    trainer.train()
    trainer.evaluate()
    steps = trainer.args.max_steps
    assert [entry["step"] for entry in trainer.state.log_history] == [*range(1, steps + 1), steps, steps]


def test_twenty_train_and_evaluate_cycles_leave_no_backend_thread_file_or_socket_behind(tmp_path, open_backends):
    trainer = reverse_trainer(tmp_path)
    cycle(trainer)
    warm = resources(open_backends)
    assert warm["open_backends"] == 1  # the one built at the first rollout, used by every cycle after it
    for _ in range(19):
        cycle(trainer)
    assert resources(open_backends) == warm
    trainer.close()
    assert resources(open_backends) == {**warm, "open_backends": 0}


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "dropped"])
def test_trainers_built_in_turn_leave_nothing_behind_whether_closed_or_dropped(tmp_path, closed, open_backends):
    def build_use_and_let_go():
        trainer = reverse_trainer(tmp_path)
        cycle(trainer)
        if closed:
            trainer.close()

    build_use_and_let_go()
    warm = resources(open_backends)
    for _ in range(4):
        build_use_and_let_go()
    assert resources(open_backends) == warm
    assert warm["open_backends"] == 0


def test_cycles_with_tools_keep_one_tools_thread_and_closed_or_dropped_trainers_none(tmp_path, open_backends):
    trainer = guessing_trainer(tmp_path)
    cycle(trainer)
    assert trainer.state.log_history[0]["tools/call_frequency"] > 1  # the calls ran, on the tools' thread
    warm = resources(open_backends)
    # evaluate() leaves the loop up for the next rollout: one thread and its loop's two sockets (a self-pipe pair).
    assert warm["threads"].count(TOOLS_THREAD) == 1 and warm["sockets"] == 2
    for _ in range(4):
        cycle(trainer)
        assert resources(open_backends) == warm
    trainer.close()
    released = {**warm, "threads": [name for name in warm["threads"] if name != TOOLS_THREAD], "sockets": 0,
                "open_backends": 0}  # the one the trainer built before it was handed the scripted policy
    released["open_files"] -= 3  # the two sockets and the loop's selector
    released["os_threads"] -= 1
    assert resources(open_backends) == released  # close() ends it while the trainer still lives
    for closed in (True, False):  # the user's close(), or the trainer collected once nothing refers to it
        trainer = guessing_trainer(tmp_path)
        cycle(trainer)
        if closed:
            trainer.close()
        del trainer
        assert settled(released, open_backends) == released


def test_trainer_state_grows_only_by_its_logged_lines(tmp_path):
    def saved_state(steps: int) -> dict:
        trainer = reverse_trainer(tmp_path / str(steps), max_steps=steps, logging_steps=1)
        trainer.train()
        trainer.save_state()
        trainer.close()
        return json.loads((tmp_path / str(steps) / "out" / "trainer_state.json").read_text())

    def shape(value):
        """The state's structure: every list's length and every key, not the numbers."""
        if isinstance(value, dict):
            return {key: shape(item) for key, item in value.items()}
        if isinstance(value, list):
            return [shape(item) for item in value]
        return type(value).__name__

    short, long = saved_state(2), saved_state(8)
    # One line per logged step, and the run's summary.
    assert [entry["step"] for entry in long["log_history"]] == [*range(1, 9), 8]
    # Each line is flat, numbers by name (which names depends on the step's groups), so no line grows either.
    assert all(isinstance(value, (int, float)) for entry in long["log_history"] for value in entry.values())
    short.pop("log_history"), long.pop("log_history")
    assert shape(long) == shape(short)  # nothing else in the state grows with the steps
