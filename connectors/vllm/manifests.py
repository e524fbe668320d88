"""Session manifests: how their generation is chosen, and the one writer both halves use.

The scheduler half decides when a session's manifest changes (its confirmed saved prefix grew).
Where the store lives in its process it hands the manifest to a `ManifestWriter`; where it does
not (vLLM's multiprocess executor) a `ManifestRelay` carries the encoded manifest in the next
step's metadata and the worker half hands it to its own `ManifestWriter`. Either way the write
runs on one thread, in order, off the scheduler loop and the forward pass (it is an fsync on
nvme, a round trip to the daemons).

Generations and the router's epoch. Every tier keeps a manifest unless it already holds a
higher generation, so the generation decides which writer of a session wins, with no read
first. It is::

    started_us + session_epoch * EPOCH_STRIDE_US   (then +1 per later write of the request)

where `started_us` is the wall-clock time the connector first saw the request (microseconds)
and `session_epoch` the router's binding epoch (0 without one). So:

- a worker whose request began before the session moved (a worker that lost it, still
  finishing a stream) loses to every request of the new holder: they began later;
- a request that a lagging router replica still sent to the old worker carries the old epoch,
  and loses to the holder's as long as it began less than `EPOCH_STRIDE_US` per epoch of
  difference after the holder's (clock skew between hosts and router watch lag are far below
  that);
- the router restarts a session's epoch at 0 once its binding expired (after `session_ttl`,
  an hour, of idleness): the new writes still win, since the idle time exceeds the old
  epochs' head start unless the session had been rebound more than `ttl / stride` (60) times.

Without a router (no epoch) this is "the later request wins", as before epochs were used.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Final, Protocol

from connectors.vllm.stats import Count, Counts
from kvstore.errors import KVKeepError
from kvstore.manifest import SessionManifest
from kvstore.store import TieredStore

__all__ = ["EPOCH_STRIDE_US", "ManifestSink", "ManifestWriter", "ManifestRelay",
           "manifest_generation", "now_us"]

log = logging.getLogger(__name__)

EPOCH_STRIDE_US: Final = 60_000_000
"""How far (in microseconds of request start) one epoch of the router outranks the last."""


def now_us() -> int:
    """Wall-clock microseconds: comparable between hosts, unlike `time.monotonic()`."""
    return time.time_ns() // 1000


def manifest_generation(*, started_us: int, epoch: int | None, previous: int) -> int:
    """The generation of a request's next manifest write (see the module docstring): above the
    request's own previous one, and fenced by its start time and the router's epoch."""
    return max(previous + 1, started_us + (epoch or 0) * EPOCH_STRIDE_US)


class ManifestSink(Protocol):
    """Where the scheduler half sends a session's new manifest."""

    def submit(self, manifest: SessionManifest) -> None: ...

    @property
    def pending(self) -> bool:
        """Manifests waiting for an engine step to carry them (keeps the engine stepping)."""
        ...

    def drain(self, timeout: float = 10.0) -> None: ...

    def shutdown(self) -> None: ...


class ManifestWriter:
    """Writes manifests to a store on one thread, in submission order."""

    def __init__(self, store: TieredStore, counters: Counts) -> None:
        self._store = store
        self._counters = counters
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvkeep-manifest")

    def submit(self, manifest: SessionManifest) -> None:
        self._executor.submit(self._write, manifest)

    @property
    def pending(self) -> bool:
        return False  # written without waiting for an engine step

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until every manifest submitted so far is written (tests, shutdown)."""
        self._executor.submit(lambda: None).result(timeout)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    def _write(self, manifest: SessionManifest) -> None:
        try:
            self._store.put_manifest(manifest)
            self._counters.add(Count.MANIFESTS_WRITTEN)
        except KVKeepError:
            log.warning("kvkeep: manifest write failed", exc_info=True)
            self._counters.add(Count.MANIFEST_ERRORS)


class ManifestRelay:
    """Holds encoded manifests for the next step's metadata, when the store lives in the
    worker's process; the worker half writes them (`ManifestWriter`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._encoded: list[bytes] = []

    def submit(self, manifest: SessionManifest) -> None:
        with self._lock:
            self._encoded.append(manifest.encode())

    def take(self) -> tuple[bytes, ...]:
        with self._lock:
            encoded, self._encoded = self._encoded, []
        return tuple(encoded)

    @property
    def pending(self) -> bool:
        return bool(self._encoded)

    def drain(self, timeout: float = 10.0) -> None:
        """Nothing to wait for here: the worker writes them (its own `drain`)."""

    def shutdown(self) -> None:
        pass
