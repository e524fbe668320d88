"""The nvme tier's read of one block file: the header, then only the byte range of the wanted
segments, verified where a bad file can still be deleted (by the tier, on CorruptBlock)."""

from __future__ import annotations

import os
import threading

from kvstore.errors import CorruptBlock
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.tiers.base import Buffer
from kvstore.tiers.nvme.block_index import IndexEntry
from kvstore.tiers.nvme.durable_files import drop_cache, read_into

__all__ = ["read_block"]

_local = threading.local()


def read_block(fd: int, digest: bytes, entry: IndexEntry, layers: LayerRange | None,
               out: Buffer | None, *, deadline: float | None, drop_page_cache: bool
               ) -> BlockRead:
    """Read and verify a block (or the segments of `layers`) from an open file, straight into
    the first bytes of `out` when given; the result is marked verified, so neither the store
    nor decoding hashes it again. Raises CorruptBlock, DeadlineExceeded, OSError, and
    ValueError when `out` is too small or `layers` goes past the block's layers."""
    header_view = _header_buffer(entry.header_size)
    if os.preadv(fd, [header_view], 0) != entry.header_size:
        raise CorruptBlock("block file shorter than its header")
    header = FrameHeader.unpack(header_view)
    if header.frame_size != entry.size or header.key_digest != digest:
        raise CorruptBlock("block header disagrees with the index")
    wanted = layers or header.all_layers
    start, stop = header.span(wanted)
    length = stop - start
    if out is None:
        target = memoryview(bytearray(length))
    else:
        view = memoryview(out).cast("B")
        if len(view) < length:
            raise ValueError(f"out buffer holds {len(view)} bytes, the read needs {length}")
        target = view[:length]
    if read_into(fd, target, start, deadline=deadline) != length:
        raise CorruptBlock("block file is truncated")
    if drop_page_cache:
        drop_cache(fd)
    return BlockRead(header, wanted, target).verified_for(digest)


def _header_buffer(size: int) -> memoryview:
    """A per-thread reusable buffer for headers: no allocation per read."""
    buf: bytearray | None = getattr(_local, "header", None)
    if buf is None or len(buf) < size:
        buf = bytearray(max(size, 4096))
        _local.header = buf
    return memoryview(buf)[:size]
