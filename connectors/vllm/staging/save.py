"""The save pipeline: a batch of gathered blocks -> frames -> the store, one path for every
setting.

The saver gathers each layer of a step's blocks right after its attention ran (one gather per
layer for the whole batch) and hands the batch here. Two stages, each a strategy chosen once
from the config, so every combination of codec, compression, MAC signing, durability and
staging is the same code with a different part plugged in:

1. **framing** (`Framer`): the blocks' layers become frames, each bound to its key, signed
   with the tenant's MAC key when there is one, compressed per `compression`:
   - `HostFramer` (`save_path: "auto"`): one frame per block encoded on the saver's thread by
     `kvstore.block.encode_block` (the reference encoder; it waits for the gathers' events
     first);
   - `RingFramer` (`save_path: "staged"`): per batch of as many blocks as a staging slot
     holds, quantized on the caches' device in one kernel sequence (`kernels.encode_rows`)
     into the slot's rows, each row a frame with room for its header in front, and copied to
     the host in one copy; then, on a pool, each row is sealed where it lies
     (`FrameLayout.seal`: hashed, header and MAC written in front, no copy) or, with
     compression, its segments compressed and framed (`kvstore.block.compress_segments`,
     `build_frame`: compression copies anyway). While the pool seals and puts batch i, the
     copy lane encodes and ships batch i+1; a slot goes back once its puts returned.
2. **sink** (`FrameSink`): where the frames go:
   - `WriteBehind` (no `durability`): `TieredStore.put` per frame: the first tier now, the
     tiers below in the background;
   - `Replicated` (`durability`): one `TieredStore.put_replicated` per chunk, returning once R
     daemons acknowledged each frame or the batch's deadline passed.

Both framers write the bytes `encode_block` writes for the same layers and settings (tested),
so readers never know which one ran. `report(j, Saved)` is called once per block of the batch
(from the saver's thread or a pool thread): the saver turns it into counters and save reports.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from connectors.vllm.caches import PagedCaches
from connectors.vllm.staging.config import StagingConfig
from connectors.vllm.staging.frames import FrameLayout
from connectors.vllm.staging.kernels import encode_rows
from connectors.vllm.staging.ring import Slot, StagingRing, split
from connectors.vllm.staging.streams import Event, lane_for
from connectors.vllm.staging.timing import StageTimes
from kvstore.block import CompressionMode, compress_segments, encode_block
from kvstore.codecs import get_codec
from kvstore.errors import KVKeepError
from kvstore.frame import CodecId, FrameBytes, Signer, build_frame
from kvstore.keys import BlockKey
from kvstore.store import TieredStore

__all__ = ["HOST_CHUNK", "NOT_SAVED", "FrameSink", "Framer", "HostFramer", "Replicated",
           "Report", "RingFramer", "SaveBatch", "SavePipeline", "Saved", "WriteBehind"]

log = logging.getLogger(__name__)

# Frames a host framer encodes before handing them to a write-behind sink: puts start while
# later blocks encode, without holding a whole batch's frames.
HOST_CHUNK = 32

# How long past its durability deadline a batch's put may still count as durable (the put
# itself ends by the deadline; this covers encoding and a thread hop).
DURABLE_GRACE_S = 0.5


@dataclass(frozen=True, slots=True)
class Saved:
    """What became of one block: `stored` (a tier of this node took it; the tiers below
    follow behind) and `durable` (R daemons acknowledged it in time; never without
    `durability`)."""

    stored: bool
    durable: bool = False


NOT_SAVED = Saved(False)

Report = Callable[[int, Saved], None]
"""Called once per block with its index in the batch; from the saver's or a pool thread."""


@dataclass(frozen=True, slots=True)
class SaveBatch:
    """One batch: block j is row `rows[j]` of every gathered layer (`[count, *block_shape]` on
    the caches' device, complete once the `ready` events are), saved under `keys[j]`."""

    keys: Sequence[BlockKey]
    layers: Sequence[torch.Tensor]
    rows: Sequence[int]
    ready: Sequence[Event] = ()
    computed_at: float | None = None
    """`time.monotonic()` when the blocks' KV was complete (each tier's copy lag counts from
    it); None: now."""
    deadline: float = math.inf
    """With `durability`: when the step that waits for these blocks stops waiting."""


Emit = Callable[[Sequence[int], Sequence[FrameBytes | None]], None]
"""A framer hands frames on: batch indexes and their frames (None: could not be framed)."""


class FrameSink(Protocol):
    def put(self, batch: SaveBatch, items: Sequence[tuple[BlockKey, FrameBytes]]
            ) -> list[Saved]:
        """Store `items` (the frame buffers may be reused once this returns)."""
        ...


class Framer(Protocol):
    def frame(self, batch: SaveBatch, emit: Emit) -> None:
        """Frame every block of `batch` and `emit` them, in chunks; returns once every
        `emit` returned (no frame buffer is in use afterwards)."""
        ...

    def close(self) -> None: ...


