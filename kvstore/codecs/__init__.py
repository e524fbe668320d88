"""Layer codecs on numpy or torch tensors: `raw` (bit-exact), `int8-sym` (per-row symmetric),
and the grouped ones that follow the block's arrangement (`int8-asym`, `int8-kivi`, `int8-g32`,
`int4`; see `grouped`).

Names. `get_codec` takes each codec's own name, and `"int8"` as the old name of `int8-sym`
(which it was called before the others came), so code written against it keeps its bytes.
A deployment's `"codec": "int8"` (the connector config) instead means `DEFAULT_INT8`, the int8
scheme `benchmarks.quant` measured best on trained models (README, "Quantized KV"):
`config_codec_name` resolves it. Frames record the codec id, never a name, so changing the
default never changes how a stored frame decodes.

See `kvstore.codecs.base` for the contract (shapes, dtypes, arrangements, where outputs go) and
`kvstore.block` for how encoded layers become a checksummed frame.
"""

from __future__ import annotations

from kvstore.codecs.arrangement import Arrangement
from kvstore.codecs.base import BaseCodec, Buffer, Codec, Encoded, EncodedLayers
from kvstore.codecs.grouped import GroupedCodec, Scheme, schemes
from kvstore.codecs.int8 import Int8Codec
from kvstore.codecs.kernels import warmup as _warmup_rows
from kvstore.codecs.raw import RawCodec
from kvstore.codecs.tensors import Array, Device, TensorLike, describe
from kvstore.errors import CodecError
from kvstore.frame import CodecId, DType

__all__ = [
    "Arrangement",
    "Array",
    "BaseCodec",
    "Buffer",
    "Codec",
    "CODECS",
    "CODEC_NAMES",
    "DEFAULT_INT8",
    "Device",
    "Encoded",
    "EncodedLayers",
    "GroupedCodec",
    "Int8Codec",
    "RawCodec",
    "Scheme",
    "TensorLike",
    "canonical_name",
    "config_codec_name",
    "describe",
    "get_codec",
    "warmup",
]

DEFAULT_INT8 = "int8-sym"
"""What a connector config's `"codec": "int8"` means (see the module docstring): on a quiet
machine only `int8-sym` meets the speed targets (README, "Quantized KV")."""

CODECS: dict[CodecId, Codec] = {CodecId.RAW: RawCodec(), CodecId.INT8: Int8Codec()}
for _name, (_codec_id, _scheme) in schemes().items():
    CODECS[_codec_id] = GroupedCodec(_codec_id, _name, _scheme)
_BY_NAME: dict[str, Codec] = {c.name: c for c in CODECS.values()}
_ALIASES = {"int8": "int8-sym"}
CODEC_NAMES: tuple[str, ...] = (*_BY_NAME, *_ALIASES)
"""Every name `get_codec` and `config_codec_name` take."""


def canonical_name(codec: str) -> str:
    """A codec's own name for a name or alias ("int8" -> "int8-sym"); CodecError if unknown."""
    return get_codec(codec).name


def config_codec_name(codec: str) -> str:
    """The codec a deployment's config means: "int8" -> DEFAULT_INT8, any other name -> its
    codec's own name; CodecError if unknown."""
    name = str(codec).lower()
    return DEFAULT_INT8 if name == "int8" else canonical_name(name)


def get_codec(codec: str | CodecId) -> Codec:
    """The codec for a name ("raw", "int8-kivi", "int8" for int8-sym, ...) or a frame's id."""
    if isinstance(codec, CodecId):
        found = CODECS.get(codec)
    else:
        name = str(codec).lower()
        found = _BY_NAME.get(_ALIASES.get(name, name))
    if found is None:
        raise CodecError(f"unknown codec {codec!r}; known: {sorted(CODEC_NAMES)}")
    return found


def warmup(dtypes: tuple[DType, ...] = tuple(DType)) -> None:
    """Compile (or load from numba's cache) every codec kernel for `dtypes` now rather than on
    first use (e.g. from a background thread at worker start)."""
    from kvstore.codecs import grouped_kernels

    _warmup_rows(dtypes)
    grouped_kernels.warmup(dtypes)
