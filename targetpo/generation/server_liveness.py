"""Whether a generation server is still alive while the trainer waits on it.

A generation or a weight update may rightly take minutes, so the requests have no read timeout. A server that stops
answering (a stopped process, a hung event loop, a peer that accepts connections and never replies) would then keep
training waiting forever. Instead, while a request is in flight its server's health check is asked every few
seconds; once it has gone unanswered for ``stall_timeout`` seconds the request is given up with
:class:`ServerStalled`. A live server answers its health check while it generates, so long generations go on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

import httpx

#: Seconds at most between two health checks of a server a request waits on.
CHECK_INTERVAL = 10.0

T = TypeVar("T")


class ServerStalled(TimeoutError):
    """A server that a request waited on left its health check unanswered for ``vllm_server_stall_timeout``."""


async def while_alive(
    work: Awaitable[T], base_url: str, headers: dict[str, str], stall_timeout: float, doing: str
) -> T:
    """The result of ``work``, a request to the server at ``base_url``, which is asked its health meanwhile.

    Raise :class:`ServerStalled` (``work`` cancelled) once the health check has gone unanswered, or answered other
    than 200, for ``stall_timeout`` seconds; ``doing`` names the request in the message. The health checks have a
    client of their own: one sharing the request's connection pool could queue behind a full pool."""
    async with httpx.AsyncClient(base_url=base_url, headers=headers) as health_client:
        return await _watch(work, health_client, stall_timeout, doing)


async def _watch(work: Awaitable[T], http: httpx.AsyncClient, stall_timeout: float, doing: str) -> T:
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    interval = min(CHECK_INTERVAL, stall_timeout / 4)
    last_alive = started = loop.time()
    last_problem = "none yet"
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=interval)
            if done:
                return task.result()
            try:
                health = await http.get("/health", timeout=interval)
            except httpx.HTTPError as error:
                last_problem = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            else:
                if health.status_code == 200:
                    last_alive = loop.time()
                    continue
                last_problem = f"HTTP {health.status_code}"
            silent = loop.time() - last_alive
            if silent >= stall_timeout:
                raise ServerStalled(
                    f"The vLLM server at {http.base_url} stopped answering while {doing}: its health check went "
                    f"unanswered for {silent:.0f} s (vllm_server_stall_timeout={stall_timeout:g}; last problem: "
                    f"{last_problem}; the request had waited {loop.time() - started:.0f} s). Check the server's log "
                    "and process (stopped, out of memory, hung); raise vllm_server_stall_timeout if it is only "
                    "slow to answer under load."
                )
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
