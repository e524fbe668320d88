"""The one interface every storage tier implements, and the stats it reports.

Tiers are synchronous and thread-safe: the vLLM connector calls them from worker threads and
asyncio callers wrap them in `asyncio.to_thread`. A tier's contract on reads:

- `get` returns a `BlockRead` (not yet verified by the tier unless it says so), or None on a miss;
- it may raise `CorruptBlock`, `TierUnavailable` or `DeadlineExceeded`, all of which the
  `TieredStore` turns into a miss (deleting a corrupt block);
- with `out` given, the payload is copied into that caller-owned, already-touched buffer and the
  returned `BlockRead.payload` is a view of it (no allocation on the hot path).

On writes: `put` returns False when the tier does not admit the block (budget, disk full) and
never leaves a partial block visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.frame import BlockRead, LayerRange
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionManifest

__all__ = ["Tier", "TierStats", "Buffer"]

Buffer = bytearray | memoryview
"""A caller-owned, writable buffer a get copies into."""


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

    def put(self, key: BlockKey, frame: bytes | bytearray | memoryview) -> bool:
        """Store a whole frame; False if not admitted. Idempotent for an existing key."""
        ...

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; returns how many were present."""
        ...

    def put_manifest(self, manifest: SessionManifest) -> None:
        """Store a session manifest unless a newer generation is already stored."""
        ...

    def get_manifest(self, key: SessionKey) -> SessionManifest | None: ...

    def delete_manifest(self, key: SessionKey) -> bool: ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...
