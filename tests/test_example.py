"""The example script: the embedded offline default, its outputs, its flags and its errors."""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from test_cli import flag_names, help_sections
from transformers import BitsAndBytesConfig, GenerationConfig

from targetpo import TargetPOConfig
from targetpo.cli import TRAINER_FLAG_GROUP
from targetpo.config.fields import FLAG_GROUPS
from targetpo.demo import (
    binary_only_generation_kwargs,
    build_tiny_causal_lm,
    digits_only_generation_kwargs,
    guessing_tokenizer,
    reverse_task_dataset,
    reverse_task_tokenizer,
)

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
    _, args, _ = example.parse_arguments(["--dataset_name", "some/data", "--output_dir", str(tmp_path)])
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


def test_dataset_streaming_trains_on_the_embedded_rows_as_a_stream_in_order(tmp_path, monkeypatch):
    """--dataset_streaming on the offline default: the trainer gets a stream, and each rollout holds the next 8 rows
    of the embedded dataset, in its order, with their own targets (without the flag the rows are shuffled)."""
    example = load_example()
    seen = []

    def recording_reward(prompts, completions, target, **kwargs):
        seen.append(list(zip(prompts, target)))
        return example.exact_reversal_reward(completions=completions, target=target)

    monkeypatch.setitem(example.BUILTIN_REWARDS, "exact_reversal", recording_reward)
    # 64 prompts of 6 bits (mostly distinct), 8 prompts x 4 completions per rollout, one rollout per step.
    run = ["--reverse_length", "6", "--num_prompts", "64", "--per_device_train_batch_size", "32", "--num_generations",
           "4", "--max_steps", "2", "--report_to", "none", "--disable_tqdm", "true"]
    trainer = example.main([*run, "--dataset_streaming", "--output_dir", str(tmp_path / "stream")])
    assert isinstance(trainer.train_dataset, datasets.IterableDataset)
    assert trainer.state.global_step == 2
    rows = reverse_task_dataset(6, 64, seed=0)
    in_order = list(zip(rows["prompt"], rows["target"]))
    # Rollout r: rows 8r to 8r + 7 of the stream, each prompt's 4 completions together.
    assert seen == [[row for row in in_order[8 * r : 8 * (r + 1)] for _ in range(4)] for r in range(2)]

    seen.clear()
    trainer = example.main([*run, "--output_dir", str(tmp_path / "map")])
    assert isinstance(trainer.train_dataset, datasets.Dataset)
    assert len(seen) == 2 and [rollout[::4] for rollout in seen] != [in_order[:8], in_order[8:16]]  # shuffled


def test_dataset_streaming_loads_local_splits_as_streams(tmp_path):
    example = load_example()
    data = tmp_path / "data"
    data.mkdir()
    splits = {"train": ["0011", "0101", "1100"], "test": ["1110", "0001"]}
    for split, bits in splits.items():
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": b + "=", "solution": b[::-1]}) + "\n"
                                                     for b in bits))
    script_args, _, _ = example.parse_arguments(
        ["--dataset_name", str(data), "--dataset_test_split", "test", "--dataset_streaming",
         "--output_dir", str(tmp_path)]
    )
    train, test = example.load_data(script_args)
    for stream, bits in ((train, splits["train"]), (test, splits["test"])):
        assert isinstance(stream, datasets.IterableDataset)
        assert [row["prompt"] for row in stream] == [b + "=" for b in bits]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dataset_name", "no-such-org/no-such-data", "--model_name_or_path", "no-such-org/no-such-model",
          "--reward_funcs", "exact_match"], "--dataset_streaming needs --max_steps: a stream has no length"),
        (["--max_steps", "1", "--async_rollouts", "true", "--use_vllm", "true", "--vllm_mode", "server"],
         "--dataset_streaming: async_rollouts=True needs a map-style train dataset.* Or drop --dataset_streaming"),
    ],
)
def test_dataset_streaming_refuses_what_a_stream_cannot_serve_naming_the_flag(tmp_path, flags, message):
    example = load_example()
    # Refused before anything loads: the dataset and model named above do not exist.
    with pytest.raises(SystemExit, match=message):
        example.main([*flags, "--dataset_streaming", "--output_dir", str(tmp_path)])


