"""Blocks: layers to one frame and back, compression policy, and integrity end to end."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import block
from kvstore.block import (
    decode_frame,
    decode_layer,
    decode_layer_batch,
    decode_layers,
    encode_block,
)
from kvstore.codecs import Int8Codec, warmup
from kvstore.errors import CodecError, CorruptBlock
from kvstore.frame import BlockRead, CodecId, Compression, DType, LayerRange, build_frame
from kvstore.keys import BlockHash, BlockKey, Namespace

KEY = BlockKey(bytes(16), Namespace("tenant-a"), BlockHash(b"\x01" * 32))
OTHER_KEY = BlockKey(bytes(16), Namespace("tenant-b"), BlockHash(b"\x01" * 32))
TORCH = {DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16,
         DType.FLOAT32: torch.float32}


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    warmup()


def gaussian_layers(n: int, shape: tuple[int, ...], dtype: DType = DType.FLOAT16,
                    seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(TORCH[dtype]) for _ in range(n)]


def compressible_layers(n: int, shape: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    """Few distinct values and many zeros: zstd saves far more than 10 % for both codecs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.round(torch.randn(shape, generator=gen) * 2) / 2
        x[torch.rand(shape, generator=gen) < 0.6] = 0
        out.append(x.half())
    return out


def encode(layers: list[Any], codec: str = "int8", compression: Any = "auto",
           **kwargs: Any) -> bytes:
    shape = tuple(layers[0].shape)
    return encode_block(layers, codec=codec, key=KEY, token_count=shape[0],
                        layout_id="tok-kvhead-dim", compression=compression, **kwargs)


def as_float64(x: Any) -> np.ndarray[Any, Any]:
    return np.asarray(x.double() if isinstance(x, torch.Tensor) else x.astype(np.float64))


# ------------------------------------------------------------------------------- round trips


@settings(max_examples=30, deadline=None)
@given(codec=st.sampled_from(["raw", "int8"]),
       compression=st.sampled_from(["auto", "none", "zstd"]),
       dtype=st.sampled_from(list(DType)), layers=st.integers(1, 5),
       shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
       compressible=st.booleans())
def test_round_trip(codec: str, compression: Any, dtype: DType, layers: int,
                    shape: tuple[int, ...], compressible: bool) -> None:
    xs = compressible_layers(layers, shape) if compressible else gaussian_layers(layers, shape)
    xs = [x.to(TORCH[dtype]) for x in xs]
    frame = encode(xs, codec, compression)
    read = BlockRead.from_frame(frame)
    header = read.header
    assert (header.codec, header.dtype, header.layer_shape, header.num_layers,
            header.layout_id, header.token_count, header.key_digest) == (
        CodecId[codec.upper()], dtype, shape, layers, "tok-kvhead-dim", shape[0], KEY.digest)
    if compression == "none":
        assert all(s.compression is Compression.NONE for s in header.segments)
    decoded = decode_layers(read, key=KEY, device="cpu")
    assert len(decoded) == layers
    for x, y in zip(xs, decoded, strict=True):
        assert y.dtype == x.dtype and y.shape == x.shape
        if codec == "raw":
            assert torch.equal(x.view(torch.uint8) if x.dtype != torch.float32 else x,
                               y.view(torch.uint8) if y.dtype != torch.float32 else y)
        else:
            step = x.double().abs().amax(dim=-1, keepdim=True) / 127
            assert torch.all((x.double() - y.double()).abs() <= step * 0.51 + 1e-6
                             + y.double().abs() * 2.0**-8)


def test_numpy_bf16_bits_and_torch_bf16_give_the_same_frame() -> None:
    xs = gaussian_layers(3, (4, 2, 8), DType.BFLOAT16)
    bits = [x.view(torch.int16).numpy().view(np.uint16) for x in xs]
    for codec in ("raw", "int8"):
        assert encode(xs, codec) == encode(bits, codec, dtype="bfloat16")
        back = decode_frame(encode(bits, codec, dtype=DType.BFLOAT16), key=KEY)
        assert all(isinstance(b, np.ndarray) and b.dtype == np.uint16 for b in back)


# ------------------------------------------------------------------------------- compression


