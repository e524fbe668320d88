"""Symmetric 8-bit grouped kernels: scale = absmax / 127, q = round_half_even(x * 127 /
absmax) in [-127, 127], one scale per group of a loop plan (see `grouped_kernels` for the shape
of the loops and the error bound)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from kvstore.codecs.bits import (
    TINY_ABSMAX,
    f2u,
    from_f32,
    magnitude,
    magnitude_buffer,
    magnitude_value,
    no_magnitude,
    non_finite_magnitude,
    round_i8,
    to_f32,
    to_magnitude,
    u2f,
    valid_scale,
)
from kvstore.codecs.kernel_plans import LOW16, SHIFT16, U0, U1, U2, pair, plane, spread, width

__all__ = ["quantize", "dequantize"]

Array = npt.NDArray[Any]


def _sym_scale_py(m: Any, tag: Any) -> Any:
    """(scale, 1/scale, bad) for magnitude bits `m`: bad = 1 when the group holds inf/NaN."""
    if m >= non_finite_magnitude(tag):
        return np.float32(np.nan), np.float32(0.0), 1
    absmax = magnitude_value(tag, m)
    if absmax < np.float32(TINY_ABSMAX):
        return np.float32(0.0), np.float32(0.0), 0
    scale = absmax / np.float32(127.0)
    if np.isinf(scale * np.float32(127.0)):  # fp32 absmax within an ulp of FLT_MAX
        scale = u2f(f2u(scale) - np.uint32(1))
    return scale, np.float32(127.0) / absmax, 0


_sym_scale = numba.njit(inline="always")(_sym_scale_py)


def _quantize_sym(src: Array, tag: Any, plan: Array, scales: Array, q: Array) -> int:
    size = width(plan)
    acc = magnitude_buffer(tag, size)
    words = acc.view(np.uint32)
    fac = np.empty(size, np.float32)
    fac_pairs = fac.view(np.uint64)
    runs = np.empty(scales.size, np.float32)  # 1/scale per group of the contiguous-runs path
    bad = 0
    g_base = U0
    for r in range(plan.shape[0]):
        base, n_p, sp, n_a, sa, n_b, sb, n_c, sc, n_e, run, inner, jn, ng = plane(plan, r)
        contiguous = n_b == U1 and inner == U1
        for p in range(n_p):
            for a in range(n_a):
                for c in range(n_c):
                    o0 = base + p * sp + a * sa + c * sc
                    g0 = g_base + ((p * n_a + a) * n_c + c) * ng
                    if contiguous:  # runs: scales now, conversions in a second phase below
                        for g in range(ng):
                            lo = o0 + g * run
                            m = no_magnitude(tag)
                            for e in range(run):
                                m = max(m, magnitude(tag, src[lo + e]))
                            scale, inv, flag = _sym_scale(m, tag)
                            scales[g0 + g] = scale
                            runs[g0 + g] = inv
                            bad += flag
                        continue
                    for e in range(n_e):
                        acc[e] = no_magnitude(tag)
                    for b in range(n_b):
                        o = o0 + b * sb
                        for e in range(n_e):
                            acc[e] = max(acc[e], magnitude(tag, src[o + e]))
                    if inner == U1:
                        for g in range(ng):
                            first = g * run
                            m = no_magnitude(tag)
                            for k in range(run):
                                m = max(m, acc[first + k])
                            scale, inv, flag = _sym_scale(m, tag)
                            scales[g0 + g] = scale
                            bad += flag
                            for k in range(run):
                                fac[first + k] = inv
                    else:
                        for jj in range(jn):
                            w0 = jj * run
                            m0 = np.uint32(0)
                            m1 = np.uint32(0)
                            for k in range(run):
                                w = words[w0 + k]
                                m0 = max(m0, w & LOW16)
                                m1 = max(m1, w >> SHIFT16)
                            s0, inv0, f0 = _sym_scale(to_magnitude(tag, m0), tag)
                            s1, inv1, f1 = _sym_scale(to_magnitude(tag, m1), tag)
                            scales[g0 + U2 * jj] = s0
                            scales[g0 + U2 * jj + U1] = s1
                            bad += f0 + f1
                            both = pair(inv0, inv1)
                            for k in range(run):
                                fac_pairs[w0 + k] = both
                    for b in range(n_b):
                        o = o0 + b * sb
                        for e in range(n_e):
                            q[o + e] = round_i8(to_f32(tag, src[o + e]) * fac[e])
        if contiguous:
            # Every scale first, then one tight loop of conversions (as the per-row kernels
            # do; ~20 % faster than run by run).
            for p in range(n_p):
                for a in range(n_a):
                    for c in range(n_c):
                        o0 = base + p * sp + a * sa + c * sc
                        g0 = g_base + ((p * n_a + a) * n_c + c) * ng
                        for g in range(ng):
                            lo = o0 + g * run
                            inv = runs[g0 + g]
                            for e in range(run):
                                q[lo + e] = round_i8(to_f32(tag, src[lo + e]) * inv)
        g_base += n_p * n_a * n_c * ng
    return bad


def _dequantize_sym(q: Array, scales: Array, tag: Any, plan: Array, dst: Array) -> int:
    # Every scale is checked before anything is decoded, and a segment with a bad one is not
    # decoded at all (the codec raises): a fallback scale chosen inside the loops kept them
    # from vectorizing.
    bad = 0
    for i in range(scales.size):
        if not valid_scale(scales[i]):
            bad += 1
    if bad:
        return bad
    fac = np.empty(width(plan), np.float32)
    fac_pairs = fac.view(np.uint64)
    g_base = U0
    for r in range(plan.shape[0]):
        base, n_p, sp, n_a, sa, n_b, sb, n_c, sc, n_e, run, inner, jn, ng = plane(plan, r)
        contiguous = n_b == U1 and inner == U1
        for p in range(n_p):
            for a in range(n_a):
                for c in range(n_c):
                    o0 = base + p * sp + a * sa + c * sc
                    g0 = g_base + ((p * n_a + a) * n_c + c) * ng
                    if contiguous:
                        for g in range(ng):
                            lo = o0 + g * run
                            scale = scales[g0 + g]
                            for e in range(run):
                                dst[lo + e] = from_f32(tag, np.float32(q[lo + e]) * scale)
                        continue
                    spread(scales, g0, jn, run, inner, fac, fac_pairs)
                    for b in range(n_b):
                        o = o0 + b * sb
                        for e in range(n_e):
                            dst[o + e] = from_f32(tag, np.float32(q[o + e]) * fac[e])
        g_base += n_p * n_a * n_c * ng
    return bad


quantize = _quantize_sym
dequantize = _dequantize_sym
