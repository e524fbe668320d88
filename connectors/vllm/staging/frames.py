"""Frames whose geometry is known before their bytes exist: uncompressed segments of one
size, so the header's size and every segment's offset follow from the block's shape alone.

That lets a pipeline lay a batch of blocks out in a staging buffer exactly as frames
(`[header | layer 0 | layer 1 | ...]` per row), copy the segments in from the device, hash
them where they lie and write the header in front: the row *is* the frame, with no copy to
assemble it. The bytes are those `kvstore.frame.build_frame` writes for the same segments
(tested), so every reader treats these frames like any other; with a signer (the tenant's MAC
key) they are signed frames: BLAKE3 segment checksums and the MAC over the header.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvstore.frame import (
    CodecId,
    Compression,
    DType,
    LayerRange,
    SegmentInfo,
    Signer,
    segment_checksum,
    signed_segment_checksum,
)
from kvstore.frame_header import header_size, pack_header

__all__ = ["FrameLayout"]


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
    signer: Signer | None = None
    header_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        # The header's size depends only on the layout id, the rank, the layer count and
        # whether the frame is signed.
        object.__setattr__(self, "header_bytes", header_size(
            len(self.layout_id.encode()), len(self.layer_shape), self.num_layers,
            self.signer is not None))

    @property
    def frame_bytes(self) -> int:
        return self.header_bytes + self.num_layers * self.segment_bytes

    def payload_span(self, layers: LayerRange) -> tuple[int, int]:
        """Bytes [start, stop) of the payload (the frame after its header) holding `layers`."""
        return layers.start * self.segment_bytes, layers.stop * self.segment_bytes

    def segments(self, row: npt.NDArray[np.uint8]) -> list[memoryview]:
        """The segments that lie in `row` after the header's room (views, no copy)."""
        data, start, size = row.data, self.header_bytes, self.segment_bytes
        return [data[start + i * size: start + (i + 1) * size] for i in range(self.num_layers)]

    def seal(self, row: npt.NDArray[np.uint8], key_digest: bytes) -> memoryview:
        """Hash the segments that lie in `row` after the header's room, write the header (and
        MAC) in front of them, and return the frame (a view of `row`, no copy)."""
        header_bytes, size, signer = self.header_bytes, self.segment_bytes, self.signer
        checksum = segment_checksum if signer is None else signed_segment_checksum
        infos = [SegmentInfo(header_bytes + i * size, size, size, Compression.NONE,
                             checksum(segment))
                 for i, segment in enumerate(self.segments(row))]
        body, finish = pack_header(self.codec, self.dtype, self.layout_id, self.token_count,
                                   self.layer_shape, key_digest, infos,
                                   None if signer is None else signer.key_id)
        header = finish(b"" if signer is None else signer.tag(body))
        row[:header_bytes] = np.frombuffer(header, np.uint8)
        return row.data[: self.frame_bytes]
