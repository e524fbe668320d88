"""The decision pipeline without a network: every filter, scorer and picker, the thresholds,
the policies, the prefix indexes and the parsers the proxy relies on."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import ConfigError
from kvstore.keys import SessionId
from router.config import parse_static_worker
from router.context import DecisionContext
from router.core import RouterCore
from router.decision import RequestFeatures, RouteReason, RouteRequest
from router.errors import BadRequest, InvalidSessionId, NoHealthyWorker, Saturated
from router.filters import (
    BoundedLoadFilter,
    ExcludeFilter,
    GpuFilter,
    KVThresholdFilter,
    ModelFilter,
    QueueThresholdFilter,
    SaturationFilter,
    UsableFilter,
)
from router.front.api import ClientRequest, Endpoint, parse_request
from router.hooks import Outcome
from router.indexer import KVBlockIndex, RoutingHistory, SessionBlocks, text_prefix_keys
from router.indexer.events import SHARED
from router.indexer.keys import token_block_keys
from router.membership.scraper import parse_vllm_metrics
from router.membership.workers import WorkerId, WorkerInfo, WorkerLoad, WorkerPool, WorkerState
from router.pickers import LeastUtilisedPicker, MaxScorePicker, RandomPicker, RoundRobinPicker
from router.policy import Thresholds, build_policy, parse_weights, policy_preset
from router.scheduler import Scheduler, overloaded
from router.scorers import (
    ApproxPrefixScorer,
    BestPrefixScorer,
    InflightTokensScorer,
    KVUtilizationScorer,
    LoadAwareScorer,
    PrecisePrefixScorer,
    QueueRatioScorer,
    QueueScorer,
    SessionAffinityScorer,
    spread,
)
from router.streaming import StreamBroken, StreamState, pump, relay

W = WorkerId


def worker(wid: str, *, running: int = 0, waiting: int = 0, kv: float = 0.0,
           models: tuple[str, ...] = ("m",), draining: bool = False,
           temp: float | None = None, mem: float | None = None) -> WorkerState:
    info = WorkerInfo(W(wid), f"http://{wid}", models, draining=draining, gpu_temp_c=temp,
                      gpu_mem_frac=mem)
    return WorkerState(info, WorkerLoad(running, waiting, kv, 0.0))


def pool_of(*states: WorkerState) -> WorkerPool:
    pool = WorkerPool()
    for s in states:
        pool.upsert(s.info).load = s.load
    return pool


def ctx(req: RouteRequest | None = None, bound: str | None = None,
        history: RoutingHistory | None = None, blocks: KVBlockIndex | None = None
        ) -> DecisionContext:
    return DecisionContext(req or RouteRequest("m"), time.monotonic(),
                           W(bound) if bound else None, history, blocks)


def ids(states: list[WorkerState]) -> list[str]:
    return [s.worker_id for s in states]


# --- filters -------------------------------------------------------------------------------
def test_hard_filters() -> None:
    a, b, c, d = worker("a"), worker("b", models=("other",)), worker("c", draining=True), \
        worker("d")
    d.suspect_until = time.monotonic() + 60
    cands = [a, b, c, d]
    assert ids(UsableFilter().apply(ctx(), cands)) == ["a", "b"]
    assert ids(ModelFilter().apply(ctx(), cands)) == ["a", "c", "d"]
    req = RouteRequest("m", exclude=frozenset({W("a")}))
    assert ids(ExcludeFilter().apply(ctx(req), cands)) == ["b", "c", "d"]
    dead = worker("e")
    dead.alive = False
    assert UsableFilter().apply(ctx(), [dead]) == []


def test_kv_threshold_filter_default_is_85_percent() -> None:
    low, edge, high = worker("a", kv=0.849), worker("b", kv=0.85), worker("c", kv=0.95)
    assert ids(KVThresholdFilter().apply(ctx(), [low, edge, high])) == ["a"]
    assert ids(KVThresholdFilter(0.96).apply(ctx(), [low, edge, high])) == ["a", "b", "c"]


def test_saturation_queue_and_gpu_filters() -> None:
    a, b = worker("a", waiting=63), worker("b", waiting=64)
    assert ids(SaturationFilter(64).apply(ctx(), [a, b])) == ["a"]
    a, b = worker("a", running=31), worker("b", running=30, waiting=2)
    assert ids(QueueThresholdFilter(32).apply(ctx(), [a, b])) == ["a"]
    hot, full, fine, unknown = worker("h", temp=90), worker("f", mem=0.99), \
        worker("ok", temp=60, mem=0.5), worker("u")
    assert ids(GpuFilter().apply(ctx(), [hot, full, fine, unknown])) == ["ok", "u"]


def test_bounded_load_filter_keeps_workers_within_the_factor_of_the_mean() -> None:
    cands = [worker("a"), worker("b", running=5), worker("c", running=3), worker("d", running=1)]
    # 9 outstanding + this one over 4 workers, x 1.25: at most 4 with it
    assert ids(BoundedLoadFilter(1.25).apply(ctx(), cands)) == ["a", "c", "d"]
    assert ids(BoundedLoadFilter(2.5).apply(ctx(), cands)) == ["a", "b", "c", "d"]
    even = [worker("a", running=4), worker("b", running=4), worker("c", running=4)]
    assert ids(BoundedLoadFilter(1.0).apply(ctx(), even)) == ["a", "b", "c"]
    assert ids(BoundedLoadFilter(1.0).apply(ctx(), [worker("a", running=99)])) == ["a"]
    with pytest.raises(ConfigError):
        Thresholds(load_factor=0.9)


# --- scorers -------------------------------------------------------------------------------
def test_spread_is_llmd_min_max() -> None:
    assert spread([0, 5, 10]) == [1.0, 0.5, 0.0]
    assert spread([3, 3]) == [1.0, 1.0]
    assert spread([]) == []


def test_load_scorers_in_unit_range() -> None:
    a, b, c = worker("a", running=1), worker("b", running=4, waiting=6, kv=0.5), \
        worker("c", running=2, kv=1.0)
    a.inflight_tokens, b.inflight_tokens, c.inflight_tokens = 0, 1000, 500
    cands = [a, b, c]
    assert QueueScorer().score(ctx(), cands) == [1.0, 0.0, pytest.approx(8 / 9)]
    assert KVUtilizationScorer().score(ctx(), cands) == [1.0, 0.5, 0.0]
    assert InflightTokensScorer().score(ctx(), cands) == [1.0, 0.0, 0.5]
    assert LoadAwareScorer().score(ctx(), cands) == [0.5, pytest.approx(0.5 * (1 - 6 / 128)),
                                                     0.5]
    b.load = WorkerLoad(0, 500, 0.0, 0.0)
    assert LoadAwareScorer().score(ctx(), [b]) == [0.0]
    # queue-ratio keeps the scale min-max throws away: 1 - queue / longest queue
    q = [worker("a", running=1), worker("b", running=4, waiting=6), worker("c", running=2)]
    assert QueueRatioScorer().score(ctx(), q) == [pytest.approx(0.9), 0.0, pytest.approx(0.8)]
    busy = [worker("a", running=240), worker("b", running=256)]
    assert QueueRatioScorer().score(ctx(), busy) == [pytest.approx(1 / 16), 0.0]
    assert QueueScorer().score(ctx(), busy) == [1.0, 0.0]  # min-max: a full 1.0 apart
    assert QueueRatioScorer().score(ctx(), [worker("a"), worker("b")]) == [1.0, 1.0]


def test_optimistic_accounting_moves_the_queue_score() -> None:
    pool = pool_of(worker("a"), worker("b"))
    pool.charge(W("a"), 100)
    a, b = pool.states()
    assert (a.queue, a.waiting, a.inflight_tokens) == (1, 1, 100)
    assert QueueScorer().score(ctx(), [a, b]) == [0.0, 1.0]
    pool.update_load(W("a"), WorkerLoad(1, 0, 0.1, 1.0))  # the scrape now counts it
    assert (a.queue, a.waiting) == (1, 0)
    pool.release(W("a"), 100)
    assert (a.inflight, a.inflight_tokens) == (0, 0)


def test_affinity_scorer() -> None:
    assert SessionAffinityScorer().score(ctx(bound="b"), [worker("a"), worker("b")]) == [0, 1]
    assert SessionAffinityScorer().score(ctx(), [worker("a")]) == [0.0]


def test_prefix_scorers() -> None:
    text = "x" * 64 * 4
    keys = text_prefix_keys(text)
    assert len(keys) == 4
    history = RoutingHistory()
    history.record(keys[:2], W("a"))
    history.record(keys, W("b"))
    req = RouteRequest("m", prefix_keys=keys)
    cands = [worker("a"), worker("b"), worker("c")]
    assert ApproxPrefixScorer().score(ctx(req, history=history), cands) == [0.5, 1.0, 0.0]
    assert ApproxPrefixScorer().score(ctx(RouteRequest("m"), history=history), cands) == [0] * 3

    index = KVBlockIndex(block_size=4)
    tokens = list(range(16))
    index.apply(W("a"), {"type": "BlockStored", "block_hashes": [11, 12, 13],
                         "parent_block_hash": None, "token_ids": tokens[:12], "block_size": 4,
                         "medium": "GPU"})
    index.apply(W("c"), {"type": "BlockStored", "block_hashes": [21, 22],
                         "parent_block_hash": None, "token_ids": tokens[:8], "block_size": 4,
                         "medium": "CPU"})
    preq = RouteRequest("m", block_keys=token_block_keys(tokens, 4))
    assert PrecisePrefixScorer().score(ctx(preq, blocks=index), cands) == \
        [0.75, 0.0, pytest.approx(2 * 0.8 / 4)]
    # best-prefix: precise when it knows the blocks, approximate otherwise.
    both = RouteRequest("m", prefix_keys=keys, block_keys=preq.block_keys)
    assert BestPrefixScorer().score(ctx(both, history=history, blocks=index), cands)[0] == 0.75
    assert BestPrefixScorer().score(ctx(req, history=history, blocks=index), cands) == \
        [0.5, 1.0, 0.0]


# --- indexes -------------------------------------------------------------------------------
def test_routing_history_longest_prefix_and_lru() -> None:
    h = RoutingHistory(capacity=4)
    h.record([1, 2, 3], W("a"))
    h.record([1, 2, 9], W("b"))
    assert h.match([1, 2, 3]) == {"a": 3, "b": 2}
    assert h.match([7]) == {}
    h.record([5, 6], W("c"))  # evicts the oldest keys
    assert len(h) == 4
    h.forget_worker(W("c"))
    assert h.match([5]) == {}


def test_kv_index_chains_parents_removals_and_gaps() -> None:
    index = KVBlockIndex(block_size=2)
    w = W("w")
    index.apply(w, {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                    "token_ids": [5, 6], "block_size": 2, "medium": None})
    index.apply(w, {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1,
                    "token_ids": [7, 8], "block_size": 2, "medium": None})
    keys = token_block_keys([5, 6, 7, 8], 2)
    assert index.match(keys) == {"w": 2.0}
    # A block whose parent was never seen is skipped, not guessed.
    index.apply(w, {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 12345,
                    "token_ids": [1, 1], "block_size": 2, "medium": None})
    assert index.blocks_skipped == 1
    index.apply(w, {"type": "BlockRemoved", "block_hashes": [2], "medium": None})
    assert index.match(keys) == {"w": 1.0}
    index.apply(w, {"type": "AllBlocksCleared"})
    assert index.match(keys) == {} and len(index) == 0


def _stored(index: KVBlockIndex, worker: str, hashes: list[int], tokens: list[int],
            medium: str | None, parent: int | None = None) -> None:
    index.apply(W(worker), {"type": "BlockStored", "block_hashes": hashes,
                            "parent_block_hash": parent, "token_ids": tokens,
                            "block_size": 2, "medium": medium})


def test_kv_index_counts_a_shared_store_for_every_worker() -> None:
    """Blocks the kvkeep connector checkpointed into a store with remote daemons can be
    restored by any worker: they chain with a worker's own blocks, at the storage weight."""
    index = KVBlockIndex(block_size=2)
    tokens = list(range(100, 116))  # 8 blocks of 2
    keys = token_block_keys(tokens, 2)
    _stored(index, "a", [1, 2], tokens[:4], None)  # a: blocks 0-1 on its GPU
    _stored(index, "w9", list(range(10, 16)), tokens[:12], "KVKEEP_SHARED")  # store: 0-5
    _stored(index, "c", [31], tokens[:2], "KVKEEP_LOCAL")  # c's own node store: block 0
    got = index.match(keys)
    assert got[SHARED] == pytest.approx(6 * 0.5)  # what any worker can restore
    assert got["a"] == pytest.approx(2 * 1.0 + 4 * 0.5)  # own GPU, then the store
    assert got["c"] == pytest.approx(6 * 0.5)  # its local copy is no better than the store
    assert "w9" not in got  # the publisher holds nothing itself: it is the store that does
    # A worker's own blocks go on where the store's end; a later own block joins via the store.
    _stored(index, "b", [41], tokens[12:14], None, parent=15)
    assert index.match(keys)["b"] == pytest.approx(6 * 0.5 + 1.0)
    cands = [worker("a"), worker("b"), worker("z")]
    scores = PrecisePrefixScorer().score(ctx(RouteRequest("m", block_keys=keys),
                                             blocks=index), cands)
    assert scores == [pytest.approx(4 / 8), pytest.approx(4 / 8), pytest.approx(3 / 8)]
    # Without the store's copies, nobody but a scores: chains need every block in order.
    lone = KVBlockIndex(block_size=2)
    _stored(lone, "a", [1, 2], tokens[:4], None)
    _stored(lone, "b", [41], tokens[12:14], None)  # parent unknown here: skipped
    assert lone.match(keys) == {"a": 2.0}
    # vLLM clearing its device cache leaves what a worker announced in its node's store.
    _stored(index, "c", [32], tokens[2:4], None, parent=31)  # c: block 1 on its GPU too
    assert index.match(keys)["c"] == pytest.approx(0.5 + 1.0 + 4 * 0.5)
    index.apply(W("c"), {"type": "AllBlocksCleared"})
    assert index.match(keys)["c"] == pytest.approx(6 * 0.5)
    # storage_weight: what a restorable block is worth against a device hit, per scorer
    assert PrecisePrefixScorer(storage_weight=0.25).score(
        ctx(RouteRequest("m", block_keys=keys), blocks=index), cands) == \
        [pytest.approx(3 / 8), pytest.approx(2.5 / 8), pytest.approx(1.5 / 8)]
    assert index.match(keys, storage_weight=0.25)[SHARED] == pytest.approx(6 * 0.25)
    index.apply(W("a"), {"type": "AllBlocksCleared"})
    assert "a" not in index.match(keys)  # a had only device blocks: it scores as anyone
    # An unknown medium is never a free hit.
    odd = KVBlockIndex(block_size=2)
    _stored(odd, "a", [1], tokens[:2], "SOMETHING_NEW")
    assert odd.match(keys) == {"a": 0.5}


