"""The server's API key without a server: the middleware that requires it (on a tiny ASGI app), the launcher's
refusal of an exposed server without one, and the trainer's side (headers, clear errors on 401, a hidden key).

The checks against a real keyed `vllm serve` are in test_vllm.py (`-k security`).
"""

import asyncio
import json

import httpx
import pytest

from targetpo.generation import server_auth
from targetpo.generation.serve import REQUIRE_KEY_MIDDLEWARE, check_exposure, is_loopback, main, serve_command
from targetpo.generation.server_auth import KEY_VARIABLE, RequireKey, resolve_api_key

KEY = "s3cret-key_0123456789"


def call(app, path, headers=(), scope_type="http", method="POST", root_path=""):
    """Send one request through ``app``; return the status it answered and whether the inner app was reached."""
    sent = []
    scope = {
        "type": scope_type, "path": path, "method": method, "root_path": root_path,
        "headers": [(name.lower().encode(), value.encode()) for name, value in headers],
    }

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = next(message for message in sent if message["type"] in ("http.response.start", "websocket.close"))
    return start.get("status", start.get("code")), sent


async def inner_app(scope, receive, send):
    """Answers 200 to everything: what a request that gets past the guard reaches."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"reached"})


RL_PATHS = ["/init_weight_transfer_engine", "/update_weights", "/pause", "/get_world_size", "/collective_rpc",
            "/tokenize", "/invocations", "/metrics", "/version", "/v1/models", "/inference/v1/generate", "/"]


@pytest.mark.parametrize("path", RL_PATHS)
def test_the_middleware_answers_401_without_the_key_and_never_reaches_vllm(path):
    guard = RequireKey(inner_app, api_key=KEY)
    for headers in ([], [("Authorization", "Bearer wrong")], [("Authorization", f"Basic {KEY}")],
                    [("Authorization", f"Bearer {KEY}x")], [("Authorization", KEY)]):
        status, sent = call(guard, path, headers)
        assert status == 401, (path, headers)
        assert b"reached" not in b"".join(message.get("body", b"") for message in sent)
    assert call(guard, path, [("Authorization", f"Bearer {KEY}")])[0] == 200
    assert call(guard, path, [("authorization", f"bearer {KEY}")])[0] == 200  # header and scheme in any case


@pytest.mark.parametrize("path", ["/health", "/ping"])
def test_the_health_checks_stay_open(path):
    assert call(RequireKey(inner_app, api_key=KEY), path)[0] == 200
    # Only those exact paths: nothing that merely starts or ends like them.
    for near in (f"{path}/../pause", f"{path}x", f"/x{path}", f"{path}/"):
        assert call(RequireKey(inner_app, api_key=KEY), near)[0] == 401, near


def test_a_websocket_without_the_key_is_closed_before_it_opens():
    status, _ = call(RequireKey(inner_app, api_key=KEY), "/v1/realtime", scope_type="websocket")
    assert status == 1008


def test_a_websocket_with_the_key_opens():
    async def websocket_app(scope, receive, send):
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})

    guard = RequireKey(websocket_app, api_key=KEY)
    code, sent = call(guard, "/v1/realtime", [("Authorization", f"Bearer {KEY}")], scope_type="websocket")
    assert code == 1000 and sent[0]["type"] == "websocket.accept"


@pytest.mark.parametrize("method", ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
def test_every_method_needs_the_key(method):
    guard = RequireKey(inner_app, api_key=KEY)
    assert call(guard, "/update_weights", method=method)[0] == 401
    assert call(guard, "/update_weights", [("Authorization", f"Bearer {KEY}")], method=method)[0] == 200
    assert call(guard, "/health", method=method)[0] == 200


# Behind a proxy that serves the server under a prefix (`vllm serve --root-path /prefix`), a request's path keeps the
# prefix (a proxy that forwards it, uvicorn's own --root-path) or not (a proxy that strips it): vLLM routes both, so
# both must be guarded alike, and only a health check under the root path is open.
@pytest.mark.parametrize("root_path, path, status", [
    ("/prefix", "/prefix/health", 200), ("/prefix", "/prefix/ping", 200), ("/prefix", "/health", 200),
    ("/a/b", "/a/b/ping", 200),
    ("/prefix", "/prefix/update_weights", 401), ("/prefix", "/update_weights", 401),
    ("/prefix", "/prefix/metrics", 401), ("/prefix", "/prefix/v1/models", 401), ("/prefix", "/prefix", 401),
    ("/prefix", "/prefix/", 401), ("/prefix", "/prefixhealth", 401), ("/prefix", "/prefix/prefix/health", 401),
    ("/prefix", "/prefix/x/health", 401), ("/prefix", "/prefix/health/", 401), ("/prefix", "/x/prefix/health", 401),
    ("/prefix", "/prefix/health/../update_weights", 401), ("/a/b", "/a/ping", 401),
])
def test_behind_a_proxy_only_the_health_checks_under_the_root_path_are_open(root_path, path, status):
    guard = RequireKey(inner_app, api_key=KEY)
    assert call(guard, path, root_path=root_path)[0] == status
    assert call(guard, path, [("Authorization", "Bearer wrong")], root_path=root_path)[0] == status
    assert call(guard, path, [("Authorization", f"Bearer {KEY}")], root_path=root_path)[0] == 200


def vllm_like_app(monkeypatch, root_path):
    """A FastAPI app wired as `vllm serve --root-path ROOT --middleware <RequireKey>` wires its own: the root path set
    on the app, the middleware class added without arguments (it reads the key from the environment). Its routes
    record that they were reached."""
    FastAPI = pytest.importorskip("fastapi", reason="vLLM's server is a FastAPI app: pip install fastapi").FastAPI

    monkeypatch.setenv(KEY_VARIABLE, KEY)
    reached = []
    app = FastAPI()

    def endpoint_for(route):
        async def endpoint():
            reached.append(route)
            return {"route": route}

        return endpoint

    for route in ("/health", "/ping", "/update_weights", "/metrics", "/version", "/v1/models"):
        app.add_api_route(route, endpoint_for(route), methods=["GET", "POST"])
    app.root_path = root_path
    app.add_middleware(RequireKey)
    return app, reached


def test_behind_a_proxy_a_real_app_reaches_no_guarded_route_without_the_key(monkeypatch):
    app, reached = vllm_like_app(monkeypatch, "/prefix")

    async def answers(requests):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return [await client.request(method, path, headers=headers) for method, path, headers in requests]

    def send(method, path, headers=None):
        reached.clear()
        return asyncio.run(answers([(method, path, headers)]))[0], list(reached)

    bearer = {"Authorization": f"Bearer {KEY}"}
    for prefix in ("/prefix", ""):  # a proxy that forwards the prefix, and one that strips it
        for route in ("/health", "/ping"):
            response, routes = send("GET", prefix + route)
            assert (response.status_code, routes) == (200, [route]), prefix + route
        for route in ("/update_weights", "/metrics", "/version", "/v1/models"):
            for method in ("GET", "POST"):
                for headers in (None, {"Authorization": "Bearer wrong"}):
                    response, routes = send(method, prefix + route, headers)
                    assert (response.status_code, routes) == (401, []), (method, prefix + route, headers)
                    assert response.headers["www-authenticate"] == "Bearer"
                    assert "Authorization: Bearer <key>" in response.json()["error"]
                response, routes = send(method, prefix + route, bearer)
                assert (response.status_code, routes) == (200, [route]), (method, prefix + route)
    for near in ("/prefixhealth", "/prefix/prefix/health", "/prefix/x/health", "/prefix/health/", "/x/prefix/health",
                 "/prefix/ping/update_weights", "/prefix//update_weights"):
        response, routes = send("POST", near)
        assert (response.status_code, routes) == (401, []), near


def test_the_401_says_how_to_send_the_key():
    status, sent = call(RequireKey(inner_app, api_key=KEY), "/update_weights")
    headers = dict(sent[0]["headers"])
    body = b"".join(message.get("body", b"") for message in sent)
    assert status == 401 and headers[b"www-authenticate"] == b"Bearer" and int(headers[b"content-length"]) == len(body)
    assert "Authorization: Bearer <key>" in json.loads(body)["error"]


def test_the_middleware_refuses_a_key_http_cannot_carry(monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, "two words")
    with pytest.raises(ValueError, match=f"{KEY_VARIABLE} must be a non-empty key of printable ASCII"):
        RequireKey(inner_app)


def test_lifespan_events_pass_through():
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    asyncio.run(RequireKey(app, api_key=KEY)({"type": "lifespan"}, None, None))
    assert reached == ["lifespan"]


def test_the_key_is_compared_in_constant_time(monkeypatch):
    compared = []
    original = server_auth.hmac.compare_digest

    def recording(a, b):
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(server_auth.hmac, "compare_digest", recording)
    guard = RequireKey(inner_app, api_key=KEY)
    assert call(guard, "/pause", [("Authorization", "Bearer short")])[0] == 401
    assert call(guard, "/pause", [("Authorization", f"Bearer {KEY}")])[0] == 200
    # Both answers came from hmac.compare_digest, on digests of one length whatever the key sent.
    assert len(compared) == 2 and all(len(a) == len(b) == 32 for a, b in compared)


def test_the_middleware_reads_the_key_from_the_environment_and_refuses_to_start_without_one(monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, KEY)
    guard = RequireKey(inner_app)  # as vLLM builds it from --middleware: no arguments
    assert call(guard, "/pause", [("Authorization", f"Bearer {KEY}")])[0] == 200
    assert call(guard, "/pause")[0] == 401
    monkeypatch.delenv(KEY_VARIABLE)
    with pytest.raises(ValueError, match=f"{KEY_VARIABLE} is unset"):
        RequireKey(inner_app)


# ------------------------------------------------------------------------------------------------ the launcher
def launch(argv, monkeypatch, environment=None):
    """Run targetpo-vllm-serve's main up to the exec; return the command and the environment it would run."""
    monkeypatch.delenv(KEY_VARIABLE, raising=False)
    for name, value in (environment or {}).items():
        monkeypatch.setenv(name, value)
    launched = {}

    def fake_exec(program, command, env):
        launched.update(command=command, env=env)

    monkeypatch.setattr("targetpo.generation.serve.os.execvpe", fake_exec)
    main(["--model", "some/model", "--weight_transfer_backend", "gloo", *argv])
    return launched["command"], launched["env"]


