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

How the loops are shaped (see `arrangement` for the plans): per (p, a, c) tile, pass 1 keeps
one running max (and min) per position e over the b axis, a fold turns those into the group
scales and spreads 1/scale back over e, pass 2 converts. The innermost loop always runs over the
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

from kvstore.codecs.bits import (
    TAG_TYPES,
    TAGS,
    TINY_ABSMAX,
    f2u,
    from_f32,
    key_ceiling,
    key_value,
    magnitude,
    magnitude_buffer,
    magnitude_value,
    no_magnitude,
    non_finite_keys,
    non_finite_magnitude,
    order_key,
    round_i8,
    to_f32,
    to_magnitude,
    u2f,
    valid_scale,
)
from kvstore.frame import DType

__all__ = ["quantize_sym", "dequantize_sym", "quantize_asym", "dequantize_asym", "warmup"]

Array = npt.NDArray[Any]

_FLT_MAX = np.float32(3.4028234663852886e38)


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


def _asym_scale_py(lo: Any, hi: Any, non_finite: Any, top: Any) -> Any:
    """(scale, 1/scale, bad) of a group with minimum `lo` and maximum `hi` (`non_finite`: the
    group holds an inf or NaN)."""
    if non_finite:
        return np.float32(np.nan), np.float32(0.0), 1
    span = hi - lo
    if not span <= _FLT_MAX:  # the range overflows float32: not representable
        return np.float32(np.nan), np.float32(0.0), 1
    if span < np.float32(TINY_ABSMAX):
        return np.float32(0.0), np.float32(0.0), 0
    scale = span / top
    # lo + top * scale must stay finite on decode (only near FLT_MAX can it not).
    while np.isinf(lo + top * scale):
        scale = u2f(f2u(scale) - np.uint32(1))
    return scale, top / span, 0


def _plane_py(plan: Array, r: int) -> Any:
    """Row `r` of a plan as unsigned loop bounds and strides: (base, P, sp, A, sa, B, sb, C, sc,
    E, run, inner, J, G), J = E / (run * inner), G = J * inner groups per tile.

    Unsigned on purpose: numba gives every signed index a wrap-around branch for negative
    values, and unless LLVM can prove an index non-negative that branch keeps the inner loops
    scalar (~10x slower here). Every index in these kernels is uint64, and so is every
    integer they combine with one (numba turns int64 op uint64 into float64)."""
    u = np.uint64
    n_e, run, inner = u(plan[r, 9]), u(plan[r, 10]), u(plan[r, 11])
    jn = n_e // (run * inner)
    return (u(plan[r, 0]), u(plan[r, 1]), u(plan[r, 2]), u(plan[r, 3]), u(plan[r, 4]),
            u(plan[r, 5]), u(plan[r, 6]), u(plan[r, 7]), u(plan[r, 8]), n_e, run, inner, jn,
            jn * inner)


_plane = numba.njit(inline="always")(_plane_py)
_sym_scale = numba.njit(inline="always")(_sym_scale_py)
_asym_scale = numba.njit(inline="always")(_asym_scale_py)
_U0, _U1, _U2 = np.uint64(0), np.uint64(1), np.uint64(2)
_LOW16, _SHIFT16, _SHIFT32 = np.uint32(0xFFFF), np.uint32(16), np.uint64(32)


def _width(plan: Array) -> int:
    """The longest contiguous axis E of a plan's planes: the running buffers' size."""
    width = 2
    for r in range(plan.shape[0]):
        width = max(width, plan[r, 9])
    return width


def _pair_py(first: Any, second: Any) -> Any:
    """Two float32 as one uint64 (first in the low half): what one store writes to a pair
    of adjacent float32 slots."""
    return np.uint64(f2u(first)) | (np.uint64(f2u(second)) << _SHIFT32)


def _asym_group_py(k_lo: Any, k_hi: Any, tag: Any, top: Any) -> Any:
    """(scale, 1/scale, zero, bad) of a group whose order keys span [k_lo, k_hi]."""
    neg_inf, pos_inf = non_finite_keys(tag)
    flag = 1 if k_lo <= neg_inf or k_hi >= pos_inf else 0
    lo = key_value(tag, k_lo)
    scale, inv, flag = _asym_scale(lo, key_value(tag, k_hi), flag, top)
    return scale, inv, lo if flag == 0 else np.float32(0.0), flag


_width_nb = numba.njit(inline="always")(_width)
_pair = numba.njit(inline="always")(_pair_py)
_asym_group = numba.njit(inline="always")(_asym_group_py)

