"""The nvme tier's start-up scan: rebuild the block index from what is on disk.

Walks every pack's data (packs.py; holes skipped with SEEK_DATA) and indexes each frame whose
header verifies and that ends within its pack; a block found twice counts where it was written
last, and the older copy is freed. It reads headers only: segment checksums are verified on
every read anyway, and reading every byte at start would take minutes on a full disk. A pack
it cannot read is skipped, not deleted. Leftover temp files (manifest writes a crash
interrupted) are deleted.

Block files of the layout before packs (`blocks/<shard>/<digest>.kvb`) are found too
(`legacy`), for the tier to move into packs; `find_block` and `pack_blocks` read the packs of
a directory in use, for tools and fault-injection tests that need a block's bytes on disk.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import CorruptBlock
from kvstore.frame import FrameHeader, header_size_from_prefix
from kvstore.tiers.nvme.block_index import IndexEntry
from kvstore.tiers.nvme.durable_files import TEMP_SUFFIX, drop_cache
from kvstore.tiers.nvme.packs import RECORD_ALIGN, aligned, pack_name, pack_serial

__all__ = ["BLOCK_SUFFIX", "MANIFEST_SUFFIX", "PACKS_DIR", "LegacyBlock", "RecoveryReport",
           "ScanResult", "scan", "pack_blocks", "find_block"]

log = logging.getLogger(__name__)

PACKS_DIR = "packs"
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
    """Duplicate copies freed, and block files of the old layout that did not verify."""
    unreadable: int
    seconds: float


@dataclass(frozen=True, slots=True)
class LegacyBlock:
    """A verified block file of the layout before packs, to be moved into a pack."""

    dir_fd: int
    name: str
    digest: bytes


@dataclass(frozen=True, slots=True)
class ScanResult:
    entries: tuple[tuple[bytes, IndexEntry], ...]
    """Valid blocks, least recently written first (the best LRU order a restart can know)."""
    stale: tuple[IndexEntry, ...]
    """Older copies of blocks found twice: to be freed."""
    packs: tuple[int, ...]
    """The serials of every pack file found, readable or not."""
    legacy: tuple[LegacyBlock, ...]
    report: RecoveryReport


def pack_records(fd: int) -> Iterator[tuple[int, FrameHeader, int]]:
    """(offset, header, header size) of every frame in an open pack, in file order."""
    size = os.fstat(fd).st_size
    offset = 0
    while offset < size:
        try:
            offset = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only holes left
                return
            raise
        offset -= offset % RECORD_ALIGN  # a filesystem of smaller blocks may start mid-page
        head = os.pread(fd, _FIRST_READ_BYTES, offset)
        header: FrameHeader | None = None
        try:
            header_size = header_size_from_prefix(head)
            if header_size > len(head):
                head = os.pread(fd, header_size, offset)
            if len(head) >= header_size:
                header = FrameHeader.unpack(head)
        except CorruptBlock:  # InvalidFrame included: a freed page, or a torn write
            pass
        if header is None or offset + header.frame_size > size:
            offset += RECORD_ALIGN
            continue
        yield offset, header, header_size
        offset += aligned(header.frame_size)


def pack_blocks(root: Path) -> Iterator[tuple[Path, int, FrameHeader]]:
    """(pack path, offset, header) of every frame in the packs of every nvme tier at or under
    `root` (a daemon's data directory, say), each tier's oldest pack first: for tools and
    tests (a tier may be writing meanwhile)."""
    for packs in sorted(p for p in root.rglob(PACKS_DIR) if p.is_dir()):
        yield from _blocks_of(packs)


def _blocks_of(packs: Path) -> Iterator[tuple[Path, int, FrameHeader]]:
    serials = sorted(s for s in (pack_serial(p.name) for p in packs.glob("*")) if s is not None)
    for serial in serials:
        path = packs / pack_name(serial)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            for offset, header, _ in pack_records(fd):
                yield path, offset, header
        finally:
            os.close(fd)


def find_block(root: Path, digest: bytes) -> tuple[Path, int, int] | None:
    """(pack path, offset, frame size) of the newest copy of a block, or None."""
    found = None
    for path, offset, header in pack_blocks(root):
        if header.key_digest == digest:
            found = (path, offset, header.frame_size)
    return found


def scan(packs_dir: int, legacy_dirs: Sequence[int], manifest_dirs: Sequence[int]
         ) -> ScanResult:
    """Scan the packs, old-layout block shards and manifest shards (open dir fds); deletes
    leftovers that must not survive."""
    began = time.monotonic()
    found: dict[bytes, IndexEntry] = {}
    stale: list[IndexEntry] = []
    serials = sorted(s for s in (pack_serial(n) for n in os.listdir(packs_dir)) if s is not None)
    unreadable = manifests = temp_removed = 0
    for serial in serials:
        try:
            fd = os.open(pack_name(serial), os.O_RDONLY | os.O_CLOEXEC, dir_fd=packs_dir)
            try:
                for offset, header, header_size in pack_records(fd):
                    old = found.pop(header.key_digest, None)
                    if old is not None:
                        stale.append(old)
                    found[header.key_digest] = IndexEntry(header.frame_size, header_size,
                                                          serial, offset)
                # Scanning must not leave a cached page behind for every block on the disk.
                drop_cache(fd)
            finally:
                os.close(fd)
        except OSError as exc:  # one unreadable pack must not take the tier down
            unreadable += 1
            log.warning("nvme scan: skipping pack %s: %s", pack_name(serial), exc)
    legacy, invalid, legacy_temp = _scan_legacy(legacy_dirs)
    for dir_fd in manifest_dirs:
        for name in os.listdir(dir_fd):
            if name.endswith(TEMP_SUFFIX):
                os.unlink(name, dir_fd=dir_fd)
                temp_removed += 1
            elif name.endswith(MANIFEST_SUFFIX):
                manifests += 1  # verified when read: decoding them all here buys nothing
    report = RecoveryReport(
        blocks=len(found) + len(legacy), bytes=sum(entry.size for entry in found.values()),
        manifests=manifests, temp_removed=temp_removed + legacy_temp,
        invalid_removed=len(stale) + invalid, unreadable=unreadable,
        seconds=time.monotonic() - began)
    return ScanResult(tuple(found.items()), tuple(stale), tuple(serials), tuple(legacy),
                      report)


def _scan_legacy(block_dirs: Sequence[int]) -> tuple[list[LegacyBlock], int, int]:
    """Verified block files of the old layout; deletes the invalid ones and temp files."""
    legacy: list[LegacyBlock] = []
    invalid = temp_removed = 0
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
                if _legacy_block_verifies(dir_fd, name, digest):
                    legacy.append(LegacyBlock(dir_fd, name, digest))
                else:
                    os.unlink(name, dir_fd=dir_fd)
                    invalid += 1
            except OSError as exc:
                log.warning("nvme scan: skipping %s: %s", name, exc)
    return legacy, invalid, temp_removed


def _legacy_block_verifies(dir_fd: int, name: str, digest: bytes) -> bool:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _FIRST_READ_BYTES, 0)
        try:
            header_size = header_size_from_prefix(head)
            if header_size > len(head):
                head = os.pread(fd, header_size, 0)
            header = FrameHeader.unpack(head)
        except CorruptBlock:
            return False
        return header.key_digest == digest and header.frame_size == size
    finally:
        os.close(fd)
