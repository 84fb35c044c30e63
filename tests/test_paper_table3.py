"""benchmarks/paper_table3.py: the exact-match error it reports, on policies whose error is known in closed form, and
the script end to end on its smallest configuration (records appended across invocations, the report)."""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "paper_table3.py"
_spec = importlib.util.spec_from_file_location("paper_task", ROOT / "benchmarks" / "paper_task.py")
paper_task = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paper_task)

LENGTH = 4


class ForcedBits(LogitsProcessor):
    """Lets only one bit through at each step: the prompt's bit that the reversal puts there, or its opposite."""

    def __init__(self, length: int, reversal: bool):
        self.length, self.reversal = length, reversal

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        position = input_ids.shape[1] - self.length  # bits written so far
        bit = input_ids[:, self.length - 1 - position]
        forced = bit if self.reversal else 1 - bit
        return torch.full_like(scores, float("-inf")).scatter(1, forced[:, None], 0.0)


def sampled_error(model, processor: LogitsProcessor, num_prompts: int = 16) -> float:
    """The paper's estimator: exact-match error of completions sampled at temperature 1 for random prompts."""
    tokenizer = paper_task.bit_tokenizer()
    prompts = paper_task.paper_prompts(LENGTH, num_prompts, seed=0)
    inputs = tokenizer(list(prompts["prompt"]), return_tensors="pt")
    generated = model.generate(
        **inputs, do_sample=True, temperature=1.0, max_new_tokens=LENGTH, min_new_tokens=LENGTH,
        logits_processor=LogitsProcessorList([processor]), pad_token_id=tokenizer.pad_token_id,
    )
    completions = tokenizer.batch_decode(generated[:, LENGTH:])
    return paper_task.exact_match_error(completions, list(prompts["target"]))


@pytest.mark.parametrize("reversal, error", [(True, 0.0), (False, 100.0)])
def test_a_policy_forced_to_the_reversal_or_away_from_it_has_error_0_or_100(reversal, error):
    model = paper_task.reference_model(LENGTH, seed=0)
    processor = ForcedBits(LENGTH, reversal)
    assert paper_task.expected_exact_match_error(model, LENGTH, processor) == error
    assert sampled_error(model, processor) == error


