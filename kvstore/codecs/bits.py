"""Scalar bit-level steps of the numba kernels, as tiny LLVM intrinsics, and the scale rules.

numba has no scalar bit `view`, and it widens integer arithmetic on uint16/uint32 to 64 bits,
which halves the vector width (bf16 dequantize ran at a third of fp16's speed); written in LLVM
IR, each step below is a few 32-bit vector instructions. Shared by the per-row int8 kernels
(`kernels`) and the grouped ones (`grouped_kernels`).

The dtype-generic helpers (`to_f32`, `from_f32`, `magnitude`, ...) take a *tag* argument whose
numba type names the element dtype (`TAGS`): one kernel source is compiled per dtype, with the
conversion chosen at compile time, so no branch sits in an inner loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from kvstore.codecs.llvmlite_compat import patch_llvmlite_for_vllm
from kvstore.frame import DType

__all__ = ["TINY_ABSMAX", "TAGS", "h2f", "f2h", "b2f", "f2b", "u2f", "f2u", "abs_bits",
           "round_i8", "row_scale", "set_scale", "valid_scale", "to_f32", "from_f32",
           "magnitude", "magnitude_buffer", "no_magnitude", "to_magnitude", "magnitude_value",
           "non_finite_magnitude", "order_key", "key_value", "key_ceiling", "non_finite_keys"]

# Importing numba loads llvmlite, whose `lib` object breaks vLLM's CPU start-up scan of
# sys.modules; make it harmless here, where the import happens (see llvmlite_compat).
patch_llvmlite_for_vllm()

TINY_ABSMAX = 2.0**-100
"""Groups whose absmax (or range) is below this are stored with scale 0.

