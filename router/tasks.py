"""How the router core's deferred work runs (binding renewals, rebinding a dead worker's
sessions): as tasks on the event loop (`BackgroundTasks`, the server's way), or at once, in the
caller, without any loop (`run_now`, for the in-memory backend, whose coroutines never wait:
a simulator places thousands of requests per simulated second this way).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["BackgroundTasks", "run_now", "run_now_discarding"]

log = logging.getLogger(__name__)
T = TypeVar("T")


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to its end here, without an event loop, and return its result.

    Only for coroutines that never suspend (every call into `MemoryBackend`). One that does
    suspend is doing real I/O and needs a loop: it is closed and `RuntimeError` raised.
    """
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    name = getattr(coro, "__qualname__", "a coroutine")
    raise RuntimeError(f"{name} waited for I/O: await it on an event loop "
                       "(run_now is for the in-memory state backend)")


def run_now_discarding(coro: Coroutine[Any, Any, Any]) -> None:
    """`run_now` as a `Defer`: the result is not wanted."""
    run_now(coro)


class BackgroundTasks:
    """A `Defer` onto the running loop: each coroutine becomes a task, kept until it ends;
    failures are logged, never raised to whoever deferred it."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __call__(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self, timeout_s: float = 2.0) -> None:
        """Let running tasks finish for up to `timeout_s` in all, then cancel the rest."""
        tasks = list(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %s", task.exception())
