"""Where K, V, tokens and channels sit inside one stored layer block, and the loop plans that
put a quantization scale over the right elements.

Every lossy scheme other than the legacy `int8-sym` needs to know the block's axes: KIVI-style
K scales span one channel over the block's tokens, V scales one token over its channels, and
group-wise scales span a run of one token's channels. The connector's layout says how a backend
arranges a block (`connectors/vllm/layouts.py`); this module knows three arrangements:

- `CANONICAL`: `[2, N, H, D]`, K then V, each `[token, kv head, channel]` (CPU `vec`/`vec16`
  kernels after the layout's gather, and the CUDA layouts).
- `AMX`: vLLM's AMX CPU kernel's block, stored verbatim as `[H, 2N, D]` (2-byte dtypes only:
  the kernel packs pairs of 16-bit values into 32-bit words). Per KV head the first `N*D`
  elements are K as `[N/16, D/2, 16, 2]` (token group, channel pair, token, channel in pair:
  token = 16*g + o, channel = 2*j + c) and the last `N*D` are V as `[D/16, N/2, 16, 2]`
  (channel group, token pair, channel, token in pair: channel = 16*gi + j, token = 2*p + s).
  Read off vLLM's `reshape_and_cache` for ISA::AMX and checked against the real op in
  tests/test_codec_arrangements.py.
- `ROWS`: nothing is known but that the last axis is contiguous: only a codec that needs no
  more than rows (`raw`, `int8-sym`) may be used; the rest refuse it.

A scheme's scales are laid out per *plane* (K, then V) and described by a `Plane`: elements
`base + p*sp + a*sa + b*sb + c*sc + e` for p < P, a < A, b < B, c < C, e < E (e contiguous).
One scale covers, for fixed (p, a, c), all b and the positions e of one *fold group*: e is read
as (j, o, i) with o < `run` and i < `inner` (e = (j*run + o)*inner + i), and a group is one
(j, i) over all o. `inner` 1 makes groups runs of `run` adjacent elements; `inner` 2 is the AMX
packing's pairs. So scales are indexed ((p*A + a)*C + c)*G + j*inner + i, G = E / run groups
per tile. The same grouping on CANONICAL and AMX blocks gives the same scales over the same
elements in another order: decoding either gives the same values (tested).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvstore.errors import CodecError
from kvstore.frame import DType

_Array = npt.NDArray[np.generic]

__all__ = ["Arrangement", "Grouping", "Plane", "plan_planes", "check_arrangement",
           "block_geometry", "rows_plane", "to_canonical", "from_canonical",
           "AMX_TOKEN_GROUP", "AMX_CHANNEL_GROUP"]

AMX_TOKEN_GROUP = 16  # K: tokens per packed group (64-byte tile rows / 4 bytes)
AMX_CHANNEL_GROUP = 16  # V: channels per packed group (the B tile's N)


class Arrangement(enum.IntEnum):
    """How a stored layer block holds K and V (the value is what segments record)."""

    ROWS = 0
    CANONICAL = 1
    AMX = 2


@dataclass(frozen=True, slots=True)
class Grouping:
    """What one scale of a plane spans.

    `over="channels"`: one token's channels of one head, in runs of `size` (None: all of the
    head's channels, i.e. per token). `over="tokens"`: one channel of one head over all of the
    block's tokens (KIVI's per-channel keys; `size` must be None).
    """

    over: Literal["channels", "tokens"]
    size: int | None = None

    def __post_init__(self) -> None:
        if self.over not in ("channels", "tokens"):
            raise CodecError(f"a grouping spans channels or tokens, not {self.over!r}")
        if self.over == "tokens" and self.size is not None:
            raise CodecError("per-channel scales span all of a block's tokens")
        if self.size is not None and self.size <= 0:
            raise CodecError(f"group size must be positive, got {self.size}")

    def describe(self) -> str:
        if self.over == "tokens":
            return "per channel"
        return "per token" if self.size is None else f"per {self.size} channels"


@dataclass(frozen=True, slots=True)
class Plane:
    """One loop nest over a plane (K or V) of a layer block; see the module docstring."""

    base: int
    P: int
    sp: int
    A: int
    sa: int
    B: int
    sb: int
    C: int
    sc: int
    E: int
    run: int
    inner: int = 1

    def __post_init__(self) -> None:
        if min(self.P, self.A, self.B, self.C, self.E, self.run, self.inner) <= 0 \
                or self.E % (self.run * self.inner):
            raise CodecError(f"inconsistent plane {self}")

    @property
    def fold_groups(self) -> int:
        return self.E // self.run

    @property
    def groups(self) -> int:
        return self.P * self.A * self.C * self.fold_groups

    def row(self) -> tuple[int, ...]:
        """The kernels' form: one int64 row."""
        return (self.base, self.P, self.sp, self.A, self.sa, self.B, self.sb, self.C, self.sc,
                self.E, self.run, self.inner)


