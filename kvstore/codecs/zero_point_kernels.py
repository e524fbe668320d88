"""Zero-point (asymmetric) grouped kernels, 8-bit and 4-bit (KIVI / LMDeploy style): zero =
min, scale = (max - min) / top, q = round_half_even((x - min) * top / (max - min)) in [0, top],
top = 255 or 15; 4-bit values are packed two per byte (element 2i in the low nibble, 2i+1 in
the high one). See `grouped_kernels` for the shape of the loops and the error bound."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from kvstore.codecs.bits import (
    TINY_ABSMAX,
    f2u,
    from_f32,
    key_ceiling,
    key_value,
    magnitude_buffer,
    no_magnitude,
    non_finite_keys,
    order_key,
    round_i8,
    to_f32,
    to_magnitude,
    u2f,
    valid_scale,
)
from kvstore.codecs.kernel_plans import (
    FLT_MAX,
    LOW16,
    SHIFT16,
    U0,
    U1,
    U2,
    pair,
    plane,
    spread,
    width,
)

__all__ = ["quantize", "dequantize"]

Array = npt.NDArray[Any]


def _asym_scale_py(lo: Any, hi: Any, non_finite: Any, top: Any) -> Any:
    """(scale, 1/scale, bad) of a group with minimum `lo` and maximum `hi` (`non_finite`: the
    group holds an inf or NaN)."""
    if non_finite:
        return np.float32(np.nan), np.float32(0.0), 1
    span = hi - lo
    if not span <= FLT_MAX:  # the range overflows float32: not representable
        return np.float32(np.nan), np.float32(0.0), 1
    if span < np.float32(TINY_ABSMAX):
        return np.float32(0.0), np.float32(0.0), 0
    scale = span / top
    # lo + top * scale must stay finite on decode (only near FLT_MAX can it not).
    while np.isinf(lo + top * scale):
        scale = u2f(f2u(scale) - np.uint32(1))
    return scale, top / span, 0


_asym_scale = numba.njit(inline="always")(_asym_scale_py)


def _asym_group_py(k_lo: Any, k_hi: Any, tag: Any, top: Any) -> Any:
    """(scale, 1/scale, zero, bad) of a group whose order keys span [k_lo, k_hi]."""
    neg_inf, pos_inf = non_finite_keys(tag)
    flag = 1 if k_lo <= neg_inf or k_hi >= pos_inf else 0
    lo = key_value(tag, k_lo)
    scale, inv, flag = _asym_scale(lo, key_value(tag, k_hi), flag, top)
    return scale, inv, lo if flag == 0 else np.float32(0.0), flag


_asym_group = numba.njit(inline="always")(_asym_group_py)


def _quantize_asym(src: Array, tag: Any, plan: Array, top: Any, scales: Array, zeros: Array,
                   q: Array) -> int:
    """`q` holds one byte per element (top 255) or one per two elements (top 15).

    Group minima and maxima are taken over order keys (`bits.order_key`), whose integer
    min/max vectorize, and the same keys tell whether a group holds an inf or NaN."""
    size = width(plan)
    lo_acc = magnitude_buffer(tag, size)
    hi_acc = magnitude_buffer(tag, size)
    lo_words = lo_acc.view(np.uint32)
    hi_words = hi_acc.view(np.uint32)
    fac = np.empty(size, np.float32)
    off = np.empty(size, np.float32)
    fac_pairs = fac.view(np.uint64)
    off_pairs = off.view(np.uint64)
    level = np.empty(size, np.uint8)
    runs = np.empty(scales.size, np.float32)  # 1/scale per group of the contiguous-runs path
    g_lo = magnitude_buffer(tag, size)  # per group of one tile: keys, scales, 1/scales, zeros
    g_hi = magnitude_buffer(tag, size)
    g_scale = np.empty(size, np.float32)
    g_inv = np.empty(size, np.float32)
    g_zero = np.empty(size, np.float32)
    packed = top < np.float32(16.0)
    neg_inf, pos_inf = non_finite_keys(tag)
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
                            start = o0 + g * run
                            k_lo = key_ceiling(tag)
                            k_hi = no_magnitude(tag)
                            for e in range(run):
                                k = order_key(tag, src[start + e])
                                k_lo = min(k_lo, k)
                                k_hi = max(k_hi, k)
                            flag = 1 if k_lo <= neg_inf or k_hi >= pos_inf else 0
                            lo = key_value(tag, k_lo)
                            scale, inv, flag = _asym_scale(lo, key_value(tag, k_hi), flag, top)
                            scales[g0 + g] = scale
                            zeros[g0 + g] = lo if flag == 0 else np.float32(0.0)
                            runs[g0 + g] = inv
                            bad += flag
                        continue
                    for e in range(n_e):
                        lo_acc[e] = key_ceiling(tag)
                        hi_acc[e] = no_magnitude(tag)
                    for b in range(n_b):
                        o = o0 + b * sb
                        for e in range(n_e):
                            k = order_key(tag, src[o + e])
                            lo_acc[e] = min(lo_acc[e], k)
                            hi_acc[e] = max(hi_acc[e], k)
                    if inner == U1:
                        # Many groups per tile (per-channel K: one per position): their keys
                        # first, then one branch-free pass over all of them (it vectorizes;
                        # group by group, the scalar scale arithmetic cost as much as the
                        # data), then the rare groups that need care, one by one.
                        if run == U1:  # a group per position: its keys are the buffers'
                            g_lo[:n_e] = lo_acc[:n_e]
                            g_hi[:n_e] = hi_acc[:n_e]
                        else:
                            for g in range(ng):
                                first = g * run
                                k_lo = key_ceiling(tag)
                                k_hi = no_magnitude(tag)
                                for k in range(run):
                                    k_lo = min(k_lo, lo_acc[first + k])
                                    k_hi = max(k_hi, hi_acc[first + k])
                                g_lo[g] = k_lo
                                g_hi[g] = k_hi
                        odd = 0
                        for g in range(ng):
                            lo = key_value(tag, g_lo[g])
                            span = key_value(tag, g_hi[g]) - lo
                            fine = (g_lo[g] > neg_inf) & (g_hi[g] < pos_inf) \
                                & (span >= np.float32(TINY_ABSMAX)) & (span <= FLT_MAX)
                            g_scale[g] = span / top if fine else np.float32(0.0)
                            g_inv[g] = top / span if fine else np.float32(0.0)
                            g_zero[g] = lo
                            odd += 0 if fine and lo + top * g_scale[g] <= FLT_MAX else 1
                        if odd:
                            for g in range(ng):
                                scale, inv, zero, flag = _asym_group(g_lo[g], g_hi[g], tag,
                                                                     top)
                                g_scale[g] = scale
                                g_inv[g] = inv
                                g_zero[g] = zero
                                bad += flag
                        for g in range(ng):
                            scales[g0 + g] = g_scale[g]
                            zeros[g0 + g] = g_zero[g]
                        if run == U1:
                            fac[:n_e] = g_inv[:n_e]
                            off[:n_e] = g_zero[:n_e]
                        else:
                            for g in range(ng):
                                first = g * run
                                for k in range(run):
                                    fac[first + k] = g_inv[g]
                                    off[first + k] = g_zero[g]
                    else:
                        for jj in range(jn):
                            w0 = jj * run
                            l0 = LOW16
                            l1 = LOW16
                            h0 = np.uint32(0)
                            h1 = np.uint32(0)
                            for k in range(run):
                                lw = lo_words[w0 + k]
                                hw = hi_words[w0 + k]
                                l0 = min(l0, lw & LOW16)
                                l1 = min(l1, lw >> SHIFT16)
                                h0 = max(h0, hw & LOW16)
                                h1 = max(h1, hw >> SHIFT16)
                            g = g0 + U2 * jj
                            s0, inv0, z0, f0 = _asym_group(to_magnitude(tag, l0),
                                                           to_magnitude(tag, h0), tag, top)
                            s1, inv1, z1, f1 = _asym_group(to_magnitude(tag, l1),
                                                           to_magnitude(tag, h1), tag, top)
                            scales[g] = s0
                            scales[g + U1] = s1
                            zeros[g] = z0
                            zeros[g + U1] = z1
                            bad += f0 + f1
                            both_inv = pair(inv0, inv1)
                            both_zero = pair(z0, z1)
                            for k in range(run):
                                fac_pairs[w0 + k] = both_inv
                                off_pairs[w0 + k] = both_zero
                    for b in range(n_b):
                        o = o0 + b * sb
                        if packed:
                            for e in range(n_e):
                                level[e] = np.uint8(round_i8((to_f32(tag, src[o + e]) - off[e])
                                                             * fac[e]))
                            half_o = o >> U1
                            for e in range(n_e >> U1):
                                q[half_o + e] = level[U2 * e] | (level[U2 * e + U1]
                                                                  << np.uint8(4))
                        else:
                            for e in range(n_e):
                                q[o + e] = np.uint8(round_i8((to_f32(tag, src[o + e]) - off[e])
                                                             * fac[e]))
        if contiguous:
            for p in range(n_p):
                for a in range(n_a):
                    for c in range(n_c):
                        o0 = base + p * sp + a * sa + c * sc
                        g0 = g_base + ((p * n_a + a) * n_c + c) * ng
                        for g in range(ng):
                            start = o0 + g * run
                            inv = runs[g0 + g]
                            zero = zeros[g0 + g]
                            if packed:
                                for e in range(run):
                                    level[e] = np.uint8(round_i8(
                                        (to_f32(tag, src[start + e]) - zero) * inv))
                                half_o = start >> U1
                                for e in range(run >> U1):
                                    q[half_o + e] = level[U2 * e] | (level[U2 * e + U1]
                                                                      << np.uint8(4))
                            else:
                                for e in range(run):
                                    q[start + e] = np.uint8(round_i8(
                                        (to_f32(tag, src[start + e]) - zero) * inv))
        g_base += n_p * n_a * n_c * ng
    return bad


def _dequantize_asym(q: Array, scales: Array, zeros: Array, tag: Any, plan: Array, top: Any,
                     dst: Array) -> int:
    # What our writers store: a finite scale >= 0 and a finite zero whose top level is finite
    # too. Anything else passed a checksum but was written wrong (or forged): checked first,
    # as in `_dequantize_sym`, and then nothing is decoded.
    bad = 0
    for i in range(scales.size):
        if not (valid_scale(scales[i]) and abs(zeros[i]) <= FLT_MAX
                and abs(zeros[i] + top * scales[i]) <= FLT_MAX):
            bad += 1
    if bad:
        return bad
    size = width(plan)
    fac = np.empty(size, np.float32)
    off = np.empty(size, np.float32)
    fac_pairs = fac.view(np.uint64)
    off_pairs = off.view(np.uint64)
    packed = top < np.float32(16.0)
    g_base = U0
    for r in range(plan.shape[0]):
        base, n_p, sp, n_a, sa, n_b, sb, n_c, sc, n_e, run, inner, jn, ng = plane(plan, r)
        contiguous = n_b == U1 and inner == U1
        for p in range(n_p):
            for a in range(n_a):
                for c in range(n_c):
                    o0 = base + p * sp + a * sa + c * sc
                    g0 = g_base + ((p * n_a + a) * n_c + c) * ng
                    if contiguous:  # runs: one scale and zero each, no buffers
                        for g in range(ng):
                            start = o0 + g * run
                            scale = scales[g0 + g]
                            zero = zeros[g0 + g]
                            if packed:
                                half_o = start >> U1
                                for e in range(run >> U1):
                                    byte = q[half_o + e]
                                    j = U2 * e
                                    dst[start + j] = from_f32(
                                        tag, np.float32(byte & np.uint8(15)) * scale + zero)
                                    dst[start + j + U1] = from_f32(
                                        tag, np.float32(byte >> np.uint8(4)) * scale + zero)
                            else:
                                for e in range(run):
                                    dst[start + e] = from_f32(
                                        tag, np.float32(q[start + e]) * scale + zero)
                        continue
                    spread(scales, g0, jn, run, inner, fac, fac_pairs)
                    spread(zeros, g0, jn, run, inner, off, off_pairs)
                    for b in range(n_b):
                        o = o0 + b * sb
                        if packed:
                            half_o = o >> U1
                            for e in range(n_e >> U1):
                                byte = q[half_o + e]
                                j = U2 * e
                                dst[o + j] = from_f32(
                                    tag, np.float32(byte & np.uint8(15)) * fac[j] + off[j])
                                dst[o + j + U1] = from_f32(
                                    tag, np.float32(byte >> np.uint8(4)) * fac[j + U1]
                                    + off[j + U1])
                        else:
                            for e in range(n_e):
                                dst[o + e] = from_f32(tag, np.float32(q[o + e]) * fac[e]
                                                      + off[e])
        g_base += n_p * n_a * n_c * ng
    return bad


quantize = _quantize_asym
dequantize = _dequantize_asym
