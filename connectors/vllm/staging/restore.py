"""The restore pipeline: blocks from the store into the paged KV cache, one path for every
setting.

A load job's blocks are restored in *units*: a layer range of the loader (all layers, or the
first k and then the rest, so the forward pass computes early layers while later ones arrive)
of as many blocks as the writer takes at once. Two stages, the second a strategy chosen once
from the config and the caches (`writer_for`):

1. **fetch** (`RestorePipeline._fetch`, on a fetch thread, one unit ahead of the writer): each
   block is borrowed from the first tier where the writer takes lent pages (pinned in place,
   no copy) or read from the store (verified by its tier, decompressed, under the job's
   deadline, by the loader's concurrent reads); a frame whose header is refused (not the
   tenant's MAC: forged; not what this engine writes: mismatched) fails its block and that
   copy is deleted. A block missing or late fails too.
2. **write** (`Writer`): the unit's layers into the paged blocks, each block verified before
   a byte of it is written, under the job's lock and only while the job is on time (nothing
   is written after a cancel: from then on vLLM may recompute or reuse the block):
   - `DecodeWriter` (`restore_path` "auto", "device_decode"): per layer, decoded on the host
     (straight into host caches that hold frames verbatim; else into a staging tensor,
     copied over and scattered) or on the cache's device;
   - `RingWriter` (`restore_path` "staged"): batches through a ring of (page-locked) slots,
     one copy and one scatter per layer per batch, hashing beside the copy
     (`connectors.vllm.staging.ring_restore`);
   - `InPlaceWriter` (`restore_path` "staged", raw frames into verbatim host caches): each
     block hashed where the host tier lends it and copied once, straight into its paged block
     (`connectors.vllm.staging.in_place`).

Every codec, compression and MAC setting works with every writer: compressed or lower-tier
frames are read (decompressed), signed ones checked at fetch. A block that fails is failed on
the job with its reason (a `Count`): vLLM recomputes it and every later block of its request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from connectors.vllm.caches import PagedCaches
from connectors.vllm.config import RestorePath
from connectors.vllm.staging.config import StagingConfig
from connectors.vllm.staging.jobs import Located, ReadLower, Refusal, RestoreBlock, RestoreJob
from connectors.vllm.staging.ring import Cancelled
from connectors.vllm.staging.timing import StageTimes
from connectors.vllm.stats import Count
from kvstore.codecs import get_codec
from kvstore.frame import CodecId, LayerRange
from kvstore.store import TieredStore
from kvstore.tiers.capabilities import BorrowedBlock

__all__ = ["RestorePipeline", "WriteRun", "Writer", "writer_for"]

log = logging.getLogger(__name__)

class WriteRun(Protocol):
    """One job's pass through a writer (a writer may keep batches in flight across units)."""

    def write(self, layers: LayerRange, entries: list[Located], last: bool) -> bool:
        """Write a unit (`last`: the last of its layer range, after which those layers are
        done); takes ownership of `entries` (it releases what they borrowed). False once the
        job is cancelled or late: nothing more may be written."""
        ...

    def finish(self) -> bool:
        """Write what is still in flight; False once the job is cancelled or late."""
        ...

    def abandon(self) -> None:
        """The job ended early: give back what is in flight, writing nothing more."""
        ...


class Writer(Protocol):
    borrows: bool
    """Whether it takes blocks lent in place by the first tier (else every block is read)."""
    times: StageTimes

    def unit_blocks(self, layers: LayerRange) -> int:
        """How many blocks of a layer range it writes per unit."""
        ...

    def start(self, job: RestoreJob) -> WriteRun: ...

    def close(self) -> None: ...


def writer_for(caches: PagedCaches, store: TieredStore, codec: CodecId, path: RestorePath,
               staging: StagingConfig | None = None) -> Writer:
    """The writer `restore_path` names for these caches."""
    # Imported here: each writer module imports this one's protocols.
    from connectors.vllm.staging.decode import DecodeWriter
    from connectors.vllm.staging.in_place import InPlaceWriter
    from connectors.vllm.staging.ring_restore import RingWriter

    config = staging or StagingConfig()
    if path != "staged":
        return DecodeWriter(caches, store, on_device=path == "device_decode")
    on_host = caches.tensors[0].device.type != "cuda"
    verbatim = (on_host and get_codec(codec).codec_id is CodecId.RAW
                and all(blocks is not None for blocks in caches.host_blocks))
    if verbatim:
        return InPlaceWriter(caches, store, codec, config)
    return RingWriter(caches, store, codec, config)


