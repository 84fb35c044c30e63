"""A generation server that stops answering, on loopback: a socket that reads requests and never replies, a server that
answers its health check but not (yet) a generation, one whose health check fails. The trainer's client gives up on
the first and the last within ``vllm_server_stall_timeout`` and waits on the second as long as it generates. Then a
server that went away: waited for within ``vllm_server_restart_grace_period``, given up after it.

A real `vllm serve` stopped from outside (SIGSTOP) mid-run is in test_vllm.py (`-k stall`), one killed (SIGKILL) and
restarted mid-run there too (`-k killed_mid_run`).
"""

import contextlib
import http.server
import json
import socket
import threading
import time

import pytest
import torch
from vllm_serve import free_port

from targetpo import TargetPOConfig
from targetpo.generation import SamplingSettings
from targetpo.generation.server_liveness import CHECK_INTERVAL, ServerStalled
from targetpo.generation.server_restarts import ServerNotBack, ServerRestarts, foreign_labels
from targetpo.generation.vllm_server import ServerGone, ServerRequests, VLLMServerClient, VLLMServerError

STALL = 1.0  # seconds: the health checks come every STALL / 4
#: The longest a stall may take to be reported: the stall itself, plus one wait between checks and one check's own
#: timeout, plus room for a loaded machine.
REPORTED_WITHIN = STALL + 2 * (STALL / 4) + 3.0


@contextlib.contextmanager
def silent_server():
    """A loopback port that accepts connections and reads what is sent, and never answers anything."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            connection.settimeout(0.1)
            connections.append(connection)

    def drain():  # read every request, so the client's send never blocks on a full buffer
        while not stop.is_set():
            for connection in list(connections):
                with contextlib.suppress(OSError):
                    connection.recv(65536)
            time.sleep(0.01)

    threads = [threading.Thread(target=accept, daemon=True), threading.Thread(target=drain, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        for connection in connections:
            connection.close()
        listener.close()


@contextlib.contextmanager
def scripted_server(health_status=200, generate_after=0.0, port=0, weights_label=None):
    """An HTTP server on loopback (on ``port``, or a free one): ``/health`` answers ``health_status`` at once; a
    generation or any other POST answers after ``generate_after`` seconds with one completion of the token ids 5, 6,
    sampled (with ``weights_label``) by the weights labelled so."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status, body):
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self._answer(health_status if self.path == "/health" else 200, {})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            time.sleep(generate_after)
            choice = {"token_ids": [5, 6], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.25}]},
                      "finish_reason": "length"}
            if weights_label is not None:
                choice["weight_versions"] = [{"version": weights_label, "start": 0, "end": 2}]
            self._answer(200, {"choices": [choice]})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def generate(client, count=2):
    return client.generate([[3, 4]] * count, {"max_tokens": 2}, list(range(count)), [f"r{i}" for i in range(count)])


def timed(call):
    """What ``call()`` raised and the seconds it took."""
    started = time.monotonic()
    with pytest.raises(ServerStalled) as raised:
        call()
    return raised.value, time.monotonic() - started


def test_a_server_that_never_answers_is_given_up_within_the_stall_timeout_for_generations_and_control_calls():
    with silent_server() as base_url:
        client = VLLMServerClient(base_url, timeout=5, stall_timeout=STALL)
        try:
            for call in (lambda: generate(client), client.pause, lambda: client.update_weights({"names": []})):
                error, took = timed(call)
                assert STALL <= took < REPORTED_WITHIN, took
                message = str(error)
                assert base_url in message and f"vllm_server_stall_timeout={STALL:g}" in message, message
                assert "health check went unanswered" in message and "ReadTimeout" in message, message
        finally:
            client.close()


def test_a_server_whose_health_check_fails_is_given_up_with_the_status_it_answered():
    with scripted_server(health_status=503, generate_after=30) as base_url:
        client = VLLMServerClient(base_url, timeout=5, stall_timeout=STALL)
        error, took = timed(lambda: generate(client))
        client.close()
    assert took < REPORTED_WITHIN and "HTTP 503" in str(error)


def test_a_live_server_generating_for_longer_than_the_stall_timeout_is_waited_for():
    with scripted_server(generate_after=4 * STALL) as base_url:
        client = VLLMServerClient(base_url, timeout=5, stall_timeout=STALL)
        started = time.monotonic()
        outputs = generate(client, count=3)
        client.pause()  # a control call as slow: waited for too
        took = time.monotonic() - started
        client.close()
    assert took >= 2 * 4 * STALL  # each outlived the stall timeout several times over
    assert [output["token_ids"] for output in outputs] == [[5, 6]] * 3
    assert [output["logprobs"] for output in outputs] == [[-0.5, -0.25]] * 3


def test_without_a_stall_timeout_a_request_waits_on_a_silent_server():
    with silent_server() as base_url:
        client = VLLMServerClient(base_url, timeout=5, stall_timeout=None)
        ended = []

        def wait_on_it():
            try:
                generate(client)
            except VLLMServerError as error:  # once the listener closes: the server went away
                ended.append(str(error))

        waiting = threading.Thread(target=wait_on_it, daemon=True)
        waiting.start()
        waiting.join(timeout=REPORTED_WITHIN)
        assert waiting.is_alive() and not ended  # still waiting: nothing gave it up
    waiting.join(timeout=30)
    client.close()
    assert len(ended) == 1 and "could not be reached to generate" in ended[0], ended


