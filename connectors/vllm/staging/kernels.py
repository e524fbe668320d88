"""The device work of a staged batch: one kernel sequence per batch, one scatter or one copy
per layer, never one per block.

Restore: a slot holds a batch's layer range, one row per block (`[rows, layers, segment]`).
raw segments are viewed as the cache's dtype where they lie and scattered; a lossy codec's
segments of every layer of the batch are decoded in one `Codec.decode_batch` (one set of
kernels for `layers x rows` segments), then each layer is scattered. Only the codec's bytes
crossed the link.

Save: a step's gathered layers (`[rows, *block_shape]` each, one gather per layer, done by
the saver) are stacked into frame order and, for a lossy codec, quantized in one
`Codec.encode_batch` over every layer of the batch, straight into the slot's frame rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from connectors.vllm.caches import PagedCaches
from kvstore.codecs import Arrangement, Codec
from kvstore.frame import CodecId, LayerRange

__all__ = ["scatter_rows", "encode_rows"]


def scatter_rows(caches: PagedCaches, codec: Codec, staged: torch.Tensor, layers: LayerRange,
                 targets: torch.Tensor) -> None:
    """Write `staged` ([count, len(layers) * segment] uint8 on the caches' device, rows in
    `targets` order) into layers `layers` of the paged blocks `targets`."""
    count, shape, dtype = staged.shape[0], caches.block_shape, caches.dtype
    segments = staged.view(count, len(layers), -1)
    if codec.codec_id is CodecId.RAW:
        for i, layer in enumerate(range(layers.start, layers.stop)):
            blocks = segments[:, i].view(caches.torch_dtype).view(count, *shape)
            caches.bound[layer].scatter(caches.tensors[layer], targets, blocks)
        return
    flat = segments.transpose(0, 1).reshape(len(layers) * count, -1)
    decoded = codec.decode_batch(flat, shape, dtype).view(len(layers), count, *shape)
    for i, layer in enumerate(range(layers.start, layers.stop)):
        caches.bound[layer].scatter(caches.tensors[layer], targets, decoded[i])


def encode_rows(codec: Codec, layers: Sequence[torch.Tensor], rows: torch.Tensor,
                arrangement: Arrangement, out: torch.Tensor) -> None:
    """Encode rows `rows` (indexes, on the layers' device) of every gathered layer into `out`
    ([count, layers * segment] uint8, on the layers' device): row j of `out` holds block
    `rows[j]`'s segments in layer order."""
    count = int(rows.shape[0])
    stacked = torch.stack([layer.index_select(0, rows) for layer in layers],
                          dim=1)  # [count, L, *shape]
    if codec.codec_id is CodecId.RAW:
        out.copy_(stacked.reshape(count, -1).view(torch.uint8))
        return
    encoded = codec.encode_batch(stacked.reshape(count * len(layers), *stacked.shape[2:]),
                                 arrangement)
    out.copy_(encoded.view(count, -1))
