"""A training process killed from outside (SIGKILL, as the out-of-memory killer or a lost machine would) while two gloo
processes train: in the middle of a step, of a rollout, and of writing a checkpoint. The other process stops within
60 s with a LostProcessError naming the lost one and the checkpoint to resume from, no process is left behind, and
resuming from the last complete checkpoint ends at the weights of the run that was never interrupted.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "lost_process_run.py"


def run_two(out_dir, kill="none", resume=False, timeout=300):
    """Both processes of one run, each started on its own; their (return code, output, time of exit)."""
    port = str(free_port())
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": python_path}
    processes = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), str(rank), port, str(out_dir), kill, "resume" if resume else "fresh"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    outcomes = []
    for process in processes:
        output, _ = process.communicate(timeout=timeout)
        outcomes.append((process.returncode, output, time.time()))
    return outcomes


def weights(out_dir):
    rank0, rank1 = (torch.load(out_dir / f"weights_rank{rank}.pt") for rank in range(2))
    assert torch.equal(rank0, rank1)
    return rank0


@pytest.fixture(scope="module")
def straight_through(tmp_path_factory):
    """The run nothing interrupts."""
    out_dir = tmp_path_factory.mktemp("straight")
    assert [code for code, _, _ in run_two(out_dir)] == [0, 0]
    return weights(out_dir)


def leftover_processes(out_dir):
    """Processes still running this test's script for ``out_dir`` (a survivor or a child it left behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(SCRIPT) in command and str(out_dir) in command:
                found.append(command)
    return found


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["step", "rollout", "checkpoint"])
def test_a_process_killed_mid_run_stops_the_other_naming_it_and_the_last_checkpoint_resumes(
    tmp_path, straight_through, kill
):
    (code0, output0, exited), (code1, _, _) = run_two(tmp_path, kill=kill)
    assert code1 == -9  # killed
    assert code0 != 0, output0[-3000:]
    assert "LostProcessError: Process 1 (of 2) went away" in output0, output0[-3000:]
    assert f"resume from {tmp_path / 'checkpoint-2'}" in output0, output0[-3000:]
    took = exited - float((tmp_path / "killed_at").read_text())
    assert 0 < took < 60, took  # measured: about 6 s (the failed collective at once, then the 5 s roll call)
    print(f"killed {kill}: the other process stopped {took:.1f} s later")
    assert leftover_processes(tmp_path) == []
    # Every checkpoint there is whole: the one being written when the process died is absent.
    checkpoints = sorted(path.name for path in tmp_path.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-2"], checkpoints

    resumed = run_two(tmp_path, resume=True)
    assert [code for code, _, _ in resumed] == [0, 0], resumed[0][1][-3000:]
    assert torch.allclose(weights(tmp_path), straight_through, atol=1e-6)