def test_kv_index_forgets_the_oldest_shared_blocks_past_its_capacity() -> None:
    index = KVBlockIndex(block_size=2, shared_capacity=3)
    tokens = list(range(10))
    _stored(index, "w", [1, 2, 3, 4, 5], tokens, "KVKEEP_SHARED")
    keys = token_block_keys(tokens, 2)
    assert index.match(keys) == {}  # blocks 0-1 forgotten: the chain cannot start
    assert index.match(keys[:0]) == {} and len(index) == 3
    _stored(index, "w", [1, 2], tokens[:4], "KVKEEP_SHARED")  # seen again: newest now
    assert index.match(keys) == {SHARED: pytest.approx(2 * 0.5)}


def test_session_blocks_lru() -> None:
    sb = SessionBlocks(capacity=2)
    sb.put("a", (1,))
    sb.put("b", (2,))
    sb.get("a")
    sb.put("c", (3,))
    assert sb.get("b") == () and sb.get("a") == (1,)


def test_prefix_keys_are_chained_and_stable() -> None:
    a = text_prefix_keys("a" * 128 + "b" * 64)
    b = text_prefix_keys("a" * 128 + "c" * 64)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert text_prefix_keys("short") == ()
    assert token_block_keys([1, 2, 3], 2) == token_block_keys([1, 2], 2)