def test_compression_policy() -> None:
    shape = (32, 8, 128)
    noisy = gaussian_layers(4, shape)
    regular = compressible_layers(4, shape)
    for codec in ("raw", "int8"):
        def kinds(layers: list[torch.Tensor], mode: str, c: str = codec) -> list[Compression]:
            return [s.compression for s in BlockRead.from_frame(
                encode(layers, c, mode)).header.segments]
        # Gaussian fp16 saves under 10 % with zstd-1: stored raw whatever the mode.
        assert kinds(noisy, "auto") == [Compression.NONE] * 4
        assert kinds(noisy, "zstd") == [Compression.NONE] * 4
        assert kinds(regular, "auto") == [Compression.ZSTD] * 4
        assert kinds(regular, "zstd") == [Compression.ZSTD] * 4
        assert kinds(regular, "none") == [Compression.NONE] * 4
        # "auto" decides from the first layer alone; "zstd" looks at each one.
        mixed = [noisy[0], regular[1], noisy[2], regular[3]]
        assert kinds(mixed, "auto") == [Compression.NONE] * 4
        assert kinds(mixed, "zstd") == [Compression.NONE, Compression.ZSTD] * 2
        mixed = [regular[0], noisy[1], regular[2], noisy[3]]
        assert kinds(mixed, "auto") == [Compression.ZSTD, Compression.NONE] * 2
    with pytest.raises(CodecError):
        encode(regular, compression="lz4")


def test_compressed_frames_are_smaller_and_decode_the_same() -> None:
    xs = compressible_layers(3, (16, 4, 32))
    plain, packed = encode(xs, "raw", "none"), encode(xs, "raw", "zstd")
    assert len(packed) < 0.9 * len(plain)
    for a, b in zip(decode_frame(plain, key=KEY), decode_frame(packed, key=KEY), strict=True):
        assert np.array_equal(a, b)


# --------------------------------------------------------------------------------- integrity


