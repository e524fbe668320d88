"""The host-RAM tier: a byte budget of reused pages in RAM, LRU eviction, pinning.

This is the tier every put goes through synchronously, so its copies are the store's hot path:
they are memoryview slice assignments (memcpy, ~20-26 GB/s here) between the caller's buffer
and pages of arenas that were touched before, never `bytearray[:] = bytes` (~2.3 GB/s) and
never a fresh large allocation per put (page faults, ~2.5 GB/s). See `MemoryTier` for the index,
eviction and pinning rules and `SlabPool` for the pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvstore.errors import ConfigError
from kvstore.tiers.memory.slabs import DEFAULT_ARENA_BYTES, DEFAULT_PAGE_BYTES
from kvstore.tiers.memory.tier import MemoryTier

__all__ = ["HostTier"]

_Arena = npt.NDArray[np.uint8]


class HostTier(MemoryTier[_Arena]):
    """RAM tier with a byte budget; implements the `Tier` protocol.

    `prefault=True` allocates and touches the whole budget at construction (a daemon that wants
    steady put latency from its first request); by default arenas come lazily as blocks arrive
    and are reused from then on. `pinned=True` (CUDA only, through torch) page-locks the arenas,
    so a GPU copies lent blocks to and from them by DMA, in place (the connector's staged
    restore); page-locked memory cannot be swapped, so it is a deliberate choice.
    """

    def __init__(self, byte_budget: int, *, name: str = "host",
                 page_bytes: int = DEFAULT_PAGE_BYTES, arena_bytes: int = DEFAULT_ARENA_BYTES,
                 prefault: bool = False, manifest_budget: int | None = None,
                 pinned: bool = False) -> None:
        # One memoryview per page, indexed by page id, so a copy does no arithmetic on arenas.
        self._page_views: list[memoryview] = []
        self._prefault = prefault
        self._pinned: list[object] | None = None
        if pinned:
            self._pinned = []  # the page-locked torch tensors the arenas are views of
            _check_pinnable()
        super().__init__(name, byte_budget, page_bytes=page_bytes, arena_bytes=arena_bytes,
                         manifest_budget=manifest_budget)
        if prefault:
            with self._lock:
                pages = self._pool.allocate(self._pool.capacity_pages)
                assert pages is not None
                self._pool.free(pages)

    def close(self) -> None:
        super().close()
        with self._lock:
            # Rebound, not cleared: a reader still copying keeps the list it started with.
            self._page_views = []
            if self._pinned is not None:
                self._pinned = []

    # -- storage hooks ------------------------------------------------------------------------

    def _new_arena(self, nbytes: int) -> _Arena:
        if self._pinned is not None:
            import torch

            tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._pinned.append(tensor)
            arena: _Arena = tensor.numpy()
        else:
            arena = np.empty(nbytes, dtype=np.uint8)
        if self._prefault:
            arena.fill(0)  # touch every page now rather than on the first put into it
        view = memoryview(arena.data)
        page_bytes = self._pool.page_bytes
        self._page_views.extend(view[offset: offset + page_bytes]
                                for offset in range(0, nbytes, page_bytes))
        return arena

    def _write_pages(self, pages: Sequence[int], src: memoryview) -> None:
        views = self._page_views
        page_bytes = self._pool.page_bytes
        size = len(src)
        for i, page in enumerate(pages):
            offset = i * page_bytes
            length = min(page_bytes, size - offset)
            views[page][:length] = src[offset: offset + length]

    def _read_into(self, pages: Sequence[int], start: int, stop: int, dst: memoryview) -> None:
        views = self._page_views
        pos = 0
        for page, offset, length in self._page_runs(pages, start, stop):
            dst[pos: pos + length] = views[page][offset: offset + length]
            pos += length

    def _page_pieces(self, pages: Sequence[int], start: int, stop: int) -> list[memoryview]:
        views = self._page_views
        return [views[page][offset: offset + length]
                for page, offset, length in self._page_runs(pages, start, stop)]

    def _read_bytes(self, pages: Sequence[int], start: int, stop: int) -> bytes:
        views = self._page_views
        # join sizes the result once and copies each piece into it: one allocation, one copy.
        return b"".join(views[page][offset: offset + length]
                        for page, offset, length in self._page_runs(pages, start, stop))


def _check_pinnable() -> None:
    try:
        import torch
    except ImportError as exc:
        raise ConfigError("a pinned host tier needs torch") from exc
    if not torch.cuda.is_available():
        raise ConfigError("a pinned host tier needs a CUDA device; torch sees none")
