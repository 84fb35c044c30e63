"""A failure on one process stops every process promptly with a clear error, instead of leaving the others waiting.

The trainer runs in two real processes on the CPU (gloo), started directly rather than by a launcher, which would kill
the survivor of a failure and hide a hang. Process 1 alone fails at the second step; it stays alive until process 0
has raised, so process 0 cannot be released by process 1's exit closing its connections.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import changed, length_reward, make_config, snapshot

from targetpo import TargetPOTrainer
from targetpo.distributed import PeerProcessError, failures_reach_every_process

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "fail_on_one_rank.py"
#: How long after process 1 fails both processes must have exited.
STOP_WITHIN_S = 30
#: The bound on a whole run: processes still running then are killed, so that a hang fails the test.
RUN_LIMIT_S = 150


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_processes(kind, out):
    """Both processes of the script; returns their return codes, their exit times (None: killed) and their stderr."""
    port = free_port()
    processes = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        with open(out / f"stderr_rank{rank}.txt", "w") as log:  # the child keeps its own copy of the descriptor
            command = [sys.executable, str(SCRIPT), kind, str(out)]
            processes.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log))
    exited = [None, None]
    deadline = time.time() + RUN_LIMIT_S
    while None in exited and time.time() < deadline:
        for rank, process in enumerate(processes):
            if exited[rank] is None and process.poll() is not None:
                exited[rank] = time.time()
        time.sleep(0.05)
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()
    stderr = [(out / f"stderr_rank{rank}.txt").read_text() for rank in range(2)]
    return [process.returncode for process in processes], exited, stderr


FAILURES = [
    # (kind, what process 1 was doing, its error, the error process 0 raises)
    pytest.param(
        "reward_raises", "scoring the completions",
        "ValueError: Reward function 'count_ones' raised KeyError: 'no reference answer for this prompt on process 1'",
        "PeerProcessError", id="reward-function-raises",
    ),
    pytest.param(
        "reward_wrong_length", "scoring the completions",
        "ValueError: Reward function 'count_ones' returned 3 scores for 4 completions",
        "PeerProcessError", id="reward-function-returns-a-bad-batch", marks=pytest.mark.slow,
    ),
    pytest.param(
        "nonfinite_logps", "computing the policy's token log-probs",
        "FloatingPointError: The policy's token log-probs are no longer finite (nan) at step 1",
        "PeerFloatingPointError", id="non-finite-log-probs", marks=pytest.mark.slow,
    ),
    pytest.param(
        "nonfinite_loss", "checking the loss",
        "FloatingPointError: The loss is inf at step 1",
        "PeerFloatingPointError", id="non-finite-loss", marks=pytest.mark.slow,
    ),
    pytest.param(
        "forward_raises", "computing the policy's token log-probs",
        "RuntimeError: the forward pass broke on process 1",
        "PeerProcessError", id="forward-pass-raises",
    ),
]  # fmt: skip


@pytest.mark.parametrize("kind, what, error, peer_error", FAILURES)
def test_a_failure_on_one_process_stops_both_with_a_clear_error(tmp_path, kind, what, error, peer_error):
    returncodes, exited, (stderr0, stderr1) = run_two_processes(kind, tmp_path)
    assert (tmp_path / "failed_at").exists(), f"process 1 never reached its failure:\n{stderr1[-3000:]}"
    failed_at = float((tmp_path / "failed_at").read_text())
    assert None not in exited, f"a process hung, killed after {RUN_LIMIT_S} s (exits {exited}, failure {failed_at})"
    stopped_after = [round(time - failed_at, 1) for time in exited]
    assert max(stopped_after) < STOP_WITHIN_S, f"the processes stopped {stopped_after} s after the failure"
    assert returncodes[0] != 0 and returncodes[1] != 0, returncodes
    # Process 1: its own error, with its traceback. Process 0: the peer error, naming process 1 and its error.
    assert error in stderr1 and "Traceback" in stderr1, stderr1[-3000:]
    assert "PeerProcessError" not in stderr1 and "PeerFloatingPointError" not in stderr1
    headline = f"targetpo.distributed.{peer_error}: Process 1 (of 2) failed while {what}, so process 0 stops too"
    assert headline in stderr0, stderr0[-3000:]
    assert f"process 1: {error}" in stderr0, stderr0[-3000:]


def test_with_one_process_failures_pass_straight_through():
    assert not dist.is_initialized()
    error = KeyError("raised inside the block")
    with pytest.raises(KeyError) as caught, failures_reach_every_process("testing"):
        raise error
    assert caught.value is error
    with failures_reach_every_process("testing"):
        pass


def exchange_worker(rank, world_size, port, out_dir):
    """Guarded blocks in a row, failing on different processes; records what each process raised."""
    from datetime import timedelta

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    failures = {
        "nothing": {},
        "non_finite": {1: FloatingPointError("the loss is nan")},
        "two": {1: ValueError("one's value"), 2: FloatingPointError("the loss is inf")},
    }
    lines = []
    for case, errors in failures.items():
        try:
            with failures_reach_every_process(f"case {case}"):
                if rank in errors:
                    raise errors[rank]
            lines.append(f"{case}: none")
        except Exception as raised:  # noqa: BLE001 (recorded for the test)
            message = str(raised).replace("\n", " / ")
            lines.append(
                f"{case}: {type(raised).__name__} own={raised is errors.get(rank)} "
                f"peer={isinstance(raised, PeerProcessError)} fpe={isinstance(raised, FloatingPointError)} | {message}"
            )
    dist.barrier()  # the processes are still in step: a plain collective afterwards works
    Path(out_dir, f"rank{rank}.txt").write_text("\n".join(lines))
    os._exit(0)  # see distributed_workers.gradient_worker: no teardown at interpreter exit


def test_every_failing_process_is_named_and_the_processes_stay_in_step(tmp_path):
    mp.spawn(exchange_worker, args=(3, free_port(), str(tmp_path)), nprocs=3, join=True)
    rank0, rank1, rank2 = ((tmp_path / f"rank{rank}.txt").read_text().splitlines() for rank in range(3))
    assert rank0[0] == rank1[0] == rank2[0] == "nothing: none"
    # A non-finite value on process 1: the others raise a peer error that is also a FloatingPointError.
    assert rank1[1] == "non_finite: FloatingPointError own=True peer=False fpe=True | the loss is nan"
    for rank, line in ((0, rank0[1]), (2, rank2[1])):
        assert line == (
            "non_finite: PeerFloatingPointError own=False peer=True fpe=True | Process 1 (of 3) failed while case "
            f"non_finite, so process {rank} stops too (the traceback is in the failing process's output): /   "
            "process 1: FloatingPointError: the loss is nan"
        )
    # Two processes failed: each raises its own error, the third names both.
    assert rank1[2] == "two: ValueError own=True peer=False fpe=False | one's value"
    assert rank2[2] == "two: FloatingPointError own=True peer=False fpe=True | the loss is inf"
    assert rank0[2] == (
        "two: PeerProcessError own=False peer=True fpe=False | Processes 1, 2 (of 3) failed while case two, so "
        "process 0 stops too (the traceback is in the failing process's output): /   process 1: ValueError: one's "
        "value /   process 2: FloatingPointError: the loss is inf"
    )


@pytest.mark.parametrize(
    "scale, beta, message",
    [(float("nan"), 0.0, "The policy's token log-probs are no longer finite"), (1e4, 0.1, "The loss is inf at step 0")],
    ids=["non-finite-log-probs", "non-finite-loss"],
)
def test_a_non_finite_value_stops_training_before_the_weights_change(
    tmp_path, tiny_model, tokenizer, prompt_dataset, scale, beta, message
):
    # The policy's activations blow up in training (not in generation); with beta > 0 and finite log-probs so far
    # from the reference's, the KL term overflows.
    def blow_up(module, args, output):
        return output * scale if module.training else output

    tiny_model.model.norm.register_forward_hook(blow_up)
    before = snapshot(tiny_model)
    config = make_config(tmp_path, beta=beta, skip_zero_gradient_completions=False)
    trainer = TargetPOTrainer(
        tiny_model, length_reward, args=config, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    with pytest.raises(FloatingPointError, match=message):
        trainer.train()
    assert not changed(before, tiny_model)  # no backward, no optimiser step