# Folds. A tile's running per-position buffers become one value per group (j, i), and the
# groups' factors are spread back over positions. inner 1: groups are runs of `run` adjacent
# positions (contiguous loops). inner 2 (the AMX packing's pairs, 16-bit dtypes only): the
# positions of a pair are the two halves of one 32-bit word, and their two factors one 64-bit
# store; read that way, both loops run over contiguous words and vectorize, where a stride-2
# loop stayed scalar.


def _quantize_sym(src: Array, tag: Any, plan: Array, scales: Array, q: Array) -> int:
    width = _width_nb(plan)
    acc = magnitude_buffer(tag, width)
    words = acc.view(np.uint32)
    fac = np.empty(width, np.float32)
    fac_pairs = fac.view(np.uint64)
    runs = np.empty(scales.size, np.float32)  # 1/scale per group of the contiguous-runs path
    bad = 0
    g_base = _U0
    for r in range(plan.shape[0]):
        base, n_p, sp, n_a, sa, n_b, sb, n_c, sc, n_e, run, inner, jn, ng = _plane(plan, r)
        contiguous = n_b == _U1 and inner == _U1
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
                    if inner == _U1:
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
                                m0 = max(m0, w & _LOW16)
                                m1 = max(m1, w >> _SHIFT16)
                            s0, inv0, f0 = _sym_scale(to_magnitude(tag, m0), tag)
                            s1, inv1, f1 = _sym_scale(to_magnitude(tag, m1), tag)
                            scales[g0 + _U2 * jj] = s0
                            scales[g0 + _U2 * jj + _U1] = s1
                            bad += f0 + f1
                            both = _pair(inv0, inv1)
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


def _spread_sym(scales: Array, g0: Any, jn: Any, run: Any, inner: Any, fac: Array,
                fac_pairs: Array) -> None:
    """Per-position factors of one tile from its groups' scales (see Folds above)."""
    if inner == _U1:
        for g in range(jn):
            scale = scales[g0 + g]
            for k in range(run):
                fac[g * run + k] = scale
    else:
        for jj in range(jn):
            both = _pair(scales[g0 + _U2 * jj], scales[g0 + _U2 * jj + _U1])
            for k in range(run):
                fac_pairs[jj * run + k] = both


_spread_sym_nb = numba.njit(inline="always")(_spread_sym)


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
    fac = np.empty(_width_nb(plan), np.float32)
    fac_pairs = fac.view(np.uint64)
    g_base = _U0
    for r in range(plan.shape[0]):
        base, n_p, sp, n_a, sa, n_b, sb, n_c, sc, n_e, run, inner, jn, ng = _plane(plan, r)
        contiguous = n_b == _U1 and inner == _U1
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
                    _spread_sym_nb(scales, g0, jn, run, inner, fac, fac_pairs)
                    for b in range(n_b):
                        o = o0 + b * sb
                        for e in range(n_e):
                            dst[o + e] = from_f32(tag, np.float32(q[o + e]) * fac[e])
        g_base += n_p * n_a * n_c * ng
    return bad


