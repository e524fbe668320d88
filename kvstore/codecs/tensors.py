"""Seeing numpy arrays and torch tensors as C-contiguous rows of raw bits, without copies.

The codecs work on one layout: a host tensor of shape [..., E] seen as a 2-D array [R, E]
with R = prod(leading dims). 16-bit dtypes are handed to the kernels as uint16 bit patterns
(numpy has no bf16, and its fp16 casts are slow), fp32 as float32.

numpy has no bfloat16, so a numpy array holding bf16 is a uint16 (or int16) array of bit
patterns plus an explicit `dtype=DType.BFLOAT16`. Decoding bf16 into numpy returns such a uint16
array too; ask for a torch tensor (`device=`) to get real bf16.

torch is never imported here: a tensor can only exist if its caller imported torch already, so
`sys.modules` tells us whether to look for one. The scheduler side of the connector and the
daemons thus stay free of torch.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, Union

import numpy as np
import numpy.typing as npt

from kvstore.errors import CodecError, InvalidFrame
from kvstore.frame import DType

if TYPE_CHECKING:
    import torch

__all__ = [
    "Array",
    "TensorLike",
    "Device",
    "resolve_dtype",
    "describe",
    "host_rows",
    "common_layout",
    "output_rows",
    "new_output",
    "rows_shape",
    "is_torch_tensor",
    "is_device_tensor",
    "torch_dtype",
    "MAX_NDIM",
]

Array = npt.NDArray[Any]
TensorLike = Union[Array, "torch.Tensor"]
Device = Union[str, "torch.device"]

MAX_NDIM = 8  # what the frame header can describe

# numpy element types accepted for each DType: the real type, or a 16-bit bit container.
_NUMPY_TYPES: dict[DType, tuple[np.dtype[Any], ...]] = {
    DType.FLOAT16: (np.dtype(np.float16), np.dtype(np.uint16), np.dtype(np.int16)),
    DType.BFLOAT16: (np.dtype(np.uint16), np.dtype(np.int16)),
    DType.FLOAT32: (np.dtype(np.float32),),
}
_BITS_KIND = "bits"  # a 16-bit integer array: bit patterns of the dtype the caller names
_NUMPY_KINDS: dict[np.dtype[Any], DType | str] = {
    np.dtype(np.float16): DType.FLOAT16, np.dtype(np.float32): DType.FLOAT32,
    np.dtype(np.uint16): _BITS_KIND, np.dtype(np.int16): _BITS_KIND,
}
# What a fresh numpy output holds (bf16 as its bit patterns).
_NUMPY_OUT: dict[DType, type[np.generic]] = {
    DType.FLOAT16: np.float16, DType.BFLOAT16: np.uint16, DType.FLOAT32: np.float32,
}
# What the kernels see.
_BITS: dict[DType, type[np.generic]] = {
    DType.FLOAT16: np.uint16, DType.BFLOAT16: np.uint16, DType.FLOAT32: np.float32,
}


def resolve_dtype(dtype: DType | str | None) -> DType | None:
    if dtype is None or isinstance(dtype, DType):
        return dtype
    try:
        return DType.from_name(str(dtype))
    except InvalidFrame as exc:
        raise CodecError(str(exc)) from None


def is_torch_tensor(x: object) -> TypeGuard[torch.Tensor]:
    torch_mod = sys.modules.get("torch")
    return torch_mod is not None and isinstance(x, torch_mod.Tensor)


def is_device_tensor(x: object) -> TypeGuard[torch.Tensor]:
    """A torch tensor that lives off the host (CUDA, ...): encoded/decoded with torch ops."""
    return is_torch_tensor(x) and x.device.type != "cpu"


def torch_dtype(dtype: DType) -> torch.dtype:
    import torch

    return {DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16,
            DType.FLOAT32: torch.float32}[dtype]


def describe(x: object, dtype: DType | str | None = None) -> tuple[tuple[int, ...], DType]:
    """(shape, dtype) of a layer tensor, checking it is one the codecs accept."""
    # This runs once per layer per block: kept to a few dict lookups (~1 us).
    want = resolve_dtype(dtype)
    if isinstance(x, np.ndarray):
        found = _from_numpy_dtype(x.dtype, want)
        shape: tuple[int, ...] = x.shape
    elif is_torch_tensor(x):
        found = _from_torch_dtype(x.dtype)
        if want is not None and want is not found:
            raise CodecError(f"tensor is {x.dtype}, but dtype={want.name} was given")
        shape = tuple(x.shape)
    else:
        raise CodecError(f"expected a numpy array or torch tensor, got {type(x).__name__}")
    _check_shape(shape)
    return shape, found


def host_rows(x: TensorLike, shape: tuple[int, ...], dtype: DType) -> Array:
    """The [R, E] bits view of a host tensor that `describe` gave (shape, dtype) for.

    Copies only if the tensor is not C-contiguous.
    """
    if isinstance(x, np.ndarray):
        flat = np.ascontiguousarray(x).view(_BITS[dtype])
    else:
        if is_device_tensor(x):
            raise CodecError("host_rows needs a CPU tensor")
        flat = _torch_bits(x.detach().contiguous(), dtype)
    return flat.reshape(rows_shape(shape))


def common_layout(layers: Sequence[TensorLike],
                  dtype: DType | str | None = None) -> tuple[tuple[int, ...], DType]:
    """(shape, dtype) shared by every layer of a block; CodecError if they differ or none."""
    if not layers:
        raise CodecError("a block needs at least one layer")
    shape, found = describe(layers[0], dtype)
    for index in range(1, len(layers)):
        other = describe(layers[index], found)
        if other != (shape, found):
            raise CodecError(f"layer {index} is {other[1].name} {other[0]}, layer 0 is "
                             f"{found.name} {shape}: all layers must match")
    return shape, found


def output_rows(out: TensorLike, shape: tuple[int, ...], dtype: DType) -> Array:
    """Check a caller's host output against (shape, dtype); return its writable [R, E] bits."""
    if isinstance(out, np.ndarray):
        if out.shape != shape:
            raise CodecError(f"out has shape {out.shape}, expected {shape}")
        if out.dtype not in _NUMPY_TYPES[dtype]:  # non-native byte orders are not in there
            raise CodecError(f"out is {out.dtype}, expected one of "
                             f"{[str(t) for t in _NUMPY_TYPES[dtype]]} for {dtype.name}")
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise CodecError("out must be a writable C-contiguous array")
        return out.view(_BITS[dtype]).reshape(rows_shape(shape))
    if not is_torch_tensor(out):
        raise CodecError(f"out must be a numpy array or torch tensor, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        raise CodecError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if is_device_tensor(out):
        raise CodecError("output_rows needs a CPU tensor")
    if out.dtype != torch_dtype(dtype):
        raise CodecError(f"out is {out.dtype}, expected {dtype.name}")
    if not out.is_contiguous():
        raise CodecError("out must be contiguous")
    return _torch_bits(out.detach(), dtype).reshape(rows_shape(shape))


def new_output(shape: tuple[int, ...], dtype: DType, device: Device | None) -> TensorLike:
    """A fresh output: numpy when `device` is None, else a torch tensor on `device`."""
    if device is None:
        return np.empty(shape, _NUMPY_OUT[dtype])
    import torch

    return torch.empty(shape, dtype=torch_dtype(dtype), device=device)


def rows_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(R, E): the number of leading indices (rows) and the last dim of a layer shape."""
    return math.prod(shape[:-1]), shape[-1]


def _check_shape(shape: tuple[int, ...]) -> None:
    if not 1 <= len(shape) <= MAX_NDIM:
        raise CodecError(f"a layer tensor needs 1-{MAX_NDIM} dims, got shape {shape}")
    if min(shape) <= 0 or max(shape) >= 1 << 32:
        raise CodecError(f"every dim must be in [1, 2**32), got shape {shape}")


def _from_torch_dtype(dt: torch.dtype) -> DType:
    try:
        return DType.from_name(str(dt))
    except InvalidFrame:
        raise CodecError(f"unsupported tensor dtype {dt}") from None


def _from_numpy_dtype(dt: np.dtype[Any], want: DType | None) -> DType:
    kind = _NUMPY_KINDS.get(dt)  # non-native byte orders are other dtypes: not found
    if kind is _BITS_KIND:
        if want is DType.FLOAT16 or want is DType.BFLOAT16:
            return want
        raise CodecError(f"a {dt} array holds bit patterns: pass dtype='bfloat16' or 'float16'")
    if isinstance(kind, DType) and (want is None or want is kind):
        return kind
    raise CodecError(f"array dtype {dt} does not fit dtype={want.name if want else None}")


def _torch_bits(t: torch.Tensor, dtype: DType) -> Array:
    """numpy view (shared memory) of a contiguous CPU tensor's bits."""
    import torch

    if dtype is DType.FLOAT32:
        return t.numpy().reshape(-1)
    # numpy has no bf16, so go through int16; the uint16 view is what the kernels take.
    return t.view(torch.int16).numpy().reshape(-1).view(np.uint16)
