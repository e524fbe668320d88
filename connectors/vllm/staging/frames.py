"""Frames whose geometry is known before their bytes exist: uncompressed segments of one
size, so the header's size and every segment's offset follow from the block's shape alone.

That lets a pipeline lay a batch of blocks out in a staging buffer exactly as frames
(`[header | layer 0 | layer 1 | ...]` per row), copy the segments in from the device, hash
them where they lie and write the header in front: the row *is* the frame, with no copy to
assemble it. The bytes are those `kvstore.frame.build_frame` writes for the same segments
(tested), so every reader treats these frames like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvstore.frame import (
    CodecId,
    Compression,
    DType,
    FrameHeader,
    LayerRange,
    SegmentInfo,
    segment_checksum,
)

__all__ = ["FrameLayout"]

_NO_DIGEST = bytes(16)


@dataclass(frozen=True, slots=True)
class FrameLayout:
    """Where everything is in a frame of `num_layers` segments of `segment_bytes` each."""

    codec: CodecId
    dtype: DType
    layout_id: str
    token_count: int
    layer_shape: tuple[int, ...]
    num_layers: int
    segment_bytes: int
    header_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        # The header's size depends only on the layout id, the rank and the layer count: pack
        # one with placeholder values and measure it.
        probe = self._header(_NO_DIGEST, [bytes(16)] * self.num_layers, 0)
        object.__setattr__(self, "header_bytes", len(probe.pack()))

    @property
    def frame_bytes(self) -> int:
        return self.header_bytes + self.num_layers * self.segment_bytes

    def payload_span(self, layers: LayerRange) -> tuple[int, int]:
        """Bytes [start, stop) of the payload (the frame after its header) holding `layers`."""
        return layers.start * self.segment_bytes, layers.stop * self.segment_bytes

    def seal(self, row: npt.NDArray[np.uint8], key_digest: bytes) -> memoryview:
        """Hash the segments that lie in `row` after the header's room, write the header in
        front of them, and return the frame (a view of `row`, no copy)."""
        header_bytes, size = self.header_bytes, self.segment_bytes
        data = row.data
        checksums = [segment_checksum(data[header_bytes + i * size: header_bytes + (i + 1) * size])
                     for i in range(self.num_layers)]
        header = self._header(key_digest, checksums, header_bytes).pack()
        row[:header_bytes] = np.frombuffer(header, np.uint8)
        return data[: self.frame_bytes]

    def _header(self, key_digest: bytes, checksums: Sequence[bytes],
                header_bytes: int) -> FrameHeader:
        size = self.segment_bytes
        segments = tuple(SegmentInfo(header_bytes + i * size, size, size, Compression.NONE,
                                     checksum) for i, checksum in enumerate(checksums))
        return FrameHeader(self.codec, self.dtype, self.layout_id, self.token_count,
                           self.layer_shape, key_digest, segments, header_bytes)
