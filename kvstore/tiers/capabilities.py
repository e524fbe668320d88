"""What some tiers can do beyond the `Tier` protocol, as protocols the store checks at runtime.

The store asks `isinstance(tier, SupportsX)` and takes the cheaper path where a tier offers it,
so it never needs to know a concrete tier class:

- `SupportsPutMany`: store a batch as one (the nvme tier syncs it once);
- `SupportsBorrow`: lend a block's bytes in place, pinned, to send from (`BorrowedBlock`);
- `SupportsReserve`: set pages aside to receive a frame into (`PageReservation`);
- `SupportsBatchedGet`: read whole blocks of a batch in one pipelined stream per node (the
  remote tier's daemons), not one round trip per block;
- `SupportsReplicas`: keep each block on several nodes and say how many acknowledged it (the
  remote tier's daemons), for puts that must be durable before they return;
- `IndexedInProcess`: `contains` is a read of an index in this process's memory (no I/O, no
  network), so vLLM's scheduler loop may ask it inline (the memory and nvme tiers).

The memory tiers (`kvstore.tiers.memory.tier`) implement borrow and reserve over host pages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvstore.errors import TierError
from kvstore.frame import BlockRead, FrameBytes, FrameHeader, LayerRange
from kvstore.keys import BlockKey
from kvstore.tiers.base import Buffer

__all__ = ["SupportsPutMany", "SupportsBorrow", "SupportsReserve", "SupportsReplicas",
           "SupportsBatchedGet", "SupportsHold",
           "IndexedInProcess", "BorrowedBlock", "PageReservation"]


class BorrowedBlock:
    """A pinned block's bytes in place: `pieces` are views of the tier's pages that hold the
    segments of `layers`, back to back (not verified). Until `release()` the pages cannot be
    reused; after it the views must not be touched. Releasing twice is harmless."""

    __slots__ = ("_release", "header", "layers", "pieces", "size")

    def __init__(self, header: FrameHeader, layers: LayerRange, pieces: list[memoryview],
                 release: Callable[[], None]) -> None:
        self.header = header
        self.layers = layers
        self.pieces = pieces
        self.size = sum(len(p) for p in pieces)
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class PageReservation:
    """Pages set aside for one frame (see `SupportsReserve`): fill `pieces` (writable views, in
    frame order, `size` bytes in all), then `commit()` or `abort()`, exactly once. Until then
    nobody else can see or reuse the pages."""

    __slots__ = ("_abort", "_done", "_publish", "key", "pieces", "size")

    def __init__(self, key: BlockKey, size: int, pieces: list[memoryview], *,
                 publish: Callable[[FrameHeader], bool], abort: Callable[[], None]) -> None:
        self.key = key
        self.size = size
        self.pieces = pieces
        self._publish = publish
        self._abort = abort
        self._done = False

    def commit(self, header: FrameHeader) -> bool:
        """Publish the block (whose frame the caller has checked); False if the tier closed.
        A block published meanwhile by a concurrent put wins, and this copy is dropped."""
        if self._done:
            raise TierError("reservation already finished")
        self._done = True
        return self._publish(header)

    def abort(self) -> None:
        """Give the pages back (idempotent; a no-op after commit)."""
        if not self._done:
            self._done = True
            self._abort()


@runtime_checkable
class SupportsPutMany(Protocol):
    """A tier that can store a batch more cheaply than one put at a time (e.g. one fsync)."""

    def put_many(self, items: Sequence[tuple[BlockKey, FrameBytes]]) -> list[bool]: ...


@runtime_checkable
class SupportsBorrow(Protocol):
    """A tier that can lend a block's bytes in place, pinned: None on a miss or when its pages
    are not host memory; ValueError for a layer range beyond the block. The caller verifies
    the bytes and must `release()` the result."""

    def borrow(self, key: BlockKey, layers: LayerRange | None = None
               ) -> BorrowedBlock | None: ...


@runtime_checkable
class SupportsReserve(Protocol):
    """A tier whose pages a frame can be received into directly: None when the block is
    present already, the budget cannot take it, or the pages are not host memory. With
    evict=False it takes only free pages (a declared frame evicts nothing before it arrives)."""

    def reserve(self, key: BlockKey, size: int, *, evict: bool = True
                ) -> PageReservation | None: ...


@runtime_checkable
class SupportsHold(Protocol):
    """A tier that keeps a block from eviction until a copy of it is made elsewhere (the
    store's write-behind reads a put back from the first tier: evicted before that, an
    acknowledged block would be lost). `hold` returns the release (idempotent), or None when
    the tier does not hold the block."""

    def hold(self, key: BlockKey) -> Callable[[], None] | None: ...


@runtime_checkable
class SupportsBatchedGet(Protocol):
    """A tier that reads whole blocks of a batch together, cheaper than one `get` each (one
    pipelined stream per node): per key a read (verified, or for the store to verify) or None;
    each payload lands in its `outs[i]` where that is large enough. It may raise what `get`
    raises."""

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[Buffer | None], *,
                 deadline: float | None = None) -> list[BlockRead | None]: ...


@runtime_checkable
class SupportsReplicas(Protocol):
    """A tier that stores each block on up to `replicas` distinct nodes (processes on other
    machines), so a block it acknowledged outlives the writer's node.

    `put_acknowledged` returns, per block, whether at least `copies` (1..replicas) distinct
    nodes acknowledged storing it before `deadline` (`time.monotonic()`); copies beyond
    `copies` may still be written in the background. `count_copies` says how many distinct
    nodes hold each key now (at most the nodes a read would try)."""

    @property
    def replicas(self) -> int: ...

    def put_acknowledged(self, items: Sequence[tuple[BlockKey, FrameBytes]], *, copies: int,
                         deadline: float) -> list[bool]: ...

    def count_copies(self, keys: Sequence[BlockKey], *, deadline: float) -> list[int]: ...


@runtime_checkable
class IndexedInProcess(Protocol):
    """A tier whose `contains` reads an index held in this process (a dictionary lookup under
    a lock, never I/O): what a caller that must not block, such as vLLM's scheduler loop, may
    ask inline. Tiers whose `contains` crosses a socket (remote daemons, Redis) lack it."""

    @property
    def indexed_in_process(self) -> bool: ...
