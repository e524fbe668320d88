"""TieredStore: ordered tiers as data, write-through/write-behind, verified reads, promotion.

The store alone knows the tier order (fastest first, e.g. hbm, host, nvme, remote); it never
special-cases a tier by name. Its rules:

- put: validated once, written synchronously to the first tier, then queued for the lower ones
  (write-behind). The queue is bounded; when it is full the background write is dropped and
  counted, never waited for: a put is on the decode path and the lower tiers are a cache, so a
  lost background copy costs at worst a later recompute, while a blocked put costs latency now.
  A queued block does not hold a copy of the caller's frame: the writer reads it back from the
  first tier when its turn comes (no extra RAM, no per-put allocation). If the block was evicted
  from the first tier before that, the background write is dropped and counted (`source_gone`);
  only a frame the first tier did not admit is copied into the queue. A writer first asks its
  targets (`contains`, batched) and skips those that already hold the block, so the same prefix
  block saved by many requests is written down once. Tiers that implement `put_many` get a
  batch of up to `write_batch` blocks at a time (the nvme tier syncs it as one).
- get: walks the tiers in order and returns the first copy that verifies (every segment's
  checksum and the key binding). A corrupt copy is deleted from its tier and counted, and the
  walk continues, since a lower tier may hold a good copy. A tier that raises anything is treated
  as empty for that call and counted. Each get has a deadline (a `time.monotonic()` instant,
  default `StoreConfig.get_deadline_s` from now); past it the get is a miss. A hit below the
  first tier schedules a promotion: a background job that copies the block up into the tiers
  above it (in the background because it needs the whole frame and a copy, and a get must not
  pay for either).
- reads before writes: background writers wait while reads are in flight on the tier they are
  about to write to, for at most `read_priority_max_wait_s` per batch so they cannot starve.
- lookup: the longest contiguous prefix of keys held by any tier, one batched `contains` per
  tier.
- manifests: written to every tier (the first synchronously, the rest behind; a manifest may
  wait up to `manifest_enqueue_timeout_s` for queue room because failover depends on it);
  reads ask every tier and return the highest generation, repairing upper tiers that lacked it.

Tiers must honour the deadline they are given: a synchronous call cannot be abandoned safely
(an abandoned read would still write into the caller's buffer later).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, runtime_checkable

from kvstore.errors import (
    ConfigError,
    CorruptBlock,
    DeadlineExceeded,
    InvalidFrame,
    TierUnavailable,
)
from kvstore.frame import BlockRead, FrameHeader, LayerRange, verify_pieces
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionManifest
from kvstore.metrics import StoreMetrics
from kvstore.tiers.base import Buffer, Tier, TierStats
from kvstore.tiers.factory import TierSpec, build_tiers
from kvstore.tiers.paged import BorrowedBlock, PageReservation

__all__ = ["TieredStore", "StoreConfig", "StoreStats", "FrameBytes", "SupportsPutMany",
           "SupportsBorrow", "SupportsReserve"]

log = logging.getLogger(__name__)

FrameBytes = bytes | bytearray | memoryview


@runtime_checkable
class SupportsPutMany(Protocol):
    """A tier that can store a batch more cheaply than one put at a time (e.g. one fsync)."""

    def put_many(self, items: Sequence[tuple[BlockKey, FrameBytes]]) -> list[bool]: ...


@runtime_checkable
class SupportsBorrow(Protocol):
    """A tier that can lend a block's bytes in place, pinned (host RAM; see PagedTier.borrow)."""

    def borrow(self, key: BlockKey, layers: LayerRange | None = None
               ) -> BorrowedBlock | None: ...


