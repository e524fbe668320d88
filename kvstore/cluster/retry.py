"""The one retry policy: bounded retries of a call (`RetryPolicy.delays`) and the endless
backoff of a loop that must keep going (`Backoff`: watches, lease keepers, supervisors).

Every loop that retries etcd or a probe uses one of these, so that jitter (many clients that
failed together must not retry together) and caps are decided here, not in five hand-written
schedules.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvstore.errors import ConfigError

__all__ = ["RetryPolicy", "NO_RETRY", "LOOP_RETRY", "Backoff"]


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently to retry a transient failure (UNAVAILABLE, a reset stream).

    `attempts` counts the first try; delays grow by `multiplier` from `base_delay` up to
    `max_delay`, each scaled by a random factor in [1 - jitter, 1] so that many clients that
    failed together do not retry together.
    """

    attempts: int = 3
    base_delay: float = 0.02
    max_delay: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay < 0 or self.max_delay < self.base_delay:
            raise ConfigError(f"inconsistent retry policy {self}")
        if not 0.0 <= self.jitter <= 1.0 or self.multiplier < 1.0:
            raise ConfigError(f"inconsistent retry policy {self}")

    def delay(self, failures: int) -> float:
        """The sleep after `failures` failures in a row (1 = the first), jittered."""
        raw = min(self.base_delay * self.multiplier ** max(failures - 1, 0), self.max_delay)
        return raw * (1.0 - self.jitter * random.random())

    def delays(self) -> Iterator[float]:
        """The sleeps between attempts: `attempts - 1` of them."""
        for failures in range(1, self.attempts):
            yield self.delay(failures)

    def sleep_within(self, delay: float, deadline: float | None) -> bool:
        """Sleep `delay` unless that would pass `deadline`; False means: give up now."""
        if deadline is not None and time.monotonic() + delay >= deadline:
            return False
        time.sleep(delay)
        return True

    def capped(self, max_delay: float) -> RetryPolicy:
        """The same schedule, never sleeping longer than `max_delay` (a lease's TTL/3)."""
        top = max(min(self.max_delay, max_delay), self.base_delay)
        return RetryPolicy(self.attempts, self.base_delay, top, self.multiplier, self.jitter)


NO_RETRY = RetryPolicy(attempts=1)

LOOP_RETRY = RetryPolicy(attempts=1, base_delay=0.1, max_delay=2.0, jitter=0.5)
"""Endless loops against etcd: 0.1 s after the first failure, doubling up to 2 s. Short enough
that a restarted etcd is back in use within a couple of seconds, long enough that a dead one
costs a few calls a second."""


@dataclass(slots=True)
class Backoff:
    """The endless schedule of one loop: `await wait()` after each failure, `reset()` after a
    success. The policy's `attempts` is not used here (a loop never gives up)."""

    policy: RetryPolicy = LOOP_RETRY
    failures: int = field(default=0)

    def next_delay(self) -> float:
        self.failures += 1
        return self.policy.delay(self.failures)

    async def wait(self) -> float:
        delay = self.next_delay()
        await asyncio.sleep(delay)
        return delay

    def reset(self) -> None:
        self.failures = 0
