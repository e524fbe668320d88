"""Loop-plan helpers shared by the grouped kernels (`symmetric_kernels`, `zero_point_kernels`):
reading a plan row, buffer sizes, and spreading per-group factors over a tile's positions.

Folds. A tile's running per-position buffers become one value per group (j, i), and the
groups' factors are spread back over positions. inner 1: groups are runs of `run` adjacent
positions (contiguous loops). inner 2 (the AMX packing's pairs, 16-bit dtypes only): the
positions of a pair are the two halves of one 32-bit word, and their two factors one 64-bit
store; read that way, both loops run over contiguous words and vectorize, where a stride-2
loop stayed scalar.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from kvstore.codecs.bits import f2u

__all__ = ["plane", "width", "pair", "spread", "U0", "U1", "U2", "LOW16", "SHIFT16",
           "FLT_MAX"]

Array = npt.NDArray[Any]

FLT_MAX = np.float32(3.4028234663852886e38)
U0, U1, U2 = np.uint64(0), np.uint64(1), np.uint64(2)
LOW16, SHIFT16, _SHIFT32 = np.uint32(0xFFFF), np.uint32(16), np.uint64(32)


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


def _spread_py(scales: Array, g0: Any, jn: Any, run: Any, inner: Any, fac: Array,
               fac_pairs: Array) -> None:
    """Per-position factors of one tile from its groups' scales (see Folds above)."""
    if inner == U1:
        for g in range(jn):
            scale = scales[g0 + g]
            for k in range(run):
                fac[g * run + k] = scale
    else:
        for jj in range(jn):
            both = pair(scales[g0 + U2 * jj], scales[g0 + U2 * jj + U1])
            for k in range(run):
                fac_pairs[jj * run + k] = both



plane = numba.njit(inline="always")(_plane_py)
width = numba.njit(inline="always")(_width)
pair = numba.njit(inline="always")(_pair_py)
spread = numba.njit(inline="always")(_spread_py)
