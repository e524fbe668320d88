"""The staged save: a step's gathered blocks into frames in a staging ring, then the store.

The saver gathers each layer of a step's blocks right after its attention ran (one gather per
layer for the whole batch, on the forward's stream). `save` then, per batch of as many blocks
as a slot holds:

1. on the copy lane (after the gathers' events): the batch's layers in frame order, quantized
   there for a lossy codec (`kernels.encode_rows`: one kernel sequence for every layer of the
   batch), into the slot's device rows, each row a frame with room for its header in front;
   one copy of the whole slot to its host buffer (page-locked on a GPU: a DMA);
2. on the pool, once that copy is done: each row's segments hashed where they lie, its header
   written in front (`FrameLayout.seal`: the row is the frame, no copy to assemble it), and
   the frame put into the store (which copies it into its first tier's pages);
3. the slot goes back to the ring once every put of its batch returned.

While the pool hashes and puts batch i, the copy lane encodes and ships batch i+1: with two
slots or more the link and the host threads work at once. Frames are exactly those
`encode_block` writes with `compression="none"` (tested), so staged saves need no reader
changes; compressed frames are not staged (the connector refuses the combination).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

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
from kvstore.codecs import Arrangement, get_codec
from kvstore.errors import KVKeepError
from kvstore.frame import CodecId
from kvstore.keys import BlockKey
from kvstore.store import TieredStore

__all__ = ["SavePipeline", "Report"]

Report = Callable[[int, bool], None]
"""Called once per block, from a pool thread, with its index in the batch and whether the
store took its frame."""


@dataclass(eq=False, slots=True)
class _Shipped:
    slot: Slot
    puts: list[Future[None]]


class SavePipeline:
    """One per worker; `save` is called from the saver's thread, one batch at a time."""

    def __init__(self, caches: PagedCaches, store: TieredStore, codec: CodecId,
                 config: StagingConfig | None = None) -> None:
        self._caches = caches
        self._store = store
        self._codec = get_codec(codec)
        self._config = config or StagingConfig()
        layout = caches.layout
        self._arrangement: Arrangement = layout.arrangement
        self.layout = FrameLayout(codec, caches.dtype, layout.layout_id, layout.block_size,
                                  caches.block_shape, caches.num_layers,
                                  self._codec.encoded_size(caches.block_shape, caches.dtype))
        device = caches.tensors[0].device
        self.ring = StagingRing(slots=self._config.slots,
                                slot_bytes=max(self._config.slot_bytes, self.layout.frame_bytes),
                                device=device, pinned=device.type == "cuda")
        self._copy = lane_for(device)
        self._pool = ThreadPoolExecutor(self._config.workers, thread_name_prefix="kvkeep-ship")
        self.times = StageTimes()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def save(self, keys: Sequence[BlockKey], layers: Sequence[torch.Tensor],
             ready: Sequence[Event], report: Report) -> None:
        """Frame and put block j (row j of every gathered layer, `[count, *block_shape]` on
        the caches' device) under `keys[j]`, after the gathers' `ready` events; `report(j, ok)`
        for each. Returns once every put returned. A batch that cannot be encoded (a lossy
        codec meeting inf or NaN) reports its blocks as not saved."""
        width = self.layout.frame_bytes
        per = self.ring.slot_bytes // width
        for event in ready:
            self._copy.wait(event)
        shipped: deque[_Shipped] = deque()
        try:
            for start in range(0, len(keys), per):
                rows = range(start, min(len(keys), start + per))
                slot = self.ring.try_acquire()
                while slot is None:  # a slot's puts are what frees it: wait for the oldest
                    if shipped:
                        self._land(shipped.popleft())
                        slot = self.ring.try_acquire()
                    else:  # another saver holds every slot (they return as its puts do)
                        slot = self.ring.acquire(_never)
                shipped.append(self._ship(slot, keys, layers, rows, report))
                while len(shipped) >= self.ring.capacity:
                    self._land(shipped.popleft())
        finally:
            while shipped:
                self._land(shipped.popleft())

    def _ship(self, slot: Slot, keys: Sequence[BlockKey], layers: Sequence[torch.Tensor],
              rows: range, report: Report) -> _Shipped:
        host, device = slot.rows(len(rows), self.layout.frame_bytes)
        try:
            with self._copy.activate():
                encode_rows(self._codec, layers, slice(rows.start, rows.stop),
                            self._arrangement, device[:, self.layout.header_bytes:])
                if not slot.shared:
                    host.copy_(device, non_blocking=True)
                copied = self._copy.record()
        except KVKeepError:  # (CodecError: inf or NaN in the batch)
            self.ring.release(slot, self._copy.record())
            for index in rows:
                report(index, False)
            return _Shipped(slot, [])
        except BaseException:
            self.ring.release(slot, self._copy.record())
            raise
        frames = host.numpy()
        puts = [self._pool.submit(self._seal_and_put, frames, copied, keys, rows.start,
                                  range(rows.start + part.start, rows.start + part.stop), report)
                for part in split(len(rows), self._config.workers)]
        return _Shipped(slot, puts)

    def _land(self, shipped: _Shipped) -> None:
        """Wait for a batch's puts, then give its slot back."""
        errors = [put.exception() for put in shipped.puts]
        if shipped.puts:
            self.ring.release(shipped.slot)
        for error in errors:
            if error is not None:
                raise error

    def _seal_and_put(self, frames: npt.NDArray[np.uint8], copied: Event,
                      keys: Sequence[BlockKey], first: int, rows: range, report: Report) -> None:
        started = time.perf_counter()
        copied.synchronize()
        waited = time.perf_counter()
        self.times.add("wait_copy", waited - started)
        for index in rows:
            key = keys[index]
            frame = self.layout.seal(frames[index - first], key.digest)
            try:
                ok = self._store.put(key, frame)
            except KVKeepError:
                ok = False
            report(index, ok)
        self.times.add("seal_and_put", time.perf_counter() - waited)


def _never() -> bool:
    return False