@runtime_checkable
class SupportsReserve(Protocol):
    """A tier whose pages a frame can be received into directly (see PagedTier.reserve)."""

    def reserve(self, key: BlockKey, size: int) -> PageReservation | None: ...


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Tunables of a TieredStore; the defaults suit a worker-local store.

    get_deadline_s: default budget of a get/lookup/get_many call, in seconds.
    write_queue_depth: background jobs (write-behind, promotions, manifests) that may wait.
    writer_threads: threads draining the queue.
    write_batch: jobs a writer takes at once; tiers with `put_many` store them as one batch.
    read_priority_max_wait_s: how long a writer yields to in-flight reads on its target tier.
    manifest_enqueue_timeout_s: how long put_manifest may wait for queue room.
    background_deadline_s: deadline of the reads a writer does (read-back, promotion source).
    promote: copy lower-tier hits up into the tiers above.
    writer_nice: a positive value lowers the writer threads' CPU priority by that much (Linux
    nice, per thread): on a node short of cores, write-behind then takes the CPU the request
    threads leave, instead of slowing puts that do not wait for it (back-pressure still bounds
    the backlog). 0 leaves them alone.
    """

    get_deadline_s: float = 0.5
    write_queue_depth: int = 256
    writer_threads: int = 1
    write_batch: int = 8
    read_priority_max_wait_s: float = 0.05
    manifest_enqueue_timeout_s: float = 1.0
    background_deadline_s: float = 5.0
    promote: bool = True
    writer_nice: int = 0

    def __post_init__(self) -> None:
        if self.get_deadline_s <= 0 or self.background_deadline_s <= 0:
            raise ConfigError("deadlines must be positive")
        if self.write_queue_depth < 1 or self.writer_threads < 1 or self.write_batch < 1:
            raise ConfigError("write_queue_depth, writer_threads and write_batch must be >= 1")
        if not 0 <= self.writer_nice <= 19:
            raise ConfigError("writer_nice must be 0-19")
        if self.read_priority_max_wait_s < 0 or self.manifest_enqueue_timeout_s < 0:
            raise ConfigError("wait times cannot be negative")


@dataclass(frozen=True, slots=True)
class StoreStats:
    tiers: tuple[TierStats, ...]
    pending_writes: int
    hits: int
    misses: int
    corrupt: int
    errors: int
    write_behind_dropped: int


class _JobKind(enum.Enum):
    BLOCK = enum.auto()  # write-behind of a put
    PROMOTE = enum.auto()  # copy a lower-tier hit up
    MANIFEST = enum.auto()


@dataclass(frozen=True, slots=True)
class _Job:
    kind: _JobKind
    seq: int
    targets: tuple[int, ...]
    key: BlockKey | SessionKey
    frame: bytes | None = None  # an immutable copy; None: read it back from `source`
    source: int = 0
    header_size: int = 0
    frame_size: int = 0
    manifest: SessionManifest | None = None


_DEADLINE = object()  # a tier raised DeadlineExceeded: the whole get is a miss


class TieredStore:
    """Ordered tiers behind one verified get/put/lookup API; thread-safe, with async wrappers."""

    def __init__(self, tiers: Sequence[Tier], *, config: StoreConfig | None = None,
                 metrics: StoreMetrics | None = None, close_tiers: bool = True) -> None:
        if not tiers:
            raise ConfigError("a TieredStore needs at least one tier")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique (they label metrics): {names}")
        self._tiers: tuple[Tier, ...] = tuple(tiers)
        self._names = tuple(names)
        self._config = config or StoreConfig()
        self._metrics = metrics or StoreMetrics()
        self._close_tiers = close_tiers
        self._queue: queue.Queue[_Job | None] = queue.Queue(self._config.write_queue_depth)
        # `_state` guards job accounting (flush waits on it); `_reads` the in-flight read counts.
        self._state = threading.Condition()
        self._reads = threading.Condition()
        self._reads_in_flight = [0] * len(self._tiers)
        self._seq = itertools.count()
        self._pending = 0
        self._pending_keys: dict[BlockKey | SessionKey, int] = {}
        self._deleted_at: dict[BlockKey | SessionKey, int] = {}
        self._promoting: set[BlockKey] = set()
        # Keys of the batches writers are working on right now (read back, written, undone).
        self._writing: dict[BlockKey | SessionKey, int] = {}
        self._closed = False
        self._counts = {"hits": 0, "misses": 0, "corrupt": 0, "errors": 0, "dropped": 0}
        self._writers = [threading.Thread(target=self._writer_main, name=f"kvkeep-writer-{i}",
                                          daemon=True)
                         for i in range(self._config.writer_threads)]
        for writer in self._writers:
            writer.start()

    @classmethod
    def from_specs(cls, specs: Sequence[TierSpec], *, config: StoreConfig | None = None,
                   metrics: StoreMetrics | None = None) -> TieredStore:
        """Build the tiers from specs (skipping optional ones this machine lacks, e.g. hbm)."""
        return cls(build_tiers(specs), config=config, metrics=metrics)

    # -- properties ---------------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return self._tiers

    @property
    def config(self) -> StoreConfig:
        return self._config

    @property
    def metrics(self) -> StoreMetrics:
        return self._metrics

    @property
    def pending_writes(self) -> int:
        with self._state:
            return self._pending

    # -- blocks -------------------------------------------------------------------------------

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        """The verified block (or segments of `layers`) from the first tier that has it.

        With `out`, the payload is copied into it and the result's payload is a view of it.
        Returns None on a miss, including a deadline passed, corrupt copies, failing tiers.
        """
        self._check_open()
        deadline = self._deadline(deadline)
        for index in range(len(self._tiers)):
            if time.monotonic() >= deadline:
                self._metrics.deadline_misses.inc()
                break
            outcome = self._read(index, key, layers, out, deadline)
            if outcome is _DEADLINE:
                break
            if isinstance(outcome, BlockRead):
                if index > 0 and self._config.promote:
                    self._schedule_promotion(key, index, outcome.header)
                return outcome
        self._metrics.misses.inc()
        self._count("misses")
        return None

    def borrow(self, key: BlockKey, layers: LayerRange | None = None, *,
               verify: bool = True) -> BorrowedBlock | None:
        """A verified hit in the first tier, lent in place (pinned pages, no copy): what a
        server sends straight from, e.g. with `socket.sendmsg(block.pieces)`.

        None when the first tier cannot lend (not host memory), does not hold the block, or
        fails in any way; the caller then uses `get`, which also reads the lower tiers. A copy
        that fails verification (checksums, key binding) is deleted, as `get` would. The caller
        must `release()` the result once the bytes are sent.

        verify=False checks only the key binding and leaves the segment checksums to
        `check_borrowed`, for a server whose client verifies every block itself: it can send
        first and hash while the client receives, instead of hashing on the critical path.
        """
        self._check_open()
        tier = self._tiers[0]
        if not isinstance(tier, SupportsBorrow):
            return None
        started = time.monotonic()
        try:
            block = tier.borrow(key, layers)
        except Exception:  # a bad layer range, a closed tier: `get` says what it is
            return None
        finally:
            self._observe(0, "get", started)
        if block is None:
            return None
        try:
            if block.header.key_digest != key.digest:
                raise CorruptBlock("frame is bound to a different key")
            if verify:
                verify_pieces(block.header, block.layers, block.pieces)
        except CorruptBlock:
            block.release()
            self._discard(0, key)
            return None
        except BaseException:
            block.release()
            raise
        self._metrics.hits.labels(self._names[0]).inc()
        self._metrics.read_bytes.labels(self._names[0]).inc(block.size)
        self._count("hits")
        return block

    def check_borrowed(self, key: BlockKey, block: BorrowedBlock) -> bool:
        """Verify a block lent with `verify=False` (before releasing it). A copy that fails is
        deleted from the first tier, as `get` would, so the next read finds a good copy below
        or misses; False then."""
        try:
            verify_pieces(block.header, block.layers, block.pieces)
        except CorruptBlock:
            self._discard(0, key)
            return False
        return True

    def get_many(self, keys: Sequence[BlockKey], layers: LayerRange | None = None, *,
                 outs: Sequence[Buffer] | None = None, deadline: float | None = None
                 ) -> list[BlockRead | None]:
        """`get` for each key under one shared deadline; `outs`, if given, one buffer per key."""
        if outs is not None and len(outs) != len(keys):
            raise ConfigError(f"get_many: {len(keys)} keys but {len(outs)} output buffers")
        deadline = self._deadline(deadline)
        return [self.get(key, layers, out=None if outs is None else outs[i], deadline=deadline)
                for i, key in enumerate(keys)]

    def put(self, key: BlockKey, frame: FrameBytes) -> bool:
        """Store a frame: synchronously in the first tier, in the background below it.

        Returns True if the first tier admitted it or a background write was queued. Raises
        InvalidFrame if the frame does not parse, has the wrong size or is bound to another key.
        The caller may reuse `frame`'s buffer as soon as this returns.
        """
        self._check_open()
        view = _byte_view(frame)
        header = _checked_header(key, view)
        admitted = self._put_one(0, key, view)
        if len(self._tiers) == 1:
            return admitted
        # Admitted: the writer reads it back from tier 0 later. Not admitted: keep an immutable
        # copy (no copy at all when the caller passed bytes).
        held = None if admitted else frame if isinstance(frame, bytes) else bytes(view)
        queued = self._enqueue(_JobKind.BLOCK, key, tuple(range(1, len(self._tiers))),
                               frame=held, source=0, header=header)
        return admitted or queued

    def put_many(self, items: Sequence[tuple[BlockKey, FrameBytes]]) -> list[bool]:
        return [self.put(key, frame) for key, frame in items]

    def begin_put(self, key: BlockKey, size: int) -> PageReservation | None:
        """Pages of the first tier for a `size`-byte frame, to receive it into in place; then
        `commit_put` (or the reservation's `abort()`). None when the first tier cannot
        (it already holds the block, has no room, or its pages are not host memory): use
        `put`, which handles each of those cases."""
        self._check_open()
        tier = self._tiers[0]
        if not isinstance(tier, SupportsReserve):
            return None
        try:
            return tier.reserve(key, size)
        except Exception:
            self._tier_error(0, "put")
            return None

    def commit_put(self, reservation: PageReservation, header: FrameHeader) -> bool:
        """Publish a frame received into `begin_put`'s pages, and queue its write-behind to the
        tiers below, like `put`. The caller has checked the frame (`header` parsed from its
        first bytes, and its segments against their checksums); this checks the header's size
        and key binding again and raises InvalidFrame (aborting the reservation) on mismatch."""
        key = reservation.key
        if header.frame_size != reservation.size or header.key_digest != key.digest:
            reservation.abort()
            raise InvalidFrame("frame header disagrees with its size or key")
        started = time.monotonic()
        try:
            admitted = reservation.commit(header)
        except Exception:
            reservation.abort()
            self._tier_error(0, "put")
            admitted = False
        finally:
            self._observe(0, "put", started)
        self._count_put(0, admitted, reservation.size)
        if len(self._tiers) == 1 or not admitted:
            return admitted
        # The writer reads it back from tier 0 later, as for any admitted put.
        self._enqueue(_JobKind.BLOCK, key, tuple(range(1, len(self._tiers))), frame=None,
                      source=0, header=header)
        return True

    def lookup(self, keys: Sequence[BlockKey], *, deadline: float | None = None) -> int:
        """How many of `keys`, from the first on, are held by some tier (prefix length)."""
        self._check_open()
        deadline = self._deadline(deadline)
        found = [False] * len(keys)
        for index, tier in enumerate(self._tiers):
            ask = [i for i, hit in enumerate(found) if not hit]
            if not ask:
                break
            if time.monotonic() >= deadline:
                self._metrics.deadline_misses.inc()
                break
            started = time.monotonic()
            try:
                flags = tier.contains([keys[i] for i in ask])
                if len(flags) != len(ask):
                    raise TierUnavailable(f"{tier.name}: contains answered {len(flags)} of "
                                          f"{len(ask)} keys")
            except Exception:
                self._tier_error(index, "contains")
                continue
            finally:
                self._observe(index, "contains", started)
            for i, hit in zip(ask, flags, strict=True):
                if hit:
                    found[i] = True
        return next((i for i, hit in enumerate(found) if not hit), len(found))

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks from every tier (and cancel their queued writes); how many were held.

        A write-behind already writing one of the keys when the delete came sees the delete
        and undoes its write, but only once its batch is written; this waits for that (one
        batch at most, bounded by `background_deadline_s`), so that when delete returns the
        blocks are gone from every tier rather than briefly back in a lower one.
        """
        self._check_open()
        self._cancel_pending(keys)
        held = [False] * len(keys)
        for index, tier in enumerate(self._tiers):
            try:
                flags = tier.contains(keys)
                tier.delete(keys)
            except Exception:
                self._tier_error(index, "delete")
                continue
            held = [a or bool(b) for a, b in zip(held, flags, strict=False)]
        with self._state:
            if self._writing and not self._state.wait_for(
                    lambda: not any(key in self._writing for key in keys),
                    self._config.background_deadline_s):
                log.warning("delete: a write-behind of a deleted block is still running")
        return sum(held)

    # -- manifests ----------------------------------------------------------------------------

    def put_manifest(self, manifest: SessionManifest) -> None:
        """Store a manifest in every tier (no tier keeps it if it holds a newer generation)."""
        self._check_open()
        try:
            self._tiers[0].put_manifest(manifest)
        except Exception:
            self._tier_error(0, "put_manifest")
        if len(self._tiers) > 1:
            self._enqueue(_JobKind.MANIFEST, manifest.key, tuple(range(1, len(self._tiers))),
                          manifest=manifest, wait=self._config.manifest_enqueue_timeout_s)

    def get_manifest(self, key: SessionKey, *, deadline: float | None = None
                     ) -> SessionManifest | None:
        """The highest generation of the manifest found in any tier, or None."""
        self._check_open()
        deadline = self._deadline(deadline)
        found: list[SessionManifest | None] = []
        for index, tier in enumerate(self._tiers):
            if time.monotonic() >= deadline:
                self._metrics.deadline_misses.inc()
                break
            manifest = None
            try:
                manifest = tier.get_manifest(key)
                if manifest is not None and manifest.key != key:
                    raise CorruptBlock("manifest bound to another session")
            except CorruptBlock:
                manifest = None
                self._corrupt(index, "manifest")
                self._try(index, "delete_manifest", lambda t: t.delete_manifest(key))
            except Exception:
                manifest = None
                self._tier_error(index, "get_manifest")
            found.append(manifest)
        best_index = max((i for i, m in enumerate(found) if m is not None),
                         key=lambda i: (_generation(found[i]), -i), default=None)
        if best_index is None:
            return None
        best = found[best_index]
        assert best is not None
        for index in range(best_index):  # manifests are small: repair upper tiers right away
            if _generation(found[index]) < best.generation:
                self._try(index, "put_manifest", lambda t: t.put_manifest(best))
        return best

    def delete_manifest(self, key: SessionKey) -> bool:
        self._check_open()
        self._cancel_pending([key])
        removed = False
        for index, tier in enumerate(self._tiers):
            try:
                removed = tier.delete_manifest(key) or removed
            except Exception:
                self._tier_error(index, "delete_manifest")
        return removed

    # -- lifecycle ----------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued background write is done; False if `timeout` ran out."""
        with self._state:
            return self._state.wait_for(lambda: self._pending == 0, timeout)

    def stats(self) -> StoreStats:
        tier_stats = []
        for index, tier in enumerate(self._tiers):
            try:
                tier_stats.append(tier.stats())
            except Exception:
                self._tier_error(index, "stats")
                tier_stats.append(TierStats(tier.name, 0, 0, 0))
        with self._state:
            counts = dict(self._counts)
            pending = self._pending
        return StoreStats(tuple(tier_stats), pending, counts["hits"], counts["misses"],
                          counts["corrupt"], counts["errors"], counts["dropped"])

    def close(self, timeout: float = 5.0) -> None:
        """Flush (up to `timeout`), stop the writers, drop what is left, close the tiers."""
        with self._state:
            if self._closed:
                return
        self.flush(timeout)
        with self._state:
            self._closed = True  # from here on nothing is enqueued
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
        if self._close_tiers:
            for index in range(len(self._tiers)):
                self._try(index, "close", lambda t: t.close())

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- asyncio wrappers (each call runs in the default executor) ---------------------------

    async def aget(self, key: BlockKey, layers: LayerRange | None = None, *,
                   out: Buffer | None = None, deadline: float | None = None
                   ) -> BlockRead | None:
        # The deadline is fixed before the hop to a thread, so executor queueing counts.
        deadline = self._deadline(deadline)
        return await asyncio.to_thread(self.get, key, layers, out=out, deadline=deadline)

    async def aget_many(self, keys: Sequence[BlockKey], layers: LayerRange | None = None, *,
                        outs: Sequence[Buffer] | None = None, deadline: float | None = None
                        ) -> list[BlockRead | None]:
        deadline = self._deadline(deadline)
        return await asyncio.to_thread(self.get_many, keys, layers, outs=outs, deadline=deadline)

    async def aput(self, key: BlockKey, frame: FrameBytes) -> bool:
        return await asyncio.to_thread(self.put, key, frame)

    async def aput_many(self, items: Sequence[tuple[BlockKey, FrameBytes]]) -> list[bool]:
        return await asyncio.to_thread(self.put_many, items)

    async def alookup(self, keys: Sequence[BlockKey], *, deadline: float | None = None) -> int:
        deadline = self._deadline(deadline)
        return await asyncio.to_thread(self.lookup, keys, deadline=deadline)

    async def adelete(self, keys: Sequence[BlockKey]) -> int:
        return await asyncio.to_thread(self.delete, keys)

    async def aput_manifest(self, manifest: SessionManifest) -> None:
        await asyncio.to_thread(self.put_manifest, manifest)

    async def aget_manifest(self, key: SessionKey, *, deadline: float | None = None
                            ) -> SessionManifest | None:
        deadline = self._deadline(deadline)
        return await asyncio.to_thread(self.get_manifest, key, deadline=deadline)

    async def adelete_manifest(self, key: SessionKey) -> bool:
        return await asyncio.to_thread(self.delete_manifest, key)

    async def aflush(self, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self.flush, timeout)

    async def aclose(self, timeout: float = 5.0) -> None:
        await asyncio.to_thread(self.close, timeout)

    # -- reads --------------------------------------------------------------------------------

    def _read(self, index: int, key: BlockKey, layers: LayerRange | None, out: Buffer | None,
              deadline: float) -> BlockRead | object | None:
        """One tier's verified answer: a BlockRead, None (miss there) or _DEADLINE."""
        tier = self._tiers[index]
        started = time.monotonic()
        with self._reads:
            self._reads_in_flight[index] += 1
        try:
            read = tier.get(key, layers, out=out, deadline=deadline)
        except DeadlineExceeded:
            self._metrics.deadline_misses.inc()
            return _DEADLINE
        except CorruptBlock:
            self._discard(index, key)
            return None
        except Exception:  # TierUnavailable, OSError, a bug: a sick tier is an empty one
            self._tier_error(index, "get")
            return None
        finally:
            with self._reads:
                self._reads_in_flight[index] -= 1
                if self._reads_in_flight[index] == 0:
                    self._reads.notify_all()
            self._observe(index, "get", started)
        if read is None:
            self._metrics.tier_misses.labels(self._names[index]).inc()
            return None
        try:
            if read.layers != (layers if layers is not None else read.header.all_layers):
                raise CorruptBlock(f"{tier.name} returned layers {read.layers}, not {layers}")
            read.verify()
            read.verify_key(key.digest)
        except CorruptBlock:
            self._discard(index, key)
            return None
        except Exception:
            self._tier_error(index, "verify")
            return None
        self._metrics.hits.labels(self._names[index]).inc()
        self._metrics.read_bytes.labels(self._names[index]).inc(len(read.payload))
        self._count("hits")
        return read

    def _discard(self, index: int, key: BlockKey) -> None:
        self._corrupt(index, "block")
        self._try(index, "delete", lambda t: t.delete([key]))

    def _schedule_promotion(self, key: BlockKey, source: int, header: FrameHeader) -> None:
        with self._state:
            if key in self._promoting:
                return  # a layer-by-layer restore reads one block many times: promote it once
            self._promoting.add(key)
        if not self._enqueue(_JobKind.PROMOTE, key, tuple(range(source)), source=source,
                             header=header):
            with self._state:
                self._promoting.discard(key)

    # -- background writes --------------------------------------------------------------------

    def _enqueue(self, kind: _JobKind, key: BlockKey | SessionKey, targets: tuple[int, ...], *,
                 frame: bytes | None = None, source: int = 0, header: FrameHeader | None = None,
                 manifest: SessionManifest | None = None, wait: float = 0.0) -> bool:
        with self._state:
            if self._closed:
                self._counts["dropped"] += 1
                self._metrics.write_behind_dropped.labels("closed").inc()
                return False
            job = _Job(kind, next(self._seq), targets, key, frame, source,
                       header.header_size if header else 0, header.frame_size if header else 0,
                       manifest)
            self._pending += 1
            self._pending_keys[key] = self._pending_keys.get(key, 0) + 1
            self._metrics.write_queue_depth.set(self._pending)
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

    def _writer_main(self) -> None:
        if self._config.writer_nice and sys.platform.startswith("linux"):
            try:  # on Linux the nice value is per thread, and raising it needs no privilege
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                               os.getpriority(os.PRIO_PROCESS, 0) + self._config.writer_nice)
            except OSError as exc:
                log.warning("cannot lower the writer thread's priority: %s", exc)
        scratch: list[bytearray] = []
        while True:
            first = self._queue.get()
            batch: list[_Job] = []
            stop = first is None
            if first is not None:
                batch.append(first)
            while not stop and len(batch) < self._config.write_batch:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                else:
                    batch.append(job)
            with self._state:
                for job in batch:
                    self._writing[job.key] = self._writing.get(job.key, 0) + 1
            try:
                self._run_batch(batch, scratch)
            except Exception:  # never let one bad batch kill the writer
                log.exception("background write batch failed")
                self._count("errors")
            finally:
                with self._state:
                    for job in batch:
                        left = self._writing.pop(job.key) - 1
                        if left:
                            self._writing[job.key] = left
                    self._state.notify_all()
                for job in batch:
                    self._job_done(job)
            if stop:
                return

    def _run_batch(self, batch: list[_Job], scratch: list[bytearray]) -> None:
        jobs: list[_Job] = []
        seen: set[tuple[BlockKey | SessionKey, tuple[int, ...]]] = set()
        for job in batch:
            if job.kind is _JobKind.MANIFEST:
                self._write_manifest(job)
            elif not self._cancelled(job) and (job.key, job.targets) not in seen:
                seen.add((job.key, job.targets))
                jobs.append(job)
        # Blocks are put again and again (every request that shares a prefix saves it): ask
        # each target first, so that a block it already holds costs no read-back and no write.
        missing = self._missing_targets(jobs)
        blocks: list[tuple[_Job, FrameBytes, tuple[int, ...]]] = []
        for job, targets in zip(jobs, missing, strict=True):
            if not targets:
                continue
            frame = job.frame if job.frame is not None else self._read_back(
                job, _scratch(scratch, len(blocks), job.frame_size))
            if frame is not None:
                blocks.append((job, frame, targets))
        for target in sorted({t for _, _, targets in blocks for t in targets}):
            items = [(job, frame) for job, frame, targets in blocks
                     if target in targets and not self._cancelled(job)]
            if items:
                self._yield_to_reads(target)
                self._write_blocks(target, items)
        for job, _, _ in blocks:
            if self._cancelled(job):  # deleted while we were writing it: undo
                self._undo(job)

    def _missing_targets(self, jobs: list[_Job]) -> list[tuple[int, ...]]:
        """For each job, the target tiers that do not hold its block yet (one call per tier)."""
        held: dict[int, set[BlockKey | SessionKey]] = {}
        for target in sorted({t for job in jobs for t in job.targets}):
            keys = [job.key for job in jobs
                    if target in job.targets and isinstance(job.key, BlockKey)]
            try:
                flags = self._tiers[target].contains(keys)
            except Exception:
                self._tier_error(target, "contains")
                flags = [False] * len(keys)
            held[target] = {key for key, hit in zip(keys, flags, strict=False) if hit}
        return [tuple(t for t in job.targets if job.key not in held[t]) for job in jobs]

    def _read_back(self, job: _Job, buf: bytearray) -> memoryview | None:
        """The job's frame, read (and verified) from its source tier into `buf`."""
        assert isinstance(job.key, BlockKey)
        source = self._tiers[job.source]
        view = memoryview(buf)
        try:
            read = source.get(job.key, None, out=view[job.header_size: job.frame_size],
                              deadline=time.monotonic() + self._config.background_deadline_s)
            if read is None:
                self._drop("source_gone")
                return None
            read.verify()
            read.verify_key(job.key.digest)
            header = read.header.pack()
            if len(header) != job.header_size or read.header.frame_size != job.frame_size:
                raise CorruptBlock("block changed shape between read and read-back")
        except CorruptBlock:
            self._discard(job.source, job.key)
            return None
        except Exception:
            self._tier_error(job.source, "read_back")
            return None
        view[: job.header_size] = header
        return view[: job.frame_size]

    def _write_blocks(self, target: int, items: list[tuple[_Job, FrameBytes]]) -> None:
        tier = self._tiers[target]
        name = self._names[target]
        started = time.monotonic()
        pairs = [(job.key, frame) for job, frame in items if isinstance(job.key, BlockKey)]
        results: list[bool] | None = None
        if len(pairs) > 1 and isinstance(tier, SupportsPutMany):
            try:
                results = tier.put_many(pairs)
            except Exception:
                self._tier_error(target, "put_many")  # retry one by one: one bad item only
        if results is None:
            results = [self._put_one(target, key, frame, observe=False) for key, frame in pairs]
        else:
            for (_, frame), ok in zip(pairs, results, strict=False):
                self._count_put(target, ok, len(frame))
        self._observe(target, "put", started)
        for (job, _), ok in zip(items, results, strict=False):
            if ok and job.kind is _JobKind.PROMOTE:
                self._metrics.promotions.labels(name).inc()

    def _undo(self, job: _Job) -> None:
        key = job.key
        assert isinstance(key, BlockKey)
        for target in job.targets:
            self._try(target, "delete", lambda t: t.delete([key]))

    def _write_manifest(self, job: _Job) -> None:
        manifest = job.manifest
        assert manifest is not None
        for target in job.targets:
            if self._cancelled(job):
                return
            self._try(target, "put_manifest", lambda t: t.put_manifest(manifest))

    def _yield_to_reads(self, index: int) -> None:
        wait_until = time.monotonic() + self._config.read_priority_max_wait_s
        with self._reads:
            while self._reads_in_flight[index] > 0:
                remaining = wait_until - time.monotonic()
                if remaining <= 0:
                    break
                self._reads.wait(remaining)

    def _job_done(self, job: _Job) -> None:
        with self._state:
            self._pending -= 1
            left = self._pending_keys.get(job.key, 0) - 1
            if left > 0:
                self._pending_keys[job.key] = left
            else:
                self._pending_keys.pop(job.key, None)
                self._deleted_at.pop(job.key, None)
            if job.kind is _JobKind.PROMOTE:
                assert isinstance(job.key, BlockKey)
                self._promoting.discard(job.key)
            self._metrics.write_queue_depth.set(self._pending)
            if self._pending == 0:
                self._state.notify_all()

    def _cancel_pending(self, keys: Sequence[BlockKey | SessionKey]) -> None:
        with self._state:
            mark = next(self._seq)  # every job queued before this delete has a smaller seq
            for key in keys:
                if key in self._pending_keys:
                    self._deleted_at[key] = mark

    def _cancelled(self, job: _Job) -> bool:
        with self._state:
            return self._deleted_at.get(job.key, -1) > job.seq

    # -- helpers ------------------------------------------------------------------------------

    def _put_one(self, index: int, key: BlockKey, frame: FrameBytes, *,
                 observe: bool = True) -> bool:
        started = time.monotonic()
        try:
            ok = self._tiers[index].put(key, frame)
        except Exception:
            self._tier_error(index, "put")
            return False
        finally:
            if observe:
                self._observe(index, "put", started)
        self._count_put(index, ok, len(frame))
        return ok

    def _count_put(self, index: int, ok: bool, nbytes: int) -> None:
        if ok:
            self._metrics.written_bytes.labels(self._names[index]).inc(nbytes)
        else:
            self._metrics.rejected_puts.labels(self._names[index]).inc()

    def _try(self, index: int, op: str, call: _TierCall) -> None:
        try:
            call(self._tiers[index])
        except Exception:
            self._tier_error(index, op)

    def _tier_error(self, index: int, op: str) -> None:
        log.debug("tier %s failed in %s", self._names[index], op, exc_info=True)
        self._metrics.errors.labels(self._names[index], op).inc()
        self._count("errors")

    def _corrupt(self, index: int, what: str) -> None:
        log.warning("corrupt %s in tier %s deleted", what, self._names[index])
        self._metrics.corrupt.labels(self._names[index]).inc()
        self._count("corrupt")

    def _drop(self, reason: str) -> None:
        self._metrics.write_behind_dropped.labels(reason).inc()
        self._count("dropped")

    def _observe(self, index: int, op: str, started: float) -> None:
        self._metrics.latency.labels(self._names[index], op).observe(time.monotonic() - started)

    def _count(self, what: str) -> None:
        with self._state:
            self._counts[what] += 1

    def _deadline(self, deadline: float | None) -> float:
        return deadline if deadline is not None else (
            time.monotonic() + self._config.get_deadline_s)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("the store is closed")