# -- sinks ----------------------------------------------------------------------------------------


class WriteBehind:
    """`put` per frame: this node's first tier now, the tiers below behind it."""

    def __init__(self, store: TieredStore) -> None:
        self._store = store

    def put(self, batch: SaveBatch, items: Sequence[tuple[BlockKey, FrameBytes]]
            ) -> list[Saved]:
        saved: list[Saved] = []
        for key, frame in items:
            try:
                saved.append(Saved(self._store.put(key, frame, computed_at=batch.computed_at)))
            except KVKeepError:
                log.warning("kvkeep: saving a block failed", exc_info=True)
                saved.append(NOT_SAVED)
        return saved


class Replicated:
    """One replicated put per chunk: returns once `copies` daemons acknowledged each frame or
    the batch's deadline passed. A frame not acknowledged in time is still in this node's
    tiers and reaches the daemons behind, as without durability: stored, not durable."""

    def __init__(self, store: TieredStore, copies: int) -> None:
        self._store = store
        self._copies = copies

    def put(self, batch: SaveBatch, items: Sequence[tuple[BlockKey, FrameBytes]]
            ) -> list[Saved]:
        try:
            acked = self._store.put_replicated(items, copies=self._copies,
                                               deadline=batch.deadline,
                                               computed_at=batch.computed_at)
        except KVKeepError:
            log.warning("kvkeep: a durable save failed", exc_info=True)
            return [NOT_SAVED] * len(items)
        if time.monotonic() > batch.deadline + DURABLE_GRACE_S:
            acked = [False] * len(items)  # its step no longer waited for it
        return [Saved(True, ok) for ok in acked]


# -- framers --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FrameSettings:
    """What every frame of a worker carries besides its bytes."""

    codec: CodecId
    compression: CompressionMode
    signer: Signer | None


class HostFramer:
    """One frame per block, encoded on the calling thread by `encode_block`, handed to the
    sink `chunk_blocks` at a time (a replicated sink wants the whole batch in one put: one
    round trip to R daemons, as the durability deadline assumes)."""

    def __init__(self, caches: PagedCaches, settings: FrameSettings,
                 chunk_blocks: int = HOST_CHUNK) -> None:
        self._caches = caches
        self._settings = settings
        self._chunk = max(1, chunk_blocks)

    def close(self) -> None:
        pass

    def frame(self, batch: SaveBatch, emit: Emit) -> None:
        for event in batch.ready:
            event.synchronize()
        layout = self._caches.layout
        for start in range(0, len(batch.keys), self._chunk):
            indexes = range(start, min(len(batch.keys), start + self._chunk))
            frames: list[FrameBytes | None] = []
            for j in indexes:
                try:
                    frames.append(encode_block(
                        [layer[batch.rows[j]] for layer in batch.layers],
                        codec=self._settings.codec, key=batch.keys[j],
                        token_count=layout.block_size, layout_id=layout.layout_id,
                        compression=self._settings.compression,
                        arrangement=layout.arrangement, signer=self._settings.signer))
                except KVKeepError:  # (CodecError: inf or NaN under a lossy codec)
                    log.warning("kvkeep: encoding a block failed", exc_info=True)
                    frames.append(None)
            emit(indexes, frames)


@dataclass(eq=False, slots=True)
class _Shipped:
    slot: Slot
    tasks: list[Future[None]]


