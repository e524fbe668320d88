"""One simulated vLLM replica: continuous batching step by step (vLLM v1's scheduler).

Each step: every decoding sequence gets one token, prefills in progress continue, then waiting
requests are admitted first come first served while the token budget (`max_num_batched_tokens`,
chunked prefill), `max_num_seqs` and free KV blocks allow. A new request first takes the
longest cached prefix of its block hashes (at least one token is always computed), then the
longest run after it that kvkeep's store holds (loaded, not computed). Decoding that finds no
free block preempts the most recently admitted sequence (recompute, as vLLM v1 does).

Loads follow the connector's `load_mode` (connectors/vllm/scheduler_side.py `_record_lookup`):
a synchronous load runs inside the step that admits its request, so the whole batch waits for
it; an asynchronous one parks its request (vLLM's WAITING_FOR_REMOTE_KVS, its blocks allocated,
outside `running`) until the load is done, and the first step starting after that schedules
it ahead of the waiting queue (vLLM puts the requests it skipped back at the queue's front).
"auto" loads asynchronously when the hit reaches a network tier (the remote daemons) and
another request is live on the replica; host-tier hits and lone requests load in the step.

Cost per step is O(prefilling sequences + sequences crossing a block boundary or finishing):
decode progress is one counter per replica, and each decoding sequence is only touched when
it needs a block or ends (two heaps keyed by that counter).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

import numpy as np

from benchmarks.sim.cache import BlockPool
from benchmarks.sim.params import EngineParams, TimingParams
from benchmarks.sim.store import KVStore
from benchmarks.sim.timing import StepWork, step_seconds
from benchmarks.sim.tokens import block_hashes

__all__ = ["Job", "JobState", "Replica", "EngineListener"]


class JobState(IntEnum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    DONE = 3
    BROKEN = 4
    LOADING = 5  # an asynchronous load in flight (vLLM's WAITING_FOR_REMOTE_KVS)


@dataclass(slots=True, eq=False)
class Job:
    """One request as the engine runs it. `prompt` holds the tokens to prefill (a resumed
    stream's prompt includes what it had generated); `output` the tokens it will generate."""

    uid: int
    prompt: np.ndarray
    prompt_hashes: list[int]
    output: np.ndarray
    owner: Any = None  # the client-side record (the cluster's)
    state: JobState = JobState.WAITING
    generated: int = 0
    computed: int = 0
    held: list[int] = field(default_factory=list)
    private: int = 0
    promoted: int = 0
    first_computed_block: int = 0
    seq_hashes: list[int] = field(default_factory=list)
    dec_base: int = 0
    gen_base: int = 0
    epoch: int = 0
    chunk: int = 0
    load_s: float = 0.0  # its store load's duration (async: what it waits, alone)
    admitted: bool = False
    # what the first prefill found (for hit rates)
    cached_tokens: int = -1
    host_tokens: int = 0
    remote_tokens: int = 0
    preemptions: int = 0

    @property
    def max_tokens(self) -> int:
        return len(self.output)

    @property
    def target(self) -> int:
        """Tokens that need KV before the next token can be sampled."""
        return len(self.prompt) + self.generated

    def tokens(self, start: int, end: int) -> np.ndarray:
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p:end - p]
        return np.concatenate((self.prompt[start:], self.output[:end - p]))


class EngineListener(Protocol):
    def first_token(self, job: Job, now: float) -> None: ...

    def finished(self, job: Job, now: float) -> None: ...