def test_a_uniform_policy_has_the_error_of_a_coin_per_bit():
    model = paper_task.reference_model(LENGTH, seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # the head has no bias: every logit 0, each bit 1/2 whatever the input
    expected = paper_task.expected_exact_match_error(model, LENGTH)
    assert expected == pytest.approx(100.0 * (1 - 2.0**-LENGTH), abs=1e-4)


def script(*arguments: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(SCRIPT), *arguments], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def run_script(*arguments: str) -> str:
    result = script(*arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_smallest_configuration_end_to_end_appends_runs_and_reports_every_method(tmp_path):
    output = tmp_path / "table3.json"
    small = ["--lengths", "3", "--prompts_per_step", "4", "--num_generations", "4", "--steps", "3",
             "--eval_every", "1", "--output", str(output)]
    # TRL and matplotlib are benchmark extras ("[bench]"): their parts run where they are installed.
    has_trl, has_matplotlib = (importlib.util.find_spec(name) is not None for name in ("trl", "matplotlib"))
    methods = ["targetpo-tpo", "targetpo-grpo", *(["trl-grpo"] if has_trl else [])]
    run_script(*small, "--seeds", "0", "--methods", *methods)
    first = json.loads(output.read_text())["runs"]
    assert sorted(run["method"] for run in first) == sorted(methods)
    for run in first:
        assert (run["H"], run["K"], run["B"], run["seed"], run["steps"]) == (3, 4, 4, 0, 3)
        assert len(run["curve"]) == 3 and run["final_error"] == run["curve"][-1]
        # each rollout's error is the share of its 16 completions that are wrong
        assert all(0 <= error <= 100 and (error / 6.25).is_integer() for error in run["curve"])
        assert 0 <= run["expected_error"] <= 100
        assert [rollout for rollout, _ in run["eval_curve"]] == [1, 2, 3]
        assert run["eval_curve"][-1][1] == pytest.approx(run["expected_error"], abs=1e-3)

    # Runs stopped by the time limit (each at its first rollout's end: the limit is 0) resume from their checkpoints
    # to the records of the runs above, which ran straight through (GRPO's KL reference included).
    checkpoints, resumed_output = tmp_path / "checkpoints", tmp_path / "resumed.json"
    interrupted = [*small[:-1], str(resumed_output), "--seeds", "0", "--methods", *methods,
                   "--checkpoints", str(checkpoints), "--checkpoint_every", "1", "--jobs", "2"]  # the limit reaches each
    assert run_script(*interrupted, "--time_limit", "0").count("stopped at the time limit") == len(methods)
    assert not resumed_output.exists() and len(list(checkpoints.iterdir())) == len(methods)
    # A checkpoint from another kind of device (its random stream differs), or evaluated at another cadence, is
    # refused before any run trains (GRPO's, first in line, would resume fine).
    [progress] = (checkpoints / "targetpo-tpo-H3-K4-B4-seed0-steps3-i4-lr0.001").glob("checkpoint-*/*progress.json")
    saved = progress.read_text()
    progress.write_text(json.dumps(dict(json.loads(saved), device="NVIDIA H100 80GB HBM3")))
    refused = script(*interrupted[:-2], "--methods", "targetpo-grpo", "targetpo-tpo")
    assert refused.returncode != 0 and "device 'NVIDIA H100 80GB HBM3' (here: 'cpu')" in refused.stderr
    assert not resumed_output.exists()
    progress.write_text(saved)
    refused = script(*interrupted[:-2], "--methods", "targetpo-tpo", "--eval_every", "2")
    assert refused.returncode != 0 and "eval_every 1 (here: 2)" in refused.stderr
    refused = script(*interrupted[:-2], "--methods", "targetpo-tpo", "--share_prompts")
    assert refused.returncode != 0 and "share_prompts False (here: True)" in refused.stderr
    # A newer checkpoint without its progress file (the process killed while saving it) is passed over.
    incomplete = progress.parent.with_name("checkpoint-999")
    shutil.copytree(progress.parent, incomplete, ignore=shutil.ignore_patterns(progress.name))
    # A resumed run's times add up over its segments: the checkpoint's (made larger here, to tell them apart) and its own.
    earlier = json.loads(saved)
    progress.write_text(json.dumps(dict(earlier, train_seconds=earlier["train_seconds"] + 500,
                                        wall_seconds=earlier["wall_seconds"] + 1000)))
    run_script(*interrupted)
    resumed = json.loads(resumed_output.read_text())["runs"]
    assert not any(checkpoints.iterdir())  # a finished run's checkpoints are removed
    resumed.sort(key=lambda run: methods.index(run["method"]))  # in the order they finished
    assert [run["method"] for run in resumed] == [run["method"] for run in first]
    for straight, stopped in zip(first, resumed):
        assert stopped["resumed"] and not straight["resumed"]
        for field in ("curve", "eval_curve", "expected_error"):
            assert stopped[field] == straight[field], (straight["method"], field)
        assert stopped["wall_seconds"] >= stopped["train_seconds"] > 0
    tpo = resumed[methods.index("targetpo-tpo")]
    assert tpo["wall_seconds"] - 1000 >= tpo["train_seconds"] - 500 > 0

    # Two runs at a time, each in a process of its own, appended to the same file.
    run_script(*small, "--seeds", "1", "--methods", "targetpo-tpo", "targetpo-grpo", "--jobs", "2")
    second = json.loads(output.read_text())["runs"]
    added = second[len(first) :]
    assert second[: len(first)] == first and len(added) == 2
    assert sorted((run["method"], run["seed"]) for run in added) == [("targetpo-grpo", 1), ("targetpo-tpo", 1)]
    # A run in its own process is the run this process would have trained: every setting reached it.
    alone = tmp_path / "alone.json"
    run_script(*small[:-1], str(alone), "--seeds", "1", "--methods", "targetpo-tpo")
    [sequential] = json.loads(alone.read_text())["runs"]
    [parallel] = [run for run in added if run["method"] == "targetpo-tpo"]
    for field in ("curve", "eval_curve", "expected_error", "settings"):
        assert parallel[field] == sequential[field], field

    # --share_prompts reaches targetpo's trainer; TRL has no such setting, so it is refused with trl-grpo.
    shared = tmp_path / "shared.json"
    run_script(*small[:-1], str(shared), "--seeds", "1", "--methods", "targetpo-tpo", "--share_prompts")
    [shared_run] = json.loads(shared.read_text())["runs"]
    assert shared_run["settings"] == dict(sequential["settings"], share_prompt_forward=True)
    refused = script(*small, "--seeds", "1", "--methods", "trl-grpo", "--share_prompts")
    assert refused.returncode != 0 and "run trl-grpo in an invocation without it" in refused.stderr

    assert "already in" in run_script(*small, "--seeds", "1", "--methods", "targetpo-tpo")  # not run twice
    assert len(json.loads(output.read_text())["runs"]) == len(second)

    reported = script("--report_only", "--output", str(output))
    assert reported.returncode == 0, reported.stderr[-3000:]
    text = reported.stdout
    table = [line for line in text.splitlines() if line.startswith("| ")]
    for method in methods:
        assert any(line.startswith(f"| {method} | 3 | 4 | 4 | 3 |") for line in table), method
    assert "| targetpo-tpo | 3 | 4 | 4 | 3 | 2 |" in text  # two seeds of targetpo-tpo in one row
    assert output.with_suffix(".md").read_text().strip() == text.strip()
    if has_matplotlib:
        assert (tmp_path / "table3_by_length.png").stat().st_size > 0
    else:  # said on stderr: stdout is the report, as written to the .md file
        assert "matplotlib is not installed" in reported.stderr


def test_the_docs_command_lines_use_the_scripts_own_flags(monkeypatch):
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "benchmarks.md").read_text(), flags=re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    commands = [shlex.split(line.split("paper_table3.py", 1)[1], comments=True) for line in lines
                if "benchmarks/paper_table3.py" in line]
    assert len(commands) >= 6, commands
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the script's sibling modules
    spec = importlib.util.spec_from_file_location("paper_table3", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for words in commands:
        words = words[: words.index(">")] if ">" in words else words
        monkeypatch.setattr(sys, "argv", ["paper_table3.py", *words])
        script.parse_args()  # an unknown flag or value exits with an error
