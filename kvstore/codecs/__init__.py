"""Layer codecs: `raw` (bit-exact) and `int8` (per-row symmetric), on numpy or torch tensors.

See `kvstore.codecs.base` for the contract (shapes, dtypes, where outputs go) and
`kvstore.block` for how encoded layers become a checksummed frame.
"""

from __future__ import annotations

from kvstore.codecs.base import BaseCodec, Buffer, Codec, Encoded, EncodedLayers
from kvstore.codecs.int8 import Int8Codec
from kvstore.codecs.kernels import warmup
from kvstore.codecs.raw import RawCodec
from kvstore.codecs.tensors import Array, Device, TensorLike, describe
from kvstore.errors import CodecError
from kvstore.frame import CodecId

__all__ = [
    "Array",
    "BaseCodec",
    "Buffer",
    "Codec",
    "CODECS",
    "Device",
    "Encoded",
    "EncodedLayers",
    "Int8Codec",
    "RawCodec",
    "TensorLike",
    "describe",
    "get_codec",
    "warmup",
]

CODECS: dict[CodecId, Codec] = {CodecId.RAW: RawCodec(), CodecId.INT8: Int8Codec()}
_BY_NAME: dict[str, Codec] = {c.name: c for c in CODECS.values()}


def get_codec(codec: str | CodecId) -> Codec:
    """The codec for a name ("raw", "int8") or a frame's CodecId."""
    found = CODECS.get(codec) if isinstance(codec, CodecId) else _BY_NAME.get(str(codec).lower())
    if found is None:
        raise CodecError(f"unknown codec {codec!r}; known: {sorted(_BY_NAME)}")
    return found
