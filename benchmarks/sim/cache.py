"""A replica's KV block pool with vLLM's prefix caching: chained block hashes, reference
counts, LRU eviction of unreferenced blocks only, and vLLM's KV events.

Model (vLLM v1 `BlockPool`): a block is free-and-empty, held privately by a request (computing,
or a duplicate of a block already cached), or cached under its hash with a reference count. A
cached block whose count falls to 0 stays cached and joins the eviction queue (LRU); a
request freeing its blocks queues its chain tail first, so a shared prefix's head goes last.
Allocation takes empty blocks first, then evicts from the queue's old end, and never touches
a referenced block. Events: `BlockStored` when a block is cached, `BlockRemoved` on eviction,
`AllBlocksCleared` on reset, in the map shape the router's indexer decodes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["BlockPool", "OutOfBlocks"]


class OutOfBlocks(Exception):
    """Raised when an allocation is attempted without checking `can_allocate` first."""


class BlockPool:
    __slots__ = (
        "_evictable",
        "_ref",
        "block_size",
        "events",
        "evictions",
        "free_empty",
        "num_blocks",
        "record_events",
    )

    def __init__(self, num_blocks: int, block_size: int, *, record_events: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_empty = num_blocks
        self._ref: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.record_events = record_events
        self.events: list[dict[str, Any]] = []
        self.evictions = 0

    # --- queries ---------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Blocks referenced by requests (vLLM's KV-cache usage numerator)."""
        return self.num_blocks - self.free_empty - len(self._evictable)

    @property
    def cached(self) -> int:
        return len(self._ref)

    def usage(self) -> float:
        return self.used / self.num_blocks

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._ref

    def refcount(self, block_hash: int) -> int:
        return self._ref.get(block_hash, 0)

    def cached_hashes(self) -> set[int]:
        return set(self._ref)

    def longest_hit(self, hashes: Sequence[int], limit: int) -> int:
        """Leading blocks of `hashes` (at most `limit`) that are cached."""
        ref = self._ref
        n = 0
        for h in hashes:
            if n >= limit or h not in ref:
                break
            n += 1
        return n

    def can_allocate(self, n: int, hits: Sequence[int] = ()) -> bool:
        """Whether `n` blocks can be taken after referencing the cached `hits` (those now
        unreferenced leave the eviction queue, so they cannot also be evicted for it)."""
        ref = self._ref
        reclaimed = sum(1 for h in hits if ref[h] == 0)
        return self.free_empty + len(self._evictable) - reclaimed >= n

    # --- changes ---------------------------------------------------------------------------
    def acquire(self, hashes: Sequence[int]) -> None:
        """Reference cached blocks (prefix hits): they leave the eviction queue."""
        ref, evictable = self._ref, self._evictable
        for h in hashes:
            count = ref[h]
            if count == 0:
                del evictable[h]
            ref[h] = count + 1

    def allocate(self, n: int) -> None:
        """Take `n` blocks for a request's private use: empty ones first, then evicting."""
        if n <= 0:
            return
        if not self.can_allocate(n):
            raise OutOfBlocks(f"{n} blocks asked, {self.free_empty + len(self._evictable)} free")
        take = min(n, self.free_empty)
        self.free_empty -= take
        rest = n - take
        if rest:
            ref, evictable = self._ref, self._evictable
            removed = []
            for _ in range(rest):
                h, _ = evictable.popitem(last=False)
                del ref[h]
                removed.append(h)
            self.evictions += rest
            if self.record_events:
                self.events.append({"type": "BlockRemoved", "block_hashes": removed,
                                    "medium": None})

    def promote(self, hashes: Sequence[int], parent: int | None, tokens: list[int] | None
                ) -> list[bool]:
        """Cache private blocks under `hashes` (a chain continuing `parent`). A hash already
        cached (another request computed it meanwhile) stays a private duplicate: returns per
        block whether it was cached (the caller then holds a reference) or not."""
        ref = self._ref
        out = []
        stored: list[int] = []
        for h in hashes:
            if h in ref:
                out.append(False)
            else:
                ref[h] = 1
                stored.append(h)
                out.append(True)
        if stored and self.record_events:
            if len(stored) == len(hashes):
                self.events.append({"type": "BlockStored", "block_hashes": list(hashes),
                                    "parent_block_hash": parent, "token_ids": tokens,
                                    "block_size": self.block_size, "lora_id": None,
                                    "medium": None})
            else:  # a duplicate splits the chain: one event per newly cached block
                bs = self.block_size
                prev = parent
                for i, h in enumerate(hashes):
                    if out[i]:
                        toks = tokens[i * bs:(i + 1) * bs] if tokens is not None else None
                        self.events.append({"type": "BlockStored", "block_hashes": [h],
                                            "parent_block_hash": prev, "token_ids": toks,
                                            "block_size": bs, "lora_id": None,
                                            "medium": None})
                    prev = h
        return out

    def release(self, hashes: Sequence[int], private: int) -> None:
        """A request frees its blocks: referenced hashes in chain order, `private` others."""
        ref, evictable = self._ref, self._evictable
        for h in reversed(hashes):
            count = ref[h] - 1
            ref[h] = count
            if count == 0:
                evictable[h] = None
        self.free_empty += private

    def clear(self) -> None:
        """Reset (the process died or the prefix cache was reset): everything goes."""
        self._ref.clear()
        self._evictable.clear()
        self.free_empty = self.num_blocks
        if self.record_events:
            self.events.append({"type": "AllBlocksCleared"})

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events
