"""The nvme tier's read of one block from its pack: the header, then only the byte range of the
wanted segments, verified where a bad block can still be dropped (by the tier, on CorruptBlock).

Where the pack holds no frame at all at the block's place (it ends before it, or the bytes there
do not start a frame: a hole punched by the tier's own removal racing the read, or pages a crash
left unwritten) the block is gone, as a file deleted behind the tier's back was before packs: a
miss, not corruption. A frame that is there but fails its checksums is corruption."""

from __future__ import annotations

import os
import threading

from kvstore.errors import CorruptBlock
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.frame_header import MAGIC
from kvstore.tiers.base import Buffer
from kvstore.tiers.nvme.block_index import IndexEntry
from kvstore.tiers.nvme.durable_files import drop_cache, read_into

__all__ = ["read_block"]

_local = threading.local()


def read_block(fd: int, digest: bytes, entry: IndexEntry, layers: LayerRange | None,
               out: Buffer | None, *, deadline: float | None, drop_page_cache: bool
               ) -> BlockRead | None:
    """Read and verify a block (or the segments of `layers`) from its open pack, straight into
    the first bytes of `out` when given; the result is marked verified, so neither the store
    nor decoding hashes it again; None where no frame is there. Raises CorruptBlock,
    DeadlineExceeded, OSError, and ValueError when `out` is too small or `layers` goes past the
    block's layers."""
    header_view = _header_buffer(entry.header_size)
    got = os.preadv(fd, [header_view], entry.offset)
    if got != entry.header_size or header_view[:len(MAGIC)] != MAGIC:
        return None
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
    if read_into(fd, target, entry.offset + start, deadline=deadline) != length:
        raise CorruptBlock("pack ends inside a block")
    if drop_page_cache:
        drop_cache(fd, entry.offset, entry.size)
    return BlockRead(header, wanted, target).verified_for(digest)


def _header_buffer(size: int) -> memoryview:
    """A per-thread reusable buffer for headers: no allocation per read."""
    buf: bytearray | None = getattr(_local, "header", None)
    if buf is None or len(buf) < size:
        buf = bytearray(max(size, 4096))
        _local.header = buf
    return memoryview(buf)[:size]
