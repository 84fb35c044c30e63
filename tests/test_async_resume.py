"""Resuming an asynchronous run (``async_rollouts``) from a checkpoint written while the next rollout was under way
ahead ends at the weights of the run straight through (to 1e-6), having trained on the same samples, recorded with the
same staleness: the checkpoint waits for the rollout ahead and keeps what it made (``rollout_ahead_<process>.pt``).

A backend written here stands in for the vLLM server at the rollout interface. It writes from the weights it last
received, known by their version (the optimiser step pushed): a completion's tokens follow the version its generation
started at and, for a generation under way ahead, the version pushed by the time it finishes (the tokens after a
push); each completion is labelled with its oldest version, and its sampling log-probs follow that version too.
Episodes played ahead are written by the version pushed when they started. A resumed run that sampled the rollout
ahead again, at its own weights, would write other tokens, at staleness 0.
"""

import warnings

import pytest
import torch
from conftest import count_letters_reward, make_config, prompt_dataset
from multi_turn_workers import ScriptedPolicy
from test_async_episodes import logged, serve
from test_multi_turn import guessing_trainer

from targetpo import TargetPOTrainer
from targetpo.demo import build_char_tokenizer, build_tiny_causal_lm, guessing_tokenizer
from targetpo.faults.checkpoints import CheckpointWriteError
from targetpo.generation import PendingCompletions, RolloutBackend, completion_masks
from targetpo.generation.vllm_server import ServerGone

LETTERS = "abcdefgh"


class FinishedLater(PendingCompletions):
    """A generation under way: written when :meth:`result` is first asked for, by the weights pushed by then."""

    def __init__(self, write):
        super().__init__()
        self.write = write

    def result(self):
        if self._completions is None:
            self._completions = self.write()
        return self._completions


class VersionedServer(RolloutBackend):
    """The stand-in server: holds the version of the weights last pushed, and writes by it."""

    holds_weights = True
    overlaps_training = True

    def __init__(self, tokenizer):
        self.tokenizer, self.version, self.pushes = tokenizer, None, []
        self.own = OwnConnection(self)

    def sync_weights(self, model, version):
        self.version = version
        self.pushes.append(version)

    def start(self, prompt_ids, prompt_mask, max_new_tokens=None, images=None):
        started = self.version
        return FinishedLater(lambda: self.letters(prompt_ids, prompt_mask, started, self.version))

    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None):
        return self.letters(prompt_ids, prompt_mask, self.version, self.version)

    def letters(self, prompt_ids, prompt_mask, first, later):
        """Two letters by version ``first``, two by ``later``, then EOS; labelled with ``first``."""
        rows = []
        for row, (ids, mask) in enumerate(zip(prompt_ids, prompt_mask)):
            seed = int(ids[mask.bool()].sum()) + row
            text = "".join(LETTERS[(seed + 3 * version + place) % len(LETTERS)]
                           for place, version in enumerate((first, first, later, later)))
            rows.append(self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id])
        return labelled(completion_masks(torch.tensor(rows), [self.tokenizer.eos_token_id]), first)

    def for_this_process(self):
        self.own.version = self.version  # asked for on the training thread as each rollout starts playing ahead
        return self.own


class OwnConnection(RolloutBackend):
    """The process's own connection, for episodes played ahead: every turn by the version pushed when they started."""

    def __init__(self, server):
        self.server, self.version = server, None

    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None):
        return guesses(self.server.tokenizer, prompt_ids, prompt_mask, max_new_tokens, self.version)


def guesses(tokenizer, prompt_ids, prompt_mask, max_new_tokens, version):
    """A guessing game's turn by weights ``version``: a digit that follows the version and the conversation so far."""
    policy = ScriptedPolicy(tokenizer, lambda context: str((3 * version + sum(map(ord, context))) % 8))
    return labelled(policy.generate(prompt_ids, prompt_mask, max_new_tokens), version)


def labelled(completions, version):
    """Completions with the sampling log-probs and the weight version of the weights ``version`` that wrote them."""
    completions.weight_versions = torch.full((len(completions.ids),), version)
    completions.sampler_logps = -0.5 * (1 + version) * completions.attention_mask.float()
    return completions


class GuessingServer(VersionedServer):
    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None):
        return guesses(self.tokenizer, prompt_ids, prompt_mask, max_new_tokens, self.version)


