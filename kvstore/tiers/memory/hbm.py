"""The hbm tier: block frames staged in device memory (CUDA, via torch), above host RAM.

It holds frames in pages of preallocated device arenas (the same `MemoryTier` index, LRU and
pinning as host RAM), so a restore of a hot block is a device-to-host copy instead of a walk
down the tiers. It exists only where CUDA does: constructing it elsewhere raises `ConfigError`,
which the tier factory treats as "skip this optional tier".

Copies go through torch: host bytes are wrapped without a copy (`torch.from_numpy` over the
caller's buffer) and copied to or from device pages with `Tensor.copy_`. Pages default to 1 MiB
because each page is one copy call with a fixed launch cost (~5-10 us), and device memory is
not short of slack.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvstore.errors import ConfigError
from kvstore.tiers.memory.slabs import DEFAULT_ARENA_BYTES
from kvstore.tiers.memory.tier import MemoryTier

if TYPE_CHECKING:
    import torch

__all__ = ["HbmTier", "cuda_available"]

_DEFAULT_HBM_PAGE_BYTES = 1 << 20

# Wrapping a read-only buffer (a `bytes` frame) is safe here: the device copy only reads it. Torch
# warns about it anyway, so the warning is silenced for this module's calls only.
warnings.filterwarnings("ignore", message=r"The given (NumPy array|buffer) is not writable",
                        category=UserWarning, module=r"kvstore\.tiers\.hbm")


def cuda_available() -> bool:
    """True when torch is installed and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class HbmTier(MemoryTier["torch.Tensor"]):
    """Device-memory tier with a byte budget; implements the `Tier` protocol."""

    def __init__(self, byte_budget: int, *, device: str | int = "cuda", name: str = "hbm",
                 page_bytes: int = _DEFAULT_HBM_PAGE_BYTES,
                 arena_bytes: int = DEFAULT_ARENA_BYTES) -> None:
        try:
            import torch
        except ImportError as exc:
            raise ConfigError("the hbm tier needs torch (pip install kvkeep[torch])") from exc
        if not torch.cuda.is_available():
            raise ConfigError("the hbm tier needs a CUDA device; torch sees none")
        try:
            self._device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"bad hbm device {device!r}: {exc}") from exc
        if self._device.type != "cuda":
            raise ConfigError(f"the hbm tier needs a CUDA device, got {self._device}")
        self._torch: Any = torch
        super().__init__(name, byte_budget, page_bytes=page_bytes, arena_bytes=arena_bytes)

    @property
    def device(self) -> torch.device:
        return self._device

    # -- storage hooks ------------------------------------------------------------------------

    def _new_arena(self, nbytes: int) -> torch.Tensor:
        arena: torch.Tensor = self._torch.empty(nbytes, dtype=self._torch.uint8,
                                                device=self._device)
        return arena

    def _write_pages(self, pages: Sequence[int], src: memoryview) -> None:
        host = self._host_tensor(src)
        page_bytes = self._pool.page_bytes
        size = len(src)
        for i, page in enumerate(pages):
            offset = i * page_bytes
            length = min(page_bytes, size - offset)
            arena, base = self._locate(page)
            arena[base: base + length].copy_(host[offset: offset + length])
        # Publish only after the bytes have landed: a reader on another stream must see them.
        self._torch.cuda.synchronize(self._device)

    def _read_into(self, pages: Sequence[int], start: int, stop: int, dst: memoryview) -> None:
        host = self._host_tensor(dst)
        pos = 0
        for page, offset, length in self._page_runs(pages, start, stop):
            arena, base = self._locate(page)
            # Device-to-pageable-host copies are synchronous: the bytes are in `dst` on return.
            host[pos: pos + length].copy_(arena[base + offset: base + offset + length])
            pos += length

    def _read_bytes(self, pages: Sequence[int], start: int, stop: int) -> bytes:
        buf = bytearray(stop - start)
        self._read_into(pages, start, stop, memoryview(buf))
        return bytes(buf)

    def _host_tensor(self, view: memoryview) -> torch.Tensor:
        if len(view) == 0:
            return self._torch.empty(0, dtype=self._torch.uint8)  # type: ignore[no-any-return]
        return self._torch.from_numpy(  # type: ignore[no-any-return]
            np.frombuffer(view, dtype=np.uint8))
