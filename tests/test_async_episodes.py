"""Asynchronous agent rollouts without an engine: episodes (tools, environments, rollout_func) played ahead on a
thread of their own while training goes on, the weight pushes they straddle, and the weight version each sample is
tagged with.

A backend written here stands in for the vLLM server at the rollout interface: it writes the guessing game's halving
search (``ScriptedPolicy``), labels every turn with the version of the weights it last received, as the server labels
each token, and gives the process a connection of its own (``for_this_process``). Pushes and turns hand over to each
other so that every rollout played ahead has its first turn written before the next push and its later turns after
it, whatever the machine's speed (a later turn may follow a later push too). test_vllm.py runs the same on a real server.
"""

import threading

import pytest
import torch
from conftest import count_letters_reward, make_config
from datasets import Dataset
from multi_turn_workers import ScriptedPolicy, halving_search
from test_multi_turn import guessing_trainer, scripted_rollout

from targetpo import TargetPOTrainer
from targetpo.data import RepeatSampler
from targetpo.demo import GuessingGame, build_char_tokenizer, build_tiny_causal_lm, guessing_tokenizer
from targetpo.generation import RolloutBackend
from targetpo.generation.server_restarts import ServerRestarts
from targetpo.generation.vllm_server import ServerGone
from targetpo.rollout import scheduler as scheduler_module

#: How long a hand-over waits; a trainer that never hands over (a break) is then caught by what the test checks.
WAIT_S = 20.0
EPISODES_THREAD = "targetpo-episodes"


class ServedWeights:
    """What the stand-in server holds and saw: the version of the weights last pushed, every push, every turn."""

    def __init__(self, first_turns_before_push=lambda version: 0):
        self.condition = threading.Condition()
        self.version = None
        self.pushes = []
        self.turns = []  # (play: 0 on the training thread, else the rollout played ahead; turn; version; thread)
        self.plays = 0  # rollouts whose episodes started on the process's own connection
        self.first_turns = 0  # of those, how many have written their first turn
        # For the push of ``version``: how many rollouts played ahead must have written their first turn before it.
        self.first_turns_before_push = first_turns_before_push

    def push(self, version):
        with self.condition:
            needed = self.first_turns_before_push(version)
            self.condition.wait_for(lambda: self.first_turns >= needed, timeout=WAIT_S)
            self.version = version
            self.pushes.append(version)
            self.condition.notify_all()

    def write(self, script, prompt_ids, prompt_mask, max_new_tokens, play, turn):
        completions = script.generate(prompt_ids, prompt_mask, max_new_tokens)
        with self.condition:
            version = self.version
            self.turns.append((play, turn, version, threading.current_thread().name))
        completions.weight_versions = torch.full((len(prompt_ids),), -1 if version is None else version)
        return completions


class OwnConnection(RolloutBackend):
    """The process's own connection: plays one rollout's episodes at a time; its second turn waits for a push."""

    def __init__(self, script, weights):
        self.script, self.weights = script, weights
        self.seeds, self.cancels, self.cancelled = [], 0, False
        self.play, self.turn, self.first_version = 0, 0, None

    def start_playing(self, seed):
        self.seeds.append(seed)
        self.turn, self.cancelled = 0, False
        with self.weights.condition:
            self.weights.plays += 1
            self.play = self.weights.plays

    def cancel(self):
        weights = self.weights
        with weights.condition:
            self.cancels += 1
            self.cancelled = True
            weights.condition.notify_all()

    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None):
        weights = self.weights
        if self.turn == 1:  # the push after the first turn comes before the second
            with weights.condition:
                weights.condition.wait_for(lambda: self.cancelled or weights.version != self.first_version,
                                           timeout=WAIT_S)
        if self.cancelled:
            raise RuntimeError("The episodes played ahead were cancelled.")
        completions = weights.write(self.script, prompt_ids, prompt_mask, max_new_tokens, self.play, self.turn)
        if self.turn == 0:
            with weights.condition:
                self.first_version = int(completions.weight_versions[0])
                weights.first_turns += 1
                weights.condition.notify_all()
        self.turn += 1
        return completions


class ServedScript(RolloutBackend):
    """The trainer's connection to the stand-in server: holds weights the trainer pushes, and gives the process a
    connection of its own."""

    holds_weights = True

    def __init__(self, tokenizer, weights, policy=halving_search):
        self.script, self.weights = ScriptedPolicy(tokenizer, policy), weights
        self.own = OwnConnection(self.script, weights)

    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None):
        return self.weights.write(self.script, prompt_ids, prompt_mask, max_new_tokens, 0, None)

    def sync_weights(self, model, version):
        self.weights.push(version)

    def for_this_process(self):
        return self.own


