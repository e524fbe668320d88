"""The background jobs of a store: what the write-behind engine is asked to do, one type each.

`seq` orders every job against deletes: a delete cancels the jobs of its keys queued before it
(a smaller `seq`), never one queued after.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.frame import FrameHeader
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionRecord

__all__ = ["BlockCopy", "Promotion", "ManifestCopy", "BlockJob", "Job"]


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Write-behind of a put: the block goes from the first tier down into `targets`.

    `frame` is None when the first tier admitted the block: the writer reads it back from there
    when its turn comes (no copy held in the queue). Otherwise it is an immutable copy.
    `computed_at` (`time.monotonic()`) is when the block's KV was computed, or the put was
    made: each target's acknowledgement is measured from it (`copy_lag_seconds`).
    """

    seq: int
    key: BlockKey
    targets: tuple[int, ...]
    header: FrameHeader
    computed_at: float
    frame: bytes | None = None

    @property
    def source(self) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class Promotion:
    """A hit in tier `source`: copy the whole block up into the tiers above it (`targets`).

    `held`: the frame as the get read it, kept when the source is across the network and the
    whole block was read (a copy is cheaper than reading the block over the network again);
    None: read back from the source when the job's turn comes."""

    seq: int
    key: BlockKey
    targets: tuple[int, ...]
    header: FrameHeader
    source: int
    held: bytes | None = None

    @property
    def frame(self) -> bytes | None:
        return self.held


@dataclass(frozen=True, slots=True)
class ManifestCopy:
    """A session's record (a KV manifest or a conversation record) written to the first tier,
    to be written to `targets` too."""

    seq: int
    key: SessionKey
    targets: tuple[int, ...]
    record: SessionRecord


BlockJob = BlockCopy | Promotion
Job = BlockCopy | Promotion | ManifestCopy
