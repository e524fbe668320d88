"""The one interface every storage tier implements, and the stats it reports.

Tiers are synchronous and thread-safe: the vLLM connector calls them from worker threads and
asyncio callers wrap them in `asyncio.to_thread`. A tier's contract on reads:

- `get` returns a `BlockRead`, or None on a miss. A tier that checks the bytes itself (the nvme
  tier, which deletes a bad file; the remote tier, which tries the next replica and repairs)
  returns the read marked verified (`BlockRead.verified_for`), and the store does not hash it
  again; any other read the store verifies, once, before anyone uses it. Memory tiers return
  reads unverified on purpose: their pages live for hours, are lent out and written in place,
  and a bit flipped there must be caught too;
- it may raise `CorruptBlock`, `TierUnavailable` or `DeadlineExceeded`, all of which the
  `TieredStore` turns into a miss (deleting a corrupt block);
- with `out` given, the payload is copied into that caller-owned, already-touched buffer and the
  returned `BlockRead.payload` is a view of it (no allocation on the hot path).

On writes: `put` returns False when the tier does not admit the block (budget, disk full) and
never leaves a partial block visible.

Optional capabilities beyond this protocol (batched puts, lending pages, receiving into pages)
are protocols of their own in `kvstore.tiers.capabilities`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.errors import TierError
from kvstore.frame import BlockRead, FrameBytes, LayerRange
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionRecord

__all__ = ["Tier", "TierStats", "Buffer", "FrameBytes", "byte_view"]

Buffer = bytearray | memoryview
"""A caller-owned, writable buffer a get copies into."""


def byte_view(buf: FrameBytes, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of `buf` (any C-contiguous buffer), for slice assignment;
    TierError for a buffer that is not contiguous (or read-only, when `writable`)."""
    view = memoryview(buf)
    if not view.c_contiguous:
        raise TierError("buffer is not C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise TierError("output buffer is read-only")
    return view


@dataclass(frozen=True, slots=True)
class TierStats:
    name: str
    blocks: int
    bytes_used: int
    bytes_budget: int
    hits: int = 0
    misses: int = 0
    puts: int = 0
    rejected_puts: int = 0
    corrupt: int = 0
    errors: int = 0
    evictions: int = 0
    """Blocks dropped to make room for others (LRU), since the tier opened."""


@runtime_checkable
class Tier(Protocol):
    """A storage tier. Implementations: host, nvme, hbm, remote, redis."""

    @property
    def name(self) -> str: ...

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of `keys` this tier holds (one batched call, no payload transfer)."""
        ...

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        """Read a block (or only the segments of `layers`); None on a miss.

        `deadline` is a `time.monotonic()` instant; past it the tier raises DeadlineExceeded.
        """
        ...

    def put(self, key: BlockKey, frame: FrameBytes) -> bool:
        """Store a whole frame; False if not admitted. Idempotent for an existing key."""
        ...

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; returns how many were present."""
        ...

    # A session key's record is a KV manifest or a conversation record (kvstore/manifest.py):
    # a tier keeps either alike, by key and generation, and decodes it by its tag.
    def put_manifest(self, record: SessionRecord) -> None:
        """Store a session's record unless a newer generation is already stored."""
        ...

    def get_manifest(self, key: SessionKey) -> SessionRecord | None: ...

    def delete_manifest(self, key: SessionKey) -> bool: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...
