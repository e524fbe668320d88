"""`int8-sym`: symmetric per-row quantization, one float32 scale per leading index.

The first lossy codec kvkeep had (frame codec id 1, called `int8` before the grouped codecs
came), kept as it was: its frames stay readable and it still encodes any arrangement, since it
needs no more than rows. On a canonical block [2, N, H, D] a row is one token of one KV head; on
a block stored verbatim (AMX) a row is whatever D consecutive elements the kernel packed there.

Segment layout: R little-endian float32 scales, then R x E int8 values, where R is the number
of leading indices of the [..., E] layer tensor (token x kv head, see `base`). For each row,
scale = absmax / 127 and q = round_half_even(x * 127 / absmax), so |q| <= 127 and the error
per element, before rounding to the output dtype, is at most half a step (scale / 2) plus a few
float32 ulps. A zero row (or one below `TINY_ABSMAX`, only possible for bf16/fp32) gets scale
0 and decodes to zeros. inf and NaN cannot be represented: encoding them raises CodecError.

Size: R * (4 + E) bytes against R * E * 2 for fp16 (E = 128: 0.52x).

The scales are written in host byte order, which the frame format fixes as little endian: like
the rest of kvkeep, this assumes a little-endian host (x86-64, arm64).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstore.codecs import kernels
from kvstore.codecs.arrangement import Arrangement
from kvstore.codecs.base import BaseCodec, Buffer, EncodedLayers, LayerSpec
from kvstore.codecs.tensors import (
    Array,
    TensorLike,
    common_layout,
    host_rows,
    is_device_tensor,
    rows_shape,
    torch_dtype,
)
from kvstore.errors import CodecError, CorruptBlock
from kvstore.frame import CodecId, DType

if TYPE_CHECKING:
    import torch

__all__ = ["Int8Codec"]

_SCALE_BYTES = 4


class Int8Codec(BaseCodec):
    codec_id = CodecId.INT8
    name = "int8-sym"

    def encoded_size(self, shape: tuple[int, ...], dtype: DType) -> int:
        rows, width = rows_shape(shape)
        return rows * (_SCALE_BYTES + width)

    def encode_many(self, layers: Sequence[TensorLike], *, dtype: DType | str | None = None,
                    arrangement: Arrangement = Arrangement.ROWS) -> EncodedLayers:
        # Rows are all this codec needs: any arrangement is fine, and none changes the bytes.
        shape, found = common_layout(layers, dtype)
        count, width = rows_shape(shape)
        if width % _SCALE_BYTES or any(is_device_tensor(x) for x in layers):
            return super().encode_many(layers, dtype=found, arrangement=arrangement)
        # Host fast path: scales and values views of one arena are cut once for the block, so
        # each layer costs a kernel call and ~2-3 us of Python (its kernel: ~4 us for 64 KiB),
        # where `encode` per layer costs ~5 us of Python.
        # A segment is count * (4 + width) bytes, a multiple of 4: every scales row is aligned.
        arena = np.empty((len(layers), count * (_SCALE_BYTES + width)), np.uint8)
        scales = arena[:, : _SCALE_BYTES * count].view(np.float32)
        q = arena[:, _SCALE_BYTES * count:].view(np.int8).reshape(len(layers), count, width)
        bad = 0
        for index, x in enumerate(layers):
            bad += kernels.quantize_rows(host_rows(x, shape, found), found, scales[index],
                                         q[index])
        if bad:
            raise CodecError("int8 cannot encode inf or NaN")
        return EncodedLayers([segment.data for segment in arena], shape, found)

    def _encode_host(self, rows: Array, spec: LayerSpec, dest: Array) -> None:
        count, width = rows.shape
        head = dest[: _SCALE_BYTES * count]
        scales = head.view(np.float32)
        # A caller's `out` at an odd address: the kernels take aligned float32 only, so the
        # scales (a few hundred bytes) are written aside and copied in.
        aside = not scales.flags.aligned
        if aside:
            scales = np.empty(count, np.float32)
        q = dest[_SCALE_BYTES * count:].view(np.int8).reshape(count, width)
        if kernels.quantize_rows(rows, spec.dtype, scales, q):
            raise CodecError("int8 cannot encode inf or NaN")
        if aside:
            head[:] = scales.view(np.uint8)

    def _encode_device(self, x: torch.Tensor, spec: LayerSpec, dest: Array) -> None:
        import torch

        from kvstore.codecs import torch_ops

        torch.from_numpy(dest).copy_(torch_ops.quantize(x))

    def _encode_batch(self, blocks: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
        from kvstore.codecs import torch_ops

        return torch_ops.quantize_many(blocks)

    def _decode_host(self, data: Buffer | Array, rows: Array, shape: tuple[int, ...],
                     dtype: DType) -> None:
        count, width = rows.shape
        scales = np.frombuffer(data, np.float32, count=count)
        if not scales.flags.aligned:
            # The segment sits at an arbitrary offset in the frame and the kernels take aligned
            # float32: copy the scales (a few hundred bytes).
            scales = scales.copy()
        q = np.frombuffer(data, np.int8, offset=_SCALE_BYTES * count).reshape(count, width)
        if kernels.dequantize_rows(q, scales, dtype, rows):
            raise CorruptBlock(_BAD_SCALE)

    def _decode_device(self, data: Array, out: torch.Tensor) -> None:
        import torch

        from kvstore.codecs import torch_ops

        if not self._valid_segment(data, tuple(out.shape), DType.FLOAT32):
            raise CorruptBlock(_BAD_SCALE)
        # torch refuses read-only memory, so stage one host copy of the (half-size) payload.
        staged = torch.from_numpy(data.copy()).to(out.device)
        torch_ops.dequantize(staged, out)

    def _valid_segment(self, data: Array, shape: tuple[int, ...], dtype: DType) -> bool:
        count, _ = rows_shape(shape)
        scales = data[: _SCALE_BYTES * count].view(np.float32)
        return bool(np.isfinite(scales).all() and (scales >= 0).all())

    def _decode_device_many(self, staged: torch.Tensor, shape: tuple[int, ...],
                            dtype: DType) -> torch.Tensor:
        from kvstore.codecs import torch_ops

        decoded = torch_ops.dequantize_many(staged, shape[-1], torch_dtype(dtype))
        return decoded.view(staged.shape[0], *shape)


# A writer of ours never stores a negative or non-finite scale; such a segment passed its
# checksum, so it was written wrong (or forged), and must not become KV.
_BAD_SCALE = "int8 segment holds an invalid scale"