def serve(monkeypatch, backend):
    """The trainer builds ``backend`` where it would connect to a vLLM server."""
    monkeypatch.setattr(scheduler_module, "build_rollout_backend", lambda *args, **kwargs: backend)


def logged(trainer, name):
    return [entry[name] for entry in trainer.state.log_history if name in entry]


def async_settings(**overrides):
    return dict(use_vllm=True, vllm_mode="server", async_rollouts=True, **overrides)


@pytest.mark.parametrize(
    "steps_per_rollout, max_staleness, max_steps",
    [(1, 1, 3), (2, 1, 4), (2, 2, 4)],
    ids=["rollout-per-step", "two-steps-staleness-1", "two-steps-staleness-2"],
)
def test_episodes_played_ahead_straddle_the_push_after_each_step_and_samples_are_tagged_with_their_oldest_turn(
    tmp_path, monkeypatch, steps_per_rollout, max_staleness, max_steps
):
    """The first rollout is played on the training thread with the weights pushed before it; rollout r >= 1 is played
    ahead, on the process's own connection, from optimiser step S*r - min(S, max_staleness) (as late as max_staleness
    allows); the weights are pushed after every optimiser step, at once, so its first turn is written by that step's
    weights and its later turns by a later step's. Each sample is tagged with its oldest turn's version: staleness
    min(S, max_staleness) for every sample of a rollout played ahead. Environments played ahead are not those of the
    training thread; the rollout played ahead of a step never run is cancelled at close."""
    lead = min(steps_per_rollout, max_staleness)
    starts = {r: steps_per_rollout * r - lead for r in range(1, max_steps + 1)}  # rollout r played ahead from there
    starts = {r: step for r, step in starts.items() if step < max_steps}
    weights = ServedWeights(lambda version: sum(step < version for step in starts.values()))
    reset_on = {}  # id of each environment reset -> the threads it was reset on

    class RecordingGame(GuessingGame):
        def reset(self, **row):
            reset_on.setdefault(id(self), set()).add(threading.current_thread().name.split("_")[0])
            return super().reset(**row)

    backend = ServedScript(guessing_tokenizer(), weights)
    serve(monkeypatch, backend)
    trainer = guessing_trainer(
        tmp_path, environment_factory=RecordingGame, max_steps=max_steps, steps_per_generation=steps_per_rollout,
        max_staleness=max_staleness, **async_settings(),
    )
    trainer.train()

    # One push before the first rollout, then one after every optimiser step, labelled with that step.
    assert weights.pushes == list(range(max_steps + 1))
    # The first rollout: on the training thread, through the trainer's connection, by the weights pushed before it.
    now = [(version, thread) for play, _, version, thread in weights.turns if play == 0]
    assert now and set(now) == {(0, "MainThread")}
    # Every later one ahead, on the episodes' thread: its first turn by the weights of the step it started at, its
    # later turns (after the push that followed that step) by a later step's, at most the step that trains on it (S*r).
    # With steps_per_rollout > max_staleness the episodes may still be playing when the next step pushes again: on a
    # slow machine a later turn then carries that push's version.
    assert weights.plays == len(starts)
    for r, start in starts.items():
        turns = [(turn, version, thread) for play, turn, version, thread in weights.turns if play == r]
        assert turns[0][:2] == (0, start), (r, turns)
        trained = steps_per_rollout * r < max_steps  # else it may still be playing: its later turns are not checked
        assert len(turns) > 1 or not trained, (r, turns)
        assert all(start + 1 <= version <= steps_per_rollout * r for turn, version, _ in turns[1:]), (r, turns)
        assert all(thread.startswith(EPISODES_THREAD) for *_, thread in turns), (r, turns)
    # Each sample's weight version is its oldest turn's: the step its rollout started at.
    rollouts = -(-max_steps // steps_per_rollout)
    for name in ("rollout/staleness_max", "rollout/staleness_mean"):
        assert logged(trainer, name) == [0] + [lead] * (rollouts - 1), name
    assert len(set(backend.own.seeds)) == len(starts)  # each rollout played ahead is sampled from a seed of its own
    # The environments played ahead are a set of their own.
    lanes = list(reset_on.values())
    assert all(len(threads) == 1 for threads in lanes)
    assert {threads.pop() for threads in lanes} == {"MainThread", EPISODES_THREAD}

    trainer.close()
    assert backend.own.cancels == 1  # the rollout played ahead of a step never run, and only it
    assert not [thread for thread in threading.enumerate() if thread.name.startswith(EPISODES_THREAD)]


def test_episodes_played_ahead_for_other_rows_are_cancelled_and_played_again(tmp_path, monkeypatch):
    """The episodes are used only for the dataset rows they were played for: with the sampler's guesses of the next
    rows wrong on purpose, each is cancelled and the rollout played on the training thread; every sample is scored
    with its own row's environment."""
    ordered = RepeatSampler.__iter__

    def guessing_wrong(self):
        for index, use, upcoming in ordered(self):
            yield index, use, upcoming if upcoming < 0 else (upcoming + 1) % self.num_prompts

    monkeypatch.setattr(RepeatSampler, "__iter__", guessing_wrong)
    weights = ServedWeights()
    backend = ServedScript(guessing_tokenizer(), weights)
    serve(monkeypatch, backend)
    scored = []

    def own_row(completions, environments, secret, **kwargs):
        scored.extend((environment.secret, row) for environment, row in zip(environments, secret))
        return [0.0] * len(completions)

    trainer = guessing_trainer(tmp_path, reward_funcs=own_row, max_steps=3, **async_settings())
    trainer.train()
    trainer.close()
    assert len(scored) == 3 * 16 and all(played == row for played, row in scored)
    assert backend.own.cancels == 3  # the two that missed, and the one ahead of a step never run
    assert {thread for play, _, _, thread in weights.turns if play == 0} == {"MainThread"}
    assert {play for play, *_ in weights.turns} == {0, 1, 2, 3}  # played ahead, and not used


def test_rollout_func_played_ahead_generates_through_the_processs_own_connection(tmp_path, monkeypatch):
    """rollout_func runs on the training thread for the first rollout, with the trainer's backend, and on the thread
    playing ahead for every later one, where ``trainer.rollout_backend`` is the process's own connection."""
    tokenizer = build_char_tokenizer()
    weights = ServedWeights()
    backend = ServedScript(tokenizer, weights, policy=lambda context: "ab")
    serve(monkeypatch, backend)
    script, calls = scripted_rollout(tokenizer), []

    def rollout_func(prompts, trainer):
        generating = trainer.rollout_backend
        calls.append((threading.current_thread().name.split("_")[0], generating))
        ids = tokenizer(prompts[:1], add_special_tokens=False, return_tensors="pt")["input_ids"]
        generating.generate(ids, torch.ones_like(ids), max_new_tokens=2)
        return script(prompts, trainer)

    trainer = TargetPOTrainer(
        build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=1, num_heads=2, max_positions=128),
        count_letters_reward, args=make_config(tmp_path, max_steps=3, **async_settings()),
        train_dataset=Dataset.from_dict({"prompt": ["p1", "p2", "p3", "p4"]}), processing_class=tokenizer,
        rollout_func=rollout_func,
    )
    trainer.train()
    trainer.close()
    assert calls[0] == ("MainThread", backend)
    assert len(calls) == 4 and all(call == (EPISODES_THREAD, backend.own) for call in calls[1:])


