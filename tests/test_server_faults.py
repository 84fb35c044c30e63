"""A generation server that stops answering, on loopback: a socket that reads requests and never replies, a server that
answers its health check but not (yet) a generation, one whose health check fails. The trainer's client gives up on
the first and the last within ``vllm_server_stall_timeout`` and waits on the second as long as it generates.

A real `vllm serve` stopped from outside (SIGSTOP) mid-run is in test_vllm.py (`-k stall`).
"""

import contextlib
import http.server
import json
import socket
import threading
import time

import pytest

from targetpo import TargetPOConfig
from targetpo.generation.server_liveness import CHECK_INTERVAL, ServerStalled
from targetpo.generation.vllm_server import VLLMServerClient, VLLMServerError

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
def scripted_server(health_status=200, generate_after=0.0):
    """An HTTP server on loopback: ``/health`` answers ``health_status`` at once; a generation or any other POST
    answers after ``generate_after`` seconds with one completion of the token ids 5, 6."""

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
            self._answer(200, {"choices": [choice]})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
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