def test_ten_thousand_random_bit_flips_are_always_detected() -> None:
    """Single-bit flips anywhere in stored frames: header, segment table, plain and zstd segments.

    A third of each frame's flips land in its header (prefix, fields, segment table, header
    checksum), the rest anywhere. Every one must fail `from_frame` + `verify` (CorruptBlock, or
    its subclass InvalidFrame); every 20th is also pushed through the decode path, which must
    refuse it on its own.
    """
    rng = np.random.default_rng(1234)
    frames = []
    for codec in ("raw", "int8"):
        frames.append(encode(gaussian_layers(3, (8, 2, 16)), codec, "none"))
        zipped = encode(compressible_layers(3, (8, 2, 16)), codec, "zstd")
        assert any(s.compression is Compression.ZSTD
                   for s in BlockRead.from_frame(zipped).header.segments)
        frames.append(zipped)
    flips = 0
    for original in frames:
        frame = bytearray(original)
        header_size = BlockRead.from_frame(frame).header.header_size
        positions = np.concatenate([rng.integers(0, header_size * 8, 850),
                                    rng.integers(0, len(frame) * 8, 1700)])
        for n, bit in enumerate(positions.tolist()):
            frame[bit // 8] ^= 1 << (bit % 8)
            with pytest.raises(CorruptBlock):
                BlockRead.from_frame(frame).verify()
            if n % 20 == 0:
                with pytest.raises(CorruptBlock):
                    decode_frame(frame, key=KEY)
            frame[bit // 8] ^= 1 << (bit % 8)
            flips += 1
        assert frame == original
        decode_frame(frame, key=KEY)  # untouched again: decodes
    assert flips >= 10_000


def test_truncated_frames_are_detected() -> None:
    frame = encode(gaussian_layers(3, (4, 2, 8)), "int8", "none")
    for size in range(len(frame)):
        with pytest.raises(CorruptBlock):
            BlockRead.from_frame(frame[:size]).verify()
        with pytest.raises(CorruptBlock):
            decode_frame(frame[:size], key=KEY)


def test_a_frame_read_for_the_wrong_key_is_refused() -> None:
    frame = encode(gaussian_layers(2, (4, 2, 8)))
    read = BlockRead.from_frame(frame)
    with pytest.raises(CorruptBlock):
        read.verify_key(OTHER_KEY.digest)
    with pytest.raises(CorruptBlock):
        decode_frame(frame, key=OTHER_KEY)
    with pytest.raises(CorruptBlock):
        decode_layer(read, 0, key=OTHER_KEY)
    with pytest.raises(CorruptBlock):
        decode_layers(read, key=OTHER_KEY)
    decode_layer(read, 1, key=KEY)


def test_decoding_verifies_without_being_asked() -> None:
    frame = bytearray(encode(gaussian_layers(3, (4, 2, 8)), "raw", "none"))
    read = BlockRead.from_frame(frame)
    header = read.header
    frame[header.segments[1].offset + 5] ^= 0x10  # after parsing: a tier's buffer went bad
    decode_layer(read, 0)
    decode_layer(read, 2)
    with pytest.raises(CorruptBlock):
        decode_layer(read, 1)
    with pytest.raises(CorruptBlock):
        decode_layers(read)
    lo, hi = header.span(header.all_layers)
    with pytest.raises(CorruptBlock):  # a tier handing over the wrong number of bytes
        decode_layer(BlockRead(header, header.all_layers, bytes(frame[lo:hi - 1])), 0)


def test_payload_disagreeing_with_the_header_is_refused() -> None:
    """Checksums pass (the writer was wrong), yet the sizes cannot be right: CorruptBlock."""
    def frame_of(segment: bytes, raw_length: int, compression: Compression = Compression.NONE,
                 codec: CodecId = CodecId.RAW) -> BlockRead:
        return BlockRead.from_frame(build_frame(
            [(segment, compression, raw_length)], codec=codec, dtype=DType.FLOAT16,
            layout_id="x", token_count=4, layer_shape=(4, 8), key_digest=KEY.digest))
    good = np.ones((4, 8), np.float16).tobytes()
    decode_layer(frame_of(good, len(good)), 0)
    for segment in (good[:-2], good + b"\0\0"):
        with pytest.raises(CorruptBlock):
            decode_layer(frame_of(segment, len(segment)), 0)
    with pytest.raises(CorruptBlock):  # raw_length right, stored bytes not
        decode_layer(frame_of(good[:-2], len(good)), 0)
    import zstandard
    short = zstandard.ZstdCompressor().compress(good[:-2])
    with pytest.raises(CorruptBlock):
        decode_layer(frame_of(short, len(good), Compression.ZSTD), 0)
    with pytest.raises(CorruptBlock):  # a raw-sized payload under an int8 header
        decode_layer(frame_of(good, len(good), codec=CodecId.INT8), 0)
    forged = bytearray(Int8Codec().encode(np.ones((4, 8), np.float16)).data)
    forged[:4] = np.float32(-1.0).tobytes()  # a scale no writer of ours produces
    with pytest.raises(CorruptBlock):
        decode_layer(frame_of(bytes(forged), len(forged), codec=CodecId.INT8), 0)


# ------------------------------------------------------------------------ ranges and outputs


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_layer_range_reads_decode_like_full_reads(codec: str) -> None:
    frame = encode(gaussian_layers(5, (8, 2, 16)), codec, "auto")
    full = decode_frame(frame, key=KEY)
    for start in range(5):
        for stop in range(start + 1, 6):
            part = decode_frame(frame, key=KEY, layers=LayerRange(start, stop))
            assert all(np.array_equal(a, b) for a, b in zip(part, full[start:stop], strict=True))
    read = BlockRead.from_frame(frame, LayerRange(1, 4))
    assert np.array_equal(decode_layer(read, 3), full[3])
    sub = decode_layers(read, LayerRange(2, 4))
    assert all(np.array_equal(a, b) for a, b in zip(sub, full[2:4], strict=True))
    for outside in (0, 4):
        with pytest.raises(CodecError):
            decode_layer(read, outside)
    with pytest.raises(CodecError):
        decode_layers(read, LayerRange(0, 2))


@pytest.mark.parametrize("codec", ["raw", "int8"])
def test_decode_into_out_buffers(codec: str) -> None:
    xs = gaussian_layers(4, (8, 2, 16))
    read = BlockRead.from_frame(encode(xs, codec))
    fresh = decode_layers(read)
    stacked = torch.empty(4, 8, 2, 16, dtype=torch.float16)
    outs = decode_layers(read, out=stacked.unbind(0))
    assert all(o.data_ptr() == stacked[i].data_ptr() for i, o in enumerate(outs))
    assert np.array_equal(stacked.numpy(), np.stack(fresh))
    host = np.zeros((4, 8, 2, 16), np.float16)
    decode_layers(read, LayerRange(1, 3), out=list(host[1:3]))
    assert np.array_equal(host[1:3], np.stack(fresh[1:3])) and not host[0].any()
    one = np.empty((8, 2, 16), np.float16)
    assert decode_layer(read, 2, out=one) is one and np.array_equal(one, fresh[2])
    with pytest.raises(CodecError):
        decode_layers(read, out=list(host[:3]))  # 3 outputs for 4 layers
    with pytest.raises(CodecError):
        decode_layer(read, 0, out=np.empty((8, 2, 16), np.float32))


def test_layers_must_agree() -> None:
    a = torch.zeros(4, 2, 8, dtype=torch.float16)
    for other in (torch.zeros(4, 2, 9, dtype=torch.float16), torch.zeros(4, 2, 8),
                  torch.zeros(4, 2, 8, dtype=torch.bfloat16)):
        with pytest.raises(CodecError):
            encode([a, other])
    with pytest.raises(CodecError):
        encode_block([], codec="raw", key=KEY, token_count=0, layout_id="x")
    with pytest.raises(CodecError):
        encode([a], codec="fp8")
    with pytest.raises(CodecError):  # numpy bits need their dtype, for every layer alike
        encode([a.view(torch.int16).numpy()])


# ------------------------------------------------------------------------- batched decoding


@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("path", ["host", "device"])
def test_a_batch_decode_keeps_bad_blocks_to_their_rows(codec: str, path: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`decode_layer_batch` as the connector's loader uses it. "device" runs the GPU path's
    code (one staged copy, one decode for all rows) on CPU tensors standing in for CUDA ones;
    the gpu-marked codec test runs it on a real device."""
    shape = (4, 2, 8)
    frames = [encode(gaussian_layers(3, shape, seed=s), codec, "none") for s in range(5)]
    reads = [BlockRead.from_frame(f) for f in frames]
    damaged = bytearray(frames[1])
    damaged[reads[1].header.segments[2].offset + 3] ^= 0x01  # block 1: layer 2 is bad
    reads[1] = BlockRead.from_frame(bytes(damaged))
    reads[4] = BlockRead.from_frame(encode(gaussian_layers(3, shape, DType.FLOAT32), codec,
                                           "none"))  # block 4: another dtype
    keys = [KEY, KEY, KEY, OTHER_KEY, KEY]  # block 3: read for the wrong key
    if path == "device":
        monkeypatch.setattr(block, "is_device_tensor", lambda x: isinstance(x, torch.Tensor))
    for layer in range(3):
        out = torch.full((6, *shape), 7.0, dtype=torch.float16)
        errors = decode_layer_batch(reads, layer, out, keys=keys)
        good = [0, 2] if layer == 2 else [0, 1, 2]
        assert [i for i, e in enumerate(errors) if e is None] == good
        assert isinstance(errors[3], CorruptBlock) and isinstance(errors[4], CodecError)
        if layer == 2:
            assert isinstance(errors[1], CorruptBlock)
        for i in good:
            expect = decode_layer(reads[i], layer, device="cpu")
            if codec == "raw":
                assert torch.equal(out[i], expect)
            else:  # torch's and the kernels' arithmetic: equal but for the last rounding
                assert torch.allclose(out[i].double(), expect.double(), rtol=2.0**-9, atol=0)
        assert torch.all(out[5] == 7.0)  # rows beyond the reads are not touched
    with pytest.raises(CodecError):
        decode_layer_batch(reads, 0, torch.empty((4, *shape), dtype=torch.float16), keys=keys)


def test_device_rows_refuse_an_invalid_scale() -> None:
    codec = Int8Codec()
    shape = (4, 2, 8)
    layers = gaussian_layers(2, shape)
    good, forged = (bytes(codec.encode(x).data) for x in layers)
    forged_bytes = bytearray(forged)
    forged_bytes[:4] = np.float32(np.nan).tobytes()
    out = torch.zeros((3, *shape), dtype=torch.float16)
    assert codec.decode_rows([bytes(forged_bytes), good], shape, DType.FLOAT16, out,
                             [0, 2]) == [0]
    assert torch.all(out[0] == 0) and torch.all(out[1] == 0)  # untouched
    expect = codec.decode(good, shape, DType.FLOAT16, device="cpu")
    assert isinstance(expect, torch.Tensor)
    assert torch.allclose(out[2].double(), expect.double(), rtol=2.0**-9, atol=0)
    with pytest.raises(CodecError):  # rows of another dtype than the segments
        codec.decode_rows([good], shape, DType.FLOAT16, out.float(), [0])


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["raw", "int8"])
@pytest.mark.parametrize("dtype", list(DType))
def test_a_batch_decodes_on_the_gpu_as_on_the_host(codec: str, dtype: DType) -> None:
    shape = (16, 8, 64)
    reads = [BlockRead.from_frame(encode(gaussian_layers(2, shape, dtype, seed=s), codec,
                                         "none")) for s in range(9)]
    keys = [KEY] * 9
    keys[4] = OTHER_KEY
    out = torch.zeros((9, *shape), dtype=TORCH[dtype], device="cuda")
    errors = decode_layer_batch(reads, 1, out, keys=keys)
    assert [e is None for e in errors] == [i != 4 for i in range(9)]
    for i in (0, 3, 8):
        expect = decode_layer(reads[i], 1, device="cpu")
        if codec == "raw":
            assert torch.equal(out[i].cpu(), expect)
        else:
            assert torch.allclose(out[i].cpu().double(), expect.double(), rtol=2.0**-7, atol=0)
    assert torch.all(out[4] == 0)