def readme_python_block(heading, index=0):
    """The ``index``-th ```python block after ``heading`` in the README."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading) :]
    return section.split("```python\n")[index + 1].split("```")[0]


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


def test_the_saved_generation_config_holds_the_resolved_sampling_settings(tmp_path):
    """Sampling settings given through generation_kwargs are the ones rollouts used, and the ones saved with the
    model for a plain `generate`."""
    example = load_example()
    out = tmp_path / "run"
    tokenizer = reverse_task_tokenizer()
    settings = {**binary_only_generation_kwargs(tokenizer), "temperature": 0.7, "top_k": 2, "max_new_tokens": 4}
    trainer = example.main(["--max_steps", "1", "--output_dir", str(out), "--reverse_length", "4",
                            "--disable_tqdm", "true", "--generation_kwargs", json.dumps(settings)])
    assert trainer.args.temperature == 1.0 and trainer.sampling.temperature == 0.7 and trainer.sampling.top_k == 2
    saved = GenerationConfig.from_pretrained(out)
    assert saved.do_sample and saved.temperature == 0.7 and saved.top_k == 2 and saved.max_new_tokens == 4
    assert saved.suppress_tokens == settings["suppress_tokens"]


def test_a_lora_run_of_the_embedded_model_loads_offline_as_the_readme_says(tmp_path):
    """`--use_peft` on the embedded model: the README's code loads the output folder (offline, as the tests run) as
    the trained policy, equal logits on a fixed input; once the folder is moved, the README's PeftModel code does."""
    example = load_example()
    out = tmp_path / "target_po-reverse"
    trainer = example.main([*QUICK, "--max_steps", "2", "--use_peft", "--output_dir", str(out)])
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str((out / "base_model").resolve())
    inputs = trainer.processing_class(["011010=", "110001="], return_tensors="pt")
    policy = trainer.model.eval()
    with torch.no_grad():
        expected = policy(**inputs).logits
        with policy.disable_adapter():  # the adapters trained, so matching the policy needs them
            assert not torch.allclose(policy(**inputs).logits, expected, atol=1e-4)

    def logits_of_readme_model(index, path):
        namespace = {}
        code = readme_python_block("### Use your trained model", index)
        assert '"outputs/target_po-reverse"' in code
        exec(code.replace('"outputs/target_po-reverse"', repr(str(path))), namespace)  # noqa: S102 - the README's code
        with torch.no_grad():
            return namespace["model"].eval()(**inputs).logits

    torch.testing.assert_close(logits_of_readme_model(0, out), expected, rtol=0, atol=1e-6)
    moved = tmp_path / "elsewhere"
    out.rename(moved)  # the absolute path in the adapter's config now leads nowhere
    torch.testing.assert_close(logits_of_readme_model(1, moved), expected, rtol=0, atol=1e-6)


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


def test_lock_task_presses_keys_with_the_tool_within_a_turn_limit_set_by_its_keys(tmp_path):
    example = load_example()
    trainer = example.build_trainer(["--task", "lock", "--lock_keys", "3", "--max_steps", "1", "--output_dir",
                                     str(tmp_path / "run"), "--disable_tqdm", "true"])
    assert trainer.args.max_tool_calling_iterations == 3 and trainer.args.max_completion_length == 16
    assert trainer.args.output_dir == str(tmp_path / "run") and trainer.args.logging_steps == 25
    assert trainer.reward_scorer.names == ["Lock"]  # the lock scores itself
    prompts = [row["prompt"][0]["content"] for row in trainer.train_dataset]
    assert len(prompts) == 4096 and all(len(bits) == 3 and set(bits) <= {"0", "1"} for bits in prompts)
    assert [schema["function"]["name"] for schema in trainer._rollout_context.episodes.tool_schemas] == ["press"]


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


# --- Task defaults and the flags passed -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "completion_length", "prompt_length"),
    [
        ([], 6, 7),  # the reverse task: H-character answers to H bits and '='
        (["--reverse_length", "4"], 4, 5),
        # The library's defaults written out (256 and 512): passed, so used, although they equal a default.
        (["--max_completion_length", "256", "--max_prompt_length", "512"], 256, 512),
        (["--task", "guess"], 20, 512),  # a whole game fits in 20 tokens; the prompt length is the library's
        (["--task", "guess", "--max_completion_length", "6"], 6, 512),
        (["--dataset_name", "some/data"], 256, 512),  # another dataset: the library's defaults
    ],
)
def test_task_defaults_fill_only_the_lengths_left_out(tmp_path, flags, completion_length, prompt_length):
    example = load_example()
    _, args, _ = example.parse_arguments([*flags, "--output_dir", str(tmp_path)])
    assert (args.max_completion_length, args.max_prompt_length) == (completion_length, prompt_length)


