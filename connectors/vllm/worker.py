"""The worker half: copies blocks between vLLM's paged KV tensors and the store.

Loads. `start_load_kv` hands the step's loads to a loader thread, which reads every block
(one verified read each), checks that each frame is what this engine would have written (codec,
dtype, layout, shape, token count, layer count), then decodes and scatters layer 0 of every
block, then layer 1, ...; `wait_for_layer_load(layer)` waits just for that layer, so restore
overlaps the forward pass. A block that is missing, corrupt, mismatched or not there by the
restore deadline is reported through `get_block_ids_with_load_errors` and vLLM recomputes it and
everything after it. Once the deadline has passed, the loader is cancelled under the lock it
scatters under: it can never write into a block after vLLM was told the block failed (the block
may be recomputed, or freed and reused, from then on).

Saves. For each step's planned blocks, `save_kv_layer` gathers the layer's blocks into a
compact copy right after the layer's attention ran (full blocks never change afterwards);
`wait_for_save` hands the copies to a saver thread that encodes one frame per block and puts it,
and waits up to `save_timeout_s` for that to finish. If any load of the step failed, all of the
step's saves are dropped: a block computed this step may have attended to bad KV. Finished
requests with unsaved blocks ("flushes") are gathered straight from the paged tensors in
`wait_for_save`, after which vLLM may free them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.layouts import BoundLayout, LayoutSpec
from connectors.vllm.metadata import (
    BlockRun,
    LoadReport,
    LoadSpec,
    Probe,
    ProbeAnswer,
    SaveReport,
    SaveSpec,
    StepMetadata,
    WorkerReport,
)
from connectors.vllm.stats import Counters
from kvstore.block import decode_layer_batch, encode_block
from kvstore.codecs import get_codec
from kvstore.errors import ConfigError, KVKeepError
from kvstore.frame import BlockRead, DType
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.manifest import SessionManifest
from kvstore.store import TieredStore

__all__ = ["WorkerSide"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _LoadJob:
    """One batch of loads: a step's synchronous loads, or one asynchronous request."""

    blocks: list[tuple[int, BlockKey]]  # (paged block id, key)
    owners: dict[int, tuple[str, int]]  # paged block id -> (request id, block index)
    req_ids: tuple[str, ...]
    deadline: float
    num_layers: int
    layer_done: list[threading.Event] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    failed: dict[int, str] = field(default_factory=dict)  # block id -> reason
    device_done: list[torch.cuda.Event | None] = field(default_factory=list)
    """Per layer, on a GPU: the scatter's completion on the loader's stream, which the forward's
    stream waits for (the host-side event only says the copy was enqueued)."""
    loaded: int = 0
    finished: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.layer_done = [threading.Event() for _ in range(self.num_layers)]
        self.device_done = [None] * self.num_layers

    def fail(self, block_id: int, reason: str) -> None:
        self.failed.setdefault(block_id, reason)

    def cancel(self, reason: str) -> None:
        """Stop the loader; every block it had not fully loaded fails with `reason`."""
        with self.lock:
            if self.cancelled or self.finished.is_set():
                return
            self.cancelled = True
            for block_id, _ in self.blocks:
                self.fail(block_id, reason)
        for event in self.layer_done:
            event.set()


# Blocks decoded and scattered per step of a load: bounds the staging tensor (a GPU's memory
# beside vLLM's cache) while keeping each copy up large (256 blocks of 128 KiB = 32 MiB).
_LOAD_CHUNK_BLOCKS = 256


def _load_reports(job: _LoadJob) -> list[LoadReport]:
    """Per request of a finished load: its blocks, and how many of them from the first on
    loaded before one failed (vLLM recomputes from a failed block on, so later ones are lost)."""
    runs: dict[str, list[int]] = {}  # request -> its block indexes, in load order
    broken: dict[str, int] = {}  # request -> the first failed block index
    for block_id, _ in job.blocks:
        req_id, index = job.owners[block_id]
        runs.setdefault(req_id, []).append(index)
        if block_id in job.failed:
            broken[req_id] = min(broken.get(req_id, index), index)
    reports = []
    for req_id, indexes in runs.items():
        first = min(indexes)
        restored = broken.get(req_id, first + len(indexes)) - first
        reports.append(LoadReport(req_id, first, len(indexes), restored))
    return reports


