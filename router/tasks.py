"""How the router core's deferred work runs (binding renewals, rebinding a dead worker's
sessions): as tasks on the event loop (`BackgroundTasks`, the server's way), or at once, in the
caller, without any loop (`run_now`, for the in-memory backend, whose coroutines never wait:
a simulator places thousands of requests per simulated second this way).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

__all__ = ["BackgroundTasks", "cancel_and_wait", "run_now", "run_now_discarding"]

log = logging.getLogger(__name__)
T = TypeVar("T")


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], timeout_s: float = 5.0
                          ) -> set[asyncio.Task[Any]]:
    """Cancel `tasks` and wait up to `timeout_s` for them to end; return the ones that did not.

    Bounded because a task can stay "cancelling" for ever: a grpc.aio call (every etcd call)
    waits for grpc's core to confirm its cancellation, and that confirmation can be lost (seen
    in a test process whose earlier event loops were closed with grpc channels open: grpc's
    poller raised on the dead loop's event and left the live loop's in its queue). A stop
    must still end; what is left is logged and abandoned.
    """
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    if not pending:
        return set()
    ended, stuck = await asyncio.wait(pending, timeout=timeout_s)
    for task in ended:  # retrieved, so none is logged as "exception was never retrieved"
        if not task.cancelled():
            task.exception()
    for task in stuck:
        log.warning("task %s did not end within %.1fs of its cancellation; abandoned",
                    task.get_name(), timeout_s)
    return stuck


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
        await cancel_and_wait(pending, timeout_s)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %s", task.exception())
