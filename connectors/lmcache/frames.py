"""One LMCache object as one kvkeep frame, and the checks a frame read back must pass.

LMCache hands the plugin opaque bytes (a chunk of KV in LMCache's own layout). They are stored
as a frame of kvkeep's format (kvstore/frame.py) with one raw segment: layout id
`OBJECT_FORMAT`, codec raw, no compression, layer shape `(payload bytes,)`, token count 0 and
the dtype field unused (0). So the daemons verify every object exactly as they verify vLLM
blocks (xxh3-128 of the payload, the header's own checksum, the binding to its key), and
nothing but an LMCache client ever takes such a frame for tensors of its own.

A frame is written straight into a caller's buffer (`write_frame`), so a batch of objects is
one reusable allocation and one memory copy per object.
"""

from __future__ import annotations

import ctypes
from functools import cache

import numpy as np

from connectors.lmcache.keys import OBJECT_FORMAT
from kvstore.errors import InvalidFrame
from kvstore.frame import (
    BlockRead,
    CodecId,
    Compression,
    DType,
    FrameHeader,
    SegmentInfo,
    build_frame,
    segment_checksum,
)
from kvstore.keys import BlockKey

__all__ = ["OBJECT_FORMAT", "frame_size", "write_frame", "matches_object", "address_of",
           "byte_view"]

Buffer = bytes | bytearray | memoryview


@cache
def _header_size() -> int:
    # The header's size depends only on the layout id, the number of dims and of segments,
    # never on the payload: measure it once on a one-byte frame (public API only).
    probe = build_frame([(b"\0", Compression.NONE, 1)], codec=CodecId.RAW, dtype=DType(0),
                        layout_id=OBJECT_FORMAT, token_count=0, layer_shape=(1,),
                        key_digest=bytes(16))
    return FrameHeader.unpack(probe).header_size


def frame_size(payload_bytes: int) -> int:
    """Bytes of the frame that stores an object of `payload_bytes`."""
    return _header_size() + payload_bytes


def write_frame(key: BlockKey, payload: Buffer, out: memoryview) -> int:
    """Write the frame of `payload` under `key` into `out` (a 'B' view at least
    `frame_size(len(payload))` long); return its length. Raises InvalidFrame for an empty
    payload or one over 4 GiB (the frame's u32 shape)."""
    view = byte_view(payload)
    size = len(view)
    if not 0 < size < 1 << 32:
        raise InvalidFrame(f"an LMCache object of {size} bytes cannot be stored")
    start = _header_size()
    header = FrameHeader(CodecId.RAW, DType(0), OBJECT_FORMAT, 0, (size,), key.digest,
                         (SegmentInfo(start, size, size, Compression.NONE,
                                      segment_checksum(view)),), start).pack()
    out[:start] = header
    out[start:start + size] = view
    return start + size


def matches_object(read: BlockRead, size: int) -> bool:
    """Whether a verified read holds a whole LMCache object of exactly `size` bytes.

    False for a block of another kind (a vLLM block under a colliding key cannot happen, since
    scopes differ, but a foreign writer could store anything) or another size: the caller's
    buffer could not take it, so it is a miss, not data.
    """
    header = read.header
    return (header.layout_id == OBJECT_FORMAT and header.codec is CodecId.RAW
            and header.num_layers == 1 and read.is_complete
            and header.segments[0].compression is Compression.NONE
            and header.segments[0].length == size and len(read.payload) == size)


def byte_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer (ctypes arrays export '<B')."""
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def address_of(buf: Buffer) -> int:
    """The address of a buffer's first byte: tells whether a read landed in the caller's
    buffer or in one the transport allocated."""
    view = memoryview(buf)
    if not view.readonly and view.nbytes and view.c_contiguous:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))  # a sixth of numpy's cost
    return int(np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0])
