"""Real multi-process runs on the CPU (gloo): groups split over processes keep the exact single-process gradient."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from distributed_workers import CASES, gradient_worker, loss_and_sequence_logps, make_batch, tiny_model

from targetpo.demo import build_tiny_causal_lm, reverse_task_tokenizer

ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(gradient_worker, args=(WORLD_SIZE, free_port(), str(out)), nprocs=WORLD_SIZE, join=True)
    return out


@pytest.mark.parametrize("name, per_device, normalize, with_invalid", CASES, ids=[case[0] for case in CASES])
def test_each_process_gets_the_single_process_gradient(two_process_results, name, per_device, normalize, with_invalid):
    # The reference: one process, the whole batch, no gather.
    batch = make_batch(per_device * WORLD_SIZE, with_invalid)
    model = tiny_model()
    loss, sequence = loss_and_sequence_logps(model, batch, normalize, span=False)
    loss.backward()
    reference = {n: p.grad for n, p in model.named_parameters()}

    for rank in range(WORLD_SIZE):
        result = torch.load(two_process_results / f"{name}_rank{rank}.pt")
        assert result["span"] == (per_device % 4 != 0)  # whole groups per process: no gather at all
        own = slice(rank * per_device, (rank + 1) * per_device)
        # Gradient on its own completions, divided by the number of processes as DDP's average does.
        assert torch.allclose(result["sequence_grad"] / WORLD_SIZE, sequence.grad[own], atol=1e-6)
        for param_name, grad in result["grads"].items():  # after DDP's all-reduce
            assert torch.allclose(grad, reference[param_name], atol=1e-6), param_name
        if result["span"]:
            assert torch.allclose(result["loss"], loss.detach(), atol=1e-6)


def launch_example(out, port):
    """The example script under `accelerate launch` with the CPU multi-process config; returns each rank's record."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/cpu_multi_process.yaml",
        "--main_process_port", str(port), "tests/scripts/launch_example.py",
        # 4 completions per process and 8 per group: every group is split over the two processes.
        "--max_steps", "3", "--per_device_train_batch_size", "4", "--num_generations", "8", "--logging_steps", "1",
        "--output_dir", str(out), "--disable_tqdm", "true",
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads((out / f"world_rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    weights = [torch.load(out / f"weights_rank{rank}.pt") for rank in range(WORLD_SIZE)]
    return records, weights


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="accelerate starts CPU processes with mpirun: apt-get install openmpi-bin")
def test_accelerate_launch_two_cpu_processes(tmp_path):
    records, (rank0, rank1) = launch_example(tmp_path / "run", free_port())
    assert all(record["num_processes"] == WORLD_SIZE for record in records)
    assert torch.equal(rank0, rank1)  # DDP kept the processes in step
    initial = torch.cat([p.detach().flatten() for p in build_tiny_causal_lm(reverse_task_tokenizer(), seed=42).parameters()])
    assert not torch.allclose(rank0, initial)  # it trained
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and any("reward" in entry for entry in state["log_history"])
    # The two halves of each group came from different random streams, not the same four samples twice.
    assert records[0]["first_completions"] != records[1]["first_completions"]

    # The same seed reproduces the same run.
    _, (again, _) = launch_example(tmp_path / "again", free_port())
    assert torch.equal(rank0, again)