def test_flags_count_as_passed_whatever_their_value():
    example = load_example()
    passed = example.passed_flags(
        ["--reverse_length", "6", "--no_disable_dropout", "--lora_r=16", "--use_peft", "--dataset_streaming", "false"]
    )
    assert passed == {"reverse_length", "disable_dropout", "lora_r", "use_peft", "dataset_streaming"}
    assert example.passed_flags([]) == set()


def test_guess_task_keeps_its_settings_beside_generation_kwargs(tmp_path):
    """--generation_kwargs on the guessing game adds to the game's settings: the completions stay 20 tokens long (not
    the reverse task's 6) and the model still writes only digits and EOS."""
    example = load_example()
    trainer = example.build_trainer(
        ["--task", "guess", "--generation_kwargs", '{"temperature": 1.0}', "--output_dir", str(tmp_path)]
    )
    expected = {**digits_only_generation_kwargs(guessing_tokenizer()), "temperature": 1.0}
    assert trainer.args.generation_kwargs == expected
    assert trainer.args.max_completion_length == trainer.sampling.max_new_tokens == 20
    assert trainer.sampling.suppressed_token_ids == expected["suppress_tokens"]


def test_a_reverse_task_completion_length_is_used_with_a_warning_when_no_answer_can_score(tmp_path):
    """H = 2 and --max_completion_length 10: every completion is 10 characters (EOS is suppressed), so the reward is
    0 everywhere, as the warning says; the flag is used as given all the same."""
    example = load_example()
    unreachable = r"--max_completion_length 10: the task suppresses EOS .* reward is 0 for every sample"
    with pytest.warns(UserWarning, match=unreachable):
        trainer = example.main([*QUICK, "--max_completion_length", "10", "--logging_steps", "1",
                                "--output_dir", str(tmp_path)])
    (log,) = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    assert log["completions/mean_length"] == log["completions/min_length"] == 10
    assert log["reward"] == 0
    with pytest.warns(UserWarning, match=r"--max_completion_length 1 is shorter than the 2 characters"):
        example.build_trainer([*QUICK, "--max_completion_length", "1", "--output_dir", str(tmp_path)])
    with pytest.warns(UserWarning, match=r"--max_prompt_length 2 keeps only the last 2 of each prompt's 3 tokens"):
        example.build_trainer([*QUICK, "--max_prompt_length", "2", "--output_dir", str(tmp_path)])


def test_reverse_task_lengths_that_can_score_raise_no_warning(tmp_path, recwarn):
    """The defaults, and a longer completion once --generation_kwargs lets the model write EOS (it may stop at H)."""
    example = load_example()
    example.build_trainer([*QUICK, "--output_dir", str(tmp_path)])
    tokenizer = reverse_task_tokenizer()
    allow_eos = [token for token in binary_only_generation_kwargs(tokenizer)["suppress_tokens"]
                 if token != tokenizer.eos_token_id]
    trainer = example.build_trainer(
        [*QUICK, "--max_completion_length", "10", "--generation_kwargs", json.dumps({"suppress_tokens": allow_eos}),
         "--output_dir", str(tmp_path)]
    )
    assert trainer.args.generation_kwargs == {"suppress_tokens": allow_eos}  # the user's key wins
    assert trainer.args.max_completion_length == 10
    assert not [warning for warning in recwarn if str(warning.message).startswith("--")]


