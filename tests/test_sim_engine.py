"""The simulator's engine: block pool invariants, KV events, token conservation, timing."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from benchmarks.sim.cache import BlockPool
from benchmarks.sim.engine import Job, JobState, Replica
from benchmarks.sim.params import DEFAULT_PARAMS, SimParams, TimingParams, load_params
from benchmarks.sim.store import KVStore
from benchmarks.sim.timing import StepWork, step_seconds
from benchmarks.sim.tokens import TextRenderer, block_hashes


def _params(kv_tokens: int = 4096, block_size: int = 16, **engine: int) -> SimParams:
    return load_params().with_overrides("engine", kv_tokens=kv_tokens, block_size=block_size,
                                        **engine)


class _Listener:
    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.done: dict[int, float] = {}

    def first_token(self, job: Job, now: float) -> None:
        assert job.uid not in self.first
        self.first[job.uid] = now

    def finished(self, job: Job, now: float) -> None:
        assert job.uid not in self.done
        self.done[job.uid] = now


def _apply(events: list[dict[str, object]], cached: set[int]) -> None:
    for e in events:
        if e["type"] == "BlockStored":
            cached.update(e["block_hashes"])  # type: ignore[arg-type]
        elif e["type"] == "BlockRemoved":
            cached.difference_update(e["block_hashes"])  # type: ignore[arg-type]
        elif e["type"] == "AllBlocksCleared":
            cached.clear()


def _run(replica: Replica, seen: set[int] | None = None, limit: int = 100_000) -> float:
    now = 0.0
    for _ in range(limit):
        if not replica.has_work:
            return now
        now += replica.start_step(now)
        replica.finish_step(now)
        pool = replica.pool
        assert 0 <= pool.used <= pool.num_blocks
        assert pool.free_empty + (pool.cached - _referenced(pool)) + pool.used \
            == pool.num_blocks  # unreferenced cached blocks are exactly the evictable ones
        if seen is not None:
            _apply(pool.take_events(), seen)
            assert seen == pool.cached_hashes()
    raise AssertionError("engine did not drain")


def _referenced(pool: BlockPool) -> int:
    return sum(1 for h in pool.cached_hashes() if pool.refcount(h) > 0)


def _jobs(n: int, rng: np.random.Generator, *, shared: int, private: int, out: int,
          bs: int, vocab: int = 1000) -> list[Job]:
    system = rng.integers(0, vocab, shared)
    jobs = []
    for i in range(n):
        prompt = np.concatenate((system, rng.integers(0, vocab, private)))
        jobs.append(Job(i, prompt, block_hashes(prompt, bs), rng.integers(0, vocab, out)))
    return jobs


@pytest.mark.parametrize("block_size", [16, 32])
def test_tokens_conserved_under_preemption_and_eviction(block_size: int) -> None:
    # a cache far too small for the load: sequences are preempted and blocks evicted
    params = _params(kv_tokens=3000, block_size=block_size, max_num_seqs=16,
                     max_num_batched_tokens=512)
    listener = _Listener()
    replica = Replica(0, params.engine, params.timing, listener)
    rng = np.random.default_rng(1)
    jobs = _jobs(30, rng, shared=300, private=200, out=150, bs=block_size)
    for job in jobs:
        replica.submit(job)
    seen: set[int] = set()
    _run(replica, seen)
    assert replica.preemptions > 0 and replica.pool.evictions > 0
    assert sorted(listener.done) == list(range(30))
    assert all(job.generated == job.max_tokens for job in jobs)
    assert all(listener.first[j.uid] <= listener.done[j.uid] for j in jobs)
    # every block is free again; what stays cached is exactly what the events say
    assert replica.pool.used == 0
    assert seen == replica.pool.cached_hashes()
    # prompt tokens: each first prefill found its cached part, the rest was computed
    computed_min = sum(len(j.prompt) - j.cached_tokens for j in jobs)
    assert replica.prefill_tokens >= computed_min


def test_prefix_hits_count_shared_blocks_only() -> None:
    params = _params(kv_tokens=1 << 16, block_size=16)
    replica = Replica(0, params.engine, params.timing, _Listener())
    rng = np.random.default_rng(2)
    jobs = _jobs(4, rng, shared=160, private=40, out=5, bs=16)
    replica.submit(jobs[0])
    _run(replica)
    for job in jobs[1:]:
        replica.submit(job)
    _run(replica)
    assert jobs[0].cached_tokens == 0
    # 160 shared tokens = 10 full blocks of 16; the private part never matches
    assert [j.cached_tokens for j in jobs[1:]] == [160, 160, 160]
    assert replica.prefill_tokens == 200 + 3 * 40


def test_lru_never_evicts_referenced_blocks() -> None:
    rng = random.Random(3)
    pool = BlockPool(64, 16)
    held: list[tuple[list[int], int]] = []
    next_hash = 1
    for _ in range(2000):
        if held and rng.random() < 0.45:
            hashes, private = held.pop(rng.randrange(len(held)))
            pool.release(hashes, private)
        else:
            n = rng.randint(1, 6)
            known = sorted(pool.cached_hashes())
            hits = rng.sample(known, min(len(known), rng.randint(0, 3)))
            if not pool.can_allocate(n, hits):
                continue
            pool.acquire(hits)
            pool.allocate(n)
            new = list(range(next_hash, next_hash + n))
            next_hash += n
            cached = pool.promote(new, None, None)
            mine = hits + [h for h, c in zip(new, cached, strict=True) if c]
            held.append((mine, n - sum(cached)))
        referenced = {h for hashes, _ in held for h in hashes}
        assert referenced <= pool.cached_hashes()
        assert all(pool.refcount(h) > 0 for h in referenced)
        # one physical block per referenced hash, however many holders, plus private blocks
        assert pool.used == len(referenced) + sum(p for _, p in held)


def test_evicts_least_recently_freed_chain_tail_first() -> None:
    pool = BlockPool(4, 16)
    pool.allocate(4)
    pool.promote([1, 2, 3, 4], None, None)
    pool.release([1, 2], 0)  # a chain: its tail (2) is queued first
    pool.release([3, 4], 0)
    pool.take_events()
    pool.allocate(1)
    assert pool.take_events() == [{"type": "BlockRemoved", "block_hashes": [2],
                                   "medium": None}]
    assert pool.contains(1) and not pool.contains(2)


def test_timing_formula_matches_the_parameter_file() -> None:
    params = load_params()
    t = params.timing
    assert t.model == "dynamo-mocker"
    work = StepWork(prefill_tokens=1000, decodes=10, running=11, kv_used=0.5)
    prefill_ms = t.prefill_scale * (t.a2 * 1000**2 + t.a1 * 1000 + t.a0)
    decode_ms = t.decode_scale * (t.d2 * 0.25 + t.d1 * 0.5 + t.d0)
    assert step_seconds(work, t, params.engine) == pytest.approx((prefill_ms + decode_ms) / 1e3)
    # hand-computed with round numbers: prefill 2 x (1e-6 x 1e6 + 0.01 x 1000 + 10) = 42 ms,
    # decode 1 x (-20 x 0.25 + 50 x 0.5 + 5) = 25 ms
    simple = TimingParams("dynamo-mocker", 1e-6, 0.01, 10.0, -20.0, 50.0, 5.0, 1.0, 2.0, 1.0,
                          0, 0, 0, 1)
    assert step_seconds(work, simple, params.engine) == pytest.approx(0.067)
    assert step_seconds(StepWork(0, 3, 3, 0.0), simple, params.engine) == pytest.approx(0.005)
    # llm-d-inference-sim: (65 + 1000 x 0.4 + 25) ms x (1 + (2 - 1) x 10 / 255)
    inf = TimingParams("llmd-inference-sim", 0, 0, 0, 0, 0, 0, 0, 0, 0, 65.0, 0.4, 25.0, 2.0)
    assert step_seconds(work, inf, params.engine) == pytest.approx(0.490 * (1 + 10 / 255))


def test_one_request_ttft_and_itl_follow_the_step_formula() -> None:
    params = _params(kv_tokens=1 << 16, block_size=16, max_num_batched_tokens=256)
    listener = _Listener()
    replica = Replica(0, params.engine, params.timing, listener)
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 1000, 600)
    job = Job(0, prompt, block_hashes(prompt, 16), rng.integers(0, 1000, 11))
    replica.submit(job)
    end = _run(replica)
    t, e = params.timing, params.engine
    # chunked prefill: 256 + 256 + 88 tokens, then 10 decode steps with 1 sequence
    ttft = sum(step_seconds(StepWork(n, 0, 1, blocks / e.num_blocks), t, e)
               for n, blocks in ((256, 16), (256, 32), (88, 38)))
    assert listener.first[0] == pytest.approx(ttft)
    decode = sum(step_seconds(StepWork(0, 1, 1, -(-(600 + k) // 16) / e.num_blocks), t, e)
                 for k in range(1, 11))
    assert end == pytest.approx(ttft + decode)


def test_rendered_text_prefixes_follow_token_prefixes() -> None:
    from router.indexer.keys import text_prefix_keys  # the router's own text keys

    r = TextRenderer(151_936)
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 151_936, 320)
    a = r.render(np.concatenate((shared, rng.integers(0, 151_936, 100))))
    b = r.render(np.concatenate((shared, rng.integers(0, 151_936, 100))))
    ka, kb = text_prefix_keys(a), text_prefix_keys(b)
    assert len(a) == 4 * 420
    common = next(i for i, (x, y) in enumerate(zip(ka, kb, strict=True)) if x != y)
    assert common == 320 * 4 // 64  # exactly the shared tokens' chunks


def test_store_costs_and_load_mode_come_from_the_parameter_file(tmp_path: Path) -> None:
    store = load_params().store
    assert store.load_mode == "auto"  # the connector's default
    assert 0 < store.remote_gbps < store.host_gbps
    assert store.host_latency_s < store.remote_latency_s
    assert store.save_s_per_block > 0
    # per tier: latency per load call + bytes at the tier's rate; nothing to load costs nothing
    assert store.remote_load_s(10**9) == pytest.approx(store.remote_latency_s
                                                       + 1 / store.remote_gbps)
    assert store.host_load_s(0) == 0.0
    text = DEFAULT_PARAMS.read_text()
    for bad, why in (('load_mode = "auto"', 'load_mode = "eager"'),
                     ("save_s_per_block =", "save_seconds =")):
        path = tmp_path / "bad.toml"
        path.write_text(text.replace(bad, why))
        with pytest.raises(ValueError):
            load_params(path)


def _store_replica(mode: str, tier: str, hashes: list[int]) -> tuple[Replica, _Listener]:
    params = _params(kv_tokens=1 << 14, block_size=16).with_overrides("store", load_mode=mode)
    store = KVStore(params.store, params.model, params.engine.block_size, nodes=1)
    for h in hashes:
        (store.host[0] if tier == "host" else store.remote).put(h)
    listener = _Listener()
    return Replica(0, params.engine, params.timing, listener, store=store,
                   record_events=False), listener


def _drain(replica: Replica, now: float) -> float:
    """Step until idle; an idle replica with loads in flight waits for the first to end."""
    while replica.has_work:
        seconds = replica.start_step(now)
        if seconds <= 0.0:
            done = replica.next_load_done()
            assert done is not None and done > now
            now = done
            continue
        now += seconds
        replica.finish_step(now)
    return now


@pytest.mark.parametrize(("mode", "tier", "alone", "parked"), [
    ("sync", "remote", False, False),
    ("auto", "remote", False, True),  # a network load beside a live request: async
    ("auto", "remote", True, False),  # alone: in the step (parking would add a step)
    ("auto", "host", False, False),  # host tier: in the step
    ("async", "host", True, True),
])
def test_load_mode_charges_the_step_or_the_request(mode: str, tier: str, alone: bool,
                                                   parked: bool) -> None:
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 1000, 20 * 16 + 1)  # 20 stored blocks, then one token to compute
    job = Job(1, prompt, block_hashes(prompt, 16), rng.integers(0, 1000, 4))
    replica, listener = _store_replica(mode, tier, job.prompt_hashes[:20])
    store = replica.store
    assert store is not None
    nbytes = 20 * store.block_bytes
    load_s = store.params.remote_load_s(nbytes) if tier == "remote" \
        else store.params.host_load_s(nbytes)
    now = 0.0
    if not alone:  # another request, decoding when the restore arrives
        other = rng.integers(1000, 2000, 40)
        replica.submit(Job(0, other, block_hashes(other, 16), rng.integers(0, 1000, 200)))
        now += replica.start_step(now)
        replica.finish_step(now)
    admitted_at = now
    replica.submit(job)
    step = replica.start_step(now)
    if parked:
        assert job.state is JobState.LOADING
        assert replica.sync_load_s == 0.0 and replica.async_load_s == pytest.approx(load_s)
        assert step < load_s  # the other request's step did not wait for it
    else:
        assert job.state is JobState.PREFILL
        assert replica.sync_load_s == pytest.approx(load_s) and replica.async_load_s == 0.0
        assert step > load_s  # the step waited for the load, and computed
    replica.finish_step(now + step)
    _drain(replica, now + step)
    assert job.remote_tokens + job.host_tokens == 20 * 16  # loaded either way, not computed
    assert listener.first[1] >= admitted_at + load_s
    assert replica.sync_load_s == (0.0 if parked else pytest.approx(load_s))


def test_the_parameter_file_store_costs_are_the_derivation_of_its_cited_runs() -> None:
    from benchmarks.sim.store_params import derive

    params = load_params()
    # the figures of the benchmarks.remote run the parameter file cites (2026-12-06)
    remote = {"baseline": {"tcp_loopback_gbps": 2.827},
              "remote": {"get_gbps": {"1MiB": 1.537, "4MiB": 1.830, "16MiB": 1.7776},
                         "lookup_1_p50_us": {"tcp": 171.8, "grpc": 636.6}}}
    costs = derive(remote, None, block_bytes=params.model.kv_bytes_per_token
                   * params.engine.block_size)
    store = params.store
    assert (costs.host_gbps, costs.remote_gbps) == (store.host_gbps, store.remote_gbps)
    assert costs.remote_latency_s == pytest.approx(store.remote_latency_s, abs=1e-6)
    assert costs.host_latency_s == store.host_latency_s
    assert costs.save_s_per_block == pytest.approx(store.save_s_per_block, rel=0.01)
