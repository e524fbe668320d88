"""The discrete-event simulation: clients, the router (its own code, via the adapter), N
replicas, kvkeep's store, and replica failures.

Time advances from event to event (a heap of callbacks). A replica runs one step at a time
and schedules the next when it ends; the router decides at each arrival from what it has been
shown: metrics scraped every `scrape_interval_s`, KV events `kv_event_delay_s` after the step
that produced them, its own optimistic charges. A killed replica loses its cache (and its
node's host tier, when the node goes with it); its streams break and resume elsewhere through
the router; its lease expires `lease_ttl_s` later, when the router forgets it and rebinds its
sessions.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from benchmarks.sim.engine import Job, Replica
from benchmarks.sim.params import SimParams
from benchmarks.sim.router_adapter import (
    RouteRefused,
    RouterInput,
    SimPolicy,
    SimRouter,
)
from benchmarks.sim.store import KVStore
from benchmarks.sim.workloads import RequestSpec, Stage

__all__ = ["Record", "Kill", "Simulation", "SimResult", "Workload"]

_MAX_ATTEMPTS = 3  # router/config.py max_attempts
_MAX_RESUMES = 2  # router/config.py max_resumes


class Workload(Protocol):
    name: str
    stages: list[Stage]

    def start(self, submit: Callable[[float, RequestSpec], None], now: float) -> None: ...

    def finished(self, spec: RequestSpec, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Kill:
    """Kill `replicas` at time `at` (seconds into the run); `node` also loses the node's
    host tier (the daemon dies with it)."""

    at: float
    replicas: tuple[int, ...]
    node: bool = True


@dataclass(slots=True, eq=False)
class Record:
    """One client request, end to end (across resumptions)."""

    spec: RequestSpec
    sent_at: float
    first_token_at: float | None = None
    done_at: float | None = None
    delivered: int = 0
    failed: str | None = None
    workers: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    resumes: int = 0
    broken_at: float | None = None
    resumed_token_at: float | None = None
    cached_tokens: int = 0
    host_tokens: int = 0
    remote_tokens: int = 0
    preemptions: int = 0
    attempts: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def prompt_tokens(self) -> int:
        return len(self.spec.prompt.tokens)


@dataclass(slots=True)
class SimResult:
    policy: str
    records: list[Record]
    stages: list[Stage]
    stage_start: dict[int, float]
    replica_stats: list[dict[str, float]]
    decisions: dict[str, int]
    kills: list[Kill]
    affected_sessions: set[str]
    moved_sessions: int
    end: float
    index_blocks: int
    events_delivered: int


class Simulation:
    def __init__(self, params: SimParams, spec: SimPolicy, workload: Workload, *,
                 replicas: int = 8, seed: int = 0, kills: Sequence[Kill] = (),
                 store: bool | None = None) -> None:
        self.params = params
        self.spec = spec
        self.workload = workload
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self._live = 0  # scheduled events other than the scrape timer
        self.names = [f"w{i}" for i in range(replicas)]
        use_store = spec.store if store is None else store
        nodes = -(-replicas // params.store.replicas_per_node)
        self.store = KVStore(params.store, params.model, params.engine.block_size, nodes) \
            if use_store else None
        self.router = SimRouter(spec, self.names, model=params.model.name,
                                block_size=params.engine.block_size, now=self._clock,
                                seed=seed, tokenize_s=params.router.tokenize_s)
        events = self.router.uses_kv_events
        self.replicas = [Replica(i, params.engine, params.timing, self, store=self.store,
                                 record_events=events,
                                 on_store_events=self._store_events
                                 if events and spec.store_events else None)
                         for i in range(replicas)]
        self.kills = list(kills)
        self.records: list[Record] = []
        self.affected: set[str] = set()
        self.moved_sessions = 0
        self.events_delivered = 0
        self._store_pending: dict[int, list[dict[str, Any]]] = {}

    def _clock(self) -> float:
        return self.now

    # --- the loop ----------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        if fn != self._scrape:
            self._live += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def run(self, until: float = float("inf")) -> SimResult:
        self.workload.start(self._submit, 0.0)
        self.at(0.0, self._scrape)
        for kill in self.kills:
            self.at(kill.at, self._kill, kill)
        heap = self._heap
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            if t > until:
                break
            self.now = t
            if fn != self._scrape:
                self._live -= 1
            fn(*args)
            if self._live == 0:
                break  # only the scrape timer is left
        self.router.close()
        return SimResult(
            self.spec.name, self.records, list(self.workload.stages),
            dict(getattr(self.workload, "started_at", {0: 0.0})),
            [{"steps": r.steps, "busy_s": r.busy_s, "prefill_tokens": r.prefill_tokens,
              "preemptions": r.preemptions, "evictions": r.pool.evictions,
              "sync_load_s": r.sync_load_s, "async_load_s": r.async_load_s,
              "save_s": r.save_s}
             for r in self.replicas],
            dict(self.router.decisions), self.kills, self.affected, self.moved_sessions,
            self.now, self.router.index_blocks, self.events_delivered)

    # --- clients -----------------------------------------------------------------------------
    def _submit(self, t: float, spec: RequestSpec) -> None:
        self.at(t, self._arrive, spec)

    def _arrive(self, spec: RequestSpec) -> None:
        record = Record(spec, self.now)
        self.records.append(record)
        prompt = spec.prompt
        wait = self.router.tokenize_wait(RouterInput(prompt.key, prompt.text, prompt.tokens,
                                                     len(spec.output), spec.session))
        if wait > 0.0:  # the router tokenizes the prompt first (a /tokenize round trip)
            self.at(self.now + wait, self._send, record, frozenset())
        else:
            self._send(record, frozenset())

    def _send(self, record: Record, tried: frozenset[str]) -> None:
        spec = record.spec
        done = record.delivered
        prompt = spec.prompt
        req = RouterInput(prompt.key, prompt.text, prompt.tokens, len(spec.output),
                          spec.session)
        for _ in range(_MAX_ATTEMPTS):
            record.attempts += 1
            try:
                routed = self.router.place(req, tried)
            except RouteRefused as exc:
                self._fail(record, f"HTTP {exc.status}")
                return
            replica = self.replicas[self.names.index(routed.worker)]
            if not replica.alive:  # connection refused: the proxy tries the next worker
                self.router.failed(routed, hard=True)
                tried = tried | {routed.worker}
                continue
            record.workers.append(routed.worker)
            record.reasons.append(routed.reason)
            if done:
                tokens = np.concatenate((prompt.tokens, spec.output[:done]))
                job = Job(spec.rid, tokens, prompt.hashes, spec.output[done:])
            else:
                job = Job(spec.rid, prompt.tokens, prompt.hashes, spec.output)
            job.owner = (record, routed)
            replica.submit(job)
            self._kick(replica)
            return
        self._fail(record, "no worker could serve the request")

    def _fail(self, record: Record, why: str) -> None:
        record.failed = why
        record.done_at = self.now
        self.workload.finished(record.spec, self.now)

    # --- replicas ----------------------------------------------------------------------------
    def _kick(self, replica: Replica) -> None:
        if not replica.alive or replica.busy_until is not None or not replica.has_work:
            return
        seconds = replica.start_step(self.now)
        if seconds <= 0.0:
            # idle but for asynchronous loads: step again when the first is done
            done = replica.next_load_done()
            if done is not None:
                self.at(done, self._load_done, replica, replica.epoch)
            return
        replica.busy_until = self.now + seconds
        self.at(replica.busy_until, self._step_end, replica, replica.epoch)

    def _step_end(self, replica: Replica, epoch: int) -> None:
        if epoch != replica.epoch or not replica.alive:
            return
        replica.busy_until = None
        replica.finish_step(self.now)
        if self.router.uses_kv_events:
            events = replica.pool.take_events()
            store_events = self._store_pending.pop(replica.index, None)
            if store_events:
                events.extend(store_events)  # one batch per step, as vLLM publishes
            if events:
                self._deliver(replica.index, events)
        self._kick(replica)

    def _load_done(self, replica: Replica, epoch: int) -> None:
        if epoch == replica.epoch and replica.alive:
            self._kick(replica)

    def _store_events(self, index: int, events: list[dict[str, Any]]) -> None:
        self._store_pending.setdefault(index, []).extend(events)

    def _deliver(self, index: int, events: list[dict[str, Any]]) -> None:
        self.at(self.now + self.params.router.kv_event_delay_s, self._events_arrive,
                self.names[index], events, self.now)

    def _events_arrive(self, worker: str, events: list[dict[str, Any]], sent: float) -> None:
        if self.router.knows(worker):
            self.router.kv_events(worker, events, sent)
            self.events_delivered += len(events)

    def _scrape(self) -> None:
        for name, replica in zip(self.names, self.replicas, strict=True):
            if replica.alive:
                running, waiting, kv = replica.load()
                self.router.scraped(name, running, waiting, kv, self.now)
        self.at(self.now + self.params.router.scrape_interval_s, self._scrape)

    # --- the engine's listener ---------------------------------------------------------------
    def first_token(self, job: Job, now: float) -> None:
        record, _ = job.owner
        if record.first_token_at is None:
            record.first_token_at = now
            record.cached_tokens = job.cached_tokens
            record.host_tokens = job.host_tokens
            record.remote_tokens = job.remote_tokens
        if record.broken_at is not None and record.resumed_token_at is None:
            record.resumed_token_at = now

    def finished(self, job: Job, now: float) -> None:
        record, routed = job.owner
        if record.first_token_at is None:
            self.first_token(job, now)
        record.delivered = len(record.spec.output)
        record.done_at = now
        record.preemptions += job.preemptions
        self.router.succeeded(routed, record.spec.prompt.tokens.tolist(),
                              record.spec.output.tolist())
        self.workload.finished(record.spec, now)

    # --- failures ----------------------------------------------------------------------------
    def _kill(self, kill: Kill) -> None:
        for i in kill.replicas:
            replica = self.replicas[i]
            name = self.names[i]
            self.affected.update(self.router.bound_sessions(name))
            broken = replica.kill()
            if kill.node and self.store is not None:
                self.store.node_lost(self.store.node_of(i))
            for job in broken:
                record, routed = job.owner
                if record.spec.session is not None:
                    self.affected.add(record.spec.session)
                record.delivered += job.generated
                record.preemptions += job.preemptions
                self.router.failed(routed, hard=True)
                if record.resumes >= _MAX_RESUMES:
                    self._fail(record, "worker failed mid-stream")
                    continue
                record.resumes += 1
                record.broken_at = self.now
                record.resumed_token_at = None
                self.at(self.now, self._send, record, frozenset({name}))
            self.at(self.now + self.params.router.lease_ttl_s, self._lease_expired, name)

    def _lease_expired(self, name: str) -> None:
        self.moved_sessions += self.router.worker_gone(name)
