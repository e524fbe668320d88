"""Damage blocks where an nvme tier (a daemon's, a connector's) keeps them on disk, as a failing
disk would: one byte of one block's frame in its pack, or of every frame under a directory.
Blocks are found the way the tier's own start-up scan finds them (kvstore.tiers.nvme.recovery)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvstore.tiers.nvme.packs import aligned
from kvstore.tiers.nvme.recovery import find_block, pack_blocks

__all__ = ["digests_on_disk", "wait_on_disk", "flip_byte", "flip_every_frame", "erase",
           "rewrite"]


def digests_on_disk(data_dir: Path) -> list[bytes]:
    """The key digests of every block on disk under `data_dir` (a digest twice if it is)."""
    return [header.key_digest for _, _, header in pack_blocks(data_dir)]


def wait_on_disk(data_dir: Path, digest: bytes, timeout: float = 10.0) -> None:
    """Until a block is on disk (a daemon writes its disk copy behind its answer)."""
    deadline = time.monotonic() + timeout
    while find_block(data_dir, digest) is None:
        assert time.monotonic() < deadline, f"{digest.hex()} never reached {data_dir}'s disk"
        time.sleep(0.05)


def flip_byte(data_dir: Path, digest: bytes, at: int, mask: int = 0xFF) -> None:
    """XOR one byte of a block's frame on disk with `mask`; `at` counts from the frame's end
    when negative."""
    found = find_block(data_dir, digest)
    assert found is not None, f"{digest.hex()} is not on {data_dir}'s disk"
    path, offset, size = found
    _flip(path, offset + (at % size), mask)


def erase(data_dir: Path, digest: bytes) -> None:
    """Zero a block's frame on disk: the block is gone (a miss to its tier), as a block file
    deleted behind the tier's back was before packs."""
    found = find_block(data_dir, digest)
    assert found is not None, f"{digest.hex()} is not on {data_dir}'s disk"
    path, offset, size = found
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(size), offset)
    finally:
        os.close(fd)


def rewrite(data_dir: Path, digest: bytes, frame: bytes) -> None:
    """Write `frame` in place of a block's frame on disk (no larger than the pages the block
    had): what whoever can write the disk could do."""
    found = find_block(data_dir, digest)
    assert found is not None, f"{digest.hex()} is not on {data_dir}'s disk"
    path, offset, size = found
    assert aligned(len(frame)) <= aligned(size), "a frame larger than the block's place"
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, frame, offset)
    finally:
        os.close(fd)


def flip_every_frame(data_dir: Path) -> int:
    """Flip a byte in the middle (inside the payload) of every frame under `data_dir`, so
    every stored frame fails its checksum; returns how many."""
    found = list(pack_blocks(data_dir))
    for path, offset, header in found:
        _flip(path, offset + header.frame_size // 2, 0xFF)
    return len(found)


def _flip(path: Path, offset: int, mask: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ mask]), offset)
    finally:
        os.close(fd)
