"""The block printed when training starts: each value against the config and model it describes, and a launch that
asked for more processes than run."""

import dataclasses
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import count_letters_reward, length_reward, make_config
from rich.console import Console
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from targetpo import TargetPOTrainer
from targetpo.episodes.async_runner import AsyncRunner
from targetpo.episodes.environments import EnvironmentReward
from targetpo.generation import RolloutBackend
from targetpo.reporting.run_summary import (
    WORLD_SIZE_VARIABLES,
    RunSummary,
    announce_run,
    asked_processes,
    rollouts_description,
    summary_table,
)
from targetpo.rewards import RewardScorer

ROOT = Path(__file__).resolve().parents[1]


def rendered(summary):
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(summary_table(summary))
    return console.export_text()


@pytest.fixture
def no_launcher(monkeypatch):
    """A process no launcher started (whatever ran pytest)."""
    for name in (*WORLD_SIZE_VARIABLES, "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)


def test_the_summary_of_a_tiny_trainer_matches_its_config(tmp_path, tiny_model, tokenizer, prompt_dataset, no_launcher):
    # A rollout of 4 prompts serves 2 optimiser steps of 2 prompts each.
    args = make_config(
        tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4,
        tpo_target_temperature=0.5, beta=0.04, reward_weights=[1.0, 0.5],
    )
    trainer = TargetPOTrainer(
        tiny_model, [count_letters_reward, length_reward], args=args, train_dataset=prompt_dataset,
        processing_class=tokenizer,
    )
    summary = trainer._run_summary()
    assert summary.loss == "tpo (target temperature η = 0.5) + KL to the reference, β = 0.04"
    assert summary.num_generations == args.num_generations == 4
    assert summary.prompts_per_rollout == args.generation_batch_size / args.num_generations == 4
    assert summary.prompts_per_optimiser_step == 4 * 2 / 4  # per-device rows x accumulation steps / K
    assert summary.processes == 1 and summary.processes_asked is None and summary.process_mismatch is None
    assert summary.rollouts == "model.generate"
    assert summary.model == "Qwen2ForCausalLM"  # built from a config: no id to name
    assert summary.parameters == summary.trainable_parameters == sum(p.numel() for p in tiny_model.parameters())
    assert summary.reward_sources == ("count_letters_reward", "length_reward × 0.5")

    text = rendered(summary)
    for line in (
        "loss  tpo (target temperature η = 0.5) + KL to the reference, β = 0.04",
        "completions per prompt (K)  4",
        "prompts per rollout  4 (16 completions)",
        "prompts per optimiser step  2 (8 completions)",
        "processes  1",
        "rollouts  model.generate",
        f"model  Qwen2ForCausalLM, {summary.parameters:,} parameters",
        "rewards  count_letters_reward, length_reward × 0.5",
    ):
        assert " ".join(line.split()) in " ".join(text.split()), (line, text)


def test_training_prints_the_block_once_unless_the_log_level_is_above_warning(
    tmp_path, tiny_model, tokenizer, prompt_dataset, capsys, no_launcher
):
    args = make_config(tmp_path, max_steps=1, loss_type="dapo")
    trainer = TargetPOTrainer(
        tiny_model, count_letters_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    trainer.train()
    out = capsys.readouterr().out
    assert out.count("targetpo: what trains") == 1
    assert "dapo (GRPO family)" in out

    trainer.args.log_level = "error"
    trainer.train()
    assert "what trains" not in capsys.readouterr().out


def test_peft_counts_the_trainable_parameters(tmp_path, tiny_model, tokenizer, prompt_dataset, no_launcher):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = TargetPOTrainer(
        tiny_model, count_letters_reward, args=make_config(tmp_path), train_dataset=prompt_dataset,
        processing_class=tokenizer, peft_config=peft_config,
    )
    summary = trainer._run_summary()
    params = list(trainer.model.parameters())
    assert summary.parameters == sum(p.numel() for p in params)
    assert 0 < summary.trainable_parameters == sum(p.numel() for p in params if p.requires_grad) < summary.parameters
    assert summary.model == f"Qwen2ForCausalLM in {type(trainer.accelerator.unwrap_model(trainer.model)).__name__}"
    assert f"{summary.trainable_parameters:,} trainable" in rendered(summary)


def test_reward_sources_name_functions_reward_models_and_environments(tmp_path, tokenizer):
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )
    scorer = RewardScorer(
        [count_letters_reward, Qwen2ForSequenceClassification(config), EnvironmentReward("Board", AsyncRunner())],
        reward_processing_classes=[None, tokenizer, None],
        reward_weights=[1.0, 2.0, 1.0],
    )
    args = make_config(tmp_path)
    summary = RunSummary.of(args, torch.nn.Linear(2, 3), 1, scorer, "model.generate")
    assert summary.reward_sources == (
        "count_letters_reward",
        "Qwen2ForSequenceClassification (reward model) × 2",
        "Board.get_reward() (environment)",
    )
    assert summary.parameters == 9 and summary.model == "Linear"


def test_rollouts_say_where_completions_come_from():
    class OwnBackend(RolloutBackend):
        def generate(self, prompt_ids, prompt_mask, max_new_tokens=None, images=None):
            raise NotImplementedError

    def lookup(city: str) -> str:
        """Look a city up."""
        return city

    class Board:
        pass

    def my_rollouts(prompts, trainer):
        return {}

    backend = OwnBackend()
    assert rollouts_description(backend, None, [], None, False) == "OwnBackend"
    assert rollouts_description(backend, None, [lookup], None, True) == (
        "OwnBackend, tools lookup, generated ahead (async_rollouts)"
    )
    assert rollouts_description(backend, None, [], {None: Board}, False) == "OwnBackend, environments Board"
    assert rollouts_description(backend, my_rollouts, [], None, False) == "rollout_func my_rollouts"


# What `accelerate launch --num_processes 2 script.py` gives the one process it starts on a machine without GPUs
# and without a config file (seen on this machine): no world size, only its own variables; the number asked for is
# on the launcher's command line.
SIMPLE_LAUNCHER_ENV = {
    "ACCELERATE_DYNAMO_BACKEND": "NO",
    "ACCELERATE_MIXED_PRECISION": "no",
    "ACCELERATE_USE_CPU": "False",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}
LAUNCHER = ["python", "/venv/bin/accelerate", "launch", "--num_processes", "2", "train.py", "--num_processes", "7"]


def test_the_processes_a_launch_asked_for():
    assert asked_processes(SIMPLE_LAUNCHER_ENV, LAUNCHER) == 2  # the launcher's option, not the script's
    module_launch = ["python", "-m", "accelerate.commands.launch", "--num-processes=3", "t.py"]
    assert asked_processes(SIMPLE_LAUNCHER_ENV, module_launch) == 3
    assert asked_processes(SIMPLE_LAUNCHER_ENV, ["accelerate", "launch", "t.py", "--num_processes", "2"]) is None
    assert asked_processes({}, LAUNCHER) is None  # not started by accelerate: its command line is not read
    assert asked_processes({"WORLD_SIZE": "4"}, None) == 4  # torchrun, accelerate's multi-process launchers
    assert asked_processes({"OMPI_COMM_WORLD_SIZE": "2"}, None) == 2  # mpirun


def test_a_launch_that_asked_for_more_processes_than_run_is_shown_and_warned(
    tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch
):
    for name, value in SIMPLE_LAUNCHER_ENV.items():
        monkeypatch.setenv(name, value)
    for name in WORLD_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("targetpo.reporting.run_summary.launcher_command", lambda: LAUNCHER)
    trainer = TargetPOTrainer(
        tiny_model, count_letters_reward, args=make_config(tmp_path), train_dataset=prompt_dataset,
        processing_class=tokenizer,
    )
    summary = trainer._run_summary()
    assert (summary.processes, summary.processes_asked) == (1, 2)
    assert "1 (asked for 2, running 1)" in rendered(summary)
    console = Console(record=True, width=200, file=io.StringIO())
    with pytest.warns(UserWarning, match="The launch asked for 2 processes, but this run has 1") as caught:
        announce_run(summary, show_block=False, console=console)
    assert "torchrun --nproc_per_node" in str(caught[0].message)
    assert console.export_text() == ""  # the warning alone, at log_level "error"

    agreeing = dataclasses.replace(summary, processes_asked=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when the launch got what it asked for
        announce_run(agreeing, console=console)
    lines = [line.split() for line in console.export_text().splitlines()]
    assert ["processes", "1"] in lines and not any("asked" in line for line in lines)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="accelerate launch starts a process per GPU")
def test_accelerate_launch_with_two_processes_on_a_cpu_says_it_runs_one(tmp_path):
    """The real launcher, as a user would type it: the block shows the mismatch and the run warns."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}  # no accelerate config file
    for name in WORLD_SIZE_VARIABLES:
        env.pop(name, None)
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
        "tests/scripts/run_summary_launch.py", str(tmp_path / "out"),
    ]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "record.json").read_text())
    assert record["processes"] == 1 and record["processes_asked"] == 2
    assert any("The launch asked for 2 processes, but this run has 1" in message for message in record["warnings"])
    assert "asked for 2, running 1" in " ".join(result.stdout.split())
