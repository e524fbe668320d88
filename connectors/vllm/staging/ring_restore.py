"""The staged restore's writer: batches of blocks through a ring of staging slots.

Per batch (a unit of the restore pipeline: as many blocks as one slot holds):

1. host copies, on the pool: each block's layer range into its row of the slot's host buffer
   (page-locked on a GPU); rows that come straight from page-locked pages skip this
   (`StagingConfig.direct_from_pinned`, raw only);
2. one copy of the batch to the device on the copy lane, while the pool hashes what was lent
   (per block, in parallel) and checks lossy segments' scales: a block read from the store
   was verified by its tier and is not hashed again;
3. finish, one batch behind: blocks that failed are failed on the job (vLLM recomputes them)
   and deleted; the rest are decoded and scattered on the compute lane, one kernel sequence
   per batch (`kernels.scatter_rows`), under the job's lock and only while it is on time, so
   nothing is written after a cancel. The slot goes back to the ring with the scatter's event.

So the host copies of batch i+1, the link's copy of batch i and the hashing of batch i run at
once (and the pipeline fetches batch i+2), and each layer of a stage is done (its
`layer_done`, and on a GPU the event the forward's stream waits for) once the stage's last
batch is scattered.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from connectors.vllm.caches import PagedCaches
from connectors.vllm.staging.config import StagingConfig
from connectors.vllm.staging.jobs import Located, RestoreJob, all_results
from connectors.vllm.staging.kernels import scatter_rows
from connectors.vllm.staging.restore import WriteRun
from connectors.vllm.staging.ring import Slot, StagingRing, split
from connectors.vllm.staging.streams import Event, lane_for
from connectors.vllm.staging.timing import StageTimes
from connectors.vllm.stats import Count
from kvstore import frame
from kvstore.codecs import get_codec
from kvstore.errors import CorruptBlock
from kvstore.frame import CodecId, LayerRange
from kvstore.store import TieredStore
from kvstore.tiers.capabilities import BorrowedBlock

__all__ = ["RingWriter", "pinned"]

# Page-locked pages are lent read-only; a device copy only reads them, but torch warns when it
# wraps a read-only buffer. Silenced for this module's calls only.
warnings.filterwarnings("ignore", message=r"The given buffer is not writable",
                        category=UserWarning, module=r"connectors\.vllm\.staging\.ring_restore")

_Bytes = npt.NDArray[np.uint8]


@dataclass(eq=False, slots=True)
class _InFlight:
    """A staged batch waiting to be finished."""

    layers: LayerRange
    last_of_stage: bool
    slot: Slot | None = None
    entries: list[Located] = field(default_factory=list)
    failures: list[tuple[int, Count]] = field(default_factory=list)
    checks: list[Future[list[tuple[int, Count]]]] = field(default_factory=list)
    copied: Event | None = None


class RingWriter:
    """One per worker (both loader threads share it: its ring and pool are thread-safe)."""

    borrows = True

    def __init__(self, caches: PagedCaches, store: TieredStore, codec: CodecId,
                 config: StagingConfig | None = None) -> None:
        self._caches = caches
        self._store = store
        self._codec = get_codec(codec)
        self.config = config or StagingConfig()
        device = caches.tensors[0].device
        self.cuda = device.type == "cuda"
        self.segment = self._codec.encoded_size(caches.block_shape, caches.dtype)
        self.ring = StagingRing(slots=self.config.slots,
                                slot_bytes=max(self.config.slot_bytes,
                                               self.segment * caches.num_layers),
                                device=device, pinned=self.cuda)
        self.copy_lane = lane_for(device)
        self.compute_lane = lane_for(device)
        self.pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix="kvkeep-stage")
        self.times = StageTimes()

    def unit_blocks(self, layers: LayerRange) -> int:
        return self.ring.slot_bytes // (len(layers) * self.segment)

    def start(self, job: RestoreJob) -> WriteRun:
        return _RingRun(self, job)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    # -- host work (pool threads) ---------------------------------------------------------------

    def copy_rows(self, host: _Bytes, batch: _InFlight, rows: range) -> list[tuple[int, Count]]:
        """Each row's layer range into `host`; a segment that does not decompress to its size
        fails its block."""
        size, layers, failed = self.segment, batch.layers, []
        for row in rows:
            entry = batch.entries[row]
            destination = host[row]
            try:
                if entry.direct:
                    continue
                if entry.borrowed is not None:
                    position = 0
                    for piece in entry.borrowed.pieces:
                        np.copyto(destination[position: position + len(piece)],
                                  np.frombuffer(piece, np.uint8))
                        position += len(piece)
                elif entry.read is not None:
                    for i, layer in enumerate(range(layers.start, layers.stop)):
                        segment = entry.read.segment(layer)
                        if len(segment) != size:
                            raise CorruptBlock(f"segment {layer} is {len(segment)} bytes")
                        np.copyto(destination[i * size: (i + 1) * size],
                                  np.frombuffer(segment, np.uint8))
            except CorruptBlock:
                failed.append((row, Count.LOAD_CORRUPT))
        return failed

    def check_rows(self, host: _Bytes, batch: _InFlight, rows: range) -> list[tuple[int, Count]]:
        """Verify what nobody verified yet (lent pages, unless trusted) and refuse segments
        no writer of ours stores (a lossy codec's scales), before anything is scattered."""
        started = time.perf_counter()
        size, layers, failed = self.segment, batch.layers, []
        trusted = self.config.trust_host_pages
        shape, dtype = self._caches.block_shape, self._caches.dtype
        for row in rows:
            entry = batch.entries[row]
            destination = host[row]
            try:
                if entry.read is not None:
                    entry.read.verify()  # a no-op for the store's reads: verified by their tier
                elif entry.borrowed is not None and not trusted:
                    checksum = frame.checksum_of(entry.header)  # BLAKE3 in a signed frame
                    if entry.direct:
                        frame.verify_pieces(entry.header, layers, entry.borrowed.pieces)
                    else:
                        for i, layer in enumerate(range(layers.start, layers.stop)):
                            data = destination[i * size: (i + 1) * size].data
                            want = entry.header.segments[layer].checksum
                            if checksum(data) != want:
                                raise CorruptBlock(f"segment {layer} checksum mismatch")
                if not entry.direct and self._codec.codec_id is not CodecId.RAW:
                    for i in range(len(layers)):
                        if not self._codec.segment_valid(destination[i * size: (i + 1) * size],
                                                         shape, dtype):
                            raise CorruptBlock("segment refused by its codec")
            except CorruptBlock:
                failed.append((row, Count.LOAD_CORRUPT))
        self.times.add("verify", time.perf_counter() - started)
        return failed

    def scatter(self, staged: torch.Tensor, layers: LayerRange, targets: torch.Tensor) -> None:
        scatter_rows(self._caches, self._codec, staged, layers, targets)

    def delete(self, entry: Located) -> None:
        self._store.delete([entry.block.key], reject=True)  # this copy (L2): unrestorable

    def direct(self, entry: Located) -> bool:
        """Whether a lent raw block goes to the device with one DMA per page run."""
        return (self.config.direct_from_pinned and self.cuda and entry.borrowed is not None
                and self._codec.codec_id is CodecId.RAW and pinned(entry.borrowed))


class _RingRun:
    """One job through the ring: batches staged, finished one behind."""

    def __init__(self, writer: RingWriter, job: RestoreJob) -> None:
        self._writer = writer
        self._job = job
        self._pending: deque[_InFlight] = deque()
        self._last_scatter: Event | None = None

    def write(self, layers: LayerRange, entries: list[Located], last: bool) -> bool:
        if not self._stage(layers, entries, last):
            return False
        while len(self._pending) > 1:
            if not self._finish_oldest():
                return False
        return True

    def finish(self) -> bool:
        while self._pending:
            if not self._finish_oldest():
                return False
        return True

    def abandon(self) -> None:
        for batch in self._pending:
            for check in batch.checks:
                with contextlib.suppress(Exception):  # the job failed already: only clean up
                    check.result()
            self._retire(batch, None)
        self._pending.clear()

    def _stage(self, layers: LayerRange, entries: list[Located], last: bool) -> bool:
        """Copy a batch into a slot and ship it; queue it to be finished. False once the job
        is cancelled or late."""
        writer, job = self._writer, self._job
        batch = _InFlight(layers, last)
        self._pending.append(batch)
        for entry in entries:
            if entry.block.block_id in job.failed:
                entry.release()
            else:
                entry.direct = writer.direct(entry)
                batch.entries.append(entry)
        if not batch.entries:
            return True
        ring = writer.ring
        slot = ring.try_acquire()
        while slot is None:  # never wait for a slot while holding one: finish it instead
            if len(self._pending) > 1:
                if not self._finish_oldest():
                    return False
                slot = ring.try_acquire()
            else:
                slot = ring.acquire(lambda: job.cancelled or time.monotonic() > job.deadline)
        batch.slot = slot
        width = len(layers) * writer.segment
        host, device = slot.rows(len(batch.entries), width)
        host_rows = host.numpy()
        parts = split(len(batch.entries), writer.config.workers)
        started = time.perf_counter()
        copies = [writer.pool.submit(writer.copy_rows, host_rows, batch, rows) for rows in parts]
        for failures in all_results(copies):  # all done before the slot could be given back
            batch.failures.extend(failures)
        writer.times.add("host_copy", time.perf_counter() - started)
        with writer.copy_lane.activate():
            if not slot.shared and any(not entry.direct for entry in batch.entries):
                device.copy_(host, non_blocking=True)
            for row, entry in enumerate(batch.entries):
                if entry.direct and entry.borrowed is not None:
                    position = 0
                    for piece in entry.borrowed.pieces:
                        source = torch.frombuffer(piece, dtype=torch.uint8)
                        device[row, position: position + len(piece)].copy_(source,
                                                                           non_blocking=True)
                        position += len(piece)
            batch.copied = writer.copy_lane.record()
        batch.checks = [writer.pool.submit(writer.check_rows, host_rows, batch, rows)
                        for rows in parts]
        return True

    def _finish_oldest(self) -> bool:
        batch = self._pending[0]
        ok = self._finish(batch)  # if it raises, the batch stays for the abandon
        self._pending.popleft()
        return ok

    def _finish(self, batch: _InFlight) -> bool:
        """Fail what did not verify, scatter the rest; False once the job is cancelled or
        late (then nothing of this batch is written)."""
        writer, job = self._writer, self._job
        started = time.perf_counter()
        failures = list(batch.failures)
        for checked in all_results(batch.checks):
            failures.extend(checked)
        writer.times.add("wait_checks", time.perf_counter() - started)
        bad = dict(failures)
        for row, reason in bad.items():
            job.fail(batch.entries[row].block.block_id, reason)
            writer.delete(batch.entries[row])
        good = [row for row, entry in enumerate(batch.entries)
                if row not in bad and entry.block.block_id not in job.failed]
        with job.lock:
            if not job.still_on_time():
                self._retire(batch, None)
                return False
            if good and batch.slot is not None and batch.copied is not None:
                _, device = batch.slot.rows(len(batch.entries),
                                            len(batch.layers) * writer.segment)
                with writer.compute_lane.activate():
                    writer.compute_lane.wait(batch.copied)
                    if len(good) != len(batch.entries):
                        device = device.index_select(0, torch.tensor(good, device=device.device))
                    targets = torch.tensor([batch.entries[row].block.block_id for row in good],
                                           device=device.device)
                    writer.scatter(device, batch.layers, targets)
                    self._last_scatter = writer.compute_lane.record()
            if batch.last_of_stage:
                event = self._last_scatter
                for layer in range(batch.layers.start, batch.layers.stop):
                    job.device_done[layer] = (event if isinstance(event, torch.cuda.Event)
                                              else None)
        self._retire(batch, self._last_scatter)
        if batch.last_of_stage:
            for layer in range(batch.layers.start, batch.layers.stop):
                job.layer_done[layer].set()
        return True

    def _retire(self, batch: _InFlight, after: Event | None) -> None:
        """Give back what the batch holds: lent pages once the link has read them, the slot
        once `after` (its scatter) is done."""
        if any(entry.direct for entry in batch.entries) and batch.copied is not None:
            batch.copied.synchronize()
        for entry in batch.entries:
            entry.release()
        if batch.slot is not None:
            self._writer.ring.release(batch.slot, after if after is not None else batch.copied)
            batch.slot = None


def pinned(block: BorrowedBlock) -> bool:
    """Whether a lent block's pages are page-locked (a DMA can read them in place)."""
    return bool(block.pieces) and bool(torch.frombuffer(block.pieces[0],
                                                        dtype=torch.uint8).is_pinned())
