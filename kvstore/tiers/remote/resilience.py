"""A circuit breaker per remote daemon; retries follow the control plane's one `RetryPolicy`
(kvstore/cluster/retry.py, re-exported here for the remote tier's callers).

Both are plain objects handed to the remote tier, so a deployment (or a test) chooses its own
policy instead of editing constants. Neither sleeps past the caller's deadline.
"""

from __future__ import annotations

import threading
import time

from kvstore.cluster.retry import NO_RETRY, RetryPolicy
from kvstore.errors import ConfigError

__all__ = ["RetryPolicy", "NO_RETRY", "CircuitBreaker", "BreakerState"]


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
