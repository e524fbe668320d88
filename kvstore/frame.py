"""The on-disk and on-wire format of one KV block: a self-describing, checksummed frame.

Layout (little endian)::

    magic "KVKB" | version u16 | header_len u32                      <- HEADER_PREFIX (10 bytes)
    codec u8 | dtype u8 | flags u8 | ndim u8 | token_count u32 | num_layers u16 | layout_len u8
    layout_id (layout_len bytes) | key_digest 16 bytes | layer_shape (ndim x u32)
    segment table: num_layers x (offset u64, length u64, raw_length u64, compression u8,
                                 checksum of the stored bytes 16 bytes)
    [signed frames only: MAC key id 8 bytes | MAC 32 bytes]
    header checksum: xxh3-64 of every header byte before it
    segments, one per layer, contiguous and in layer order

Segment checksums are xxh3-128, or, in a signed frame (flags bit 0, `FLAG_SIGNED`), BLAKE3
truncated to 128 bits; a signed frame's MAC is a keyed hash of every header byte before it
(kvstore/mac.py), so it covers the segment checksums, the shape and the key binding.

A reader that wants layers [a, b) reads the header, then one contiguous byte range: that is what
makes layer-range reads cheap on disk and on the wire. Every segment is verified against its
checksum before use, and the header against its own, so a bit flip anywhere is caught. Why two
checksums: xxh3 catches accidents at ~80 GB/s, but it is not a cryptographic hash (its secret is
public and its mixing invertible; collisions and second preimages can be built), so a MAC over
xxh3 digests would let whoever can write a frame swap a segment for one with the same digest.
A signed frame's segments are hashed with BLAKE3 instead (second-preimage resistant at 128
bits), still once per read: the MAC itself then costs one small keyed hash of the header.

The key digest binds a frame to the key it was stored under, so a frame served for the wrong key
(renamed file, index bug, replica mix-up) is detected as corrupt rather than used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import blake3
import xxhash
import zstandard

from kvstore.errors import CorruptBlock, InvalidFrame
from kvstore.frame_header import (
    FLAG_SIGNED,
    FORMAT_VERSION,
    HEADER_PREFIX_BYTES,
    MAC_BYTES,
    MAC_KEY_ID_BYTES,
    MAGIC,
    MAX_LAYERS,
    CodecId,
    Compression,
    DType,
    FrameHeader,
    LayerRange,
    SegmentInfo,
    Signer,
    header_size,
    header_size_from_prefix,
    pack_header,
)

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_PREFIX_BYTES",
    "CodecId",
    "DType",
    "Compression",
    "LayerRange",
    "SegmentInfo",
    "FrameHeader",
    "BlockRead",
    "FrameBytes",
    "FLAG_SIGNED",
    "MAC_KEY_ID_BYTES",
    "MAC_BYTES",
    "Signer",
    "build_frame",
    "header_size_from_prefix",
    "segment_checksum",
    "signed_segment_checksum",
    "checksum_of",
    "check_payload_size",
    "checked_frame",
    "verify_pieces",
]

FrameBytes: TypeAlias = bytes | bytearray | memoryview
"""A whole frame, or any part of one, as the buffer it arrived in."""

def segment_checksum(data: bytes | bytearray | memoryview) -> bytes:
    """xxh3-128 of a segment's stored bytes (~80 GB/s here, so verifying every read is cheap)."""
    return xxhash.xxh3_128_digest(data)


def signed_segment_checksum(data: bytes | bytearray | memoryview) -> bytes:
    """BLAKE3 of a signed frame's segment, truncated to 128 bits (see the module doc)."""
    return blake3.blake3(data).digest(16)


def checksum_of(header: FrameHeader) -> Callable[[bytes | bytearray | memoryview], bytes]:
    """The segment checksum a frame's header says its segments carry."""
    return signed_segment_checksum if header.signed else segment_checksum