DATASET = ["--dataset_name", "no-such-org/no-such-data", "--model_name_or_path", "no-such-org/no-such-model",
           "--reward_funcs", "exact_match"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # 6 is --reverse_length's default: written on the command line, it is refused all the same.
        (["--task", "guess", "--reverse_length", "6"], "--reverse_length sets the length of the reverse task's"),
        (["--task", "lock", "--reverse_length", "4"], "--reverse_length sets the length of the reverse task's"),
        (["--task", "reverse", "--lock_keys", "4"], r"--lock_keys sets the number of the lock's keys, and --task "
                                                    r"reverse plays another task"),
        (["--dataset_config", "small"], "--dataset_config: these select parts of --dataset_name's dataset"),
        (["--dataset_train_split", "train", "--dataset_test_split", "test"],
         "--dataset_train_split, --dataset_test_split: these select parts of --dataset_name's"),
        (["--model_revision", "main"], "--model_revision main selects a version of --model_name_or_path"),
        ([*DATASET, "--task", "reverse", "--num_prompts", "8"], "--task, --num_prompts: the embedded tasks' settings"),
    ],
)
def test_flags_that_would_be_ignored_are_refused_before_any_work(tmp_path, flags, message):
    example = load_example()
    # The dataset and model named in DATASET do not exist: reaching either would fail with another message. Nothing
    # trains here, even when a refusal is missed.
    with pytest.raises(SystemExit, match=message):
        example.build_trainer([*flags, "--output_dir", str(tmp_path)])


def test_lora_flags_without_use_peft_are_ignored_with_a_warning(tmp_path):
    example = load_example()
    with pytest.warns(UserWarning, match=r"--lora_r, --lora_alpha ignored: they configure --use_peft, which is off"):
        trainer = example.build_trainer([*QUICK, "--lora_r", "4", "--lora_alpha", "8", "--output_dir", str(tmp_path)])
    assert not isinstance(trainer.model, PeftModel)


def test_vllm_flags_without_use_vllm_are_named_in_a_warning_even_at_their_defaults(tmp_path):
    example = load_example()
    flags = ["--vllm_mode", "server", "--vllm_server_port", "8000", "--output_dir", str(tmp_path)]  # both defaults
    with pytest.warns(UserWarning, match=r"--vllm_mode, --vllm_server_port ignored: they configure --use_vllm"):
        trainer = example.build_trainer([*QUICK, *flags])
    assert not trainer.args.use_vllm
    with pytest.warns(UserWarning) as caught:  # a value off its default: named once, not by the config as well
        example.build_trainer([*QUICK, "--vllm_server_port", "9000", "--output_dir", str(tmp_path)])
    assert len([w for w in caught if "vllm_server_port" in str(w.message)]) == 1


def test_help_opens_with_what_the_script_does_and_three_example_commands(tmp_path):
    example = load_example()
    text = example.build_parser().format_help()
    usage, description, _ = text.split("\n\n", 2)
    assert usage.startswith("usage:") and "\n" not in usage  # one line, not every flag before the description
    assert description.startswith("Fine-tune a causal language model with Target Policy Optimization (TPO).")
    examples = text[text.index("examples:") : text.index("options:")]
    commands = [shlex.split(line) for line in examples.replace("\\\n", " ").splitlines()
                if line.strip().startswith(("python ", "accelerate "))]
    assert len(commands) == 3
    # Each command's flags are the script's, and mean what the comment above it says.
    parsed = [example.parse_arguments([*command[command.index("examples/target_po.py") + 1 :],
                                       "--output_dir", str(tmp_path)]) for command in commands]
    (default, _, _), (guess, _, _), (hub, hub_args, _) = parsed
    assert default == example.ScriptArguments() and guess.task == "guess"
    assert hub.model_name_or_path and hub.dataset_name and hub_args.use_vllm


# --- TRL's model flags (ModelConfig) ------------------------------------------------------------------------------

#: One quick step of the embedded reversal task: 2-bit strings, so most groups of 4 hold a success and a failure and
#: the first step has a gradient.
QUICK = ["--reverse_length", "2", "--num_prompts", "64", "--per_device_train_batch_size", "32", "--num_generations",
         "4", "--max_steps", "1", "--report_to", "none", "--disable_tqdm", "true"]


