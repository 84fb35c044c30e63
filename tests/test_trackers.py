"""``report_to`` with wandb, trackio and tensorboard: the metrics reach each, and the completions table wandb and
trackio, offline.

None of them is a dependency of targetpo (wandb and tensorboard come with the `test` extra): each test is skipped,
saying so, when its tracker is not installed. wandb runs with ``WANDB_MODE=offline`` (its run folder holds each logged
table as JSON); trackio keeps its runs in a local SQLite database; tensorboard writes event files, read back here with
tensorboard's own reader. All are real: nothing is mocked.
"""

import json
import math
import sqlite3
import struct
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
            table = trainer._completions.table
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
    # The metrics, as transformers' callback logged them (offline, wandb keeps them only in its run file).
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    history = wandb_history(next(run.glob("run-*.wandb")))
    for name in ("reward", "tpo/informative_group_fraction", "completions/mean_length"):
        values = [round(float(step[f"train/{name}"]), 5) for step in history if f"train/{name}" in step]
        assert values == [round(entry[name], 5) for entry in logged], name


def wandb_history(path, timeout=30):
    """The history rows of an offline wandb run file, each a dict of key to JSON text, read once wandb's service has
    written the run's exit record.

    The file is a LevelDB-style log (wandb has no public reader for it): a 7-byte wandb header, then 32 KiB blocks of
    chunks, each a 7-byte header (crc32, little-endian length, kind: 1 whole, 2 first, 3 middle, 4 last) and its
    bytes; the joined chunks of a record are one of wandb's own protobuf ``Record`` messages.
    """
    from wandb.proto.wandb_internal_pb2 import Record

    deadline = time.monotonic() + timeout
    while True:
        records, data, position, pending = [], path.read_bytes(), 7, b""
        while position + 7 <= len(data):
            if (room := 32768 - position % 32768) < 7:  # a block's tail too short for a header is padding
                position += room
                continue
            _, length, kind = struct.unpack("<IHB", data[position : position + 7])
            if kind == 0:
                break
            pending += data[position + 7 : position + 7 + length]
            position += 7 + length
            if kind in (1, 4):
                records.append(Record.FromString(pending))
                pending = b""
        if any(record.HasField("exit") for record in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [
        {item.key or ".".join(item.nested_key): item.value_json for item in record.history.item}
        for record in records
        if record.HasField("history")
    ]


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


def test_tensorboard_gets_every_metric_at_its_step_in_the_output_dir(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = train_reporting_to("tensorboard", tmp_path, [])
    (run,) = Path(trainer.args.output_dir, "runs").iterdir()  # transformers' default: <output_dir>/runs/<date>_<host>
    events = EventAccumulator(str(run))
    events.Reload()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2
    numbers = [name for name, value in logged[0].items() if name != "step" and isinstance(value, (int, float))]
    assert {"reward", "tpo/informative_group_fraction", "completions/mean_length"} <= set(numbers)
    assert {f"train/{name}" for name in numbers} <= set(events.Tags()["scalars"])
    for name in numbers:  # every log that held it (`epoch` is in the run's closing summary too)
        expected = [(entry["step"], entry[name]) for entry in trainer.state.log_history if name in entry]
        scalars = [(scalar.step, scalar.value) for scalar in events.Scalars(f"train/{name}")]
        assert [step for step, _ in scalars] == [step for step, _ in expected], name
        assert [value for _, value in scalars] == pytest.approx([value for _, value in expected], rel=1e-6), name
