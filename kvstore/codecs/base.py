"""The codec contract, and the host / device dispatch every codec shares.

Contract (what the connector's layout module must hand over):

- One call encodes one *layer tensor* of shape [..., E]: a numpy array or a torch tensor on any
  device, float16, bfloat16 or float32 (a numpy bf16 tensor is a uint16 array of bit patterns
  with `dtype=DType.BFLOAT16`; see `tensors`).
- `arrangement` (see `arrangement`) says where K, V, tokens and channels are in that tensor:
  the connector's layout knows it. `raw` ignores it and `int8-sym` needs only rows of the last
  axis (one scale per leading index: per token and KV head on a canonical `[2, N, H, D]`
  block), so both take any arrangement. The grouped codecs (`grouped`) need CANONICAL or AMX and
  refuse ROWS, the default: `check_layout` says up front whether a codec can encode a layout.
- `encode` returns the segment bytes (`Encoded.data`) with the tensor's shape and dtype; the
  frame header stores those, and `decode` needs them back. A segment that depends on its
  arrangement records it, so decoding needs nothing else.
- `decode(data, shape, dtype)` returns the original shape and dtype: into `out` when given
  (a numpy array or a torch tensor on any device; no allocation), else a new torch tensor on
  `device` when given, else a new numpy array. A payload whose size disagrees with shape and
  dtype raises `CorruptBlock`. Decode does not verify checksums: `kvstore.block` does that
  before it calls a codec, and anyone else must verify first.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeGuard, runtime_checkable

import numpy as np

from kvstore.codecs.arrangement import Arrangement
from kvstore.codecs.tensors import (
    Array,
    Device,
    TensorLike,
    common_layout,
    describe,
    host_rows,
    is_device_tensor,
    new_output,
    output_rows,
    torch_dtype,
)
from kvstore.errors import CodecError, CorruptBlock
from kvstore.frame import CodecId, DType

if TYPE_CHECKING:
    import torch

__all__ = ["Codec", "BaseCodec", "Encoded", "EncodedLayers", "Buffer", "LayerSpec"]

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Encoded:
    """One encoded layer.

    `data` is a view of the caller's `out` when one was given; without `out`, a codec may return
    a view of the input tensor itself (raw does, for host tensors): copy it before the input
    changes if it is to be kept.
    """

    data: memoryview
    shape: tuple[int, ...]
    dtype: DType


@dataclass(frozen=True, slots=True)
class EncodedLayers:
    """The layers of one block, encoded: one segment per layer, all of one shape and dtype."""

    data: list[memoryview]
    shape: tuple[int, ...]
    dtype: DType


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What an encoder knows about the layer tensor it encodes."""

    shape: tuple[int, ...]
    dtype: DType
    arrangement: Arrangement
    plan: object = None
    """The codec's own checked plan for this shape (`BaseCodec._plan`), built once per call."""


