"""Restores: blocks from the store into vLLM's paged KV cache, verified, layer by layer.

`start` hands a step's synchronous loads to the loader thread as one `LoadJob` (they share the
forward pass, so they share its wait) and each asynchronous load to another thread as its own
job. A job runs through the restore pipeline (`connectors.vllm.staging.restore`): in *stages*,
each a layer range of every block (the frames hold one segment per layer, so a range is one
contiguous read in every tier), fetched one unit ahead and written by the writer
`restore_path` chooses (decoded layer by layer, or staged through a ring of slots, or copied
in place), each block verified before it is written. `wait_for_layer(i)` waits for just layer
i, so the forward pass computes layer 0 while later layers are still arriving.

A block that is missing, corrupt, mismatched or not there by the deadline fails (the reason is
its counter) and is reported through `WorkerOutbox`: vLLM recomputes it and every later block
of its request. Once the deadline has passed the job is cancelled under the lock it scatters
under, so the loader never writes into a block after vLLM was told it failed (from then on
the block may be recomputed, or freed and reused).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from connectors.vllm.config import RestorePath
from connectors.vllm.metadata import BlockRun, LoadReport, LoadSpec, SaveReport
from connectors.vllm.staging import RestorePipeline, StagingConfig, writer_for
from connectors.vllm.staging.jobs import RestoreBlock, RestoreJob
from connectors.vllm.stats import Count
from connectors.vllm.worker_context import WorkerContext
from kvstore.errors import ForgedBlock
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.keys import BlockKey, Namespace
from kvstore.mac import verify_mac

__all__ = ["Loader", "LoadBlock", "LoadJob", "layer_stages"]

log = logging.getLogger(__name__)

# A stage's blocks are read by this many concurrent store calls: a store reads a batch one
# block after the other, and a remote read is mostly a round trip's waiting, not bytes.
_READ_THREADS = 4
_MIN_BLOCKS_PER_READ = 4


def layer_stages(num_layers: int, first_layers: int) -> tuple[LayerRange, ...]:
    """The layer ranges a load reads one after the other: everything at once (0), or `[0, k)`
    first and then the rest in one more read, so the forward pass computes the first layers
    while the rest are in flight (two reads per block, not one per layer: a remote read
    costs a round trip)."""
    if first_layers <= 0 or first_layers >= num_layers:
        return (LayerRange(0, num_layers),)
    return (LayerRange(0, first_layers), LayerRange(first_layers, num_layers))


@dataclass(frozen=True, slots=True)
class LoadBlock:
    """One block to restore: where it goes (paged block id), what it is (key), whose it is."""

    block_id: int
    key: BlockKey
    req_id: str
    index: int
    """The block's index in its request."""


@dataclass(slots=True)
class LoadJob:
    """One batch of loads: a step's synchronous loads, or one asynchronous request."""

    blocks: tuple[LoadBlock, ...]
    req_ids: tuple[str, ...]
    deadline: float
    num_layers: int
    layer_done: list[threading.Event] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    failed: dict[int, Count] = field(default_factory=dict)
    """Paged block id -> why it failed (a `LOAD_FAILURES` counter)."""
    device_done: list[torch.cuda.Event | None] = field(default_factory=list)
    """Per layer, on a GPU: the scatter's completion on the loader's stream, which the forward's
    stream waits for (the host-side event only says the copy was enqueued)."""
    loaded: int = 0
    finished: threading.Event = field(default_factory=threading.Event)
    started: float = field(default_factory=time.monotonic)
    ended: float = 0.0
    """When the loader thread let go of the job (0 while it runs)."""

    def __post_init__(self) -> None:
        self.layer_done = [threading.Event() for _ in range(self.num_layers)]
        self.device_done = [None] * self.num_layers

    def fail(self, block_id: int, reason: Count) -> None:
        self.failed.setdefault(block_id, reason)

    def fail_all(self, reason: Count) -> None:
        for block in self.blocks:
            self.fail(block.block_id, reason)

    def cancel(self, reason: Count) -> None:
        """Stop the loader; every block it had not fully loaded fails with `reason`."""
        with self.lock:
            if self.cancelled or self.finished.is_set():
                return
            self.cancelled = True
            self.fail_all(reason)
        self.release_waiters()

    def release_waiters(self) -> None:
        for event in self.layer_done:
            event.set()

    def still_on_time(self) -> bool:
        """Under `lock`: False if the job was cancelled or is now past its deadline."""
        if self.cancelled:
            return False
        if time.monotonic() > self.deadline:
            self.cancelled = True
            self.fail_all(Count.LOAD_LATE)
            return False
        return True

    def reports(self) -> list[LoadReport]:
        """Per request of a finished load: its blocks, and how many of them from the first on
        loaded before one failed (vLLM recomputes from a failed block on, so later ones are
        lost)."""
        runs: dict[str, list[int]] = {}  # request -> its block indexes, in load order
        broken: dict[str, int] = {}  # request -> the first failed block index
        for block in self.blocks:
            runs.setdefault(block.req_id, []).append(block.index)
            if block.block_id in self.failed:
                broken[block.req_id] = min(broken.get(block.req_id, block.index), block.index)
        reports = []
        for req_id, indexes in runs.items():
            first = min(indexes)
            restored = broken.get(req_id, first + len(indexes)) - first
            reports.append(LoadReport(req_id, first, len(indexes), restored))
        return reports


