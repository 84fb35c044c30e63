"""Checkpoints that are whole or absent. Each is written aside, in a staging folder the Trainer's checkpoint discovery
does not see, and moved into place by one rename once every process has written its part; only then are older ones
rotated out (``save_total_limit``). A write that fails, a full disk above all, removes the partial folder, leaves the
checkpoints in place as they were, and raises :class:`CheckpointWriteError` saying what to do.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

try:  # transformers >= 5.2
    from transformers.trainer_utils import rotate_checkpoints
except ImportError:  # 5.0 and 5.1 rotate inside the Trainer's own save: their checkpoints are written in place
    rotate_checkpoints = None

#: ``_partial-checkpoint-N`` holds checkpoint-N while it is written; ``_replaced-checkpoint-N`` an older checkpoint-N
#: while the new one takes its name. Their leading underscore keeps them out of the Trainer's checkpoint discovery
#: (``get_last_checkpoint`` and the rotation read names that start with "checkpoint-"; a name such as
#: "checkpoint-N.tmp" would be rotated as step N) and out of its pushes of ``output_dir`` to the Hub (it skips "_*").
STAGING, REPLACED = "_partial-", "_replaced-"
_LEFT_BY_A_STOPPED_SAVE = re.compile(rf"^_(partial|replaced)-{PREFIX_CHECKPOINT_DIR}-(\d+)$")
_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")  # how safetensors (Rust) reports the errno of an I/O error


class CheckpointWriteError(OSError):
    """A checkpoint could not be written: the partial one is removed and earlier checkpoints are as they were. Its
    ``errno`` is the failed write's, when one is known (``errno.ENOSPC`` for a full disk)."""


class NotTheWrite(Exception):
    """Raised from inside a checkpoint's save for a failure that is not the checkpoint's own (the rollout it waits
    for, say): the partial checkpoint is removed and the failure, this error's cause, raised as it is, not as a
    :class:`CheckpointWriteError`."""


class AtomicCheckpoints:
    """Stages the Trainer's checkpoints and moves each into place whole (see the module's docstring).

    The Trainer's ``_save_checkpoint`` names ``checkpoint-N`` inside the run folder ``_get_output_dir`` gives, writes
    every part there (the model, the optimizer, RNG states, the trainer state; every process its own) and then
    pushes and rotates. Overriding only that folder keeps all of its writing as it is: while a checkpoint is written
    the trainer's ``_get_output_dir`` returns ``staging`` (None otherwise), and :meth:`staged`, around the Trainer's
    save, moves the result into place, pushes it from there and rotates in the real run folder. ``wait_for_everyone``
    is the processes' barrier.
    """

    def __init__(self, args: Any, wait_for_everyone: Callable[[], None]):
        self.args = args
        self.wait_for_everyone = wait_for_everyone
        self.staging: str | None = None

    def push_unless_staged(self, checkpoint_folder: str, push: Callable[[str], None]) -> None:
        """Push ``checkpoint_folder`` to the Hub now, unless it is staged: :meth:`staged` pushes it once in place (an
        upload from the staging folder would lose its files to the move)."""
        if self.staging is None:
            push(checkpoint_folder)

    @contextmanager
    def staged(self, run_dir: str, state: Any, push: Callable[[str], None]) -> Iterator[None]:
        """Stage the checkpoint of ``state.global_step`` that the block writes. Once every process has written its
        part it is flushed to disk and moved into place, then pushed (``push``, with ``push_to_hub``) and older
        checkpoints rotated out. A failure raises :class:`CheckpointWriteError` and leaves the checkpoints in place
        as they were. Every process enters it: each may write into the checkpoint (its RNG state, optimizer shards).
        """
        if rotate_checkpoints is None:  # transformers 5.0, 5.1: written in place, as the Trainer writes it
            yield
            return
        name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        staging, final = os.path.join(run_dir, STAGING + name), os.path.join(run_dir, name)
        if self.args.should_save:
            clear_stopped_saves(run_dir)
        self.wait_for_everyone()  # no process writes into a folder that is being removed
        self.staging = staging
        try:
            yield
            self.wait_for_everyone()  # every process's part is written
            if state.best_model_checkpoint == os.path.join(staging, name):  # the Trainer found it where it was staged
                state.best_model_checkpoint = final
                if self.args.should_save:
                    state.save_to_json(os.path.join(staging, name, TRAINER_STATE_NAME))
            if self.args.should_save:
                _move_into_place(os.path.join(staging, name), final)
        except NotTheWrite as error:
            shutil.rmtree(staging, ignore_errors=True)
            raise error.__cause__ from None
        except Exception as error:
            raise _write_failed(error, final, staging) from error
        finally:
            self.staging = None
        if self.args.push_to_hub:
            push(final)
        if self.args.should_save:
            self._rotate(run_dir, state)
        self.wait_for_everyone()  # every process finds the checkpoint in place when it goes on

    def _rotate(self, run_dir: str, state: Any) -> None:
        """Delete the checkpoints ``save_total_limit`` leaves out, as the Trainer would (the newest and best kept)."""
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=state.best_model_checkpoint,
            use_mtime=True,
        )


