"""`raw`: the tensor's bytes as they are (C order, little endian). Lossless, bit-exact."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kvstore.codecs.base import BaseCodec, Buffer, LayerSpec
from kvstore.codecs.tensors import Array, torch_dtype
from kvstore.frame import CodecId, DType

if TYPE_CHECKING:
    import torch

__all__ = ["RawCodec"]


class RawCodec(BaseCodec):
    codec_id = CodecId.RAW
    name = "raw"

    def encoded_size(self, shape: tuple[int, ...], dtype: DType) -> int:
        return math.prod(shape) * dtype.itemsize

    def _view_host(self, rows: Array) -> memoryview | None:
        # Zero copy: the frame builder copies the bytes into the frame anyway.
        return rows.reshape(-1).view(np.uint8).data

    def _encode_host(self, rows: Array, spec: LayerSpec, dest: Array) -> None:
        np.copyto(dest, rows.reshape(-1).view(np.uint8))

    def _encode_device(self, x: torch.Tensor, spec: LayerSpec, dest: Array) -> None:
        import torch

        torch.from_numpy(dest).copy_(x.detach().contiguous().reshape(-1).view(torch.uint8))

    def _decode_device_many(self, staged: torch.Tensor, shape: tuple[int, ...],
                            dtype: DType) -> torch.Tensor:
        return staged.view(torch_dtype(dtype)).view(staged.shape[0], *shape)

    def _encode_batch(self, blocks: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
        import torch

        return blocks.contiguous().reshape(blocks.shape[0], -1).view(torch.uint8)

    def _decode_host(self, data: Buffer | Array, rows: Array, shape: tuple[int, ...],
                     dtype: DType) -> None:
        np.copyto(rows.reshape(-1).view(np.uint8), np.frombuffer(data, np.uint8))

    def _decode_device(self, data: Array, out: torch.Tensor) -> None:
        import torch

        # torch refuses to wrap read-only memory, so stage one host copy (pinned staging would
        # let this overlap; the hbm tier owns such buffers).
        staged = torch.from_numpy(data.copy()).to(out.device)
        out.view(-1).view(torch.uint8).copy_(staged)
