"""The scheduler half: what to restore, what to save, and session manifests. No tensor work.

Per request it keeps where its blocks live and which of them are known saved. Each step it

- answers `get_num_new_matched_tokens` for the request's block hashes beyond vLLM's local
  prefix cache without ever waiting on I/O inside vLLM's `schedule()`: tiers that answer from
  memory (host, nvme index) are asked inline; when the store also has tiers across the network
  (remote daemons, Redis) and the in-memory ones do not hold the whole run, the lookup goes to
  `BackgroundLookups` (one thread, batched across the step's requests) and vLLM is told to ask
  again next step (None), up to the restore deadline. When the store lives only in the
  worker's process (vLLM's multiprocess executor), the lookup is a `Probe` in the next step's
  metadata, answered with that step's output, the same way;
- turns the tokens vLLM agreed to load into a `LoadSpec` (block ids + hashes);
- plans saves of blocks that the step completes: during prefill all of them, during decode once
  at least `checkpoint_interval` tokens of completed blocks are unsaved;
- learns from the worker which saves landed, and writes the session manifest (blocks in order,
  token ids so far) once its saved prefix grows, through `connectors.vllm.manifests` (whose
  generations the router's `session_epoch` fences). A manifest names only blocks the worker
  confirmed stored (a store may still evict them later; a restore then recomputes them);
- gives a request the router sent with a `restore_reason` (its session moved here) the longer
  `hinted_restore_deadline_ms` for its lookup and load;
- decides, per request, how much of a lookup's hit to restore (`restore_cost`: each block
  priced on the tier it lies on, against the engine's prefill rate, learned here from the
  time between steps), and counts what it decided (`decided_*`). Only where the store is in
  this process: with the multiprocess executor's probes every hit is restored;
- with several KV cache groups (vLLM's hybrid KV cache manager, `connectors.vllm.groups`)
  keeps each group's block ids, looks a block up in every group's store layout (a prefix is
  restorable when every group holds all of it), saves and restores each group's blocks under
  its own fingerprint, skipping the null entries of blocks a sliding window freed, and loads
  asynchronously: vLLM can map a failed block back to its request only with one group, so a
  failed load is reported as the request's (`failed_recving`), which vLLM recomputes;
- when vLLM publishes KV events, adds a `BlockStored` for each request's grown saved prefix to
  them (medium `KVKEEP_SHARED` for a store with remote daemons, else `KVKEEP_LOCAL`), so a
  router knows which prefixes the store can restore. Each event carries the whole saved prefix
  from its first block (no parent to resolve): a router that missed earlier events still keys
  it right.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.groups import NULL_BLOCK_ID, KVGroup, single_group, window_safe_interval
from connectors.vllm.lookups import BackgroundLookups
from connectors.vllm.manifests import (
    ManifestRelay,
    ManifestSink,
    ManifestWriter,
    manifest_generation,
    now_us,
)
from connectors.vllm.metadata import (
    BlockRun,
    LoadSpec,
    Probe,
    SaveSpec,
    StepMetadata,
    WorkerReport,
)
from connectors.vllm.params import RestoreParams, namespace_for, parse_params
from connectors.vllm.restore_cost import RestoreCostModel, block_bytes_of
from connectors.vllm.stats import Count, Counts
from connectors.vllm.tracking import LookupAnswer, PendingProbe, TrackedRequest
from kvstore.errors import KVKeepError
from kvstore.keys import BlockHash, BlockKey, ModelFingerprint, SessionKey
from kvstore.manifest import SessionManifest
from kvstore.store import TieredStore

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide"]

log = logging.getLogger(__name__)

_IDLE_STEP_S = 0.001
SAVE_REPORT_WAIT_S = 30.0
"""How long a finished request's unreported saves are waited for (its manifest's last blocks);
past it, the request is forgotten and those blocks stay out of its manifest (they are still
found by their hashes)."""

# A lookup answer is reused for this long when vLLM asks again about the same request (it does
# when it could not schedule it); the worker verifies every block anyway.
_LOOKUP_TTL_S = 1.0


class SchedulerSide:
    def __init__(self, *, config: ConnectorConfig, fingerprint: ModelFingerprint,
                 store: TieredStore | None, block_size: int, num_layers: int,
                 counters: Counts, event_medium: str | None = None,
                 groups: tuple[KVGroup, ...] | None = None,
                 group_fingerprints: tuple[ModelFingerprint, ...] | None = None) -> None:
        """`store` is None when it lives in the worker's process: lookups and manifest writes
        then travel in the step metadata. `event_medium` None: publish no KV events.
        `groups`, `group_fingerprints`: vLLM's KV cache groups and the fingerprint each
        group's blocks are keyed by (None: one group, keyed by `fingerprint`); `fingerprint`
        keys the manifests."""
        self._event_medium = event_medium
        self._events: list[Any] = []
        self._config = config
        self._fp = fingerprint
        self._groups = groups or single_group()
        self._group_fps = group_fingerprints or (fingerprint,)
        if len(self._group_fps) != len(self._groups):
            raise ValueError("one fingerprint per KV cache group")
        self._store = store
        self._block_tables: Callable[[str], tuple[list[int], ...]] | None = None
        self._bs = block_size
        self._num_layers = num_layers
        self._interval = window_safe_interval(config.checkpoint_interval(block_size),
                                              self._groups, block_size)
        if config.durability is not None and (config.checkpoint_tokens or 0) > block_size:
            log.warning("kvkeep: durability saves every block as it completes; checkpoint_tokens "
                        "%d is not used", config.checkpoint_tokens)
        self._counters = counters
        self._reqs: dict[str, TrackedRequest] = {}
        self._finished_last_step: list[str] = []
        self._probes: list[Probe] = []
        self._relay: ManifestRelay | None = None
        # A store whose tiers all answer from memory is asked inline (a dictionary read);
        # one with tiers across the network gets its lookups off vLLM's scheduler loop.
        self._background = (BackgroundLookups(store)
                            if store is not None and not store.answers_in_process else None)
        self._in_process: tuple[bool, ...] = () if store is None else store.in_process
        self._cost = (None if store is None else RestoreCostModel(
            store.tiers, block_size=block_size,
            block_bytes=sum(block_bytes_of(fp) for fp in self._group_fps),
            enabled=config.restore_policy == "cost",
            prefill_tokens_per_s=config.prefill_tokens_per_s, metrics=store.metrics))
        # The previous step: (when its metadata was built, its scheduled tokens, whether it
        # loaded KV, its requests), to time it when the next one is built.
        self._last_step: tuple[float, int, bool, frozenset[str]] | None = None
        self._manifests: ManifestSink
        if store is None:
            self._manifests = self._relay = ManifestRelay()
        else:
            self._manifests = ManifestWriter(store, counters)

    # -- vLLM scheduler API --------------------------------------------------------------------

    def bind_block_tables(self, block_ids: Callable[[str], tuple[list[int], ...]]) -> None:
        """vLLM's KV cache manager's current block ids of a request, per group: a sliding
        window frees blocks by putting the null block in their place, which the step's
        scheduler output (new block ids only) does not show."""
        self._block_tables = block_ids

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._track(request)
        if not tracked.params.usable_for(self._num_layers):
            self._counters.add(Count.RESTORE_NONE if tracked.params.mode == "none"
                               else Count.PARTIAL_LAYER_UNUSABLE)
            return 0, False
        if request.skip_reading_prefix_cache or tracked.load_failed:
            return 0, False
        local = num_computed_tokens // self._bs
        # vLLM must compute at least one token to sample from: never claim the last one.
        limit = min(len(request.block_hashes), (request.num_tokens - 1) // self._bs)
        tracked.local_blocks = local
        if limit <= local:
            return 0, False
        hit = self._lookup(tracked, local, limit - local)
        if hit is None:
            return None, False  # the worker answers with the next step's output
        if hit == 0:
            return 0, False
        return hit * self._bs, tracked.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        tracked = self._track(request)
        tracked.group_ids = [list(ids) for ids in blocks.get_block_ids()]
        if num_external_tokens <= 0 or tracked.pending_loads:
            return
        count = num_external_tokens // self._bs
        first = tracked.local_blocks
        if tracked.block_count < first + count:
            # vLLM allocated fewer blocks than it agreed to load: a broken invariant upstream.
            raise RuntimeError(f"kvkeep: {request.request_id} has {tracked.block_count} "
                               f"blocks for {first + count}")
        # An asynchronous load makes only its own request wait: it gets the longer hinted
        # deadline, since giving up means recomputing the prefix, a prefill every request in
        # the batch waits for (measured: benchmarks.stall's engine part).
        deadline_s = (self._config.hinted_restore_deadline_s if tracked.load_async
                      else self._deadline_s(tracked))
        # A group's null entries (outside a sliding window) are neither loaded nor attended.
        tracked.pending_loads = tuple(
            LoadSpec(run, is_async=tracked.load_async, deadline_s=deadline_s)
            for run in self._runs(tracked, first, first + count) if len(run))
        tracked.loading_async = tracked.load_async
        if tracked.loading_async:
            self._counters.add(Count.ASYNC_LOADS)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepMetadata:
        self._purge_finished()
        if not scheduler_output.num_scheduled_tokens and any(
                tracked.loading_async for tracked in self._reqs.values()):
            # Nothing to compute, an asynchronous load to wait for: vLLM's loop would spin
            # through empty steps holding the GIL that the loader's threads need (measured:
            # 45k empty steps in one benchmarks.stall arm). A step with work never waits here.
            time.sleep(_IDLE_STEP_S)
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        for tracked in self._reqs.values():
            loads.extend(tracked.pending_loads)
            tracked.pending_loads = ()
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            fresh = self._reqs.get(new.req_id)
            if fresh is None:
                continue
            fresh.group_ids = [list(ids) for ids in new.block_ids]
            done = (new.num_computed_tokens + scheduled[new.req_id]
                    - len(spec_tokens.get(new.req_id, ())))
            self._plan_saves(fresh, done, saves)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            running = self._reqs.get(req_id)
            if running is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                running.group_ids = ([list(ids) for ids in new_ids] if new_ids is not None
                                     else [[] for _ in self._groups])
            elif new_ids is not None:
                for mine, more in zip(running.group_ids, new_ids, strict=True):
                    mine.extend(more)
            done = (cached.num_computed_tokens[i] + scheduled[req_id]
                    - len(spec_tokens.get(req_id, ())))
            self._plan_saves(running, done, saves)
        saves.extend(self._flushes())
        self._time_step(scheduler_output, bool(loads))
        probes, self._probes = self._probes, []
        manifests = self._relay.take() if self._relay is not None else ()
        return StepMetadata(tuple(loads), tuple(saves), tuple(probes), manifests)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        report = output.kv_connector_worker_meta
        touched: set[str] = set()
        if isinstance(report, WorkerReport):
            for answer in report.probes:
                tracked = self._reqs.get(answer.req_id)
                if tracked is not None and tracked.probe is not None \
                        and tracked.probe.asks(answer.first, answer.count):
                    tracked.probe = None
                    self._record_lookup(tracked, LookupAnswer(
                        answer.first, answer.count, answer.hit, time.monotonic()),
                        network=answer.network)
            for load in report.loads:
                if (tracked := self._reqs.get(load.req_id)) is not None:
                    tracked.restored_blocks += load.restored
            for save in report.saves:
                tracked = self._reqs.get(save.req_id)
                if tracked is None:
                    continue
                hashes = tracked.request.block_hashes
                if save.index >= len(hashes) or bytes(hashes[save.index]) != save.block_hash:
                    continue  # a stale report (the request was preempted and re-planned)
                if save.ok:
                    tracked.saved.add(save.index)
                    touched.add(save.req_id)
                else:
                    # Also undoes an earlier "present" in the same report: a block found in
                    # the store that then failed to load is gone (or bad) and must be saved.
                    tracked.saved.discard(save.index)
                    tracked.saved_prefix = min(tracked.saved_prefix, save.index)
                    tracked.planned = min(tracked.planned, save.index)
                    if not save.retry_now:  # the store refused: wait for the next checkpoint
                        tracked.hold_until_tokens = (tracked.request.num_computed_tokens
                                                     + self._interval)
        for req_id in touched:
            tracked = self._reqs[req_id]
            while tracked.saved_prefix in tracked.saved:
                tracked.saved_prefix += 1
            self._maybe_write_manifest(tracked)
            self._maybe_publish(tracked)
        for req_id in output.finished_sending or ():
            if (tracked := self._reqs.get(req_id)) is not None:
                tracked.flush = "none"
        for req_id in output.finished_recving or ():
            if (tracked := self._reqs.get(req_id)) is not None:
                tracked.loading_async = False
        for req_id in getattr(output, "failed_recving", ()) or ():
            # A whole request's load failed (several KV cache groups): vLLM recomputes it
            # from the start. Its lookup answer is stale (the store dropped what failed), and
            # the store just failed it: it computes, rather than be offered the same blocks.
            if (tracked := self._reqs.get(req_id)) is not None:
                tracked.load_failed = True
                tracked.lookup = None
                tracked.restored_blocks = 0

    def request_finished(self, request: Request, block_ids: Sequence[Sequence[int]]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM finished `request`; `block_ids`: its blocks per KV cache group."""
        tracked = self._reqs.get(request.request_id)
        if tracked is None:
            return False, None
        tracked.finished = True
        tracked.finished_at = time.monotonic()
        tracked.group_ids = [list(ids) for ids in block_ids]
        done = min(request.num_computed_tokens // self._bs, len(request.block_hashes),
                   tracked.block_count)
        # Completed blocks that no checkpoint covered yet: save them before vLLM frees them.
        # Not while an asynchronous load is still filling them: they hold no KV yet.
        if done > tracked.planned and not tracked.loading_async:
            tracked.flush = "wanted"
        return tracked.flush == "wanted", self._response(tracked)

    def has_pending_work(self) -> bool:
        """Probes or manifests waiting for a step to carry them to the worker (keeps vLLM's
        engine loop stepping when nothing else runs)."""
        return (bool(self._probes) or self._manifests.pending
                or (self._background is not None and self._background.pending)
                or any(self._reqs[r].saves_in_flight for r in self._finished_last_step
                       if r in self._reqs))

    def drain_manifests(self, timeout: float = 10.0) -> None:
        """Wait until every manifest handed to the writer so far is written (tests, shutdown)."""
        self._manifests.drain(timeout)

    def shutdown(self) -> None:
        if self._background is not None:
            self._background.close()
        self._manifests.shutdown()

    # -- helpers -------------------------------------------------------------------------------

    def _track(self, request: Request) -> TrackedRequest:
        tracked = self._reqs.get(request.request_id)
        if tracked is not None and tracked.request is request:
            return tracked
        try:
            params = parse_params(request.kv_transfer_params)
        except ValueError as exc:
            log.warning("kvkeep: ignoring kv_transfer_params of %s: %s", request.request_id, exc)
            self._counters.add(Count.BAD_PARAMS)
            params = RestoreParams()
        if params.hinted:
            self._counters.add(Count.RESTORES_HINTED)
        tracked = TrackedRequest(request, namespace_for(self._config.tenant, request.cache_salt),
                                 params, now_us())
        self._reqs[request.request_id] = tracked
        return tracked

    def _deadline_s(self, tracked: TrackedRequest) -> float:
        return self._config.restore_deadline_for(hinted=tracked.params.hinted)

    def _lookup(self, tracked: TrackedRequest, first: int, count: int) -> int | None:
        """Blocks of [first, first+count) the store holds as a prefix; None: ask again later."""
        now = time.monotonic()
        cached = tracked.lookup
        if cached is not None and cached.answers(first, count) and now - cached.at < _LOOKUP_TTL_S:
            return cached.hit
        hashes = tracked.request.block_hashes[first:first + count]
        if self._store is None:
            return self._probe(tracked, first, count, now)
        if self._background is not None:
            return self._lookup_behind(self._background, tracked, first, count, hashes, now)
        keys = self._keys(tracked, hashes)
        deadline = now + self._deadline_s(tracked)
        self._counters.add(Count.LOOKUPS)
        try:
            tiers = self._held(_prefix(self._store.locate(keys, deadline=deadline)))
        except KVKeepError:
            log.warning("kvkeep: lookup failed; computing instead", exc_info=True)
            self._counters.add(Count.LOOKUP_ERRORS)
            tiers = ()
        if time.monotonic() >= deadline:
            # The store answered with what it had found in time; report none of it, since a
            # store this slow would make the load late too.
            self._counters.add(Count.LOOKUP_DEADLINE)
            tiers = ()
        return self._record_lookup(tracked, LookupAnswer(first, count, len(tiers), now), tiers)

    def _lookup_behind(self, lookups: BackgroundLookups, tracked: TrackedRequest, first: int,
                       count: int, hashes: Sequence[Any], now: float) -> int | None:
        """The lookup of a store with network tiers: the in-memory tiers inline; the rest on
        the lookup thread, while vLLM asks again each step (None) up to the deadline. A
        request still waiting costs a dictionary read per step: its keys are built once."""
        assert self._store is not None
        probe = tracked.probe
        if probe is not None and probe.asks(first, count):
            finished = lookups.take(tracked.request_id)
            if finished is not None:
                tracked.probe = None
                if finished.failed:
                    self._counters.add(Count.LOOKUP_ERRORS)
                held = self._held(finished.tiers)
                tiers = held if len(held) >= probe.inline_hit else probe.inline_tiers
                return self._record_lookup(
                    tracked, LookupAnswer(first, count, len(tiers), now), tiers)
            if now - probe.sent_at < self._deadline_s(tracked):
                return None
            # The network tiers did not answer in time (a slow or dead daemon): restore what
            # the in-memory tiers hold, compute the rest.
            self._counters.add(Count.LOOKUP_DEADLINE)
            lookups.forget(tracked.request_id)
            tracked.probe = None
            return self._record_lookup(
                tracked, LookupAnswer(first, count, probe.inline_hit, now), probe.inline_tiers)
        self._counters.add(Count.LOOKUPS)
        keys = self._keys(tracked, hashes)
        try:
            inline = self._held(_prefix(self._store.locate(keys, in_process_only=True)))
        except KVKeepError:
            log.warning("kvkeep: lookup failed; computing instead", exc_info=True)
            self._counters.add(Count.LOOKUP_ERRORS)
            return self._record_lookup(tracked, LookupAnswer(first, count, 0, now), ())
        if len(inline) == count:
            return self._record_lookup(tracked, LookupAnswer(first, count, count, now), inline)
        tracked.probe = PendingProbe(first, count, now, inline)
        lookups.submit(tracked.request_id, first, keys, now + self._deadline_s(tracked))
        return None

    def _record_lookup(self, tracked: TrackedRequest, answer: LookupAnswer,
                       tiers: Sequence[int] | None = None, network: bool = False) -> int:
        """Count a lookup's answer and decide how much of its hit to restore (`tiers`: where
        each hit block lies; None: not known, all of it) and how to load it (`network`: with
        `tiers` unknown, whether the hit lies on a network tier); the blocks to restore."""
        self._counters.add(Count.LOOKUP_HIT_BLOCKS, answer.hit)
        restore = answer.hit
        if tiers is not None and self._cost is not None and answer.hit:
            decision = self._cost.decide(tiers[:answer.hit])
            restore = decision.restore
            self._counters.add({"restore": Count.DECIDED_RESTORE,
                                "recompute": Count.DECIDED_RECOMPUTE,
                                "partial": Count.DECIDED_PARTIAL}[decision.kind])
            self._counters.add(Count.DECIDED_RESTORE_TOKENS, decision.restore * self._bs)
            self._counters.add(Count.DECIDED_RECOMPUTE_TOKENS, decision.recompute * self._bs)
            if decision.recompute:
                log.debug("kvkeep: %s restores %d of %d stored blocks (load %.4f s, compute "
                          "%.4f s)", tracked.request_id, decision.restore, answer.hit,
                          decision.load_s, decision.compute_s or 0.0)
        if tiers is not None:
            network = any(not self._in_process[tier] for tier in tiers[:restore])
        # With several KV cache groups every load is asynchronous: vLLM maps a failed block
        # back to its request with one group only, so a failure is reported per request
        # (`failed_recving`), which only an asynchronous load can be.
        tracked.load_async = len(self._groups) > 1 or self._config.load_mode == "async" or (
            self._config.load_mode == "auto" and network and self._others_live(tracked))
        # What vLLM is told (and reuses on a second ask) is what the decision kept.
        tracked.lookup = LookupAnswer(answer.first, answer.count, restore, answer.at)
        self._note_hint(tracked, answer)
        return restore

    def _others_live(self, tracked: TrackedRequest) -> bool:
        """Whether another request is in the engine: a load inside the forward pass would
        hold its steps. A request alone loads inline: parking it would only add a step to its
        first token (measured: `benchmarks.restore`'s lone requests)."""
        return any(not other.finished for req_id, other in self._reqs.items()
                   if req_id != tracked.request_id)

    def _note_hint(self, tracked: TrackedRequest, answer: LookupAnswer) -> None:
        params = tracked.params
        if params.hinted and not tracked.hint_checked:
            tracked.hint_checked = True
            missing = answer.count - answer.hit
            self._counters.add(Count.HINTED_BLOCKS_MISSING, missing)
            if missing:
                # The session's KV should all be in the store: what is not was never
                # checkpointed (lost with its worker, or late) or was evicted since.
                log.info("kvkeep: %s (%s from %s): the store holds %d of %d blocks; the "
                         "rest is recomputed", tracked.request_id, params.reason,
                         params.previous_worker or "an unnamed worker", answer.hit,
                         answer.count)

    def _time_step(self, scheduler_output: SchedulerOutput, loaded: bool) -> None:
        """The engine's prefill rate, for the decision: the previous step took from its
        metadata to this one's. Not used when it loaded KV in its forward pass, or when none
        of its requests runs again now (the engine may have idled in between)."""
        if self._cost is None:
            return
        now = time.monotonic()
        scheduled = scheduler_output.num_scheduled_tokens
        last = self._last_step
        if last is not None:
            at, tokens, had_loads, req_ids = last
            if not had_loads and any(req_id in scheduled for req_id in req_ids):
                self._cost.observe_step(tokens, now - at)
        total = sum(scheduled.values())
        self._last_step = (now, total, loaded, frozenset(scheduled)) if total else None

    @property
    def restore_cost(self) -> RestoreCostModel | None:
        """The decision's prices (None without the store in this process)."""
        return self._cost

    def _probe(self, tracked: TrackedRequest, first: int, count: int, now: float) -> int | None:
        probe = tracked.probe
        deadline_s = self._deadline_s(tracked)
        if probe is not None and probe.asks(first, count):
            if now - probe.sent_at < deadline_s:
                return None
            # The worker did not answer in time (a slow store, a long step): compute.
            self._counters.add(Count.LOOKUP_DEADLINE)
            tracked.probe = None
            return self._record_lookup(tracked, LookupAnswer(first, count, 0, now))
        self._counters.add(Count.LOOKUPS)
        tracked.probe = PendingProbe(first, count, now)
        hashes = tracked.request.block_hashes[first:first + count]
        self._probes.append(Probe(tracked.request_id, tracked.namespace.label, first,
                                  tuple(bytes(h) for h in hashes), deadline_s))
        return None

    def _plan_saves(self, tracked: TrackedRequest, done_tokens: int,
                    out: list[SaveSpec]) -> None:
        request = tracked.request
        complete = min(done_tokens // self._bs, len(request.block_hashes), tracked.block_count)
        if complete <= tracked.planned or done_tokens < tracked.hold_until_tokens:
            return
        in_prefill = done_tokens <= request.num_prompt_tokens
        if not in_prefill and (complete - tracked.planned) * self._bs < self._interval:
            return
        # Only here are the ids possibly stale: `update_state_after_alloc` and
        # `request_finished` hand over vLLM's current ones.
        self._refresh_freed(tracked)
        out.extend(SaveSpec(run) for run in self._runs(tracked, tracked.planned, complete)
                   if len(run))
        tracked.planned = complete

    def _flushes(self) -> list[SaveSpec]:
        flushes: list[SaveSpec] = []
        for tracked in self._reqs.values():
            if tracked.flush != "wanted":
                continue
            request = tracked.request
            done = min(request.num_computed_tokens // self._bs, len(request.block_hashes),
                       tracked.block_count)
            # Even an empty flush is sent (one per group): its completion is what lets vLLM
            # free the blocks.
            first = min(tracked.planned, done)
            flushes.extend(SaveSpec(run, flush=True) for run in self._runs(tracked, first, done))
            tracked.planned = max(tracked.planned, done)
            tracked.flush = "sent"
        return flushes

    def _runs(self, tracked: TrackedRequest, first: int, stop: int) -> list[BlockRun]:
        """Block indices [first, stop) of `tracked` as one run per KV cache group, each without
        the group's null entries: a sliding window frees a prefix of a request's blocks, so
        what a group still holds of the range is the part after its last null entry (never
        empty for a full-attention group). Runs may be empty."""
        request = tracked.request
        runs: list[BlockRun] = []
        for group, ids in zip(self._groups, tracked.group_ids, strict=True):
            span = ids[first:stop]
            start = first + next((len(span) - i for i, block in enumerate(reversed(span))
                                  if block == NULL_BLOCK_ID), 0)
            runs.append(BlockRun(
                req_id=request.request_id,
                namespace=tracked.namespace.label,
                first=start,
                block_ids=tuple(ids[start:stop]),
                block_hashes=tuple(bytes(h) for h in request.block_hashes[start:stop]),
                group=group.index,
            ))
        return runs

    def _refresh_freed(self, tracked: TrackedRequest) -> None:
        """Null the entries a sliding window freed since the request's ids were last read (a
        freed block may already hold another request's KV: it must never be saved)."""
        if all(group.window is None for group in self._groups):
            return
        if self._block_tables is not None:  # (empty lists for a request it no longer holds)
            tracked.group_ids = [list(ids) for ids in self._block_tables(tracked.request_id)]
            return
        # No manager to ask: null everything below each window's start, as vLLM would by now
        # (counting this step's tokens as done frees at most more, never less).
        computed = tracked.request.num_computed_tokens
        for group, ids in zip(self._groups, tracked.group_ids, strict=True):
            for i in range(min(group.first_kept_block(computed, self._bs), len(ids))):
                ids[i] = NULL_BLOCK_ID

    def _keys(self, tracked: TrackedRequest, hashes: Sequence[Any]) -> list[BlockKey]:
        """The store keys of `hashes`: block-major, one per KV cache group."""
        return [BlockKey.of(fp, tracked.namespace, bytes(h))
                for h in hashes for fp in self._group_fps]

    def _held(self, tiers: Sequence[int]) -> tuple[int, ...]:
        """Per block, the slowest tier holding one of its groups, from a held prefix of
        `_keys` (a block counts only when every group holds it)."""
        width = len(self._group_fps)
        if width == 1:
            return tuple(tiers)
        return tuple(max(tiers[i:i + width])
                     for i in range(0, len(tiers) - width + 1, width))

    def _purge_finished(self) -> None:
        # Reports for a step arrive in the same update as `request_finished`, so a finished
        # request is dropped one step later, once they have been read. Not while saves it
        # planned are unreported (saves never hold a step, so a slow store reports them
        # steps after the request ended): its manifest is written from those reports, and a
        # one-step request would otherwise leave none. `SAVE_REPORT_WAIT_S` bounds the wait.
        now = time.monotonic()
        for req_id in self._finished_last_step:
            tracked = self._reqs.get(req_id)
            if tracked is None or not tracked.finished or tracked.flush != "none":
                continue
            if tracked.saves_in_flight and now - tracked.finished_at < SAVE_REPORT_WAIT_S:
                continue
            del self._reqs[req_id]
            if self._background is not None:
                self._background.forget(req_id)
        self._finished_last_step = [r for r, t in self._reqs.items() if t.finished]

    def take_events(self) -> list[Any]:
        """The `BlockStored` events since the last call (vLLM publishes them each step)."""
        events, self._events = self._events, []
        return events

    def _maybe_publish(self, tracked: TrackedRequest) -> None:
        if self._event_medium is None or tracked.saved_prefix <= tracked.published_blocks:
            return
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        request = tracked.request
        count = min(tracked.saved_prefix, len(request.block_hashes))
        # The extra keys vLLM hashed each block with (a tenant's cache_salt roots the first),
        # published as vLLM publishes its own: without them a salted request's store-held
        # blocks would never match it in the router's index.
        extra: list[tuple[Any, ...] | None] = []
        mm_index = 0
        for i in range(count):
            keys, mm_index = generate_block_hash_extra_keys(
                request, i * self._bs, (i + 1) * self._bs, mm_index)
            extra.append(keys)
        self._events.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in request.block_hashes[:count]],
            parent_block_hash=None, token_ids=list(request.all_token_ids[:count * self._bs]),
            block_size=self._bs, lora_id=None, medium=self._event_medium, lora_name=None,
            extra_keys=to_event_extra_keys(extra)))
        tracked.published_blocks = count
        self._counters.add(Count.PUBLISHED_BLOCKS, count)

    def _maybe_write_manifest(self, tracked: TrackedRequest) -> None:
        session = tracked.params.session_id
        if session is None or tracked.saved_prefix <= tracked.manifest_blocks:
            return
        request = tracked.request
        tracked.generation = manifest_generation(started_us=tracked.started_us,
                                                 epoch=tracked.params.epoch,
                                                 previous=tracked.generation)
        manifest = SessionManifest(
            key=SessionKey.of(self._fp, tracked.namespace, session),
            block_hashes=tuple(BlockHash(bytes(h))
                               for h in request.block_hashes[:tracked.saved_prefix]),
            token_count=tracked.saved_prefix * self._bs,
            generation=tracked.generation,
            token_ids=tuple(request.all_token_ids),
        )
        tracked.manifest_blocks = tracked.saved_prefix
        self._manifests.submit(manifest)

    def _response(self, tracked: TrackedRequest) -> dict[str, Any] | None:
        """What the request's final output carries back in `kv_transfer_params` (the router
        turns it into X-KVKeep-* headers)."""
        restored = {"restored_tokens": tracked.restored_blocks * self._bs}
        if tracked.params.session_id is None:
            return restored if tracked.restored_blocks else None
        return {"session_id": tracked.params.session_id,
                "checkpointed_tokens": tracked.saved_prefix * self._bs,
                "manifest_generation": tracked.generation, **restored}

    @property
    def tracked_requests(self) -> Sequence[str]:
        return tuple(self._reqs)

    def unprotected_tokens(self) -> tuple[int, int]:
        """(all, the most of one request): tokens in complete blocks that vLLM has computed
        and the store does not hold yet, over the requests being served. What a node's death
        now would lose (the recovery point, per request): checkpoint batching, saves still
        in flight, and saves skipped or failed while the store is behind all show here."""
        total = worst = 0
        for tracked in self._reqs.values():
            if tracked.finished:
                continue
            unsaved = max(tracked.request.num_computed_tokens // self._bs
                          - tracked.saved_prefix, 0) * self._bs
            total += unsaved
            worst = max(worst, unsaved)
        return total, worst


def _prefix(where: Sequence[int]) -> tuple[int, ...]:
    """The tiers of the held prefix of a `TieredStore.locate` answer."""
    stop = next((i for i, tier in enumerate(where) if tier < 0), len(where))
    return tuple(where[:stop])
