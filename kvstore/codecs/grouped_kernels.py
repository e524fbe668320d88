"""Fused numba kernels for the grouped codecs: one scale (and zero point) per group of elements,
the groups laid out by loop plans (`arrangement.Plane`), on the raw bits of fp16, bf16, fp32.

Three schemes, quantize and dequantize each:
- symmetric 8-bit: scale = absmax / 127, q = round_half_even(x * 127 / absmax) in [-127, 127];
- asymmetric 8-bit and 4-bit (KIVI / LMDeploy style): zero = min, scale = (max - min) / top,
  q = round_half_even((x - min) * top / (max - min)) in [0, top], top = 255 or 15; 4-bit
  values are packed two per byte (element 2i in the low nibble, 2i+1 in the high one).

Error per element before rounding to the output dtype: at most half a step (scale / 2) plus a
few float32 ulps. A group whose absmax (symmetric) or range (asymmetric) is below TINY_ABSMAX
gets scale 0 and decodes to zero (symmetric) or to its minimum (asymmetric). inf and NaN cannot
be represented: a group holding one gets a NaN scale and is counted, and the codec raises.

The kernels live in `symmetric_kernels` and `zero_point_kernels` (helpers in `kernel_plans`);
this module compiles and calls them. How the loops are shaped (see `arrangement` for the
plans): per (p, a, c) tile, pass 1 keeps one running max (and min) per position e over the b
axis, a fold turns those into the group scales and spreads 1/scale back over e, pass 2
converts. The innermost loop always runs over the
contiguous axis e, so both passes vectorize. Plans whose scale covers one contiguous run per
tile (B == 1: per-token and group-wise scales on canonical blocks) take a shorter path with no
running buffers, like the per-row int8 kernels. Kernels are serial and release the GIL; a
per-layer block is far below the size where splitting over threads pays (`kernels`).

Every kernel is one Python function compiled per dtype: `tag` (see `bits.TAGS`) selects the
element conversion at compile time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
import numpy.typing as npt
from numba import types

from kvstore.codecs import symmetric_kernels, zero_point_kernels
from kvstore.codecs.bits import TAG_TYPES, TAGS
from kvstore.frame import DType

__all__ = ["quantize_sym", "dequantize_sym", "quantize_asym", "dequantize_asym", "warmup"]

Array = npt.NDArray[Any]


# ---------------------------------------------------------------------------------------------
# Signatures (read-only inputs, so writable arrays convert too) and compilation on first use.


def _ro(kind: Any) -> Any:
    return types.Array(kind, 1, "C", readonly=True)


_SRC = {DType.FLOAT16: types.uint16, DType.BFLOAT16: types.uint16, DType.FLOAT32: types.float32}
_PLAN = types.Array(types.int64, 2, "C", readonly=True)
_F32_W, _F32_RO = types.float32[::1], _ro(types.float32)


def _signature(kind: str, dtype: DType) -> Any:
    elem, tag = _SRC[dtype], TAG_TYPES[dtype]
    if kind == "qs":
        return types.int64(_ro(elem), tag, _PLAN, _F32_W, types.int8[::1])
    if kind == "ds":
        return types.int64(_ro(types.int8), _F32_RO, tag, _PLAN, elem[::1])
    if kind == "qa":
        return types.int64(_ro(elem), tag, _PLAN, types.float32, _F32_W, _F32_W,
                           types.uint8[::1])
    return types.int64(_ro(types.uint8), _F32_RO, _F32_RO, tag, _PLAN, types.float32,
                       elem[::1])


_PY: dict[str, Callable[..., int]] = {
    "qs": symmetric_kernels.quantize, "ds": symmetric_kernels.dequantize,
    "qa": zero_point_kernels.quantize, "da": zero_point_kernels.dequantize}
_compile_lock = threading.Lock()
_compiled: dict[tuple[str, DType], Callable[..., Any]] = {}


def _kernel(kind: str, dtype: DType) -> Callable[..., Any]:
    fn = _compiled.get((kind, dtype))
    if fn is None:
        with _compile_lock:
            fn = _compiled.get((kind, dtype))
            if fn is None:
                fn = numba.njit(_signature(kind, dtype), cache=True, nogil=True)(_PY[kind])
                _compiled[(kind, dtype)] = fn
    return fn


def quantize_sym(src: Array, dtype: DType, plan: Array, scales: Array, q: Array) -> int:
    """Symmetric 8-bit: flat element bits `src` -> `scales` [groups], `q` [elements] int8.
    Returns the number of groups holding inf or NaN."""
    return int(_kernel("qs", dtype)(src, TAGS[dtype], plan, scales, q))


def dequantize_sym(q: Array, scales: Array, dtype: DType, plan: Array, dst: Array) -> int:
    """The inverse of `quantize_sym` into flat bits `dst`; returns the number of invalid
    scales (then nothing is written)."""
    return int(_kernel("ds", dtype)(q, scales, TAGS[dtype], plan, dst))


def quantize_asym(src: Array, dtype: DType, plan: Array, top: int, scales: Array,
                  zeros: Array, q: Array) -> int:
    """Asymmetric `top` (255 or 15) levels: `src` -> `scales`, `zeros`, `q` (uint8; packed in
    nibbles for 15). Returns the number of groups holding inf or NaN or too wide a range."""
    return int(_kernel("qa", dtype)(src, TAGS[dtype], plan, np.float32(top), scales, zeros, q))


def dequantize_asym(q: Array, scales: Array, zeros: Array, dtype: DType, plan: Array,
                    top: int, dst: Array) -> int:
    """The inverse of `quantize_asym`; returns the number of groups with an invalid scale or
    zero point (then nothing is written)."""
    return int(_kernel("da", dtype)(q, scales, zeros, TAGS[dtype], plan, np.float32(top), dst))


def warmup(dtypes: tuple[DType, ...] = tuple(DType)) -> None:
    """Compile (or load from numba's cache) every grouped kernel for `dtypes`."""
    for dtype in dtypes:
        for kind in _PY:
            _kernel(kind, dtype)