def test_the_launcher_listens_on_loopback_unless_told_otherwise(monkeypatch, capsys):
    command, env = launch(["--port", "8123"], monkeypatch)
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert "--middleware" not in command and KEY_VARIABLE not in env
    assert command[-2:] == ["--port", "8123"]  # other arguments still go to vllm serve


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10", "::", ""])
def test_an_exposed_host_without_a_key_is_refused_with_the_reason_and_the_fix(monkeypatch, host):
    with pytest.raises(SystemExit) as refused:
        launch(["--host", host], monkeypatch)
    message = str(refused.value)
    assert "without an API key" in message and "replace its weights" in message
    assert "--api-key" in message and KEY_VARIABLE in message and "--allow-unauthenticated-remote" in message


def test_the_opt_out_flag_serves_an_exposed_host_without_a_key(monkeypatch):
    command, env = launch(["--host", "0.0.0.0", "--allow-unauthenticated-remote"], monkeypatch)
    assert command[command.index("--host") + 1] == "0.0.0.0" and "--middleware" not in command


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_key_reaches_vllm_and_the_middleware_through_the_environment_only(monkeypatch, capsys, how):
    argv = ["--host", "0.0.0.0", *(["--api-key", KEY] if how == "flag" else [])]
    command, env = launch(argv, monkeypatch, {KEY_VARIABLE: KEY} if how == "environment" else None)
    assert env[KEY_VARIABLE] == KEY and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert command[command.index("--middleware") + 1] == REQUIRE_KEY_MIDDLEWARE
    assert KEY not in " ".join(command)  # command lines are visible to every user of the machine
    assert KEY not in capsys.readouterr().out  # nor printed
    # vLLM imports the middleware from its path, in its own process.
    module, name = REQUIRE_KEY_MIDDLEWARE.rsplit(".", 1)
    assert getattr(__import__(module, fromlist=[name]), name) is RequireKey


