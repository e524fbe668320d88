"""Where the nvme tier keeps its files, and the lock that makes one process their owner.

    <root>/.kvkeep-nvme.lock               flock'ed by the owning process
    <root>/blocks/<shard>/<digest>.kvb     one frame per block, named by its key digest
    <root>/manifests/<shard>/<digest>.kvm  one encoded session record (manifest.py) per session

Shards keep directories small to list and cheap to fsync. Their fds stay open for the layout's
life, so file operations are openat/renameat/unlinkat relative to them, with no path walks.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvstore.errors import ConfigError, TierUnavailable
from kvstore.tiers.nvme.recovery import BLOCK_SUFFIX, ScanResult, scan

__all__ = ["StoreLayout", "BLOCK_SHARDS", "MANIFEST_SHARDS", "open_and_scan"]

BLOCK_SHARDS = 64
MANIFEST_SHARDS = 16
_LOCK_FILE = ".kvkeep-nvme.lock"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class StoreLayout:
    """Opens (creating) and locks a data directory; raises OSError or ConfigError."""

    def __init__(self, root: Path, *, durable: bool) -> None:
        self.root = root
        self.block_dirs: list[int] = []
        self.manifest_dirs: list[int] = []
        self._lock_fd = -1
        try:
            self._open(durable)
        except BaseException:
            self.close()
            raise

    def block_path(self, digest: bytes) -> tuple[int, str]:
        """(directory fd, file name) of a block."""
        return self.block_dirs[digest[0] % BLOCK_SHARDS], digest.hex() + BLOCK_SUFFIX

    def close(self) -> None:
        for fd in (*self.block_dirs, *self.manifest_dirs):
            os.close(fd)
        self.block_dirs.clear()
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
        for sub, count, fds in (("blocks", BLOCK_SHARDS, self.block_dirs),
                                ("manifests", MANIFEST_SHARDS, self.manifest_dirs)):
            for shard in range(count):
                path = self.root / sub / f"{shard:02x}"
                path.mkdir(parents=True, exist_ok=True)
                fds.append(os.open(path, _DIR_FLAGS))
        if durable:
            # A block is only as durable as every directory entry on its path.
            for path in (self.root, self.root / "blocks", self.root / "manifests"):
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
        return layout, scan(layout.block_dirs, layout.manifest_dirs)
    except BaseException as exc:
        layout.close()
        if isinstance(exc, OSError):
            raise TierUnavailable(f"cannot scan nvme tier at {root}: {exc}") from exc
        raise