@runtime_checkable
class Codec(Protocol):
    """What `kvstore.block` needs from a codec (see the module docstring for the contract)."""

    @property
    def codec_id(self) -> CodecId: ...

    @property
    def name(self) -> str: ...

    def encoded_size(self, shape: tuple[int, ...], dtype: DType) -> int:
        """Bytes of the encoded segment of a tensor of this shape and dtype."""
        ...

    def check_layout(self, shape: tuple[int, ...], dtype: DType,
                     arrangement: Arrangement) -> None:
        """CodecError unless this codec can encode layers of this shape, dtype, arrangement."""
        ...

    def encode(self, x: TensorLike, *, dtype: DType | str | None = None,
               out: bytearray | memoryview | Array | None = None,
               arrangement: Arrangement = Arrangement.ROWS) -> Encoded:
        """Encode one layer tensor; into `out` (a writable buffer of >= encoded_size bytes).

        Without `out` the result may alias `x` (see `Encoded`).
        """
        ...

    def encode_many(self, layers: Sequence[TensorLike], *, dtype: DType | str | None = None,
                    arrangement: Arrangement = Arrangement.ROWS) -> EncodedLayers:
        """Encode the layers of one block (same shape and dtype, else CodecError).

        Same bytes as `encode` per layer, with less overhead per layer. Results may alias the
        inputs (see `Encoded`).
        """
        ...

    def decode(self, data: Buffer | Array, shape: tuple[int, ...], dtype: DType, *,
               out: TensorLike | None = None, device: Device | None = None) -> TensorLike:
        """Decode one segment (see the module docstring for where the output goes)."""
        ...

    def decode_rows(self, segments: Sequence[Buffer], shape: tuple[int, ...], dtype: DType,
                    out: torch.Tensor, rows: Sequence[int]) -> list[int]:
        """Decode segment j into row `rows[j]` of a device tensor, all in one copy up;
        returns the rows refused (see `BaseCodec.decode_rows`)."""
        ...

    def encode_batch(self, blocks: torch.Tensor, arrangement: Arrangement = Arrangement.ROWS
                     ) -> torch.Tensor:
        """Encode K stacked layer tensors `[K, *shape]` with torch ops where they live: a
        `[K, encoded_size]` uint8 tensor on the same device, row k the segment of blocks[k]."""
        ...

    def decode_batch(self, staged: torch.Tensor, shape: tuple[int, ...], dtype: DType
                     ) -> torch.Tensor:
        """Decode K segments `[K, encoded_size]` (uint8, on any device, rows may be strided)
        into a `[K, *shape]` tensor of `dtype` there; each row must have passed
        `segment_valid` first."""
        ...

    def segment_valid(self, data: Array, shape: tuple[int, ...], dtype: DType) -> bool:
        """Whether a verified segment of the right size is one this codec writes (int8: sane
        scales): the host-side check before a segment is decoded on a device."""
        ...


