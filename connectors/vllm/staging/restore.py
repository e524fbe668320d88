"""The staged restore: blocks from the store into the paged KV cache through a staging ring.

Per batch (as many blocks as one slot holds; per layer stage of the loader):

1. fetch: each block is borrowed from the first tier where it can lend (its pages, pinned in
   place, no copy) or read from the tiers below (verified by them); frames another engine
   wrote fail as mismatched. The next batch is fetched while this one is staged.
2. host copies, on the pool: each block's layer range into its row of the slot's host buffer
   (page-locked on a GPU); rows that come straight from page-locked pages skip this
   (`StagingConfig.direct_from_pinned`, raw only).
3. one copy of the batch to the device on the copy lane, while the pool hashes what was lent
   (per block, in parallel) and checks lossy segments' scales: a block read from the tiers
   below was verified by them and is not hashed again.
4. finish, one batch behind: blocks that failed are failed on the job (vLLM recomputes them)
   and deleted; the rest are decoded and scattered on the compute lane, one kernel sequence
   per batch (`kernels.scatter_rows`), under the job's lock and only while it is on time, so
   nothing is written after a cancel. The slot goes back to the ring with the scatter's event.

So the host copies of batch i+1, the link's copy of batch i and the hashing of batch i run at
once, and each layer of a stage is done (its `layer_done`, and on a GPU the event the
forward's stream waits for) once the stage's last batch is scattered.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from connectors.vllm.caches import PagedCaches
from connectors.vllm.staging.config import StagingConfig
from connectors.vllm.staging.in_place import InPlaceWriter
from connectors.vllm.staging.jobs import (
    Located,
    ReadLower,
    Refusal,
    RestoreBlock,
    RestoreJob,
    all_results,
)
from connectors.vllm.staging.kernels import scatter_rows
from connectors.vllm.staging.ring import Cancelled, Slot, StagingRing, split
from connectors.vllm.staging.streams import Event, lane_for
from connectors.vllm.staging.timing import StageTimes
from connectors.vllm.stats import Count
from kvstore import frame
from kvstore.codecs import get_codec
from kvstore.errors import CorruptBlock
from kvstore.frame import CodecId, LayerRange
from kvstore.store import TieredStore
from kvstore.tiers.capabilities import BorrowedBlock

__all__ = ["RestoreBlock", "RestoreJob", "RestorePipeline", "ReadLower", "Refusal"]

# Page-locked pages are lent read-only; a device copy only reads them, but torch warns when it
# wraps a read-only buffer. Silenced for this module's calls only.
warnings.filterwarnings("ignore", message=r"The given buffer is not writable",
                        category=UserWarning, module=r"connectors\.vllm\.staging\.restore")

_Bytes = npt.NDArray[np.uint8]

log = logging.getLogger(__name__)


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


@dataclass(eq=False, slots=True)
class _Run:
    job: RestoreJob
    pending: deque[_InFlight] = field(default_factory=deque)
    last_scatter: Event | None = None


class RestorePipeline:
    """One per worker (both loader threads share it: its ring and pool are thread-safe)."""

    def __init__(self, caches: PagedCaches, store: TieredStore, codec: CodecId,
                 config: StagingConfig | None = None) -> None:
        self._caches = caches
        self._store = store
        self._codec = get_codec(codec)
        self._config = config or StagingConfig()
        device = caches.tensors[0].device
        self._cuda = device.type == "cuda"
        # Host caches whose blocks hold a raw frame's layers verbatim (vLLM's CPU backend): a
        # block's bytes go from where they lie straight into its paged block, with no slot.
        verbatim = (not self._cuda and self._codec.codec_id is CodecId.RAW
                    and all(blocks is not None for blocks in caches.host_blocks))
        self._segment = self._codec.encoded_size(caches.block_shape, caches.dtype)
        full = self._segment * caches.num_layers
        self.ring = StagingRing(slots=self._config.slots,
                                slot_bytes=max(self._config.slot_bytes, full), device=device,
                                pinned=self._cuda)
        self._copy = lane_for(device)
        self._compute = lane_for(device)
        self._pool = ThreadPoolExecutor(self._config.workers, thread_name_prefix="kvkeep-stage")
        self._fetcher = ThreadPoolExecutor(2, thread_name_prefix="kvkeep-stage-fetch")
        self.times = StageTimes()
        self._in_place = (InPlaceWriter(caches, store, self._pool, self._config, self._segment,
                                        self.times) if verbatim else None)

    def close(self) -> None:
        self._fetcher.shutdown(wait=True)
        self._pool.shutdown(wait=True)

    def load(self, job: RestoreJob, stages: Sequence[LayerRange], read_lower: ReadLower,
             refusal: Refusal) -> None:
        """Restore `stages` of every block of `job`, in order; blocks that cannot be are failed
        on the job with their reason. Returns early (writing nothing more) once the job is
        cancelled or late."""
        run = _Run(job)
        units = self._units(job, stages)
        unit = next(units, None)
        fetched = None if unit is None else self._fetcher.submit(
            self._fetch, job, unit[0], unit[1], read_lower, refusal)
        try:
            while unit is not None and fetched is not None:
                layers, _, last = unit
                entries = fetched.result()
                fetched = None
                unit = next(units, None)
                if unit is not None:
                    fetched = self._fetcher.submit(self._fetch, job, unit[0], unit[1],
                                                   read_lower, refusal)
                if self._in_place is not None:
                    if not self._in_place.write(job, layers, entries, last):
                        return
                elif not self._stage(run, layers, entries, last):
                    return
                while len(run.pending) > 1:
                    if not self._finish_oldest(run):
                        return
            while run.pending:
                if not self._finish_oldest(run):
                    return
        except Cancelled:
            with job.lock:
                job.still_on_time()  # marks the job late, if it is not cancelled already
        finally:
            for batch in run.pending:
                self._abandon(batch)
            if fetched is not None:
                fetched.add_done_callback(_release_fetched)

    # -- batches --------------------------------------------------------------------------------

    def _units(self, job: RestoreJob, stages: Sequence[LayerRange]
               ) -> Iterator[tuple[LayerRange, list[RestoreBlock], bool]]:
        """(layers, blocks, last of its stage) per batch; a stage's blocks are those that have
        not failed by the time it starts (an empty stage is one empty batch)."""
        for layers in stages:
            blocks = [b for b in job.blocks if b.block_id not in job.failed]
            per = self.ring.slot_bytes // (len(layers) * self._segment)
            chunks = [blocks[i: i + per] for i in range(0, len(blocks), per)] or [[]]
            for number, chunk in enumerate(chunks):
                yield layers, chunk, number == len(chunks) - 1

    def _stage(self, run: _Run, layers: LayerRange, entries: list[Located], last: bool) -> bool:
        """Copy a batch into a slot and ship it; queue it to be finished. False once the job
        is cancelled or late."""
        job = run.job
        batch = _InFlight(layers, last)
        run.pending.append(batch)
        for entry in entries:
            if entry.block.block_id in job.failed:
                entry.release()
            else:
                batch.entries.append(entry)
        if not batch.entries:
            return True
        slot = self.ring.try_acquire()
        while slot is None:  # never wait for a slot while holding one: finish it instead
            if len(run.pending) > 1:
                if not self._finish_oldest(run):
                    return False
                slot = self.ring.try_acquire()
            else:
                slot = self.ring.acquire(lambda: job.cancelled or time.monotonic() > job.deadline)
        batch.slot = slot
        width = len(layers) * self._segment
        host, device = slot.rows(len(batch.entries), width)
        host_rows = host.numpy()
        parts = split(len(batch.entries), self._config.workers)
        started = time.perf_counter()
        copies = [self._pool.submit(self._copy_rows, host_rows, batch, rows) for rows in parts]
        for failures in all_results(copies):  # all done before the slot could be given back
            batch.failures.extend(failures)
        self.times.add("host_copy", time.perf_counter() - started)
        with self._copy.activate():
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
            batch.copied = self._copy.record()
        batch.checks = [self._pool.submit(self._check_rows, host_rows, batch, rows)
                        for rows in parts]
        return True

    def _finish_oldest(self, run: _Run) -> bool:
        batch = run.pending[0]
        ok = self._finish(run, batch)  # if it raises, the batch stays for load's clean-up
        run.pending.popleft()
        return ok

    def _finish(self, run: _Run, batch: _InFlight) -> bool:
        """Fail what did not verify, scatter the rest; False once the job is cancelled or
        late (then nothing of this batch is written)."""
        job = run.job
        started = time.perf_counter()
        failures = list(batch.failures)
        for checked in all_results(batch.checks):
            failures.extend(checked)
        self.times.add("wait_checks", time.perf_counter() - started)
        bad = dict(failures)
        for row, reason in bad.items():
            block = batch.entries[row].block
            job.fail(block.block_id, reason)
            self._store.delete([block.key], reject=True)  # this copy (L2): unrestorable
        good = [row for row, entry in enumerate(batch.entries)
                if row not in bad and entry.block.block_id not in job.failed]
        with job.lock:
            if not job.still_on_time():
                self._retire(batch, None)
                return False
            if good and batch.slot is not None and batch.copied is not None:
                _, device = batch.slot.rows(len(batch.entries), len(batch.layers) * self._segment)
                with self._compute.activate():
                    self._compute.wait(batch.copied)
                    if len(good) != len(batch.entries):
                        device = device.index_select(0, torch.tensor(good, device=device.device))
                    targets = torch.tensor([batch.entries[row].block.block_id for row in good],
                                           device=device.device)
                    scatter_rows(self._caches, self._codec, device, batch.layers, targets)
                    run.last_scatter = self._compute.record()
            if batch.last_of_stage:
                event = run.last_scatter
                for layer in range(batch.layers.start, batch.layers.stop):
                    job.device_done[layer] = (event if isinstance(event, torch.cuda.Event)
                                              else None)
        self._retire(batch, run.last_scatter)
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
            self.ring.release(batch.slot, after if after is not None else batch.copied)
            batch.slot = None

    def _abandon(self, batch: _InFlight) -> None:
        for check in batch.checks:
            with contextlib.suppress(Exception):  # the job failed already: only clean up
                check.result()
        self._retire(batch, None)

    # -- host work (pool threads) ---------------------------------------------------------------

    def _copy_rows(self, host: _Bytes, batch: _InFlight, rows: range
                   ) -> list[tuple[int, Count]]:
        """Each row's layer range into `host`; a segment that does not decompress to its size
        fails its block."""
        size, layers, failed = self._segment, batch.layers, []
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

    def _check_rows(self, host: _Bytes, batch: _InFlight, rows: range
                    ) -> list[tuple[int, Count]]:
        """Verify what nobody verified yet (lent pages, unless trusted) and refuse segments
        no writer of ours stores (a lossy codec's scales), before anything is scattered."""
        started = time.perf_counter()
        size, layers, failed = self._segment, batch.layers, []
        trusted = self._config.trust_host_pages
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

    # -- fetching (fetch thread) ----------------------------------------------------------------

    def _fetch(self, job: RestoreJob, layers: LayerRange, blocks: Sequence[RestoreBlock],
               read_lower: ReadLower, refusal: Refusal) -> list[Located]:
        """Where each block's bytes are: lent by the first tier, else read from below."""
        if job.cancelled or not blocks:
            return []
        started = time.perf_counter()
        width = len(layers) * self._segment
        entries: list[Located] = []
        lower: list[RestoreBlock] = []
        try:
            for block in blocks:
                lent = self._store.borrow(block.key, layers, verify=False)
                if lent is None:
                    lower.append(block)
                    continue
                refused = refusal(lent.header)
                if refused is not None or lent.size != width:
                    lent.release()
                    if refused is None:  # compressed segments: read (and decompress) below
                        lower.append(block)
                    else:
                        self._refused(job, block, refused)
                    continue
                direct = (self._config.direct_from_pinned and self._cuda
                          and self._codec.codec_id is CodecId.RAW and _pinned(lent))
                entries.append(Located(block, lent.header, borrowed=lent, direct=direct))
            if lower:
                reads = read_lower(job, layers, lower)
                for block, read in zip(lower, reads, strict=True):
                    if read is None:
                        job.fail(block.block_id, Count.LOAD_LATE if time.monotonic()
                                 >= job.deadline else Count.LOAD_MISSING)
                    elif (refused := refusal(read.header)) is not None:
                        self._refused(job, block, refused)
                    else:
                        entries.append(Located(block, read.header, read=read))
        except BaseException:
            for entry in entries:
                entry.release()
            raise
        self.times.add("fetch", time.perf_counter() - started)
        return entries

    def _refused(self, job: RestoreJob, block: RestoreBlock,
                 refused: tuple[Count, str]) -> None:
        reason, why = refused
        log.warning("kvkeep: frame for %s refused: %s", block.key.storage_name, why)
        job.fail(block.block_id, reason)
        self._store.delete([block.key], reject=True)  # this copy (L2): unusable here


def _pinned(block: BorrowedBlock) -> bool:
    """Whether a lent block's pages are page-locked (a DMA can read them in place)."""
    return bool(block.pieces) and bool(torch.frombuffer(block.pieces[0],
                                                        dtype=torch.uint8).is_pinned())


def _release_fetched(fetched: Future[list[Located]]) -> None:
    """A batch fetched for a load that ended first: give back what it borrowed."""
    if fetched.cancelled() or fetched.exception() is not None:
        return
    for entry in fetched.result():
        entry.release()
