"""Stopping tasks is bounded: a task that never ends after its cancellation (a grpc.aio call
whose cancellation grpc never confirms) is reported and abandoned, not waited for forever."""

from __future__ import annotations

import asyncio
import time

from router.tasks import BackgroundTasks, cancel_and_wait


async def _deaf(release: asyncio.Event) -> None:
    """Swallows cancellations until `release`, as a call waiting on a lost completion does."""
    while not release.is_set():
        try:
            await release.wait()
        except asyncio.CancelledError:
            continue


def test_a_task_deaf_to_cancellation_is_abandoned_after_the_timeout() -> None:
    async def main() -> None:
        release = asyncio.Event()
        deaf = asyncio.create_task(_deaf(release))
        polite = asyncio.create_task(asyncio.sleep(3600))
        await asyncio.sleep(0)  # both started: the deaf one is inside its try
        start = time.monotonic()
        stuck = await cancel_and_wait([deaf, polite], timeout_s=0.3)
        assert stuck == {deaf}
        assert polite.cancelled()
        assert time.monotonic() - start < 5  # bounded (generous: not a timing claim)
        assert not deaf.done()
        release.set()
        await deaf

    asyncio.run(main())


def test_tasks_that_end_are_not_reported() -> None:
    async def main() -> None:
        done = asyncio.create_task(asyncio.sleep(0))
        await done
        assert await cancel_and_wait([done]) == set()
        assert not done.cancelled()

    asyncio.run(main())


def test_background_tasks_close_is_bounded_too() -> None:
    async def main() -> None:
        release = asyncio.Event()
        background = BackgroundTasks()
        background(_deaf(release))
        await asyncio.wait_for(background.close(timeout_s=0.2), timeout=10)
        assert len(background) == 1  # still running, abandoned
        release.set()
        await asyncio.sleep(0)

    asyncio.run(main())