class _TierCall(Protocol):
    def __call__(self, tier: Tier, /) -> object: ...


def _byte_view(frame: FrameBytes) -> memoryview:
    view = memoryview(frame)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise InvalidFrame("a frame must be a C-contiguous buffer")
        view = view.cast("B")
    return view


def _checked_header(key: BlockKey, view: memoryview) -> FrameHeader:
    try:
        header = FrameHeader.unpack(view)
    except InvalidFrame:
        raise
    except CorruptBlock as exc:  # on a write path, a bad frame is bad input
        raise InvalidFrame(f"frame header does not verify: {exc}") from exc
    if header.frame_size != len(view):
        raise InvalidFrame(f"frame is {len(view)} bytes, its header says {header.frame_size}")
    if header.key_digest != key.digest:
        raise InvalidFrame("frame is bound to a different key")
    return header


def _generation(manifest: SessionManifest | None) -> int:
    return -1 if manifest is None else manifest.generation


def _scratch(pool: list[bytearray], slot: int, size: int) -> bytearray:
    """A writer's reusable buffer number `slot`, at least `size` bytes (touched once, reused)."""
    while len(pool) <= slot:
        pool.append(bytearray())
    if len(pool[slot]) < size:
        pool[slot] = bytearray(max(size, 2 * len(pool[slot])))
    return pool[slot]

