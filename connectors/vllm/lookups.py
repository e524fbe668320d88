"""Store lookups that cross the network, run off vLLM's scheduler loop.

vLLM calls the scheduler half's `get_num_new_matched_tokens` inside `schedule()`, for every
waiting request, every step. A lookup that asks remote daemons or Redis is a network round trip
(up to the restore deadline when a daemon is slow or dead), and doing it inline would hold the
whole batch's step for it. So the scheduler half asks only the tiers that answer from memory
inline (`TieredStore.lookup(in_process_only=True)`) and hands the rest to `BackgroundLookups`:
one thread that takes every lookup queued since its last pass and asks the store once for all
of their keys (one batched `contains` per tier for the whole step's arrivals, not one per
request). vLLM is told "ask again next step" (None) meanwhile, which it supports for exactly
this; the answer is picked up by `take` on a later step.

Lateness is judged by the scheduler half, by its own clock, against the request's deadline
(`restore_deadline_ms`): a lookup still running then is given up (the request computes), and
its late answer is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.keys import BlockKey
from kvstore.store import TieredStore

__all__ = ["BackgroundLookups", "FinishedLookup"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FinishedLookup:
    """The answer for one request's blocks [first, first + count): `hit` of them held as a
    prefix, block i of it on the store's tier `tiers[i]` (the first that holds it: where a
    load reads it, what the restore-or-recompute decision prices); `failed`: the store
    raised, and `hit` is 0."""

    first: int
    count: int
    hit: int
    failed: bool = False
    tiers: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class _Job:
    req_id: str
    first: int
    keys: tuple[BlockKey, ...]
    deadline: float


class BackgroundLookups:
    """One lookup thread for one scheduler half; every method is safe from any thread."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._running: set[str] = set()
        self._done: dict[str, FinishedLookup] = {}
        self._closed = False
        self._passes = 0
        self._thread = threading.Thread(target=self._run, name="kvkeep-lookups", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> bool:
        """Lookups queued, running, or answered and not yet taken."""
        with self._cond:
            return bool(self._queue or self._running or self._done)

    @property
    def passes(self) -> int:
        """Batched store calls made so far (how many steps' worth of lookups were merged)."""
        with self._cond:
            return self._passes

    def submit(self, req_id: str, first: int, keys: Sequence[BlockKey], deadline: float) -> None:
        """Queue a lookup of `keys` (blocks from `first` on) for `req_id`, replacing any earlier
        one for it; `deadline` is a `time.monotonic()` instant the store stops asking at."""
        with self._cond:
            self._done.pop(req_id, None)
            self._queue = [job for job in self._queue if job.req_id != req_id]
            self._queue.append(_Job(req_id, first, tuple(keys), deadline))
            self._cond.notify()

    def take(self, req_id: str) -> FinishedLookup | None:
        """The finished answer for `req_id` (and forget it), or None while it runs."""
        with self._cond:
            return self._done.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """Drop whatever is queued or answered for `req_id` (given up, or the request ended);
        a lookup already running for it finishes, and its answer is dropped."""
        with self._cond:
            self._queue = [job for job in self._queue if job.req_id != req_id]
            self._done.pop(req_id, None)
            self._running.discard(req_id)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                jobs, self._queue = self._queue, []
                self._running = {job.req_id for job in jobs}
            answers = self._answer(jobs)
            with self._cond:
                self._passes += 1
                for job, answer in zip(jobs, answers, strict=True):
                    # Forgotten while it ran (or replaced by a newer submit): drop it.
                    if job.req_id in self._running and not any(
                            queued.req_id == job.req_id for queued in self._queue):
                        self._done[job.req_id] = answer
                self._running = set()

    def _answer(self, jobs: list[_Job]) -> list[FinishedLookup]:
        """One `locate` call for every job's keys (duplicates asked once), then each job's
        prefix and where its blocks lie."""
        position: dict[bytes, int] = {}
        keys: list[BlockKey] = []
        for job in jobs:
            for key in job.keys:
                if key.digest not in position:
                    position[key.digest] = len(keys)
                    keys.append(key)
        deadline = max(job.deadline for job in jobs)
        try:
            where = self._store.locate(keys, deadline=deadline) if keys else []
        except Exception:
            # The store's own tiers already turn their failures into misses; what reaches here
            # is a closed store or a bug, and the requests compute instead.
            log.warning("kvkeep: background lookup failed; computing instead", exc_info=True)
            return [FinishedLookup(job.first, len(job.keys), 0, failed=True) for job in jobs]
        answers = []
        for job in jobs:
            tiers = [where[position[key.digest]] for key in job.keys]
            hit = next((i for i, tier in enumerate(tiers) if tier < 0), len(tiers))
            if time.monotonic() >= job.deadline:
                hit = 0  # too slow for this request: its load would be late as well
            answers.append(FinishedLookup(job.first, len(job.keys), hit,
                                          tiers=tuple(tiers[:hit])))
        return answers
