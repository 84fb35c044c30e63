"""The API key of a ``vllm serve`` process that trains: the server's middleware that requires it, and the header
that carries it.

vLLM's own ``--api-key`` guards only its inference routes (paths under ``/v1``, ``/v2``, ``/inference`` and
``/cohere``); the weight-update, pause and cache routes that ``VLLM_SERVER_DEV_MODE=1`` opens, and others at the root
(``/tokenize``, ``/invocations``, ``/collective_rpc``, ...), stay open to anyone who reaches the port.
:class:`RequireKey`, which ``targetpo-vllm-serve`` adds with vLLM's ``--middleware`` option, requires the key on
every path except the health checks. It reads the key from ``VLLM_API_KEY`` in the server's environment, the
variable vLLM's own check reads, so the key never appears on a command line (which other users of the machine can
read).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

#: The environment variable that holds the key, on the server (vLLM reads it too) and, when the config gives none,
#: on the trainer.
KEY_VARIABLE = "VLLM_API_KEY"

#: Paths answered without the key: the readiness checks (``/ping`` is vLLM's SageMaker twin of ``/health``), which
#: change nothing and tell nothing but "up". ``/metrics`` and ``/version`` need the key: they describe the server's
#: load and software to whoever asks.
OPEN_PATHS = frozenset({"/health", "/ping"})


def check_api_key(api_key: str, setting: str) -> None:
    """Refuse a key an HTTP header cannot carry as it is (``setting`` names where it came from)."""
    if not api_key or not api_key.isascii() or not api_key.isprintable() or any(c.isspace() for c in api_key):
        raise ValueError(
            f"{setting} must be a non-empty key of printable ASCII characters without spaces (it travels in the HTTP "
            "header Authorization: Bearer <key>), e.g. one made with `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`."
        )


def resolve_api_key(configured: str | None) -> str | None:
    """The trainer's key: ``vllm_server_api_key`` when set, else ``VLLM_API_KEY`` from the environment (unset or
    empty: no key)."""
    if configured is not None:
        check_api_key(configured, "vllm_server_api_key")
        return configured
    from_environment = os.environ.get(KEY_VARIABLE) or None
    if from_environment is not None:
        check_api_key(from_environment, f"{KEY_VARIABLE} (read because vllm_server_api_key is unset)")
    return from_environment


def authorization_headers(api_key: str | None) -> dict[str, str]:
    """The headers that carry ``api_key`` on every request to the server; none without a key."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def _digest(text: str) -> bytes:
    # Compared as fixed-length digests: comparing the keys themselves would reveal the key's length in the time taken.
    return hashlib.sha256(text.encode("utf-8")).digest()


def key_matches(authorization: str | None, expected_digest: bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <the key>``, compared in constant time."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), expected_digest)


class RequireKey:
    """ASGI middleware: every HTTP request or websocket except those to :data:`OPEN_PATHS` must carry
    ``Authorization: Bearer <key>``, the key being ``VLLM_API_KEY`` in the server's environment. Others are answered
    401 (a websocket is closed before it opens), and never reach vLLM."""

    def __init__(self, app: Any, api_key: str | None = None) -> None:
        self.app = app
        key = api_key if api_key is not None else os.environ.get(KEY_VARIABLE)
        if not key:
            # A guard without a key would let nothing through, or everything: refuse to start instead.
            raise ValueError(
                f"{__name__}.RequireKey requires an API key, and {KEY_VARIABLE} is unset or empty in the server's "
                f"environment: start the server with `targetpo-vllm-serve --api-key <key>` or with {KEY_VARIABLE} "
                "set, or leave this middleware out."
            )
        check_api_key(key, KEY_VARIABLE)
        self._expected = _digest(key)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan events carry no request
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or key_matches(_header(scope, b"authorization"), self._expected):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accepting: the client sees HTTP 403
            return
        await _unauthorized(send)


def _header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _unauthorized(send: Any) -> None:
    body = (
        b'{"error": "Unauthorized: this server requires its API key on every request, '
        b'as the header Authorization: Bearer <key>."}'
    )
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
