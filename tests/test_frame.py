"""The frame format on its own: fields round trip, layer ranges, and every corruption is caught."""

from __future__ import annotations

import struct

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import CorruptBlock, InvalidFrame
from kvstore.frame import (
    FORMAT_VERSION,
    HEADER_PREFIX_BYTES,
    MAGIC,
    BlockRead,
    CodecId,
    Compression,
    DType,
    FrameHeader,
    LayerRange,
    build_frame,
    header_size_from_prefix,
)

KEY = bytes(range(16))


def make_frame(segments: list[bytes], *, compress: frozenset[int] | set[int] = frozenset(),
               codec: CodecId = CodecId.RAW, dtype: DType = DType.FLOAT16,
               layout_id: str = "tok-head-dim", token_count: int = 16,
               layer_shape: tuple[int, ...] = (16, 2, 4)) -> bytes:
    triples = []
    for i, seg in enumerate(segments):
        if i in compress:
            triples.append((zstandard.ZstdCompressor(level=1).compress(seg), Compression.ZSTD,
                            len(seg)))
        else:
            triples.append((seg, Compression.NONE, len(seg)))
    return build_frame(triples, codec=codec, dtype=dtype, layout_id=layout_id,
                       token_count=token_count, layer_shape=layer_shape, key_digest=KEY)


def read_all(frame: bytes | bytearray, layers: LayerRange | None = None) -> list[bytes]:
    read = BlockRead.from_frame(frame, layers)
    read.verify()
    return [bytes(read.segment(i)) for i in range(read.layers.start, read.layers.stop)]


SEGMENTS = [bytes([i]) * (10 + 7 * i) + bytes(range(i * 3)) for i in range(4)]


@settings(max_examples=50, deadline=None)
@given(
    segments=st.lists(st.binary(min_size=0, max_size=64), min_size=1, max_size=6),
    compress=st.sets(st.integers(0, 5)),
    codec=st.sampled_from(list(CodecId)),
    dtype=st.sampled_from(list(DType)),
    layout_id=st.text(st.characters(codec="ascii", min_codepoint=33), min_size=1, max_size=64),
    token_count=st.integers(0, 2**32 - 1),
    layer_shape=st.lists(st.integers(1, 2**32 - 1), min_size=1, max_size=8).map(tuple),
)
def test_fields_and_segments_round_trip(segments: list[bytes], compress: set[int],
                                        codec: CodecId, dtype: DType, layout_id: str,
                                        token_count: int, layer_shape: tuple[int, ...]) -> None:
    frame = make_frame(segments, compress=compress, codec=codec, dtype=dtype,
                       layout_id=layout_id, token_count=token_count, layer_shape=layer_shape)
    header = FrameHeader.unpack(frame)
    assert (header.codec, header.dtype, header.layout_id, header.token_count,
            header.layer_shape, header.key_digest, header.version) == (
        codec, dtype, layout_id, token_count, layer_shape, KEY, FORMAT_VERSION)
    assert header.num_layers == len(segments) and header.frame_size == len(frame)
    assert header.pack() == frame[: header.header_size]
    assert header_size_from_prefix(frame[:HEADER_PREFIX_BYTES]) == header.header_size
    assert read_all(frame) == segments
    assert BlockRead.from_frame(frame).to_frame() == frame


def test_layer_range_reads_only_their_segments() -> None:
    frame = make_frame(SEGMENTS, compress={2})
    header = FrameHeader.unpack(frame)
    for start in range(4):
        for stop in range(start + 1, 5):
            want = LayerRange(start, stop)
            read = BlockRead.from_frame(frame, want)
            lo, hi = header.span(want)
            assert bytes(read.payload) == frame[lo:hi]
            assert read_all(frame, want) == SEGMENTS[start:stop]
            assert read.is_complete == (start == 0 and stop == 4)
            # A tier hands over just the header and the range's bytes: same result.
            tier_read = BlockRead(header, want, frame[lo:hi])
            tier_read.verify()
    partial = BlockRead.from_frame(frame, LayerRange(1, 3))
    with pytest.raises(ValueError):
        partial.segment(0)
    with pytest.raises(ValueError):
        partial.to_frame()
    with pytest.raises(ValueError):
        BlockRead.from_frame(frame, LayerRange(2, 5))


def test_layer_range_validation() -> None:
    for start, stop in ((0, 0), (3, 2), (-1, 2)):
        with pytest.raises(ValueError):
            LayerRange(start, stop)
    r = LayerRange(2, 5)
    assert len(r) == 3 and 2 in r and 5 not in r and "3" not in r