def block_geometry(arrangement: Arrangement, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(N tokens, H heads, D channels) of a block of `shape` in `arrangement`."""
    if arrangement is Arrangement.CANONICAL:
        if len(shape) != 4 or shape[0] != 2:
            raise CodecError(f"a canonical block is [2, tokens, heads, head_size], got {shape}")
        return shape[1], shape[2], shape[3]
    if arrangement is Arrangement.AMX:
        if len(shape) != 3 or shape[1] % 2:
            raise CodecError(f"an AMX block is [heads, 2*tokens, head_size], got {shape}")
        return shape[1] // 2, shape[0], shape[2]
    raise CodecError("a ROWS block has no known K/V, token or channel axes")


def check_arrangement(arrangement: Arrangement, shape: tuple[int, ...], dtype: DType) -> None:
    """CodecError unless a block of `shape` and `dtype` can be read in `arrangement`."""
    if arrangement is Arrangement.ROWS:
        return
    tokens, _, channels = block_geometry(arrangement, shape)
    if arrangement is Arrangement.AMX:
        if dtype.itemsize != 2:
            raise CodecError(f"the AMX arrangement packs 16-bit values; {dtype.name} blocks "
                             f"are not laid out that way")
        if tokens % AMX_TOKEN_GROUP or channels % AMX_CHANNEL_GROUP:
            raise CodecError(f"the AMX arrangement needs tokens and head size divisible by "
                             f"{AMX_TOKEN_GROUP}, got {tokens} and {channels}")


def plan_planes(arrangement: Arrangement, shape: tuple[int, ...], dtype: DType,
                k: Grouping, v: Grouping) -> tuple[Plane, Plane]:
    """The K and V loop plans of a block, or CodecError if the grouping does not fit it."""
    check_arrangement(arrangement, shape, dtype)
    tokens, heads, channels = block_geometry(arrangement, shape)
    for grouping in (k, v):
        if grouping.size is not None and channels % grouping.size:
            raise CodecError(f"groups of {grouping.size} channels do not divide head size "
                             f"{channels}")
    if arrangement is Arrangement.CANONICAL:
        plane = tokens * heads * channels
        return (_canonical(0, tokens, heads, channels, k),
                _canonical(plane, tokens, heads, channels, v))
    return (_amx_k(tokens, heads, channels, k), _amx_v(tokens, heads, channels, v))


def _canonical(base: int, n: int, h: int, d: int, grouping: Grouping) -> Plane:
    if grouping.over == "tokens":  # one scale per (head, channel), over the block's n tokens
        return Plane(base, 1, 0, 1, 0, n, h * d, 1, 0, h * d, 1)
    size = grouping.size or d  # one scale per (token, head, run of `size` channels)
    return Plane(base, 1, 0, n * h, d, 1, 0, 1, 0, d, size)


def _amx_k(n: int, h: int, d: int, grouping: Grouping) -> Plane:
    # Per head: [g = n/16 (stride 16d), j = d/2 (stride 32), o = 16 (2), c = 2 (1)].
    t, pair = AMX_TOKEN_GROUP, 2 * AMX_TOKEN_GROUP  # one (g, j): 16 tokens x 2 channels
    if grouping.over == "tokens":
        # A tile is one g: its 16d elements read as (j, o, c); reduce g (b) and o, keep j, c.
        return Plane(0, h, 2 * n * d, 1, 0, n // t, t * d, 1, 0, t * d, t, 2)
    size = grouping.size or d
    if size % 2:
        raise CodecError(f"the AMX layout packs K channels in pairs: groups of {size} split one")
    # Keep g, o and j // (size/2); reduce j % (size/2) (b) and c (runs of 2 keep o).
    return Plane(0, h, 2 * n * d, n // t, t * d, size // 2, pair, d // size,
                 (size // 2) * pair, pair, 2)


def _amx_v(n: int, h: int, d: int, grouping: Grouping) -> Plane:
    # Per head, after its K: [gi = d/16 (stride 16n), p = n/2 (32), j = 16 (2), s = 2 (1)].
    ch, pair = AMX_CHANNEL_GROUP, 2 * AMX_CHANNEL_GROUP  # one (gi, p): 16 channels x 2 tokens
    base = n * d
    if grouping.over == "tokens":  # reduce p and s (runs of 2 keep j); keep gi, j
        return Plane(base, h, 2 * n * d, 1, 0, n // 2, pair, d // ch, ch * n, pair, 2)
    size = grouping.size or d
    if size % ch:
        raise CodecError(f"the AMX layout packs V channels in runs of {ch}: groups of {size} "
                         f"split one")
    # A tile is one gi's 16n elements read as (p, j, s); keep gi // (size/16), p, s; reduce
    # gi % (size/16) (b) and j.
    return Plane(base, h, 2 * n * d, d // size, size * n, size // ch, ch * n, 1, 0, ch * n,
                 ch, 2)


def rows_plane(shape: tuple[int, ...]) -> Plane:
    """One scale per row of the last axis: what `int8-sym` does on any arrangement."""
    width = shape[-1]
    return Plane(0, 1, 0, math.prod(shape[:-1]), width, 1, 0, 1, 0, width, width)


def to_canonical(block: _Array, arrangement: Arrangement) -> _Array:
    """A numpy block in `arrangement` as a canonical [2, N, H, D] array (a copy for AMX).

    For tools and tests that need K and V by token and channel (the codecs themselves never
    move data: their plans index the block where it is)."""
    if arrangement is Arrangement.CANONICAL:
        block_geometry(arrangement, tuple(block.shape))
        return block
    n, h, d = block_geometry(arrangement, tuple(block.shape))
    t, ch = AMX_TOKEN_GROUP, AMX_CHANNEL_GROUP
    planes = block.reshape(h, 2, n * d)
    # K: [h, g, j, o, c] -> [g, o, h, j, c]; V: [h, gi, p, j, s] -> [p, s, h, gi, j].
    k = planes[:, 0].reshape(h, n // t, d // 2, t, 2).transpose(1, 3, 0, 2, 4)
    v = planes[:, 1].reshape(h, d // ch, n // 2, ch, 2).transpose(2, 4, 0, 1, 3)
    return np.stack((k.reshape(n, h, d), v.reshape(n, h, d)))


def from_canonical(block: _Array, arrangement: Arrangement) -> _Array:
    """The inverse of `to_canonical`: a canonical [2, N, H, D] array in `arrangement`."""
    if arrangement is Arrangement.CANONICAL:
        return block
    if arrangement is not Arrangement.AMX or block.ndim != 4 or block.shape[0] != 2:
        raise CodecError(f"cannot arrange a {tuple(block.shape)} block as {arrangement.name}")
    _, n, h, d = block.shape
    t, ch = AMX_TOKEN_GROUP, AMX_CHANNEL_GROUP
    k = block[0].reshape(n // t, t, h, d // 2, 2).transpose(2, 0, 3, 1, 4)
    v = block[1].reshape(n // 2, 2, h, d // ch, ch).transpose(2, 3, 0, 4, 1)
    return np.stack((k.reshape(h, n * d), v.reshape(h, n * d)), axis=1).reshape(h, 2 * n, d)
