"""Codecs: raw is bit-exact, int8 stays within its error bound, inputs and outputs are checked."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvstore.codecs import Int8Codec, RawCodec, describe, get_codec, kernels, torch_ops, warmup
from kvstore.errors import CodecError, CorruptBlock
from kvstore.frame import CodecId, DType

RAW, INT8 = RawCodec(), Int8Codec()
TORCH = {DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16,
         DType.FLOAT32: torch.float32}
BITS = {DType.FLOAT16: np.uint16, DType.BFLOAT16: np.uint16, DType.FLOAT32: np.uint32}
# Half an ulp of the output dtype, relative to the value (round to nearest), and the absolute
# floor from its subnormals; fp32 output adds no rounding beyond the kernel's own.
OUT_HALF_ULP = {DType.FLOAT16: (2.0**-11, 2.0**-25), DType.BFLOAT16: (2.0**-8, 2.0**-134),
                DType.FLOAT32: (0.0, 0.0)}
shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=9)
fast = settings(max_examples=60, deadline=None)


@pytest.fixture(scope="module", autouse=True)
def _compiled() -> None:
    warmup()  # compile (or load from numba's cache) once, outside hypothesis' timing


def to_float64(x: Any, dtype: DType) -> np.ndarray[Any, Any]:
    """Decode any of our tensor representations to float64 values."""
    if isinstance(x, torch.Tensor):
        return np.asarray(x.double().numpy())
    if dtype is DType.BFLOAT16:
        return np.asarray(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).double())
    return np.asarray(x, np.float64)


def bits_of(x: Any, dtype: DType) -> np.ndarray[Any, Any]:
    if isinstance(x, torch.Tensor):
        return x.contiguous().view(torch.int16 if dtype.itemsize == 2 else torch.int32).numpy() \
            .view(BITS[dtype])
    return np.ascontiguousarray(x).view(BITS[dtype])


def as_input(values: np.ndarray[Any, Any], dtype: DType, kind: str) -> tuple[Any, DType | None]:
    """float32 `values` rounded to `dtype`, as numpy (bf16: uint16 bits) or a torch tensor."""
    t = torch.from_numpy(values).to(TORCH[dtype])
    if kind == "torch":
        return t, None
    if dtype is DType.BFLOAT16:
        return t.view(torch.int16).numpy().view(np.uint16), DType.BFLOAT16
    return t.numpy(), None


# ------------------------------------------------------------------------------------------ raw


@fast
@given(dtype=st.sampled_from(list(DType)), shape=shapes, kind=st.sampled_from(["numpy", "torch"]),
       data=st.data())
def test_raw_round_trip_is_bit_exact(dtype: DType, shape: tuple[int, ...], kind: str,
                                     data: st.DataObject) -> None:
    # Any bit pattern at all, NaN payloads and negative zeros included, must come back as is.
    bits = data.draw(hnp.arrays(BITS[dtype], shape))
    if kind == "torch":
        tdt = TORCH[dtype]
        signed = bits.view(np.int16 if dtype.itemsize == 2 else np.int32)
        x: Any = torch.from_numpy(signed.copy()).view(tdt)
        given_dtype = None
    else:
        x = bits.view(np.float16) if dtype is DType.FLOAT16 else (
            bits if dtype is DType.BFLOAT16 else bits.view(np.float32))
        given_dtype = dtype if dtype is DType.BFLOAT16 else None
    enc = RAW.encode(x, dtype=given_dtype)
    assert (enc.shape, enc.dtype) == (shape, dtype)
    assert bytes(enc.data) == bits.tobytes()
    to_numpy = RAW.decode(enc.data, shape, dtype)
    to_torch = RAW.decode(bytes(enc.data), shape, dtype, device="cpu")
    assert isinstance(to_numpy, np.ndarray) and isinstance(to_torch, torch.Tensor)
    assert to_numpy.shape == shape and to_torch.dtype == TORCH[dtype]
    assert np.array_equal(bits_of(to_numpy, dtype), bits)
    assert np.array_equal(bits_of(to_torch, dtype), bits)


def test_raw_encodes_non_contiguous_inputs_in_logical_order() -> None:
    x = np.arange(24, dtype=np.float32).reshape(4, 6).T  # a transposed view
    enc = RAW.encode(x)
    assert bytes(enc.data) == np.ascontiguousarray(x).tobytes()
    t = torch.arange(24, dtype=torch.float16).reshape(4, 6).t()
    assert bytes(RAW.encode(t).data) == t.contiguous().numpy().tobytes()


# ----------------------------------------------------------------------------------------- int8

finite_values = st.floats(width=32, allow_nan=False, allow_infinity=False)


def check_int8_bound(x: Any, dtype: DType, given_dtype: DType | None,
                     out_kind: str) -> None:
    """Decode(encode(x)) is within half a quantization step of x, plus stated rounding slack.

    Per element, with a = row absmax and s = the row's stored scale (a / 127):
      |x - y| <= s / 2                       the quantization itself (round to nearest)
               + a * 2**-21                  float32 arithmetic: 127/a, x*inv, a/127 and q*s
                                             each round once (<= ~4 ulps of a, doubled)
               + h * |y| + floor             rounding the float32 result to the output dtype:
                                             half an ulp (h = 2**-11 fp16, 2**-8 bf16, 0 fp32),
                                             floor = half the smallest fp16 subnormal
    For bf16 the output rounding alone can reach ~s/2 (an 8-bit significand), which is why the
    bound cannot be a bare s/2 there. Rows with a < 2**-100 (bf16/fp32 only) decode to zeros.
    """
    enc = INT8.encode(x, dtype=given_dtype)
    shape = enc.shape
    rows = int(np.prod(shape[:-1]))
    scales = np.frombuffer(enc.data, "<f4", count=rows).astype(np.float64)
    if out_kind == "torch":
        y: Any = INT8.decode(enc.data, shape, dtype, device="cpu")
        assert isinstance(y, torch.Tensor) and y.dtype == TORCH[dtype]
    else:
        y = INT8.decode(enc.data, shape, dtype)
        assert isinstance(y, np.ndarray)
    assert tuple(y.shape) == shape
    xs = to_float64(x, dtype).reshape(rows, -1)
    ys = to_float64(y, dtype).reshape(rows, -1)
    absmax = np.abs(xs).max(axis=1, keepdims=True)
    rel, floor = OUT_HALF_ULP[dtype]
    bound = scales[:, None] / 2 + absmax * 2.0**-21 + rel * np.abs(ys) + floor
    tiny = absmax[:, 0] < kernels.TINY_ABSMAX
    assert np.all(ys[tiny] == 0)
    assert np.all(np.abs(xs - ys)[~tiny] <= bound[~tiny])
    q = np.frombuffer(enc.data, np.int8, offset=4 * rows)
    assert q.min(initial=0) >= -127


@fast
@given(dtype=st.sampled_from(list(DType)), kind=st.sampled_from(["numpy", "torch"]),
       out_kind=st.sampled_from(["numpy", "torch"]),
       values=hnp.arrays(np.float32, shapes, elements=finite_values))
def test_int8_error_is_within_half_a_step(dtype: DType, kind: str, out_kind: str,
                                          values: np.ndarray[Any, Any]) -> None:
    # Out-of-range float32 values saturate to inf in fp16: keep to what the dtype can hold.
    limit = {DType.FLOAT16: 65504.0, DType.BFLOAT16: 3.38e38, DType.FLOAT32: 3.4e38}[dtype]
    x, given_dtype = as_input(np.clip(values, -limit, limit), dtype, kind)
    check_int8_bound(x, dtype, given_dtype, out_kind)


@pytest.mark.parametrize("dtype", list(DType))
def test_int8_edge_rows(dtype: DType) -> None:
    big = {DType.FLOAT16: 65504.0, DType.BFLOAT16: 3.3895e38, DType.FLOAT32: 3.4028235e38}[dtype]
    values = np.array([[0.0, 0.0, 0.0, 0.0],            # zero row: scale 0, decodes to zeros
                       [-0.0, 0.0, -0.0, 0.0],
                       [big, -big, big / 3, 1.0],        # at the top of the range
                       [6e-8, -6e-8, 0.0, 3e-8],         # fp16 subnormals
                       [1e-35, -1e-36, 0.0, 1e-38],      # below TINY_ABSMAX for bf16/fp32
                       [1.0, 1.0, 1.0, 1.0]], np.float32)
    x, given_dtype = as_input(values, dtype, "numpy")
    check_int8_bound(x, dtype, given_dtype, "numpy")
    y = to_float64(INT8.decode(INT8.encode(x, dtype=given_dtype).data, values.shape, dtype), dtype)
    assert np.all(y[:2] == 0) and np.all(np.isfinite(y))


@pytest.mark.parametrize("dtype", list(DType))
def test_int8_relative_rms_error_on_gaussian_data(dtype: DType) -> None:
    rng = np.random.default_rng(0)
    x, given_dtype = as_input(rng.standard_normal((256, 8, 128), np.float32), dtype, "numpy")
    y = INT8.decode(INT8.encode(x, dtype=given_dtype).data, (256, 8, 128), dtype)
    xs, ys = to_float64(x, dtype), to_float64(y, dtype)
    rel_rms = np.sqrt(np.mean((xs - ys) ** 2)) / np.sqrt(np.mean(xs**2))
    assert rel_rms <= 0.01, rel_rms


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", list(DType))
def test_int8_refuses_non_finite(dtype: DType, bad: float) -> None:
    values = np.ones((3, 8), np.float32)
    values[1, 5] = bad
    for kind in ("numpy", "torch"):
        x, given_dtype = as_input(values, dtype, kind)
        with pytest.raises(CodecError):
            INT8.encode(x, dtype=given_dtype)
    with pytest.raises(CodecError):
        torch_ops.quantize(torch.from_numpy(values).to(TORCH[dtype]))


def test_int8_size_is_scales_then_values() -> None:
    assert INT8.encoded_size((32, 8, 128), DType.FLOAT16) == 256 * (4 + 128)
    assert INT8.encoded_size((5,), DType.BFLOAT16) == 4 + 5


def test_int8_large_tensors_split_over_threads_give_the_same_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(1).standard_normal((1024, 8, 128)).astype(np.float16)  # 2 MiB
    monkeypatch.setattr(kernels, "PARALLEL_MIN_BYTES", 1 << 40)
    serial = bytes(INT8.encode(x).data)
    monkeypatch.setattr(kernels, "PARALLEL_MIN_BYTES", 1 << 20)
    monkeypatch.setenv("KVKEEP_CODEC_THREADS", "3")
    assert bytes(INT8.encode(x).data) == serial
    y = INT8.decode(serial, x.shape, DType.FLOAT16)
    monkeypatch.setattr(kernels, "PARALLEL_MIN_BYTES", 1 << 40)
    assert np.array_equal(y, INT8.decode(serial, x.shape, DType.FLOAT16))


@pytest.mark.parametrize("width", [16, 7])  # 7: segments not 4-byte multiples (slow path)
@pytest.mark.parametrize("codec", [RAW, INT8], ids=["raw", "int8"])
def test_encode_many_gives_the_bytes_of_encode(codec: RawCodec | Int8Codec, width: int) -> None:
    rng = np.random.default_rng(3)
    layers = [rng.standard_normal((5, 3, width)).astype(np.float16) for _ in range(4)]
    many = codec.encode_many(layers)
    assert (many.shape, many.dtype) == ((5, 3, width), DType.FLOAT16)
    assert [bytes(d) for d in many.data] == [bytes(codec.encode(x).data) for x in layers]
    bits = [torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            for x in layers]
    as_bf16 = codec.encode_many(bits, dtype="bf16")
    assert [bytes(d) for d in as_bf16.data] == [
        bytes(codec.encode(torch.from_numpy(b.view(np.int16)).view(torch.bfloat16)).data)
        for b in bits]
    with pytest.raises(CodecError):
        codec.encode_many([])
    with pytest.raises(CodecError):
        codec.encode_many([layers[0], layers[1][:4]])
    if codec is INT8:
        layers[2][1, 1, 1] = np.inf
        with pytest.raises(CodecError):
            codec.encode_many(layers)


# ------------------------------------------------------------------------ torch (device) path


@pytest.mark.parametrize("dtype", list(DType))
def test_torch_ops_agree_with_the_kernels(dtype: DType) -> None:
    """The device path's arithmetic, run on CPU tensors, matches the numba kernels."""
    t = (torch.randn(64, 4, 32) * 5).to(TORCH[dtype])
    t[3] = 0
    segment = torch_ops.quantize(t).numpy()
    kernel_segment = np.frombuffer(INT8.encode(t).data, np.uint8)
    rows = 64 * 4
    assert np.array_equal(segment[: 4 * rows], kernel_segment[: 4 * rows])  # same scales
    q_torch = segment[4 * rows:].view(np.int8).astype(np.int16)
    q_kernel = kernel_segment[4 * rows:].view(np.int8).astype(np.int16)
    assert np.abs(q_torch - q_kernel).max() <= 1
    out = torch.empty_like(t)
    torch_ops.dequantize(torch.from_numpy(kernel_segment.copy()), out)
    expect = INT8.decode(kernel_segment, tuple(t.shape), dtype, device="cpu")
    assert isinstance(expect, torch.Tensor)
    step = torch.from_numpy(kernel_segment[: 4 * rows].view(np.float32).copy())
    assert torch.all((out.double() - expect.double()).abs().reshape(rows, -1)
                     <= step.double()[:, None] * 1e-2 + 1e-30)


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("codec", [RAW, INT8], ids=["raw", "int8"])
def test_device_path_simulated_on_cpu(codec: RawCodec | Int8Codec, dtype: DType,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs the torch (device) halves of the codecs with CPU tensors standing in for CUDA ones,
    so their byte layout and copies are checked on machines without a GPU."""
    t = (torch.randn(16, 2, 32) * 4).to(TORCH[dtype])
    host_bytes = bytes(codec.encode(t).data)
    host_out = codec.decode(host_bytes, (16, 2, 32), dtype, device="cpu")
    from kvstore.codecs import base, int8

    def on_device(x: object) -> bool:
        return isinstance(x, torch.Tensor)

    monkeypatch.setattr(base, "is_device_tensor", on_device)
    monkeypatch.setattr(int8, "is_device_tensor", on_device)
    dev_bytes = bytes(codec.encode(t).data)
    # A block on one device is encoded in one batch: the same bytes as layer by layer.
    layers = [t, (t * 0.5).to(t.dtype), -t, torch.zeros_like(t)]
    many = codec.encode_many(layers)
    assert [bytes(d) for d in many.data] == [bytes(codec.encode(x).data) for x in layers]
    assert bytes(many.data[0]) == dev_bytes
    if codec is RAW:
        assert dev_bytes == host_bytes
    else:  # same scales; values within one level (rounding ties may differ)
        assert dev_bytes[: 4 * 32] == host_bytes[: 4 * 32]
        assert np.abs(np.frombuffer(dev_bytes[128:], np.int8).astype(int)
                      - np.frombuffer(host_bytes[128:], np.int8).astype(int)).max() <= 1
    out = torch.empty(16, 2, 32, dtype=TORCH[dtype])
    assert codec.decode(host_bytes, (16, 2, 32), dtype, out=out) is out
    assert isinstance(host_out, torch.Tensor)
    tol = 0.0 if codec is RAW else 1e-2
    assert torch.allclose(out.double(), host_out.double(), atol=tol, rtol=tol)
    with pytest.raises(CodecError):
        codec.decode(host_bytes, (16, 2, 32), dtype, out=torch.empty(16, 2, 31,
                                                                   dtype=TORCH[dtype]))
    if codec is INT8:
        forged = bytearray(host_bytes)
        forged[:4] = np.float32(-2.0).tobytes()
        with pytest.raises(CorruptBlock):
            codec.decode(bytes(forged), (16, 2, 32), dtype, out=out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DType))
def test_cuda_tensors_quantize_on_the_device(dtype: DType) -> None:
    t = (torch.randn(32, 8, 128) * 3).to(TORCH[dtype])
    gpu = t.cuda()
    for codec in (RAW, INT8):
        on_gpu = codec.encode(gpu)
        on_cpu = codec.encode(t)
        assert len(on_gpu.data) == len(on_cpu.data)
        rows = 32 * 8
        if codec is RAW:
            assert bytes(on_gpu.data) == bytes(on_cpu.data)
        else:  # CUDA's division may differ from the CPU's in the last ulp
            gpu_scales = np.frombuffer(on_gpu.data, np.float32, count=rows)
            cpu_scales = np.frombuffer(on_cpu.data, np.float32, count=rows)
            assert np.allclose(gpu_scales, cpu_scales, rtol=1e-6, atol=0)
        back = codec.decode(on_gpu.data, (32, 8, 128), dtype, device="cuda")
        assert isinstance(back, torch.Tensor) and back.is_cuda and back.dtype == TORCH[dtype]
        out = torch.empty_like(gpu)
        codec.decode(on_cpu.data, (32, 8, 128), dtype, out=out)
        host = codec.decode(on_cpu.data, (32, 8, 128), dtype, device="cpu")
        assert isinstance(host, torch.Tensor)
        # Same bytes decoded on the GPU: equal but for the output dtype's rounding.
        assert torch.allclose(out.cpu().double(), host.double(), atol=0, rtol=2.0**-7)
        # Bytes quantized on the GPU: a value may land one level away (scale off by an ulp).
        step = host.double().abs().amax(dim=-1, keepdim=True) / 127
        assert torch.all((back.cpu().double() - host.double()).abs()
                         <= step * 1.01 + host.double().abs() * 2.0**-7)
        # A block's layers, encoded on the GPU in one batch: the bytes of layer-by-layer.
        layers = [gpu, gpu * 0.25, -gpu]
        many = codec.encode_many(layers)
        singles = [bytes(codec.encode(x).data) for x in layers]
        assert [bytes(d) for d in many.data] == singles


# ------------------------------------------------------------------------- outputs and inputs


@pytest.mark.parametrize("codec", [RAW, INT8], ids=["raw", "int8"])
def test_decode_into_caller_buffers(codec: RawCodec | Int8Codec) -> None:
    x = torch.randn(16, 2, 8, dtype=torch.bfloat16)
    enc = codec.encode(x)
    fresh = codec.decode(enc.data, (16, 2, 8), DType.BFLOAT16, device="cpu")
    assert isinstance(fresh, torch.Tensor)
    out_t = torch.empty(16, 2, 8, dtype=torch.bfloat16)
    assert codec.decode(enc.data, (16, 2, 8), DType.BFLOAT16, out=out_t) is out_t
    assert torch.equal(out_t, fresh)
    out_np = np.empty((16, 2, 8), np.uint16)
    assert codec.decode(enc.data, (16, 2, 8), DType.BFLOAT16, out=out_np) is out_np
    assert np.array_equal(out_np, out_t.view(torch.int16).numpy().view(np.uint16))
    stacked = np.zeros((3, 16, 2, 8), np.uint16)  # a view into a larger, touched buffer
    codec.decode(enc.data, (16, 2, 8), DType.BFLOAT16, out=stacked[1])
    assert np.array_equal(stacked[1], out_np) and not stacked[0].any() and not stacked[2].any()


@pytest.mark.parametrize("codec", [RAW, INT8], ids=["raw", "int8"])
def test_encode_into_caller_buffers(codec: RawCodec | Int8Codec) -> None:
    x = np.random.default_rng(2).standard_normal((8, 3, 16)).astype(np.float16)
    plain = bytes(codec.encode(x).data)
    arena = bytearray(len(plain) + 7)
    enc = codec.encode(x, out=memoryview(arena)[1:])  # odd address: scales written aside
    assert bytes(enc.data) == plain and arena[1: 1 + len(plain)] == plain
    with pytest.raises(CodecError):
        codec.encode(x, out=bytearray(len(plain) - 1))
    with pytest.raises(CodecError):
        codec.encode(x, out=bytes(len(plain)))  # type: ignore[arg-type]  # read-only


@pytest.mark.parametrize("codec", [RAW, INT8], ids=["raw", "int8"])
def test_bad_outputs_are_refused(codec: RawCodec | Int8Codec) -> None:
    x = np.ones((4, 8), np.float16)
    data = codec.encode(x).data
    bad_outs: list[Any] = [
        np.empty((4, 9), np.float16),                   # shape
        np.empty((4, 8), np.float32),                   # dtype
        np.empty((8, 4), np.float16).T,                 # not C-contiguous
        np.frombuffer(bytes(64), np.float16).reshape(4, 8),   # read-only
        torch.empty(4, 8, dtype=torch.bfloat16),        # torch dtype
        torch.empty(8, 4, dtype=torch.float16).t(),     # torch layout
        [[0.0] * 8] * 4,                                # not a tensor
    ]
    for out in bad_outs:
        with pytest.raises(CodecError):
            codec.decode(data, (4, 8), DType.FLOAT16, out=out)
    with pytest.raises(CodecError):
        codec.decode(data, (4, 8), DType.FLOAT16, out=np.empty((4, 8), np.float16), device="cpu")


@pytest.mark.parametrize("codec", [RAW, INT8], ids=["raw", "int8"])
def test_payload_size_must_match_shape_and_dtype(codec: RawCodec | Int8Codec) -> None:
    data = bytes(codec.encode(np.ones((4, 8), np.float16)).data)
    for wrong in (data[:-1], data + b"\0", b""):
        with pytest.raises(CorruptBlock):
            codec.decode(wrong, (4, 8), DType.FLOAT16)
    with pytest.raises(CorruptBlock):
        codec.decode(data, (2, 16), DType.FLOAT32)  # same element count, other layout


def test_int8_refuses_invalid_scales() -> None:
    data = bytearray(INT8.encode(np.ones((2, 4), np.float16)).data)
    for scale in (-1.0, np.inf, np.nan):
        data[:4] = np.float32(scale).tobytes()
        with pytest.raises(CorruptBlock):
            INT8.decode(bytes(data), (2, 4), DType.FLOAT16)


def test_inputs_are_checked() -> None:
    bad: list[tuple[Any, Any]] = [
        (np.ones((2, 3), np.float64), None),            # unsupported dtype
        (np.ones((2, 3), np.uint16), None),             # bits without saying which dtype
        (np.ones((2, 3), np.float16), "bfloat16"),      # dtype contradicts the array
        (torch.ones(2, 3, dtype=torch.float16), "bf16"),
        (torch.ones(2, 3, dtype=torch.float64), None),
        (np.ones((2, 3), np.float16), "float8"),        # unknown dtype name
        (np.ones((2, 0), np.float16), None),            # empty
        (np.float16(1.0), None),                        # 0-d scalar
        (np.ones((1,) * 9, np.float16), None),          # more dims than a frame holds
        ([1.0, 2.0], None),                             # not a tensor
        (np.ones((2, 3), ">f2"), None),                 # foreign byte order
    ]
    for x, dtype in bad:
        for codec in (RAW, INT8):
            with pytest.raises(CodecError):
                codec.encode(x, dtype=dtype)
    assert describe(np.ones((2, 3), np.int16), "bf16") == ((2, 3), DType.BFLOAT16)
    assert describe(torch.ones(5, requires_grad=True)) == ((5,), DType.FLOAT32)
    assert RAW.encode(torch.ones(5, requires_grad=True)).shape == (5,)


def test_codec_registry() -> None:
    assert get_codec("raw") is get_codec(CodecId.RAW)
    assert get_codec("INT8").codec_id is CodecId.INT8
    with pytest.raises(CodecError):
        get_codec("fp8")
