"""Where the nvme tier keeps its files, and the lock that makes one process their owner.

    <root>/.kvkeep-nvme.lock               flock'ed by the owning process
    <root>/packs/<serial>.kvp              blocks, appended (packs.py)
    <root>/manifests/<shard>/<digest>.kvm  one encoded session record (manifest.py) per session
    <root>/blocks/<shard>/<digest>.kvb     the layout before packs, a file per block: opened
                                           only where a directory still has it, to move them

Shards keep directories small to list and cheap to fsync. Their fds stay open for the layout's
life, so file operations are openat/renameat/unlinkat relative to them, with no path walks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from kvstore.errors import ConfigError, TierUnavailable
from kvstore.tiers.nvme.recovery import PACKS_DIR, ScanResult, scan

__all__ = ["StoreLayout", "BLOCK_SHARDS", "MANIFEST_SHARDS", "open_and_scan"]

BLOCK_SHARDS = 64
MANIFEST_SHARDS = 16
_LOCK_FILE = ".kvkeep-nvme.lock"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class StoreLayout:
    """Opens (creating) and locks a data directory; raises OSError or ConfigError."""

    def __init__(self, root: Path, *, durable: bool) -> None:
        self.root = root
        self.packs_dir = -1
        self.legacy_block_dirs: list[int] = []
        self.manifest_dirs: list[int] = []
        self._lock_fd = -1
        try:
            self._open(durable)
        except BaseException:
            self.close()
            raise

    def drop_legacy(self) -> None:
        """Remove the old layout's block directories once their blocks moved (best effort:
        a directory something else put a file in stays)."""
        for fd in self.legacy_block_dirs:
            os.close(fd)
        self.legacy_block_dirs.clear()
        blocks = self.root / "blocks"
        for shard in range(BLOCK_SHARDS):
            with contextlib.suppress(OSError):
                (blocks / f"{shard:02x}").rmdir()
        with contextlib.suppress(OSError):
            blocks.rmdir()

    def close(self) -> None:
        for fd in (*self.legacy_block_dirs, *self.manifest_dirs):
            os.close(fd)
        if self.packs_dir >= 0:
            os.close(self.packs_dir)
            self.packs_dir = -1
        self.legacy_block_dirs.clear()
        self.manifest_dirs.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def _open(self, durable: bool) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.root / _LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                                0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            # A second owner would delete the first one's temp files as crash leftovers.
            raise ConfigError(f"{self.root} is in use by another nvme tier") from exc
        packs = self.root / PACKS_DIR
        packs.mkdir(exist_ok=True)
        self.packs_dir = os.open(packs, _DIR_FLAGS)
        for shard in range(MANIFEST_SHARDS):
            path = self.root / "manifests" / f"{shard:02x}"
            path.mkdir(parents=True, exist_ok=True)
            self.manifest_dirs.append(os.open(path, _DIR_FLAGS))
        for shard in range(BLOCK_SHARDS):
            path = self.root / "blocks" / f"{shard:02x}"
            if path.is_dir():
                self.legacy_block_dirs.append(os.open(path, _DIR_FLAGS))
        if durable:
            # A block is only as durable as every directory entry on its path.
            for path in (self.root, self.root / "manifests"):
                fd = os.open(path, _DIR_FLAGS)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)


def open_and_scan(root: Path, *, durable: bool) -> tuple[StoreLayout, ScanResult]:
    """Open the tree at `root` (created if new, locked) and run the start-up scan over it;
    TierUnavailable where the disk refuses either."""
    try:
        layout = StoreLayout(root, durable=durable)
    except OSError as exc:
        raise TierUnavailable(f"cannot open nvme tier at {root}: {exc}") from exc
    try:
        return layout, scan(layout.packs_dir, layout.legacy_block_dirs, layout.manifest_dirs)
    except BaseException as exc:
        layout.close()
        if isinstance(exc, OSError):
            raise TierUnavailable(f"cannot scan nvme tier at {root}: {exc}") from exc
        raise