def recording(samples, reward):
    """``reward``, recording each rollout's optimiser step and completion ids."""

    def recorded(completions, completion_ids, trainer_state, **kwargs):
        samples.append((trainer_state.global_step, [list(ids) for ids in completion_ids]))
        return reward(completions)

    return recorded


def letters(completions):
    return [score + index / len(completions) for index, score in enumerate(count_letters_reward(completions))]


def by_position(completions):
    return [index / len(completions) for index in range(len(completions))]


def letters_trainer(out_dir, samples, **overrides):
    tokenizer = build_char_tokenizer()
    settings = {**dict(use_vllm=True, vllm_mode="server", async_rollouts=True, max_steps=4), **overrides}
    return TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128, seed=0),
        recording(samples, letters), args=make_config(out_dir, **settings), train_dataset=prompt_dataset.__wrapped__(),
        processing_class=tokenizer,
    )  # fmt: skip


def weights(trainer):
    return torch.cat([parameter.detach().flatten() for parameter in trainer.model.parameters()])


def assert_resumed_as_straight(straight, resumed, straight_samples, resumed_samples, checkpoint_step):
    assert resumed.state.global_step == straight.state.global_step
    difference = (weights(resumed) - weights(straight)).abs().max()
    assert torch.allclose(weights(resumed), weights(straight), atol=1e-6), difference
    # The rollouts the resumed run made are the straight run's from the checkpoint on, sample for sample.
    assert resumed_samples == [sample for sample in straight_samples if sample[0] >= checkpoint_step]
    for name in ("rollout/staleness_max", "rollout/staleness_mean", "reward"):  # the checkpoint's log, then the same
        assert logged(resumed, name) == pytest.approx(logged(straight, name)), name


#: (steps_per_generation, max_staleness, the checkpoint resumed from): the next rollout starts at the current one's
#: first micro-step, so every checkpoint falls while one is under way ahead; with two steps per rollout the checkpoint
#: of step 1 falls in the middle of a rollout as well.
CASES = {"rollout-per-step": (1, 1, 2), "mid-rollout": (2, 2, 1)}


@pytest.mark.parametrize("steps_per_generation, max_staleness, checkpoint_step", list(CASES.values()), ids=list(CASES))
def test_a_run_resumed_while_a_rollout_was_generated_ahead_trains_on_its_samples_as_straight_through(
    tmp_path, monkeypatch, steps_per_generation, max_staleness, checkpoint_step
):
    settings = dict(steps_per_generation=steps_per_generation, max_staleness=max_staleness)
    straight_samples, resumed_samples = [], []
    serve(monkeypatch, VersionedServer(build_char_tokenizer()))
    straight = letters_trainer(tmp_path / "straight", straight_samples, save_strategy="steps", save_steps=1, **settings)
    straight.train()
    straight.close()
    # Every rollout after the first was generated ahead, starting a step (or two) before it trained.
    assert logged(straight, "rollout/staleness_max")[1:] == [max_staleness] * (4 // steps_per_generation - 1)
    checkpoint = tmp_path / "straight" / "out" / f"checkpoint-{checkpoint_step}"
    assert (checkpoint / "rollout_ahead_0.pt").exists()
    assert (checkpoint / "rollout_in_progress_0.pt").exists() == (steps_per_generation > 1)

    serve(monkeypatch, VersionedServer(build_char_tokenizer()))  # a server restarted with the resumed run
    resumed = letters_trainer(tmp_path / "resumed", resumed_samples, **settings)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*generated ahead.*")
        resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed.close()
    assert_resumed_as_straight(straight, resumed, straight_samples, resumed_samples, checkpoint_step)


def test_a_run_resumed_while_episodes_were_played_ahead_trains_on_them_as_straight_through(tmp_path, monkeypatch):
    """Environments' episodes played ahead on the process's own connection: the checkpoint keeps them as played, the
    environments included, for the dataset rows they were played for."""
    straight_samples, resumed_samples = [], []
    settings = dict(use_vllm=True, vllm_mode="server", async_rollouts=True, max_steps=4)
    serve(monkeypatch, GuessingServer(guessing_tokenizer()))
    straight = guessing_trainer(
        tmp_path / "straight", reward_funcs=recording(straight_samples, by_position), save_strategy="steps",
        save_steps=1, **settings,
    )  # fmt: skip
    straight.train()
    straight.close()
    assert logged(straight, "rollout/staleness_max") == [0, 1, 1, 1]
    checkpoint = tmp_path / "straight" / "out" / "checkpoint-2"
    assert (checkpoint / "rollout_ahead_0.pt").exists()

    serve(monkeypatch, GuessingServer(guessing_tokenizer()))
    resumed = guessing_trainer(tmp_path / "resumed", reward_funcs=recording(resumed_samples, by_position), **settings)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*generated ahead.*")
        resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed.close()
    assert_resumed_as_straight(straight, resumed, straight_samples, resumed_samples, 2)


def test_a_run_resumed_without_async_rollouts_samples_the_rollout_ahead_again_and_says_so(tmp_path, monkeypatch):
    straight_samples, resumed_samples = [], []
    serve(monkeypatch, VersionedServer(build_char_tokenizer()))
    straight = letters_trainer(tmp_path / "straight", straight_samples, max_steps=2, save_strategy="steps", save_steps=1)
    straight.train()
    straight.close()
    resumed = letters_trainer(tmp_path / "resumed", resumed_samples, max_steps=2, async_rollouts=False)
    with pytest.warns(UserWarning, match=r"generated ahead .* this run has async_rollouts=False\. That rollout is "
                                         r"sampled again at the resumed weights"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "out" / "checkpoint-1"))
    resumed.close()
    assert logged(resumed, "rollout/staleness_max") == [0, 0]  # the checkpoint's log, then a rollout made now
    assert resumed_samples != [sample for sample in straight_samples if sample[0] >= 1]


