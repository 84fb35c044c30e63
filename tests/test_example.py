"""The example script: the embedded offline default, its outputs, its flags and its errors."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "target_po.py"


def load_example():
    spec = importlib.util.spec_from_file_location("target_po_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_example_trains_and_saves_everything(tmp_path):
    example = load_example()
    out = tmp_path / "run"
    trainer = example.main(
        ["--max_steps", "3", "--logging_steps", "1", "--output_dir", str(out), "--tpo_target_temperature", "0.5",
         "--reverse_length", "4", "--disable_tqdm", "true"]
    )
    assert trainer.args.tpo_target_temperature == 0.5  # every TargetPOConfig field is a flag
    assert trainer.args.learning_rate == example.EMBEDDED_DEFAULTS["learning_rate"]  # the task's defaults apply
    assert trainer.args.max_completion_length == 4
    for name in ("model.safetensors", "config.json", "tokenizer.json", "trainer_state.json"):
        assert (out / name).exists(), name
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert len([entry for entry in state["log_history"] if "reward" in entry]) == 3


def test_example_keeps_library_defaults_for_other_datasets(tmp_path):
    example = load_example()
    _, args = example.parse_arguments(["--dataset_name", "some/data", "--output_dir", str(tmp_path)])
    assert args.learning_rate == 1e-6 and args.max_steps == -1


def test_example_reports_an_unreachable_dataset(tmp_path):
    example = load_example()
    with pytest.raises(SystemExit, match="could not load dataset 'no-such-org/no-such-data'"):
        example.main(["--dataset_name", "no-such-org/no-such-data", "--reward_funcs", "exact_match",
                      "--model_name_or_path", "no-such-org/no-such-model", "--output_dir", str(tmp_path)])


def test_example_refuses_a_dataset_without_a_model(tmp_path):
    example = load_example()
    # Refused before anything loads: the dataset named here does not exist, and loading it would fail differently.
    with pytest.raises(SystemExit, match="--dataset_name needs --model_name_or_path: the embedded demo model"):
        example.main(["--dataset_name", "no-such-org/no-such-data", "--reward_funcs", "exact_match",
                      "--output_dir", str(tmp_path)])


def test_example_reports_an_unreachable_model(tmp_path):
    example = load_example()
    with pytest.raises(SystemExit, match="Could not load the tokenizer 'no-such-org/no-such-model'"):
        example.main(["--model_name_or_path", "no-such-org/no-such-model", "--output_dir", str(tmp_path)])


def test_example_trains_on_a_local_dataset_with_a_builtin_reward(tmp_path):
    example = load_example()
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": bits + "=", "solution": bits[::-1]} for bits in ("0011", "0101", "1100", "1110")]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(SystemExit, match="--reward_funcs is required"):
        example.main(["--dataset_name", str(data), "--output_dir", str(tmp_path / "a")])
    # A saved model and its tokenizer load from disk like a Hub model would.
    example.main(["--max_steps", "1", "--reverse_length", "4", "--output_dir", str(tmp_path / "base"), "--disable_tqdm", "true"])
    trainer = example.main(
        ["--model_name_or_path", str(tmp_path / "base"), "--dataset_name", str(data), "--reward_funcs", "exact_match",
         "--max_steps", "2", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "4", "--max_prompt_length", "8", "--output_dir", str(tmp_path / "b"),
         "--report_to", "none", "--disable_tqdm", "true"]
    )
    assert trainer.state.global_step == 2
    assert any("rewards/exact_match_reward/mean" in entry for entry in trainer.state.log_history)


def readme_python_block(heading):
    """The first ```python block after ``heading`` in the README."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def test_trained_model_is_usable_as_the_readme_says(tmp_path):
    """The README's "Use your trained model" code, run on a model the example saved: a plain `generate` gives
    exactly H binary characters, which the task's reward scores."""
    example = load_example()
    out = tmp_path / "target_po-reverse"
    example.main(["--max_steps", "2", "--output_dir", str(out), "--disable_tqdm", "true"])
    code = readme_python_block("### Use your trained model")
    assert '"outputs/target_po-reverse"' in code
    namespace = {}
    exec(code.replace('"outputs/target_po-reverse"', repr(str(out))), namespace)  # noqa: S102 - the README's own code
    completions, rewards = namespace["completions"], namespace["rewards"]
    assert len(completions) == len(namespace["prompts"]) == len(rewards)
    assert all(len(text) == 6 and set(text) <= {"0", "1"} for text in completions), completions
    assert all(reward in (0.0, 1.0) for reward in rewards)


@pytest.mark.slow
def test_default_demo_learns_the_sparse_task(tmp_path):
    """The README's command, as a user runs it: no arguments but the output folder, in a fresh process."""
    out = tmp_path / "demo"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # No wall-clock timeout: the run is bounded by its fixed number of steps (max_steps), and a slow or shared
    # machine only makes it take longer.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--output_dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "it/s" in result.stderr  # the progress bar
    state = json.loads((out / "trainer_state.json").read_text())
    rewards = [entry["reward"] for entry in state["log_history"] if "reward" in entry]
    start = sum(rewards[:3]) / 3
    end = sum(rewards[-5:]) / 5
    # A random policy solves a 6-bit reversal with probability 1/64; training must multiply that several times.
    assert start < 0.08
    assert end > 3 * start and end > 0.12, rewards


def test_guess_task_plays_multi_turn_games_with_the_tool(tmp_path):
    example = load_example()
    trainer = example.main(
        ["--task", "guess", "--max_steps", "2", "--logging_steps", "1", "--output_dir", str(tmp_path / "run"),
         "--disable_tqdm", "true"]
    )
    assert trainer.args.max_tool_calling_iterations == example.GUESS_DEFAULTS["max_tool_calling_iterations"]
    assert trainer.reward_scorer.names == ["GuessingGame"]  # the game scores itself
    logs = [entry for entry in trainer.state.log_history if "tools/call_frequency" in entry]
    assert len(logs) == 2 and all(entry["tools/call_frequency"] > 0 for entry in logs)


@pytest.mark.slow
def test_guess_demo_learns_to_find_the_digit(tmp_path):
    """The multi-turn demo, 250 steps: from about 1 game in 30 won (the untrained model rarely writes one digit and
    stops) to more than 1 in 5 (measured: 0.36-0.40 around step 250)."""
    out = tmp_path / "guess"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--task", "guess", "--max_steps", "250", "--output_dir", str(out)],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [entry["reward"] for entry in json.loads((out / "trainer_state.json").read_text())["log_history"]
               if "reward" in entry]
    assert rewards[0] < 0.1
    assert rewards[-1] > 0.2, rewards
