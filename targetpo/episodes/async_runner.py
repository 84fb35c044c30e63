"""An event loop of its own for a rollout's tool calls (and async rewards): sync tools on threads, bounded by a
timeout and a concurrency, async ones side by side; an exception comes back as a value, so a tool's error is the
model's to read and never stops the loop."""

from __future__ import annotations

import asyncio
import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: What a call given up at its timeout returns in place of a result.
TIMED_OUT = object()


@dataclass(frozen=True)
class ToolCallLimits:
    """How a turn's calls run: ``timeout`` seconds at most per call (None: no limit), and at most ``concurrency``
    sync calls of different samples at once (1: one after another in the training process)."""

    timeout: float | None = None
    concurrency: int = 1

    @property
    def off_thread(self) -> bool:
        """Whether sync tools run on threads of their own: to be waited for with a timeout, or side by side."""
        return self.timeout is not None or self.concurrency > 1


class AsyncRunner:
    """Runs coroutines on an event loop of its own, in a background thread.

    A loop of its own works whether or not the caller is already inside a running loop (a notebook), where
    ``asyncio.run`` would refuse.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopper: weakref.finalize | None = None  # stops the loop if the runner is dropped without `close()`
        self._starting = threading.Lock()  # episodes played ahead call it from their own thread too

    def run(self, awaitables: Sequence[Any]) -> list[Any]:
        """The results of all ``awaitables``, run concurrently; an exception is returned in place of its result."""
        with self._starting:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=_run_until_stopped, args=(self._loop,), name="targetpo-tools", daemon=True
                )
                self._thread.start()
                # The thread holds the loop, not the runner: a runner dropped without `close()` (a trainer collected
                # after `evaluate()`) would leave the thread and the loop's sockets behind, one set per trainer.
                self._stopper = weakref.finalize(self, _stop, self._loop)

        async def gather() -> list[Any]:
            return await asyncio.gather(*map(_returning_errors, awaitables), return_exceptions=True)

        results = asyncio.run_coroutine_threadsafe(gather(), self._loop).result()
        interrupted = next((result.error for result in results if isinstance(result, _Interrupted)), None)
        if interrupted is not None:  # a SystemExit or KeyboardInterrupt ends the run, as in the training process
            raise interrupted
        return results

    def run_sample_calls(
        self, samples: Sequence[Sequence[tuple[int, str, Callable[[], Any]]]], limits: ToolCallLimits
    ) -> list[Any]:
        """Each sample's calls in order, the samples side by side: sync tools on a thread each, at most
        ``limits.concurrency`` at once; every call bounded by ``limits.timeout``. Results (or exceptions) in order."""
        slots: asyncio.Semaphore | None = None

        async def call(invoke: Callable[[], Any]) -> Any:
            """Its result, the exception the tool raised, or TIMED_OUT."""
            clock = asyncio.get_running_loop().time
            try:
                async with slots:  # the timeout counts from the call's start, not while it queues
                    started = clock()
                    result = await asyncio.wait_for(_in_thread(invoke), limits.timeout)
                if inspect.isawaitable(result):  # an async tool: the thread only made its coroutine
                    left = None if limits.timeout is None else limits.timeout - (clock() - started)
                    result = await asyncio.wait_for(_returning_errors(result), left)
                return result
            except asyncio.TimeoutError:  # the tool's own errors come back as values, so this is the timeout
                return TIMED_OUT

        async def sample_calls(calls: Sequence[tuple[int, str, Callable[[], Any]]]) -> list[Any]:
            return [await call(invoke) for _, _, invoke in calls]

        async def every_sample() -> list[Any]:
            nonlocal slots
            slots = asyncio.Semaphore(limits.concurrency)  # made on the loop that uses it
            return await asyncio.gather(*(sample_calls(calls) for calls in samples))

        (per_sample,) = self.run([every_sample()])
        if isinstance(per_sample, BaseException):  # not a tool's error (those are values): it ends the run
            raise per_sample
        results = [result for results in per_sample for result in results]
        interrupted = next((result.error for result in results if isinstance(result, _Interrupted)), None)
        if interrupted is not None:
            raise interrupted
        return results

    def close(self) -> None:
        if self._loop is not None:
            self._stopper.detach()
            _stop(self._loop)
            self._thread.join()  # the thread closes the loop once it stops
            self._loop = self._thread = self._stopper = None


def _run_until_stopped(loop: asyncio.AbstractEventLoop) -> None:
    """The runner's thread: the loop until it is stopped, then closed (its selector and sockets released)."""
    try:
        loop.run_forever()
    finally:
        loop.close()


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    """Stop ``loop`` from another thread; nothing to do once it is closed."""
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # closed already
        pass


class _Interrupted(Exception):
    """A tool's SystemExit or KeyboardInterrupt, carried out of its thread to be raised in the training process."""

    def __init__(self, error: BaseException):
        super().__init__(repr(error))
        self.error = error


async def _returning_errors(awaitable: Any) -> Any:
    """The awaitable's result, or the exception it raised as a value (a SystemExit or KeyboardInterrupt carried as
    ``_Interrupted``: raised on the loop, either would stop the loop's thread and leave its caller waiting forever)."""
    try:
        return await awaitable
    except Exception as error:
        return error
    except (SystemExit, KeyboardInterrupt) as error:
        return _Interrupted(error)


def _in_thread(invoke: Callable[[], Any]) -> asyncio.Future:
    """``invoke()`` (its result, or the exception it raised) on a daemon thread of its own, as a future of the running
    loop. Not a pool: a call that hangs past its timeout keeps its thread, and must not hold up the calls after it (nor
    the interpreter's exit)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():  # given up by then: nobody waits for it
            outcome()

    def hand_over(outcome: Callable[[], None]) -> None:
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop is closed: the run ended while this call, given up, ran on
            pass

    def work() -> None:
        try:
            result = invoke()
        except Exception as error:  # a value, told apart from the timeout: the model is answered with it
            result = error
        except BaseException as error:  # SystemExit, KeyboardInterrupt: not the model's to read; they end the run
            result = _Interrupted(error)  # carried as a value: raised in the loop it would stop the loop itself
        hand_over(lambda: future.set_result(result))

    threading.Thread(target=work, name="targetpo-tool-call", daemon=True).start()
    return future
