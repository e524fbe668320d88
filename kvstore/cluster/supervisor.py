"""Long-lived tasks that must never die for good: a membership watch that stopped would freeze
every router's or client's view of the cluster (dead members kept, new ones never seen), and
the only trace would be one log line.

`supervise` runs a task again whenever it raises or returns, after the loop backoff (reset once
a run lasted `healthy_after_s`), and counts each restart. Cancellation passes through: it is
how the owner stops it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvstore.cluster.retry import LOOP_RETRY, Backoff, RetryPolicy

__all__ = ["supervise"]

_log = logging.getLogger(__name__)


async def supervise(name: str, run: Callable[[], Awaitable[None]], *,
                    retry: RetryPolicy = LOOP_RETRY, healthy_after_s: float = 10.0,
                    on_restart: Callable[[str], None] | None = None) -> None:
    """Run `run()` until cancelled, restarting it after every end."""
    backoff = Backoff(retry)
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        try:
            await run()
            _log.warning("task %s ended; restarting it", name)
        except asyncio.CancelledError:
            raise
        except Exception:  # whatever killed it, the task's job is still needed: run it again
            _log.exception("task %s died; restarting it", name)
        if loop.time() - started >= healthy_after_s:
            backoff.reset()
        if on_restart is not None:
            try:
                on_restart(name)
            except Exception:  # a metrics hook's bug must not stop the supervision
                _log.exception("restart hook of %s failed", name)
        await backoff.wait()