@dataclass(slots=True)
class _StepSaves:
    """Blocks to save this step, and their per-layer gathered copies."""

    items: list[tuple[str, int, int, BlockKey]]  # (req id, block index, block id, key)
    block_ids: torch.Tensor
    layers: list[torch.Tensor | None]
    ready: list[torch.cuda.Event] = field(default_factory=list)


class WorkerSide:
    def __init__(self, *, config: ConnectorConfig, fingerprint: ModelFingerprint,
                 layout: LayoutSpec, store: TieredStore, counters: Counters) -> None:
        self._config = config
        self._fp = fingerprint
        self._spec = layout
        self._store = store
        self._counters = counters
        self._codec = get_codec(config.codec).codec_id
        self._num_layers = fingerprint.num_layers
        self._caches: list[torch.Tensor] = []
        self._bound: list[BoundLayout] = []
        self._layer_index: dict[str, int] = {}
        self._dtype: DType | None = None
        self._sync_loader = ThreadPoolExecutor(1, thread_name_prefix="kvkeep-load")
        self._async_loader = ThreadPoolExecutor(1, thread_name_prefix="kvkeep-aload")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvkeep-save")
        self._manifest_writer = ThreadPoolExecutor(1, thread_name_prefix="kvkeep-manifest")
        self._state = threading.Lock()
        self._step_job: _LoadJob | None = None
        self._async_jobs: list[_LoadJob] = []
        self._step_saves: _StepSaves | None = None
        self._errors: set[int] = set()
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._reports: list[SaveReport] = []
        self._loads: list[LoadReport] = []
        self._answers: list[ProbeAnswer] = []
        self._inflight_saves = 0

    # -- registration --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self._num_layers:
            raise ConfigError(f"kvkeep: {len(names)} KV cache layers registered, the model "
                              f"has {self._num_layers}")
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._caches = [kv_caches[name] for name in names]
        self._bound = [self._spec.bind(t) for t in self._caches]
        dtypes = {t.dtype for t in self._caches}
        if len(dtypes) != 1:
            raise ConfigError(f"kvkeep: KV cache layers differ in dtype: {dtypes}")
        self._dtype = DType.from_name(str(self._caches[0].dtype))

    # -- loads ---------------------------------------------------------------------------------

    def start_load_kv(self, loads: Sequence[LoadSpec]) -> None:
        sync = [spec for spec in loads if not spec.is_async]
        if sync:
            job = self._new_job([spec.run for spec in sync])
            self._step_job = job
            self._sync_loader.submit(self._run_load, job)
        for spec in loads:
            if spec.is_async:
                job = self._new_job([spec.run])
                with self._state:
                    self._async_jobs.append(job)
                self._async_loader.submit(self._run_load, job)

    def wait_for_layer_load(self, layer_name: str) -> None:
        job = self._step_job
        index = self._layer_index.get(layer_name)
        if job is None or index is None:
            return
        if not job.layer_done[index].wait(max(0.0, job.deadline - time.monotonic())):
            job.cancel("load_late")
        event = job.device_done[index]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def _new_job(self, runs: Sequence[BlockRun]) -> _LoadJob:
        blocks: list[tuple[int, BlockKey]] = []
        owners: dict[int, tuple[str, int]] = {}
        for run in runs:
            namespace = Namespace.from_label(run.namespace)
            for i, (block_id, block_hash) in enumerate(zip(run.block_ids, run.block_hashes,
                                                           strict=True)):
                blocks.append((block_id, BlockKey.of(self._fp, namespace, block_hash)))
                owners[block_id] = (run.req_id, run.first + i)
        return _LoadJob(blocks, owners, tuple(run.req_id for run in runs),
                        time.monotonic() + self._config.restore_deadline_s, self._num_layers)

    def _run_load(self, job: _LoadJob) -> None:
        try:
            self._load(job)
        except Exception:  # a bug or a dead store: every block not loaded is recomputed
            log.exception("kvkeep: load failed")
            with job.lock:
                for block_id, _ in job.blocks:
                    job.fail(block_id, "load_errors")
                job.cancelled = True
        finally:
            job.finished.set()
            for event in job.layer_done:
                event.set()

    def _load(self, job: _LoadJob) -> None:
        keys = [key for _, key in job.blocks]
        reads = self._store.get_many(keys, deadline=job.deadline)
        good: list[tuple[int, BlockKey, BlockRead]] = []
        for (block_id, key), read in zip(job.blocks, reads, strict=True):
            if read is None:
                job.fail(block_id, "load_late" if time.monotonic() >= job.deadline
                         else "load_missing")
            elif (reason := self._check_header(read)) is not None:
                log.warning("kvkeep: frame for %s does not match this engine: %s",
                            key.storage_name, reason)
                job.fail(block_id, "load_mismatch")
                self._store.delete([key])  # it can never be used under this key
            else:
                good.append((block_id, key, read))
        assert self._dtype is not None
        # Decoded on the host, then copied to the cache's device: the path measured on an H200
        # (int8 restores at 0.19-0.24x a pageable copy up). Staging on the GPU instead makes
        # `decode_layer_batch` send a chunk's segments up in one copy and decode them there;
        # it is tested (on CPU and under the gpu marker) but not yet measured, so not the
        # default: `python -m benchmarks.gpu` compares both ("batched"). Chunks bound the
        # staging memory.
        staging = torch.empty((min(len(good), _LOAD_CHUNK_BLOCKS), *self._spec.block_shape),
                              dtype=self._caches[0].dtype, device="cpu")
        for layer in range(job.num_layers):
            cache = self._caches[layer]
            wanted = [entry for entry in good if entry[0] not in job.failed]
            for start in range(0, len(wanted), _LOAD_CHUNK_BLOCKS):
                if not self._load_chunk(job, layer, wanted[start:start + _LOAD_CHUNK_BLOCKS],
                                        staging):
                    return
            with job.lock:
                if not self._still_on_time(job):
                    return
                if cache.is_cuda and wanted:
                    job.device_done[layer] = _recorded_event()
            job.layer_done[layer].set()
        job.loaded = sum(1 for block_id, _, _ in good if block_id not in job.failed)

    def _load_chunk(self, job: _LoadJob, layer: int,
                    chunk: Sequence[tuple[int, BlockKey, BlockRead]],
                    staging: torch.Tensor) -> bool:
        """Decode one layer of `chunk`'s blocks and scatter the good ones into the cache;
        False when the job was cancelled or ran late (then nothing more may be written)."""
        errors = decode_layer_batch([read for _, _, read in chunk], layer, staging,
                                    keys=[key for _, key, _ in chunk])
        rows: list[int] = []  # rows of `staging` that hold this layer, verified
        targets: list[int] = []  # and the paged blocks they go to
        for row, ((block_id, key, _), error) in enumerate(zip(chunk, errors, strict=True)):
            if error is not None:
                job.fail(block_id, "load_corrupt")
                self._store.delete([key])
                continue
            rows.append(row)
            targets.append(block_id)
        with job.lock:
            if not self._still_on_time(job):
                return False
            if rows:
                cache = self._caches[layer]
                data = staging.index_select(0, torch.tensor(rows, device=staging.device))
                self._bound[layer].scatter(cache, torch.tensor(targets, device=cache.device),
                                           data.to(cache.device))
        return True

    @staticmethod
    def _still_on_time(job: _LoadJob) -> bool:
        """Under `job.lock`: False if the job was cancelled or is now past its deadline."""
        if job.cancelled:
            return False
        if time.monotonic() > job.deadline:
            job.cancelled = True
            for block_id, _ in job.blocks:
                job.fail(block_id, "load_late")
            return False
        return True

    def _check_header(self, read: BlockRead) -> str | None:
        header = read.header
        expect = (self._codec, self._dtype, self._spec.layout_id, self._spec.block_shape,
                  self._spec.block_size, self._num_layers)
        found = (header.codec, header.dtype, header.layout_id, tuple(header.layer_shape),
                 header.token_count, header.num_layers)
        if found != expect:
            return f"frame has {found}, expected {expect}"
        return None

    def _finish_step_load(self) -> bool:
        """Settle the step's synchronous loads; True if all of them succeeded."""
        job, self._step_job = self._step_job, None
        if job is None:
            return True
        if not job.finished.wait(max(0.0, job.deadline - time.monotonic())):
            # Once cancelled (under the loader's scatter lock) the loader writes nothing more,
            # so there is no need to wait for it: it may be stuck in a slow store call.
            job.cancel("load_late")
        self._account(job)
        return not job.failed

    def _account(self, job: _LoadJob) -> None:
        for reason in job.failed.values():
            self._counters.add(reason)
        self._counters.add("loaded_blocks", job.loaded)
        keys = dict(job.blocks)
        loads = _load_reports(job)
        with self._state:
            self._loads.extend(loads)
            self._errors.update(job.failed)
            # The scheduler may count these blocks as stored (its lookup found them): they
            # are not, or not usable, so they must be saved again once recomputed.
            self._reports.extend(
                SaveReport(*job.owners[block_id], keys[block_id].block_hash, False, True)
                for block_id in job.failed)

    # -- saves ---------------------------------------------------------------------------------

    def begin_step(self, meta: StepMetadata) -> None:
        """Before the forward pass: answer the scheduler's probes, queue its manifests, and
        decide which of the step's planned blocks to gather."""
        for probe in meta.probes:
            self._answer(probe)
        for encoded in meta.manifests:
            self._manifest_writer.submit(self._write_manifest, encoded)
        runs = [spec.run for spec in meta.saves if not spec.flush and len(spec.run)]
        self._step_saves = self._select(runs) if runs else None

    def _answer(self, probe: Probe) -> None:
        namespace = Namespace.from_label(probe.namespace)
        keys = [BlockKey.of(self._fp, namespace, h) for h in probe.block_hashes]
        try:
            hit = self._store.lookup(
                keys, deadline=time.monotonic() + self._config.restore_deadline_s)
        except KVKeepError:
            log.warning("kvkeep: lookup failed; computing instead", exc_info=True)
            self._counters.add("lookup_errors")
            hit = 0
        with self._state:
            self._answers.append(ProbeAnswer(probe.req_id, probe.first, len(keys), hit))

    def _write_manifest(self, encoded: bytes) -> None:
        try:
            self._store.put_manifest(SessionManifest.decode(encoded))
            self._counters.add("manifests_written")
        except KVKeepError:
            log.warning("kvkeep: manifest write failed", exc_info=True)
            self._counters.add("manifest_errors")

    def save_kv_layer(self, layer_name: str) -> None:
        saves = self._step_saves
        index = self._layer_index.get(layer_name)
        if saves is None or index is None:
            return
        cache = self._caches[index]
        saves.layers[index] = self._bound[index].gather(cache, saves.block_ids.to(cache.device))
        if cache.is_cuda:
            # The saver thread encodes on its own stream: it must see the finished gather.
            saves.ready.append(_recorded_event())

    def wait_for_save(self, saves: Sequence[SaveSpec]) -> None:
        loads_ok = self._finish_step_load()
        step, self._step_saves = self._step_saves, None
        futures: list[Future[None]] = []
        if step is not None:
            if not loads_ok:
                # KV computed this step may have attended to blocks that failed to load.
                self._counters.add("save_dropped_after_load_error", len(step.items))
                self._report(step.items, ok=False, retry_now=True)
                self._release(len(step.items))
            elif any(layer is None for layer in step.layers):
                self._counters.add("save_failed", len(step.items))
                self._report(step.items, ok=False)
                self._release(len(step.items))
            else:
                futures.append(self._saver.submit(self._encode_and_put, step))
        for spec in saves:
            if spec.flush:
                futures.extend(self._flush(spec.run))
        deadline = time.monotonic() + self._config.save_timeout_s
        for future in futures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                future.result(timeout=remaining)
            except TimeoutError:
                break  # it finishes in the background and is reported when it does

    def _select(self, runs: Sequence[BlockRun]) -> _StepSaves | None:
        """The blocks of `runs` not already stored (deduplication by key)."""
        items: list[tuple[str, int, int, BlockKey]] = []
        for run in runs:
            namespace = Namespace.from_label(run.namespace)
            keys = [BlockKey.of(self._fp, namespace, h) for h in run.block_hashes]
            # Stored blocks of a run are almost always its leading ones (a restored or shared
            # prefix): one batched lookup finds them. Any other duplicate is re-put, which a
            # store treats as a no-op. No local "saved lately" cache: the store may have
            # evicted or deleted (corrupt) a block since, and then it must be saved again.
            try:
                present = self._store.lookup(keys)
            except KVKeepError:
                present = 0
            self._report_present(run, range(present))
            items.extend((run.req_id, run.first + i, run.block_ids[i], keys[i])
                         for i in range(present, len(run)))
        room = self._config.max_inflight_saves - self._inflight_saves
        if len(items) > room:
            dropped, items = items[max(room, 0):], items[:max(room, 0)]
            self._counters.add("save_backpressure", len(dropped))
            self._report(dropped, ok=False)
        if not items:
            return None
        with self._state:
            self._inflight_saves += len(items)
        return _StepSaves(items, torch.tensor([item[2] for item in items]),
                          [None] * self._num_layers)

    def _flush(self, run: BlockRun) -> list[Future[None]]:
        """Save a finished request's last blocks straight from the paged tensors."""
        futures: list[Future[None]] = []
        try:
            step = self._select([run]) if len(run) else None
            if step is not None:
                for layer, cache in enumerate(self._caches):
                    ids = step.block_ids.to(cache.device)
                    step.layers[layer] = self._bound[layer].gather(cache, ids)
                    if cache.is_cuda:
                        step.ready.append(_recorded_event())
                futures.append(self._saver.submit(self._encode_and_put, step))
        finally:
            # The gathered copies no longer need the paged blocks: vLLM may free them now.
            with self._state:
                self._finished_sending.add(run.req_id)
        return futures

    def _encode_and_put(self, step: _StepSaves) -> None:
        try:
            for event in step.ready:
                event.synchronize()
            for j, (req_id, index, _, key) in enumerate(step.items):
                layers = [layer[j] for layer in step.layers if layer is not None]
                ok = False
                try:
                    frame = encode_block(layers, codec=self._codec, key=key,
                                         token_count=self._spec.block_size,
                                         layout_id=self._spec.layout_id,
                                         compression=self._config.compression,
                                         arrangement=self._spec.arrangement)
                    ok = self._store.put(key, frame)
                except KVKeepError:
                    log.warning("kvkeep: saving a block failed", exc_info=True)
                if ok:
                    self._counters.add("saved_blocks")
                else:
                    self._counters.add("save_failed")
                self._report([(req_id, index, 0, key)], ok=ok)
        finally:
            self._release(len(step.items))

    def _report_present(self, run: BlockRun, indices: Sequence[int]) -> None:
        self._counters.add("save_skipped_present", len(indices))
        with self._state:
            self._reports.extend(SaveReport(run.req_id, run.first + i, run.block_hashes[i], True)
                                 for i in indices)

    def _report(self, items: Sequence[tuple[str, int, int, BlockKey]], *, ok: bool,
                retry_now: bool = False) -> None:
        with self._state:
            self._reports.extend(SaveReport(req_id, index, key.block_hash, ok, retry_now)
                                 for req_id, index, _, key in items)

    def _release(self, count: int) -> None:
        with self._state:
            self._inflight_saves -= count

    # -- per-step results ----------------------------------------------------------------------

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        done: list[_LoadJob] = []
        with self._state:
            running: list[_LoadJob] = []
            for job in self._async_jobs:
                (done if job.finished.is_set() else running).append(job)
            self._async_jobs = running
        for job in done:
            self._account(job)
        with self._state:
            for job in done:
                self._finished_recving.update(job.req_ids)
            sending, self._finished_sending = self._finished_sending, set()
            recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._state:
            errors, self._errors = self._errors, set()
        return errors

    def take_report(self) -> WorkerReport | None:
        with self._state:
            reports, self._reports = self._reports, []
            answers, self._answers = self._answers, []
            loads, self._loads = self._loads, []
        if not (reports or answers or loads):
            return None
        return WorkerReport(tuple(reports), tuple(answers), tuple(loads))

    def drain_manifests(self, timeout: float = 10.0) -> None:
        """Wait until every manifest queued so far is written (tests, shutdown)."""
        self._manifest_writer.submit(lambda: None).result(timeout)

    def shutdown(self) -> None:
        job = self._step_job
        if job is not None:
            job.cancel("load_late")
        with self._state:
            for async_job in self._async_jobs:
                async_job.cancel("load_late")
        self._sync_loader.shutdown(wait=True)
        self._async_loader.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        self._manifest_writer.shutdown(wait=True)


def _recorded_event() -> torch.cuda.Event:
    """A CUDA event recorded on the calling thread's current stream."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves __init__ untyped
    event.record()
    return event