class LosesTheServerOnceAhead(OwnConnection):
    """The process's own connection finds the server gone on the first episodes played ahead."""

    def __init__(self, server):
        super().__init__(server)
        self.lost = False

    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None):
        if not self.lost:
            self.lost = True
            raise ServerGone("The vLLM server at http://stand-in could not be reached to generate: connection refused")
        return super().generate(prompt_ids, prompt_mask, max_new_tokens)


class GuessingServerThatComesBack(GuessingServer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.own = LosesTheServerOnceAhead(self)

    def recovers_from(self, error):
        return isinstance(error, ServerGone)


def test_episodes_ahead_lost_with_the_server_at_a_checkpoint_are_left_out_of_it_and_played_again(tmp_path, monkeypatch):
    """The checkpoint of step 1 waits for the episodes played ahead, which the server lost: with a server that comes
    back they are not the checkpoint's to keep; the next step plays them again, on the training thread."""
    serve(monkeypatch, GuessingServerThatComesBack(guessing_tokenizer()))
    settings = dict(use_vllm=True, vllm_mode="server", async_rollouts=True, max_steps=3)
    trainer = guessing_trainer(tmp_path, save_strategy="steps", save_steps=1, **settings)
    trainer.train()
    trainer.close()
    checkpoints = tmp_path / "out"
    assert not (checkpoints / "checkpoint-1" / "rollout_ahead_0.pt").exists()
    assert (checkpoints / "checkpoint-2" / "rollout_ahead_0.pt").exists()
    assert logged(trainer, "rollout/staleness_max") == [0, 0, 1]  # rollout 1 played again at step 1's weights


class FailingLater(PendingCompletions):
    """A generation under way that fails when its result is asked for."""

    def result(self):
        raise RuntimeError("the server failed on this rollout")


class FailsAhead(VersionedServer):
    """A server whose second rollout, generated ahead, fails."""

    starts = 0

    def start(self, prompt_ids, prompt_mask, max_new_tokens=None, images=None):
        self.starts += 1
        if self.starts == 2:
            return FailingLater()
        return super().start(prompt_ids, prompt_mask, max_new_tokens, images)


def test_a_rollout_ahead_that_fails_while_a_checkpoint_waits_for_it_stops_training_with_its_own_error(
    tmp_path, monkeypatch
):
    """Not a failure to write the checkpoint: the rollout's own error comes out, and the partial checkpoint is gone."""
    serve(monkeypatch, FailsAhead(build_char_tokenizer()))
    trainer = letters_trainer(tmp_path, [], save_strategy="steps", save_steps=1)
    with pytest.raises(RuntimeError, match="the server failed on this rollout") as raised:
        trainer.train()
    trainer.close()
    assert not isinstance(raised.value, CheckpointWriteError)
    assert trainer.state.global_step == 1
    assert sorted(path.name for path in (tmp_path / "out").iterdir() if "checkpoint" in path.name) == []