def test_every_single_bit_flip_is_detected() -> None:
    """Exhaustive: every bit of a small frame (header, segment table, plain and zstd segments)."""
    frame = bytearray(make_frame(SEGMENTS, compress={1, 3}))
    assert read_all(frame) == SEGMENTS
    for bit in range(len(frame) * 8):
        frame[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptBlock):
            read_all(frame)
        frame[bit // 8] ^= 1 << (bit % 8)
    assert read_all(frame) == SEGMENTS


def test_every_truncation_is_detected() -> None:
    frame = make_frame(SEGMENTS, compress={0})
    for size in range(len(frame)):
        with pytest.raises(CorruptBlock):
            read_all(frame[:size])


def test_payload_of_the_wrong_length_is_refused() -> None:
    frame = make_frame(SEGMENTS)
    header = FrameHeader.unpack(frame)
    lo, hi = header.span(header.all_layers)
    for payload in (frame[lo:hi - 1], frame[lo:hi] + b"\0"):
        with pytest.raises(CorruptBlock):
            BlockRead(header, header.all_layers, payload).verify()


def test_malformed_prefixes_are_invalid_frames() -> None:
    frame = make_frame(SEGMENTS)
    size = header_size_from_prefix(frame)
    cases = [
        b"XXXX" + frame[4:],                                          # magic
        frame[:4] + struct.pack("<H", FORMAT_VERSION + 1) + frame[6:],  # version
        frame[:6] + struct.pack("<I", 5) + frame[10:],                # header shorter than prefix
        frame[:6] + struct.pack("<I", 1 << 30) + frame[10:],          # absurd header length
        frame[: HEADER_PREFIX_BYTES - 1],                             # no full prefix
        frame[: size - 1],                                            # header cut short
    ]
    for bad in cases:
        with pytest.raises(InvalidFrame):
            BlockRead.from_frame(bad)
    assert frame.startswith(MAGIC)


def test_a_checksummed_but_undecompressable_segment_is_corrupt() -> None:
    garbage = b"not zstd at all"
    frame = build_frame([(garbage, Compression.ZSTD, 100)], codec=CodecId.RAW,
                        dtype=DType.FLOAT16, layout_id="x", token_count=1, layer_shape=(50,),
                        key_digest=KEY)
    read = BlockRead.from_frame(frame)
    read.verify()  # the checksum is right: the writer stored garbage
    with pytest.raises(CorruptBlock):
        read.segment(0)
    packed = zstandard.ZstdCompressor().compress(b"a" * 100)
    for claimed in (99, 101):  # decompresses, but not to the size the table claims
        frame = build_frame([(packed, Compression.ZSTD, claimed)], codec=CodecId.RAW,
                            dtype=DType.FLOAT16, layout_id="x", token_count=1,
                            layer_shape=(50,), key_digest=KEY)
        with pytest.raises(CorruptBlock):
            BlockRead.from_frame(frame).segment(0)


def test_key_binding() -> None:
    read = BlockRead.from_frame(make_frame(SEGMENTS))
    read.verify_key(KEY)
    with pytest.raises(CorruptBlock):
        read.verify_key(bytes(16))


def test_build_frame_refuses_what_the_header_cannot_hold() -> None:
    ok = dict(codec=CodecId.RAW, dtype=DType.FLOAT16, layout_id="x", token_count=1,
              layer_shape=(4,), key_digest=KEY)
    seg = [(b"abcd", Compression.NONE, 4)]
    build_frame(seg, **ok)  # type: ignore[arg-type]
    bad = [dict(ok, layout_id=""), dict(ok, layout_id="x" * 65), dict(ok, key_digest=b"k"),
           dict(ok, layer_shape=()), dict(ok, layer_shape=(0,)), dict(ok, layer_shape=(1,) * 9)]
    for kwargs in bad:
        with pytest.raises(InvalidFrame):
            build_frame(seg, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidFrame):
        build_frame([], **ok)  # type: ignore[arg-type]


def test_dtype_names() -> None:
    for name, dtype in (("float16", DType.FLOAT16), ("torch.bfloat16", DType.BFLOAT16),
                        ("bf16", DType.BFLOAT16), ("FP32", DType.FLOAT32)):
        assert DType.from_name(name) is dtype
    assert [d.itemsize for d in DType] == [2, 2, 4]
    with pytest.raises(InvalidFrame):
        DType.from_name("int8")


def test_checked_frame_is_the_one_check_of_every_write_path() -> None:
    import numpy as np

    from kvstore.frame import checked_frame
    from tests.blockframes import block_key
    from tests.blockframes import make_frame as keyed_frame

    key = block_key(1)
    good = keyed_frame(key)
    view, header = checked_frame(good, key.digest, segments=True)
    assert bytes(view) == good and header.frame_size == len(good)
    even = next(f for f in (keyed_frame(key, segment_bytes=n) for n in (1024, 1025))
                if len(f) % 2 == 0)
    view, _ = checked_frame(np.frombuffer(even, np.uint16), key.digest)  # any contiguous buffer
    assert bytes(view) == even
    strided = memoryview(bytearray(good * 2))[::2]
    bad_payload = bytearray(good)
    bad_payload[-1] ^= 1
    bad_header = bytearray(good)
    bad_header[20] ^= 1
    for frame, digest in [(strided, key.digest), (good + b"x", key.digest),
                          (good[:-1], key.digest), (good, block_key(2).digest),
                          (bytes(bad_header), key.digest), (b"junk" * 10, key.digest)]:
        with pytest.raises(InvalidFrame):
            checked_frame(frame, digest)
    checked_frame(bytes(bad_payload), key.digest)  # the header alone is fine ...
    with pytest.raises(InvalidFrame):  # ... the segments are not
        checked_frame(bytes(bad_payload), key.digest, segments=True)
