"""A checkpoint is whole or absent: a write that fails part-way (a full disk) or is stopped (a crash) leaves the
earlier checkpoints intact and resumable, never a half-written ``checkpoint-N``; ``save_total_limit`` removes an old
checkpoint only once the new one is in place; what a stopped save left is never resumed from, and is cleared.

A full disk is made for real where this machine lets an unprivileged user mount a small tmpfs (``unshare -rm``).
Elsewhere the write fails at the boundary where a full disk shows: the optimizer's ``torch.save`` writes part of its
file, then raises ``OSError(ENOSPC)``. That is the one thing replaced; the model, trainer and files are real.
"""

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import letters_then_position_reward, make_config
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from targetpo import TargetPOTrainer
from targetpo.demo import build_tiny_causal_lm
from targetpo.faults.checkpoints import CheckpointWriteError, clear_stopped_saves

SCRIPT = Path(__file__).resolve().parent / "scripts" / "out_of_space.py"


def fingerprint(folder):
    """Each file of a folder, by name, with a hash of its bytes."""
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(Path(folder).iterdir())}


class Fingerprints(TrainerCallback):
    """Each checkpoint's fingerprint when the Trainer reports it saved."""

    def __init__(self):
        self.saved = {}

    def on_save(self, args, state, control, **kwargs):
        name = f"checkpoint-{state.global_step}"
        self.saved[name] = fingerprint(Path(args.output_dir) / name)


