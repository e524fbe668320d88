"""`MemoryTier`, what the memory tiers (host RAM, device HBM) share: an LRU index of blocks held
in pages, with pinning, lending (`borrow`) and receiving in place (`reserve`).

A block's frame is copied into pages from a `SlabPool`; the parsed `FrameHeader` is kept beside
it, so a layer-range read copies only the bytes of the segments asked for. Subclasses supply
the storage (an arena type) and the two copies (into pages, out of pages).

Concurrency: one lock guards the index, the pool and the counters, and is held only for
bookkeeping, never while bytes move. A reader pins the block (a pin count) before it copies
outside the lock; eviction skips pinned blocks, and a block deleted while pinned gives its pages
back only when the last pin goes. The store's write-behind pins a put the same way (`hold`)
until its copy to the tiers below is made, so that no acknowledged block is evicted before it
is on disk. A writer reserves pages, copies into them outside the lock and
publishes the block only when the copy is complete, so no reader ever sees a partial block. A
put of a key that is already present is a no-op (frames are content-addressed by their key), so
a block is never overwritten under a reader.

Eviction is LRU. ARC would resist one-off scans better, but the store's access pattern (a
session's prefix read back in order, soon after it was written) is LRU-friendly and LRU keeps
pinning simple; the policy lives in `_reserve` should that change.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvstore.errors import DeadlineExceeded, TierError, TierUnavailable
from kvstore.frame import BlockRead, FrameBytes, FrameHeader, LayerRange, checked_frame
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionManifest, SessionRecord
from kvstore.tiers.base import Buffer, TierStats, byte_view
from kvstore.tiers.capabilities import BorrowedBlock, PageReservation
from kvstore.tiers.memory.slabs import DEFAULT_ARENA_BYTES, DEFAULT_PAGE_BYTES, SlabPool

__all__ = ["MemoryTier"]

A = TypeVar("A")


@dataclass(slots=True, eq=False)
class _Entry:
    """One stored block; mutable and private to the tier (pins change under the lock)."""

    pages: list[int]
    size: int
    header: FrameHeader
    pins: int = 0
    dead: bool = False  # deleted while pinned: pages go back when the last pin is released


class MemoryTier(ABC, Generic[A]):
    """A byte-budgeted LRU tier over pages of arenas of type `A` (see the module docstring)."""

    def __init__(self, name: str, byte_budget: int, *, page_bytes: int = DEFAULT_PAGE_BYTES,
                 arena_bytes: int = DEFAULT_ARENA_BYTES,
                 manifest_budget: int | None = None) -> None:
        """`manifest_budget`: bytes of (estimated) memory session manifests may take beside
        the blocks, least recently used evicted first; default 1/16 of `byte_budget`, at least
        1 MiB. Without a bound a long-running daemon would grow by every session it saw."""
        self._name = name
        self._pool: SlabPool[A] = SlabPool(byte_budget, self._new_arena, page_bytes=page_bytes,
                                           arena_bytes=arena_bytes)
        self._lock = threading.Lock()
        # By key digest (bytes: hashed and compared in C; equal digests are equal keys, as in the
        # nvme tier's index), LRU first, MRU last.
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self._manifests: OrderedDict[SessionKey, tuple[SessionRecord, int]] = OrderedDict()
        self._manifest_bytes = 0
        self._manifest_budget = (manifest_budget if manifest_budget is not None
                                 else max(1 << 20, byte_budget // 16))
        self.manifest_evictions = 0
        self._free_target = 0  # pages kept free after each stored block (keep_free)
        self._closed = False
        self._hits = 0
        self._misses = 0
        self._puts = 0
        self._rejected = 0
        self._evictions = 0

    # -- the Tier protocol --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def indexed_in_process(self) -> bool:
        return True  # `contains` reads `_index` (see IndexedInProcess)

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            self._check_open()
            index = self._index
            touch = index.move_to_end
            found = []
            for key in keys:
                digest = key.digest
                hit = digest in index
                if hit:
                    # A lookup usually precedes a load: keep what was just asked for from being
                    # the next victim.
                    touch(digest)
                found.append(hit)
            return found

    def hold(self, key: BlockKey) -> Callable[[], None] | None:
        """Pin the block until the returned release is called (`SupportsHold`): eviction skips
        it meanwhile; None when this tier does not hold it."""
        with self._lock:
            if self._closed:
                return None
            entry = self._index.get(key.digest)
            if entry is None:
                return None
            entry.pins += 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._unpin(entry)

        return release

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        if deadline is not None and time.monotonic() >= deadline:
            raise DeadlineExceeded(f"{self._name}: deadline passed before the read")
        with self._lock:
            self._check_open()
            entry = self._index.get(key.digest)
            if entry is None:
                self._misses += 1
                return None
            self._index.move_to_end(key.digest)
            entry.pins += 1
            self._hits += 1
        try:
            want = layers if layers is not None else entry.header.all_layers
            start, stop = entry.header.span(want)
            if out is None:
                return BlockRead(entry.header, want, self._read_bytes(entry.pages, start, stop))
            dst = byte_view(out, writable=True)
            if len(dst) < stop - start:
                raise TierError(f"{self._name}: output buffer holds {len(dst)} bytes, the read "
                                f"needs {stop - start}")
            dst = dst[: stop - start]
            self._read_into(entry.pages, start, stop, dst)
            return BlockRead(entry.header, want, dst)
        finally:
            with self._lock:
                self._unpin(entry)

    def borrow(self, key: BlockKey, layers: LayerRange | None = None) -> BorrowedBlock | None:
        """Pin a block and lend views of the bytes of `layers` in its pages (no copy); None on a
        miss or when this tier's pages are not host memory. Raises ValueError for a layer range
        beyond the block. The caller verifies the bytes and must `release()` the result."""
        with self._lock:
            self._check_open()
            entry = self._index.get(key.digest)
            if entry is None:
                self._misses += 1
                return None
            want = layers if layers is not None else entry.header.all_layers
            start, stop = entry.header.span(want)  # ValueError: before anything is pinned
            pieces = self._page_pieces(entry.pages, start, stop)
            if pieces is None:
                return None
            pieces = [piece.toreadonly() for piece in pieces]  # lent to read, never to write
            self._index.move_to_end(key.digest)
            entry.pins += 1
            self._hits += 1

        def release() -> None:
            with self._lock:
                self._unpin(entry)

        return BorrowedBlock(entry.header, want, pieces, release)

    def reserve(self, key: BlockKey, size: int, *, evict: bool = True
                ) -> PageReservation | None:
        """Pages for a `size`-byte frame of `key`, to be filled in place (e.g. straight from a
        socket) and then committed: a put without the copy out of a receive buffer. None when
        the block is already present, the budget cannot take it (evicting as `put` would), or
        the pages are not host memory; `put` then does what it does in those cases.

        evict=False takes only free pages: a frame that is declared but has not arrived (and
        may never) then evicts nothing; `keep_free` keeps free pages there for it."""
        if size <= 0:
            return None
        npages = self._pool.pages_for(size)
        with self._lock:
            self._check_open()
            if key.digest in self._index:
                return None
            pages = self._reserve(npages) if evict else self._pool.allocate(npages)
            if pages is None:
                return None
            pieces = self._page_pieces(pages, 0, size)
            if pieces is None:
                self._free_pages(pages)
                return None
        return PageReservation(
            key, size, pieces,
            publish=lambda header: self._publish_reserved(key, pages, size, header),
            abort=lambda: self._release_reserved(pages))

    def _publish_reserved(self, key: BlockKey, pages: list[int], size: int,
                          header: FrameHeader) -> bool:
        with self._lock:
            if self._closed:
                return False
            if key.digest in self._index:  # a concurrent put of the same key published first
                self._free_pages(pages)
                return True
            self._index[key.digest] = _Entry(pages, size, header)
            self._puts += 1
            self._evict_to_free_target()
            return True

    def _release_reserved(self, pages: list[int]) -> None:
        with self._lock:
            self._free_pages(pages)

    def put(self, key: BlockKey, frame: FrameBytes) -> bool:
        # The header is checked here; the segments by the store, on every read of them.
        src, header = checked_frame(frame, key.digest)
        npages = self._pool.pages_for(len(src))
        with self._lock:
            self._check_open()
            if key.digest in self._index:
                self._index.move_to_end(key.digest)
                return True
            pages = self._reserve(npages)
            if pages is None:
                self._rejected += 1
                return False
        try:
            self._write_pages(pages, src)
        except BaseException:
            with self._lock:
                self._free_pages(pages)
            raise
        with self._lock:
            if self._closed:
                return False
            if key.digest in self._index:  # a concurrent put of the same key published first
                self._free_pages(pages)
                return True
            self._index[key.digest] = _Entry(pages, len(src), header)
            self._puts += 1
            self._evict_to_free_target()
            return True

    def keep_free(self, nbytes: int) -> None:
        """After each block stored, evict least recently used blocks until `nbytes` of pages
        are free (capped at a quarter of the budget): room that `reserve(evict=False)` can
        hand out to frames before they arrive. Eviction is thus paid for by bytes that did
        arrive, never by a declaration."""
        with self._lock:
            self._free_target = min(self._pool.pages_for(nbytes) if nbytes > 0 else 0,
                                    self._pool.capacity_pages // 4)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        removed = 0
        with self._lock:
            self._check_open()
            for key in keys:
                entry = self._index.pop(key.digest, None)
                if entry is None:
                    continue
                removed += 1
                if entry.pins:
                    entry.dead = True
                else:
                    self._free_pages(entry.pages)
        return removed

    def put_manifest(self, record: SessionRecord) -> None:
        with self._lock:
            self._check_open()
            current = self._manifests.get(record.key)
            # Equal generations are a rewrite by the same writer; only a newer one may win.
            if current is not None and current[0].generation > record.generation:
                return
            cost = _record_cost(record)
            self._manifest_bytes += cost - (current[1] if current is not None else 0)
            self._manifests[record.key] = (record, cost)
            self._manifests.move_to_end(record.key)
            while self._manifest_bytes > self._manifest_budget and len(self._manifests) > 1:
                _, (_, freed) = self._manifests.popitem(last=False)
                self._manifest_bytes -= freed
                self.manifest_evictions += 1

    def get_manifest(self, key: SessionKey) -> SessionRecord | None:
        with self._lock:
            self._check_open()
            found = self._manifests.get(key)
            if found is None:
                return None
            self._manifests.move_to_end(key)
            return found[0]

    def delete_manifest(self, key: SessionKey) -> bool:
        with self._lock:
            self._check_open()
            found = self._manifests.pop(key, None)
            if found is None:
                return False
            self._manifest_bytes -= found[1]
            return True

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(
                name=self._name,
                blocks=len(self._index),
                bytes_used=self._pool.pages_in_use * self._pool.page_bytes,
                bytes_budget=self._pool.capacity_pages * self._pool.page_bytes,
                hits=self._hits,
                misses=self._misses,
                puts=self._puts,
                rejected_puts=self._rejected,
                evictions=self._evictions,
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.clear()
            self._manifests.clear()
            self._manifest_bytes = 0
            # Readers still copying hold their own references to the arenas they read.
            self._pool.release()

    # -- state beyond the protocol (tests, benchmarks, metrics) -------------------------------

    @property
    def evictions(self) -> int:
        return self._evictions

    @property
    def allocated_bytes(self) -> int:
        """Arena bytes allocated so far; stays flat once the tier is warm."""
        with self._lock:
            return self._pool.allocated_bytes

    @property
    def arena_allocations(self) -> int:
        with self._lock:
            return self._pool.arena_allocations

    @property
    def pinned_blocks(self) -> int:
        with self._lock:
            return sum(1 for entry in self._index.values() if entry.pins)

    @property
    def page_bytes(self) -> int:
        return self._pool.page_bytes

    # -- storage hooks ------------------------------------------------------------------------

    @abstractmethod
    def _new_arena(self, nbytes: int) -> A:
        """Allocate one arena (called under the lock, rarely)."""

    @abstractmethod
    def _write_pages(self, pages: Sequence[int], src: memoryview) -> None:
        """Copy `src` into `pages` in order, page_bytes per page (the last one partly)."""

    @abstractmethod
    def _read_into(self, pages: Sequence[int], start: int, stop: int, dst: memoryview) -> None:
        """Copy frame bytes [start, stop) of a block stored in `pages` into `dst`."""

    @abstractmethod
    def _read_bytes(self, pages: Sequence[int], start: int, stop: int) -> bytes:
        """Frame bytes [start, stop) of a block stored in `pages`, as a fresh bytes object."""

    def _page_pieces(self, pages: Sequence[int], start: int, stop: int
                     ) -> list[memoryview] | None:
        """Views of frame bytes [start, stop) in place, or None if pages are not host memory."""
        return None

    def _page_runs(self, pages: Sequence[int], start: int, stop: int
                   ) -> list[tuple[int, int, int]]:
        """(page, offset in page, length) pieces covering frame bytes [start, stop)."""
        page_bytes = self._pool.page_bytes
        runs = []
        pos = start
        while pos < stop:
            index, offset = divmod(pos, page_bytes)
            length = min(page_bytes - offset, stop - pos)
            runs.append((pages[index], offset, length))
            pos += length
        return runs

    def _locate(self, page: int) -> tuple[A, int]:
        return self._pool.locate(page)

    # -- helpers (callers hold the lock) ------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"{self._name} tier is closed")

    def _reserve(self, npages: int) -> list[int] | None:
        if npages > self._pool.capacity_pages:
            return None
        while True:
            pages = self._pool.allocate(npages)
            if pages is not None:
                return pages
            victim = next((k for k, e in self._index.items() if e.pins == 0), None)
            if victim is None:  # everything left is pinned or being written
                return None
            self._free_pages(self._index.pop(victim).pages)
            self._evictions += 1

    def _evict_to_free_target(self) -> None:
        while self._pool.available_pages() < self._free_target:
            victim = next((k for k, e in self._index.items() if e.pins == 0), None)
            if victim is None:
                return
            self._free_pages(self._index.pop(victim).pages)
            self._evictions += 1

    def _unpin(self, entry: _Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.dead:
            self._free_pages(entry.pages)

    def _free_pages(self, pages: list[int]) -> None:
        if not self._closed:  # after close the pool was released wholesale
            self._pool.free(pages)


def _record_cost(record: SessionRecord) -> int:
    """Roughly the Python memory a session's record holds: a 32-byte `bytes` per block hash
    (~72 B with its object and pointer; conversation records have none), an int per token id
    (~36 B), and the object itself."""
    blocks = len(record.block_hashes) if isinstance(record, SessionManifest) else 0
    return 256 + 72 * blocks + 36 * len(record.token_ids)
