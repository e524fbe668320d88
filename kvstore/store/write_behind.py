"""The store's write-behind engine: a bounded queue of typed jobs (`kvstore.store.jobs`) and the
writer threads that carry them out.

- A `BlockCopy` (a put's copy into the lower tiers) and a `Promotion` (a lower-tier hit copied
  up) are block jobs: the writer asks each target first (`contains`, batched) and skips those
  that hold the block already, so a prefix block saved by many requests is written down once;
  it reads the frame back from the job's source tier into a reusable scratch buffer (unless the
  job holds a copy; until then the first tier holds the block, `SupportsHold`, so that no
  eviction loses a block a put acknowledged), gives way to reads in flight on the target (at most
  `read_priority_max_wait_s` per batch, so it cannot starve), and writes up to `write_batch`
  blocks at a time, as one `put_many` where the tier has it. It starts a batch once the store's
  callers have paused (`writer_quiet_s`, at most `writer_defer_max_s` after the job was
  queued; StoreConfig): on a node short of cores, a burst of puts or gets runs alone, and the
  disk work fills the gap after it. Each copy a target acknowledges
  is timed from the block's computation (`BlockCopy.computed_at`) into `copy_lag_seconds`:
  the window in which a dying node takes KV with it.
- A `ManifestCopy` writes a session manifest to every lower tier.

Submitting never blocks a put: when the queue is full, by jobs (`write_queue_depth`) or by the
bytes its block jobs carry (`max_queued_bytes`: the RAM they pin, held copies or the tier-0
pages they read back), the job is dropped and counted (`write_behind_dropped{reason}`,
`dropped_total`), and `copy_down` says so: a caller that acknowledges durability (the daemon's
put commit, kvstore/store/facade.py `commit_put`) refuses instead of acknowledging a block that
would live in RAM only. A lost background copy costs at worst a later recompute, a blocked put
costs latency now. Only manifests may wait for room (`manifest_enqueue_timeout_s`), because
failover depends on them.
A delete cancels the queued jobs of its keys; a job already being written when the delete came
is undone once its batch is written (`wait_unwritten` lets the delete wait for that).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.errors import CorruptBlock
from kvstore.frame import FrameBytes, FrameHeader
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionRecord
from kvstore.store.config import StoreConfig
from kvstore.store.jobs import BlockCopy, BlockJob, Job, ManifestCopy, Promotion
from kvstore.store.tier_calls import TierCalls
from kvstore.tiers.capabilities import SupportsHold, SupportsPutMany

__all__ = ["WriteBehind"]

log = logging.getLogger("kvstore.store")

_QUEUED_BYTES_MAX = 1 << 30
"""Block bytes the queue may carry at most; less when the first tier is smaller (its budget,
but at least `_QUEUED_BYTES_MIN`): queued copies that read back from tier 0 cannot be kept
past what it holds, and held copies cost RAM of their own."""
_QUEUED_BYTES_MIN = 64 << 20

_BATCH_BYTES = 8 << 20
"""While the writer gives way to callers (`writer_quiet_s`) and no one waits for it, a batch
stops taking jobs past this many bytes of blocks: the writer looks for callers only between
batches, and a batch of 16 blocks of 4 MiB took 60 ms or more to write, which a burst of
lookups right after the stores waited out (one daemon, 4 MiB, lookups right after 5 rounds of
stores: p50 10-54 us a key, 9-28 with batches capped). Under back-pressure batches are whole:
sustained durable 4 MiB stores ran 7 % slower with every batch capped. Small blocks still go
`write_batch` at once."""

_JobKey = BlockKey | SessionKey


class WriteBehind:
    """Background copies between the tiers of one store; thread-safe."""

    def __init__(self, calls: TierCalls, config: StoreConfig) -> None:
        self._calls = calls
        self._config = config
        self._queue: queue.Queue[Job | None] = queue.Queue(config.write_queue_depth)
        # Guards the job accounting below; flush and delete wait on it.
        self._state = threading.Condition()
        self._seq = itertools.count()
        self._pending = 0
        self._pending_keys: dict[_JobKey, int] = {}
        self._deleted_at: dict[_JobKey, int] = {}
        self._promoting: set[BlockKey] = set()
        # Keys of the batches writers are working on right now (read back, written, undone).
        self._writing: dict[_JobKey, int] = {}
        self._job_bytes: dict[int, int] = {}  # seq -> bytes, for the block jobs queued
        self._queued_at: dict[int, float] = {}  # seq -> time.monotonic() it was queued
        self._waiting = 0  # threads in `_wait_for`: no holding back then
        self._queued_bytes = 0
        self._dropped = 0
        # (at_most, wake): one-shot calls for waiters that cannot block a thread (an event
        # loop's), made as the pending count falls to at_most (when_pending_at_most).
        self._watchers: list[tuple[int, Callable[[], None]]] = []
        self._on_done: dict[int, Callable[[], None]] = {}  # seq -> release of a held source
        # The first tier's `hold`, looked up once: a Protocol isinstance on every put is slow.
        first = calls.tiers[0] if calls.tiers else None
        self._hold_first = first.hold if isinstance(first, SupportsHold) else None
        budget = _QUEUED_BYTES_MAX
        if calls.tiers:
            try:
                budget = min(budget, max(calls.tiers[0].stats().bytes_budget, _QUEUED_BYTES_MIN))
            except Exception:  # a tier that cannot say: the fixed bound
                budget = _QUEUED_BYTES_MAX
        self.max_queued_bytes = budget
        self._closed = False
        self._writers = [threading.Thread(target=self._writer_main, name=f"kvkeep-writer-{i}",
                                          daemon=True)
                         for i in range(config.writer_threads)]
        for writer in self._writers:
            writer.start()

    # -- submitting ---------------------------------------------------------------------------

    def copy_down(self, key: BlockKey, header: FrameHeader, frame: bytes | None, *,
                  computed_at: float, skip: frozenset[int] = frozenset()) -> bool:
        """Queue a put's copy into every tier below the first but those in `skip` (`frame`,
        `computed_at`: see BlockCopy)."""
        targets = tuple(t for t in range(1, len(self._calls)) if t not in skip)
        if not targets:
            return True
        release = None
        if frame is None and self._hold_first is not None:
            # Read back from the first tier later: kept there until then (an eviction before
            # the read-back would lose a block its put acknowledged).
            release = self._hold_first(key)
            if release is None:  # evicted already: nothing to copy down
                self._drop("source_gone")
                return False
        return self._submit(key, lambda seq: BlockCopy(seq, key, targets, header, computed_at,
                                                       frame),
                            nbytes=header.frame_size, on_done=release)

    def promote(self, key: BlockKey, source: int, header: FrameHeader,
                frame: bytes | None = None) -> None:
        """Queue a copy of a block hit in tier `source` into the tiers above it (`frame`: the
        whole frame as read, else it is read back from `source`)."""
        with self._state:
            if key in self._promoting:
                return  # a layer-by-layer restore reads one block many times: promote it once
            self._promoting.add(key)
        targets = tuple(range(source))
        if not self._submit(key, lambda seq: Promotion(seq, key, targets, header, source, frame),
                            nbytes=header.frame_size):
            with self._state:
                self._promoting.discard(key)

    def copy_manifest(self, record: SessionRecord) -> bool:
        """Queue a session record's copy into every tier below the first (may wait for room)."""
        targets = tuple(range(1, len(self._calls)))
        return self._submit(record.key,
                            lambda seq: ManifestCopy(seq, record.key, targets, record),
                            wait=self._config.manifest_enqueue_timeout_s)

    def _submit(self, key: _JobKey, make: Callable[[int], Job], wait: float = 0.0,
                nbytes: int = 0, on_done: Callable[[], None] | None = None) -> bool:
        """Queue the job `make` builds; False (counted as dropped) when it cannot be.
        `on_done` is called once the job is done, or at once when it is not queued."""
        with self._state:
            refused = "closed" if self._closed else (
                # One job bigger than the whole bound still goes into an empty queue: else a
                # block bigger than half of RAM could never be written down.
                "queue_bytes" if nbytes and self._queued_bytes
                and self._queued_bytes + nbytes > self.max_queued_bytes else None)
            if refused is not None:
                self._drop(refused)
            else:
                job = make(next(self._seq))
                if on_done is not None:
                    self._on_done[job.seq] = on_done
                if nbytes:
                    self._job_bytes[job.seq] = nbytes
                    self._queued_bytes += nbytes
                if self._config.writer_quiet_s:  # what `_give_way` bounds its wait by
                    self._queued_at[job.seq] = time.monotonic()
                self._pending += 1
                self._pending_keys[key] = self._pending_keys.get(key, 0) + 1
                self._calls.metrics.write_queue_depth.set(self._pending)
        if refused is not None:
            if on_done is not None:
                on_done()
            return False
        try:
            if wait > 0:
                self._queue.put(job, timeout=wait)
            else:
                self._queue.put_nowait(job)
        except queue.Full:
            self._drop("queue_full")
            self._job_done(job)
            return False
        return True

    # -- state --------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        with self._state:
            return self._pending

    @property
    def queued_bytes(self) -> int:
        """Bytes of the block jobs queued or being written."""
        with self._state:
            return self._queued_bytes

    @property
    def dropped_total(self) -> int:
        """Jobs dropped since start, every reason (also `write_behind_dropped{reason}`)."""
        with self._state:
            return self._dropped

    @property
    def closed(self) -> bool:
        return self._closed  # read on every get and put: a bool needs no lock to be read

    def cancel(self, keys: Sequence[_JobKey]) -> None:
        """Cancel the jobs of `keys` queued so far (a delete of them is starting)."""
        with self._state:
            mark = next(self._seq)  # every job queued before this delete has a smaller seq
            for key in keys:
                if key in self._pending_keys:
                    self._deleted_at[key] = mark

    def wait_unwritten(self, keys: Sequence[_JobKey]) -> bool:
        """Wait until no writer holds any of `keys` (at most `background_deadline_s`)."""
        with self._state:
            return not self._writing or self._wait_for(
                lambda: not any(key in self._writing for key in keys),
                self._config.background_deadline_s)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is done; False if `timeout` ran out."""
        return self.wait_pending(0, timeout)

    def wait_pending(self, at_most: int, timeout: float | None = None) -> bool:
        """Wait until at most `at_most` jobs are queued or being written; False if `timeout`
        ran out. Woken as each batch finishes, not by polling: a put's ack that waits for the
        disk goes as soon as the disk has caught up."""
        with self._state:
            return self._wait_for(lambda: self._pending <= at_most, timeout)

    def _wait_for(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """`_state.wait_for`, counted as a wait on the writer: a writer holding its batch back
        (`_give_way`) goes at once. Caller holds _state."""
        if done():
            return True
        self._waiting += 1
        self._state.notify_all()
        try:
            return self._state.wait_for(done, timeout)
        finally:
            self._waiting -= 1

    def when_pending_at_most(self, at_most: int, wake: Callable[[], None]
                             ) -> Callable[[], None]:
        """Call `wake` once when at most `at_most` jobs are queued or being written: here and
        now if so already, otherwise on the writer thread that finishes the job that brings it
        there. Returns what cancels the call. `wait_pending` for a waiter that must not block
        a thread (an event loop's: its `wake` is a call_soon_threadsafe); `wake` must not
        block either."""
        watcher = (at_most, wake)
        with self._state:
            if self._pending > at_most:
                self._watchers.append(watcher)
                self._state.notify_all()  # a writer holding its batch back goes now
                return lambda: self._unwatch(watcher)
        wake()
        return lambda: None

    def _unwatch(self, watcher: tuple[int, Callable[[], None]]) -> None:
        with self._state:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def close(self, timeout: float) -> None:
        """Flush (up to `timeout`), refuse new jobs, drop what is left, stop the writers."""
        self.flush(timeout)
        with self._state:
            self._closed = True  # from here on nothing is queued
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._drop("closed")
                self._job_done(job)
        for _ in self._writers:
            self._queue.put(None)
        for writer in self._writers:
            writer.join(timeout)

    # -- the writers --------------------------------------------------------------------------

    def _writer_main(self) -> None:
        if self._config.writer_nice and sys.platform.startswith("linux"):
            try:  # on Linux the nice value is per thread, and raising it needs no privilege
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               os.getpriority(os.PRIO_PROCESS, 0) + self._config.writer_nice)
            except OSError as exc:
                log.warning("cannot lower the writer thread's priority: %s", exc)
        scratch: list[bytearray] = []
        stop = False
        while not stop:
            batch, stop = self._next_batch()
            if not batch:
                break
            with self._state:
                for job in batch:
                    self._writing[job.key] = self._writing.get(job.key, 0) + 1
            try:
                self._run_batch(batch, scratch)
            except Exception:  # never let one bad batch kill the writer
                log.exception("background write batch failed")
                for _ in batch:
                    self._drop("error")
            finally:
                with self._state:
                    for job in batch:
                        left = self._writing.pop(job.key) - 1
                        if left:
                            self._writing[job.key] = left
                    self._state.notify_all()
                for job in batch:
                    self._job_done(job)

    def _next_batch(self) -> tuple[list[Job], bool]:
        """Up to `write_batch` jobs, and up to `_BATCH_BYTES` past the first (waiting for the
        first), and whether to stop after them."""
        first = self._queue.get()
        if first is None:
            return [], True
        whole = self._give_way(first)  # more jobs queue meanwhile: the batch fills
        batch = [first]
        size = 0 if whole else self._bytes_of(first)
        while len(batch) < self._config.write_batch and (whole or size < _BATCH_BYTES):
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return batch, True
            batch.append(job)
            size += 0 if whole else self._bytes_of(job)
        return batch, False

    def _bytes_of(self, job: Job) -> int:
        with self._state:
            return self._job_bytes.get(job.seq, 0)

    def _give_way(self, job: Job) -> bool:
        """Hold the next batch back while the store's callers are busy (StoreConfig's
        `writer_quiet_s`): until they have paused that long, `job` has waited
        `writer_defer_max_s` since it was queued, someone waits for the writer, or the queue
        is half full (a full one drops copies, which the daemon must then refuse to ack).
        Returns whether the batch may be whole: short batches (`_BATCH_BYTES`) are for giving
        way between them, pointless when the writer does not give way or someone waits."""
        quiet = self._config.writer_quiet_s
        if quiet <= 0:
            return True
        with self._state:
            give_up_at = (self._queued_at.get(job.seq, time.monotonic())
                          + self._config.writer_defer_max_s)
            while True:
                now = time.monotonic()
                calm = now - self._calls.last_foreground
                if self._urgent():
                    return True
                if calm >= quiet or now >= give_up_at:
                    return False
                # Woken early by a waiter (wait_pending, wait_unwritten, a watcher).
                self._state.wait(min(quiet - calm, give_up_at - now))

    def _urgent(self) -> bool:
        """Someone waits for the writer, or the queue is half full. Caller holds _state."""
        return bool(self._closed or self._waiting or self._watchers
                    or 2 * self._pending > self._config.write_queue_depth
                    or 2 * self._queued_bytes > self.max_queued_bytes)

    def _run_batch(self, batch: list[Job], scratch: list[bytearray]) -> None:
        jobs: list[BlockJob] = []
        seen: set[tuple[BlockKey, tuple[int, ...]]] = set()
        for job in batch:
            if isinstance(job, ManifestCopy):
                self._write_manifest(job)
            elif not self._cancelled(job) and (job.key, job.targets) not in seen:
                seen.add((job.key, job.targets))
                jobs.append(job)
        # Blocks are put again and again (every request that shares a prefix saves it): ask
        # each target first, so that a block it already holds costs no read-back and no write.
        ready: list[tuple[BlockJob, FrameBytes, tuple[int, ...]]] = []
        for job, targets in zip(jobs, self._missing_targets(jobs), strict=True):
            if not targets:
                continue
            frame = job.frame if job.frame is not None else self._read_back(
                job, _scratch(scratch, len(ready), job.header.frame_size))
            if frame is not None:
                ready.append((job, frame, targets))
        for target in sorted({t for _, _, targets in ready for t in targets}):
            items = [(job, frame) for job, frame, targets in ready
                     if target in targets and not self._cancelled(job)]
            if items:
                self._calls.yield_to_reads(target, self._config.read_priority_max_wait_s)
                self._write_blocks(target, items)
        for job, _, _ in ready:
            if self._cancelled(job):  # deleted while we were writing it: undo
                self._undo(job)

    def _missing_targets(self, jobs: list[BlockJob]) -> list[tuple[int, ...]]:
        """For each job, the target tiers that do not hold its block yet (one call per tier)."""
        held: dict[int, set[BlockKey]] = {}
        for target in sorted({t for job in jobs for t in job.targets}):
            keys = [job.key for job in jobs if target in job.targets]
            try:
                flags = self._calls.tiers[target].contains(keys)
            except Exception:
                self._calls.failed(target, "contains")
                flags = [False] * len(keys)
            held[target] = {key for key, hit in zip(keys, flags, strict=False) if hit}
        return [tuple(t for t in job.targets if job.key not in held[t]) for job in jobs]

    def _read_back(self, job: BlockJob, buf: bytearray) -> memoryview | None:
        """The job's frame, read (and verified, unless its tier did) from its source into
        `buf`: the header the job carries, then the payload right behind it."""
        header_size, frame_size = job.header.header_size, job.header.frame_size
        view = memoryview(buf)
        try:
            read = self._calls.tiers[job.source].get(
                job.key, None, out=view[header_size:frame_size],
                deadline=time.monotonic() + self._config.background_deadline_s)
            if read is None:
                self._drop("source_gone")
                return None
            read = read.verified_for(job.key.digest)
            header = read.header.pack()
            if len(header) != header_size or read.header.frame_size != frame_size:
                raise CorruptBlock("block changed shape between put and read-back")
        except CorruptBlock:
            self._calls.discard(job.source, job.key)
            return None
        except Exception:
            self._calls.failed(job.source, "read_back")
            return None
        view[:header_size] = header
        return view[:frame_size]

    def _write_blocks(self, target: int, items: list[tuple[BlockJob, FrameBytes]]) -> None:
        calls = self._calls
        tier = calls.tiers[target]
        started = time.monotonic()
        pairs = [(job.key, frame) for job, frame in items]
        results: list[bool] | None = None
        if len(pairs) > 1 and isinstance(tier, SupportsPutMany):
            try:
                results = tier.put_many(pairs)
            except Exception:
                calls.failed(target, "put_many")  # retry one by one: one bad item only
        if results is None:
            results = [calls.put(target, key, frame, observe=False) for key, frame in pairs]
        else:
            for (_, frame), ok in zip(pairs, results, strict=False):
                calls.count_put(target, ok, len(frame))
        calls.observe(target, "put", started)
        for (job, _), ok in zip(items, results, strict=False):
            if ok and isinstance(job, Promotion):
                calls.metrics.promotions.labels(calls.names[target]).inc()
            elif ok and isinstance(job, BlockCopy):
                calls.copied(target, job.computed_at)

    def _undo(self, job: BlockJob) -> None:
        key = job.key
        for target in job.targets:
            self._calls.attempt(target, "delete", lambda t: t.delete([key]))

    def _write_manifest(self, job: ManifestCopy) -> None:
        record = job.record
        for target in job.targets:
            if self._cancelled(job):
                return
            self._calls.attempt(target, "put_manifest", lambda t: t.put_manifest(record))

    # -- bookkeeping --------------------------------------------------------------------------

    def _drop(self, reason: str) -> None:
        with self._state:  # a Condition over an RLock: callers may hold it already
            self._dropped += 1
        self._calls.dropped(reason)

    def _job_done(self, job: Job) -> None:
        with self._state:
            self._queued_bytes -= self._job_bytes.pop(job.seq, 0)
            self._queued_at.pop(job.seq, None)
            self._pending -= 1
            left = self._pending_keys.get(job.key, 0) - 1
            if left > 0:
                self._pending_keys[job.key] = left
            else:
                self._pending_keys.pop(job.key, None)
                self._deleted_at.pop(job.key, None)
            if isinstance(job, Promotion):
                self._promoting.discard(job.key)
            self._calls.metrics.write_queue_depth.set(self._pending)
            self._state.notify_all()  # flush, and acks held by back-pressure (wait_pending)
            due = [w for w in self._watchers if w[0] >= self._pending]
            if due:
                self._watchers = [w for w in self._watchers if w[0] < self._pending]
            on_done = self._on_done.pop(job.seq, None)
        if on_done is not None:
            on_done()
        for _, wake in due:
            try:
                wake()
            except Exception:  # a waiter's loop already closed: never the writer's failure
                log.debug("a pending-writes watcher failed", exc_info=True)

    def _cancelled(self, job: Job) -> bool:
        with self._state:
            return self._deleted_at.get(job.key, -1) > job.seq


def _scratch(pool: list[bytearray], slot: int, size: int) -> bytearray:
    """A writer's reusable buffer number `slot`, at least `size` bytes (touched once, reused)."""
    while len(pool) <= slot:
        pool.append(bytearray())
    if len(pool[slot]) < size:
        pool[slot] = bytearray(max(size, 2 * len(pool[slot])))
    return pool[slot]
