"""Retry with backoff, and a circuit breaker per remote daemon.

Both are plain objects handed to the remote tier, so a deployment (or a test) chooses its own
policy instead of editing constants. Neither sleeps past the caller's deadline.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["RetryPolicy", "NO_RETRY", "CircuitBreaker", "BreakerState"]


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

    def delays(self) -> Iterator[float]:
        """The sleeps between attempts: `attempts - 1` of them."""
        delay = self.base_delay
        for _ in range(self.attempts - 1):
            yield delay * (1.0 - self.jitter * random.random())
            delay = min(delay * self.multiplier, self.max_delay)

    def sleep_within(self, delay: float, deadline: float | None) -> bool:
        """Sleep `delay` unless that would pass `deadline`; False means: give up now."""
        if deadline is not None and time.monotonic() + delay >= deadline:
            return False
        time.sleep(delay)
        return True


NO_RETRY = RetryPolicy(attempts=1)


class BreakerState:
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Stops calling a daemon that just failed, so a dead node costs one deadline, not one per call.

    Closed: calls pass. After `failure_threshold` consecutive failures it opens for `cooldown`
    seconds (doubling on each failed probe, up to `max_cooldown`): calls are refused at once and
    the caller treats the daemon as a miss. Then one probe call is let through (half-open); its
    success closes the breaker, its failure reopens it. Thread-safe.
    """

    def __init__(self, failure_threshold: int = 1, cooldown: float = 0.5,
                 max_cooldown: float = 10.0) -> None:
        if failure_threshold < 1 or cooldown <= 0 or max_cooldown < cooldown:
            raise ConfigError("inconsistent circuit breaker settings")
        self._threshold = failure_threshold
        self._base_cooldown = cooldown
        self._max_cooldown = max_cooldown
        self._lock = threading.Lock()
        self._failures = 0
        self._cooldown = cooldown
        self._open_until = 0.0
        self._probing = False
        self._state = BreakerState.CLOSED

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == BreakerState.OPEN and time.monotonic() >= self._open_until:
                return BreakerState.HALF_OPEN
            return self._state

    def allow(self) -> bool:
        """May a call go to this daemon now? In half-open state only one probe at a time may."""
        with self._lock:
            if self._state == BreakerState.CLOSED:
                return True
            if time.monotonic() < self._open_until or self._probing:
                return False
            self._state = BreakerState.HALF_OPEN
            self._probing = True
            return True

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._cooldown = self._base_cooldown
            self._probing = False
            self._state = BreakerState.CLOSED

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            was_probe = self._probing
            self._probing = False
            if was_probe or self._failures >= self._threshold:
                if was_probe:
                    self._cooldown = min(self._cooldown * 2.0, self._max_cooldown)
                self._state = BreakerState.OPEN
                self._open_until = time.monotonic() + self._cooldown

    def reset(self) -> None:
        """Forget failures: the daemon re-registered, so it is a new process worth a try."""
        self.record_success()
