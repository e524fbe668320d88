"""The header of a block frame (kvstore/frame.py): its fields, and its encoding.

See kvstore/frame.py for the layout and for why signed frames exist; this module only packs and
unpacks headers (checking their own checksum and internal consistency), and knows nothing of
segment contents.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import xxhash

from kvstore.errors import CorruptBlock, InvalidFrame

__all__ = ["MAGIC", "FORMAT_VERSION", "HEADER_PREFIX_BYTES", "MAX_LAYERS", "FLAG_SIGNED",
           "MAC_KEY_ID_BYTES", "MAC_BYTES", "CodecId", "DType", "Compression", "LayerRange",
           "SegmentInfo", "FrameHeader", "Signer", "header_size_from_prefix", "header_size",
           "pack_header"]

MAGIC = b"KVKB"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")
HEADER_PREFIX_BYTES = _PREFIX.size
_FIXED = struct.Struct("<BBBBIHB")
_SEGMENT = struct.Struct("<QQQB16s")
_HEADER_CHECKSUM = struct.Struct("<Q")
_MAX_LAYOUT_ID = 64
_MAX_NDIM = 8
MAX_LAYERS = 4096
# A header past this size is malformed, whatever it claims (4096 layers need ~170 KiB).
_MAX_HEADER_BYTES = 1 << 20
FLAG_SIGNED = 0x01
"""Header flag: BLAKE3 segment checksums and a MAC trailer (kvstore/mac.py)."""
MAC_KEY_ID_BYTES = 8
MAC_BYTES = 32
_MAC_TRAILER = MAC_KEY_ID_BYTES + MAC_BYTES

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


_COMPRESSION_OF = {int(c): c for c in Compression}
_new_tuple = tuple.__new__


class Signer(Protocol):
    """Whoever signs frames (kvstore/mac.py's `MacKey`): an id for its key, and a MAC."""

    @property
    def key_id(self) -> bytes: ...

    def tag(self, data: bytes) -> bytes: ...


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


class SegmentInfo(NamedTuple):
    """One layer's segment as its frame's header describes it. A named tuple, not a frozen
    dataclass: a reader builds one per layer of every block it reads, and a frozen dataclass's
    `__init__` (one `object.__setattr__` a field) was a tenth of a remote read's client CPU with
    32 layers (py-spy, 32 x 256 KiB `RemoteTier.get_into`); `unpack_header` builds them with
    `tuple.__new__`, cheaper still."""

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
    mac_key_id: bytes = b""
    """Signed frames: the id of the key that signed it (kvstore/mac.py); b"" otherwise."""
    mac: bytes = b""
    """Signed frames: the MAC of every header byte before it."""
    _packed: bytes | None = field(default=None, init=False, repr=False, compare=False)
    """`pack()`'s bytes, kept: a daemon sends a stored block's header with every GET, and
    packing it was ~10% of the daemon's time per GET of a 256 KiB block."""

    @property
    def signed(self) -> bool:
        return bool(self.mac)

    def mac_input(self) -> bytes:
        """The header bytes a signed frame's MAC covers: all of them before the MAC."""
        return pack_header(self.codec, self.dtype, self.layout_id, self.token_count,
                            self.layer_shape, self.key_digest, self.segments,
                            self.mac_key_id if self.signed else None)[0]

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
        packed = self._packed
        if packed is None:
            _, finish = pack_header(self.codec, self.dtype, self.layout_id, self.token_count,
                                    self.layer_shape, self.key_digest, self.segments,
                                    self.mac_key_id if self.signed else None)
            packed = finish(self.mac)
            object.__setattr__(self, "_packed", packed)  # immutable: always the same bytes
        return packed

    @classmethod
    def unpack(cls, buf: bytes | bytearray | memoryview) -> FrameHeader:
        """Parse and verify a header from the start of `buf` (which may hold more than it)."""
        return unpack_header(memoryview(buf))


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


def header_size(layout_len: int, ndim: int, num_layers: int, signed: bool) -> int:
    return (HEADER_PREFIX_BYTES + _FIXED.size + layout_len + 16 + 4 * ndim
            + _SEGMENT.size * num_layers + (_MAC_TRAILER if signed else 0)
            + _HEADER_CHECKSUM.size)


def pack_header(codec: CodecId, dtype: DType, layout_id: str, token_count: int,
                 layer_shape: tuple[int, ...], key_digest: bytes,
                 segments: Sequence[SegmentInfo], mac_key_id: bytes | None
                 ) -> tuple[bytes, Callable[[bytes], bytes]]:
    """The header bytes a MAC covers (everything before the MAC; the key id included), and
    how to finish the header from there given the MAC (b"" for an unsigned frame)."""
    layout = layout_id.encode()
    if not 0 < len(layout) <= _MAX_LAYOUT_ID:
        raise InvalidFrame(f"layout id must be 1-{_MAX_LAYOUT_ID} bytes")
    if len(key_digest) != 16:
        raise InvalidFrame("key digest must be 16 bytes")
    if not 0 < len(layer_shape) <= _MAX_NDIM or any(d <= 0 for d in layer_shape):
        raise InvalidFrame(f"bad layer shape {layer_shape}")
    signed = mac_key_id is not None
    if signed and len(mac_key_id or b"") != MAC_KEY_ID_BYTES:
        raise InvalidFrame(f"a MAC key id is {MAC_KEY_ID_BYTES} bytes")
    size = header_size(len(layout), len(layer_shape), len(segments), signed)
    parts = [
        _PREFIX.pack(MAGIC, FORMAT_VERSION, size),
        _FIXED.pack(int(codec), int(dtype), FLAG_SIGNED if signed else 0, len(layer_shape),
                    token_count, len(segments), len(layout)),
        layout,
        key_digest,
        struct.pack(f"<{len(layer_shape)}I", *layer_shape),
    ]
    parts.extend(_SEGMENT.pack(s.offset, s.length, s.raw_length, int(s.compression), s.checksum)
                 for s in segments)
    if mac_key_id is not None:
        parts.append(mac_key_id)
    signed_part = b"".join(parts)

    def finish(mac: bytes) -> bytes:
        if len(mac) != (MAC_BYTES if signed else 0):
            raise InvalidFrame(f"a MAC is {MAC_BYTES} bytes, in signed frames only")
        body = signed_part + mac
        return body + _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))

    return signed_part, finish


