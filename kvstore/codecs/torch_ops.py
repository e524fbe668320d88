"""INT8 quantize / dequantize with torch ops, where the tensor lives (a GPU).

Quantizing on the device before the copy to host sends ~half the bytes over PCIe (int8 plus one
float32 per row, against 2 bytes per element); dequantizing after the copy up does the same on
loads. The arithmetic mirrors the numba kernels (float32 absmax, scale = absmax / 127,
q = round-half-even(x * (127 / absmax))), so both paths agree to within one quantization level.

This module imports torch; only the codecs import it, and only for tensors that are on a device.
"""

from __future__ import annotations

import torch

from kvstore.codecs.kernels import TINY_ABSMAX
from kvstore.errors import CodecError

__all__ = ["quantize", "quantize_many", "dequantize", "dequantize_many"]


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
