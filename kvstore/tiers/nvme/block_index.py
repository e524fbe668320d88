"""An LRU index of stored blocks under a byte budget, with reservations for writes in flight.

A write reserves its bytes before it touches the disk, so concurrent writers never overshoot the
budget together, and marks its key in flight, so a second put of the same block waits for
nothing and writes nothing. Eviction happens at reservation time and returns the victims for the
caller to delete. Every block that leaves the index (evicted or removed) is also noted, for
the owner to hand to whoever follows its contents (`drain_removed`): the daemon's key catalog,
which must not keep an entry for every block it ever held. Not thread-safe by itself: the
owning tier guards it with its lock.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["IndexEntry", "Admission", "BlockIndex"]


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """What the tier knows of a stored block without touching the disk."""

    size: int
    header_size: int


class Admission(enum.Enum):
    PRESENT = enum.auto()
    """Already stored, or being written by a concurrent put: nothing to do."""
    REJECTED = enum.auto()
    """Does not fit the budget even after evicting everything evictable."""
    RESERVED = enum.auto()
    """Bytes reserved; the caller must `commit` or `release`."""


class BlockIndex:
    def __init__(self, budget: int) -> None:
        self._budget = budget
        self._entries: OrderedDict[bytes, IndexEntry] = OrderedDict()  # LRU first, MRU last
        self._inflight: set[bytes] = set()
        self._used = 0
        self._reserved = 0
        self._removed: list[bytes] = []
        self.evicted = 0
        """Blocks `evict_to` dropped since the index was made."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: object) -> bool:
        return digest in self._entries

    @property
    def used(self) -> int:
        """Bytes of committed blocks (reservations excluded)."""
        return self._used

    @property
    def budget(self) -> int:
        return self._budget

    def drain_removed(self) -> list[bytes]:
        """The digests of the blocks that left the index since the last call."""
        removed, self._removed = self._removed, []
        return removed

    def lookup(self, digest: bytes) -> IndexEntry | None:
        """The entry of a block, marking it most recently used."""
        entry = self._entries.get(digest)
        if entry is not None:
            self._entries.move_to_end(digest)
        return entry

    def reserve(self, digest: bytes, size: int) -> tuple[Admission, list[bytes]]:
        """Admit `size` bytes for `digest`; returns the admission and the evicted digests."""
        if self.lookup(digest) is not None or digest in self._inflight:
            return Admission.PRESENT, []
        if size + self._reserved > self._budget:
            return Admission.REJECTED, []
        victims = self.evict_to(self._budget - self._reserved - size)
        self._inflight.add(digest)
        self._reserved += size
        return Admission.RESERVED, victims

    def release(self, digest: bytes, size: int) -> None:
        """Give back a reservation whose write failed."""
        self._inflight.discard(digest)
        self._reserved -= size

    def commit(self, digest: bytes, entry: IndexEntry) -> None:
        """Turn a reservation into a stored, most recently used block."""
        self.release(digest, entry.size)
        old = self._entries.pop(digest, None)  # only if deleted and put again meanwhile
        self._used += entry.size - (old.size if old else 0)
        self._entries[digest] = entry

    def remove(self, digest: bytes, expected: IndexEntry | None = None) -> IndexEntry | None:
        """Drop a block (only if its entry is `expected`, when given); returns what was dropped."""
        entry = self._entries.get(digest)
        if entry is None or (expected is not None and entry is not expected):
            return None
        del self._entries[digest]
        self._used -= entry.size
        self._removed.append(digest)
        return entry

    def evict_to(self, limit: int) -> list[bytes]:
        """Drop least recently used blocks until used bytes <= limit; returns their digests."""
        victims: list[bytes] = []
        while self._used > limit and self._entries:
            digest, entry = self._entries.popitem(last=False)
            self._used -= entry.size
            victims.append(digest)
        self._removed.extend(victims)
        self.evicted += len(victims)
        return victims

    def load(self, entries: Iterable[tuple[bytes, IndexEntry]]) -> None:
        """Add blocks found on disk, least recently used first."""
        for digest, entry in entries:
            old = self._entries.pop(digest, None)
            self._used -= old.size if old else 0
            self._entries[digest] = entry
            self._used += entry.size
