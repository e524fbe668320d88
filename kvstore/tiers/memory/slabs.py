"""A page allocator over lazily allocated, reused arenas (the "slabs" of the memory tiers).

Why pages: a fresh large allocation costs page faults (~2.5 GB/s here against ~18 GB/s into
memory that was touched before), and glibc hands every large temporary buffer back to the OS. So
a memory tier never allocates per put. It carves arenas into fixed-size pages, a block occupies
as many pages as it needs (not necessarily adjacent), and freed pages are reused by later puts.
Arenas are allocated only when the free list runs dry, never beyond the byte budget, and never
returned until the pool is dropped: after warm-up a put allocates nothing.

The pool is storage-agnostic: an arena is whatever `new_arena(nbytes)` returns (a numpy array in
host RAM, a torch tensor on a device). It is not thread-safe; the owning tier calls it under its
own lock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from kvstore.errors import ConfigError

__all__ = ["SlabPool", "DEFAULT_PAGE_BYTES", "DEFAULT_ARENA_BYTES"]

A = TypeVar("A")

# 256 KiB pages: a real 4 MiB block plus its ~2 KiB header needs 17 pages, 6 % slack; 1 MiB
# pages would waste 25 % on exactly that shape, and much smaller pages cost one Python-level
# copy call per page (~0.5-1 us each, against ~12 us to copy 256 KiB).
DEFAULT_PAGE_BYTES = 256 << 10
# Arenas of 64 MiB keep the number of allocations small without reserving the whole budget up
# front (a tier configured with 20 GiB should not map 20 GiB on start).
DEFAULT_ARENA_BYTES = 64 << 20


class SlabPool(Generic[A]):
    """Fixed-size pages carved from arenas allocated lazily up to a byte budget."""

    def __init__(self, byte_budget: int, new_arena: Callable[[int], A], *,
                 page_bytes: int = DEFAULT_PAGE_BYTES,
                 arena_bytes: int = DEFAULT_ARENA_BYTES) -> None:
        if page_bytes <= 0 or arena_bytes < page_bytes:
            raise ConfigError(f"bad slab geometry: page {page_bytes} B, arena {arena_bytes} B")
        if byte_budget < page_bytes:
            raise ConfigError(f"byte budget {byte_budget} is smaller than one page ({page_bytes})")
        self._page_bytes = page_bytes
        self._pages_per_arena = arena_bytes // page_bytes
        self._max_pages = byte_budget // page_bytes
        self._new_arena = new_arena
        self._arenas: list[A] = []
        self._arena_pages: list[int] = []
        self._free: list[int] = []
        self._page_count = 0  # pages carved so far (free + in use)
        self._in_use = 0
        self._arena_allocations = 0

    # -- public API ---------------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def capacity_pages(self) -> int:
        """Pages the budget allows in total."""
        return self._max_pages

    @property
    def pages_in_use(self) -> int:
        return self._in_use

    @property
    def allocated_bytes(self) -> int:
        """Bytes of arena memory allocated so far (never shrinks while the pool lives)."""
        return self._page_count * self._page_bytes

    @property
    def arena_allocations(self) -> int:
        """How many arenas were ever allocated: flat once the pool is warm."""
        return self._arena_allocations

    @property
    def arenas(self) -> Sequence[A]:
        return self._arenas

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self._page_bytes))

    def available_pages(self) -> int:
        """Pages obtainable without evicting: free ones plus those the budget still allows."""
        return len(self._free) + (self._max_pages - self._page_count)

    def allocate(self, npages: int) -> list[int] | None:
        """Take `npages` pages, or None (taking nothing) if the budget cannot supply them."""
        if npages > self.available_pages():
            return None
        while len(self._free) < npages:
            self._grow()
        taken = self._free[-npages:]
        del self._free[-npages:]
        self._in_use += npages
        return taken

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(pages)
        self._in_use -= len(pages)

    def locate(self, page: int) -> tuple[A, int]:
        """The arena holding `page` and the page's byte offset inside it."""
        arena, index = divmod(page, self._pages_per_arena)
        return self._arenas[arena], index * self._page_bytes

    def release(self) -> None:
        """Drop every arena (the tier is closing); the pool is empty and reusable afterwards."""
        self._arenas.clear()
        self._arena_pages.clear()
        self._free.clear()
        self._page_count = 0
        self._in_use = 0

    # -- helpers ------------------------------------------------------------------------------

    def _grow(self) -> None:
        # Page ids are arena_index * pages_per_arena + index, so every arena but the last is full
        # size; the last one is cut to what the budget still allows.
        assert not self._arena_pages or self._arena_pages[-1] == self._pages_per_arena, (
            "only the last arena may be short, and the budget check keeps it from being grown")
        npages = min(self._pages_per_arena, self._max_pages - self._page_count)
        arena_index = len(self._arenas)
        self._arenas.append(self._new_arena(npages * self._page_bytes))
        self._arena_pages.append(npages)
        self._arena_allocations += 1
        base = arena_index * self._pages_per_arena
        # Reversed so that allocate() (which pops from the end) hands out low pages first.
        self._free.extend(range(base + npages - 1, base - 1, -1))
        self._page_count += npages