# --- pickers -------------------------------------------------------------------------------
def test_max_score_picker_ranks_and_breaks_ties_randomly() -> None:
    cands = [worker("a"), worker("b"), worker("c")]
    picker = MaxScorePicker(random.Random(1))
    assert ids(picker.rank(cands, [0.1, 0.9, 0.5])) == ["b", "c", "a"]
    firsts = {picker.rank(cands, [1.0, 1.0, 0.0])[0].worker_id for _ in range(50)}
    assert firsts == {"a", "b"}


def test_a_policy_without_scorers_ranks_at_random() -> None:
    """All weights 0 leaves the max-score picker no scorer: it used to index an empty score
    list (IndexError); every candidate is now as good, in random order."""
    pool = pool_of(worker("a"), worker("b"), worker("c"))
    zero = sched(pool, "llm-d")
    zero.policy = build_policy("llm-d", weights={"best-prefix": 0, "queue": 0,
                                                 "kv-utilization": 0}, rng=random.Random(3))
    assert zero.policy.scorers == ()
    picks = [zero.decide(RouteRequest("m")).worker for _ in range(60)]
    assert set(picks) == {"a", "b", "c"}
    with pytest.raises(ValueError):
        MaxScorePicker(random.Random(0)).rank([worker("a"), worker("b")], [1.0])
    # the `random` preset: the same, with its own picker, and repeatable from its seed
    runs = []
    for _ in range(2):
        rand = sched(pool, "random")
        runs.append([rand.decide(RouteRequest("m")).worker for _ in range(20)])
    assert runs[0] == runs[1] and set(runs[0]) == {"a", "b", "c"}
    assert ids(RandomPicker(random.Random(1)).rank([worker("a"), worker("b")], [])) in (
        ["a", "b"], ["b", "a"])