Only bf16 and fp32 can hold such values (fp16's smallest is 2**-24). Below ~2**-119 the scale
would be subnormal and 127/absmax would overflow float32, so the half-step error bound would no
longer hold; KV entries this small carry no information, and the absolute error stays < 2**-100.
"""

_I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()
# Adding 1.5 * 2**23 to |t| < 2**22 leaves round_half_even(t) in the float's low mantissa bits:
# its low byte is the int8 two's complement. One vaddps instead of vrndscaleps + vcvttps2dq.
_ROUND_MAGIC = 12582912.0


def _bitop(name: str, sig: Any, build: Callable[[Any, Any], Any]) -> Any:
    """An intrinsic of one argument whose LLVM body is `build(builder, arg)`."""
    def typer(typingctx: Any, value: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return build(builder, args[0])
        return sig, codegen
    typer.__name__ = name
    return intrinsic(typer)


def _const(kind: Any, value: float) -> Any:
    return ir.Constant(kind, value)


h2f = _bitop("h2f", types.float32(types.uint16),  # fp16 bits -> float32 (vcvtph2ps)
              lambda b, x: b.fpext(b.bitcast(x, ir.HalfType()), _F32))
f2h = _bitop("f2h", types.uint16(types.float32),  # float32 -> fp16 bits, nearest even
              lambda b, x: b.bitcast(b.fptrunc(x, ir.HalfType()), _I16))
b2f = _bitop("b2f", types.float32(types.uint16),  # bf16 bits are a float32's top half
              lambda b, x: b.bitcast(b.shl(b.zext(x, _I32), _const(_I32, 16)), _F32))
u2f = _bitop("u2f", types.float32(types.uint32), lambda b, x: b.bitcast(x, _F32))
f2u = _bitop("f2u", types.uint32(types.float32), lambda b, x: b.bitcast(x, _I32))
abs_bits = _bitop("abs_bits", types.uint32(types.float32),  # magnitude bits of a float32
                   lambda b, x: b.and_(b.bitcast(x, _I32), _const(_I32, 0x7FFFFFFF)))
round_i8 = _bitop("round_i8", types.int8(types.float32),
                   lambda b, x: b.trunc(b.bitcast(b.fadd(x, _const(_F32, _ROUND_MAGIC)), _I32),
                                        ir.IntType(8)))


def _f2b_ir(b: Any, x: Any) -> Any:
    """float32 -> bf16 bits, round to nearest even (finite values: all we ever narrow)."""
    u = b.bitcast(x, _I32)
    lsb = b.and_(b.lshr(u, _const(_I32, 16)), _const(_I32, 1))
    rounded = b.add(b.add(u, _const(_I32, 0x7FFF)), lsb)
    return b.trunc(b.lshr(rounded, _const(_I32, 16)), _I16)


f2b = _bitop("f2b", types.uint16(types.float32), _f2b_ir)


def _order_key_ir(width: int) -> Callable[[Any, Any], Any]:
    """Sign-magnitude bits -> an unsigned key that orders like the values: positives get the
    top bit set, negatives are inverted. Integer min/max on keys vectorize where float min/max
    reductions cannot (without fast-math, LLVM keeps them scalar for NaN's sake)."""
    kind = ir.IntType(width)
    top, rest = 1 << (width - 1), (1 << (width - 1)) - 1

    def build(b: Any, x: Any) -> Any:
        sign = b.lshr(x, ir.Constant(kind, width - 1))
        mask = b.or_(b.mul(sign, ir.Constant(kind, rest)), ir.Constant(kind, top))
        return b.xor(x, mask)
    return build


def _from_order_key_ir(width: int) -> Callable[[Any, Any], Any]:
    """The inverse of `_order_key_ir`."""
    kind = ir.IntType(width)
    full, rest = (1 << width) - 1, (1 << (width - 1)) - 1

    def build(b: Any, k: Any) -> Any:
        sign = b.lshr(k, ir.Constant(kind, width - 1))
        return b.xor(k, b.xor(ir.Constant(kind, full), b.mul(sign, ir.Constant(kind, rest))))
    return build


key16 = _bitop("key16", types.uint16(types.uint16), _order_key_ir(16))
unkey16 = _bitop("unkey16", types.uint16(types.uint16), _from_order_key_ir(16))
key32 = _bitop("key32", types.uint32(types.uint32), _order_key_ir(32))
unkey32 = _bitop("unkey32", types.uint32(types.uint32), _from_order_key_ir(32))


def _row_scale_py(absmax: Any) -> Any:
    """(scale, 127/absmax) for one row; a zero or negligible row gets (0, 0): it stores zeros."""
    if absmax < np.float32(TINY_ABSMAX):
        return np.float32(0.0), np.float32(0.0)
    scale = absmax / np.float32(127.0)
    # Only an fp32 absmax within an ulp of FLT_MAX gets here: 127 * scale would round to inf on
    # decode, so step the scale one ulp down (an error of ~1e-7 relative, far below half a step).
    if np.isinf(scale * np.float32(127.0)):
        scale = u2f(f2u(scale) - np.uint32(1))
    return scale, np.float32(127.0) / absmax


def _set_scale_py(row: Any, absmax: Any, non_finite: Any, scales: Any, inv: Any) -> Any:
    """Store a row's scale (NaN marks a row with inf/NaN) and 1/scale; 1 if the row is bad."""
    if non_finite:
        scales[row] = np.float32(np.nan)
        inv[row] = np.float32(0.0)
        return 1
    scales[row], inv[row] = row_scale(absmax)
    return 0


def _valid_scale_py(scale: Any) -> Any:
    """What our writers store: finite and >= 0. NaN fails both comparisons."""
    return scale >= np.float32(0.0) and scale <= np.float32(3.4028234663852886e38)


row_scale = numba.njit(inline="always")(_row_scale_py)
set_scale = numba.njit(inline="always")(_set_scale_py)
valid_scale = numba.njit(inline="always")(_valid_scale_py)


# ---------------------------------------------------------------------------------------------
# Dtype-generic steps. A kernel gets `tag = TAGS[dtype]` as an argument; its numba type picks
# the conversion when the kernel is compiled for that dtype. Elements are the bits the tensors
# module hands over: uint16 for fp16 and bf16, float32 for fp32.

TAGS: dict[DType, Any] = {DType.FLOAT16: np.uint8(0), DType.BFLOAT16: np.int8(0),
                          DType.FLOAT32: np.float32(0)}
TAG_TYPES: dict[DType, Any] = {DType.FLOAT16: types.uint8, DType.BFLOAT16: types.int8,
                               DType.FLOAT32: types.float32}


def _overload(stub: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """numba's `overload`, inlined, typed for mypy (numba's own decorators are untyped).

    numba checks that an implementation's parameters equal the overload's, annotations
    included: implementations below are annotated exactly as their overloads are."""
    return cast(Callable[[Callable[..., Any]], Callable[..., Any]],
                overload(stub, inline="always"))


def _dtype_of(tag: Any) -> DType:
    for dtype, kind in TAG_TYPES.items():
        if tag == kind:
            return dtype
    raise TypeError(f"no dtype has tag type {tag}")


def to_f32(tag: Any, x: Any) -> Any:
    """Element bits -> float32 (exact)."""
    raise NotImplementedError("numba only")


def from_f32(tag: Any, value: Any) -> Any:
    """float32 -> element bits, round to nearest even."""
    raise NotImplementedError("numba only")


def magnitude(tag: Any, x: Any) -> Any:
    """The magnitude bits of an element (uint16 for 16-bit dtypes, uint32 for fp32): they
    order like the magnitudes. Kept 16-bit where it can be: twice the lanes per vector max."""
    raise NotImplementedError("numba only")


def magnitude_buffer(tag: Any, size: Any) -> Any:
    """An uninitialized array of `size` magnitudes of the tag's type."""
    raise NotImplementedError("numba only")


def to_magnitude(tag: Any, value: Any) -> Any:
    """An unsigned integer converted to the tag's magnitude (and key) type."""
    raise NotImplementedError("numba only")


def no_magnitude(tag: Any) -> Any:
    """A zero magnitude of the tag's type (the start of a running max)."""
    raise NotImplementedError("numba only")


def magnitude_value(tag: Any, m: Any) -> Any:
    """The float32 value of magnitude bits `m`."""
    raise NotImplementedError("numba only")


def non_finite_magnitude(tag: Any) -> Any:
    """The smallest magnitude bits of an inf or NaN of the dtype."""
    raise NotImplementedError("numba only")


def order_key(tag: Any, x: Any) -> Any:
    """An element as an unsigned key (the type of `magnitude`) that orders like its value."""
    raise NotImplementedError("numba only")


def key_value(tag: Any, k: Any) -> Any:
    """The float32 value of an order key."""
    raise NotImplementedError("numba only")


def key_ceiling(tag: Any) -> Any:
    """The largest key of the tag's type (the start of a running min)."""
    raise NotImplementedError("numba only")


def non_finite_keys(tag: Any) -> Any:
    """(key of -inf, key of +inf): a key at or beyond either is an inf or a NaN."""
    raise NotImplementedError("numba only")


@_overload(order_key)
def _order_key(tag: Any, x: Any) -> Any:
    if _dtype_of(tag) is DType.FLOAT32:
        def impl1(tag: Any, x: Any) -> Any:
            return key32(f2u(x))
        return impl1
    def impl2(tag: Any, x: Any) -> Any:
        return key16(x)
    return impl2


@_overload(key_value)
def _key_value(tag: Any, k: Any) -> Any:
    dtype = _dtype_of(tag)
    if dtype is DType.FLOAT16:
        def impl1(tag: Any, k: Any) -> Any:
            return h2f(unkey16(k))
        return impl1
    if dtype is DType.BFLOAT16:
        def impl2(tag: Any, k: Any) -> Any:
            return b2f(unkey16(k))
        return impl2
    def impl3(tag: Any, k: Any) -> Any:
        return u2f(unkey32(k))
    return impl3


@_overload(key_ceiling)
def _key_ceiling(tag: Any) -> Any:
    if _dtype_of(tag) is DType.FLOAT32:
        def impl1(tag: Any) -> Any:
            return np.uint32(0xFFFFFFFF)
        return impl1
    def impl2(tag: Any) -> Any:
        return np.uint16(0xFFFF)
    return impl2


@_overload(non_finite_keys)
def _non_finite_keys(tag: Any) -> Any:
    dtype = _dtype_of(tag)
    if dtype is DType.FLOAT32:  # -inf 0xFF800000, +inf 0x7F800000
        def impl1(tag: Any) -> Any:
            return np.uint32(0x007FFFFF), np.uint32(0xFF800000)
        return impl1
    low, high = (0x03FF, 0xFC00) if dtype is DType.FLOAT16 else (0x007F, 0xFF80)

    def impl2(tag: Any) -> Any:
        return np.uint16(low), np.uint16(high)
    return impl2


@_overload(to_f32)
def _to_f32(tag: Any, x: Any) -> Any:
    dtype = _dtype_of(tag)
    if dtype is DType.FLOAT16:
        def impl1(tag: Any, x: Any) -> Any:
            return h2f(x)
        return impl1
    if dtype is DType.BFLOAT16:
        def impl2(tag: Any, x: Any) -> Any:
            return b2f(x)
        return impl2
    def impl3(tag: Any, x: Any) -> Any:
        return x
    return impl3


@_overload(from_f32)
def _from_f32(tag: Any, value: Any) -> Any:
    dtype = _dtype_of(tag)
    if dtype is DType.FLOAT16:
        def impl1(tag: Any, value: Any) -> Any:
            return f2h(value)
        return impl1
    if dtype is DType.BFLOAT16:
        def impl2(tag: Any, value: Any) -> Any:
            return f2b(value)
        return impl2
    def impl3(tag: Any, value: Any) -> Any:
        return value
    return impl3


@_overload(magnitude)
def _magnitude(tag: Any, x: Any) -> Any:
    if _dtype_of(tag) is DType.FLOAT32:
        def impl1(tag: Any, x: Any) -> Any:
            return abs_bits(x)
        return impl1
    def impl2(tag: Any, x: Any) -> Any:
        return np.uint16(x & np.uint16(0x7FFF))
    return impl2


@_overload(magnitude_buffer)
def _magnitude_buffer(tag: Any, size: Any) -> Any:
    if _dtype_of(tag) is DType.FLOAT32:
        def impl1(tag: Any, size: Any) -> Any:
            return np.empty(size, np.uint32)
        return impl1
    def impl2(tag: Any, size: Any) -> Any:
        return np.empty(size, np.uint16)
    return impl2


@_overload(to_magnitude)
def _to_magnitude(tag: Any, value: Any) -> Any:
    if _dtype_of(tag) is DType.FLOAT32:
        def impl1(tag: Any, value: Any) -> Any:
            return np.uint32(value)
        return impl1
    def impl2(tag: Any, value: Any) -> Any:
        return np.uint16(value)
    return impl2


@_overload(no_magnitude)
def _no_magnitude(tag: Any) -> Any:
    if _dtype_of(tag) is DType.FLOAT32:
        def impl1(tag: Any) -> Any:
            return np.uint32(0)
        return impl1
    def impl2(tag: Any) -> Any:
        return np.uint16(0)
    return impl2


@_overload(magnitude_value)
def _magnitude_value(tag: Any, m: Any) -> Any:
    dtype = _dtype_of(tag)
    if dtype is DType.FLOAT16:
        def impl1(tag: Any, m: Any) -> Any:
            return h2f(np.uint16(m))
        return impl1
    if dtype is DType.BFLOAT16:
        def impl2(tag: Any, m: Any) -> Any:
            return b2f(np.uint16(m))
        return impl2
    def impl3(tag: Any, m: Any) -> Any:
        return u2f(m)
    return impl3


@_overload(non_finite_magnitude)
def _non_finite_magnitude(tag: Any) -> Any:
    dtype = _dtype_of(tag)
    if dtype is DType.FLOAT32:
        def impl1(tag: Any) -> Any:
            return np.uint32(0x7F800000)
        return impl1
    bound = 0x7C00 if dtype is DType.FLOAT16 else 0x7F80
    def impl2(tag: Any) -> Any:
        return np.uint16(bound)
    return impl2
