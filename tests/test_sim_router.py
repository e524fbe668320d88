"""The simulator routes with the router's own code: policy config changes placement, router
errors come from the router, KV events reach the router's index, results are deterministic."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from benchmarks.sim.cluster import SimResult, Simulation
from benchmarks.sim.params import SimParams, load_params
from benchmarks.sim.router_adapter import SimPolicy, load_policies
from benchmarks.sim.stats import tier_hits
from benchmarks.sim.workloads import SharedPrefixWorkload
from kvstore.errors import ConfigError


def _small() -> SimParams:
    # a small cluster: 4 replicas of 16k tokens; the workload's prefixes need ~2/3 of it
    return load_params().with_overrides("engine", kv_tokens=16384, block_size=16)


def _run(spec: SimPolicy, *, seed: int = 0, replicas: int = 4, kv_tokens: int = 16384,
         output_tokens: int = 40, rate: float = 12) -> SimResult:
    params = _small().with_overrides("engine", kv_tokens=kv_tokens)
    wl = SharedPrefixWorkload(groups=12, prompts_per_group=4, system_tokens=800,
                              question_tokens=100, output_tokens=output_tokens,
                              stages=((rate / 2, 8), (rate, 8)), vocab=params.model.vocab,
                              block_size=params.engine.block_size, seed=seed)
    return Simulation(params, spec, wl, replicas=replicas, seed=seed).run()


def _groups_per_worker(result: SimResult) -> float:
    """How many workers each system prompt went to, on average (1 = perfect locality)."""
    by_group: dict[int, set[str]] = {}
    for r in result.records:
        group = r.spec.prompt.hashes[0]
        by_group.setdefault(group, set()).update(r.workers)
    return sum(len(w) for w in by_group.values()) / len(by_group)


def test_policy_weights_change_the_simulated_placement() -> None:
    specs = load_policies()
    approx = specs["llmd_approx"]
    prefix_heavy = approx.with_weights(prefix=10.0)
    load_only = approx.with_weights(prefix=0.0)
    a, b = _run(prefix_heavy), _run(load_only)
    assert [r.workers for r in a.records] != [r.workers for r in b.records]
    assert _groups_per_worker(a) < _groups_per_worker(b)
    assert tier_hits(a.records)["device"] > tier_hits(b.records)["device"]


def test_round_robin_is_the_routers_round_robin() -> None:
    result = _run(load_policies()["round_robin"])
    first = [r.workers[0] for r in sorted(result.records, key=lambda r: r.sent_at)]
    # the router's RoundRobinPicker rotates over workers sorted by id
    assert first[:8] == ["w0", "w1", "w2", "w3", "w0", "w1", "w2", "w3"]
    assert set(result.decisions) == {"stateless"}


def test_precise_policy_reads_kv_events_through_the_routers_index() -> None:
    precise = load_policies()["llmd_precise"]
    result = _run(precise)
    assert result.events_delivered > 0 and result.index_blocks > 0
    # text prompts the router does not tokenize give the same policy no precise signal:
    # placement differs, locality drops
    blind = dataclasses.replace(precise, input="text", tokenize={"mode": "off"})
    other = _run(blind)
    assert other.index_blocks == 0 or [r.workers for r in other.records] != \
        [r.workers for r in result.records]
    assert tier_hits(result.records)["device"] > tier_hits(other.records)["device"]


def test_unknown_router_policy_is_the_routers_error() -> None:
    with pytest.raises(ConfigError):
        SimPolicy(name="x", router_policy="no-such-policy")
    with pytest.raises(ConfigError):
        SimPolicy(name="x", router_policy="kvkeep", weights={"no-such-scorer": 1.0})


def test_same_seed_same_outcome_other_seed_other_outcome() -> None:
    spec = load_policies()["kvkeep"]
    a, b, c = _run(spec, seed=3), _run(spec, seed=3), _run(spec, seed=4)
    key = [(r.workers, r.first_token_at, r.done_at) for r in a.records]
    assert key == [(r.workers, r.first_token_at, r.done_at) for r in b.records]
    assert key != [(r.workers, r.first_token_at, r.done_at) for r in c.records]


def test_store_turns_evictions_into_restores() -> None:
    spec = load_policies()["kvkeep"]
    with_store = _run(spec)
    without = _run(dataclasses.replace(spec, store=False))
    hits = tier_hits(with_store.records)
    assert hits["host"] + hits["remote"] > 0
    assert tier_hits(without.records)["host"] == 0
    assert Counter(r.failed for r in with_store.records) == Counter({None: 48 + 96 + 0})


def test_the_default_keeps_its_kv_and_queue_thresholds_off_stateless_requests() -> None:
    # Under KV pressure soft filters on every placement (the previous default, here with a
    # 50 % KV threshold so that they bind in a small run) often leave nobody, and send the
    # rest to whoever passes rather than to the prefix's holder: locality is lost. The
    # default applies them to session placements only, so stateless requests are placed as
    # with no soft filter at all. (That a request nobody passes is scored over all workers,
    # not handed to the least utilised, is tests/test_router_pipeline.py's.)
    spec = dataclasses.replace(load_policies()["kvkeep"], store=False)
    old = dataclasses.replace(spec, filters=("kv-threshold", "queue-threshold", "gpu"),
                              session_filters=(), thresholds={"kv_new_session": 0.5})
    filtered = _run(old, kv_tokens=8192, output_tokens=300, rate=16.0)
    unfiltered = _run(dataclasses.replace(spec, soft_filters=False), kv_tokens=8192,
                      output_tokens=300, rate=16.0)
    default = _run(spec, kv_tokens=8192, output_tokens=300, rate=16.0)
    assert filtered.decisions.get("soft_filter_fallback", 0) > len(filtered.records) // 4
    assert "soft_filter_fallback" not in unfiltered.decisions
    assert "soft_filter_fallback" not in default.decisions  # GPU limits only: none here
    assert [r.workers for r in default.records] == [r.workers for r in unfiltered.records]
    assert _groups_per_worker(default) < _groups_per_worker(filtered)


def test_the_router_tokenizes_text_prompts_once_each() -> None:
    """A text-prompt policy whose scorers read token blocks tokenizes (router/tokenize/prompts.py):
    the first request of each prompt waits for the /tokenize round trip, repeats hit the
    router's token cache, and the precise index then places them as well as token-id
    prompts do; with tokenizing off the same policy has only its text keys."""
    # KV for a third of the prefixes: evictions the routing history cannot see
    params = _small().with_overrides("router", tokenize_base_s=0.4, tokenize_per_token_s=0.0
                                     ).with_overrides("engine", kv_tokens=4096)
    precise = SimPolicy(name="t", router_policy="llm-d", input="text",
                        thresholds={"max_waiting": 10**9})

    def run(spec: SimPolicy) -> SimResult:
        wl = SharedPrefixWorkload(groups=12, prompts_per_group=4, system_tokens=800,
                                  question_tokens=100, output_tokens=100,
                                  stages=((6, 8), (12, 8)), vocab=params.model.vocab,
                                  block_size=params.engine.block_size, seed=0)
        return Simulation(params, spec, wl, replicas=4, seed=0).run()

    assert precise.router_tokenizes
    off = dataclasses.replace(precise, tokenize={"mode": "off"})
    assert not off.router_tokenizes
    tokenized, text_only = run(precise), run(off)
    seen: set[int] = set()
    first, repeat = [], []
    for r in sorted(tokenized.records, key=lambda r: r.sent_at):
        assert r.ttft is not None
        (repeat if r.spec.prompt.key in seen else first).append(r.ttft)
        seen.add(r.spec.prompt.key)
    assert min(first) >= 0.4 and min(repeat) < 0.4
    assert tokenized.index_blocks > 0
    assert tier_hits(tokenized.records)["device"] > tier_hits(text_only.records)["device"]