def unpack_header(view: memoryview) -> FrameHeader:
    size = header_size_from_prefix(view[:HEADER_PREFIX_BYTES])
    if len(view) < size:
        raise InvalidFrame(f"header truncated: need {size} bytes, have {len(view)}")
    body = view[: size - _HEADER_CHECKSUM.size]
    (stored_sum,) = _HEADER_CHECKSUM.unpack_from(view, size - _HEADER_CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(body) != stored_sum:
        raise CorruptBlock("frame header checksum mismatch")
    pos = HEADER_PREFIX_BYTES
    codec_v, dtype_v, flags, ndim, token_count, num_layers, layout_len = _FIXED.unpack_from(
        view, pos)
    pos += _FIXED.size
    if flags & ~FLAG_SIGNED:
        raise InvalidFrame(f"unknown frame flags {flags:#x}")
    signed = bool(flags & FLAG_SIGNED)
    if size != header_size(layout_len, ndim, num_layers, signed):
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
    table_end = pos + _SEGMENT.size * num_layers
    for offset, length, raw_length, comp, checksum in _SEGMENT.iter_unpack(view[pos:table_end]):
        if offset != expected_offset:
            raise InvalidFrame("segments are not contiguous")
        compression = _COMPRESSION_OF.get(comp)  # a dict: Compression(comp) costs ~1 us a layer
        if compression is None:
            raise InvalidFrame(f"unknown compression {comp}")
        # tuple.__new__ straight: SegmentInfo(...) goes through namedtuple's Python-level
        # __new__, ~0.8 us a layer here (a tenth of a 32-layer block's read).
        segments.append(_new_tuple(SegmentInfo, (offset, length, raw_length, compression,
                                                 checksum)))
        expected_offset += length
    pos = table_end
    if num_layers == 0 or ndim == 0:
        raise InvalidFrame("frame has no layers or no shape")
    key_id = mac = b""
    if signed:
        key_id = bytes(view[pos: pos + MAC_KEY_ID_BYTES])
        mac = bytes(view[pos + MAC_KEY_ID_BYTES: pos + _MAC_TRAILER])
    return FrameHeader(codec, dtype, layout_id, token_count, tuple(layer_shape), key_digest,
                       tuple(segments), size, mac_key_id=key_id, mac=mac)
