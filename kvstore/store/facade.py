"""TieredStore: ordered tiers as data behind one get/put/lookup/manifest API.

The store alone knows the tier order (fastest first, e.g. hbm, host, nvme, remote); it never
special-cases a tier by name, and it imports no concrete tier: what a tier can do beyond the
`Tier` protocol it learns from the capability protocols (`kvstore.tiers.capabilities`). Its rules:

- put: validated once (header, size, key binding), written synchronously to the first tier,
  then copied behind to the lower ones by the write-behind engine (`write_behind.py`), which
  never makes a put wait. A queued block does not hold a copy of the caller's frame: it is read
  back from the first tier when its turn comes; only a frame the first tier did not admit is
  copied into the queue. `put_replicated` instead waits for the tiers that keep copies on
  other nodes (`replicated.py`): for callers whose KV must outlive their node.
- get: walks the tiers in order and returns the first copy that verifies, verified exactly once:
  by its tier where the tier checks its own reads (nvme, remote: `BlockRead.verified`), else here
  (`BlockRead.verified_for`: every segment's checksum and the key binding). What it returns is
  marked verified, so decoding does not hash it again. A corrupt copy is deleted from its tier
  and counted, and the walk continues, since a lower tier may hold a good copy. A tier that
  raises anything is treated as empty for that call and counted. Each get has a deadline (a
  `time.monotonic()` instant, default `StoreConfig.get_deadline_s` from now); past it the get is
  a miss. A hit below the first tier schedules a promotion: a background job that copies the
  block up into the tiers above it (in the background because it needs the whole frame and a
  copy, and a get must not pay for either). `get_many` walks tier by tier with the keys no
  tier above had; a tier that reads batches (`SupportsBatchedGet`) gets a batch of whole-block
  reads in one call (one batched stream per remote node, not a round trip per block).
- reads before writes: background writers wait while reads are in flight on the tier they are
  about to write to, for at most `read_priority_max_wait_s` per batch so they cannot starve.
- lookup: the longest contiguous prefix of keys held by any tier, one batched `contains` per
  tier.
- session records (a KV manifest or a conversation record, kvstore/manifest.py, alike here):
  written to every tier (the first synchronously, the rest behind; a record may wait up to
  `manifest_enqueue_timeout_s` for queue room because failover depends on it); reads ask every
  tier and return the highest generation, repairing upper tiers that lacked it. A typed read
  (`get_manifest`) refuses the other kind with CorruptBlock.
- accounting: Prometheus only (`kvstore.metrics`); `stats()` is a view of the same counters.

Tiers must honour the deadline they are given: a synchronous call cannot be abandoned safely
(an abandoned read would still write into the caller's buffer later).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

from kvstore.errors import ConfigError, CorruptBlock, InvalidFrame, TierFull, TierUnavailable
from kvstore.frame import (
    BlockRead,
    FrameBytes,
    FrameHeader,
    LayerRange,
    checked_frame,
    verify_pieces,
)
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionManifest, SessionRecord, expect_kind
from kvstore.metrics import StoreMetrics
from kvstore.store.config import StoreConfig
from kvstore.store.replicated import ReplicatedPuts
from kvstore.store.stats import StoreStats
from kvstore.store.tier_calls import DEADLINE_PASSED, DeadlinePassed, TierCalls
from kvstore.store.write_behind import WriteBehind
from kvstore.tiers.base import Buffer, Tier, TierStats
from kvstore.tiers.capabilities import (
    BorrowedBlock,
    IndexedInProcess,
    PageReservation,
    SupportsBatchedGet,
    SupportsBorrow,
    SupportsReserve,
)
from kvstore.tiers.factory import TierSpec, build_tiers

__all__ = ["TieredStore", "PullUp"]

log = logging.getLogger("kvstore.store")

# Lent blocks whose last check `check_borrowed` remembers (about 6 MiB): past it, the oldest
# are forgotten, which only costs them an earlier check.
_LENT_CHECKS_KEPT = 1 << 16


@dataclass(slots=True)
class PullUp:
    """What `TieredStore.pull_up` did with its keys: already in the first tier, copied up,
    found nowhere (or unreadable in time), or refused by a tier above (full)."""

    present: int = 0
    pulled: int = 0
    missing: int = 0
    refused: int = 0


class TieredStore:
    """Ordered tiers behind one verified get/put/lookup API; thread-safe. For asyncio callers,
    `AsyncTieredStore` wraps one."""

    def __init__(self, tiers: Sequence[Tier], *, config: StoreConfig | None = None,
                 metrics: StoreMetrics | None = None, close_tiers: bool = True) -> None:
        if not tiers:
            raise ConfigError("a TieredStore needs at least one tier")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique (they label metrics): {names}")
        self._config = config or StoreConfig()
        self._calls = TierCalls(tiers, metrics or StoreMetrics())
        self._close_tiers = close_tiers
        # Asked per tier on every inline lookup (vLLM's scheduler loop): decided once, since
        # the tiers never change (a runtime Protocol check is an attribute probe per call).
        self._in_process = tuple(_in_process(tier) for tier in tiers)
        first = tiers[0]
        self._lender: SupportsBorrow | None = first if isinstance(first, SupportsBorrow) else None
        self._batched = tuple(isinstance(tier, SupportsBatchedGet) for tier in tiers)
        self._writes = WriteBehind(self._calls, self._config)
        self._replicated = ReplicatedPuts(self._calls, self._writes)
        # Key digest -> when its lent copy last passed `check_borrowed`, oldest first.
        self._lent_checked: OrderedDict[bytes, float] = OrderedDict()
        self._lent_lock = threading.Lock()

    @classmethod
    def from_specs(cls, specs: Sequence[TierSpec], *, config: StoreConfig | None = None,
                   metrics: StoreMetrics | None = None) -> TieredStore:
        """Build the tiers from specs (skipping optional ones this machine lacks, e.g. hbm)."""
        return cls(build_tiers(specs), config=config, metrics=metrics)

    # -- properties ---------------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return self._calls.tiers

    @property
    def config(self) -> StoreConfig:
        return self._config

    @property
    def metrics(self) -> StoreMetrics:
        return self._calls.metrics

    @property
    def pending_writes(self) -> int:
        return self._writes.pending

    def wait_pending_writes(self, at_most: int, timeout: float) -> bool:
        """Wait until at most `at_most` background writes are pending; False on timeout."""
        return self._writes.wait_pending(at_most, timeout)

    def when_pending_writes_at_most(self, at_most: int, wake: Callable[[], None]
                                    ) -> Callable[[], None]:
        """`wait_pending_writes` for a waiter that cannot block (an event loop): `wake` is
        called once, maybe on a writer thread, when at most `at_most` background writes are
        pending. Returns what cancels the call."""
        return self._writes.when_pending_at_most(at_most, wake)

    @property
    def answers_in_process(self) -> bool:
        """Every tier's `contains` is an in-process index read (`IndexedInProcess`): a lookup
        never waits on I/O or the network."""
        return all(self._in_process)

    # -- blocks -------------------------------------------------------------------------------

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        """The block (or segments of `layers`) from the first tier that has a good copy,
        verified and marked so (`BlockRead.verified`).

        With `out`, the payload is copied into it and the result's payload is a view of it.
        Returns None on a miss, including a deadline passed, corrupt copies, failing tiers.
        """
        return self.get_many([key], layers, outs=None if out is None else [out],
                             deadline=deadline)[0]

    def get_many(self, keys: Sequence[BlockKey], layers: LayerRange | None = None, *,
                 outs: Sequence[Buffer] | None = None, deadline: float | None = None
                 ) -> list[BlockRead | None]:
        """`get` for each key under one shared deadline; `outs`, if given, one buffer per key.

        Tier by tier: each tier is asked for the keys no tier above it had, and a tier that
        reads batches (`SupportsBatchedGet`: the remote daemons, one batched stream per node)
        gets them in one call when whole blocks are wanted, instead of one round trip per
        block. The results are what `get` per key gives: verified, promoted, counted."""
        if outs is not None and len(outs) != len(keys):
            raise ConfigError(f"get_many: {len(keys)} keys but {len(outs)} output buffers")
        self._check_open()
        self._calls.foreground()
        deadline = self.deadline(deadline)
        reads: list[BlockRead | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        for index in range(len(self._calls)):
            if not pending:
                break
            if time.monotonic() >= deadline:
                self.metrics.deadline_misses.inc()
                break
            found = self._read_tier(index, keys, layers, outs, pending, deadline)
            if found is DEADLINE_PASSED:
                break
            for i, read in zip(pending, found, strict=True):
                if read is not None:
                    if index > 0 and self._config.promote:
                        self._writes.promote(keys[i], index, read.header,
                                             self._held_copy(index, read))
                    reads[i] = read
            pending = [i for i in pending if reads[i] is None]
        if pending:
            self.metrics.misses.inc(len(pending))
        return reads

    @property
    def in_process(self) -> tuple[bool, ...]:
        """Per tier (in `tiers` order): whether it answers from this process (host RAM, the
        nvme index) rather than across the network (daemons, Redis)."""
        return self._in_process

    def _held_copy(self, index: int, read: BlockRead) -> bytes | None:
        """The whole frame of a block read from a network tier, for its promotion: one copy in
        RAM (about 50 us for 0.5 MiB) instead of a second read of the block from the daemon
        or Redis when the write-behind gets to it. None for in-process tiers (reading the
        block back there costs what the copy would) and for layer-range reads (not a frame)."""
        if self._in_process[index] or read.layers != read.header.all_layers:
            return None
        return read.header.pack() + bytes(read.payload)

    def pull_up(self, keys: Sequence[BlockKey], *, deadline: float | None = None) -> PullUp:
        """Copy each block from the first tier that holds it into every tier above that one,
        now (a prefetch: connectors/vllm/prefetch.py). Whole blocks, verified as any read, in
        one batched read per tier, each written up from the bytes just read: unlike a `get`'s
        promotion, which the write-behind does later by reading the block again."""
        self._check_open()
        deadline = self.deadline(deadline)
        where = self.locate(keys, deadline=deadline)
        result = PullUp(present=where.count(0), missing=where.count(-1))
        for index in range(1, len(self._calls)):
            positions = [i for i, tier in enumerate(where) if tier == index]
            if not positions:
                continue
            found = self._read_tier(index, keys, None, None, positions, deadline)
            if found is DEADLINE_PASSED:
                self.metrics.deadline_misses.inc()
                result.missing += len(positions)
                continue
            for i, read in zip(positions, found, strict=True):
                if read is None:
                    result.missing += 1
                    continue
                frame = read.header.pack() + bytes(read.payload)
                written = [self._calls.put(target, keys[i], frame) for target in range(index)]
                for target, ok in enumerate(written):
                    if ok:
                        self.metrics.promotions.labels(self._calls.names[target]).inc()
                if all(written):
                    result.pulled += 1
                else:
                    result.refused += 1
        return result

    def _read_tier(self, index: int, keys: Sequence[BlockKey], layers: LayerRange | None,
                   outs: Sequence[Buffer] | None, pending: Sequence[int], deadline: float
                   ) -> list[BlockRead | None] | Literal[DeadlinePassed.DEADLINE]:
        """Tier `index`'s verified reads of `keys[i]` for i in `pending` (in that order)."""
        if layers is None and self._batched[index] and len(pending) > 1:
            return self._calls.read_many(index, [keys[i] for i in pending],
                                         [None if outs is None else outs[i] for i in pending],
                                         deadline)
        found: list[BlockRead | None] = []
        for i in pending:
            outcome = self._calls.read(index, keys[i], layers,
                                       None if outs is None else outs[i], deadline)
            if outcome is DEADLINE_PASSED:
                return DEADLINE_PASSED
            found.append(outcome)
        return found

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
        self._calls.foreground()
        tier = self._lender
        if tier is None:
            return None
        started = time.monotonic()
        try:
            block = tier.borrow(key, layers)
        except Exception:  # a bad layer range, a closed tier: `get` says what it is
            return None
        finally:
            self._calls.observe(0, "get", started)
        if block is None:
            return None
        try:
            if block.header.key_digest != key.digest:
                raise CorruptBlock("frame is bound to a different key")
            if verify:
                verify_pieces(block.header, block.layers, block.pieces)
        except CorruptBlock:
            block.release()
            self._calls.discard(0, key)
            return None
        except BaseException:
            block.release()
            raise
        self._calls.hit(0, block.size)
        return block

    def check_borrowed(self, key: BlockKey, block: BorrowedBlock) -> bool:
        """Verify a block lent with `verify=False` (before releasing it), unless the whole
        block passed within `lent_recheck_s` (StoreConfig), here or when it was received
        (`commit_put`). A copy that fails is deleted from the first tier, as `get` would, so
        the next read finds a good copy below or misses; False then.

        Why not every time: hashing each block after each send cost a daemon 43 % of its
        connection thread's time serving 4 MiB GETs from RAM (py-spy), once per read of a hot
        block rather than once per block."""
        now = time.monotonic()
        recheck = self._config.lent_recheck_s
        checked = self._lent_checked.get(key.digest)
        if recheck and checked is not None and now - checked < recheck:
            return True
        try:
            verify_pieces(block.header, block.layers, block.pieces)
        except CorruptBlock:
            with self._lent_lock:
                self._lent_checked.pop(key.digest, None)
            self._calls.discard(0, key)
            return False
        if block.layers == block.header.all_layers:  # a range checked its own segments only
            self._checked_whole(key.digest, now)
        return True

    def _checked_whole(self, digest: bytes, at: float) -> None:
        """Remember that the first tier's copy of a block passed its checksums at `at`."""
        if not self._config.lent_recheck_s:
            return
        with self._lent_lock:
            self._lent_checked[digest] = at
            self._lent_checked.move_to_end(digest)
            while len(self._lent_checked) > _LENT_CHECKS_KEPT:
                self._lent_checked.popitem(last=False)

    def put(self, key: BlockKey, frame: FrameBytes, *, computed_at: float | None = None
            ) -> bool:
        """Store a frame: synchronously in the first tier, in the background below it.

        Returns True if the first tier admitted it or a background write was queued. Raises
        InvalidFrame if the frame does not parse, has the wrong size or is bound to another key.
        The caller may reuse `frame`'s buffer as soon as this returns. `computed_at`
        (`time.monotonic()`, default now) is when the block was computed: each tier's copy is
        timed from it (`copy_lag_seconds`).
        """
        self._check_open()
        self._calls.foreground()
        born = time.monotonic() if computed_at is None else computed_at
        view, header = checked_frame(frame, key.digest)
        admitted = self._calls.put(0, key, view)
        if admitted:
            self._calls.copied(0, born)
        if len(self._calls) == 1:
            return admitted
        # Admitted: the writer reads it back from tier 0 later. Not admitted: keep an immutable
        # copy (no copy at all when the caller passed bytes).
        held = None if admitted else frame if isinstance(frame, bytes) else bytes(view)
        queued = self._writes.copy_down(key, header, held, computed_at=born)
        return admitted or queued

    @property
    def max_replicated_copies(self) -> int:
        """The most copies `put_replicated` may ask for; 0: no tier keeps copies on other
        nodes (no remote tier)."""
        return self._replicated.max_copies

    def put_replicated(self, items: Sequence[tuple[BlockKey, FrameBytes]], *, copies: int,
                       deadline: float, computed_at: float | None = None) -> list[bool]:
        """`put` for each frame, returning once `copies` distinct nodes of every tier that
        replicates (`SupportsReplicas`) acknowledged it or `deadline` passed: True per block
        acknowledged in time. Lower tiers that do not replicate, and a replicated one that did
        not acknowledge, get their copy behind as with `put` (see `kvstore.store.replicated`).
        ConfigError when `copies` exceeds `max_replicated_copies`."""
        self._check_open()
        return self._replicated.put(items, copies=copies, deadline=deadline,
                                    computed_at=computed_at)

    def replicated_prefix(self, keys: Sequence[BlockKey], *, copies: int,
                          deadline: float | None = None) -> int:
        """How many of `keys`, from the first on, `copies` nodes of every replicating tier
        hold now (0 without such a tier): `lookup` for durable saves."""
        self._check_open()
        return self._replicated.prefix(keys, copies=copies, deadline=self.deadline(deadline))

    def put_many(self, items: Sequence[tuple[BlockKey, FrameBytes]]) -> list[bool]:
        return [self.put(key, frame) for key, frame in items]

    def begin_put(self, key: BlockKey, size: int, *, evict: bool = True
                  ) -> PageReservation | None:
        """Pages of the first tier for a `size`-byte frame, to receive it into in place; then
        `commit_put` (or the reservation's `abort()`). None when the first tier cannot
        (it already holds the block, has no room, or its pages are not host memory): use
        `put`, which handles each of those cases. evict=False: free pages only (see
        `SupportsReserve`)."""
        self._check_open()
        self._calls.foreground()
        tier = self.tiers[0]
        if not isinstance(tier, SupportsReserve):
            return None
        try:
            return tier.reserve(key, size, evict=evict)
        except Exception:
            self._calls.failed(0, "put")
            return None

    def commit_put(self, reservation: PageReservation, header: FrameHeader) -> bool:
        """Publish a frame received into `begin_put`'s pages, and queue its write-behind to the
        tiers below, like `put`. The caller has checked the frame (`header` parsed from its
        first bytes, and its segments against their checksums); this checks the header's size
        and key binding again and raises InvalidFrame (aborting the reservation) on mismatch.
        That check counts as `check_borrowed`'s for the next `lent_recheck_s`."""
        key = reservation.key
        if header.frame_size != reservation.size or header.key_digest != key.digest:
            reservation.abort()
            raise InvalidFrame("frame header disagrees with its size or key")
        started = time.monotonic()
        try:
            admitted = reservation.commit(header)
        except Exception:
            reservation.abort()
            self._calls.failed(0, "put")
            admitted = False
        finally:
            self._calls.observe(0, "put", started)
        self._calls.count_put(0, admitted, reservation.size)
        if admitted:
            # The caller verified these very pages a moment ago: the first sends of the block
            # need not hash it again (check_borrowed; 4 MiB: ~0.35 ms of a daemon's GET).
            self._checked_whole(key.digest, started)
        if len(self._calls) == 1 or not admitted:
            return admitted
        self._calls.copied(0, started)
        # Read back from tier 0, as for any put. A copy the write-behind dropped (its queue
        # full, by jobs or bytes) leaves the block in RAM only, to be lost when it is evicted:
        # the caller acknowledges durability, so it must not acknowledge this one (M3).
        if not self._writes.copy_down(key, header, None, computed_at=started):
            raise TierFull(f"write-behind queue full: {key.storage_name} would stay in RAM "
                           "only")
        return True

    def lookup(self, keys: Sequence[BlockKey], *, deadline: float | None = None,
               in_process_only: bool = False) -> int:
        """How many of `keys`, from the first on, are held by some tier (prefix length).
        `in_process_only`: ask only the tiers that answer from memory (`IndexedInProcess`)."""
        found = self.holds(keys, deadline=deadline, in_process_only=in_process_only)
        return next((i for i, hit in enumerate(found) if not hit), len(found))

    def holds(self, keys: Sequence[BlockKey], *, deadline: float | None = None,
              in_process_only: bool = False) -> list[bool]:
        """Which of `keys` some tier holds: one batched `contains` per tier, each asked only
        for what the tiers above it lacked; a failing tier, or one reached past `deadline`,
        counts as holding nothing."""
        return [index >= 0 for index in self.locate(keys, deadline=deadline,
                                                    in_process_only=in_process_only)]

    def locate(self, keys: Sequence[BlockKey], *, deadline: float | None = None,
               in_process_only: bool = False) -> list[int]:
        """`holds`, saying where: per key the index (in `tiers`) of the first tier that holds
        it, the one a `get` reads it from, or -1 (what a restore-or-recompute decision
        prices)."""
        self._check_open()
        self._calls.foreground()
        deadline = self.deadline(deadline)
        found = [-1] * len(keys)
        for index, tier in enumerate(self.tiers):
            if in_process_only and not self._in_process[index]:
                continue
            ask = [i for i, hit in enumerate(found) if hit < 0]
            if not ask:
                break
            if time.monotonic() >= deadline:
                self.metrics.deadline_misses.inc()
                break
            started = time.monotonic()
            try:
                flags = tier.contains([keys[i] for i in ask])
                if len(flags) != len(ask):
                    raise TierUnavailable(f"{tier.name}: contains answered {len(flags)} of "
                                          f"{len(ask)} keys")
            except Exception:
                self._calls.failed(index, "contains")
                continue
            finally:
                self._calls.observe(index, "contains", started)
            for i, hit in zip(ask, flags, strict=True):
                if hit:
                    found[i] = index
        return found

    def delete(self, keys: Sequence[BlockKey], *, reject: bool = False) -> int:
        """Remove blocks from every tier (and cancel their queued writes); how many were held.
        `reject`: the caller refused the copies it read (forged, not its engine's): a tier
        with replicas elsewhere (`reject`, kvstore/tiers/remote/tier.py) drops only the copy it
        served, never the good ones on other nodes (trust review L2).

        A write-behind already writing one of the keys when the delete came sees the delete
        and undoes its write, but only once its batch is written; this waits for that (one
        batch at most, bounded by `background_deadline_s`), so that when delete returns the
        blocks are gone from every tier rather than briefly back in a lower one.
        """
        self._check_open()
        self._writes.cancel(keys)
        held = [False] * len(keys)
        for index, tier in enumerate(self.tiers):
            try:
                flags = tier.contains(keys)
                refuse = getattr(tier, "reject", None) if reject else None
                if callable(refuse):
                    refuse(keys)
                else:
                    tier.delete(keys)
            except Exception:
                self._calls.failed(index, "delete")
                continue
            held = [a or bool(b) for a, b in zip(held, flags, strict=False)]
        if not self._writes.wait_unwritten(keys):
            log.warning("delete: a write-behind of a deleted block is still running")
        return sum(held)

    # -- session records: KV manifests and conversation records -------------------------------

    def put_manifest(self, record: SessionRecord) -> None:
        """Store a session's record in every tier (no tier keeps it if it holds a newer
        generation, of either kind)."""
        self._check_open()
        self._calls.attempt(0, "put_manifest", lambda t: t.put_manifest(record))
        if len(self._calls) > 1:
            self._writes.copy_manifest(record)

    def get_manifest(self, key: SessionKey, *, deadline: float | None = None
                     ) -> SessionManifest | None:
        """The KV session manifest under `key` (`get_record`), or None; CorruptBlock if the
        key holds a conversation record."""
        return expect_kind(self.get_record(key, deadline=deadline), SessionManifest)

    def get_record(self, key: SessionKey, *, deadline: float | None = None
                   ) -> SessionRecord | None:
        """The highest generation of the session's record found in any tier, whatever its
        kind, or None (the daemons serve either; a writer must outrank either)."""
        self._check_open()
        deadline = self.deadline(deadline)
        found: list[SessionRecord | None] = []
        for index, tier in enumerate(self.tiers):
            if time.monotonic() >= deadline:
                self.metrics.deadline_misses.inc()
                break
            record = None
            try:
                record = tier.get_manifest(key)
                if record is not None and record.key != key:
                    raise CorruptBlock("session record bound to another session")
            except CorruptBlock:
                record = None
                self._calls.corrupt(index, "manifest")
                self._calls.attempt(index, "delete_manifest", lambda t: t.delete_manifest(key))
            except Exception:
                record = None
                self._calls.failed(index, "get_manifest")
            found.append(record)
        best_index = max((i for i, m in enumerate(found) if m is not None),
                         key=lambda i: (_generation(found[i]), -i), default=None)
        if best_index is None:
            return None
        best = found[best_index]
        assert best is not None
        for index in range(best_index):  # records are small: repair upper tiers right away
            if _generation(found[index]) < best.generation:
                self._calls.attempt(index, "put_manifest", lambda t: t.put_manifest(best))
        return best

    def delete_manifest(self, key: SessionKey) -> bool:
        self._check_open()
        self._writes.cancel([key])
        removed = False
        for index, tier in enumerate(self.tiers):
            try:
                removed = tier.delete_manifest(key) or removed
            except Exception:
                self._calls.failed(index, "delete_manifest")
        return removed

    # -- lifecycle ----------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued background write is done; False if `timeout` ran out."""
        return self._writes.flush(timeout)

    def stats(self) -> StoreStats:
        """The tiers' own stats and the store's counters (read off its Prometheus metrics)."""
        tier_stats = []
        for index, tier in enumerate(self.tiers):
            try:
                tier_stats.append(tier.stats())
            except Exception:
                self._calls.failed(index, "stats")
                tier_stats.append(TierStats(tier.name, 0, 0, 0))
        return StoreStats.of(self.metrics, tuple(tier_stats), self._writes.pending)

    def close(self, timeout: float = 5.0) -> None:
        """Flush (up to `timeout`), stop the writers, drop what is left, close the tiers."""
        if self._writes.closed:
            return
        self._writes.close(timeout)
        if self._close_tiers:
            for index in range(len(self._calls)):
                self._calls.attempt(index, "close", lambda t: t.close())

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def deadline(self, deadline: float | None) -> float:
        """`deadline`, or the default one (`get_deadline_s`) from now."""
        return deadline if deadline is not None else (
            time.monotonic() + self._config.get_deadline_s)

    def _check_open(self) -> None:
        if self._writes.closed:
            raise TierUnavailable("the store is closed")


def _generation(record: SessionRecord | None) -> int:
    return -1 if record is None else record.generation


def _in_process(tier: Tier) -> bool:
    return isinstance(tier, IndexedInProcess) and tier.indexed_in_process