def test_round_robin_and_least_utilised() -> None:
    cands = [worker("b"), worker("a"), worker("c")]
    rr = RoundRobinPicker()
    assert [rr.rank(cands, [])[0].worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    cands = [worker("a", running=5), worker("b", running=1, kv=0.9), worker("c", running=1)]
    assert ids(LeastUtilisedPicker().rank(cands, [])) == ["c", "b", "a"]


# --- policies and thresholds ----------------------------------------------------------------
def sched(pool: WorkerPool, name: str = "kvkeep", **th: float) -> Scheduler:
    return Scheduler(pool, build_policy(name, thresholds=Thresholds(**th),  # type: ignore[arg-type]
                                        rng=random.Random(0)),
                     history=RoutingHistory(), blocks=KVBlockIndex())


S = SessionId("s1")


def test_sticky_until_overloaded_then_migrates() -> None:
    pool = pool_of(worker("a", running=3), worker("b", running=1))
    s = sched(pool)
    d = s.decide(RouteRequest("m", S), W("a"))
    assert (d.worker, d.reason, d.restore) == ("a", RouteReason.STICKY, False)
    # imbalance 8 (default): 9 vs 1 migrates, restore hint names the old worker
    pool.update_load(W("a"), WorkerLoad(9, 0, 0.3, 0.0))
    d = s.decide(RouteRequest("m", S), W("a"))
    assert (d.worker, d.reason, d.previous, d.restore) == ("b", RouteReason.MIGRATED, "a", True)
    # queued requests (waiting >= 4) on the sticky worker also migrate
    pool.update_load(W("a"), WorkerLoad(2, 4, 0.3, 0.0))
    assert s.decide(RouteRequest("m", S), W("a")).reason is RouteReason.MIGRATED
    # ... but not when everyone is as loaded: moving would not help
    pool.update_load(W("b"), WorkerLoad(2, 4, 0.3, 0.0))
    assert s.decide(RouteRequest("m", S), W("a")).reason is RouteReason.STICKY


def test_overloaded_thresholds() -> None:
    th = Thresholds(migrate_waiting=4, migrate_imbalance=8)
    assert not overloaded(worker("a", running=8), [worker("b", running=1)], th)
    assert overloaded(worker("a", running=9), [worker("b", running=1)], th)
    assert overloaded(worker("a", waiting=4), [worker("b", running=3)], th)
    assert not overloaded(worker("a", waiting=4), [worker("b", waiting=4)], th)
    assert not overloaded(worker("a", running=100), [], th)


def test_failover_when_the_bound_worker_is_gone() -> None:
    pool = pool_of(worker("a"), worker("b"))
    pool.remove(W("a"))
    d = sched(pool).decide(RouteRequest("m", S), W("a"))
    assert (d.worker, d.reason, d.previous, d.restore) == ("b", RouteReason.FAILOVER, "a", True)


def test_new_sessions_avoid_kv_over_threshold_and_hot_workers() -> None:
    pool = pool_of(worker("a", kv=0.90), worker("b", kv=0.50, running=3))
    s = sched(pool)
    # a holds the prompt's prefix, but is over 85 % KV: the session starts on b
    keys = text_prefix_keys("p" * 640)
    assert s.history is not None
    s.history.record(keys, W("a"))
    d = s.decide(RouteRequest("m", S, prefix_keys=keys))
    assert (d.worker, d.reason) == ("b", RouteReason.NEW)
    # everyone over the soft thresholds: the least-utilised takes it, not the prefix holder
    pool.update_load(W("b"), WorkerLoad(3, 0, 0.95, 0.0))
    pool.update_load(W("a"), WorkerLoad(40, 0, 0.99, 0.0))
    assert s.decide(RouteRequest("m", S, prefix_keys=keys)).worker == "b"
    # under the thresholds, the prefix wins
    pool.update_load(W("a"), WorkerLoad(1, 0, 0.2, 0.0))
    pool.update_load(W("b"), WorkerLoad(1, 0, 0.2, 0.0))
    assert s.decide(RouteRequest("m", None, prefix_keys=keys)).worker == "a"


def test_stateless_requests_keep_the_prefix_when_soft_filters_leave_nobody() -> None:
    """The KV and queue thresholds are session rules in the default policy; a stateless
    request is scored over every worker, and one that a policy's soft filters leave no worker
    for is scored over all of them, not handed to the least utilised."""
    keys = text_prefix_keys("p" * 640)
    pool = pool_of(worker("a", running=2, kv=0.90), worker("b", running=3, kv=0.50))
    s = sched(pool)
    assert s.history is not None
    s.history.record(keys, W("a"))
    assert s.decide(RouteRequest("m", None, prefix_keys=keys)).worker == "a"
    assert s.decide(RouteRequest("m", S, prefix_keys=keys)).worker == "b"  # a session: KV rule
    # every worker over the thresholds, a stateless policy's filters included
    pool.update_load(W("a"), WorkerLoad(40, 0, 0.99, 0.0))
    pool.update_load(W("b"), WorkerLoad(36, 0, 0.95, 0.0))
    strict = Scheduler(pool, replace(policy_preset("kvkeep"),
                                     filters=("kv-threshold", "queue-threshold", "gpu"),
                                     session_filters=()).build(random.Random(0)),
                       history=s.history, blocks=KVBlockIndex())
    for scheduler in (s, strict):
        assert scheduler.decide(RouteRequest("m", None, prefix_keys=keys)).worker == "a"
        assert scheduler.decide(RouteRequest("m", S, prefix_keys=keys)).worker == "b"


def test_saturated_is_429_and_no_worker_is_503() -> None:
    pool = pool_of(worker("a", waiting=64), worker("b", waiting=70))
    with pytest.raises(Saturated) as exc:
        sched(pool, max_waiting=64).decide(RouteRequest("m"))
    assert exc.value.status == 429 and exc.value.headers()["Retry-After"] == "1"
    # the default (512) queues there: vLLM's waiting count includes preempted sequences,
    # hundreds on a saturated worker whose new requests still start in well under a second
    assert sched(pool).decide(RouteRequest("m")).worker == "a"
    pool = pool_of(worker("a", waiting=512), worker("b", waiting=600))
    with pytest.raises(Saturated):
        sched(pool).decide(RouteRequest("m"))
    with pytest.raises(NoHealthyWorker):
        sched(pool).decide(RouteRequest("other-model"))
    with pytest.raises(NoHealthyWorker):
        sched(WorkerPool()).decide(RouteRequest("m"))


def test_baseline_policies() -> None:
    pool = pool_of(worker("a", running=5), worker("b", running=0), worker("c", running=2))
    rr = sched(pool, "round-robin")
    assert [rr.decide(RouteRequest("m")).worker for _ in range(3)] == ["a", "b", "c"]
    assert sched(pool, "least-loaded").decide(RouteRequest("m")).worker == "b"
    so = sched(pool, "session-only")
    d = so.decide(RouteRequest("m", S), W("a"))  # sticky even though a is the hottest
    assert (d.worker, d.reason) == ("a", RouteReason.STICKY)
    llmd = sched(pool, "llm-d")
    d = llmd.decide(RouteRequest("m", S), W("a"))
    assert (d.worker, d.reason, d.previous) == ("b", RouteReason.MIGRATED, "a")
    assert {s.name: w for s, w in llmd.policy.scorers} == {
        "best-prefix": 3.0, "queue": 2.0, "kv-utilization": 2.0}


def test_weights_from_config() -> None:
    assert parse_weights("prefix=1, queue=0.5") == {"prefix": 1.0, "queue": 0.5}
    with pytest.raises(ConfigError):
        parse_weights("nonsense=1")
    with pytest.raises(ConfigError):
        parse_weights("queue=-1")
    policy = build_policy("kvkeep", weights={"prefix": 0, "queue": 5})
    names = {s.name: w for s, w in policy.scorers}
    assert "prefix" not in names and names["queue"] == 5
    with pytest.raises(ConfigError):
        build_policy("nope")
    with pytest.raises(ConfigError):
        Thresholds(kv_new_session=1.5)


def test_placing_charges_and_records_history_and_finishing_releases() -> None:
    core = RouterCore(build_policy("least-loaded", rng=random.Random(0)))
    for w in ("a", "b"):
        core.add_worker(WorkerInfo(W(w), f"http://{w}", ("m",)))
    route = core.route(RequestFeatures("m", prompt_text="q" * 128, max_tokens=18))
    placements = [core.place_now(route) for _ in range(4)]
    # optimistic accounting spreads a burst between two scrapes
    assert sorted(p.worker for p in placements) == ["a", "a", "b", "b"]
    assert set(core.history.match(route.prefix_keys)) == {"a", "b"}
    assert [(w.inflight, w.inflight_tokens) for w in core.workers()] == [(2, 100), (2, 100)]
    for p in placements:
        core.finish(p, Outcome(ok=True))
    assert [(w.inflight, w.inflight_tokens, w.pending) for w in core.workers()] == [
        (0, 0, 0), (0, 0, 0)]


def test_a_retry_goes_to_the_next_ranked_worker() -> None:
    """A send that fails before the response is decided again without the failed workers:
    with nothing else changed, that is the picker's runner-up, then the next."""
    pool = pool_of(worker("a", running=0), worker("b", running=5), worker("c", running=9))
    s = sched(pool, "least-loaded")
    picks = [s.decide(RouteRequest("m", exclude=frozenset(W(x) for x in tried))).worker
             for tried in ("", "a", "ab")]
    assert picks == ["a", "b", "c"]
    with pytest.raises(NoHealthyWorker):
        s.decide(RouteRequest("m", exclude=frozenset({W("a"), W("b"), W("c")})))


# --- parsers ----------------------------------------------------------------------------------
def test_parse_request() -> None:
    c = parse_request(Endpoint.COMPLETIONS, b'{"model":"m","prompt":[1,2,3],"stream":true,'
                      b'"max_tokens":9,"session_id":"abc"}', None)
    assert (c.prompt_tokens, c.session_id, c.stream, c.resumable) == ((1, 2, 3), "abc", True,
                                                                      True)
    assert "session_id" not in c.body and c.estimated_tokens == 12
    c = parse_request(Endpoint.CHAT, b'{"model":"m","messages":[{"role":"user","content":'
                      b'[{"type":"text","text":"hi"}]}],"logprobs":true,"stream":true}', "s.1")
    assert c.prompt_text == "user:hi\n" and c.session_id == "s.1"
    assert c.resumable and c.logprobs == 0  # logprobs of the sampled tokens only
    # What a continuation can give back is resumable; what it cannot is not.
    for body, endpoint, resumable, top in (
            (b'"logprobs":true,"top_logprobs":3', Endpoint.CHAT, True, 3),
            (b'"logprobs":false', Endpoint.CHAT, True, None),
            (b'"logprobs":"yes"', Endpoint.CHAT, False, None),
            (b'"logprobs":true,"top_logprobs":-1', Endpoint.CHAT, False, None),
            (b'"logprobs":4', Endpoint.COMPLETIONS, True, 4),
            (b'"logprobs":true', Endpoint.COMPLETIONS, False, None),
            (b'"prompt_logprobs":1', Endpoint.COMPLETIONS, False, None),
            (b'"response_format":{"type":"json_object"}', Endpoint.CHAT, False, None),
            (b'"tools":[{"type":"function"}]', Endpoint.CHAT, False, None)):
        head = (b'{"model":"m","messages":[{"role":"user","content":"x"}],' if endpoint is
                Endpoint.CHAT else b'{"model":"m","prompt":"x",')
        parsed = parse_request(endpoint, head + body + b',"stream":true}', None)
        assert (parsed.resumable, parsed.logprobs) == (resumable, top), body
    for bad in (b"{", b"[]", b'{"prompt":"x"}', b'{"model":"m","prompt":5}',
                b'{"model":"m","prompt":"x","n":0}', b'{"model":"m","prompt":"x","stream":1}',
                b'{"model":"m","messages":[]}', b'{"model":"m","prompt":"x","max_tokens":-1}',
                b"\xff\xfe"):
        with pytest.raises(BadRequest):
            parse_request(Endpoint.COMPLETIONS if b"messages" not in bad else Endpoint.CHAT,
                          bad, None)
    for sid_body, header in ((b'"session_id":"bad id"', None), (b'"session_id":5', None),
                             (b'"session_id":"a"', "b")):
        with pytest.raises(InvalidSessionId):
            parse_request(Endpoint.COMPLETIONS, b'{"model":"m","prompt":"x",' + sid_body + b"}",
                          header)


def test_parse_vllm_metrics() -> None:
    text = """# HELP vllm:num_requests_running x
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.5
"""
    load = parse_vllm_metrics(text, 7.0)
    assert load == WorkerLoad(5, 4, 0.5, 7.0)


def test_static_worker_spec() -> None:
    w = parse_static_worker("w9=http://h:1/,kv-events=tcp://h:2", 0)
    assert (w.worker_id, w.url, w.kv_events) == ("w9", "http://h:1", "tcp://h:2")
    assert parse_static_worker("http://h:1", 3).worker_id == "w3"
    with pytest.raises(ConfigError):
        parse_static_worker("h:1", 0)


def _creq(endpoint: Endpoint, wants_ids: bool = False) -> ClientRequest:
    body = b'{"model":"m","prompt":"x","stream":true,"max_tokens":5,' \
           b'"stream_options":{"include_usage":true}' + \
           (b',"return_token_ids":true}' if wants_ids else b"}")
    if endpoint is Endpoint.CHAT:
        body = body.replace(b'"prompt":"x"', b'"messages":[{"role":"user","content":"x"}]')
    return parse_request(endpoint, body, None)


def test_stream_state_tracks_strips_and_translates() -> None:
    st = StreamState(_creq(Endpoint.CHAT))
    first = st.absorb({"id": "c1", "created": 5, "model": "m", "prompt_token_ids": [1, 2],
                       "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    assert first is not None and "prompt_token_ids" not in first
    st.absorb({"id": "c1", "choices": [{"index": 0, "delta": {"content": " a"},
                                        "token_ids": [7]}]})
    assert (st.prompt_ids, st.generated, st.remaining_max_tokens()) == ([1, 2], [7], 4)
    st.resumed = True
    out = st.absorb({"id": "other", "choices": [{"index": 0, "text": " b", "token_ids": [8],
                                                  "prompt_token_ids": [1, 2, 7]}]})
    assert out == {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
                   "choices": [{"index": 0, "delta": {"content": " b"}, "logprobs": None,
                                "finish_reason": None}]}
    usage = st.absorb({"id": "other", "choices": [], "usage": {"prompt_tokens": 3}})
    assert usage is not None and usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                                     "total_tokens": 4}
    keep = StreamState(_creq(Endpoint.COMPLETIONS, wants_ids=True))
    c = keep.absorb({"id": "x", "choices": [{"index": 0, "text": "a", "token_ids": [3],
                                            "prompt_token_ids": [1]}]})
    assert c is not None and c["choices"][0]["token_ids"] == [3]
    assert c["choices"][0]["prompt_token_ids"] == [1]


def _relayed(line: bytes, creq: ClientRequest, state: StreamState | None = None
             ) -> tuple[list[bytes], StreamState]:
    state = state or StreamState(creq)
    state.chunk_id = state.chunk_id or "c"
    batch: list[bytes] = []
    relay._relay_line(line, state, batch)
    return batch, state


def _events(batch: list[bytes]) -> list[Any]:
    out = []
    for b in batch:
        assert b.endswith(b"\n\n") and b.count(b"\n") == 2  # one SSE event, no raw newline
        out.append(json.loads(b[6:]) if b.startswith(b"data: {") or b.startswith(b"data: [")
                   else b)
    return out


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(extra=st.dictionaries(st.text(max_size=8), _json_values, max_size=4),
       text=st.text(), ids=st.lists(st.integers(0, 2 ** 31), max_size=3),
       finish=st.none() | st.sampled_from(["length", "stop"]), wants=st.booleans())
def test_relay_codecs_agree(extra: dict[str, Any], text: str, ids: list[int],
                            finish: str | None, wants: bool) -> None:
    """The fast codec (msgspec) and the json module relay any event alike: same JSON for the
    client, same tokens kept."""
    choice = {**extra, "index": 0, "text": text, "finish_reason": finish, "token_ids": ids}
    line = b"data: " + json.dumps({**extra, "id": "x", "choices": [choice]}).encode()
    creq = _creq(Endpoint.COMPLETIONS, wants_ids=wants)
    fast, fs = _relayed(line, creq)
    saved = relay._CODECS
    relay._CODECS = (relay._STD,)
    try:
        std, ss = _relayed(line, creq)
    finally:
        relay._CODECS = saved
    assert _events(fast) == _events(std)
    assert (fs.generated, fs.finish_reason) == (ss.generated, ss.finish_reason) == (ids, finish)
    assert ("token_ids" in _events(fast)[0]["choices"][0]) is wants


def test_relay_odd_events() -> None:
    creq = _creq(Endpoint.COMPLETIONS)
    # Not JSON: passed through as it came. Beyond the fast codec (NaN, deep nesting): the json
    # module's reading, as before.
    assert _relayed(b"data: {oops", creq)[0] == [b"data: {oops\n\n"]
    nan = _events(_relayed(b'data: {"id":"x","choices":[],"v":NaN}', creq)[0])[0]
    assert nan["v"] != nan["v"]
    deep = b"data: " + b"[" * 5000 + b"]" * 5000
    assert len(_relayed(deep, creq)[0]) == 1
    big = _events(_relayed(b'data: {"choices":[],"n":123456789012345678901234567890}',
                           creq)[0])[0]
    assert big["n"] == 123456789012345678901234567890
    # Choices that are not objects do not break the relay.
    assert _events(_relayed(b'data: {"choices":[1,null]}', creq)[0]) == [{"choices": [1, None]}]
    with pytest.raises(StreamBroken):
        _relayed(b'data: {"error":{"message":"engine dead"}}', creq)


class _Content:
    def __init__(self, reads: list[bytes]) -> None:
        self.reads = reads

    async def readany(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""


class _Resp:
    def __init__(self, reads: list[bytes]) -> None:
        self.content = _Content(reads)


class _Out:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)


def _chunk(i: int, finish: str | None = None) -> bytes:
    return b'data: {"id":"c","choices":[{"index":0,"text":"t%d","finish_reason":%s,' \
           b'"token_ids":[%d]}]}\n\n' % (i, b'"%s"' % finish.encode() if finish else b"null", i)


def test_pump_writes_each_read_at_once_and_returns_the_tail() -> None:
    """Every complete event of a read goes out in one write before the next read; an event
    split across reads waits for its end; the events read with [DONE] come back for the
    proxy's final write."""
    whole = _chunk(1) + _chunk(2)
    reads = [whole, _chunk(3)[:20], _chunk(3)[20:] + b": comment\n\n",
             _chunk(4, "length") + b"data: [DONE]\n\n", b"more after done"]
    out, state = _Out(), StreamState(_creq(Endpoint.COMPLETIONS))
    tail = asyncio.run(pump(_Resp(reads), out, state))  # type: ignore[arg-type]
    assert len(out.writes) == 2
    texts = [json.loads(e[6:])["choices"][0]["text"]
             for w in [*out.writes, tail] for e in w.split(b"\n\n") if e]
    assert texts == ["t1", "t2", "t3", "t4"]
    assert out.writes[0].count(b"data: ") == 2 and b"t4" in tail and b"token_ids" not in tail
    assert state.done and state.generated == [1, 2, 3, 4] and state.finish_reason == "length"


def test_pump_break_delivers_what_came_before() -> None:
    out, state = _Out(), StreamState(_creq(Endpoint.COMPLETIONS))
    with pytest.raises(StreamBroken):
        broken = _Resp([_chunk(1) + b'data: {"error":{"code":500}}\n\n'])
        asyncio.run(pump(broken, out, state))  # type: ignore[arg-type]
    assert len(out.writes) == 1 and b"t1" in out.writes[0] and state.generated == [1]
    out, state = _Out(), StreamState(_creq(Endpoint.COMPLETIONS))
    with pytest.raises(StreamBroken):  # closed before finishing
        asyncio.run(pump(_Resp([_chunk(1)]), out, state))  # type: ignore[arg-type]


def test_pool_models_follow_registrations() -> None:
    pool = WorkerPool()
    assert pool.models() == frozenset()
    pool.upsert(WorkerInfo(W("a"), "http://a", ("m1",)))
    assert pool.models() == {"m1"}
    pool.upsert(WorkerInfo(W("b"), "http://b", ("m2",)))
    pool.upsert(WorkerInfo(W("a"), "http://a", ("m3",)))
    assert pool.models() == {"m2", "m3"}
    pool.remove(W("b"))
    assert pool.models() == {"m3"}


# --- the policies under load (replay simulation) -----------------------------------------------
def test_plain_stickiness_loses_to_round_robin_and_kvkeep_does_not() -> None:
    """Dynamo's finding, reproduced with the real scheduler in a discrete-event replay:
    affinity without load awareness builds hot spots and loses to round robin. The kvkeep
    policy keeps the cache hits of stickiness and beats round robin, with or without the
    store's restores."""
    from benchmarks.router import replay

    rr = replay("round-robin", turns=2000)
    sticky = replay("session-only", turns=2000)
    ours = replay("kvkeep", turns=2000)
    ours_no_store = replay("kvkeep", turns=2000, store=False)
    assert sticky["mean_ttft_s"] > 1.5 * rr["mean_ttft_s"]
    assert sticky["cache_hit_rate"] > rr["cache_hit_rate"]
    assert ours["mean_ttft_s"] < rr["mean_ttft_s"]
    assert ours["p99_ttft_s"] <= rr["p99_ttft_s"]
    assert ours_no_store["mean_ttft_s"] < rr["mean_ttft_s"]
    assert ours["cache_hit_rate"] > rr["cache_hit_rate"]


def test_nvml_reading_feeds_the_gpu_filter(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: a stub `pynvml` stands in for NVML to check the reading and its use."""
    import sys
    import types

    from router.node import gpu

    class Mem:
        used, total = 60, 64

    stub = types.ModuleType("pynvml")
    stub.nvmlInit = lambda: None  # type: ignore[attr-defined]
    stub.nvmlDeviceGetCount = lambda: 2  # type: ignore[attr-defined]
    stub.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    stub.nvmlDeviceGetMemoryInfo = lambda h: Mem()  # type: ignore[attr-defined]
    stub.nvmlDeviceGetTemperature = lambda h, sensor: 70 + 20 * h  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    monkeypatch.setattr(gpu, "_nvml", None)
    monkeypatch.setattr(gpu, "_nvml_failed", False)
    reading = gpu.read_gpu()
    assert reading == gpu.GpuReading(mem_frac=60 / 64, temp_c=90.0)
    hot = worker("hot", temp=reading.temp_c, mem=reading.mem_frac)
    assert GpuFilter().apply(ctx(), [hot, worker("cool")])[0].worker_id == "cool"
    monkeypatch.setattr(gpu, "_nvml", None)
    monkeypatch.setattr(gpu, "_nvml_failed", True)  # no NVML: no reading, filter passes
    assert gpu.read_gpu() is None