class DiskFull:
    """Replaces ``torch.save``: the optimizer file of ``checkpoint-<step>`` gets half its bytes, then ENOSPC (or
    ``fails`` instead). Every optimizer write records the output folder as it was at that moment (``seen``)."""

    def __init__(self, output_dir, step, fails=None):
        self.output_dir, self.step = Path(output_dir), step
        self.fails = fails or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.seen = {}
        self.save = torch.save

    def __call__(self, obj, file, *args, **kwargs):
        self.save(obj, file, *args, **kwargs)
        path = Path(file)
        if path.name != "optimizer.pt":
            return
        self.seen[path.parent.name] = sorted(os.listdir(self.output_dir))
        if path.parent.name == f"checkpoint-{self.step}":
            with open(path, "r+b") as written:
                written.truncate(path.stat().st_size // 2)
            raise self.fails


def run(tmp_path, tokenizer, dataset, name, callbacks=(), eval_dataset=None, **overrides):
    """A fresh tiny model trained for 4 steps (unless told otherwise) into tmp_path/name/out."""
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    args = make_config(tmp_path / name, **{"max_steps": 4, **overrides})
    return TargetPOTrainer(
        model, letters_then_position_reward, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
        processing_class=tokenizer, callbacks=list(callbacks),
    )  # fmt: skip


def weights(trainer):
    return {name: value.detach().clone() for name, value in trainer.model.named_parameters()}


def test_a_checkpoint_the_disk_cannot_hold_leaves_the_last_one_whole_and_the_run_resumes_from_it(
    tmp_path, tokenizer, prompt_dataset, monkeypatch
):
    straight = run(tmp_path, tokenizer, prompt_dataset, "straight")
    straight.train()

    out = tmp_path / "a" / "out"
    fingerprints, disk_full = Fingerprints(), DiskFull(out, step=4)
    monkeypatch.setattr(torch, "save", disk_full)
    failing = run(tmp_path, tokenizer, prompt_dataset, "a", [fingerprints], save_strategy="steps", save_steps=2)
    with pytest.raises(CheckpointWriteError) as raised:
        failing.train()
    monkeypatch.undo()

    message, checkpoint = str(raised.value), out / "checkpoint-2"
    assert isinstance(raised.value, OSError) and raised.value.errno == errno.ENOSPC
    assert f"Could not write the checkpoint {out / 'checkpoint-4'}: No space left on device (ENOSPC)" in message
    assert "MiB free" in message and "set output_dir to a folder on a disk with room" in message
    assert f'trainer.train(resume_from_checkpoint="{checkpoint}")' in message
    # While checkpoint-4 was written, its folder was nowhere under a checkpoint's name; now it is gone altogether.
    assert disk_full.seen["checkpoint-4"] == ["_partial-checkpoint-4", "checkpoint-2"]
    assert sorted(os.listdir(out)) == ["checkpoint-2"]
    assert fingerprint(checkpoint) == fingerprints.saved["checkpoint-2"]

    resumed = run(tmp_path, tokenizer, prompt_dataset, "resumed")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    for name, value in weights(straight).items():
        torch.testing.assert_close(weights(resumed)[name], value, rtol=0, atol=1e-6, msg=name)


def test_save_total_limit_removes_the_old_checkpoint_only_once_the_new_one_is_in_place(
    tmp_path, tokenizer, prompt_dataset, monkeypatch
):
    out = tmp_path / "a" / "out"
    fingerprints, disk_full = Fingerprints(), DiskFull(out, step=3)
    monkeypatch.setattr(torch, "save", disk_full)
    trainer = run(
        tmp_path, tokenizer, prompt_dataset, "a", [fingerprints], save_strategy="steps", save_steps=1,
        save_total_limit=1,
    )  # fmt: skip
    with pytest.raises(CheckpointWriteError, match="checkpoint-3"):
        trainer.train()
    monkeypatch.undo()

    # Each new checkpoint was written beside the last good one, which went only once the new one was in place.
    assert disk_full.seen["checkpoint-2"] == ["_partial-checkpoint-2", "checkpoint-1"]
    assert disk_full.seen["checkpoint-3"] == ["_partial-checkpoint-3", "checkpoint-2"]
    assert sorted(os.listdir(out)) == ["checkpoint-2"]
    assert fingerprint(out / "checkpoint-2") == fingerprints.saved["checkpoint-2"]
    resumed = run(tmp_path, tokenizer, prompt_dataset, "resumed", max_steps=3)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.state.global_step == 3


def test_a_save_stopped_part_way_leaves_no_checkpoint_and_a_resumed_run_ignores_then_clears_it(
    tmp_path, tokenizer, prompt_dataset, monkeypatch
):
    out = tmp_path / "a" / "out"
    monkeypatch.setattr(torch, "save", DiskFull(out, step=4, fails=KeyboardInterrupt()))  # the process is stopped
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, tokenizer, prompt_dataset, "a", save_strategy="steps", save_steps=2).train()
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == ["_partial-checkpoint-4", "checkpoint-2"]
    (out / "checkpoint-3.tmp-1234").mkdir()  # a temporary folder named as other tools name them
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")

    loaded = []

    class Resumed(TargetPOTrainer):
        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            loaded.append(resume_from_checkpoint)
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    args = make_config(tmp_path / "a", max_steps=4, save_strategy="steps", save_steps=2)
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0)
    resumed = Resumed(
        model, letters_then_position_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    with pytest.warns(UserWarning, match="_partial-checkpoint-4"):
        resumed.train(resume_from_checkpoint=True)
    assert loaded == [str(out / "checkpoint-2")]
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-3.tmp-1234", "checkpoint-4"]


def test_clearing_a_stopped_save_puts_back_a_checkpoint_that_was_moved_aside(tmp_path):
    for folder in ("_replaced-checkpoint-5", "_replaced-checkpoint-6", "checkpoint-6", "_partial-checkpoint-7"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "trainer_state.json").write_text(json.dumps({"folder": folder}))
    (tmp_path / "_partial-notes").mkdir()  # not ours

    with pytest.warns(UserWarning, match="_partial-checkpoint-7, _replaced-checkpoint-6"):
        clear_stopped_saves(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["_partial-notes", "checkpoint-5", "checkpoint-6"]
    assert json.loads((tmp_path / "checkpoint-5" / "trainer_state.json").read_text())["folder"].startswith("_replaced")
    assert json.loads((tmp_path / "checkpoint-6" / "trainer_state.json").read_text())["folder"] == "checkpoint-6"


def small_disk_is_possible(where):
    """Whether an unprivileged user may mount a tmpfs here (a user and mount namespace: ``unshare -rm``)."""
    if shutil.which("unshare") is None:
        return False
    where.mkdir()
    probe = ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs '{where}'"]
    return subprocess.run(probe, capture_output=True, timeout=30, check=False).returncode == 0


def test_a_real_full_disk_leaves_the_last_checkpoint_whole_and_the_run_resumes_from_it(
    tmp_path, tokenizer, prompt_dataset
):
    disk, result = tmp_path / "disk", tmp_path / "result"
    if not small_disk_is_possible(disk):
        pytest.skip("no tmpfs can be mounted here without privileges (unshare -rm)")
    straight = run(tmp_path, tokenizer, prompt_dataset, "straight", save_strategy="steps", save_steps=2)
    straight.train()
    # Room for one checkpoint (tmpfs counts whole pages) and the start of the next: its model file, the first large
    # one written, runs out of space part-way.
    checkpoint, page = tmp_path / "straight" / "out" / "checkpoint-2", os.sysconf("SC_PAGE_SIZE")
    size = sum(-(-path.stat().st_size // page) * page for path in checkpoint.iterdir())
    size += (checkpoint / "model.safetensors").stat().st_size // 2 + 4 * page
    result.mkdir()
    command = f"mount -t tmpfs -o size={size} tmpfs '{disk}' && exec '{sys.executable}' '{SCRIPT}' '{disk}' '{result}'"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", command], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    seen = json.loads((result / "seen.json").read_text())
    assert seen["left"] == ["checkpoint-2"], seen
    assert seen["errno"] == errno.ENOSPC, seen  # safetensors reports it in its text: "(os error 28)"
    assert f"Could not write the checkpoint {disk / 'a' / 'out' / 'checkpoint-4'}: No space left" in seen["error"], seen
    assert "MiB free" in seen["error"] and "resume_from_checkpoint=" in seen["error"], seen
    resumed = torch.load(result / "weights.pt")
    for name, value in weights(straight).items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=1e-6, msg=name)


def test_the_best_checkpoint_is_recorded_where_it_ends_up_not_where_it_was_written(tmp_path, tokenizer, prompt_dataset):
    out = tmp_path / "a" / "out"
    trainer = run(
        tmp_path, tokenizer, prompt_dataset, "a", eval_dataset=prompt_dataset, max_steps=2, save_strategy="steps",
        save_steps=1, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8, load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
    )  # fmt: skip
    trainer.train()
    assert Path(trainer.state.best_model_checkpoint).parent == out
    for checkpoint in ("checkpoint-1", "checkpoint-2"):
        best = json.loads((out / checkpoint / "trainer_state.json").read_text())["best_model_checkpoint"]
        assert Path(best).parent == out and Path(best).name in {"checkpoint-1", "checkpoint-2"}, (checkpoint, best)
