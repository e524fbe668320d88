"""A block's layers in and out of one checksummed frame: `encode_block`, `decode_layer(s)`.

Encoding: every layer goes through the codec (`raw` or `int8`, see `kvstore.codecs`), then
optionally zstd (level 1) per segment, then `kvstore.frame.build_frame`.

Compression policy. zstd-1 saves only 6-18 % on fp16 or int8 KV at ~1-1.3 GB/s (machine
facts), far slower than the codecs, so a segment is stored compressed only when that saves at
least `MIN_SAVING` (10 %):
- "none": never compress.
- "auto": compress the first `SAMPLE_BYTES` of the first layer; if that sample does not save
  10 %, store every layer raw (one small compression per block is the whole cost). If it does,
  compress every layer and keep each one compressed only where it saves 10 %. Layers of one
  block are alike (same model, same tokens), so the first one predicts the rest well.
- "zstd": try every layer, keep each where it saves 10 %.

Decoding hashes only what nobody verified: a `BlockRead` marked `verified` (every read the
`TieredStore` returns) is decoded as it is, while for any other read (`decode_frame`, a
`BlockRead` built by hand or straight from a tier) each segment is checked against its checksum
just before a codec sees it. Given `key`, the frame's key binding is checked either way (16
bytes). A layer whose stored size disagrees with the header's shape, dtype and codec raises
`CorruptBlock`; every read path turns that, like any other `CorruptBlock`, into a miss.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, overload

import zstandard

from kvstore.codecs import Arrangement, Array, Buffer, Device, TensorLike, get_codec
from kvstore.codecs.tensors import is_device_tensor, torch_dtype
from kvstore.errors import CodecError, CorruptBlock, KVKeepError
from kvstore.frame import (
    BlockRead,
    CodecId,
    Compression,
    DType,
    LayerRange,
    Signer,
    build_frame,
    check_payload_size,
    segment_checksum,
    signed_segment_checksum,
)
from kvstore.keys import BlockKey

if TYPE_CHECKING:
    import torch

__all__ = [
    "CompressionMode",
    "compress_segments",
    "ZSTD_LEVEL",
    "MIN_SAVING",
    "SAMPLE_BYTES",
    "encode_block",
    "decode_layer",
    "decode_layers",
    "decode_layer_batch",
    "decode_frame",
]

CompressionMode = Literal["auto", "none", "zstd"]
ZSTD_LEVEL = 1  # level 3 was never better on KV here, and is slower
MIN_SAVING = 0.10
SAMPLE_BYTES = 64 << 10  # ~50 us of zstd: small next to quantizing a whole block


def encode_block(
    layers: Sequence[TensorLike],
    *,
    codec: str | CodecId,
    key: BlockKey,
    token_count: int,
    layout_id: str,
    compression: CompressionMode = "auto",
    dtype: DType | str | None = None,
    arrangement: Arrangement = Arrangement.ROWS,
    signer: Signer | None = None,
) -> bytes:
    """Encode all layers of one block into one frame bound to `key`; with `signer` (the
    tenant's `kvstore.mac.MacKey`), a signed frame that readers holding the key accept.

    Every layer must have the same shape and dtype (CodecError otherwise). `dtype` is needed
    only for numpy arrays of bf16 bit patterns (uint16); `arrangement` says where K, V, tokens
    and channels are in a layer (the grouped codecs need it); see `kvstore.codecs.base` for the
    layer tensor contract.
    """
    if compression not in ("auto", "none", "zstd"):
        raise CodecError(f"compression must be 'auto', 'none' or 'zstd', not {compression!r}")
    coder = get_codec(codec)
    # Raw segments are views of the layers themselves; build_frame copies them into the frame
    # before it returns, so nothing aliases the caller's tensors afterwards.
    encoded = coder.encode_many(layers, dtype=dtype, arrangement=arrangement)
    return build_frame(compress_segments(encoded.data, compression), codec=coder.codec_id,
                       dtype=encoded.dtype, layout_id=layout_id, token_count=token_count,
                       layer_shape=encoded.shape, key_digest=key.digest, signer=signer)


@overload
def decode_layer(read: BlockRead, layer: int, *, out: None = None, device: None = None,
                 key: BlockKey | None = None) -> Array: ...
@overload
def decode_layer(read: BlockRead, layer: int, *, out: Array, device: None = None,
                 key: BlockKey | None = None) -> Array: ...
@overload
def decode_layer(read: BlockRead, layer: int, *, out: torch.Tensor, device: None = None,
                 key: BlockKey | None = None) -> torch.Tensor: ...
@overload
def decode_layer(read: BlockRead, layer: int, *, out: None = None, device: Device,
                 key: BlockKey | None = None) -> torch.Tensor: ...
def decode_layer(read: BlockRead, layer: int, *, out: TensorLike | None = None,
                 device: Device | None = None, key: BlockKey | None = None) -> TensorLike:
    """Verify and decode one layer of `read` (a layer index of the whole block).

    Output: into `out` (numpy array or torch tensor, any device) when given; else a new torch
    tensor on `device` when given; else a new numpy array (bf16 as uint16 bit patterns).
    Raises CorruptBlock (a miss) on any integrity failure, CodecError on a bad request (layer
    outside the read, `out` of the wrong shape or dtype).
    """
    _check_layer(read, layer)
    if key is not None:
        read.verify_key(key.digest)
    checked = _CheckedRead(read)
    return checked.codec.decode(checked.segment(layer), read.header.layer_shape,
                                read.header.dtype, out=out, device=device)


@overload
def decode_layers(read: BlockRead, layers: LayerRange | None = None, *, out: None = None,
                  device: None = None, key: BlockKey | None = None) -> list[Array]: ...
@overload
def decode_layers(read: BlockRead, layers: LayerRange | None = None, *,
                  out: Sequence[Array], device: None = None,
                  key: BlockKey | None = None) -> list[Array]: ...
@overload
def decode_layers(read: BlockRead, layers: LayerRange | None = None, *,
                  out: Sequence[torch.Tensor], device: None = None,
                  key: BlockKey | None = None) -> list[torch.Tensor]: ...
@overload
def decode_layers(read: BlockRead, layers: LayerRange | None = None, *, out: None = None,
                  device: Device, key: BlockKey | None = None) -> list[torch.Tensor]: ...
def decode_layers(read: BlockRead, layers: LayerRange | None = None, *,
                  out: Sequence[TensorLike] | None = None, device: Device | None = None,
                  key: BlockKey | None = None) -> Sequence[TensorLike]:
    """Verify and decode `layers` (default: all layers of the read), one output per layer.

    `out`, when given, holds one output per layer (a stacked [L, ...] tensor's `unbind(0)` or a
    numpy array's `list(...)` gives views). Each segment of an unverified read is hashed just
    before it is decoded.
    """
    want = layers or read.layers
    if want.start not in read.layers or want.stop - 1 not in read.layers:
        raise CodecError(f"layers [{want.start}, {want.stop}) not in the read "
                         f"[{read.layers.start}, {read.layers.stop})")
    if out is not None and len(out) != len(want):
        raise CodecError(f"{len(out)} outputs for {len(want)} layers")
    if key is not None:
        read.verify_key(key.digest)
    checked = _CheckedRead(read)
    shape, dtype = read.header.layer_shape, read.header.dtype
    return [checked.codec.decode(checked.segment(layer), shape, dtype,
                                 out=None if out is None else out[i], device=device)
            for i, layer in enumerate(range(want.start, want.stop))]


def decode_layer_batch(reads: Sequence[BlockRead], layer: int, out: torch.Tensor, *,
                       keys: Sequence[BlockKey]) -> list[KVKeepError | None]:
    """Verify and decode `layer` of each read into `out[i]` (`out`: [>= len(reads), *shape]).

    Returns per read None when its row holds the layer, else the CorruptBlock or CodecError
    that kept it out (that row is then unspecified): one bad block never spoils the others.
    A host `out` is filled row by row; on a device the verified segments of every read go up
    in one copy and are decoded there together (`Codec.decode_rows`).
    """
    if len(keys) != len(reads) or out.shape[0] < len(reads):
        raise CodecError(f"{len(reads)} reads, {len(keys)} keys, {out.shape[0]} output rows")
    results: list[KVKeepError | None] = [None] * len(reads)
    if not is_device_tensor(out):
        for i, (read, key) in enumerate(zip(reads, keys, strict=True)):
            try:
                decode_layer(read, layer, out=out[i], key=key)
            except (CorruptBlock, CodecError) as exc:
                results[i] = exc
        return results
    shape = tuple(out.shape[1:])
    by_codec: dict[tuple[CodecId, DType], tuple[list[Buffer], list[int]]] = {}
    for i, (read, key) in enumerate(zip(reads, keys, strict=True)):
        try:
            _check_layer(read, layer)
            if tuple(read.header.layer_shape) != shape \
                    or torch_dtype(read.header.dtype) != out.dtype:
                raise CodecError(f"frame layers are {read.header.dtype.name} "
                                 f"{read.header.layer_shape}, rows {out.dtype} {shape}")
            read.verify_key(key.digest)
            segment = _CheckedRead(read).segment(layer)
        except (CorruptBlock, CodecError) as exc:
            results[i] = exc
            continue
        group = by_codec.setdefault((read.header.codec, read.header.dtype), ([], []))
        group[0].append(segment)
        group[1].append(i)
    for (codec, dtype), (segments, rows) in by_codec.items():
        for row in get_codec(codec).decode_rows(segments, shape, dtype, out, rows):
            results[row] = CorruptBlock("segment refused by its codec (invalid scale)")
    return results


def _check_layer(read: BlockRead, layer: int) -> None:
    if layer not in read.layers:
        raise CodecError(f"layer {layer} not in the read [{read.layers.start}, "
                         f"{read.layers.stop})")


def decode_frame(frame: Buffer, *, key: BlockKey, layers: LayerRange | None = None,
                 device: Device | None = None) -> list[TensorLike]:
    """Parse, verify (checksums and key) and decode a whole frame's `layers`: the simple path."""
    read = BlockRead.from_frame(frame, layers)
    return list(decode_layers(read, key=key, device=device))


# ---------------------------------------------------------------------------------------------

_zstd = threading.local()  # ZstdCompressor objects must not be shared between threads


def compress_segments(segments: Sequence[memoryview], mode: CompressionMode) -> list[
        tuple[Buffer, Compression, int]]:
    """Per-layer (stored bytes, compression, raw length) triples, per the module's policy:
    what `build_frame` takes (the staged save frames a slot's rows with it too)."""
    plain: list[tuple[Buffer, Compression, int]] = [
        (s, Compression.NONE, len(s)) for s in segments]
    if mode == "none":
        return plain
    cctx: zstandard.ZstdCompressor | None = getattr(_zstd, "cctx", None)
    if cctx is None:
        cctx = _zstd.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    if mode == "auto":
        sample = segments[0][:SAMPLE_BYTES]
        if not _pays(len(cctx.compress(sample)), len(sample)):
            return plain
    stored: list[tuple[Buffer, Compression, int]] = []
    for segment, fallback in zip(segments, plain, strict=True):
        packed = cctx.compress(segment)
        stored.append((packed, Compression.ZSTD, len(segment))
                      if _pays(len(packed), len(segment)) else fallback)
    return stored


def _pays(packed: int, raw: int) -> bool:
    return packed <= raw * (1.0 - MIN_SAVING)


class _CheckedRead:
    """A read whose sizes were checked against its header and codec (the one shape check of
    decoding); hands out segments, hashed unless the read is marked verified."""

    __slots__ = ("base", "codec", "expected", "payload", "read")

    def __init__(self, read: BlockRead) -> None:
        header = read.header
        self.base = check_payload_size(header, read.layers, len(read.payload))
        self.read = read
        self.codec = get_codec(header.codec)
        self.payload = memoryview(read.payload)
        self.expected = self.codec.encoded_size(header.layer_shape, header.dtype)

    def segment(self, layer: int) -> Buffer:
        """The decompressed payload of `layer`, once its stored bytes are known to match their
        checksum.

        An unverified read has each segment hashed just before use (not the whole read up
        front), so a caller decoding layer by layer hashes every byte once; a verified read was
        hashed once already, by the tier or the store that returned it.
        """
        info = self.read.header.segments[layer]
        if info.raw_length != self.expected:
            raise CorruptBlock(f"segment {layer} holds {info.raw_length} bytes; the header's "
                               f"shape and dtype need {self.expected}")
        lo = info.offset - self.base
        stored = self.payload[lo: lo + info.length]
        if not self.read.verified:
            checksum = signed_segment_checksum if self.read.header.signed else segment_checksum
            if checksum(stored) != info.checksum:
                raise CorruptBlock(f"segment {layer} checksum mismatch")
        if info.compression is Compression.NONE:
            return stored
        return self.read.segment(layer)  # decompresses, checking the size it comes out at