class BaseCodec(abc.ABC):
    """Shared dispatch: validate, then run the host (numpy/numba) or device (torch) half."""

    codec_id: CodecId  # set by each codec class (or, for the grouped codecs, instance)
    name: str

    @abc.abstractmethod
    def encoded_size(self, shape: tuple[int, ...], dtype: DType) -> int: ...

    def check_layout(self, shape: tuple[int, ...], dtype: DType,
                     arrangement: Arrangement) -> None:
        self._plan(shape, dtype, arrangement)

    def _plan(self, shape: tuple[int, ...], dtype: DType, arrangement: Arrangement) -> object:
        """What the encoder needs to know about this shape, checked (CodecError if it cannot
        encode it); None for codecs that need nothing beyond rows."""
        return None

    def _spec(self, shape: tuple[int, ...], dtype: DType,
              arrangement: Arrangement) -> LayerSpec:
        return LayerSpec(shape, dtype, arrangement, self._plan(shape, dtype, arrangement))

    def encode(self, x: TensorLike, *, dtype: DType | str | None = None,
               out: bytearray | memoryview | Array | None = None,
               arrangement: Arrangement = Arrangement.ROWS) -> Encoded:
        shape, found = describe(x, dtype)
        spec = self._spec(shape, found, arrangement)
        if out is None and not is_device_tensor(x):
            view = self._view_host(host_rows(x, shape, found))
            if view is not None:
                return Encoded(view, shape, found)
        dest = _byte_buffer(out, self.encoded_size(shape, found))
        if is_device_tensor(x):
            self._encode_device(x, spec, dest)
        else:
            self._encode_host(host_rows(x, shape, found), spec, dest)
        return Encoded(dest.data, shape, found)

    def encode_many(self, layers: Sequence[TensorLike], *, dtype: DType | str | None = None,
                    arrangement: Arrangement = Arrangement.ROWS) -> EncodedLayers:
        shape, found = common_layout(layers, dtype)
        spec = self._spec(shape, found, arrangement)
        size = self.encoded_size(shape, found)
        if _on_one_device(layers):
            # A block on one GPU: encoded with one set of kernels and one copy to host.
            block = np.empty((len(layers), size), np.uint8)
            self._encode_device_many(layers, spec, block)
            return EncodedLayers([segment.data for segment in block], shape, found)
        # One allocation for the block, one row of it per layer, and no per-layer `out`
        # checks: Python per layer is most of the cost of a 64 KiB layer (~4 us of kernel).
        arena: Array | None = None
        data: list[memoryview] = []
        for index, x in enumerate(layers):
            if not is_device_tensor(x):
                rows = host_rows(x, shape, found)
                view = self._view_host(rows)
                if view is not None:
                    data.append(view)
                    continue
            if arena is None:
                arena = np.empty((len(layers), size), np.uint8)
            dest = arena[index]
            if is_device_tensor(x):
                self._encode_device(x, spec, dest)
            else:
                self._encode_host(rows, spec, dest)
            data.append(dest.data)
        return EncodedLayers(data, shape, found)

    def decode(self, data: Buffer | Array, shape: tuple[int, ...], dtype: DType, *,
               out: TensorLike | None = None, device: Device | None = None) -> TensorLike:
        expected = self.encoded_size(shape, dtype)
        if len(data) != expected:
            raise CorruptBlock(f"{self.name} payload is {len(data)} bytes; shape {shape} "
                               f"{dtype.name} needs {expected}")
        if out is None:
            out = new_output(shape, dtype, device)
        elif device is not None:
            raise CodecError("pass either out or device, not both")
        if is_device_tensor(out):
            if tuple(out.shape) != shape or out.dtype != torch_dtype(dtype):
                raise CodecError(f"out is {out.dtype} {tuple(out.shape)}, expected "
                                 f"{dtype.name} {shape}")
            if not out.is_contiguous():
                raise CodecError("out must be contiguous")
            self._decode_device(np.frombuffer(data, np.uint8), out)
        else:
            self._decode_host(data, output_rows(out, shape, dtype), shape, dtype)
        return out

    def decode_rows(self, segments: Sequence[Buffer], shape: tuple[int, ...], dtype: DType,
                    out: torch.Tensor, rows: Sequence[int]) -> list[int]:
        """Decode segment j into `out[rows[j]]`, `out` a tensor on a device: the segments go
        up in one host-to-device copy and are decoded there by one set of kernels (per block,
        a copy and a few launches each would cost more than their bytes). Returns the rows it
        refused (a wrong size, a scale no writer stores); those rows are left as they were.
        """
        import torch

        if tuple(out.shape[1:]) != shape or out.dtype != torch_dtype(dtype):
            raise CodecError(f"out is {out.dtype} {tuple(out.shape)}, expected rows of "
                             f"{dtype.name} {shape}")
        expected = self.encoded_size(shape, dtype)
        host = np.empty((len(segments), expected), np.uint8)
        kept: list[int] = []
        refused: list[int] = []
        for segment, row in zip(segments, rows, strict=True):
            data = np.frombuffer(segment, np.uint8)
            if data.size != expected or not self._valid_segment(data, shape, dtype):
                refused.append(row)
                continue
            host[len(kept)] = data
            kept.append(row)
        if kept:
            staged = torch.from_numpy(host[: len(kept)]).to(out.device)
            decoded = self._decode_device_many(staged, shape, dtype)
            if kept == list(range(len(kept))):
                out[: len(kept)].copy_(decoded)
            else:
                out.index_copy_(0, torch.tensor(kept, device=out.device), decoded)
        return refused

    def encode_batch(self, blocks: torch.Tensor, arrangement: Arrangement = Arrangement.ROWS
                     ) -> torch.Tensor:
        shape, found = describe(blocks[0])
        if blocks.ndim != len(shape) + 1:
            raise CodecError(f"encode_batch takes [K, *shape] blocks, got {tuple(blocks.shape)}")
        return self._encode_batch(blocks.detach(), self._spec(shape, found, arrangement))

    def decode_batch(self, staged: torch.Tensor, shape: tuple[int, ...], dtype: DType
                     ) -> torch.Tensor:
        expected = self.encoded_size(shape, dtype)
        if staged.ndim != 2 or staged.shape[1] != expected:
            raise CorruptBlock(f"{self.name} segments are {tuple(staged.shape)}; shape {shape} "
                               f"{dtype.name} needs rows of {expected} bytes")
        return self._decode_device_many(staged, shape, dtype)

    def segment_valid(self, data: Array, shape: tuple[int, ...], dtype: DType) -> bool:
        return data.size == self.encoded_size(shape, dtype) and self._valid_segment(data, shape,
                                                                                    dtype)

    def _valid_segment(self, data: Array, shape: tuple[int, ...], dtype: DType) -> bool:
        """Whether a segment of the right size can be decoded (int8: its scales are sane)."""
        return True

    @abc.abstractmethod
    def _encode_batch(self, blocks: torch.Tensor, spec: LayerSpec) -> torch.Tensor:
        """`encode_batch` once its input is checked: [K, *spec.shape] -> [K, bytes] uint8."""

    @abc.abstractmethod
    def _decode_device_many(self, staged: torch.Tensor, shape: tuple[int, ...],
                            dtype: DType) -> torch.Tensor:
        """Decode K segments already on the device [K, bytes] into a [K, *shape] tensor."""

    def _view_host(self, rows: Array) -> memoryview | None:
        """The encoding as a view of the input itself, for codecs where that is possible."""
        return None

    @abc.abstractmethod
    def _encode_host(self, rows: Array, spec: LayerSpec, dest: Array) -> None:
        """Write the encoding of host [R, E] `rows` into `dest` (uint8, encoded_size bytes)."""

    @abc.abstractmethod
    def _encode_device(self, x: torch.Tensor, spec: LayerSpec, dest: Array) -> None:
        """Encode a device tensor with torch ops there, then copy the result into `dest`."""

    def _encode_device_many(self, layers: Sequence[torch.Tensor], spec: LayerSpec,
                            dest: Array) -> None:
        """Encode same-shaped layers on one device into the rows of `dest` [L, size]: one
        set of kernels for the block and one copy to host."""
        import torch

        encoded = self._encode_batch(torch.stack([x.detach() for x in layers]), spec)
        torch.from_numpy(dest).copy_(encoded)

    @abc.abstractmethod
    def _decode_host(self, data: Buffer | Array, rows: Array, shape: tuple[int, ...],
                     dtype: DType) -> None:
        """Decode into the [R, E] bits view `rows` of a host output of `shape`."""

    @abc.abstractmethod
    def _decode_device(self, data: Array, out: torch.Tensor) -> None:
        """Decode host bytes `data` (uint8) into the device tensor `out`."""


def _on_one_device(layers: Sequence[TensorLike]) -> TypeGuard[Sequence[torch.Tensor]]:
    """Whether every layer lives on one and the same accelerator."""
    first = layers[0]
    return is_device_tensor(first) and all(
        is_device_tensor(x) and x.device == first.device for x in layers)


def _byte_buffer(out: bytearray | memoryview | Array | None, size: int) -> Array:
    """A writable uint8 array of exactly `size` bytes: the head of `out`, or a fresh one."""
    if out is None:
        return np.empty(size, np.uint8)
    if isinstance(out, np.ndarray) and out.dtype == np.uint8 and out.ndim == 1 \
            and out.flags.writeable and out.size >= size:
        return out[:size] if out.size > size else out  # the common, preallocated case
    try:
        view = np.frombuffer(out, np.uint8) if not isinstance(out, np.ndarray) else (
            out.reshape(-1).view(np.uint8))
    except (TypeError, ValueError) as exc:
        raise CodecError(f"out is not a contiguous byte buffer: {exc}") from exc
    if not view.flags.writeable:
        raise CodecError("out must be writable")
    if view.size < size:
        raise CodecError(f"out holds {view.size} bytes, the encoding needs {size}")
    return view[:size]