class RestorePipeline:
    """Fetch, then write, unit by unit. One per worker: both loader threads share it (the
    writer's ring and pools are thread-safe)."""

    def __init__(self, store: TieredStore, writer: Writer, *, read: ReadLower,
                 refusal: Refusal) -> None:
        self._store = store
        self.writer = writer
        self._read = read
        self._refusal = refusal
        # One fetch in flight per loader thread (a step's loads and an asynchronous one).
        self._fetcher = ThreadPoolExecutor(2, thread_name_prefix="kvkeep-fetch")

    @property
    def times(self) -> StageTimes:
        return self.writer.times

    def close(self) -> None:
        self._fetcher.shutdown(wait=True)
        self.writer.close()

    def load(self, job: RestoreJob, stages: Sequence[LayerRange]) -> None:
        """Restore `stages` of every block of `job`, in order; blocks that cannot be are failed
        on the job with their reason. Returns early (writing nothing more) once the job is
        cancelled or late."""
        run = self.writer.start(job)
        units = self._units(job, stages)
        unit = next(units, None)
        fetched = None if unit is None else self._fetcher.submit(self._fetch, job, *unit[:2])
        finished = False
        try:
            while unit is not None and fetched is not None:
                layers, _, last = unit
                entries = fetched.result()
                fetched = None
                unit = next(units, None)
                if unit is not None:
                    fetched = self._fetcher.submit(self._fetch, job, *unit[:2])
                if not run.write(layers, entries, last):
                    return
            finished = run.finish()
        except Cancelled:
            with job.lock:
                job.still_on_time()  # marks the job late, if it is not cancelled already
        finally:
            if not finished:
                run.abandon()
            if fetched is not None:
                fetched.add_done_callback(_release_fetched)

    def _units(self, job: RestoreJob, stages: Sequence[LayerRange]
               ) -> Iterator[tuple[LayerRange, list[RestoreBlock], bool]]:
        """(layers, blocks, last of its stage) per unit; a stage's blocks are those that have
        not failed by the time it starts (an empty stage is one empty unit)."""
        for layers in stages:
            blocks = [b for b in job.blocks if b.block_id not in job.failed]
            per = max(1, self.writer.unit_blocks(layers))
            chunks = [blocks[i: i + per] for i in range(0, len(blocks), per)] or [[]]
            for number, chunk in enumerate(chunks):
                yield layers, chunk, number == len(chunks) - 1

    def _fetch(self, job: RestoreJob, layers: LayerRange, blocks: Sequence[RestoreBlock]
               ) -> list[Located]:
        """Where each block's bytes are: lent by the first tier (writers that take lent
        pages), else read from the store."""
        if job.cancelled or not blocks:
            return []
        started = time.perf_counter()
        entries: list[Located] = []
        reads: list[RestoreBlock] = []
        try:
            for block in blocks:
                lent = self._store.borrow(block.key, layers, verify=False) \
                    if self.writer.borrows else None
                if lent is None:
                    reads.append(block)
                    continue
                refused = self._refusal(lent.header)
                if refused is not None or lent.size != _stored_width(lent, layers):
                    lent.release()
                    if refused is None:  # compressed segments: read (and decompress)
                        reads.append(block)
                    else:
                        self._refused(job, block, refused)
                    continue
                entries.append(Located(block, lent.header, borrowed=lent))
            if reads:
                for block, read in zip(reads, self._read(job, layers, reads), strict=True):
                    if read is None:
                        job.fail(block.block_id, Count.LOAD_LATE if time.monotonic()
                                 >= job.deadline else Count.LOAD_MISSING)
                    elif (refused := self._refusal(read.header)) is not None:
                        self._refused(job, block, refused)
                    else:
                        entries.append(Located(block, read.header, read=read))
        except BaseException:
            for entry in entries:
                entry.release()
            raise
        self.writer.times.add("fetch", time.perf_counter() - started)
        return entries

    def _refused(self, job: RestoreJob, block: RestoreBlock,
                 refused: tuple[Count, str]) -> None:
        reason, why = refused
        log.warning("kvkeep: frame for %s refused: %s", block.key.storage_name, why)
        job.fail(block.block_id, reason)
        self._store.delete([block.key], reject=True)  # this copy (L2): unusable here


def _stored_width(lent: BorrowedBlock, layers: LayerRange) -> int:
    """What a lent layer range weighs when its segments are stored uncompressed."""
    return sum(lent.header.segments[layer].raw_length for layer in range(layers.start,
                                                                          layers.stop))


def _release_fetched(fetched: Future[list[Located]]) -> None:
    """A unit fetched for a load that ended first: give back what it borrowed."""
    if fetched.cancelled() or fetched.exception() is not None:
        return
    for entry in fetched.result():
        entry.release()