class Loader:
    def __init__(self, context: WorkerContext, *, deadline_s: float,
                 first_layers: int = 0, path: RestorePath = "auto",
                 staging: StagingConfig | None = None) -> None:
        self._ctx = context
        self._deadline_s = deadline_s
        self._stages = layer_stages(context.fingerprint.num_layers, first_layers)
        self._path = path
        self._staging = staging
        self._pipeline: RestorePipeline | None = None  # built on first use: caches come later
        self._sync = ThreadPoolExecutor(1, thread_name_prefix="kvkeep-load")
        self._async = ThreadPoolExecutor(1, thread_name_prefix="kvkeep-aload")
        self._readers = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="kvkeep-read")
        self._lock = threading.Lock()
        self._step_job: LoadJob | None = None
        self._async_jobs: list[LoadJob] = []

    # -- the engine's calls ---------------------------------------------------------------------

    def start(self, loads: Sequence[LoadSpec]) -> None:
        sync = [spec for spec in loads if not spec.is_async]
        if sync:
            job = self._new_job(sync)
            self._step_job = job
            self._sync.submit(self._run, job)
        for spec in loads:
            if spec.is_async:
                job = self._new_job([spec])
                with self._lock:
                    self._async_jobs.append(job)
                self._async.submit(self._run, job)

    def wait_for_layer(self, layer: int) -> None:
        job = self._step_job
        if job is None:
            return
        if not job.layer_done[layer].wait(max(0.0, job.deadline - time.monotonic())):
            job.cancel(Count.LOAD_LATE)
        event = job.device_done[layer]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def finish_step(self) -> bool:
        """Settle the step's synchronous loads; True if all of them succeeded."""
        job, self._step_job = self._step_job, None
        if job is None:
            return True
        if not job.finished.wait(max(0.0, job.deadline - time.monotonic())):
            # Once cancelled (under the loader's scatter lock) the loader writes nothing more,
            # so there is no need to wait for it: it may be stuck in a slow store call.
            job.cancel(Count.LOAD_LATE)
        self._account(job)
        return not job.failed

    def finish_async(self) -> None:
        """Account every finished asynchronous load and tell vLLM its requests are ready."""
        with self._lock:
            done = [job for job in self._async_jobs if job.finished.is_set()]
            self._async_jobs = [job for job in self._async_jobs if not job.finished.is_set()]
        for job in done:
            self._account(job)
            self._ctx.outbox.finished_recving(job.req_ids)

    def drain(self, timeout: float) -> int:
        """Wait up to `timeout` for every load in flight, then cancel the ones still running
        (their blocks fail late); how many were cancelled. Once it returns no load writes into
        the caches again (a cancel takes the lock each write holds): vLLM's sleep mode unmaps
        them next."""
        give_up = time.monotonic() + timeout
        with self._lock:
            jobs = list(self._async_jobs)
        if self._step_job is not None:
            jobs.append(self._step_job)
        cancelled = 0
        for job in jobs:
            if not job.finished.wait(max(0.0, give_up - time.monotonic())):
                job.cancel(Count.LOAD_LATE)
                cancelled += 1
        tensors = self._ctx.caches.tensors
        if tensors and tensors[0].is_cuda:
            torch.cuda.synchronize()  # scatters enqueued on the loader's stream before a cancel
        return cancelled

    def shutdown(self) -> None:
        job = self._step_job
        if job is not None:
            job.cancel(Count.LOAD_LATE)
        with self._lock:
            for async_job in self._async_jobs:
                async_job.cancel(Count.LOAD_LATE)
        self._sync.shutdown(wait=True)
        self._async.shutdown(wait=True)
        if self._pipeline is not None:
            self._pipeline.close()  # its fetches read through `_readers`: closed after it
        self._readers.shutdown(wait=True)

    # -- a job ----------------------------------------------------------------------------------

    def _new_job(self, specs: Sequence[LoadSpec]) -> LoadJob:
        blocks: list[LoadBlock] = []
        for spec in specs:
            blocks.extend(self._blocks(spec.run))
        # A step's synchronous loads share the forward pass, so they share its wait: the
        # longest any of them may take (a hinted restore's, if one is among them).
        budget = max(self._deadline_s if spec.deadline_s is None else spec.deadline_s
                     for spec in specs)
        return LoadJob(tuple(blocks), tuple(spec.run.req_id for spec in specs),
                       time.monotonic() + budget, self._ctx.fingerprint.num_layers)

    def _blocks(self, run: BlockRun) -> list[LoadBlock]:
        namespace = Namespace.from_label(run.namespace)
        fingerprint = self._ctx.fingerprint
        return [LoadBlock(block_id, BlockKey.of(fingerprint, namespace, block_hash), run.req_id,
                          run.first + i)
                for i, (block_id, block_hash) in enumerate(zip(run.block_ids, run.block_hashes,
                                                               strict=True))]

    def _run(self, job: LoadJob) -> None:
        try:
            self._load(job)
        except Exception:  # a bug or a dead store: every block not loaded is recomputed
            log.exception("kvkeep: load failed")
            with job.lock:
                job.fail_all(Count.LOAD_ERRORS)
                job.cancelled = True
        finally:
            job.ended = time.monotonic()
            job.finished.set()
            job.release_waiters()

    def _load(self, job: LoadJob) -> None:
        self._pipeline_now().load(job, self._stages)
        job.loaded = sum(1 for block in job.blocks if block.block_id not in job.failed)

    def prepare(self) -> None:
        """Once the caches are registered: build the restore pipeline now (its writer's ring
        and threads), not during the first restore."""
        self._pipeline_now()

    def _pipeline_now(self) -> RestorePipeline:
        with self._lock:
            if self._pipeline is None:
                writer = writer_for(self._ctx.caches, self._ctx.store, self._ctx.codec,
                                    self._path, self._staging)
                self._pipeline = RestorePipeline(self._ctx.store, writer, read=self._read,
                                                 refusal=self._refusal)
            return self._pipeline

    def _read(self, job: RestoreJob, layers: LayerRange,
              blocks: Sequence[RestoreBlock]) -> list[BlockRead | None]:
        """One verified read of `layers` per block, by up to `_READ_THREADS` store calls at
        once, under the job's deadline (a store reads a batch one block after the other, and
        a remote read is mostly a round trip's waiting, not bytes)."""
        whole = None if len(layers) == self._ctx.fingerprint.num_layers else layers
        keys = [block.key for block in blocks]
        parts = max(1, min(_READ_THREADS, len(keys) // _MIN_BLOCKS_PER_READ))
        if parts == 1:
            return self._ctx.store.get_many(keys, whole, deadline=job.deadline)
        size = -(-len(keys) // parts)
        calls = [self._readers.submit(self._ctx.store.get_many, keys[i:i + size], whole,
                                      deadline=job.deadline)
                 for i in range(0, len(keys), size)]
        return [read for call in calls for read in call.result()]

    def _forged(self, header: FrameHeader) -> ForgedBlock | None:
        """With the tenant's MAC key: why a frame is not its writers' (None when it is)."""
        if self._ctx.mac_key is None:
            return None
        try:
            verify_mac(header, self._ctx.mac_key)
        except ForgedBlock as exc:
            return exc
        return None

    def _refusal(self, header: FrameHeader) -> tuple[Count, str] | None:
        """Why a fetched frame's header refuses it: forged, or not this engine's."""
        if (forged := self._forged(header)) is not None:
            return Count.LOAD_FORGED, str(forged)
        if (reason := self._mismatch(header)) is not None:
            return Count.LOAD_MISMATCH, f"does not match this engine: {reason}"
        return None

    def _mismatch(self, header: FrameHeader) -> str | None:
        """Why a verified frame is not one this engine would have written, or None."""
        spec = self._ctx.caches.layout
        expect = (self._ctx.codec, self._ctx.caches.dtype, spec.layout_id, spec.block_shape,
                  spec.block_size, self._ctx.fingerprint.num_layers)
        found = (header.codec, header.dtype, header.layout_id, tuple(header.layer_shape),
                 header.token_count, header.num_layers)
        return None if found == expect else f"frame has {found}, expected {expect}"

    def _account(self, job: LoadJob) -> None:
        for reason in job.failed.values():
            self._ctx.counters.add(reason)
        self._ctx.counters.add(Count.LOADED_BLOCKS, job.loaded)
        reports = job.reports()
        self._ctx.telemetry.restore((job.ended or time.monotonic()) - job.started,
                                    blocks=len(job.blocks),
                                    restored=sum(report.restored for report in reports))
        self._ctx.outbox.loads(reports, job.failed)
        # The scheduler may count these blocks as stored (its lookup found them): they are
        # not, or not usable, so they must be saved again once recomputed.
        self._ctx.outbox.saves(SaveReport(block.req_id, block.index, block.key.block_hash, False,
                                      True)
                           for block in job.blocks if block.block_id in job.failed)