def save_tiny_model(directory, num_layers=1, dtype=torch.float32, model_max_length=None):
    """A tiny model and its tokenizer saved as a checkpoint folder, as `from_pretrained` finds one on disk."""
    tokenizer = reverse_task_tokenizer()
    if model_max_length is not None:
        tokenizer.model_max_length = model_max_length
    build_tiny_causal_lm(tokenizer, num_layers=num_layers).to(dtype).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_trl_lora_flags_train_only_the_adapters_they_describe(tmp_path):
    example = load_example()
    base = save_tiny_model(tmp_path / "base")
    out = tmp_path / "run"
    trainer = example.main(
        [*QUICK, "--model_name_or_path", str(base), "--use_peft", "--lora_r", "4", "--lora_alpha", "8",
         "--lora_dropout", "0.1", "--lora_target_modules", "q_proj", "v_proj", "--dtype", "float32",
         "--output_dir", str(out)]
    )
    model = trainer.model
    assert isinstance(model, PeftModel)
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 8, 0.1)
    assert set(config.target_modules) == {"q_proj", "v_proj"} and config.task_type == "CAUSAL_LM"
    assert not config.use_rslora and not config.use_dora
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "v_proj"}
    # The output folder holds the adapter, with the same settings, and no full model.
    saved = json.loads((out / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], sorted(saved["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    assert (out / "adapter_model.safetensors").exists() and not (out / "model.safetensors").exists()
    # Only the adapters trained: every base weight still equals the checkpoint's, and the adapters moved off their
    # zero initialisation (lora_B starts at 0).
    trained = {name.replace("base_model.model.", "", 1).replace(".base_layer", ""): param
               for name, param in model.named_parameters() if "lora_" not in name}
    assert all(not param.requires_grad for param in trained.values())
    snapshot = load_file(base / "model.safetensors")
    assert snapshot.keys() <= trained.keys()
    for name, weight in snapshot.items():
        assert torch.equal(trained[name].detach(), weight), name
    lora_b = [param for name, param in model.named_parameters() if "lora_B" in name]
    assert lora_b and all(param.requires_grad for param in lora_b)
    assert any(param.abs().sum() > 0 for param in lora_b)


def test_lora_target_modules_pass_patterns_as_strings_and_names_as_lists(tmp_path):
    example = load_example()

    def targets(*values):
        _, _, model_args = example.parse_arguments(
            ["--use_peft", "--lora_target_modules", *values, "--output_dir", str(tmp_path)]
        )
        return example.lora_config(model_args).target_modules

    assert targets("all-linear") == "all-linear"  # PEFT's shorthand, read from a string only
    assert targets(r".*\.(q|v)_proj") == r".*\.(q|v)_proj"  # a regular expression over whole module names
    assert targets("q_proj") == {"q_proj"}  # a plain name stays a name (as a string PEFT would need a full match)
    assert targets("q_proj", "v_proj") == {"q_proj", "v_proj"}
    _, _, model_args = example.parse_arguments(["--lora_r", "4", "--output_dir", str(tmp_path)])
    assert example.lora_config(model_args) is None  # without --use_peft the LoRA flags are ignored, as in TRL


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], torch.float32),  # TRL's default, whatever the checkpoint holds
        (["--dtype", "auto"], torch.bfloat16),  # the checkpoint's own
        (["--dtype", "float16"], torch.float16),
    ],
)
def test_dtype_sets_the_precision_a_checkpoint_loads_in(tmp_path, flags, expected):
    example = load_example()
    base = save_tiny_model(tmp_path / "base", dtype=torch.bfloat16)
    trainer = example.main([*QUICK, "--model_name_or_path", str(base), *flags, "--output_dir", str(tmp_path / "run")])
    assert {param.dtype for param in trainer.model.parameters()} == {expected}


@pytest.mark.parametrize("embedded", [True, False])
def test_dtype_and_attn_implementation_reach_the_model(tmp_path, embedded):
    """The same flags give the same model whether it is loaded from a checkpoint or the embedded one is built."""
    example = load_example()
    source = [] if embedded else ["--model_name_or_path", str(save_tiny_model(tmp_path / "base"))]
    trainer = example.main(
        [*QUICK, *source, "--dtype", "bfloat16", "--attn_implementation", "eager",
         "--output_dir", str(tmp_path / "run")]
    )
    assert {param.dtype for param in trainer.model.parameters()} == {torch.bfloat16}
    assert trainer.model.config._attn_implementation == "eager"
    default = example.main([*QUICK, *source, "--output_dir", str(tmp_path / "default")])
    assert {param.dtype for param in default.model.parameters()} == {torch.float32}
    assert default.model.config._attn_implementation != "eager"  # the model's own choice


