"""Saves: completed blocks from vLLM's paged KV cache into the store, one frame per block.

For each step's planned blocks, `plan` (before the forward pass) drops those the store's
in-memory tiers already hold, and `save_layer` gathers the rest's layer into a compact copy
right after the layer's attention ran (full blocks never change afterwards). `finish_step`
hands the copies to the saver thread, which asks the whole store (network tiers too) which it
holds and runs the rest through the save pipeline (`connectors.vllm.staging.save`: a framer,
host or staged, into a sink, write-behind or replicated, as the config says). If any load of
the step failed, all of the step's saves are dropped: a block computed this step may have
attended to bad KV.
Finished requests with unsaved blocks ("flushes") are gathered straight from the paged tensors
in `finish_step`, after which vLLM may free them.

Nothing on the step's path waits for the network (issue 18): the step's own dedup asks only
in-memory tiers, and without `durability` a step does not wait for its puts (unless
`save_timeout_s` > 0 asks it to, `save_wait_us` counting the wait); a slow or dead store costs
how recent the stored KV is, never the step. What bounds memory instead is
`max_inflight_saves`: blocks past it are not saved now (`save_backpressure`, logged at most
every `_BACKPRESSURE_LOG_S`) and are planned again at the next checkpoint; how far behind the
store is shows in `kvkeep_connector_store_copy_lag_seconds` and the outbox's save reports.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from connectors.vllm.caches import recorded_event
from connectors.vllm.config import ConnectorConfig
from connectors.vllm.metadata import BlockRun, SaveReport, SaveSpec
from connectors.vllm.staging.save import (
    DURABLE_GRACE_S,
    HOST_CHUNK,
    NOT_SAVED,
    Framer,
    FrameSettings,
    FrameSink,
    HostFramer,
    Replicated,
    RingFramer,
    SaveBatch,
    Saved,
    SavePipeline,
    WriteBehind,
)
from connectors.vllm.stats import Count
from connectors.vllm.worker_context import WorkerContext
from kvstore.errors import KVKeepError
from kvstore.keys import BlockKey, Namespace

__all__ = ["Saver", "SaveItem"]

log = logging.getLogger(__name__)

_BACKPRESSURE_LOG_S = 10.0


@dataclass(frozen=True, slots=True)
class SaveItem:
    """One block to save: whose it is, where it is now (paged block id), and its key."""

    req_id: str
    index: int
    """The block's index in its request."""
    block_id: int
    key: BlockKey

    def report(self, *, ok: bool, retry_now: bool = False) -> SaveReport:
        return SaveReport(self.req_id, self.index, self.key.block_hash, ok, retry_now)


@dataclass(slots=True)
class _Batch:
    """Blocks to save together, and their per-layer gathered copies."""

    items: tuple[SaveItem, ...]
    block_ids: torch.Tensor
    layers: list[torch.Tensor | None]
    ready: list[torch.cuda.Event] = field(default_factory=list)
    planned: float = field(default_factory=time.monotonic)
    """When the step that computes these blocks began (or their request's flush): save lag."""
    computed_at: float = 0.0
    """`time.monotonic()` once its KV was complete (the step's forward pass, or the flush)."""
    deadline: float = math.inf
    """With `durability`: when its step stops waiting for R daemons to hold it."""

    @property
    def gathered(self) -> bool:
        return all(layer is not None for layer in self.layers)


