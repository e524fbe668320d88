"""Where a daemon's block bytes sit while a front moves them: received puts, outgoing reads.

`IncomingBlock` is a put being received: host-tier pages reserved for the frame (so a socket
can scatter-read straight into them, no receive buffer), or, when the host tier cannot lend
pages, a scratch buffer. `OutgoingBlock` is a read being sent: pages lent in place by the host
tier, or a scratch buffer the block was read into. Both fronts use these, so a block costs the
same copies whichever transport carries it; scratch buffers come from one `ScratchPool`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore.frame import FrameHeader, LayerRange

if TYPE_CHECKING:
    from kvstore.keys import BlockKey
    from kvstore.tiers.capabilities import BorrowedBlock, PageReservation

__all__ = ["IncomingBlock", "OutgoingBlock", "ScratchPool", "SCRATCH_BYTES", "byte_range"]

SCRATCH_BYTES = 64 << 20
"""Each scratch buffer; frames larger than this get a buffer of their own."""


class ScratchPool:
    """Reused receive/read buffers, so a warm daemon does not page-fault per request: at most
    `keep` idle ones are kept; a new one is calloc'd (pages become resident when touched)."""

    def __init__(self, size: int = SCRATCH_BYTES, keep: int = 8) -> None:
        self.size = size
        self._keep = keep
        self._idle: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A buffer of at least `size` bytes (pooled when `size` fits one)."""
        if size > self.size:
            return bytearray(size)
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return bytearray(self.size)

    def give(self, buf: bytearray) -> None:
        if len(buf) != self.size:
            return
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(buf)


class IncomingBlock:
    """One put's frame being received: fill `pieces` (writable views, in frame order, `size`
    bytes in all), by `write` or a socket's scatter reads, by `deadline` (a time.monotonic()
    instant the fronts enforce), then `commit()` or `abort()`, once. Used as a context manager,
    it aborts on the way out unless it was committed."""

    __slots__ = ("_buffer", "_commit", "_pool", "_release", "deadline", "done", "key", "pieces",
                 "reservation", "size", "wait_for_disk")

    def __init__(self, key: BlockKey, size: int, *, reservation: PageReservation | None,
                 pool: ScratchPool, commit: Callable[[IncomingBlock], bool],
                 release: Callable[[], None], deadline: float = float("inf")) -> None:
        self.key = key
        self.size = size
        self.deadline = deadline
        self.reservation = reservation
        self._pool = pool
        self._buffer: bytearray | None = None
        if reservation is not None:
            self.pieces = reservation.pieces
        else:
            self._buffer = pool.take(size)
            self.pieces = [memoryview(self._buffer)[:size]]
        self._commit = commit
        self._release = release
        self.done = False
        self.wait_for_disk = True
        """Whether `commit` itself holds the ack for back-pressure (blocking); the gRPC front
        sets False and waits on its event loop instead (M2)."""

    @property
    def frame(self) -> memoryview:
        """The received frame, when it was received into a buffer (not into pages)."""
        assert self._buffer is not None
        return memoryview(self._buffer)[:self.size]

    def write(self, offset: int, data: memoryview | bytes) -> None:
        """Copy `data` into the frame at `offset` (it must fit)."""
        pos = 0
        for dst in byte_range(self.pieces, offset, offset + len(data)):
            dst[:] = data[pos:pos + len(dst)]
            pos += len(dst)

    def commit(self) -> bool:
        """Verify the frame and store it (see BlockServiceCore.begin_put); raises Refusal."""
        if self.done:
            raise AssertionError("put already finished")
        self.done = True
        try:
            return self._commit(self)
        finally:
            self._finish()

    def abort(self) -> None:
        """Give everything back; nothing is stored (idempotent, a no-op after commit)."""
        if self.done:
            return
        self.done = True
        if self.reservation is not None:
            self.reservation.abort()
        self._finish()

    def _finish(self) -> None:
        if self._buffer is not None:
            self._pool.give(self._buffer)
            self._buffer = None
        self._release()

    def __enter__(self) -> IncomingBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class OutgoingBlock:
    """A block (or layer range) being sent: `header`, `layers`, and `pieces`, its payload in
    order (`size` bytes). `finish()` once the bytes were sent or copied out, exactly once."""

    __slots__ = ("_finish", "header", "layers", "pieces", "size")

    def __init__(self, header: FrameHeader, layers: LayerRange, pieces: list[memoryview],
                 finish: Callable[[], bool]) -> None:
        self.header = header
        self.layers = layers
        self.pieces = pieces
        self.size = sum(len(p) for p in pieces)
        self._finish = finish

    @classmethod
    def borrowed(cls, block: BorrowedBlock, check: Callable[[], bool]) -> OutgoingBlock:
        """Pages lent in place; `check` verifies them when they are finished with."""
        def finish() -> bool:
            try:
                return check()
            finally:
                block.release()
        return cls(block.header, block.layers, block.pieces, finish)

    def finish(self) -> bool:
        """Release the bytes; False when they turned out corrupt (a copy lent unverified that
        failed its check: it was dropped from the store, and the client's own check rejects
        what it got)."""
        return self._finish()


def byte_range(pieces: list[memoryview], start: int, stop: int) -> list[memoryview]:
    """Views of bytes [start, stop) of the concatenation of `pieces`."""
    out = []
    pos = 0
    for piece in pieces:
        end = pos + len(piece)
        if end > start and pos < stop:
            out.append(piece[max(start - pos, 0): min(stop, end) - pos])
        pos = end
        if pos >= stop:
            break
    return out
