"""The nvme tier's start-up scan: rebuild the block index from what is on disk.

Deletes leftover temp files (writes a crash interrupted) and every block file whose header does
not verify, is bound to another key than its name says, or disagrees with the file's size. It
reads headers only: segment checksums are verified on every read anyway, and reading every byte
at start would take minutes on a full disk. A file it cannot read is skipped, not deleted.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import CorruptBlock
from kvstore.frame import FrameHeader, header_size_from_prefix
from kvstore.tiers.nvme.block_index import IndexEntry
from kvstore.tiers.nvme.durable_files import TEMP_SUFFIX, drop_cache

__all__ = ["BLOCK_SUFFIX", "MANIFEST_SUFFIX", "RecoveryReport", "ScanResult", "scan"]

log = logging.getLogger(__name__)

BLOCK_SUFFIX = ".kvb"
MANIFEST_SUFFIX = ".kvm"
_NAME_RE = re.compile(r"[0-9a-f]{32}")
# Enough for the header of a ~90-layer frame in one read; bigger headers take a second read.
_FIRST_READ_BYTES = 4096


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What the start-up scan found and did."""

    blocks: int
    bytes: int
    manifests: int
    temp_removed: int
    invalid_removed: int
    unreadable: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ScanResult:
    entries: tuple[tuple[bytes, IndexEntry], ...]
    """Valid blocks, least recently written first (the best LRU order a restart can know)."""
    report: RecoveryReport


def scan(block_dirs: Sequence[int], manifest_dirs: Sequence[int]) -> ScanResult:
    """Scan the shard directories (open fds); deletes what must not survive."""
    began = time.monotonic()
    found: list[tuple[int, bytes, IndexEntry]] = []
    temp_removed = invalid_removed = unreadable = manifests = 0
    for dir_fd in block_dirs:
        for name in os.listdir(dir_fd):
            if name.endswith(TEMP_SUFFIX):
                os.unlink(name, dir_fd=dir_fd)
                temp_removed += 1
                continue
            stem = name.removesuffix(BLOCK_SUFFIX)
            if stem == name or _NAME_RE.fullmatch(stem) is None:
                continue  # not ours: leave it alone
            digest = bytes.fromhex(stem)
            try:
                scanned = _scan_block(dir_fd, name, digest)
                if scanned is None:
                    os.unlink(name, dir_fd=dir_fd)
                    invalid_removed += 1
                else:
                    found.append((scanned[0], digest, scanned[1]))
            except OSError as exc:  # one unreadable file must not take the tier down
                unreadable += 1
                log.warning("nvme scan: skipping %s: %s", name, exc)
    for dir_fd in manifest_dirs:
        for name in os.listdir(dir_fd):
            if name.endswith(TEMP_SUFFIX):
                os.unlink(name, dir_fd=dir_fd)
                temp_removed += 1
            elif name.endswith(MANIFEST_SUFFIX):
                manifests += 1  # verified when read: decoding them all here buys nothing
    found.sort(key=lambda item: item[0])
    report = RecoveryReport(
        blocks=len(found), bytes=sum(entry.size for _, _, entry in found), manifests=manifests,
        temp_removed=temp_removed, invalid_removed=invalid_removed, unreadable=unreadable,
        seconds=time.monotonic() - began)
    return ScanResult(tuple((digest, entry) for _, digest, entry in found), report)


def _scan_block(dir_fd: int, name: str, digest: bytes) -> tuple[int, IndexEntry] | None:
    """(mtime, entry) of a block file whose header verifies and matches its size, or None."""
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        head = os.pread(fd, _FIRST_READ_BYTES, 0)
        try:
            header_size = header_size_from_prefix(head)
            if header_size > len(head):
                head = os.pread(fd, header_size, 0)
            header = FrameHeader.unpack(head)
        except CorruptBlock:  # InvalidFrame included
            return None
        if header.key_digest != digest or header.frame_size != st.st_size:
            return None
        # Scanning must not leave a cached page behind for every block on the disk.
        drop_cache(fd)
        return st.st_mtime_ns, IndexEntry(st.st_size, header_size)
    finally:
        os.close(fd)
