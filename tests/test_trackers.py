"""``report_to`` with wandb and trackio: the metrics and the completions table reach both, offline.

Neither package is a dependency of targetpo: each test is skipped, saying so, when its tracker is not installed.
wandb runs with ``WANDB_MODE=offline`` (its run folder holds each logged table as JSON); trackio keeps its runs in a
local SQLite database. Both are real: nothing is mocked.
"""

import json
import math
import re
import sqlite3
import time
from pathlib import Path

import pytest
from conftest import make_config

from targetpo import TargetPOTrainer
from targetpo.demo import (
    binary_only_generation_kwargs,
    build_tiny_causal_lm,
    exact_reversal_reward,
    reverse_task_dataset,
    reverse_task_tokenizer,
)


def train_reporting_to(tracker, tmp_path, seen):
    """Two steps of the reversal task, one rollout per step, logged to ``tracker`` with the completions table;
    ``seen`` collects each rollout's table as the trainer holds it."""
    tokenizer = reverse_task_tokenizer()
    args = make_config(
        tmp_path / "out", max_steps=2, logging_steps=1, per_device_train_batch_size=16, num_generations=8,
        max_completion_length=6, max_prompt_length=7, generation_kwargs=binary_only_generation_kwargs(tokenizer),
        log_completions=True, num_completions_to_print=1, report_to=[tracker], run_name="tables",
        project="targetpo-tables", learning_rate=0.05,
    )
    trainer = TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, seed=0), exact_reversal_reward, args=args,
        train_dataset=reverse_task_dataset(num_prompts=64), processing_class=tokenizer,
    )
    original = trainer.log

    def log(logs, *rest):
        original(logs, *rest)
        if "loss" in logs:
            table = trainer._completion_table
            seen.append({"completion": list(table.completions), "reward": list(table.total_rewards)})

    trainer.log = log
    trainer.train()
    return trainer


def assert_tables(tables, seen):
    """One table per rollout, each holding that rollout's completions and rewards in order."""
    assert len(tables) == len(seen) == 2
    for table, expected in zip(tables, seen):
        assert table["completion"] == expected["completion"]
        assert table["reward"] == pytest.approx(expected["reward"])
    assert tables[0]["completion"] != tables[1]["completion"]


def test_wandb_gets_the_metrics_and_one_completions_table_per_rollout(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    seen = []
    trainer = train_reporting_to("wandb", tmp_path, seen)
    wandb.finish()
    (run,) = Path(tmp_path, "wandb").glob("offline-run-*")
    deadline = time.monotonic() + 30  # wandb's service process writes the table files a moment later
    tables = "files/media/table/completions_*.table.json"
    while len(files := list(run.glob(tables))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    files.sort(key=lambda path: int(path.name.split("_")[1]))  # named by wandb's own step
    tables = []
    for path in files:
        table = json.loads(path.read_text())
        columns = [list(column) for column in zip(*table["data"])]
        tables.append(dict(zip(table["columns"], columns)))
    assert_tables(tables, seen)
    # The metrics (transformers' callback logs them; offline, wandb has no reader for its run file): each history
    # item is a protobuf pair of key and JSON value.
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    for name in ("reward", "tpo/informative_group_fraction", "completions/mean_length"):
        values = {round(value, 5) for value in wandb_history(run, f"train/{name}")}
        assert values == {round(entry[name], 5) for entry in logged}, name


def wandb_history(run, key, timeout=30):
    """The values logged under ``key`` in an offline wandb run's file, once wandb's service has written them."""
    pattern = rb"\x12" + re.escape(bytes([len(key)]) + key.encode()) + rb"\x82\x01.([^\x00-\x1f]+)"
    deadline = time.monotonic() + timeout
    path = next(run.glob("run-*.wandb"))
    while not (found := re.findall(pattern, path.read_bytes())) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [float(value) for value in found]


def test_trackio_gets_the_metrics_and_one_completions_table_per_rollout_at_the_metrics_step(tmp_path, monkeypatch):
    pytest.importorskip("trackio", reason="trackio is not installed (pip install trackio)")
    from trackio import sqlite_storage, utils

    # trackio reads TRACKIO_DIR once, when imported; its database goes where its storage module says.
    for module in (utils, sqlite_storage):
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    seen = []
    trainer = train_reporting_to("trackio", tmp_path, seen)
    database = sqlite_storage.SQLiteStorage.get_project_db_path("targetpo-tables")
    assert database.parent == tmp_path / "trackio"
    rows = [(step, json.loads(metrics)) for step, metrics in sqlite3.connect(database).execute(
        "select step, metrics from metrics order by id")]
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    metric_steps = {metrics["train/global_step"]: step for step, metrics in rows if "train/reward" in metrics}
    assert [metrics["train/reward"] for _, metrics in rows if "train/reward" in metrics] == pytest.approx(
        [entry["reward"] for entry in logged]
    )
    tables = [(step, metrics["completions"]["_value"]) for step, metrics in rows if "completions" in metrics]
    assert_tables([{key: [row[key] for row in table] for key in ("completion", "reward")} for _, table in tables], seen)
    # Each table sits at the step of the metrics it was logged with, so trackio's steps stay one per log.
    assert [step for step, _ in tables] == [metric_steps[1], metric_steps[2]]
    assert all(not math.isnan(entry["loss"]) for entry in logged)