@dataclass(frozen=True, slots=True)
class BlockRead:
    """The result of reading a block (or a layer range of it) from any tier.

    `payload` holds the stored bytes of the segments of `layers`, back to back, exactly as they
    sit in the frame after the header. Nothing in it is trusted until it has been verified, once:
    `verified` says it was (see `verified_for`), and then nothing hashes it again: not the store,
    not decoding. A tier that checks its reads itself (nvme, remote) returns them marked; the
    store checks every read that arrives unmarked (memory tiers, redis) before it hands it out.
    """

    header: FrameHeader
    layers: LayerRange
    payload: bytes | bytearray | memoryview
    verified: bool = False
    """The payload matched the header (size, every segment's checksum) and the header the key
    it was read for. Set only by `verified_for` (or by code that ran the same checks)."""

    @classmethod
    def from_frame(cls, frame: FrameBytes, layers: LayerRange | None = None) -> BlockRead:
        """Slice a full frame (zero copy) to the segments of `layers` (all when None)."""
        view = memoryview(frame)
        header = FrameHeader.unpack(view)
        want = layers or header.all_layers
        start, stop = header.span(want)
        if len(view) < stop:
            raise CorruptBlock(f"frame truncated: {len(view)} bytes, segments need {stop}")
        return cls(header, want, view[start:stop])

    @property
    def is_complete(self) -> bool:
        return self.layers == self.header.all_layers

    def _segment_view(self, layer: int) -> memoryview:
        if layer not in self.layers:
            raise ValueError(f"layer {layer} not in read range [{self.layers.start}, "
                             f"{self.layers.stop})")
        base = self.header.segments[self.layers.start].offset
        seg = self.header.segments[layer]
        return memoryview(self.payload)[seg.offset - base: seg.offset - base + seg.length]

    def verified_for(self, key_digest: bytes) -> BlockRead:
        """This read, checked and marked verified: the key binding always (a 16-byte compare,
        so a read verified for one key is never taken for another), then, unless it is marked
        already, the payload's size and every segment's checksum. Raises CorruptBlock."""
        self.verify_key(key_digest)
        if self.verified:
            return self
        self.verify()
        return BlockRead(self.header, self.layers, self.payload, True)

    def verify(self) -> None:
        """Check the payload's size and every segment in range against its checksum (a read
        marked `verified` was checked already and is not hashed again); CorruptBlock on any
        mismatch."""
        if self.verified:
            return
        check_payload_size(self.header, self.layers, len(self.payload))
        checksum = checksum_of(self.header)
        view = memoryview(self.payload)
        segments = self.header.segments
        base = segments[self.layers.start].offset
        for layer in range(self.layers.start, self.layers.stop):
            seg = segments[layer]
            start = seg.offset - base
            if checksum(view[start:start + seg.length]) != seg.checksum:
                raise CorruptBlock(f"segment {layer} checksum mismatch")

    def verify_key(self, key_digest: bytes) -> None:
        if self.header.key_digest != key_digest:
            raise CorruptBlock("frame is bound to a different key")

    def segment(self, layer: int) -> bytes | memoryview:
        """The codec payload of one layer, decompressed if it was stored compressed."""
        view = self._segment_view(layer)
        info = self.header.segments[layer]
        if info.compression is Compression.NONE:
            return view
        try:
            out = zstandard.ZstdDecompressor().decompress(view, max_output_size=info.raw_length)
        except zstandard.ZstdError as exc:
            raise CorruptBlock(f"segment {layer} does not decompress") from exc
        if len(out) != info.raw_length:
            raise CorruptBlock(f"segment {layer} decompressed to the wrong size")
        return out

    def to_frame(self) -> bytes:
        """Header + payload as one frame; for a partial read the header still lists all layers."""
        if not self.is_complete:
            raise ValueError("only a complete read can be turned back into a frame")
        return self.header.pack() + bytes(self.payload)


def check_payload_size(header: FrameHeader, layers: LayerRange, size: int) -> int:
    """The one size check of a read: `size` payload bytes must be exactly the segments of
    `layers`. Returns the frame offset the payload starts at; CorruptBlock otherwise."""
    start, stop = header.span(layers)
    if size != stop - start:
        raise CorruptBlock(f"payload is {size} bytes, expected {stop - start}")
    return start