def test_the_api_key_flag_wins_over_the_environment(monkeypatch):
    command, env = launch(["--api-key", KEY], monkeypatch, {KEY_VARIABLE: "from-the-environment"})
    assert env[KEY_VARIABLE] == KEY and command[command.index("--middleware") + 1] == REQUIRE_KEY_MIDDLEWARE


def test_a_key_http_cannot_carry_is_refused_naming_where_it_came_from(monkeypatch):
    with pytest.raises(ValueError, match="--api-key must be a non-empty key of printable ASCII"):
        launch(["--api-key", "two words"], monkeypatch)
    with pytest.raises(ValueError, match="vllm_server_api_key must be"):
        resolve_api_key("clé")


def test_loopback_hosts():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("::")
    assert not is_loopback("192.0.2.10") and not is_loopback("no-such-host.invalid")
    check_exposure("127.0.0.1", None, False)  # loopback needs no key


def test_serve_command_without_a_key_is_as_before():
    command, env = serve_command("m", "gloo", ["--port", "1"])
    assert env == {"VLLM_SERVER_DEV_MODE": "1"} and "--middleware" not in command


# ------------------------------------------------------------------------------------------------ the trainer's side
def test_the_trainers_key_comes_from_the_config_then_the_environment(monkeypatch):
    monkeypatch.setenv(KEY_VARIABLE, "from-the-environment")
    assert resolve_api_key("from-the-config") == "from-the-config"
    assert resolve_api_key(None) == "from-the-environment"
    monkeypatch.setenv(KEY_VARIABLE, "")
    assert resolve_api_key(None) is None
    monkeypatch.delenv(KEY_VARIABLE)
    assert resolve_api_key(None) is None


