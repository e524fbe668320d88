"""The on-disk and on-wire format of one KV block: a self-describing, checksummed frame.

Layout (little endian)::

    magic "KVKB" | version u16 | header_len u32                      <- HEADER_PREFIX (10 bytes)
    codec u8 | dtype u8 | flags u8 | ndim u8 | token_count u32 | num_layers u16 | layout_len u8
    layout_id (layout_len bytes) | key_digest 16 bytes | layer_shape (ndim x u32)
    segment table: num_layers x (offset u64, length u64, raw_length u64, compression u8,
                                 xxh3-128 checksum of the stored bytes 16 bytes)
    header checksum: xxh3-64 of every header byte before it
    segments, one per layer, contiguous and in layer order

A reader that wants layers [a, b) reads the header, then one contiguous byte range: that is what
makes layer-range reads cheap on disk and on the wire. Every segment is verified against its
checksum before use, and the header against its own, so a bit flip anywhere is caught.

The key digest binds a frame to the key it was stored under, so a frame served for the wrong key
(renamed file, index bug, replica mix-up) is detected as corrupt rather than used.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import xxhash
import zstandard

from kvstore.errors import CorruptBlock, InvalidFrame

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
    "build_frame",
    "header_size_from_prefix",
    "segment_checksum",
    "check_payload_size",
    "checked_frame",
    "verify_pieces",
]

FrameBytes: TypeAlias = bytes | bytearray | memoryview
"""A whole frame, or any part of one, as the buffer it arrived in."""

MAGIC = b"KVKB"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")
HEADER_PREFIX_BYTES = _PREFIX.size
_FIXED = struct.Struct("<BBBBIHB")
_SEGMENT = struct.Struct("<QQQB16s")
_HEADER_CHECKSUM = struct.Struct("<Q")
_MAX_LAYOUT_ID = 64
_MAX_NDIM = 8
_MAX_LAYERS = 4096
# A header past this size is malformed, whatever it claims (4096 layers need ~170 KiB).
_MAX_HEADER_BYTES = 1 << 20


class CodecId(enum.IntEnum):
    """A frame's codec (`kvstore.codecs`); ids are never reused, so old frames stay readable."""

    RAW = 0
    INT8 = 1  # "int8-sym": symmetric, one scale per row (per token and KV head)
    INT8_ASYM = 2
    INT8_KIVI = 3
    INT8_G32 = 4
    INT4 = 5


class DType(enum.IntEnum):
    FLOAT16 = 0
    BFLOAT16 = 1
    FLOAT32 = 2

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2

    @classmethod
    def from_name(cls, name: str) -> DType:
        normal = name.removeprefix("torch.").lower()
        aliases = {"float16": cls.FLOAT16, "half": cls.FLOAT16, "fp16": cls.FLOAT16,
                   "bfloat16": cls.BFLOAT16, "bf16": cls.BFLOAT16,
                   "float32": cls.FLOAT32, "float": cls.FLOAT32, "fp32": cls.FLOAT32}
        try:
            return aliases[normal]
        except KeyError:
            raise InvalidFrame(f"unsupported dtype {name!r}") from None


class Compression(enum.IntEnum):
    NONE = 0
    ZSTD = 1


def segment_checksum(data: bytes | bytearray | memoryview) -> bytes:
    """xxh3-128 of a segment's stored bytes (~80 GB/s here, so verifying every read is cheap)."""
    return xxhash.xxh3_128_digest(data)