def test_a_failure_while_playing_ahead_stops_training_with_its_error(tmp_path, monkeypatch):
    class FailingAhead(GuessingGame):
        def reset(self, **row):
            if threading.current_thread().name.startswith(EPISODES_THREAD):
                raise RuntimeError("the board could not be set up")
            return super().reset(**row)

    serve(monkeypatch, ServedScript(guessing_tokenizer(), ServedWeights()))
    trainer = guessing_trainer(tmp_path, environment_factory=FailingAhead, max_steps=3, **async_settings())
    with pytest.raises(RuntimeError, match="the board could not be set up"):
        trainer.train()
    trainer.close()


class LosesTheServerOnItsFirstPlay(OwnConnection):
    """The process's own connection finds the server gone while it plays the first rollout ahead."""

    def generate(self, prompt_ids, prompt_mask, max_new_tokens=None):
        if self.play == 1:
            raise ServerGone("The vLLM server at http://stand-in could not be reached to generate: connection refused")
        return super().generate(prompt_ids, prompt_mask, max_new_tokens)


class ServerThatComesBack(ServedScript):
    """A server that may go away and come back (``vllm_server_restart_grace_period``): work lost with it is redone."""

    def recovers_from(self, error):
        return isinstance(error, ServerGone)


@pytest.mark.parametrize("comes_back", [True, False], ids=["comes-back", "no-grace-period"])
def test_episodes_played_ahead_that_the_server_lost_are_played_again_on_the_training_thread(
    tmp_path, monkeypatch, comes_back
):
    """Episodes played ahead whose server went away are played again, on the training thread, through the trainer's
    connection (which waits for the server), with the weights of the step that trains on them; without a grace
    period the loss stops training."""
    weights = ServedWeights()
    backend = (ServerThatComesBack if comes_back else ServedScript)(guessing_tokenizer(), weights)
    backend.own = LosesTheServerOnItsFirstPlay(backend.script, weights)
    serve(monkeypatch, backend)
    trainer = guessing_trainer(tmp_path, max_steps=3, **async_settings())
    if not comes_back:
        with pytest.raises(ServerGone, match="could not be reached"):
            trainer.train()
        trainer.close()
        assert trainer.state.global_step == 1
        return
    trainer.train()
    trainer.close()
    assert trainer.state.global_step == 3
    # Rollout 0 and rollout 1 (lost ahead) on the training thread, by the weights of the steps that train on them.
    assert {(version, thread) for play, _, version, thread in weights.turns if play == 0} == {
        (0, "MainThread"), (1, "MainThread")
    }
    assert not [turn for turn in weights.turns if turn[0] == 1]  # nothing of the lost play was kept
    # Rollout 2, played ahead from step 1, as usual.
    assert logged(trainer, "rollout/staleness_max") == [0, 0, 1]