class RingFramer:
    """Batches quantized on the device into a staging slot's frame rows, one copy per batch,
    sealed (or compressed and framed) on a pool. One per worker; `frame` is called from the
    saver's thread, one batch at a time."""

    def __init__(self, caches: PagedCaches, settings: FrameSettings,
                 config: StagingConfig | None = None) -> None:
        self._caches = caches
        self._settings = settings
        self._codec = get_codec(settings.codec)
        self._config = config or StagingConfig()
        layout = caches.layout
        self._arrangement = layout.arrangement
        self.layout = FrameLayout(settings.codec, caches.dtype, layout.layout_id,
                                  layout.block_size, caches.block_shape, caches.num_layers,
                                  self._codec.encoded_size(caches.block_shape, caches.dtype),
                                  signer=settings.signer)
        device = caches.tensors[0].device
        self.ring = StagingRing(slots=self._config.slots,
                                slot_bytes=max(self._config.slot_bytes, self.layout.frame_bytes),
                                device=device, pinned=device.type == "cuda")
        self._copy = lane_for(device)
        self._pool = ThreadPoolExecutor(self._config.workers, thread_name_prefix="kvkeep-ship")
        self.times = StageTimes()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def frame(self, batch: SaveBatch, emit: Emit) -> None:
        per = self.ring.slot_bytes // self.layout.frame_bytes
        for event in batch.ready:
            self._copy.wait(event)
        shipped: deque[_Shipped] = deque()
        try:
            for start in range(0, len(batch.keys), per):
                indexes = range(start, min(len(batch.keys), start + per))
                slot = self.ring.try_acquire()
                while slot is None:  # a slot's puts are what frees it: wait for the oldest
                    if shipped:
                        self._land(shipped.popleft())
                        slot = self.ring.try_acquire()
                    else:  # another saver holds every slot (they return as its puts do)
                        slot = self.ring.acquire(_never)
                shipped.append(self._ship(slot, batch, indexes, emit))
                while len(shipped) >= self.ring.capacity:
                    self._land(shipped.popleft())
        finally:
            # Every slot goes back even if a batch failed: a lost slot would leave a later
            # save waiting for it forever.
            error: BaseException | None = None
            while shipped:
                try:
                    self._land(shipped.popleft())
                except BaseException as exc:
                    error = error or exc
            if error is not None:
                raise error

    def _ship(self, slot: Slot, batch: SaveBatch, indexes: range, emit: Emit) -> _Shipped:
        host, device = slot.rows(len(indexes), self.layout.frame_bytes)
        rows = [batch.rows[j] for j in indexes]
        try:
            with self._copy.activate():
                picked = torch.tensor(rows, device=batch.layers[0].device)
                encode_rows(self._codec, batch.layers, picked, self._arrangement,
                            device[:, self.layout.header_bytes:])
                if not slot.shared:
                    host.copy_(device, non_blocking=True)
                copied = self._copy.record()
        except KVKeepError:  # (CodecError: inf or NaN in the batch)
            log.warning("kvkeep: encoding a batch of %d blocks failed", len(indexes),
                        exc_info=True)
            self.ring.release(slot, self._copy.record())
            emit(indexes, [None] * len(indexes))
            return _Shipped(slot, [])
        except BaseException:
            self.ring.release(slot, self._copy.record())
            raise
        frames = host.numpy()
        tasks = [self._pool.submit(self._seal, frames, copied, batch, indexes.start,
                                   range(indexes.start + part.start, indexes.start + part.stop),
                                   emit)
                 for part in split(len(indexes), self._config.workers)]
        return _Shipped(slot, tasks)

    def _land(self, shipped: _Shipped) -> None:
        """Wait for a batch's seals and puts, then give its slot back (a batch that failed to
        encode gave it back already)."""
        errors = [task.exception() for task in shipped.tasks]
        if shipped.tasks:
            self.ring.release(shipped.slot)
        for error in errors:
            if error is not None:
                raise error

    def _seal(self, frames: npt.NDArray[np.uint8], copied: Event, batch: SaveBatch,
              first: int, indexes: range, emit: Emit) -> None:
        started = time.perf_counter()
        copied.synchronize()
        waited = time.perf_counter()
        self.times.add("wait_copy", waited - started)
        sealed: list[FrameBytes | None] = []
        for j in indexes:
            try:
                sealed.append(self._frame_row(frames[j - first], batch.keys[j]))
            except KVKeepError:
                log.warning("kvkeep: framing a block failed", exc_info=True)
                sealed.append(None)
        self.times.add("seal", time.perf_counter() - waited)
        emit(indexes, sealed)
        self.times.add("seal_and_put", time.perf_counter() - waited)

    def _frame_row(self, row: npt.NDArray[np.uint8], key: BlockKey) -> FrameBytes:
        compression = self._settings.compression
        if compression == "none":
            return self.layout.seal(row, key.digest)
        segments = self.layout.segments(row)
        settings = self._settings
        return build_frame(compress_segments(segments, compression), codec=settings.codec,
                           dtype=self.layout.dtype, layout_id=self.layout.layout_id,
                           token_count=self.layout.token_count,
                           layer_shape=self.layout.layer_shape, key_digest=key.digest,
                           signer=settings.signer)


def _never() -> bool:
    return False


# -- the pipeline ---------------------------------------------------------------------------------


class SavePipeline:
    """A framer and a sink; `save` runs a batch through both and reports each block once."""

    def __init__(self, framer: Framer, sink: FrameSink) -> None:
        self.framer = framer
        self.sink = sink

    def close(self) -> None:
        self.framer.close()

    def save(self, batch: SaveBatch, report: Report) -> None:
        """Frame and store every block of `batch`; returns once each was reported."""

        def emit(indexes: Sequence[int], frames: Sequence[FrameBytes | None]) -> None:
            framed = [(j, frame) for j, frame in zip(indexes, frames, strict=True)
                      if frame is not None]
            for j, frame in zip(indexes, frames, strict=True):
                if frame is None:
                    report(j, NOT_SAVED)
            if not framed:
                return
            results = self.sink.put(batch, [(batch.keys[j], frame) for j, frame in framed])
            for (j, _), saved in zip(framed, results, strict=True):
                report(j, saved)

        self.framer.frame(batch, emit)
