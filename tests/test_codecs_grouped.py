"""The grouped codecs (int8-asym, int8-kivi, int8-g32, int4): error bounds against a float64
reference of each scheme, the same values on canonical and AMX blocks, torch ops byte-equal to
the numba kernels, forged segments refused, and frames of every version still decoding."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvstore.block import decode_frame, decode_layer_batch, encode_block
from kvstore.codecs import (
    CODECS,
    DEFAULT_INT8,
    Arrangement,
    GroupedCodec,
    config_codec_name,
    get_codec,
    torch_ops,
    warmup,
)
from kvstore.codecs.arrangement import Grouping, from_canonical, to_canonical
from kvstore.codecs.grouped import HEADER_BYTES, build_plan
from kvstore.errors import CodecError, CorruptBlock
from kvstore.frame import BlockRead, CodecId, DType
from tests.codec_frames_fixture import FIXTURE, bits_digest, fixture_key

pytestmark = pytest.mark.slow

GROUPED = ["int8-asym", "int8-kivi", "int8-g32", "int4"]
TORCH = {DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16,
         DType.FLOAT32: torch.float32}
# Half an ulp of the output dtype relative to the value, and its absolute floor (subnormals).
OUT_HALF_ULP = {DType.FLOAT16: (2.0**-11, 2.0**-25), DType.BFLOAT16: (2.0**-8, 2.0**-134),
                DType.FLOAT32: (0.0, 0.0)}
fast = settings(max_examples=40, deadline=None)


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    warmup()


def codec(name: str) -> GroupedCodec:
    found = get_codec(name)
    assert isinstance(found, GroupedCodec)
    return found


def kv_block(n: int, h: int, d: int, dtype: DType, seed: int, outliers: bool = True
             ) -> torch.Tensor:
    """A canonical [2, N, H, D] block shaped like trained KV: K with a few large channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, n, h, d, generator=g)
    if outliers:
        x[0, :, :, ::max(1, d // 3)] *= 12.0
        x[0] += 2.0  # a K offset: what a zero point is for
    return x.to(TORCH[dtype])


def reference_bound(name: str, x: np.ndarray) -> np.ndarray:
    """Per element of a canonical float64 block: half a quantization step of its group, by the
    scheme's definition (computed here, independently of the kernels' plans)."""
    scheme = codec(name).scheme
    bound = np.empty_like(x)
    for kv, grouping in ((0, scheme.k), (1, scheme.v)):
        plane = x[kv]  # [N, H, D]
        n, h, d = plane.shape
        if grouping.over == "tokens":
            view = plane.reshape(n, h * d)
            lo, hi = view.min(0, keepdims=True), view.max(0, keepdims=True)
            amax = np.abs(view).max(0, keepdims=True)
            shape = view.shape
        else:
            size = grouping.size or d
            view = plane.reshape(n, h, d // size, size)
            lo, hi = view.min(-1, keepdims=True), view.max(-1, keepdims=True)
            amax = np.abs(view).max(-1, keepdims=True)
            shape = view.shape
        step = (hi - lo) / scheme.top if scheme.top else amax / 127.0
        bound[kv] = np.broadcast_to(step / 2, shape).reshape(n, h, d)
    return bound


def as_f64(t: Any, dtype: DType) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return np.asarray(t.double().numpy())
    if dtype is DType.BFLOAT16:
        return np.asarray(torch.from_numpy(t.view(np.int16)).view(torch.bfloat16).double())
    return np.asarray(t, np.float64)


def check_bound(name: str, x: torch.Tensor, got: torch.Tensor, dtype: DType) -> None:
    want = as_f64(x, dtype)
    err = np.abs(as_f64(got, dtype) - want)
    rel, floor = OUT_HALF_ULP[dtype]
    # Half a step, a few float32 ulps, and the output dtype's rounding of the decoded value
    # (which may lie half a step beyond the input).
    half_step = reference_bound(name, want)
    allowed = half_step * (1 + 1e-5) + (np.abs(want) + half_step) * (rel + 1e-6) + floor \
        + 1e-30
    assert (err <= allowed).all(), float((err - allowed).max())


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("geometry", [(32, 2, 64), (16, 1, 32), (32, 4, 128)],
                         ids=lambda g: "x".join(map(str, g)))
def test_error_is_within_half_a_step(name: str, dtype: DType,
                                     geometry: tuple[int, int, int]) -> None:
    n, h, d = geometry
    x = kv_block(n, h, d, dtype, seed=n + h + d)
    enc = codec(name).encode(x, arrangement=Arrangement.CANONICAL)
    assert len(enc.data) == codec(name).encoded_size(enc.shape, enc.dtype)
    got = codec(name).decode(bytes(enc.data), enc.shape, enc.dtype, device="cpu")
    assert isinstance(got, torch.Tensor)
    check_bound(name, x, got, dtype)


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("geometry", [(32, 2, 64), (64, 3, 128), (32, 1, 32), (16, 8, 128)],
                         ids=lambda g: "x".join(map(str, g)))
def test_amx_blocks_decode_to_the_same_values_as_canonical_ones(
        name: str, geometry: tuple[int, int, int]) -> None:
    """Same scheme, same groups, other element order: bit-identical values."""
    n, h, d = geometry
    x = kv_block(n, h, d, DType.BFLOAT16, seed=3)
    bits = x.view(torch.int16).numpy().view(np.uint16)
    amx = from_canonical(bits, Arrangement.AMX)
    c = codec(name)
    canonical = c.decode(bytes(c.encode(bits, dtype="bfloat16",
                                        arrangement=Arrangement.CANONICAL).data),
                         x.shape, DType.BFLOAT16)
    packed = c.encode(amx, dtype="bfloat16", arrangement=Arrangement.AMX)
    assert len(packed.data) == c.encoded_size(tuple(x.shape), DType.BFLOAT16)
    decoded = c.decode(bytes(packed.data), amx.shape, DType.BFLOAT16)
    assert np.array_equal(to_canonical(np.asarray(decoded), Arrangement.AMX), canonical)


@fast
@given(data=st.data(), name=st.sampled_from(GROUPED),
       dtype=st.sampled_from([DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16]))
def test_arbitrary_finite_values(data: st.DataObject, name: str, dtype: DType) -> None:
    """Any finite values round-trip within the bound, or (a range beyond float32, asymmetric
    schemes only) are refused: never silently wrong."""
    d = 32
    n = data.draw(st.sampled_from([2, 4, 16]))
    big = float(np.float32(6.0e4 if dtype is DType.FLOAT16 else 3.0e38))
    values = data.draw(hnp.arrays(np.float32, (2, n, 1, d), elements=st.floats(
        -big, big, width=32, allow_subnormal=True) | st.sampled_from([0.0, -0.0, 1e-30, 2.5])))
    x = torch.from_numpy(values).to(TORCH[dtype])
    assert torch.isfinite(x).all()
    c = codec(name)
    try:
        enc = c.encode(x, arrangement=Arrangement.CANONICAL)
    except CodecError:
        span = x.double().amax() - x.double().amin()
        assert c.scheme.zero_point and span > 3.4e38  # only an overflowing range is refused
        return
    got = c.decode(bytes(enc.data), enc.shape, enc.dtype, device="cpu")
    assert isinstance(got, torch.Tensor) and torch.isfinite(got).all()
    check_bound(name, x, got, dtype)


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_values_are_refused(name: str, bad: float,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    x = kv_block(16, 1, 32, DType.BFLOAT16, seed=1)
    x[1, 5, 0, 7] = bad
    with pytest.raises(CodecError):
        codec(name).encode(x, arrangement=Arrangement.CANONICAL)
    with pytest.raises(CodecError):
        torch_ops.grouped_quantize(x[None], _plan(name, x.shape).planes, codec(name).scheme.top)


def _plan(name: str, shape: Any, arrangement: Arrangement = Arrangement.CANONICAL,
          dtype: DType = DType.BFLOAT16) -> Any:
    return build_plan(codec(name).scheme, arrangement, tuple(shape), dtype)


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("arrangement", [Arrangement.CANONICAL, Arrangement.AMX])
def test_torch_ops_give_the_kernels_bytes(name: str, dtype: DType,
                                          arrangement: Arrangement) -> None:
    """The device path (torch ops, run here on CPU tensors) writes the same segments as the
    numba kernels and decodes them to the same values."""
    if arrangement is Arrangement.AMX and dtype is DType.FLOAT32:
        return
    x = kv_block(32, 2, 64, dtype, seed=5)
    if arrangement is Arrangement.AMX:
        x = torch.from_numpy(from_canonical(x.numpy() if dtype is not DType.BFLOAT16 else
                                            x.view(torch.int16).numpy(), arrangement))
        x = x.view(torch.bfloat16) if dtype is DType.BFLOAT16 else x
    c = codec(name)
    host = bytes(c.encode(x, arrangement=arrangement).data)
    plan = _plan(name, x.shape, arrangement, dtype)
    layers = torch.stack([x, (x * 0.5).to(x.dtype)])
    device = torch_ops.grouped_quantize(layers, plan.planes, c.scheme.top)
    assert bytes(device[0].numpy()) == host[HEADER_BYTES:]
    assert bytes(device[1].numpy()) == bytes(c.encode(layers[1],
                                                      arrangement=arrangement).data)[HEADER_BYTES:]
    decoded = torch_ops.grouped_dequantize(torch.from_numpy(np.frombuffer(host, np.uint8)
                                                            [HEADER_BYTES:].copy())[None],
                                           plan.planes, c.scheme.top, plan.elements,
                                           TORCH[dtype])
    want = c.decode(host, tuple(x.shape), dtype, device="cpu")
    assert isinstance(want, torch.Tensor)
    assert torch.equal(decoded.view(x.shape).view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("name", GROUPED)
def test_device_path_simulated_on_cpu(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """encode / encode_many / decode / decode_rows through the codec's device halves (CPU
    tensors standing in for CUDA ones): the host path's bytes and values."""
    x = kv_block(32, 2, 64, DType.BFLOAT16, seed=9)
    c = codec(name)
    layers = [x, (x * 0.25).to(x.dtype), -x]
    host = [bytes(c.encode(t, arrangement=Arrangement.CANONICAL).data) for t in layers]
    from kvstore.codecs import base

    def on_device(t: object) -> bool:
        return isinstance(t, torch.Tensor)

    monkeypatch.setattr(base, "is_device_tensor", on_device)
    assert bytes(c.encode(x, arrangement=Arrangement.CANONICAL).data) == host[0]
    many = c.encode_many(layers, arrangement=Arrangement.CANONICAL)
    assert [bytes(d) for d in many.data] == host
    out = torch.empty_like(x)
    c.decode(host[0], tuple(x.shape), DType.BFLOAT16, out=out)
    monkeypatch.undo()
    want = c.decode(host[0], tuple(x.shape), DType.BFLOAT16, device="cpu")
    assert isinstance(want, torch.Tensor) and torch.equal(out.view(torch.int16),
                                                          want.view(torch.int16))
    rows = torch.zeros(4, *x.shape, dtype=x.dtype)
    forged = bytearray(host[2])
    forged[HEADER_BYTES: HEADER_BYTES + 4] = np.float32(-1.0).tobytes()
    refused = c.decode_rows([host[0], host[1], bytes(forged)], tuple(x.shape),
                            DType.BFLOAT16, rows, [3, 0, 1])
    assert refused == [1]
    assert torch.equal(rows[3].view(torch.int16), want.view(torch.int16))
    assert (rows[1] == 0).all()  # a refused row is left as it was


def _segment(name: str, shape: tuple[int, ...] = (2, 16, 1, 32)) -> bytearray:
    x = kv_block(shape[1], shape[2], shape[3], DType.BFLOAT16, seed=2)
    return bytearray(codec(name).encode(x, arrangement=Arrangement.CANONICAL).data)


@pytest.mark.parametrize("name", GROUPED)
def test_forged_segments_are_refused(name: str) -> None:
    c, shape = codec(name), (2, 16, 1, 32)
    good = _segment(name)
    c.decode(bytes(good), shape, DType.BFLOAT16)
    groups = _plan(name, shape).groups
    forgeries: list[list[tuple[int, bytes]]] = [
        [(0, bytes([2]))],  # says AMX, the shape is canonical
        [(0, bytes([9]))],  # no such arrangement
        [(1, bytes([1]))],  # reserved bits
        [(HEADER_BYTES, f32(-0.5))],  # a negative scale
        [(HEADER_BYTES, f32(np.nan))],
        [(HEADER_BYTES, f32(np.inf))],
    ]
    if c.scheme.zero_point:
        zero = HEADER_BYTES + 4 * groups
        forgeries += [[(zero, f32(np.nan))], [(zero, f32(-np.inf))],
                      [(zero, f32(3.4e38)), (HEADER_BYTES, f32(1e37))]]  # top level overflows
    for patches in forgeries:
        bad = bytearray(good)
        for offset, patch in patches:
            bad[offset: offset + len(patch)] = patch
        with pytest.raises(CorruptBlock):
            c.decode(bytes(bad), shape, DType.BFLOAT16)
        assert not c._valid_segment(np.frombuffer(bytes(bad), np.uint8), shape, DType.BFLOAT16)
    with pytest.raises(CorruptBlock):
        c.decode(bytes(good[:-1]), shape, DType.BFLOAT16)


def f32(value: float) -> bytes:
    return np.float32(value).tobytes()


def test_int4_packs_pairs_low_nibble_first() -> None:
    """int4: levels 0..15 from each group's min to max, element 2i in the low nibble."""
    c = codec("int4")
    n, d = 16, 32
    x = torch.zeros(2, n, 1, d)
    x[0] = torch.arange(n, dtype=torch.float32)[:, None, None]  # K: per channel, 0..15
    x[1] = torch.arange(d, dtype=torch.float32)[None, None, :] * (15 / 31)  # V: per token
    enc = bytes(c.encode(x, arrangement=Arrangement.CANONICAL).data)
    plan = _plan("int4", x.shape, dtype=DType.FLOAT32)
    values = np.frombuffer(enc, np.uint8)[HEADER_BYTES + 8 * plan.groups:]
    assert values.size == x.numel() // 2
    k = values[: n * d // 2]
    # K element (t, c) = t: both nibbles of token t's bytes are t.
    assert (k.reshape(n, d // 2) == (np.arange(n) * 17)[:, None]).all()
    v = values[n * d // 2:].reshape(n, d // 2)
    levels = np.round(np.arange(d) * (15 / 31) / (15 / 31) * 15 / 31).astype(np.uint8)
    assert (v & 15 == levels[0::2]).all() and (v >> 4 == levels[1::2]).all()
    back = c.decode(enc, tuple(x.shape), DType.FLOAT32)
    assert np.abs(np.asarray(back)[0] - x[0].numpy()).max() < 1e-5


@pytest.mark.parametrize("name", GROUPED)
def test_layouts_a_codec_cannot_read_are_refused(name: str) -> None:
    c = codec(name)
    x = kv_block(32, 2, 64, DType.BFLOAT16, seed=4)
    with pytest.raises(CodecError, match="needs to know where K, V"):
        c.encode(x)  # the default arrangement: ROWS
    with pytest.raises(CodecError, match="needs to know"):
        encode_block([x], codec=name, key=fixture_key(), token_count=32, layout_id="x")
    with pytest.raises(CodecError):
        c.encode(x, arrangement=Arrangement.AMX)  # a 4-D block is not an AMX one
    with pytest.raises(CodecError, match="16-bit"):
        c.encode(torch.zeros(2, 64, 64), arrangement=Arrangement.AMX)  # fp32
    with pytest.raises(CodecError):
        c.encode(torch.zeros(2, 40, 64, dtype=torch.bfloat16), arrangement=Arrangement.AMX)
    for other in ("raw", "int8-sym"):  # rows are all these need
        get_codec(other).check_layout((2, 64, 64), DType.FLOAT32, Arrangement.ROWS)


@pytest.mark.parametrize("name", GROUPED)
def test_caller_buffers_at_odd_offsets(name: str) -> None:
    c = codec(name)
    x = kv_block(16, 2, 32, DType.FLOAT16, seed=6)
    size = c.encoded_size(tuple(x.shape), DType.FLOAT16)
    want = bytes(c.encode(x, arrangement=Arrangement.CANONICAL).data)
    arena = np.zeros(size + 3, np.uint8)
    got = c.encode(x, arrangement=Arrangement.CANONICAL, out=arena[1:1 + size])
    assert bytes(got.data) == want
    odd = bytearray(size + 1)
    odd[1:] = want
    decoded = c.decode(memoryview(odd)[1:], tuple(x.shape), DType.FLOAT16)
    assert np.array_equal(decoded, c.decode(want, tuple(x.shape), DType.FLOAT16))
    many = c.encode_many([x, x], arrangement=Arrangement.CANONICAL)
    assert [bytes(d) for d in many.data] == [want, want]


def test_sizes() -> None:
    shape = (2, 32, 8, 128)
    fp16 = 2 * np.prod(shape)
    sizes = {name: codec(name).encoded_size(shape, DType.FLOAT16) / fp16 for name in GROUPED}
    # scales (+ zeros) per group; int4 stores half a byte per value
    assert sizes["int8-asym"] == pytest.approx(0.5 + 8 / 256 + 4 / fp16)
    assert sizes["int8-g32"] == pytest.approx(0.5 + 4 / 64 + 4 / fp16)
    # int4: half a byte per value, 8 bytes per K channel (over 32 tokens), per 32 V channels
    assert sizes["int4"] == pytest.approx(0.25 + 8 / 64 / 2 + 8 / 64 / 2 + 4 / fp16)
    assert codec("int8-kivi").encoded_size((8, 64, 128), DType.BFLOAT16) == \
        codec("int8-kivi").encoded_size(shape, DType.BFLOAT16)


def test_registry() -> None:
    assert {c.codec_id: c.name for c in CODECS.values()} == {
        CodecId.RAW: "raw", CodecId.INT8: "int8-sym", CodecId.INT8_ASYM: "int8-asym",
        CodecId.INT8_KIVI: "int8-kivi", CodecId.INT8_G32: "int8-g32", CodecId.INT4: "int4"}
    assert get_codec("int8").name == "int8-sym"  # its old name, for code written against it
    assert config_codec_name("int8") == DEFAULT_INT8 and config_codec_name("INT4") == "int4"
    assert codec("int8-kivi").scheme.k == Grouping("tokens")
    with pytest.raises(CodecError):
        get_codec("int2")


def _fixture() -> dict[str, Any]:
    return dict(json.loads(FIXTURE.read_text()))


@pytest.mark.parametrize("entry", _fixture()["before_grouped"],
                         ids=lambda e: f"{e['codec']}-{e['dtype']}")
def test_frames_written_before_the_grouped_codecs_decode_identically(entry: dict[str, Any]
                                                                      ) -> None:
    """raw and int8 frames written by kvkeep before this change (tests/codec_frames.json):
    same values, and re-encoding their layers gives the very same frame."""
    frame = bytes.fromhex(entry["frame"])
    decoded = decode_frame(frame, key=fixture_key(), device="cpu")
    assert [bits_digest(t) for t in decoded] == entry["decoded"]
    read = BlockRead.from_frame(frame)
    assert read.header.codec is (CodecId.RAW if entry["codec"] == "raw" else CodecId.INT8)
    if entry["codec"] == "raw":
        again = encode_block(decoded, codec="raw", key=fixture_key(), token_count=4,
                             layout_id="cpu/tnhd", compression="none")
        assert again == frame


@pytest.mark.parametrize("entry", _fixture()["grouped"],
                         ids=lambda e: f"{e['codec']}-{e['arrangement']}")
def test_grouped_frames_of_this_version_decode_identically(entry: dict[str, Any]) -> None:
    frame = bytes.fromhex(entry["frame"])
    decoded = decode_frame(frame, key=fixture_key(), device="cpu")
    assert [bits_digest(t) for t in decoded] == entry["decoded"]
    read = BlockRead.from_frame(frame)
    assert get_codec(read.header.codec).name == entry["codec"]
    # The batch decoder (what the connector's restore calls) reads them the same way.
    out = torch.empty(1, *read.header.layer_shape, dtype=TORCH[read.header.dtype])
    assert decode_layer_batch([read], 1, out, keys=[fixture_key()]) == [None]
    assert hashlib.sha256(out[0].view(torch.uint8).numpy().tobytes()).hexdigest() \
        == entry["decoded"][1]