def mock_server(status_for):
    """An httpx transport answering each path with ``status_for(path, authorization)``; records the requests."""
    seen = []

    def handle(request):
        seen.append((request.url.path, request.headers.get("authorization")))
        status = status_for(request.url.path, request.headers.get("authorization"))
        return httpx.Response(status, json={"world_size": 1, "data": []} if status == 200 else {"error": "no"})

    return httpx.MockTransport(handle), seen


def client_on(transport, api_key, timeout=30):
    from targetpo.generation.vllm_server import VLLMServerClient

    client = VLLMServerClient("http://127.0.0.1:9", timeout, api_key)
    client._http = httpx.Client(base_url=client.base_url, transport=transport, headers=client._headers)
    return client


def keyed(path, authorization):
    if path in ("/health", "/ping"):
        return 200
    return 200 if authorization == f"Bearer {KEY}" else 401


@pytest.mark.parametrize("api_key, problem", [(None, "sent none"), ("wrong", "refused the API key")])
def test_a_missing_or_wrong_key_fails_the_server_check_at_once_naming_the_setting(api_key, problem):
    import time

    from targetpo.generation.vllm_server import VLLMServerAuthenticationError

    transport, _ = mock_server(keyed)
    started = time.monotonic()
    with pytest.raises(VLLMServerAuthenticationError, match=problem) as refused:
        client_on(transport, api_key).wait_for_server()
    assert time.monotonic() - started < 5  # not waited out as a slow server
    assert "vllm_server_api_key" in str(refused.value) and KEY_VARIABLE in str(refused.value)
    assert "HTTP 401" in str(refused.value)


@pytest.mark.parametrize("refused_path, status", [
    ("/health", 403), ("/v1/models", 401), ("/v1/models", 403), ("/get_world_size", 401), ("/get_world_size", 403),
])
def test_the_key_is_checked_on_an_inference_path_and_on_a_weight_update_path(refused_path, status):
    from targetpo.generation.vllm_server import VLLMServerAuthenticationError

    # Each path refused alone: a server whose own check and whose middleware disagree is still caught.
    transport, _ = mock_server(lambda path, authorization: status if path == refused_path else 200)
    with pytest.raises(VLLMServerAuthenticationError, match=f"HTTP {status} on {refused_path}"):
        client_on(transport, KEY, timeout=3).wait_for_server()


def test_a_401_on_the_health_check_is_not_retried_until_the_timeout():
    import time

    from targetpo.generation.vllm_server import VLLMServerAuthenticationError

    transport, seen = mock_server(lambda path, authorization: 401)
    started = time.monotonic()
    with pytest.raises(VLLMServerAuthenticationError):
        client_on(transport, "any", timeout=60).wait_for_server()
    assert time.monotonic() - started < 5 and len(seen) == 1


def test_the_right_key_goes_on_every_request(monkeypatch):
    transport, seen = mock_server(keyed)
    client = client_on(transport, KEY)
    client.wait_for_server()
    assert client.world_size() == 1
    client.pause()
    assert seen and all(authorization == f"Bearer {KEY}" for _, authorization in seen)