def checked_frame(frame: FrameBytes, key_digest: bytes, *, segments: bool = False
                  ) -> tuple[memoryview, FrameHeader]:
    """A whole frame offered to be stored under a key, checked as every write path checks it:
    a contiguous buffer whose header parses and verifies, exactly the size that header gives,
    bound to `key_digest`; with `segments`, every segment's checksum too. Returns a flat byte
    view of it and its header; InvalidFrame (bad input, not a corrupt copy) otherwise."""
    view = memoryview(frame)
    if not view.c_contiguous:
        raise InvalidFrame("a frame must be a C-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    try:
        header = FrameHeader.unpack(view)
        if header.frame_size != len(view):
            raise InvalidFrame(f"frame is {len(view)} bytes, its header says "
                               f"{header.frame_size}")
        if header.key_digest != key_digest:
            raise InvalidFrame("frame is bound to a different key")
        if segments:
            BlockRead(header, header.all_layers, view[header.header_size:]).verify()
    except InvalidFrame:
        raise
    except CorruptBlock as exc:
        raise InvalidFrame(f"frame does not verify: {exc}") from exc
    return view, header


def verify_pieces(header: FrameHeader, layers: LayerRange,
                  pieces: Sequence[bytes | bytearray | memoryview]) -> None:
    """`BlockRead.verify` for a payload held in pieces (e.g. memory pages, in order): check every
    segment of `layers` against its checksum, hashing across piece boundaries; CorruptBlock on
    any mismatch or a payload of the wrong size."""
    views = [memoryview(p).cast("B") for p in pieces]
    check_payload_size(header, layers, sum(len(v) for v in views))
    checksum = checksum_of(header)
    index, offset = 0, 0  # the piece being consumed, and how far into it
    for layer in range(layers.start, layers.stop):
        info = header.segments[layer]
        need = info.length
        while index < len(views) and offset == len(views[index]):
            index, offset = index + 1, 0
        if need == 0 or offset + need <= len(views[index]):
            digest = checksum(views[index][offset: offset + need] if need else b"")
            offset += need
        else:  # the segment spans pieces: one streaming hash (same digest as one-shot)
            hasher: Any = blake3.blake3() if header.signed else xxhash.xxh3_128()
            while need:
                if offset == len(views[index]):
                    index, offset = index + 1, 0
                take = min(need, len(views[index]) - offset)
                hasher.update(views[index][offset: offset + take])
                offset += take
                need -= take
            digest = hasher.digest(16) if header.signed else hasher.digest()
        if digest != info.checksum:
            raise CorruptBlock(f"segment {layer} checksum mismatch")


def build_frame(
    segments: Sequence[tuple[bytes | bytearray | memoryview, Compression, int]],
    *,
    codec: CodecId,
    dtype: DType,
    layout_id: str,
    token_count: int,
    layer_shape: tuple[int, ...],
    key_digest: bytes,
    signer: Signer | None = None,
) -> bytes:
    """Assemble a frame from per-layer (stored bytes, compression, raw length) triples; with
    `signer`, a signed frame (BLAKE3 segment checksums and a MAC, see the module doc)."""
    if not 1 <= len(segments) <= MAX_LAYERS:
        raise InvalidFrame(f"a frame holds 1-{MAX_LAYERS} layers, got {len(segments)}")
    size = header_size(len(layout_id.encode()), len(layer_shape), len(segments),
                       signer is not None)
    checksum = segment_checksum if signer is None else signed_segment_checksum
    infos: list[SegmentInfo] = []
    offset = size
    for data, compression, raw_length in segments:
        infos.append(SegmentInfo(offset, len(data), raw_length, compression, checksum(data)))
        offset += len(data)
    body, finish = pack_header(codec, dtype, layout_id, token_count, layer_shape, key_digest,
                                infos, None if signer is None else signer.key_id)
    header = finish(b"" if signer is None else signer.tag(body))
    assert len(header) == size
    # One allocation and one copy of each segment: join sizes the result first.
    return b"".join([header, *(data for data, _, _ in segments)])

