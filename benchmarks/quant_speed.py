"""Codec speed against memcpy for `benchmarks.quant`: a real model's per-layer block, layer by
layer into preallocated buffers (as the connector calls the codecs), in both arrangements."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvstore.codecs import Arrangement, get_codec, warmup
from kvstore.codecs.arrangement import from_canonical
from kvstore.frame import DType

__all__ = ["codec_speeds", "LAYERS", "CANONICAL_SHAPE"]

LAYERS = 32
CANONICAL_SHAPE = (2, 32, 8, 128)  # K/V, tokens, KV heads, head size: Llama-3-8B's block
_MEMCPY_BYTES = 256 << 20


def _best_gbps(nbytes: int, run: Callable[[], None], repeats: int) -> float:
    """Best of `repeats` timed runs after one warm-up: other processes on a shared machine
    only ever slow a run down, so the best is the closest to what the code itself costs."""
    run()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def _memcpy_gbps(repeats: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, _MEMCPY_BYTES, dtype=np.uint8)
    dst = np.empty_like(src)
    return _best_gbps(_MEMCPY_BYTES, lambda: np.copyto(dst, src), repeats)


def _layers(arrangement: Arrangement) -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(LAYERS):
        x = rng.standard_normal(CANONICAL_SHAPE, dtype=np.float32)
        x[0, :, :, ::16] *= 10.0  # K outlier channels, as trained models have
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation: bits only
        out.append(np.ascontiguousarray(from_canonical(bits, arrangement)))
    return out


def codec_speeds(codecs: Sequence[str], *, repeats: int) -> dict[str, Any]:
    """{"memcpy_gbps": f, "codecs": {name: {per-arrangement GB/s and ratios, the lower ratio
    of the two arrangements as `quantize_vs_memcpy` / `dequantize_vs_memcpy`, bytes}}}."""
    warmup((DType.BFLOAT16,))
    memcpy = _memcpy_gbps(repeats)
    results: dict[str, Any] = {}
    for name in codecs:
        codec = get_codec(name)
        per: dict[str, dict[str, float]] = {}
        for arrangement in (Arrangement.CANONICAL, Arrangement.AMX):
            layers = _layers(arrangement)
            shape = layers[0].shape
            size = codec.encoded_size(shape, DType.BFLOAT16)
            encoded = [np.empty(size, np.uint8) for _ in layers]
            decoded = [np.empty_like(x) for x in layers]
            nbytes = sum(x.nbytes for x in layers)

            def quantize(layers: list[np.ndarray] = layers, encoded: list[np.ndarray] = encoded,
                         arrangement: Arrangement = arrangement, codec: Any = codec) -> None:
                for x, out in zip(layers, encoded, strict=True):
                    codec.encode(x, dtype=DType.BFLOAT16, out=out, arrangement=arrangement)

            def dequantize(encoded: list[np.ndarray] = encoded,
                           decoded: list[np.ndarray] = decoded,
                           shape: tuple[int, ...] = shape, codec: Any = codec) -> None:
                for data, out in zip(encoded, decoded, strict=True):
                    codec.decode(data, shape, DType.BFLOAT16, out=out)

            q = _best_gbps(nbytes, quantize, repeats)
            dq = _best_gbps(nbytes, dequantize, repeats)
            per[arrangement.name.lower()] = {
                "quantize_gbps": round(q, 2), "dequantize_gbps": round(dq, 2),
                "quantize_vs_memcpy": round(q / memcpy, 3),
                "dequantize_vs_memcpy": round(dq / memcpy, 3)}
        results[name] = {
            "quantize_vs_memcpy": min(p["quantize_vs_memcpy"] for p in per.values()),
            "dequantize_vs_memcpy": min(p["dequantize_vs_memcpy"] for p in per.values()),
            "bytes_vs_bf16": round(codec.encoded_size(CANONICAL_SHAPE, DType.BFLOAT16)
                                   / (2 * math.prod(CANONICAL_SHAPE)), 4),
            "by_arrangement": per,
        }
    return {"memcpy_gbps": round(memcpy, 2), "codecs": results,
            "shape": list(CANONICAL_SHAPE), "layers": LAYERS, "dtype": "bfloat16"}