class Replica:
    """A vLLM engine with a prefix cache, optionally backed by kvkeep's store."""

    def __init__(self, index: int, engine: EngineParams, timing: TimingParams,
                 listener: EngineListener, *, store: KVStore | None = None,
                 record_events: bool = True,
                 on_store_events: Callable[[int, list[dict[str, Any]]], None] | None = None
                 ) -> None:
        self.index = index
        self.engine = engine
        self.timing = timing
        self.bs = engine.block_size
        self.pool = BlockPool(engine.num_blocks, engine.block_size, record_events=record_events)
        self.listener = listener
        self.store = store
        self.on_store_events = on_store_events
        self.record_events = record_events
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.load_mode = store.params.load_mode if store is not None else "sync"
        # asynchronous loads in flight: (done at, tie-break, job); and jobs whose load is done,
        # for the next step to schedule first
        self._loading: list[tuple[float, int, Job]] = []
        self.loaded: deque[Job] = deque()
        self._unsaved = 0  # blocks saved since the last step was timed: their gather copies
        self.decoding: set[Job] = set()
        self.counter = 0
        # (decode counter, tie-break, job epoch, job): when a sequence needs its next block,
        # and when it has generated its last token
        self._alloc_heap: list[tuple[int, int, int, Job]] = []
        self._finish_heap: list[tuple[int, int, int, Job]] = []
        self._seq = 0
        self.alive = True
        self.busy_until: float | None = None
        self.epoch = 0  # of the replica's life; a step scheduled before a kill is void
        self._step_prefill: list[tuple[Job, int]] = []
        self._step_decodes = 0
        # counters
        self.steps = 0
        self.busy_s = 0.0
        self.prefill_tokens = 0
        self.preemptions = 0
        self.sync_load_s = 0.0  # step time spent waiting for loads
        self.async_load_s = 0.0  # load time requests waited alone
        self.save_s = 0.0  # step time spent gathering blocks to save

    # --- the cluster's side ------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        job.state = JobState.WAITING
        self.waiting.append(job)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._loading or self.loaded)

    def next_load_done(self) -> float | None:
        """When the earliest asynchronous load in flight ends (the replica must step then,
        even with nothing else to do), or None."""
        return self._loading[0][0] if self._loading else None

    def load(self) -> tuple[int, int, float]:
        """What vLLM's /metrics says: running, waiting, KV-cache usage."""
        return len(self.running), len(self.waiting), self.pool.usage()

    def start_step(self, now: float) -> float:
        """Schedule one step starting at `now`; returns its duration (0.0: nothing to do)."""
        budget = self.engine.max_num_batched_tokens
        self._step_prefill = []
        load_s = 0.0
        self._finish_loads(now)
        self._allocate_decode_blocks()
        n_dec = len(self.decoding)
        budget -= n_dec
        for job in list(self.running):
            if job.state is not JobState.PREFILL or budget <= 0:
                continue
            if job not in self.running:
                continue  # preempted while making room for an earlier one
            n = min(job.target - job.computed, budget)
            if not self._reserve(job, job.computed + n):
                continue
            job.chunk = n
            budget -= n
            self._step_prefill.append((job, n))
        while self.loaded and budget > 0 and len(self.running) < self.engine.max_num_seqs:
            job = self.loaded.popleft()
            job.state = JobState.PREFILL
            self.running.append(job)
            n = min(job.target - job.computed, budget)
            if not self._reserve(job, job.computed + n):
                break  # preempted itself for room: it waits again, its blocks now cached
            job.chunk = n
            budget -= n
            self._step_prefill.append((job, n))
        while self.waiting and budget > 0 and len(self.running) < self.engine.max_num_seqs:
            job = self.waiting[0]
            n, job_load = self._admit(job, budget, now)
            if n < 0:
                break
            self.waiting.popleft()
            if job.state is JobState.LOADING:
                continue  # parked until its load is done: no tokens, no step time
            budget -= n
            load_s += job_load
            self._step_prefill.append((job, n))
        prefill = sum(n for _, n in self._step_prefill)
        self._step_decodes = len(self.decoding)
        work = StepWork(prefill, self._step_decodes, len(self.running), self.pool.usage())
        seconds = step_seconds(work, self.timing, self.engine)
        if self.store is not None and seconds > 0.0:
            # Synchronous loads hold the step. Saves add their per-layer gather copies, charged
            # to the step after the one that computed the blocks (the totals are the same).
            save_s = self.store.save_step_s(self._unsaved)
            seconds += load_s + save_s
            self.sync_load_s += load_s
            self.save_s += save_s
        self._unsaved = 0
        if seconds > 0.0:
            self.steps += 1
            self.busy_s += seconds
            self.prefill_tokens += prefill
        return seconds

    def finish_step(self, now: float) -> None:
        """Apply the step scheduled by `start_step`, ending at `now`."""
        if self._step_decodes:
            self.counter += 1
            heap = self._finish_heap
            while heap and heap[0][0] <= self.counter:
                _, _, epoch, job = heapq.heappop(heap)
                if epoch == job.epoch and job.state is JobState.DECODE:
                    self._complete(job, now)
        for job, n in self._step_prefill:
            if job.state is not JobState.PREFILL:
                continue  # preempted later in the same scheduling pass
            job.computed += n
            self._promote_full(job)
            if job.computed >= job.target:
                self._prefill_done(job, now)
        self._step_prefill = []

    def kill(self) -> list[Job]:
        """The process dies: its jobs break, its cache is gone."""
        broken = (list(self.running) + list(self.loaded) + [job for _, _, job in self._loading]
                  + list(self.waiting))
        for job in broken:
            if job.state is JobState.DECODE:
                job.generated = job.gen_base + (self.counter - job.dec_base)
            job.state = JobState.BROKEN
            job.epoch += 1
        self.running.clear()
        self.waiting.clear()
        self.loaded.clear()
        self._loading.clear()
        self.decoding.clear()
        self._alloc_heap.clear()
        self._finish_heap.clear()
        self.pool.clear()
        self.pool.take_events()  # a dead process publishes nothing
        self.alive = False
        self.epoch += 1
        self.busy_until = None
        return broken

    def generated_now(self, job: Job) -> int:
        if job.state is JobState.DECODE:
            return job.gen_base + (self.counter - job.dec_base)
        return job.generated

    # --- scheduling --------------------------------------------------------------------------
    def _admit(self, job: Job, budget: int, now: float) -> tuple[int, float]:
        """Admit the head of the queue: prefix hit, store hit, blocks for its first chunk.
        Returns (tokens scheduled, synchronous load seconds) or (-1, 0) when its blocks do not
        fit; (0, 0) with the job LOADING when its load runs asynchronously."""
        bs = self.bs
        target = job.target
        self._ensure_hashes(job, target // bs)
        limit = (target - 1) // bs
        hashes = job.seq_hashes
        hit = self.pool.longest_hit(hashes, limit)
        host = remote = 0
        seconds = 0.0
        if self.store is not None and hit < limit:
            sh = self.store.lookup(self.index, hashes[hit:limit])
            host, remote, seconds = sh.host_blocks, sh.remote_blocks, sh.seconds
        if host + remote and self._loads_async(network=remote > 0):
            return self._park(job, hit, host, remote, seconds, now)
        start = (hit + host + remote) * bs
        n = min(target - start, budget)
        need = -(-(start + n) // bs) - hit
        if not self._claim(job, hit, need):
            return -1, 0.0
        job.first_computed_block = hit + host + remote
        job.computed = start
        job.chunk = n
        job.state = JobState.PREFILL
        job.load_s = seconds
        self._note_hits(job, hit, host, remote)
        self.running.append(job)
        if start > hit * bs:
            self._promote_full(job)  # loaded blocks are whole: cache them now
        return n, seconds

    def _claim(self, job: Job, hit: int, private: int) -> bool:
        """Take the job's `hit` cached blocks and `private` new ones, if the pool has room."""
        cached = job.seq_hashes[:hit]
        if not self.pool.can_allocate(private, cached):
            return False
        self.pool.acquire(cached)
        self.pool.allocate(private)
        job.held = list(cached)
        job.private = private
        job.promoted = hit
        return True

    def _loads_async(self, *, network: bool) -> bool:
        """The connector's choice: "auto" parks a load that reaches a network tier while
        another request is live (the one being admitted is still at the head of `waiting`);
        a lone request loads in the step, parking it would only add a step to its TTFT."""
        if self.load_mode == "sync":
            return False
        if self.load_mode == "async":
            return True
        others = (len(self.running) + len(self.waiting) - 1 + len(self._loading)
                  + len(self.loaded))
        return network and others > 0

    def _note_hits(self, job: Job, hit: int, host: int, remote: int) -> None:
        """Where the first admission found the prompt's blocks (the hit rates)."""
        if job.cached_tokens < 0:
            job.cached_tokens = hit * self.bs
            job.host_tokens = host * self.bs
            job.remote_tokens = remote * self.bs

    def _park(self, job: Job, hit: int, host: int, remote: int, seconds: float, now: float
              ) -> tuple[int, float]:
        """Start an asynchronous load of the `host` + `remote` blocks after the device hit:
        vLLM allocates their blocks now and parks the request until they are loaded."""
        loaded = host + remote
        if not self._claim(job, hit, loaded):
            return -1, 0.0
        job.first_computed_block = hit + loaded
        job.computed = (hit + loaded) * self.bs
        job.chunk = 0
        job.state = JobState.LOADING
        job.load_s = seconds
        self._note_hits(job, hit, host, remote)
        self.async_load_s += seconds
        self._seq += 1
        heapq.heappush(self._loading, (now + seconds, self._seq, job))
        return 0, 0.0

    def _finish_loads(self, now: float) -> None:
        """Loads done by `now`: their blocks join the prefix cache (vLLM caches them only then)
        and the jobs wait for this step's scheduling, ahead of the queue."""
        heap = self._loading
        while heap and heap[0][0] <= now:
            _, _, job = heapq.heappop(heap)
            self._promote_full(job)
            self.loaded.append(job)

    def _reserve(self, job: Job, tokens: int) -> bool:
        """Blocks for `job` to hold KV of `tokens` tokens, preempting the newest sequences if
        needed; False if `job` itself had to be preempted."""
        need = -(-tokens // self.bs) - len(job.held) - job.private
        if need <= 0:
            return True
        while not self.pool.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is job:
                return False
        self.pool.allocate(need)
        job.private += need
        return True

    def _preempt(self, job: Job) -> None:
        if job.state is JobState.DECODE:
            job.generated = job.gen_base + (self.counter - job.dec_base)
            self.decoding.discard(job)
        self.running.remove(job)
        self.pool.release(job.held, job.private)
        job.held = []
        job.private = 0
        job.promoted = 0
        job.computed = 0
        job.state = JobState.WAITING
        job.epoch += 1
        job.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(job)

    def _allocate_decode_blocks(self) -> None:
        heap = self._alloc_heap
        c = self.counter
        while heap and heap[0][0] <= c:
            _, _, epoch, job = heapq.heappop(heap)
            if epoch != job.epoch or job.state is not JobState.DECODE:
                continue
            kv = job.computed + (c - job.dec_base)  # KV tokens before this step
            job.generated = job.gen_base + (c - job.dec_base)
            full = kv // self.bs
            if full > job.promoted:
                self._ensure_hashes(job, full)
                self._promote_range(job, job.promoted, full)
            if not self._reserve(job, kv + 1):
                continue
            self._push(self._alloc_heap, c + self.bs, job)

    def _prefill_done(self, job: Job, now: float) -> None:
        job.generated += 1
        first = job.generated == 1
        if job.generated >= job.max_tokens:
            if first:
                self.listener.first_token(job, now)
            self._complete(job, now)
            return
        job.state = JobState.DECODE
        job.dec_base = self.counter
        job.gen_base = job.generated
        self.decoding.add(job)
        kv = job.computed
        self._push(self._alloc_heap, job.dec_base + (-kv) % self.bs, job)
        self._push(self._finish_heap, job.dec_base + job.max_tokens - job.gen_base, job)
        if first:
            self.listener.first_token(job, now)

    def _complete(self, job: Job, now: float) -> None:
        job.generated = job.max_tokens
        job.state = JobState.DONE
        self.decoding.discard(job)
        self.running.remove(job)
        self.pool.release(job.held, job.private)
        job.held = []
        job.private = 0
        self.listener.finished(job, now)

    def _push(self, heap: list[tuple[int, int, int, Job]], counter: int, job: Job) -> None:
        self._seq += 1
        heapq.heappush(heap, (counter, self._seq, job.epoch, job))

    # --- blocks and hashes -------------------------------------------------------------------
    def _ensure_hashes(self, job: Job, blocks: int) -> None:
        """Extend the job's sequence hashes (prompt blocks first, then generated ones) to
        `blocks` full blocks."""
        have = len(job.seq_hashes)
        if have >= blocks:
            return
        if have == 0 and job.prompt_hashes:
            job.seq_hashes = list(job.prompt_hashes[:blocks])
            have = len(job.seq_hashes)
            if have >= blocks:
                return
        bs = self.bs
        parent = job.seq_hashes[-1] if have else 0
        more = block_hashes(job.tokens(have * bs, blocks * bs), bs, parent)
        job.seq_hashes.extend(more)

    def _promote_full(self, job: Job) -> None:
        full = job.computed // self.bs
        if full > job.promoted:
            self._ensure_hashes(job, full)
            self._promote_range(job, job.promoted, full)

    def _promote_range(self, job: Job, start: int, end: int) -> None:
        """Blocks [start, end) of the job now hold KV: cache them (and save the computed ones
        to the store)."""
        hashes = job.seq_hashes[start:end]
        parent = job.seq_hashes[start - 1] if start > 0 else None
        tokens = job.tokens(start * self.bs, end * self.bs).tolist() \
            if self.record_events else None
        for h, cached in zip(hashes, self.pool.promote(hashes, parent, tokens), strict=True):
            if cached:
                job.held.append(h)
                job.private -= 1
        job.promoted = end
        if self.store is not None:
            first = max(start, job.first_computed_block)
            if first < end:
                self._unsaved += end - first
                new_host, new_remote = self.store.save(self.index, job.seq_hashes[first:end])
                if self.on_store_events is not None and (new_host or new_remote):
                    self.on_store_events(self.index, self._store_events(
                        job, first, end, set(new_host), set(new_remote)))

    def _store_events(self, job: Job, start: int, end: int, host: set[int],
                      remote: set[int]) -> list[dict[str, Any]]:
        """The connector's announcements of what it checkpointed: `KVKEEP_SHARED` for blocks
        any worker can restore (remote daemons), `KVKEEP_LOCAL` for this node's tier."""
        events: list[dict[str, Any]] = []
        bs = self.bs
        for medium, wanted in (("KVKEEP_SHARED", remote), ("KVKEEP_LOCAL", host - remote)):
            run: list[int] = []
            run_start = start
            for k in range(start, end + 1):
                h = job.seq_hashes[k] if k < end else None
                if h is not None and h in wanted:
                    if not run:
                        run_start = k
                    run.append(h)
                    continue
                if run:
                    parent = job.seq_hashes[run_start - 1] if run_start > 0 else None
                    tokens = job.tokens(run_start * bs, (run_start + len(run)) * bs).tolist()
                    events.append({"type": "BlockStored", "block_hashes": run,
                                   "parent_block_hash": parent, "token_ids": tokens,
                                   "block_size": bs, "lora_id": None, "medium": medium})
                    run = []
        return events