def test_a_backend_without_a_connection_per_process_is_refused_naming_it(tmp_path, monkeypatch):
    """Episodes played ahead need the process's own connection: a backend that gives none is refused at the first
    rollout played ahead, naming it, before any step trains on it."""
    tokenizer = guessing_tokenizer()
    serve(monkeypatch, ServedScript(tokenizer, ServedWeights()))
    trainer = guessing_trainer(tmp_path, max_steps=2, **async_settings())

    class Shared(RolloutBackend):
        collective = True

        def __init__(self, inner):
            self.inner = inner

        def generate(self, *args, **kwargs):
            return self.inner.generate(*args, **kwargs)

    trainer.rollout_backend = Shared(ScriptedPolicy(tokenizer, halving_search))
    with pytest.raises(ValueError, match=r"which Shared does not give \(`for_this_process\(\)` returns None\)"):
        trainer.train()
    assert trainer.state.global_step == 0
    trainer.close()


# ------------------------------------------------------------------------------------------------ the server's side
class RecordingClient:
    """Stands in for the HTTP client of ``vllm serve``: records the calls a weight push makes, in order, and answers
    generation requests with tokens labelled by the weight versions given."""

    events = []
    replies = []  # what the next generate call answers
    healthy = []  # what the next health checks answer (then: healthy)

    def __init__(self, base_url, timeout, api_key=None, stall_timeout=None):
        self.base_url, self.weight_version = base_url, None
        self.served = None  # the label of the weights the server holds: the version of the last push finished

    def served_weights(self):
        return str(self.served)

    def answers_health(self):
        return self.healthy.pop(0) if self.healthy else True

    def wait_for_server(self):
        pass

    def check_sampled_logprobs(self):
        pass

    def pause(self):
        self.events.append("pause")

    def resume(self):
        self.events.append("resume")

    def forget_cached_activations(self):
        self.events.append("forget caches")

    def generate(self, prompts, fields, seeds, request_ids, cancellation=None, image_urls=None):
        return self.replies[: len(prompts)]

    def shutdown_weight_transfer_engine(self):
        pass

    def close(self):
        pass


class RecordingTransfer:
    def __init__(self, client):
        self.client = client

    def send_weights(self):
        self.client.events.append(f"send {self.client.weight_version}")
        self.client.served = self.client.weight_version

    def shutdown(self):
        pass


def server_backend(monkeypatch):
    """A VLLMServerBackend on the recording client, its weight transfer opened."""
    from accelerate import Accelerator

    from targetpo.generation import SamplingSettings, vllm_server

    monkeypatch.setattr(vllm_server, "VLLMServerClient", RecordingClient)
    monkeypatch.setattr(vllm_server, "make_sampling_params", lambda fields, seed: None)  # vLLM's own check
    monkeypatch.setattr(RecordingClient, "events", [])
    settings = SamplingSettings(max_new_tokens=4, eos_token_ids=(1,), pad_token_id=0)
    backend = vllm_server.VLLMServerBackend(Accelerator(cpu=True), settings, "http://127.0.0.1:1", timeout=1.0)
    backend._transfer = RecordingTransfer(backend.client)
    return backend