def test_the_stall_timeout_is_a_positive_number_or_none():
    server = {"output_dir": "unused", "use_vllm": True, "vllm_mode": "server"}
    assert TargetPOConfig(**server, vllm_server_stall_timeout=None).vllm_server_stall_timeout is None
    assert TargetPOConfig(**server).vllm_server_stall_timeout == 120
    for wrong in (0, -1.0):
        with pytest.raises(ValueError, match="vllm_server_stall_timeout"):
            TargetPOConfig(**server, vllm_server_stall_timeout=wrong)
    assert CHECK_INTERVAL <= 120 / 4  # the default stall is checked at least four times before it is reported


# ------------------------------------------------------------------------------------------------ a server that went away
GRACE = 1.5


def gone(base_url):
    """The error a request to the server at ``base_url``, where nothing listens, raises."""
    client = VLLMServerClient(base_url, timeout=5)
    try:
        with pytest.raises(ServerGone) as raised:
            client.world_size()
    finally:
        client.close()
    return raised.value


def test_a_server_that_went_away_ends_a_request_at_once_with_an_error_naming_it():
    base_url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    error = gone(base_url)
    assert time.monotonic() - started < 5
    assert isinstance(error, VLLMServerError) and base_url in str(error) and "could not be reached" in str(error)


def test_without_a_grace_period_a_server_that_went_away_stops_training_with_its_own_error():
    base_url = f"http://127.0.0.1:{free_port()}"
    lost = gone(base_url)
    restarts = ServerRestarts(base_url, grace_period=0)
    with pytest.raises(ServerGone) as raised:
        restarts.wait_for_return(lambda: True, lost)
    assert raised.value is lost and restarts.count == 0 and not restarts.survived


def test_a_server_not_back_within_the_grace_period_stops_training_naming_it_and_the_setting():
    base_url = f"http://127.0.0.1:{free_port()}"
    lost = gone(base_url)
    client = VLLMServerClient(base_url, timeout=5)
    restarts = ServerRestarts(base_url, grace_period=GRACE)
    started = time.monotonic()
    with pytest.raises(ServerNotBack) as raised:
        restarts.wait_for_return(client.answers_health, lost)
    took = time.monotonic() - started
    client.close()
    assert GRACE <= took < GRACE + 3, took
    message = str(raised.value)
    assert base_url in message and f"vllm_server_restart_grace_period={GRACE:g}" in message, message
    assert raised.value.__cause__ is lost and restarts.count == 0


def test_a_server_back_within_the_grace_period_is_waited_for_and_the_wait_is_logged(caplog):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    lost = gone(base_url)
    client = VLLMServerClient(base_url, timeout=5)
    restarts = ServerRestarts(base_url, grace_period=30)
    back = threading.Event()

    def restart_after_a_second():
        time.sleep(1.0)
        with scripted_server(port=port):
            back.wait(timeout=30)

    restarting = threading.Thread(target=restart_after_a_second, daemon=True)
    restarting.start()
    try:
        with caplog.at_level("WARNING", logger="targetpo.generation.server_restarts"):
            waited = restarts.wait_for_return(client.answers_health, lost)
        assert client.answers_health()
    finally:
        back.set()
        restarting.join(timeout=30)
        client.close()
    assert 1.0 <= waited < 5, waited
    assert restarts.count == 1
    [message] = [record.getMessage() for record in caplog.records]
    assert base_url in message and "vllm_server_restart_grace_period" in message and "went away" in message


def test_completions_labelled_with_weights_the_trainer_never_pushed_are_told_apart():
    # vLLM labels the weights it loaded itself "default"; the trainer pushes optimiser steps.
    assert foreign_labels([["3", "3"], ["2", "3"], []]) == []
    assert foreign_labels([["3"], ["default", "3"], [None]]) == ["default"]


@pytest.mark.parametrize("label", ["7", "default"])
def test_completions_of_a_server_that_restarted_unseen_are_never_trained_on(label):
    """A process's own requests (episodes played ahead) to a server holding its own weights, not the ones pushed:
    refused as the server having gone away, so they are played again or training stops."""
    settings = SamplingSettings(max_new_tokens=2, eos_token_ids=(1,), pad_token_id=0)
    with scripted_server(weights_label=label) as base_url:
        requests = ServerRequests(base_url, 5, settings, "p0")
        prompt = torch.tensor([[3, 4]])
        try:
            if label == "default":
                with pytest.raises(ServerGone, match="labelled 'default'.*restarted"):
                    requests.generate(prompt, torch.ones_like(prompt))
            else:
                completions = requests.generate(prompt, torch.ones_like(prompt))
                assert completions.ids.tolist() == [[5, 6]] and completions.weight_versions.tolist() == [7]
        finally:
            requests.close()


def test_the_restart_grace_period_is_zero_or_more_seconds():
    server = {"output_dir": "unused", "use_vllm": True, "vllm_mode": "server"}
    assert TargetPOConfig(**server).vllm_server_restart_grace_period == 0
    assert TargetPOConfig(**server, vllm_server_restart_grace_period=600).vllm_server_restart_grace_period == 600
    for wrong in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="vllm_server_restart_grace_period"):
            TargetPOConfig(**server, vllm_server_restart_grace_period=wrong)
