"""How big the staging pipelines are, and what they may skip."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["StagingConfig"]


@dataclass(frozen=True, slots=True)
class StagingConfig:
    slots: int = 3
    """Staging slots per direction: one being filled, one on the link, one being consumed."""
    slot_bytes: int = 64 << 20
    """Bytes per slot (host and device each): a batch of blocks per copy, large enough that a
    copy runs at the link's rate (16 blocks of an 8B model's 4 MiB), small enough to sit beside
    vLLM's cache in device memory. Never below one block."""
    workers: int = 4
    """Host threads that copy, hash and verify (hashing and copies release the GIL)."""
    direct_from_pinned: bool = False
    """Restore raw blocks that the first tier lends from page-locked pages with one DMA per
    page, straight into the device slot (no host copy); hashed beside the DMA."""
    trust_host_pages: bool = False
    """Skip hashing blocks lent by the first tier (they were checked when they entered it).
    Off: a bit flipped in host RAM is still a miss, which `tests/test_verify_once.py` pins;
    the pipeline hashes beside the copies instead, in parallel."""

    def __post_init__(self) -> None:
        if self.slots < 2:
            raise ConfigError("a staging pipeline needs at least 2 slots (one in flight while "
                              "the next is filled)")
        if self.slot_bytes <= 0 or self.workers <= 0:
            raise ConfigError("staging slot_bytes and workers must be positive")