@dataclass(frozen=True, slots=True)
class LayerRange:
    """Layers [start, stop) of a block."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"empty or negative layer range [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.stop

    def clamp_check(self, num_layers: int) -> None:
        if self.stop > num_layers:
            raise ValueError(f"layer range [{self.start}, {self.stop}) beyond {num_layers} layers")


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    offset: int
    length: int
    raw_length: int
    compression: Compression
    checksum: bytes


@dataclass(frozen=True, slots=True)
class FrameHeader:
    codec: CodecId
    dtype: DType
    layout_id: str
    token_count: int
    layer_shape: tuple[int, ...]
    key_digest: bytes
    segments: tuple[SegmentInfo, ...]
    header_size: int
    version: int = FORMAT_VERSION

    @property
    def num_layers(self) -> int:
        return len(self.segments)

    @property
    def frame_size(self) -> int:
        return self.header_size + sum(s.length for s in self.segments)

    @property
    def all_layers(self) -> LayerRange:
        return LayerRange(0, self.num_layers)

    def span(self, layers: LayerRange) -> tuple[int, int]:
        """Byte range [start, stop) of the frame that holds the segments of `layers`."""
        layers.clamp_check(self.num_layers)
        first, last = self.segments[layers.start], self.segments[layers.stop - 1]
        return first.offset, last.offset + last.length

    def pack(self) -> bytes:
        return _pack_header(self.codec, self.dtype, self.layout_id, self.token_count,
                            self.layer_shape, self.key_digest, self.segments)

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> FrameHeader:
        """Parse and verify a header from the start of `buf` (which may hold more than it)."""
        return _unpack_header(memoryview(buf))


def header_size_from_prefix(prefix: bytes | bytearray | memoryview) -> int:
    """Total header size, from the first HEADER_PREFIX_BYTES bytes of a frame."""
    if len(prefix) < HEADER_PREFIX_BYTES:
        raise InvalidFrame("frame shorter than its header prefix")
    magic, version, header_len = _PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        raise InvalidFrame("bad frame magic")
    if version != FORMAT_VERSION:
        raise InvalidFrame(f"unsupported frame version {version}")
    if not HEADER_PREFIX_BYTES < header_len <= _MAX_HEADER_BYTES:
        raise InvalidFrame(f"implausible header length {header_len}")
    return int(header_len)


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
        for layer in range(self.layers.start, self.layers.stop):
            if segment_checksum(self._segment_view(layer)) != self.header.segments[layer].checksum:
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
    index, offset = 0, 0  # the piece being consumed, and how far into it
    for layer in range(layers.start, layers.stop):
        info = header.segments[layer]
        need = info.length
        while index < len(views) and offset == len(views[index]):
            index, offset = index + 1, 0
        if need == 0 or offset + need <= len(views[index]):
            digest = segment_checksum(views[index][offset: offset + need] if need else b"")
            offset += need
        else:  # the segment spans pieces: one streaming hash (same digest as one-shot xxh3)
            hasher = xxhash.xxh3_128()
            while need:
                if offset == len(views[index]):
                    index, offset = index + 1, 0
                take = min(need, len(views[index]) - offset)
                hasher.update(views[index][offset: offset + take])
                offset += take
                need -= take
            digest = hasher.digest()
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
) -> bytes:
    """Assemble a frame from per-layer (stored bytes, compression, raw length) triples."""
    if not 1 <= len(segments) <= _MAX_LAYERS:
        raise InvalidFrame(f"a frame holds 1-{_MAX_LAYERS} layers, got {len(segments)}")
    header_size = _header_size(len(layout_id.encode()), len(layer_shape), len(segments))
    infos: list[SegmentInfo] = []
    offset = header_size
    for data, compression, raw_length in segments:
        infos.append(SegmentInfo(offset, len(data), raw_length, compression,
                                 segment_checksum(data)))
        offset += len(data)
    header = _pack_header(codec, dtype, layout_id, token_count, layer_shape, key_digest, infos)
    assert len(header) == header_size
    # One allocation and one copy of each segment: join sizes the result first.
    return b"".join([header, *(data for data, _, _ in segments)])


def _header_size(layout_len: int, ndim: int, num_layers: int) -> int:
    return (HEADER_PREFIX_BYTES + _FIXED.size + layout_len + 16 + 4 * ndim
            + _SEGMENT.size * num_layers + _HEADER_CHECKSUM.size)


def _pack_header(codec: CodecId, dtype: DType, layout_id: str, token_count: int,
                 layer_shape: tuple[int, ...], key_digest: bytes,
                 segments: Sequence[SegmentInfo]) -> bytes:
    layout = layout_id.encode()
    if not 0 < len(layout) <= _MAX_LAYOUT_ID:
        raise InvalidFrame(f"layout id must be 1-{_MAX_LAYOUT_ID} bytes")
    if len(key_digest) != 16:
        raise InvalidFrame("key digest must be 16 bytes")
    if not 0 < len(layer_shape) <= _MAX_NDIM or any(d <= 0 for d in layer_shape):
        raise InvalidFrame(f"bad layer shape {layer_shape}")
    size = _header_size(len(layout), len(layer_shape), len(segments))
    parts = [
        _PREFIX.pack(MAGIC, FORMAT_VERSION, size),
        _FIXED.pack(int(codec), int(dtype), 0, len(layer_shape), token_count, len(segments),
                    len(layout)),
        layout,
        key_digest,
        struct.pack(f"<{len(layer_shape)}I", *layer_shape),
    ]
    parts.extend(_SEGMENT.pack(s.offset, s.length, s.raw_length, int(s.compression), s.checksum)
                 for s in segments)
    body = b"".join(parts)
    return body + _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def _unpack_header(view: memoryview) -> FrameHeader:
    size = header_size_from_prefix(view[:HEADER_PREFIX_BYTES])
    if len(view) < size:
        raise InvalidFrame(f"header truncated: need {size} bytes, have {len(view)}")
    body = view[: size - _HEADER_CHECKSUM.size]
    (stored_sum,) = _HEADER_CHECKSUM.unpack_from(view, size - _HEADER_CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(body) != stored_sum:
        raise CorruptBlock("frame header checksum mismatch")
    pos = HEADER_PREFIX_BYTES
    codec_v, dtype_v, _flags, ndim, token_count, num_layers, layout_len = _FIXED.unpack_from(
        view, pos)
    pos += _FIXED.size
    if size != _header_size(layout_len, ndim, num_layers):
        raise InvalidFrame("header length disagrees with its contents")
    try:
        codec, dtype = CodecId(codec_v), DType(dtype_v)
        layout_id = bytes(view[pos: pos + layout_len]).decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidFrame(f"bad header field: {exc}") from exc
    pos += layout_len
    key_digest = bytes(view[pos: pos + 16])
    pos += 16
    layer_shape = struct.unpack_from(f"<{ndim}I", view, pos)
    pos += 4 * ndim
    segments: list[SegmentInfo] = []
    expected_offset = size
    for _ in range(num_layers):
        offset, length, raw_length, comp, checksum = _SEGMENT.unpack_from(view, pos)
        pos += _SEGMENT.size
        if offset != expected_offset:
            raise InvalidFrame("segments are not contiguous")
        try:
            compression = Compression(comp)
        except ValueError as exc:
            raise InvalidFrame(f"unknown compression {comp}") from exc
        segments.append(SegmentInfo(offset, length, raw_length, compression, checksum))
        expected_offset += length
    if num_layers == 0 or ndim == 0:
        raise InvalidFrame("frame has no layers or no shape")
    return FrameHeader(codec, dtype, layout_id, token_count, tuple(layer_shape), key_digest,
                       tuple(segments), size)