class Saver:
    def __init__(self, context: WorkerContext, config: ConnectorConfig) -> None:
        self._ctx = context
        self._config = config
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvkeep-save")
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()  # not `_lock`: the step's `_select` takes that
        self._inflight = 0
        self._step: _Batch | None = None
        self._pipeline: SavePipeline | None = None  # built once the caches are registered
        self._backpressure_logged = -math.inf

    def plan(self, saves: Sequence[SaveSpec]) -> None:
        """Before the forward pass: which of the step's planned (not flushed) blocks to gather."""
        runs = [spec.run for spec in saves if not spec.flush and len(spec.run)]
        self._step = self._select(runs) if runs else None

    def save_layer(self, layer: int) -> None:
        step = self._step
        if step is None:
            return
        cache = self._ctx.caches.tensors[layer]
        step.layers[layer] = self._ctx.caches.bound[layer].gather(cache,
                                                              step.block_ids.to(cache.device))
        if cache.is_cuda:
            # The saver thread encodes on its own stream: it must see the finished gather.
            step.ready.append(recorded_event())

    def finish_step(self, saves: Sequence[SaveSpec], *, loads_ok: bool) -> None:
        """After the forward pass: put the step's gathered blocks and flush finished requests,
        waiting up to `save_timeout_s` (later ones finish in the background)."""
        step, self._step = self._step, None
        futures: list[Future[None]] = []
        if step is not None:
            if not loads_ok:
                # KV computed this step may have attended to blocks that failed to load.
                self._ctx.counters.add(Count.SAVE_DROPPED_AFTER_LOAD_ERROR, len(step.items))
                self._ctx.outbox.saves(item.report(ok=False, retry_now=True) for item in step.items)
                self._release(len(step.items))
                self._not_durable(step.items, "its loads failed")
            elif not step.gathered:
                self._ctx.counters.add(Count.SAVE_FAILED, len(step.items))
                self._ctx.outbox.saves(item.report(ok=False) for item in step.items)
                self._release(len(step.items))
                self._not_durable(step.items, "a layer was not gathered")
            else:
                self._stamp(step)
                futures.append(self._executor.submit(self._encode_and_put, step))
        for spec in saves:
            if spec.flush:
                futures.extend(self._flush(spec.run))
        if self._config.durability is not None:
            self._wait_durable(futures)
            return
        if self._config.save_timeout_s <= 0 or not futures:
            return  # the default: the puts finish in the background and report then
        started = time.monotonic()
        deadline = started + self._config.save_timeout_s
        for future in futures:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                future.result(timeout=remaining)
            except TimeoutError:
                break  # it finishes in the background and is reported when it does
        self._ctx.counters.add(Count.SAVE_WAIT_US, int((time.monotonic() - started) * 1e6))

    def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` for every save handed to the saver thread so far; True if they
        all ended. (Its saves encode gathered copies, never the paged cache: one still running
        afterwards reads nothing vLLM's sleep mode unmaps.)"""
        marker = self._executor.submit(lambda: None)  # one thread, in order: after the others
        try:
            marker.result(timeout=timeout)
        except TimeoutError:
            return False
        return True

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
        if self._pipeline is not None:
            self._pipeline.close()

    # -- helpers --------------------------------------------------------------------------------

    def _select(self, runs: Sequence[BlockRun]) -> _Batch | None:
        """The blocks of `runs` not already stored (deduplication by key), within the room
        `max_inflight_saves` leaves."""
        items: list[SaveItem] = []
        for run in runs:
            namespace = Namespace.from_label(run.namespace)
            keys = [BlockKey.of(self._ctx.fingerprint, namespace, h) for h in run.block_hashes]
            # Stored blocks of a run are almost always its leading ones (a restored or shared
            # prefix): one batched lookup finds them. Any other duplicate is re-put, which a
            # store treats as a no-op. No local "saved lately" cache: the store may have
            # evicted or deleted (corrupt) a block since, and then it must be saved again.
            try:
                present = self._stored_prefix(keys)
            except KVKeepError:
                present = 0
            self._ctx.counters.add(Count.SAVE_SKIPPED_PRESENT, present)
            self._ctx.outbox.saves(SaveReport(run.req_id, run.first + i, run.block_hashes[i], True)
                               for i in range(present))
            items.extend(SaveItem(run.req_id, run.first + i, run.block_ids[i], keys[i])
                         for i in range(present, len(run)))
        with self._lock:
            room = max(self._config.max_inflight_saves - self._inflight, 0)
            taken, dropped = items[:room], items[room:]
            self._inflight += len(taken)
        if dropped:
            self._ctx.counters.add(Count.SAVE_BACKPRESSURE, len(dropped))
            now = time.monotonic()
            if now - self._backpressure_logged >= _BACKPRESSURE_LOG_S:
                self._backpressure_logged = now
                log.warning("kvkeep: %d block(s) of %s not saved now: %d saves in flight, the "
                            "max_inflight_saves limit (the store is behind); they are planned "
                            "again at the next checkpoint", len(dropped),
                            ", ".join(sorted({item.req_id for item in dropped})[:4]),
                            self._config.max_inflight_saves)
            self._ctx.outbox.saves(item.report(ok=False) for item in dropped)
            self._not_durable(dropped, "too many saves in flight")
        if not taken:
            return None
        return _Batch(tuple(taken), torch.tensor([item.block_id for item in taken]),
                      [None] * self._ctx.fingerprint.num_layers)

    def _flush(self, run: BlockRun) -> list[Future[None]]:
        """Save a finished request's last blocks straight from the paged tensors."""
        futures: list[Future[None]] = []
        try:
            batch = self._select([run]) if len(run) else None
            if batch is not None:
                for layer, cache in enumerate(self._ctx.caches.tensors):
                    ids = batch.block_ids.to(cache.device)
                    batch.layers[layer] = self._ctx.caches.bound[layer].gather(cache, ids)
                    if cache.is_cuda:
                        batch.ready.append(recorded_event())
                self._stamp(batch)
                futures.append(self._executor.submit(self._encode_and_put, batch))
        finally:
            # The gathered copies no longer need the paged blocks: vLLM may free them now.
            self._ctx.outbox.finished_sending(run.req_id)
        return futures

    def _encode_and_put(self, batch: _Batch) -> None:
        """On the saver thread: the batch's blocks that no tier holds yet through the save
        pipeline (framing, then the store), each reported once."""
        try:
            rows = list(range(len(batch.items)))
            if self._config.durability is None:
                held = self._held_elsewhere(batch.items)
                for j in rows:
                    if held[j]:
                        self._ctx.counters.add(Count.SAVE_SKIPPED_PRESENT)
                        self._ctx.outbox.saves((batch.items[j].report(ok=True),))
                rows = [j for j in rows if not held[j]]
            if rows:
                self._save(batch, rows)
        finally:
            self._release(len(batch.items))

    def _save(self, batch: _Batch, rows: Sequence[int]) -> None:
        items = [batch.items[j] for j in rows]
        unsaved: list[SaveItem] = []
        unacknowledged: list[SaveItem] = []
        durable = self._config.durability is not None

        reported: set[int] = set()

        def report(index: int, saved: Saved) -> None:
            reported.add(index)
            item = items[index]
            self._ctx.counters.add(Count.SAVED_BLOCKS if saved.stored else Count.SAVE_FAILED)
            if saved.stored:
                self._ctx.telemetry.saved(time.monotonic() - batch.planned)
            if durable:
                if saved.durable:
                    self._ctx.counters.add(Count.DURABLE_BLOCKS)
                else:
                    (unacknowledged if saved.stored else unsaved).append(item)
            self._ctx.outbox.saves((item.report(ok=saved.stored),))

        layers = [layer for layer in batch.layers if layer is not None]
        try:
            self._pipeline_now().save(SaveBatch([item.key for item in items], layers, rows,
                                                batch.ready, batch.computed_at, batch.deadline),
                                      report)
        except Exception:  # a bug, a device error: never the step's; the blocks go unsaved
            log.exception("kvkeep: a batch of %d saves failed", len(items))
            for index in sorted(set(range(len(items))) - reported):
                report(index, NOT_SAVED)
        self._not_durable(unsaved, "it was not saved (see the log above)")
        if self._config.durability is not None:
            self._not_durable(unacknowledged,
                              f"{self._config.durability.replicas} daemons did not acknowledge "
                              f"it in {self._config.durability.timeout_s * 1000:.0f} ms")

    def prepare(self) -> None:
        """Once the caches are registered: build the save pipeline (its staging ring and
        threads with `save_path: "staged"`) now, not during the first save."""
        self._pipeline_now()

    def _pipeline_now(self) -> SavePipeline:
        with self._build_lock:
            if self._pipeline is None:
                self._pipeline = self._build_pipeline()
            return self._pipeline

    def _build_pipeline(self) -> SavePipeline:
        """The framer `save_path` names, into the sink `durability` names: every combination
        of the two and of codec, compression and MAC signing is allowed."""
        settings = FrameSettings(self._ctx.codec, self._config.compression, self._ctx.mac_key)
        durability = self._config.durability
        # A replicated sink gets a batch in one put (one round trip to R daemons); a batch is
        # at most `max_inflight_saves` blocks.
        chunk = HOST_CHUNK if durability is None else self._config.max_inflight_saves
        framer: Framer = (RingFramer(self._ctx.caches, settings)
                          if self._config.save_path == "staged"
                          else HostFramer(self._ctx.caches, settings, chunk))
        sink: FrameSink = (WriteBehind(self._ctx.store) if durability is None
                           else Replicated(self._ctx.store, durability.replicas))
        return SavePipeline(framer, sink)

    # -- durability: blocks on R daemons before the step that computed them returns ------------

    def _stamp(self, batch: _Batch) -> None:
        batch.computed_at = time.monotonic()
        if self._config.durability is not None:
            batch.deadline = batch.computed_at + self._config.durability.timeout_s

    def _stored_prefix(self, keys: Sequence[BlockKey]) -> int:
        """The leading `keys` a save may skip: held by an in-memory tier (asked on the step's
        path: no network), or with `durability`, by R daemons (a block only in this node's RAM
        must still be made durable; that wait is the setting's cost)."""
        durability = self._config.durability
        if durability is None:
            return self._ctx.store.lookup(keys, in_process_only=True)
        present = self._ctx.store.replicated_prefix(
            keys, copies=durability.replicas,
            deadline=time.monotonic() + durability.timeout_s)
        self._ctx.counters.add(Count.DURABLE_BLOCKS, present)
        return present

    def _held_elsewhere(self, items: Sequence[SaveItem]) -> list[bool]:
        """On the saver thread: which of `items` a network tier already holds (a prefix
        restored from the daemons, another worker's save), so that they are not sent again.
        A store that cannot say in time holds nothing: the blocks are put (puts are
        idempotent). A store of in-memory tiers only was asked already, by the step."""
        if self._ctx.store.answers_in_process:
            return [False] * len(items)
        try:
            deadline = time.monotonic() + self._config.restore_deadline_s
            return self._ctx.store.holds([item.key for item in items], deadline=deadline)
        except KVKeepError:
            return [False] * len(items)

    def _wait_durable(self, futures: Sequence[Future[None]]) -> None:
        """Hold the step (and so every token it sampled) until its saves are durable. Each
        save ends by its own deadline (`durability.timeout_s` from now); past it and a grace,
        the step goes on regardless (a save that ends later counts as not durable)."""
        if not futures:
            return
        assert self._config.durability is not None
        started = time.monotonic()
        give_up = started + self._config.durability.timeout_s + DURABLE_GRACE_S
        for future in futures:
            try:
                future.result(timeout=max(give_up - time.monotonic(), 0.0))
            except TimeoutError:
                log.warning("kvkeep: a step stopped waiting for its durable saves")
                break
        self._ctx.counters.add(Count.DURABLE_WAIT_US,
                               int((time.monotonic() - started) * 1e6))

    def _not_durable(self, items: Sequence[SaveItem], why: str) -> None:
        if self._config.durability is None or not items:
            return
        self._ctx.counters.add(Count.DURABLE_MISSED, len(items))
        log.warning("kvkeep: %d block(s) of %s not durable on %d daemons: %s", len(items),
                    ", ".join(sorted({item.req_id for item in items})),
                    self._config.durability.replicas, why)

    def _release(self, count: int) -> None:
        with self._lock:
            self._inflight -= count