def _quantize_asym(src: Array, tag: Any, plan: Array, top: Any, scales: Array, zeros: Array,
                   q: Array) -> int:
    """`q` holds one byte per element (top 255) or one per two elements (top 15).

    Group minima and maxima are taken over order keys (`bits.order_key`), whose integer
    min/max vectorize, and the same keys tell whether a group holds an inf or NaN."""
    width = _width_nb(plan)
    lo_acc = magnitude_buffer(tag, width)
    hi_acc = magnitude_buffer(tag, width)
    lo_words = lo_acc.view(np.uint32)
    hi_words = hi_acc.view(np.uint32)
    fac = np.empty(width, np.float32)
    off = np.empty(width, np.float32)
    fac_pairs = fac.view(np.uint64)
    off_pairs = off.view(np.uint64)
    level = np.empty(width, np.uint8)
    runs = np.empty(scales.size, np.float32)  # 1/scale per group of the contiguous-runs path
    g_lo = magnitude_buffer(tag, width)  # per group of one tile: keys, scales, 1/scales, zeros
    g_hi = magnitude_buffer(tag, width)
    g_scale = np.empty(width, np.float32)
    g_inv = np.empty(width, np.float32)
    g_zero = np.empty(width, np.float32)
    packed = top < np.float32(16.0)
    neg_inf, pos_inf = non_finite_keys(tag)
    bad = 0
    g_base = _U0
    for r in range(plan.shape[0]):
        base, n_p, sp, n_a, sa, n_b, sb, n_c, sc, n_e, run, inner, jn, ng = _plane(plan, r)
        contiguous = n_b == _U1 and inner == _U1
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
                    if inner == _U1:
                        # Many groups per tile (per-channel K: one per position): their keys
                        # first, then one branch-free pass over all of them (it vectorizes;
                        # group by group, the scalar scale arithmetic cost as much as the
                        # data), then the rare groups that need care, one by one.
                        if run == _U1:  # a group per position: its keys are the buffers'
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
                                & (span >= np.float32(TINY_ABSMAX)) & (span <= _FLT_MAX)
                            g_scale[g] = span / top if fine else np.float32(0.0)
                            g_inv[g] = top / span if fine else np.float32(0.0)
                            g_zero[g] = lo
                            odd += 0 if fine and lo + top * g_scale[g] <= _FLT_MAX else 1
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
                        if run == _U1:
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
                            l0 = _LOW16
                            l1 = _LOW16
                            h0 = np.uint32(0)
                            h1 = np.uint32(0)
                            for k in range(run):
                                lw = lo_words[w0 + k]
                                hw = hi_words[w0 + k]
                                l0 = min(l0, lw & _LOW16)
                                l1 = min(l1, lw >> _SHIFT16)
                                h0 = max(h0, hw & _LOW16)
                                h1 = max(h1, hw >> _SHIFT16)
                            g = g0 + _U2 * jj
                            s0, inv0, z0, f0 = _asym_group(to_magnitude(tag, l0),
                                                           to_magnitude(tag, h0), tag, top)
                            s1, inv1, z1, f1 = _asym_group(to_magnitude(tag, l1),
                                                           to_magnitude(tag, h1), tag, top)
                            scales[g] = s0
                            scales[g + _U1] = s1
                            zeros[g] = z0
                            zeros[g + _U1] = z1
                            bad += f0 + f1
                            both_inv = _pair(inv0, inv1)
                            both_zero = _pair(z0, z1)
                            for k in range(run):
                                fac_pairs[w0 + k] = both_inv
                                off_pairs[w0 + k] = both_zero
                    for b in range(n_b):
                        o = o0 + b * sb
                        if packed:
                            for e in range(n_e):
                                level[e] = np.uint8(round_i8((to_f32(tag, src[o + e]) - off[e])
                                                             * fac[e]))
                            half_o = o >> _U1
                            for e in range(n_e >> _U1):
                                q[half_o + e] = level[_U2 * e] | (level[_U2 * e + _U1]
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
                                half_o = start >> _U1
                                for e in range(run >> _U1):
                                    q[half_o + e] = level[_U2 * e] | (level[_U2 * e + _U1]
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
        if not (valid_scale(scales[i]) and abs(zeros[i]) <= _FLT_MAX
                and abs(zeros[i] + top * scales[i]) <= _FLT_MAX):
            bad += 1
    if bad:
        return bad
    width = _width_nb(plan)
    fac = np.empty(width, np.float32)
    off = np.empty(width, np.float32)
    fac_pairs = fac.view(np.uint64)
    off_pairs = off.view(np.uint64)
    packed = top < np.float32(16.0)
    g_base = _U0
    for r in range(plan.shape[0]):
        base, n_p, sp, n_a, sa, n_b, sb, n_c, sc, n_e, run, inner, jn, ng = _plane(plan, r)
        contiguous = n_b == _U1 and inner == _U1
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
                                half_o = start >> _U1
                                for e in range(run >> _U1):
                                    byte = q[half_o + e]
                                    j = _U2 * e
                                    dst[start + j] = from_f32(
                                        tag, np.float32(byte & np.uint8(15)) * scale + zero)
                                    dst[start + j + _U1] = from_f32(
                                        tag, np.float32(byte >> np.uint8(4)) * scale + zero)
                            else:
                                for e in range(run):
                                    dst[start + e] = from_f32(
                                        tag, np.float32(q[start + e]) * scale + zero)
                        continue
                    _spread_sym_nb(scales, g0, jn, run, inner, fac, fac_pairs)
                    _spread_sym_nb(zeros, g0, jn, run, inner, off, off_pairs)
                    for b in range(n_b):
                        o = o0 + b * sb
                        if packed:
                            half_o = o >> _U1
                            for e in range(n_e >> _U1):
                                byte = q[half_o + e]
                                j = _U2 * e
                                dst[o + j] = from_f32(
                                    tag, np.float32(byte & np.uint8(15)) * fac[j] + off[j])
                                dst[o + j + _U1] = from_f32(
                                    tag, np.float32(byte >> np.uint8(4)) * fac[j + _U1]
                                    + off[j + _U1])
                        else:
                            for e in range(n_e):
                                dst[o + e] = from_f32(tag, np.float32(q[o + e]) * fac[e]
                                                      + off[e])
        g_base += n_p * n_a * n_c * ng
    return bad


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


_PY: dict[str, Callable[..., int]] = {"qs": _quantize_sym, "ds": _dequantize_sym,
                                      "qa": _quantize_asym, "da": _dequantize_asym}
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