def test_once_processes_send_requests_of_their_own_every_push_pauses_the_server(monkeypatch):
    """A request of another process's own connection may arrive mid-push, which the main process cannot see: from the
    first connection of its own on, every push runs between /pause (mode keep) and /resume, labelled with its step,
    and the caches the old weights computed are dropped before the resume."""
    backend = server_backend(monkeypatch)
    model = torch.nn.Linear(2, 2)
    backend.sync_weights(model, 0)
    assert RecordingClient.events == ["send 0", "forget caches"]  # nothing can be in flight
    backend.for_this_process()
    RecordingClient.events.clear()
    for step in (1, 2):
        backend.sync_weights(model, step)
    assert RecordingClient.events == [
        "pause", "send 1", "forget caches", "resume", "pause", "send 2", "forget caches", "resume"]
    backend.close()


def test_a_completion_of_a_connection_of_its_own_is_tagged_with_the_oldest_weights_that_wrote_it(monkeypatch):
    """The server labels a completion's tokens with the versions of the weights that wrote them, in spans; a
    completion's weight version is the oldest of them (staleness counts from it), -1 where none is reported."""
    backend = server_backend(monkeypatch)
    own = backend.for_this_process()
    monkeypatch.setattr(RecordingClient, "replies", [
        {"token_ids": [5, 6, 1], "logprobs": [-0.1, -0.2, -0.3], "weight_versions": ["3", "4"]},
        {"token_ids": [5, 1], "logprobs": [-0.1, -0.2], "weight_versions": ["4"]},
        {"token_ids": [1], "logprobs": [-0.1], "weight_versions": []},
    ])
    ids = torch.tensor([[7, 8], [7, 8], [7, 8]])
    completions = own.generate(ids, torch.ones_like(ids))
    assert completions.weight_versions.tolist() == [3, 4, -1]
    backend.close()


class BrokenTransfer(RecordingTransfer):
    def send_weights(self):
        self.client.events.append(f"send {self.client.weight_version} (broken off)")
        raise RuntimeError("Connection closed by peer")


@pytest.mark.parametrize("server_answers", [True, False], ids=["server-still-up", "server-gone"])
def test_a_push_broken_off_drops_its_transfer_and_keeps_the_server_paused_until_the_push_is_made_again(
    monkeypatch, server_answers
):
    """With a grace period: a transfer that failed part-way is never used again, and the server, whose weights may be
    half replaced under the old label, stays paused (nothing is sampled from them) until a push succeeds. A server
    that no longer answers went away: waited for, then pushed to again; one that still answers stops training."""
    backend = server_backend(monkeypatch)
    backend.restarts = ServerRestarts(backend.base_url, grace_period=5)
    backend.for_this_process()  # every push pauses the server
    model = torch.nn.Linear(2, 2)
    backend.sync_weights(model, 0)
    backend._transfer = BrokenTransfer(backend.client)
    monkeypatch.setattr(backend, "_open_transfer", lambda: RecordingTransfer(backend.client))
    monkeypatch.setattr(RecordingClient, "healthy", [server_answers, False])  # gone: back at the second check
    RecordingClient.events.clear()
    if server_answers:
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            backend.sync_weights(model, 1)
        assert RecordingClient.events == ["pause", "send 1 (broken off)"] and backend._transfer is None
        backend.sync_weights(model, 1)  # the next push opens a transfer of its own, then resumes the server
        assert RecordingClient.events[2:] == ["pause", "send 1", "forget caches", "resume"]
    else:
        backend.sync_weights(model, 1)
        assert RecordingClient.events == ["pause", "send 1 (broken off)", "pause", "send 1", "forget caches", "resume"]
        assert backend.restarts.count == 1
    assert backend.client.served == "1"
    backend.close()


def test_a_push_that_loses_the_server_every_time_stops_training_after_a_bounded_number_of_tries(monkeypatch):
    """A server that the push itself brings down each time (out of memory while loading, say) is pushed to again
    TRIES_AFTER_A_LOSS times, then training stops with the loss; it does not loop for ever."""
    from targetpo.generation.server_restarts import TRIES_AFTER_A_LOSS

    backend = server_backend(monkeypatch)
    backend.restarts = ServerRestarts(backend.base_url, grace_period=5)
    backend._transfer = BrokenTransfer(backend.client)
    monkeypatch.setattr(backend, "_open_transfer", lambda: BrokenTransfer(backend.client))
    monkeypatch.setattr(RecordingClient, "healthy", [False, True] * (TRIES_AFTER_A_LOSS + 1))  # gone, then back
    with pytest.raises(ServerGone, match="went away during a weight push"):
        backend.sync_weights(torch.nn.Linear(2, 2), 1)
    assert backend.restarts.count == TRIES_AFTER_A_LOSS
    assert RecordingClient.events.count("send 1 (broken off)") == TRIES_AFTER_A_LOSS + 1
    backend.close()
