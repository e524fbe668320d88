"""When a disk has run full: refuse writes until it is worth trying again.

A cache that keeps retrying writes on a full disk burns I/O and fills logs; one that gives up for
good never recovers. So after ENOSPC/EDQUOT writes are refused until either the owner frees
space itself (`freed`), or a periodic statvfs shows room for the offered write plus a margin.
Not thread-safe by itself: the owning tier calls it under its lock.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

__all__ = ["SpaceGuard"]

log = logging.getLogger(__name__)


class SpaceGuard:
    def __init__(self, path: Path, *, recheck_s: float, min_free_bytes: int) -> None:
        self._path = path
        self._recheck_s = recheck_s
        self._min_free = min_free_bytes
        self._blocked_at: float | None = None

    @property
    def blocked(self) -> bool:
        return self._blocked_at is not None

    def note_full(self, exc: OSError) -> None:
        if self._blocked_at is None:
            log.warning("%s: disk full (%s); refusing writes", self._path, exc)
        self._blocked_at = time.monotonic()

    def freed(self) -> None:
        """The owner deleted files: let the next write find out whether they were enough."""
        self._blocked_at = None

    def allows(self, size: int) -> bool:
        """Whether a write of `size` bytes may be tried now (statvfs at most every recheck_s)."""
        if self._blocked_at is None:
            return True
        now = time.monotonic()
        if now - self._blocked_at < self._recheck_s:
            return False
        self._blocked_at = now
        try:
            st = os.statvfs(self._path)
        except OSError:
            return False
        if st.f_bavail * st.f_frsize < size + self._min_free:
            return False
        self._blocked_at = None
        log.info("%s: disk has room again; admitting writes", self._path)
        return True