def test_the_async_generate_client_sends_the_key(monkeypatch):
    from targetpo.generation.vllm_server import VLLMServerAuthenticationError, VLLMServerClient

    sent = []
    original = httpx.AsyncClient.__init__

    def recording(self, *args, **kwargs):
        sent.append(dict(kwargs.get("headers") or {}))
        kwargs["transport"] = httpx.MockTransport(lambda request: httpx.Response(401, json={"error": "no"}))
        original(self, *args, **kwargs)

    monkeypatch.setattr(httpx.AsyncClient, "__init__", recording)
    client = VLLMServerClient("http://127.0.0.1:9", 5, "wrong")
    with pytest.raises(VLLMServerAuthenticationError, match="vllm_server_api_key"):
        client.generate([[3, 4]], {"max_tokens": 1}, [0], ["r0"])
    assert sent == [{"Authorization": "Bearer wrong"}]


def test_the_key_is_kept_out_of_printed_and_logged_configs():
    from targetpo import TargetPOConfig

    config = TargetPOConfig(output_dir="unused", vllm_server_api_key=KEY, use_vllm=True, report_to="none")
    assert config.vllm_server_api_key == KEY
    for shown in (repr(config), str(config), config.to_json_string(), json.dumps(config.to_dict())):
        assert KEY not in shown
    with pytest.warns(UserWarning) as warned:
        TargetPOConfig(output_dir="unused", vllm_server_api_key=KEY, report_to="none")
    assert all(KEY not in str(warning.message) for warning in warned)


def test_each_process_own_connection_sends_the_key():
    from types import SimpleNamespace

    from targetpo.generation import SamplingSettings
    from targetpo.generation.vllm_server import VLLMServerBackend

    # The backend's own wiring, without a server: what for_this_process builds from it.
    backend = VLLMServerBackend.__new__(VLLMServerBackend)
    backend.accelerator = SimpleNamespace(process_index=1)
    backend.base_url, backend.timeout, backend.api_key, backend._own_requests = "http://127.0.0.1:9", 5, KEY, None
    backend.stall_timeout = 7.0
    backend.settings = SamplingSettings(max_new_tokens=2, eos_token_ids=(1,), pad_token_id=0)
    requests = backend.for_this_process()
    try:
        assert requests.client._http.headers["authorization"] == f"Bearer {KEY}"
        assert requests.client._headers == {"Authorization": f"Bearer {KEY}"}
        assert requests.client.stall_timeout == 7.0  # its requests are watched as the main connection's are
    finally:
        requests.close()


def test_processes_holding_different_keys_are_refused_on_every_process(monkeypatch):
    from targetpo.generation import vllm_server

    # What each of three processes would gather: process 2 lacks VLLM_API_KEY, which its machine does not set.
    keys = [KEY, KEY, None]
    monkeypatch.setattr(vllm_server, "gather_object", lambda _: [
        None if key is None else vllm_server.hashlib.sha256(key.encode()).hexdigest() for key in keys
    ])
    for own_key in keys:  # every process sees the same gathered list, so every one raises
        with pytest.raises(vllm_server.VLLMServerAuthenticationError, match=r"processes \[2\].*vllm_server_api_key"):
            vllm_server._check_same_key_everywhere(own_key)
    keys[2] = KEY
    vllm_server._check_same_key_everywhere(KEY)


def test_checkpoints_and_saved_models_keep_the_servers_key_out_of_training_args(
    tmp_path, tiny_model, tokenizer, prompt_dataset
):
    import copy
    import pickle
    import warnings

    import torch
    from conftest import count_letters_reward, make_config
    from transformers import Trainer

    from targetpo import TargetPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the key is unused without a vLLM server, which the config says
        args = make_config(tmp_path, max_steps=1, save_strategy="steps", save_steps=1, vllm_server_api_key=KEY)
    trainer = TargetPOTrainer(
        tiny_model, count_letters_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    # A tracker that uploads the model (wandb's WANDB_LOG_MODEL) saves it through a plain Trainer and a copied config.
    Trainer(model=trainer.model, args=copy.deepcopy(args)).save_model(str(tmp_path / "tracker"))
    saved = [tmp_path / folder / "training_args.bin" for folder in ("out/checkpoint-1", "saved", "tracker")]
    for path in saved:
        assert KEY.encode() not in path.read_bytes(), path
        recorded = torch.load(path, weights_only=False)
        assert recorded.vllm_server_api_key is None and recorded.learning_rate == args.learning_rate, path
    assert KEY.encode() not in pickle.dumps(args)
    # Left out of what is pickled only: the config itself and its copies in this process keep it.
    assert trainer.args.vllm_server_api_key == KEY
    assert copy.copy(args).vllm_server_api_key == KEY and copy.deepcopy(args).vllm_server_api_key == KEY
