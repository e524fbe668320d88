"""Quantize / dequantize with torch ops, where the tensor lives (a GPU): `int8-sym`, and the
grouped codecs at the end.

Quantizing on the device before the copy to host sends ~half the bytes over PCIe (int8 plus one
float32 per row, against 2 bytes per element); dequantizing after the copy up does the same on
loads. The arithmetic mirrors the numba kernels (float32 absmax, scale = absmax / 127,
q = round-half-even(x * (127 / absmax))), so both paths agree to within one quantization level.

This module imports torch; only the codecs import it, and only for tensors that are on a device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.codecs.arrangement import Plane
from kvstore.codecs.bits import TINY_ABSMAX
from kvstore.errors import CodecError

__all__ = ["quantize", "quantize_many", "dequantize", "dequantize_many", "grouped_quantize",
           "grouped_dequantize"]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Quantize `x` [..., E] per row; returns the segment bytes as one uint8 tensor on x's device.

    Layout (as the int8 codec stores it): R float32 scales, then R x E int8 values. Packing both
    into one tensor makes the trip to host a single copy.
    """
    return quantize_many(x.detach().reshape(1, -1, x.shape[-1]))[0]


def quantize_many(layers: torch.Tensor) -> torch.Tensor:
    """Quantize L stacked layers [L, ..., E]; returns [L, segment bytes] uint8, one row each.

    One set of kernels for a whole block: on a GPU each launch costs microseconds, so a block of
    32 layers quantized layer by layer is bound by launches, not by memory bandwidth.
    """
    count = layers.shape[0]
    rows = layers.detach().reshape(count, -1, layers.shape[-1]).float()
    absmax = rows.abs().amax(dim=2)
    if not bool(torch.isfinite(absmax).all()):
        raise CodecError("int8 cannot encode inf or NaN")
    keep = absmax >= TINY_ABSMAX
    # Where a row is dropped, divide by 1 instead of 0 so nothing turns into inf/NaN.
    safe = torch.where(keep, absmax, torch.ones_like(absmax))
    scale = torch.where(keep, safe / 127.0, torch.zeros_like(absmax))
    # See kernels._row_scale: a scale within an ulp of FLT_MAX / 127 would overflow on decode.
    scale = torch.where(torch.isinf(scale * 127.0), torch.nextafter(scale, torch.zeros_like(scale)),
                        scale)
    inv = torch.where(keep, 127.0 / safe, torch.zeros_like(absmax))
    q = torch.round(rows * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([scale.contiguous().view(torch.uint8),
                      q.reshape(count, -1).view(torch.uint8)], dim=1)


def dequantize(segment: torch.Tensor, out: torch.Tensor) -> None:
    """Decode a uint8 segment (already on out's device) into `out` [..., E], in out's dtype."""
    out.copy_(dequantize_many(segment.view(1, -1), out.shape[-1], out.dtype).view(out.shape))


def dequantize_many(segments: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode K uint8 segments [K, bytes] (on the device) into [K, rows, width] of `dtype`,
    in one set of kernels for all of them."""
    count = segments.shape[0]
    rows = segments.shape[1] // (4 + width)
    scales = segments[:, : 4 * rows].contiguous().view(torch.float32)
    q = segments[:, 4 * rows:].contiguous().view(torch.int8).view(count, rows, width)
    return (q.float() * scales[..., None]).to(dtype)


# ---------------------------------------------------------------------------------------------
# Grouped codecs (`grouped`): the same plans as the numba kernels (`grouped_kernels`), as
# strided views. Each plane is viewed as [L, P, A, B, C, E]; its scales reduce B and fold E,
# exactly as the kernels do, with the same float32 operations in the same order: on the CPU both
# paths give the same bytes (tested).


def _over(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """numerator / t, one correctly rounded division: torch computes `scalar / tensor` as
    `t.reciprocal() * scalar`, which rounds twice and moved some levels by one."""
    return torch.full_like(t, numerator) / t


def _fold(t: torch.Tensor, plane: Plane, reduce: str) -> torch.Tensor:
    """[L, P, A, C, E] per-position extremes -> [L, P, A, C, G] per fold group: E read as
    (J, run, inner), reduced over run (see `arrangement`)."""
    lead = t.shape[:4]
    runs = t.reshape(*lead, plane.E // (plane.run * plane.inner), plane.run, plane.inner)
    folded = runs.amax(dim=5) if reduce == "max" else runs.amin(dim=5)
    return folded.reshape(*lead, plane.fold_groups)


def _spread(g: torch.Tensor, plane: Plane) -> torch.Tensor:
    """[L, P, A, C, G] per-group values -> [L, P, A, 1, C, E] per position (B broadcast)."""
    lead = g.shape[:4]
    jn = plane.E // (plane.run * plane.inner)
    full = g.reshape(*lead, jn, 1, plane.inner).expand(*lead, jn, plane.run, plane.inner)
    return full.reshape(*lead, plane.E).unsqueeze(3)


def _strided(flat: torch.Tensor, plane: Plane) -> torch.Tensor:
    count, n = flat.shape
    return flat.as_strided((count, plane.P, plane.A, plane.B, plane.C, plane.E),
                           (n, plane.sp, plane.sa, plane.sb, plane.sc, 1),
                           flat.storage_offset() + plane.base)


def grouped_quantize(layers: torch.Tensor, planes: Sequence[Plane], top: int | None
                     ) -> torch.Tensor:
    """Quantize L stacked layers [L, ...] by `planes`; `top` None: symmetric int8, else
    asymmetric with levels 0..top (255, or 15 packed two per byte). Returns [L, bytes] uint8:
    scales, zero points (asymmetric only), values, as `grouped` lays out a segment after its
    header."""
    count = layers.shape[0]
    flat = layers.detach().reshape(count, -1).float().contiguous()
    values = torch.empty(flat.shape, dtype=torch.int8 if top is None else torch.uint8,
                         device=flat.device)
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    for plane in planes:
        view = _strided(flat, plane)
        if top is None:
            absmax = _fold(view.abs().amax(dim=3), plane, "max")
            if not bool(torch.isfinite(absmax).all()):
                raise CodecError("int8 cannot encode inf or NaN")
            keep = absmax >= TINY_ABSMAX
            safe = torch.where(keep, absmax, torch.ones_like(absmax))
            scale = torch.where(keep, safe / 127.0, torch.zeros_like(absmax))
            scale = torch.where(torch.isinf(scale * 127.0),
                                torch.nextafter(scale, torch.zeros_like(scale)), scale)
            inv = torch.where(keep, _over(127.0, safe), torch.zeros_like(absmax))
            levels = torch.round(view * _spread(inv, plane)).clamp_(-127, 127)
        else:
            low = _fold(view.amin(dim=3), plane, "min")
            span = _fold(view.amax(dim=3), plane, "max") - low
            if not bool(torch.isfinite(low).all() and torch.isfinite(span).all()):
                raise CodecError("cannot encode inf, NaN or a range beyond float32")
            keep = span >= TINY_ABSMAX
            safe = torch.where(keep, span, torch.ones_like(span))
            scale = torch.where(keep, safe / float(top), torch.zeros_like(span))
            while True:  # see grouped_kernels._asym_scale: the top level must stay finite
                over = torch.isinf(low + float(top) * scale)
                if not bool(over.any()):
                    break
                scale = torch.where(over, torch.nextafter(scale, torch.zeros_like(scale)), scale)
            inv = torch.where(keep, _over(float(top), safe), torch.zeros_like(span))
            levels = torch.round((view - _spread(low, plane)) * _spread(inv, plane)).clamp_(0, top)
            zeros.append(low.reshape(count, -1))
        _strided(values, plane).copy_(levels)
        scales.append(scale.reshape(count, -1))
    parts = [torch.cat(scales, dim=1).contiguous().view(torch.uint8)]
    if zeros:
        parts.append(torch.cat(zeros, dim=1).contiguous().view(torch.uint8))
    packed = values.view(torch.uint8)
    if top is not None and top < 16:
        packed = packed[:, 0::2] | (packed[:, 1::2] << 4)
    parts.append(packed)
    return torch.cat(parts, dim=1)


def grouped_dequantize(payload: torch.Tensor, planes: Sequence[Plane], top: int | None,
                       elements: int, dtype: torch.dtype) -> torch.Tensor:
    """Decode K payloads [K, bytes] (on the device, after the header) into [K, elements] of
    `dtype`, one set of kernels for all of them."""
    count = payload.shape[0]
    groups = sum(plane.groups for plane in planes)
    scales = payload[:, : 4 * groups].contiguous().view(torch.float32)
    offset = 4 * groups
    zeros: torch.Tensor | None = None
    if top is not None:
        zeros = payload[:, offset: offset + 4 * groups].contiguous().view(torch.float32)
        offset += 4 * groups
    raw = payload[:, offset:]
    if top is None:
        levels = raw.contiguous().view(torch.int8).float()
    elif top < 16:
        levels = torch.stack((raw & 15, raw >> 4), dim=2).reshape(count, elements).float()
    else:
        levels = raw.float()
    out = torch.empty((count, elements), dtype=dtype, device=payload.device)
    first = 0
    for plane in planes:
        shape = (count, plane.P, plane.A, plane.C, plane.fold_groups)
        scale = _spread(scales[:, first: first + plane.groups].reshape(shape), plane)
        decoded = _strided(levels, plane) * scale
        if zeros is not None:
            decoded = decoded + _spread(zeros[:, first: first + plane.groups].reshape(shape),
                                        plane)
        _strided(out, plane).copy_(decoded)
        first += plane.groups
    return out
