"""Grouped codecs: a scale (and zero point) per group of elements that the block's arrangement
places: per token, per channel over the block's tokens (KIVI's keys), or per run of channels.

Schemes (name, frame codec id, K scales, V scales):

| name        | id | bits | zero point | K                         | V                   |
|-------------|----|------|------------|---------------------------|---------------------|
| `int8-asym` | 2  | 8    | yes        | per token                 | per token           |
| `int8-kivi` | 3  | 8    | yes        | per channel (block's N)   | per token           |
| `int8-g32`  | 4  | 8    | no         | per 32 channels of a token| per 32 channels     |
| `int4`      | 5  | 4    | yes        | per channel (block's N)   | per 32 channels     |

"per token" is one scale per (token, KV head) over the head's channels. Symmetric: scale =
absmax / 127, q in [-127, 127]. With a zero point (asymmetric): zero = min, scale = (max - min) /
top, q in [0, top] (top = 255, or 15 for int4, two values per byte). See `grouped_kernels` for
the arithmetic and its error bound (half a step plus float32 rounding).

Segment layout (little endian)::

    arrangement u8 | 0 u8 | 0 u16                                  <- 4 bytes
    scales: G float32 (K's groups, then V's, in plan order)
    zeros:  G float32 (zero-point schemes only)
    values: one int8 (symmetric) / uint8 per element, or one byte per two elements (int4),
            in the tensor's own element order

The arrangement is recorded so that a segment decodes from its frame alone, and is checked
against the frame's shape (CANONICAL blocks are [2, N, H, D], AMX blocks [H, 2N, D]): a codec
never reads a block along axes it was not written with. The scale count G is the same for both
arrangements, so the segment size follows from shape and dtype as the frame needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstore.codecs import grouped_kernels
from kvstore.codecs.arrangement import Arrangement, Grouping, Plane, block_geometry, plan_planes
from kvstore.codecs.base import BaseCodec, Buffer, LayerSpec
from kvstore.codecs.tensors import Array, torch_dtype
from kvstore.errors import CodecError, CorruptBlock
from kvstore.frame import CodecId, DType

if TYPE_CHECKING:
    import torch

__all__ = ["Scheme", "GroupedCodec", "HEADER_BYTES"]

HEADER_BYTES = 4
_PER_TOKEN = Grouping("channels")
_PER_CHANNEL = Grouping("tokens")


@dataclass(frozen=True, slots=True)
class Scheme:
    """How a grouped codec quantizes: levels and where its K and V scales go."""

    bits: int
    zero_point: bool
    k: Grouping
    v: Grouping

    def __post_init__(self) -> None:
        if (self.bits, self.zero_point) not in ((8, False), (8, True), (4, True)):
            raise CodecError(f"no kernel for {self.bits}-bit "
                             f"{'asymmetric' if self.zero_point else 'symmetric'} values")

    @property
    def top(self) -> int | None:
        """The highest level of a zero-point scheme (None: symmetric int8)."""
        return (1 << self.bits) - 1 if self.zero_point else None

    def describe(self) -> str:
        kind = "asymmetric" if self.zero_point else "symmetric"
        return f"{self.bits}-bit {kind}, K {self.k.describe()}, V {self.v.describe()}"


@dataclass(frozen=True, slots=True)
class _Plan:
    planes: tuple[Plane, Plane]
    rows: Array  # the kernels' int64 [2, 11] form
    groups: int
    elements: int


class GroupedCodec(BaseCodec):
    """One scheme of the table above (an instance per frame codec id)."""

    def __init__(self, codec_id: CodecId, name: str, scheme: Scheme) -> None:
        self.codec_id = codec_id
        self.name = name
        self.scheme = scheme
        # Per-call Python is most of the cost of a small layer: sizes and plans are pure
        # functions of their keys, computed once per process (a lost race computes one twice).
        self._sizes: dict[tuple[tuple[int, ...], DType], int] = {}
        self._plans: dict[tuple[Arrangement, tuple[int, ...], DType], _Plan] = {}

    def __repr__(self) -> str:
        return f"GroupedCodec({self.name!r}: {self.scheme.describe()})"

    # -- sizes and plans ------------------------------------------------------------------------

    def encoded_size(self, shape: tuple[int, ...], dtype: DType) -> int:
        size = self._sizes.get((shape, dtype))
        if size is None:
            groups, elements = self._counts(shape)
            per_group = 8 if self.scheme.zero_point else 4
            values = elements if self.scheme.bits == 8 else elements // 2
            size = self._sizes[(shape, dtype)] = HEADER_BYTES + groups * per_group + values
        return size

    def _counts(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """(scales, elements) of a block: the same in both arrangements, which the rank of the
        shape tells apart (4-D canonical, 3-D AMX)."""
        tokens, heads, channels = block_geometry(_arrangement_of(shape), shape)
        groups = sum(_group_count(g, tokens, heads, channels)
                     for g in (self.scheme.k, self.scheme.v))
        return groups, math.prod(shape)

    def _plan(self, shape: tuple[int, ...], dtype: DType, arrangement: Arrangement) -> _Plan:
        plan = self._plans.get((arrangement, shape, dtype))
        if plan is None:
            plan = self._plans[(arrangement, shape, dtype)] = self._new_plan(shape, dtype,
                                                                             arrangement)
        return plan

    def _new_plan(self, shape: tuple[int, ...], dtype: DType, arrangement: Arrangement
                  ) -> _Plan:
        if arrangement is Arrangement.ROWS:
            raise CodecError(f"codec {self.name} ({self.scheme.describe()}) needs to know where "
                             f"K, V, tokens and channels are in a block; this layout does not "
                             f"say (arrangement ROWS): use 'raw' or 'int8-sym'")
        if _arrangement_of(shape) is not arrangement:
            raise CodecError(f"a {arrangement.name} block cannot have shape {shape}")
        return build_plan(self.scheme, arrangement, shape, dtype)

    def _segment_plan(self, data: Array, shape: tuple[int, ...], dtype: DType) -> _Plan:
        """The plan a segment was written with, from its header; CorruptBlock if the header is
        not one this codec writes for this shape."""
        try:
            arrangement = Arrangement(int(data[0]))
        except ValueError:
            raise CorruptBlock(f"{self.name} segment names an unknown arrangement "
                               f"{int(data[0])}") from None
        if int(data[1]) or int(data[2]) or int(data[3]):
            raise CorruptBlock(f"{self.name} segment header has reserved bits set")
        try:
            return self._plan(shape, dtype, arrangement)
        except CodecError as exc:
            raise CorruptBlock(f"{self.name} segment does not fit its frame: {exc}") from None

    # -- host ------------------------------------------------------------------------------------

    def _encode_host(self, rows: Array, spec: LayerSpec, dest: Array) -> None:
        plan = spec.plan
        assert isinstance(plan, _Plan)
        dest[:HEADER_BYTES] = (int(spec.arrangement), 0, 0, 0)
        params = dest[HEADER_BYTES: HEADER_BYTES + self._param_bytes(plan)]
        # A caller's `out` at an odd address: the kernels take aligned float32 only, so the
        # scales (a few hundred bytes) are written aside and copied in.
        aside = not params.view(np.float32).flags.aligned  # (a flag: cheaper than .ctypes)
        target = np.empty(params.size, np.uint8) if aside else params
        scales, zeros = self._params(target, plan)
        values = dest[HEADER_BYTES + params.size:]
        flat = rows.reshape(-1)
        top = self.scheme.top
        if top is None:
            bad = grouped_kernels.quantize_sym(flat, spec.dtype, plan.rows, scales,
                                               values.view(np.int8))
        else:
            assert zeros is not None
            bad = grouped_kernels.quantize_asym(flat, spec.dtype, plan.rows, top, scales,
                                                zeros, values)
        if bad:
            raise CodecError(f"{self.name} cannot encode inf, NaN or a range beyond float32")
        if aside:
            params[:] = target

    def _decode_host(self, data: Buffer | Array, rows: Array, shape: tuple[int, ...],
                     dtype: DType) -> None:
        segment = np.frombuffer(data, np.uint8)
        plan = self._segment_plan(segment, shape, dtype)
        scales, zeros, values = self._read_sections(segment, plan)
        flat = rows.reshape(-1)
        top = self.scheme.top
        if top is None:
            bad = grouped_kernels.dequantize_sym(values.view(np.int8), scales, dtype,
                                                 plan.rows, flat)
        else:
            assert zeros is not None
            bad = grouped_kernels.dequantize_asym(values, scales, zeros, dtype, plan.rows, top,
                                                  flat)
        if bad:
            raise CorruptBlock(_BAD_SCALE)

    def _param_bytes(self, plan: _Plan) -> int:
        return plan.groups * (8 if self.scheme.zero_point else 4)

    def _params(self, params: Array, plan: _Plan) -> tuple[Array, Array | None]:
        """float32 scales and zeros (or None) over an aligned params byte range."""
        scales = params[: 4 * plan.groups].view(np.float32)
        zeros = params[4 * plan.groups:].view(np.float32) if self.scheme.zero_point else None
        return scales, zeros

    def _read_sections(self, segment: Array, plan: _Plan) -> tuple[Array, Array | None, Array]:
        """Scales, zeros (or None) and values of a segment. A segment sits at any offset of its
        frame and the kernels take aligned float32: unaligned scales are read from a copy."""
        end = HEADER_BYTES + self._param_bytes(plan)
        params = segment[HEADER_BYTES:end]
        if not params.view(np.float32).flags.aligned:
            params = params.copy()
        scales, zeros = self._params(params, plan)
        return scales, zeros, segment[end:]

    def _valid_segment(self, data: Array, shape: tuple[int, ...], dtype: DType) -> bool:
        """Header and scales as our writers store them (decode_rows checks this on the host
        before a segment goes up to a device)."""
        try:
            plan = self._segment_plan(data, shape, dtype)
        except CorruptBlock:
            return False
        scales, zeros, _ = self._read_sections(data, plan)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            return False
        if zeros is None:
            return True
        top = np.float32(self.scheme.top or 0)
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.isfinite(zeros).all() and np.isfinite(zeros + top * scales).all())

    # -- device ----------------------------------------------------------------------------------

    def _encode_device(self, x: torch.Tensor, spec: LayerSpec, dest: Array) -> None:
        self._encode_device_many([x], spec, dest.reshape(1, -1))

    def _encode_batch(self, blocks: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
        import torch

        from kvstore.codecs import torch_ops

        plan = spec.plan
        assert isinstance(plan, _Plan)
        payload = torch_ops.grouped_quantize(blocks, plan.planes, self.scheme.top)
        header = torch.tensor([int(spec.arrangement), 0, 0, 0], dtype=torch.uint8,
                              device=payload.device)
        return torch.cat([header.expand(payload.shape[0], HEADER_BYTES), payload], dim=1)

    def _decode_device(self, data: Array, out: torch.Tensor) -> None:
        import torch

        shape, dtype = tuple(out.shape), _dtype_of(out)
        if not self._valid_segment(data, shape, dtype):
            raise CorruptBlock(_BAD_SCALE)
        staged = torch.from_numpy(data.copy()).to(out.device).view(1, -1)
        out.copy_(self._decode_device_many(staged, shape, dtype)[0])

    def _decode_device_many(self, staged: torch.Tensor, shape: tuple[int, ...],
                            dtype: DType) -> torch.Tensor:
        from kvstore.codecs import torch_ops

        # Every row passed `_valid_segment` for this shape, so all share the arrangement the
        # shape implies, and with it one plan.
        plan = self._plan(shape, dtype, _arrangement_of(shape))
        decoded = torch_ops.grouped_dequantize(staged[:, HEADER_BYTES:], plan.planes,
                                               self.scheme.top, plan.elements,
                                               torch_dtype(dtype))
        return decoded.view(staged.shape[0], *shape)


def _arrangement_of(shape: tuple[int, ...]) -> Arrangement:
    """The only arrangement a grouped segment of this shape can have been written in."""
    if len(shape) == 4:
        return Arrangement.CANONICAL
    if len(shape) == 3:
        return Arrangement.AMX
    raise CodecError(f"grouped codecs encode [2, N, H, D] or [H, 2N, D] blocks, not {shape}")


def _group_count(grouping: Grouping, tokens: int, heads: int, channels: int) -> int:
    if grouping.over == "tokens":
        return heads * channels
    return tokens * heads * (channels // (grouping.size or channels))


def build_plan(scheme: Scheme, arrangement: Arrangement, shape: tuple[int, ...],
               dtype: DType) -> _Plan:
    """The checked loop plan of `scheme` for blocks of this shape, dtype and arrangement."""
    planes = plan_planes(arrangement, shape, dtype, scheme.k, scheme.v)
    if scheme.bits == 4 and any(_odd(p) for p in planes):
        raise CodecError(f"int4 packs element pairs: shape {shape} splits one")
    rows = np.array([p.row() for p in planes], np.int64)
    rows.flags.writeable = False
    return _Plan(planes, rows, sum(p.groups for p in planes), math.prod(shape))


def _odd(plane: Plane) -> bool:
    """Whether any run of the plane starts at an odd element (int4 packs pairs in order)."""
    return bool((plane.base | plane.sp | plane.sa | plane.sb | plane.sc | plane.E) & 1)


def _dtype_of(t: torch.Tensor) -> DType:
    return DType.from_name(str(t.dtype))


def schemes() -> dict[str, tuple[CodecId, Scheme]]:
    """The grouped codecs kvkeep ships: name -> (frame codec id, scheme)."""
    return {
        "int8-asym": (CodecId.INT8_ASYM, Scheme(8, True, _PER_TOKEN, _PER_TOKEN)),
        "int8-kivi": (CodecId.INT8_KIVI, Scheme(8, True, _PER_CHANNEL, _PER_TOKEN)),
        "int8-g32": (CodecId.INT8_G32, Scheme(8, False, Grouping("channels", 32),
                                              Grouping("channels", 32))),
        "int4": (CodecId.INT4, Scheme(4, True, _PER_CHANNEL, Grouping("channels", 32))),
    }


# A writer of ours never stores a negative or non-finite scale, nor a zero point whose top level
# overflows; such a segment passed its checksum, so it was written wrong (or forged).
_BAD_SCALE = "grouped segment holds an invalid scale or zero point"