def test_model_revision_picks_the_version_of_model_and_tokenizer(tmp_path, monkeypatch):
    """A Hub repository with two revisions, laid out in a local Hub cache as a download leaves it (the tests run with
    HF_HUB_OFFLINE=1, so it is read from there): --model_revision selects the model and the tokenizer."""
    repo = tmp_path / "hub" / "models--local-org--tiny"
    for ref, commit, layers, max_length in (("main", "a" * 40, 1, 111), ("v1", "b" * 40, 2, 222)):
        save_tiny_model(repo / "snapshots" / commit, num_layers=layers, model_max_length=max_length)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # where the cache lives
    example = load_example()
    run = [*QUICK, "--model_name_or_path", "local-org/tiny"]
    chosen = example.main([*run, "--model_revision", "v1", "--output_dir", str(tmp_path / "v1")])
    assert chosen.model.config.num_hidden_layers == 2 and chosen.processing_class.model_max_length == 222
    main = example.main([*run, "--output_dir", str(tmp_path / "main")])  # TRL's default revision, "main"
    assert main.model.config.num_hidden_layers == 1 and main.processing_class.model_max_length == 111


def custom_code_checkpoint(directory):
    """A checkpoint whose repository ships its own model and tokenizer code (``auto_map``), as some Hub models do."""
    save_tiny_model(directory)
    (directory / "custom_code.py").write_text(
        "from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM\n\n\n"
        "class CustomConfig(Qwen2Config):\n    model_type = 'custom-qwen2'\n\n\n"
        "class CustomForCausalLM(Qwen2ForCausalLM):\n    config_class = CustomConfig\n\n\n"
        "class CustomTokenizerFast(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "custom-qwen2"
    config["auto_map"] = {
        "AutoConfig": "custom_code.CustomConfig", "AutoModelForCausalLM": "custom_code.CustomForCausalLM"
    }
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "CustomTokenizerFast"
    tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "custom_code.CustomTokenizerFast"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def test_trust_remote_code_reaches_the_model_and_the_tokenizer(tmp_path):
    example = load_example()
    run = [*QUICK, "--model_name_or_path", str(custom_code_checkpoint(tmp_path / "custom"))]
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        example.main([*run, "--output_dir", str(tmp_path / "refused")])
    trainer = example.main([*run, "--trust_remote_code", "--output_dir", str(tmp_path / "run")])
    assert trainer.args.trust_remote_code  # one flag: TargetPOConfig's, which the trainer also gives reward models
    assert type(trainer.model).__name__ == "CustomForCausalLM"  # the repository's own classes ran
    assert type(trainer.processing_class).__name__ == "CustomTokenizerFast"


def test_quantization_without_bitsandbytes_or_a_gpu_is_refused_before_any_work(tmp_path):
    example = load_example()
    # Neither the dataset nor the model exists: reaching either would fail with another message.
    run = ["--dataset_name", "no-such-org/no-such-data", "--reward_funcs", "exact_match", "--model_name_or_path",
           "no-such-org/no-such-model", "--use_peft", "--output_dir", str(tmp_path)]
    for flag in ("--load_in_4bit", "--load_in_8bit"):
        with pytest.raises(SystemExit) as refused:
            example.main([*run, flag])
        message = str(refused.value)
        assert f"{flag} needs the bitsandbytes package" in message and "pip install bitsandbytes" in message
        assert f"{flag} needs a CUDA GPU" in message
        assert "could not load" not in message
    with pytest.raises(SystemExit, match="--load_in_4bit and --load_in_8bit exclude each other"):
        example.main([*run, "--load_in_4bit", "--load_in_8bit"])


def test_quantization_flags_build_trl_s_bitsandbytes_settings(tmp_path):
    """The GPU side: bitsandbytes and CUDA are missing here, so this checks what the flags build and the script
    hands to `from_pretrained` (through model_init_kwargs), not a quantised load. The boundary the test stops at."""
    example = load_example()
    _, training_args, model_args = example.parse_arguments(
        ["--load_in_4bit", "--bnb_4bit_quant_type", "fp4", "--use_bnb_nested_quant", "--dtype", "bfloat16",
         "--model_revision", "v2", "--attn_implementation", "eager", "--output_dir", str(tmp_path)]
    )
    kwargs = example.model_init_kwargs(model_args, training_args)
    quantization = kwargs.pop("quantization_config")
    assert isinstance(quantization, BitsAndBytesConfig)
    assert quantization.load_in_4bit and not quantization.load_in_8bit
    assert quantization.bnb_4bit_quant_type == "fp4" and quantization.bnb_4bit_use_double_quant
    assert quantization.bnb_4bit_compute_dtype == torch.bfloat16  # the compute dtype is --dtype
    assert kwargs == {"revision": "v2", "dtype": "bfloat16", "attn_implementation": "eager", "device_map": {"": 0}}
    _, training_args, model_args = example.parse_arguments(["--load_in_8bit", "--output_dir", str(tmp_path)])
    quantization = example.quantization_config(model_args)
    assert quantization.load_in_8bit and not quantization.load_in_4bit
    # Keys given in --model_init_kwargs win over the flags.
    _, training_args, model_args = example.parse_arguments(
        ["--model_init_kwargs", '{"dtype": "float16"}', "--output_dir", str(tmp_path)]
    )
    assert example.model_init_kwargs(model_args, training_args) == {"revision": "main", "dtype": "float16"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model_revision", "v1"], "--model_revision v1 selects a version of --model_name_or_path, but none"),
        (["--use_peft", "--lora_task_type", "SEQ_CLS"], "its adapters must be CAUSAL_LM"),
        (["--load_in_4bit", "--use_peft"], "the embedded model is built in memory, not loaded"),
        (["--load_in_8bit"], "--load_in_8bit needs --use_peft"),
        (["--load_in_4bit", "--dtype", "auto"], "must then name one: pass --dtype bfloat16"),
    ],
)
def test_model_flags_that_cannot_work_together_are_refused(tmp_path, flags, message):
    example = load_example()
    with pytest.raises(SystemExit, match=message):
        example.main([*QUICK, *flags, "--output_dir", str(tmp_path)])