def clear_stopped_saves(run_dir: str) -> None:
    """Clear what a save stopped part-way (a crash, a kill) left in ``run_dir``, with a warning: a partial checkpoint
    is removed; an older checkpoint moved aside goes back to its name if no checkpoint took it, else it is removed."""
    if not os.path.isdir(run_dir):
        return
    cleared = []
    for entry in sorted(os.listdir(run_dir)):
        found = _LEFT_BY_A_STOPPED_SAVE.match(entry)
        if found is None:
            continue
        path, name = os.path.join(run_dir, entry), f"{PREFIX_CHECKPOINT_DIR}-{found.group(2)}"
        if found.group(1) == "replaced" and not os.path.exists(os.path.join(run_dir, name)):
            os.rename(path, os.path.join(run_dir, name))
            continue
        shutil.rmtree(path, ignore_errors=True)
        cleared.append(entry)
    if cleared:
        warnings.warn(
            f"Removed what an earlier save stopped part-way left in {run_dir}: {', '.join(cleared)} (never complete "
            "checkpoints, and never resumed from).",
            stacklevel=2,
        )


def _move_into_place(staged: str, final: str) -> None:
    """Flush ``staged`` to disk and rename it ``final``: an older ``final`` (the same step saved again) is moved aside
    first and removed once the new one is in place, and put back if the rename fails."""
    _sync_tree(staged)
    run_dir, name = os.path.split(final)
    replaced = os.path.join(run_dir, REPLACED + name)
    if os.path.exists(final):
        os.rename(final, replaced)
    try:
        os.rename(staged, final)
    except OSError:
        if os.path.isdir(replaced):
            os.rename(replaced, final)
        raise
    _sync_directory(run_dir)  # the rename itself is on disk
    shutil.rmtree(replaced, ignore_errors=True)
    os.rmdir(os.path.dirname(staged))


def _sync_tree(folder: str) -> None:
    """Flush every file under ``folder`` and the folders themselves to disk, so the rename never publishes a
    checkpoint whose data a power cut could still lose. A full disk may show here first (delayed allocation)."""
    for root, _, files in os.walk(folder):
        for file in files:
            descriptor = os.open(os.path.join(root, file), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        _sync_directory(root)


def _sync_directory(folder: str) -> None:
    if os.name != "posix":  # a folder cannot be opened to be flushed elsewhere
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_failed(error: Exception, final: str, staging: str) -> CheckpointWriteError:
    """Remove the partial checkpoint and say what failed, why, and what to do."""
    run_dir = os.path.dirname(final)
    try:  # measured before the partial checkpoint's files are freed
        free = f"The disk holding {run_dir} has {shutil.disk_usage(run_dir).free / 2**20:.1f} MiB free. "
    except OSError:
        free = ""
    shutil.rmtree(staging, ignore_errors=True)
    code = _errno_of(error)
    why = f"{os.strerror(code)} ({errno.errorcode.get(code, code)}); " if code is not None else ""
    last = get_last_checkpoint(run_dir) if os.path.isdir(run_dir) else None
    then = (
        f'then resume from the last complete checkpoint: trainer.train(resume_from_checkpoint="{last}")'
        if last is not None
        else "then start the run again (it has no complete checkpoint yet)"
    )
    message = (
        f"Could not write the checkpoint {final}: {why}{type(error).__name__}: {error}. {free}The partial checkpoint "
        f"({staging}) is removed and the checkpoints before it are untouched. Free space on that disk (or fix the "
        f"cause above), or set output_dir to a folder on a disk with room, {then}."
    )
    return CheckpointWriteError(code, message) if code is not None else CheckpointWriteError(message)


def _errno_of(error: BaseException | None) -> int | None:
    """The errno of the I/O error behind ``error``, if any: its own, a cause's, or one written in its text."""
    while error is not None:
        if isinstance(error, OSError) and error.errno is not None:
            return error.errno
        found = _OS_ERROR_IN_TEXT.search(str(error))
        if found is not None:
            return int(found.group(1))
        error = error.__cause__ or error.__context__
    return None


class CheckpointsWrittenWhole:
    """The Trainer's checkpoint hooks with every checkpoint staged and moved into place whole by
    ``self.whole_checkpoints`` (an :class:`AtomicCheckpoints`); listed before ``transformers.Trainer`` among a
    trainer's bases. Only the folder the Trainer writes into changes, so all of its own writing stays as it is."""

    whole_checkpoints: AtomicCheckpoints

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        with self.whole_checkpoints.staged(super()._get_output_dir(trial), self.state, super()._push_from_checkpoint):
            super()._save_checkpoint(model, trial)

    def _get_output_dir(self, trial: Any) -> str:
        """Where the Trainer puts ``checkpoint-N``: the staging folder while one is written."""
        return self.whole_checkpoints.staging or super()._get_output_dir(trial)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        self.whole_checkpoints.push_unless_staged(checkpoint_folder, super()._push_from_checkpoint)
