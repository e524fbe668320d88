"""When a disk is full, or about to be: refuse writes until it is worth trying again.

A cache that keeps retrying writes on a full disk burns I/O and fills logs; one that gives up for
good never recovers. So writes are refused as soon as a statvfs (at most every `PROBE_S`, ~1 us
each) shows less free space than the offered write plus a margin: a disk filled by someone else
is seen before a write of ours fails half way, and before the daemon acknowledges a put it could
not write. The margin is `min_free_bytes` (64 MiB by default), at most 1/16 of the filesystem and
at most 1/16 of the owner's own byte budget: a fixed margin never let a small disk take writes
again (a 128 MiB tmpfs under a 96 MiB budget has at most ~32 MiB free once the others' files
go), and an owner at its budget replaces its own oldest files rather than growing, so it needs
room for the write in hand plus a slack that scales with what it writes, not with the disk.
Free inodes count too (`f_favail`, M4): a filesystem with bytes to spare but (nearly) no inodes
left takes no new file, so writes are refused while fewer than `min_free_inodes` (1024, at most
1/16 of the filesystem's) are left; a filesystem that reports no inode count (`f_files` 0, as
btrfs does) is judged by bytes alone. Writes are refused too after a write failed with
ENOSPC/EDQUOT, and then statvfs is trusted
again only after `recheck_s` (a filesystem that reports room it cannot give, out of inodes or
over a quota, must not be retried in a loop). Writes are allowed again when the
owner frees space itself (`freed`), or when a later statvfs shows room. Thread-safe (a lock
of its own, held for bookkeeping only, never across the statvfs): the tier asks it without
taking its own lock, so a put's check never waits behind the tier's file operations.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

__all__ = ["SpaceGuard", "PROBE_S"]

PROBE_S = 0.05

log = logging.getLogger(__name__)


class SpaceGuard:
    def __init__(self, path: Path, *, recheck_s: float, min_free_bytes: int,
                 budget_bytes: int | None = None, min_free_inodes: int = 1024) -> None:
        self._path = path
        self._recheck_s = recheck_s
        self._min_free = (min_free_bytes if budget_bytes is None
                          else min(min_free_bytes, budget_bytes // 16))
        self._min_free_inodes = min_free_inodes
        self._blocked_at: float | None = None
        self._by_error = False  # blocked by a failed write (else by a statvfs probe)
        self._checked_at = float("-inf")
        self._lock = threading.Lock()

    @property
    def blocked(self) -> bool:
        return self._blocked_at is not None

    def note_full(self, exc: OSError | str) -> None:
        with self._lock:
            self._note_full(exc)

    def freed(self) -> None:
        """The owner deleted files: let the next write find out whether they were enough."""
        with self._lock:
            self._blocked_at = None
            self._by_error = False

    def allows(self, size: int, *, fresh: bool = False) -> bool:
        """Whether a write of `size` bytes may be tried now (statvfs at most every PROBE_S,
        or now when `fresh`, while no write has failed; see the module doc)."""
        now = time.monotonic()
        with self._lock:
            if self._blocked_at is None:
                if not fresh and now - self._checked_at < PROBE_S:
                    return True
            else:
                wait = self._recheck_s if self._by_error else 0.0 if fresh else PROBE_S
                if now - self._blocked_at < wait:
                    return False
            self._checked_at = now
            was_blocked = self._blocked_at is not None
        room = self._has_room(size)
        with self._lock:
            if self._blocked_at is not None and self._by_error and not was_blocked:
                return False  # a write failed meanwhile: that is the fresher news
            if room is False or (room is None and was_blocked):
                self._note_full("less free space (bytes or inodes) than the write and its "
                                "margin")
                return False
            if self._blocked_at is not None:
                self._blocked_at = None
                self._by_error = False
                log.info("%s: disk has room again; admitting writes", self._path)
            return True

    def _note_full(self, exc: OSError | str) -> None:
        if self._blocked_at is None:
            log.warning("%s: disk full (%s); refusing writes", self._path, exc)
        self._blocked_at = time.monotonic()
        self._by_error = self._by_error or isinstance(exc, OSError)

    def _has_room(self, size: int) -> bool | None:
        """Room for `size` bytes and the margin; None when statvfs itself fails."""
        try:
            st = os.statvfs(self._path)
        except OSError:
            return None
        margin = min(self._min_free, st.f_blocks * st.f_frsize // 16)
        if st.f_files > 0:  # one file per write, and its inode margin
            inodes = min(self._min_free_inodes, st.f_files // 16)
            if st.f_favail < 1 + inodes:
                return False
        return bool(st.f_bavail * st.f_frsize >= size + margin)