def test_an_unknown_dtype_is_refused_with_the_choices(tmp_path, capsys):
    example = load_example()
    with pytest.raises(SystemExit):
        example.main(["--dtype", "float64", "--output_dir", str(tmp_path)])
    assert "invalid choice: 'float64'" in capsys.readouterr().err


def test_help_lists_every_flag_once_in_sections_tpo_first():
    # argparse formats each help text with %-substitution: one stray '%' in a field's help breaks --help for all.
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "target_po.py"), "--help"], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    example = load_example()
    sections = {title: listed for title, listed in help_sections(result.stdout).items() if listed}
    assert list(sections) == [*FLAG_GROUPS, TRAINER_FLAG_GROUP]  # TPO first; no flag left under "options"
    listed = [name for names in sections.values() for name in names]
    assert sorted(listed) == sorted(flag_names(example.ScriptArguments, TargetPOConfig, example.ModelArguments))
    # The script's own flags beside the library's of the same concern.
    assert {"model_name_or_path", "dtype", "use_peft", "model_init_kwargs"} <= set(sections["model"])
    assert {"dataset_name", "task", "shuffle_dataset"} <= set(sections["data"])
    assert {"reward_funcs", "reward_weights"} <= set(sections["rewards"])


def refused_on_the_command_line(flags: list[str]) -> str:
    """The script's stderr when it refuses `flags`: argparse's usage line and one error line, no traceback."""
    result = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(result.stderr.splitlines()) == 2 and result.stderr.startswith("usage:"), result.stderr[-3000:]
    return result.stderr.splitlines()[-1]


def test_a_misspelt_flag_is_one_error_naming_the_flag_meant(tmp_path):
    error = refused_on_the_command_line(["--num_generation", "4", "--output_dir", str(tmp_path)])
    assert error.endswith("error: --num_generation is not a flag: did you mean --num_generations, "
                          "--num_generations_eval or --num_iterations?")


def test_a_refused_setting_is_the_config_s_message_without_a_traceback(tmp_path):
    with pytest.raises(ValueError) as raised:
        TargetPOConfig(output_dir=str(tmp_path), tpo_target_temperature=0.0)
    error = refused_on_the_command_line(["--tpo_target_temperature", "0", "--output_dir", str(tmp_path)])
    assert error.endswith(f"error: {raised.value}")


def test_abbreviations_are_refused_naming_the_flags_meant(tmp_path, capsys):
    example = load_example()
    with pytest.raises(SystemExit) as refused:
        example.parse_arguments(["--lr", "1e-5", "--output_dir", str(tmp_path)])
    assert refused.value.code == 2
    assert "error: --lr is not a flag: did you mean --learning_rate, " in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a flag's beginning is no longer read as the flag
        example.parse_arguments(["--tpo_target_temp", "0.5", "--output_dir", str(tmp_path)])
    assert "did you mean --tpo_target_temperature" in capsys.readouterr().err
