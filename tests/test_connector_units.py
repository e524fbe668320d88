"""The connector's pure parts, without an engine: config, request params, metadata pickling,
and the scheduler half's save planning on scripted steps."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.metadata import (
    BlockRun,
    LoadReport,
    LoadSpec,
    SaveReport,
    SaveSpec,
    StepMetadata,
    WorkerReport,
)
from connectors.vllm.params import RestoreParams, namespace_for, parse_params
from connectors.vllm.prometheus import StatsReporter
from connectors.vllm.scheduler_side import SchedulerSide
from connectors.vllm.stats import Count, Counts
from kvstore.codecs import DEFAULT_INT8
from kvstore.errors import ConfigError, InvalidKey
from kvstore.keys import ModelFingerprint, SessionId
from tests.blockframes import block_key

BS = 32


# -- config ------------------------------------------------------------------------------------

def test_full_config_parses() -> None:
    config = ConnectorConfig.from_extra({
        "store": {"host_bytes": 1 << 30, "nvme": {"path": "/data", "bytes": 1 << 34},
                  "remote": {"etcd": "http://e:2379", "replicas": 2, "timeout_ms": 500}},
        "codec": "int8", "compression": "auto", "checkpoint_tokens": 64,
        "restore_deadline_ms": 250, "save_timeout_ms": 100, "load_mode": "async",
        "tenant": "acme", "model_id": "m", "weights_revision": "abc"})
    assert config.codec == DEFAULT_INT8 and config.load_mode == "async"  # "int8": the default
    assert config.restore_deadline_s == 0.25 and config.save_timeout_s == 0.1
    assert config.store.nvme is not None and config.store.nvme.byte_budget == 1 << 34
    assert config.store.remote is not None and config.store.remote.timeout_s == 0.5
    assert config.checkpoint_interval(BS) == 64
    assert hash(config.store)  # specs key the per-process store registry


@pytest.mark.parametrize("extra", [
    {},
    {"store": {}},
    {"store": {"host_bytes": 1}, "checkpoint_token": 64},
    {"store": {"host_bytes": 1}, "codec": "fp4"},
    {"store": {"host_bytes": 1}, "checkpoint_tokens": 0},
    {"store": {"host_bytes": 1}, "restore_deadline_ms": -1},
    {"store": {"host_bytes": 1}, "tenant": "no spaces"},
    {"store": {"nvme": {"bytes": 5}}},
    {"store": {"remote": {"replicas": 2}}},
    {"store": {"remote": {"etcd": "http://e", "daemons": {"a": "h:1"}}}},
    {"store": {"nvme": {"path": "/d", "durable": "false"}}},  # bool("false") would be True
    {"store": {"host_bytes": 1, "host_pinned": "yes"}},
    {"store": {"remote": {"etcd": "http://e", "prefix": 5}}},
])
def test_bad_configs_are_rejected(extra: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra(extra)


def test_an_empty_remote_prefix_is_the_default_one() -> None:
    for prefix in (None, ""):
        config = ConnectorConfig.from_extra(
            {"store": {"remote": {"etcd": "http://e:2379", "prefix": prefix}}})
        assert config.store.remote is not None
        assert config.store.remote.prefix == "/kvkeep/stores/"  # not "None"


def test_checkpoint_interval_is_at_least_a_block() -> None:
    config = ConnectorConfig.from_extra({"store": {"host_bytes": 1}, "checkpoint_tokens": 8})
    assert config.checkpoint_interval(BS) == BS
    assert ConnectorConfig.from_extra({"store": {"host_bytes": 1}}).checkpoint_interval(BS) == BS


# -- params ------------------------------------------------------------------------------------

def test_params() -> None:
    assert parse_params(None) == RestoreParams()
    assert parse_params({"session_id": "s-1", "restore": "none"}) == RestoreParams("s-1", "none")
    hint = parse_params({"restore": {"layers": [0, 2]}})
    assert hint.layers == (0, 2) and hint.usable_for(2) and not hint.usable_for(3)
    assert not parse_params({"restore": {"layers": [1, 3]}}).usable_for(3)
    assert not parse_params({"restore": "none"}).usable_for(3)
    for bad in ({"session_id": "a b"}, {"restore": "sometimes"}, {"restore": {"layers": [2, 1]}},
                {"restore": {"layers": [0, True]}}, ["not", "a", "dict"]):
        with pytest.raises(InvalidKey):
            parse_params(bad)


def test_namespace_for_salts() -> None:
    assert namespace_for("t", None).label == "t"
    assert namespace_for("t", "salt-1").label == "t~salt-1"
    odd = namespace_for("t", "a salt with spaces/and slashes")
    assert odd.salt.startswith("h") and odd == namespace_for("t", "a salt with spaces/and slashes")


# -- metadata ----------------------------------------------------------------------------------

def test_metadata_pickles() -> None:
    run = BlockRun("r1", "t~s", 2, (7, 9), (b"\x01" * 32, b"\x02" * 32))
    meta = StepMetadata((LoadSpec(run, is_async=True),), (SaveSpec(run, flush=True),))
    assert pickle.loads(pickle.dumps(meta)) == meta
    report = WorkerReport((SaveReport("r1", 2, b"\x01" * 32, True),))
    assert pickle.loads(pickle.dumps(report)) == report
    with pytest.raises(ValueError):
        BlockRun("r1", "t", 0, (1,), ())


def test_worker_reports_aggregate_failure_wins() -> None:
    h = b"\x03" * 32
    a = WorkerReport((SaveReport("r", 0, h, True), SaveReport("r", 1, h, True)))
    b = WorkerReport((SaveReport("r", 0, h, False),))
    merged = a.aggregate(b)
    assert isinstance(merged, WorkerReport)
    assert {(s.index, s.ok) for s in merged.saves} == {(0, False), (1, True)}


def test_load_reports_count_the_run_before_the_first_failure() -> None:
    from connectors.vllm.loader import LoadBlock, LoadJob

    keys = [block_key(i) for i in range(7)]
    # r1 loads its blocks 2-5 into paged blocks 10-13, r2 its blocks 0-2 into 20-22.
    job = LoadJob(tuple([LoadBlock(10 + i, keys[i], "r1", 2 + i) for i in range(4)]
                        + [LoadBlock(20 + i, keys[4 + i], "r2", i) for i in range(3)]),
                  ("r1", "r2"), 0.0, 2)
    job.fail(12, Count.LOAD_CORRUPT)  # r1's block 4: vLLM recomputes 4 and 5, keeps 2, 3
    job.fail(13, Count.LOAD_MISSING)
    assert set(job.reports()) == {LoadReport("r1", 2, 4, 2), LoadReport("r2", 0, 3, 3)}
    job.fail(20, Count.LOAD_LATE)
    assert LoadReport("r2", 0, 3, 0) in job.reports()
    # With tensor parallelism a block is restored only where every rank loaded it.
    a = WorkerReport(loads=(LoadReport("r1", 2, 4, 4), LoadReport("r2", 0, 3, 3)))
    b = WorkerReport(loads=(LoadReport("r1", 2, 4, 1),))
    merged = a.aggregate(b)
    assert isinstance(merged, WorkerReport)
    assert set(merged.loads) == {LoadReport("r1", 2, 4, 1), LoadReport("r2", 0, 3, 3)}


# -- scheduler half, on scripted steps ---------------------------------------------------------

@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = None
    # vLLM's Request carries these; generate_block_hash_extra_keys reads them.
    mm_features: list[Any] = field(default_factory=list)
    lora_request: Any = None
    prompt_embeds: Any = None
    skip_reading_prefix_cache: bool = False
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rehash()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def rehash(self) -> None:
        full = len(self.all_token_ids) // BS
        self.block_hashes = [bytes([i % 256]) * 32 for i in range(full)]


class FakeStore:
    answers_in_process = True  # asked inline (tests/test_connector_lookups.py: the other way)

    def __init__(self, present: int = 0, tier: int = 0) -> None:
        self.present = present
        self.tier = tier
        self.manifests: list[Any] = []

    # No tier to price: the restore-or-recompute decision restores every hit.
    tiers: tuple[Any, ...] = ()
    metrics = None
    in_process = (True, False)  # host RAM, then a network tier (daemons)

    def lookup(self, keys: list[Any], *, deadline: float | None = None,
               in_process_only: bool = False) -> int:
        return min(self.present, len(keys))

    def locate(self, keys: list[Any], *, deadline: float | None = None,
               in_process_only: bool = False) -> list[int]:
        return [self.tier if i < self.present else -1 for i in range(len(keys))]

    def put_manifest(self, manifest: Any) -> None:
        self.manifests.append(manifest)


def _side(store: FakeStore, event_medium: str | None = None, **extra: Any) -> SchedulerSide:
    config = ConnectorConfig.from_extra({"store": {"host_bytes": 1}, **extra})
    fp = ModelFingerprint("m", "w", "bfloat16", 2, 2, 32, BS, "cpu/tnhd", config.codec)
    return SchedulerSide(config=config, fingerprint=fp, store=store,  # type: ignore[arg-type]
                         block_size=BS, num_layers=2, counters=Counts(),
                         event_medium=event_medium)


def _blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def _step(new: list[tuple[FakeRequest, list[int], int]] = (),  # type: ignore[assignment]
          cached: list[tuple[FakeRequest, list[int], int]] = ()  # type: ignore[assignment]
          ) -> Any:
    """A SchedulerOutput with (request, new block ids, tokens scheduled) per request."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(ids,),
                                            num_computed_tokens=r.num_computed_tokens)
                            for r, ids, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r.request_id for r, _, _ in cached], resumed_req_ids=set(),
            new_block_ids=[(ids,) if ids else None for _, ids, _ in cached],
            num_computed_tokens=[r.num_computed_tokens for r, _, _ in cached]),
        num_scheduled_tokens={r.request_id: n for r, _, n in (*new, *cached)},
        scheduled_spec_decode_tokens={},
    )


def _saved(side: SchedulerSide, meta: StepMetadata, ok: bool = True) -> None:
    reports = tuple(SaveReport(s.run.req_id, s.run.first + i, s.run.block_hashes[i], ok)
                    for s in meta.saves for i in range(len(s.run)))
    side.update_connector_output(SimpleNamespace(  # type: ignore[arg-type]
        kv_connector_worker_meta=WorkerReport(reports), finished_sending=None,
        finished_recving=None))


def test_confirmed_saves_are_announced_as_kv_events() -> None:
    """Each growth of a request's saved prefix becomes one BlockStored for the whole prefix;
    unconfirmed or failed saves announce nothing; without a medium nothing is collected."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    side = _side(FakeStore(), event_medium="KVKEEP_SHARED")
    req = FakeRequest("a", list(range(3 * BS + 5)), 3 * BS + 5)
    side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta(_step(new=[(req, [1, 2, 3, 4], 3 * BS + 5)]))
    assert side.take_events() == []  # planned is not saved
    _saved(side, meta, ok=False)
    assert side.take_events() == []
    meta = side.build_connector_meta(_step())  # nothing new to plan until the next interval
    req.num_computed_tokens = 3 * BS + 5
    side._reqs["a"].hold_until_tokens = 0  # let the failed blocks be planned again at once
    meta = side.build_connector_meta(_step(cached=[(req, [], 1)]))
    _saved(side, meta)
    (event,) = side.take_events()
    assert isinstance(event, BlockStored) and event.medium == "KVKEEP_SHARED"
    assert event.parent_block_hash is None and event.block_size == BS
    # as vLLM converts its own (64-bit ints by default), so a router can match both
    assert list(event.block_hashes) == [maybe_convert_block_hash(h) for h in req.block_hashes[:3]]
    assert list(event.token_ids) == req.all_token_ids[:3 * BS]
    assert side.take_events() == []  # taken once
    _saved(side, meta)  # the same reports again: the prefix did not grow, nothing new
    assert side.take_events() == []
    quiet = _side(FakeStore())
    quiet.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    _saved(quiet, quiet.build_connector_meta(_step(new=[(req, [1, 2, 3, 4], 3 * BS + 5)])))
    assert quiet.take_events() == []


def test_lookup_claims_only_beyond_local_and_never_the_last_token() -> None:
    side = _side(FakeStore(present=10))
    exact = FakeRequest("a", list(range(4 * BS)), 4 * BS)  # 4 full blocks, the last one kept
    assert side.get_num_new_matched_tokens(exact, 0) == (3 * BS, False)  # type: ignore[arg-type]
    assert side.get_num_new_matched_tokens(exact, BS) == (2 * BS, False)  # type: ignore[arg-type]
    none = FakeRequest("b", list(range(100)), 100, {"restore": "none"})
    assert side.get_num_new_matched_tokens(none, 0) == (0, False)  # type: ignore[arg-type]
    partial = FakeRequest("c", list(range(100)), 100, {"restore": {"layers": [0, 1]}})
    assert side.get_num_new_matched_tokens(partial, 0) == (0, False)  # type: ignore[arg-type]
    async_side = _side(FakeStore(present=10), load_mode="async")
    assert async_side.get_num_new_matched_tokens(exact, 0) == (  # type: ignore[arg-type]
        3 * BS, True)


def test_auto_load_mode_loads_network_hits_asynchronously() -> None:
    """`load_mode: auto`: a hit in host RAM loads inside the forward pass (sync: fast, and
    layer-pipelined); one on a network tier parks only its own request (async), so a slow
    daemon never holds the batch's step."""
    exact = FakeRequest("a", list(range(3 * BS + 1)), 3 * BS + 1)
    in_ram = _side(FakeStore(present=10, tier=0), load_mode="auto")
    assert in_ram.get_num_new_matched_tokens(exact, 0) == (3 * BS, False)  # type: ignore[arg-type]
    remote = _side(FakeStore(present=10, tier=1), load_mode="auto")
    # Alone in the engine, nothing to hold up: inline.
    assert remote.get_num_new_matched_tokens(exact, 0) == (3 * BS, False)  # type: ignore[arg-type]
    remote = _side(FakeStore(present=10, tier=1), load_mode="auto")
    busy = FakeRequest("other", list(range(2 * BS + 1)), 2 * BS + 1, {"restore": "none"})
    remote.get_num_new_matched_tokens(busy, 0)  # type: ignore[arg-type]  # another one running
    assert remote.get_num_new_matched_tokens(exact, 0) == (3 * BS, True)  # type: ignore[arg-type]
    remote.update_state_after_alloc(exact, _blocks([1, 2, 3, 4]), 3 * BS)  # type: ignore[arg-type]
    meta = remote.build_connector_meta(_step(new=[(exact, [1, 2, 3, 4], 1)]))
    (load,) = meta.loads
    assert load.is_async
    sync = _side(FakeStore(present=10, tier=1), load_mode="sync")
    assert sync.get_num_new_matched_tokens(exact, 0) == (3 * BS, False)  # type: ignore[arg-type]


def test_load_spec_covers_the_external_blocks() -> None:
    side = _side(FakeStore(present=10))
    req = FakeRequest("a", list(range(5 * BS + 3)), 5 * BS + 3)
    assert side.get_num_new_matched_tokens(req, BS) == (4 * BS, False)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, _blocks([11, 12, 13, 14, 15, 16]),  # type: ignore[arg-type]
                                  4 * BS)
    req.num_computed_tokens = 5 * BS
    meta = side.build_connector_meta(_step(new=[(req, [11, 12, 13, 14, 15, 16], 3)]))
    (load,) = meta.loads
    assert load.run.first == 1 and load.run.block_ids == (12, 13, 14, 15)
    assert load.run.block_hashes == tuple(req.block_hashes[1:5])


def test_saves_every_checkpoint_interval_then_flush_at_finish() -> None:
    store = FakeStore()
    side = _side(store, checkpoint_tokens=3 * BS)
    req = FakeRequest("a", list(range(40)), 40, {"session_id": "s"})
    side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, _blocks([1, 2]), 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta(_step(new=[(req, [1, 2], 40)]))
    assert [(s.run.first, len(s.run)) for s in meta.saves] == [(0, 1)]  # prefill: at once
    _saved(side, meta)
    req.num_computed_tokens = 40
    ids = [1, 2]
    planned: list[tuple[int, int]] = []
    for token in range(40, 189):  # decode: one token per step
        req.all_token_ids.append(token)
        req.rehash()
        new = [len(ids) + 1] if len(ids) * BS <= token else []
        ids += new
        meta = side.build_connector_meta(_step(cached=[(req, new, 1)]))
        planned += [(s.run.first, len(s.run)) for s in meta.saves]
        _saved(side, meta)
        req.num_computed_tokens += 1
    assert planned == [(1, 3)]  # blocks 1-3 once three were complete; block 4 still pending
    side.drain_manifests()
    assert store.manifests[-1].token_count == 4 * BS
    delay, params = side.request_finished(req, (ids,))  # type: ignore[arg-type]
    assert delay and params == {"session_id": "s", "checkpointed_tokens": 4 * BS,
                                "manifest_generation": store.manifests[-1].generation,
                                "restored_tokens": 0}
    meta = side.build_connector_meta(_step())
    (flush,) = meta.saves
    assert flush.flush and (flush.run.first, len(flush.run)) == (4, 1)
    _saved(side, meta)
    side.update_connector_output(SimpleNamespace(  # type: ignore[arg-type]
        kv_connector_worker_meta=None, finished_sending={"a"}, finished_recving=None))
    side.build_connector_meta(_step())
    side.build_connector_meta(_step())
    assert side.tracked_requests == ()
    side.shutdown()
    assert store.manifests[-1].token_count == 5 * BS
    generations = [m.generation for m in store.manifests]
    assert generations == sorted(set(generations))


def test_unprotected_tokens_are_computed_blocks_the_store_does_not_hold() -> None:
    """The recovery point in tokens (`unprotected_tokens` on vLLM's /metrics): complete blocks
    computed and not yet reported saved, per request and over all; a failed save keeps its
    block unprotected, a finished request counts no more."""
    side = _side(FakeStore())
    a = FakeRequest("a", list(range(100)), 100)
    b = FakeRequest("b", list(range(1000, 1070)), 70)
    for req, ids in ((a, [1, 2, 3, 4]), (b, [5, 6, 7])):
        side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
        side.update_state_after_alloc(req, _blocks(ids), 0)  # type: ignore[arg-type]
    assert side.unprotected_tokens() == (0, 0)  # nothing computed yet
    meta = side.build_connector_meta(_step(new=[(a, [1, 2, 3, 4], 100), (b, [5, 6, 7], 70)]))
    a.num_computed_tokens, b.num_computed_tokens = 100, 70  # 3 and 2 complete blocks
    assert side.unprotected_tokens() == (5 * BS, 3 * BS)  # saves planned, none confirmed
    b_saves = [s for s in meta.saves if s.run.req_id == "b"]
    a_saves = [s for s in meta.saves if s.run.req_id == "a"]
    _saved(side, SimpleNamespace(saves=a_saves))  # type: ignore[arg-type]
    _saved(side, SimpleNamespace(saves=b_saves), ok=False)  # type: ignore[arg-type]
    assert side.unprotected_tokens() == (2 * BS, 2 * BS)  # a's held; b's failed
    side.request_finished(b, ([5, 6, 7],))  # type: ignore[arg-type]
    assert side.unprotected_tokens() == (0, 0)
    # Reported as gauges, when they change.
    values = [(5 * BS, 3 * BS), (5 * BS, 3 * BS), (0, 0)]
    reporter = StatsReporter(Counts(), block_size=BS, unprotected=lambda: values.pop(0),
                             store_interval_s=0)
    first = reporter.take()
    assert first is not None and first.data["gauges"]["unprotected_tokens"] == {"": 5.0 * BS}
    assert first.data["gauges"]["unprotected_tokens_max"] == {"": 3.0 * BS}
    assert reporter.take() is None  # unchanged: nothing to send
    last = reporter.take()
    assert last is not None and last.data["gauges"]["unprotected_tokens"] == {"": 0.0}


def test_failed_saves_are_planned_again() -> None:
    side = _side(FakeStore())
    req = FakeRequest("a", list(range(100)), 100)
    side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
    side.update_state_after_alloc(req, _blocks([1, 2, 3, 4]), 0)  # type: ignore[arg-type]
    meta = side.build_connector_meta(_step(new=[(req, [1, 2, 3, 4], 100)]))
    assert [(s.run.first, len(s.run)) for s in meta.saves] == [(0, 3)]
    side.update_connector_output(SimpleNamespace(  # type: ignore[arg-type]
        kv_connector_worker_meta=WorkerReport((
            SaveReport("a", 0, req.block_hashes[0], True),
            SaveReport("a", 1, req.block_hashes[1], False, retry_now=True))),
        finished_sending=None, finished_recving=None))
    req.num_computed_tokens = 100
    req.all_token_ids.append(1)
    meta = side.build_connector_meta(_step(cached=[(req, [], 1)]))
    assert [(s.run.first, len(s.run)) for s in meta.saves] == [(1, 2)]


# -- the router's fields: hints, epochs, deadlines ---------------------------------------------

def test_router_fields_parse_and_are_checked() -> None:
    params = parse_params({"session_id": "s", "restore": "auto", "session_epoch": 3,
                           "restore_reason": "failover", "previous_worker": "10.0.0.7:8000",
                           "some_other_component": {"x": 1}})  # unknown fields are ignored
    assert params == RestoreParams(SessionId("s"), "auto", None, 3, "failover", "10.0.0.7:8000")
    assert params.hinted and not parse_params({"session_epoch": 0}).hinted
    assert parse_params({"session_id": 42}).session_id == "42"
    for bad in ({"session_epoch": -1}, {"session_epoch": True}, {"session_epoch": "3"},
                {"session_epoch": 1 << 40}, {"restore_reason": "bored"},
                {"restore_reason": ["failover"]}, {"previous_worker": "w1\nFAKE LOG LINE"},
                {"previous_worker": ""}, {"previous_worker": "x" * 300},
                {"previous_worker": 7}, {"session_id": {"a": 1}}, {"session_id": True}):
        with pytest.raises(InvalidKey):
            parse_params(bad)


def test_hinted_restore_deadline() -> None:
    base = {"store": {"host_bytes": 1}}
    default = ConnectorConfig.from_extra(base)
    assert (default.restore_deadline_s, default.hinted_restore_deadline_s) == (2.0, 5.0)
    assert default.restore_deadline_for(hinted=True) == 5.0
    assert default.restore_deadline_for(hinted=False) == 2.0
    long = ConnectorConfig.from_extra({**base, "restore_deadline_ms": 8000})
    assert long.hinted_restore_deadline_s == 8.0  # never below the cold deadline
    set_ = ConnectorConfig.from_extra({**base, "restore_deadline_ms": 100,
                                       "hinted_restore_deadline_ms": 900})
    assert (set_.restore_deadline_s, set_.hinted_restore_deadline_s) == (0.1, 0.9)
    with pytest.raises(ConfigError):
        ConnectorConfig.from_extra({**base, "restore_deadline_ms": 1000,
                                    "hinted_restore_deadline_ms": 500})


def test_remote_replicas_default_to_two() -> None:
    def replicas(remote: dict[str, Any]) -> int:
        spec = ConnectorConfig.from_extra({"store": {"remote": remote}}).store.remote
        assert spec is not None
        return spec.replicas

    assert replicas({"etcd": "http://e:2379"}) == 2
    assert replicas({"daemons": {"a": "h:1", "b": "h:2", "c": "h:3"}}) == 2
    assert replicas({"daemons": {"a": "h:1"}}) == 1  # one listed daemon holds one copy
    assert replicas({"etcd": "http://e:2379", "replicas": 3}) == 3
    with pytest.raises(ConfigError):
        replicas({"daemons": {"a": "h:1", "b": "h:2"}, "replicas": 3})


def test_manifest_generations_fence_stale_writers() -> None:
    from connectors.vllm.manifests import EPOCH_STRIDE_US, manifest_generation

    t = 1_750_000_000_000_000

    def gen(started: int, epoch: int | None, previous: int = 0) -> int:
        return manifest_generation(started_us=started, epoch=epoch, previous=previous)

    # Each write of a request outranks its previous one.
    assert gen(t, 2, previous=gen(t, 2)) == gen(t, 2) + 1
    # The worker that lost the session: its request began before the takeover.
    assert gen(t + 5_000_000, 1) > gen(t, 0, previous=gen(t, 0) + 1000)
    # A lagging router sent a request to the old worker after the takeover: older epoch.
    assert gen(t, 1) > gen(t + EPOCH_STRIDE_US // 2, 0)
    # No router (no epoch): the later request wins, as it always did.
    assert gen(t + 1, None) > gen(t, None)
    # A binding that expired after an hour idle restarts at epoch 0 and still wins.
    assert gen(t + 3600_000_000, 0) > gen(t, 10, previous=gen(t, 10) + 5000)


def test_hinted_requests_get_the_longer_deadline_and_count_misses() -> None:
    side = _side(FakeStore(present=2), restore_deadline_ms=100, hinted_restore_deadline_ms=700)
    counters = side._counters
    moved = FakeRequest("a", list(range(5 * BS + 3)), 5 * BS + 3,
                        {"session_id": "s", "restore_reason": "failover",
                         "previous_worker": "w2", "session_epoch": 4})
    cold = FakeRequest("b", list(range(5 * BS + 3)), 5 * BS + 3)
    for req in (moved, cold):
        assert side.get_num_new_matched_tokens(req, 0) == (2 * BS, False)  # type: ignore[arg-type]
        side.update_state_after_alloc(req, _blocks([1, 2, 3, 4, 5, 6]),  # type: ignore[arg-type]
                                      2 * BS)
    meta = side.build_connector_meta(_step(new=[(moved, [1, 2, 3, 4, 5, 6], 3 * BS + 3),
                                                (cold, [1, 2, 3, 4, 5, 6], 3 * BS + 3)]))
    deadlines = {load.run.req_id: load.deadline_s for load in meta.loads}
    assert deadlines == {"a": 0.7, "b": 0.1}
    snapshot = counters.snapshot()
    assert snapshot[Count.RESTORES_HINTED] == 1
    assert snapshot[Count.HINTED_BLOCKS_MISSING] == 5 - 2  # asked 5, the store held 2
    assert snapshot["restores_hinted"] == 1  # by value as well as by member

    probing = _side(FakeStore(), lookup="worker", restore_deadline_ms=100,
                    hinted_restore_deadline_ms=700)
    probing._store = None
    assert probing.get_num_new_matched_tokens(moved, 0) == (None, False)  # type: ignore[arg-type]
    (probe,) = probing.build_connector_meta(_step()).probes
    assert probe.deadline_s == 0.7


def test_two_workers_of_one_session_write_fenced_manifests() -> None:
    """A real store: the worker that lost the session keeps writing; the holder's manifest
    stays. Two scheduler halves share one host tier, as two workers share the daemons."""
    from kvstore.keys import Namespace, SessionKey
    from kvstore.store import TieredStore
    from kvstore.tiers.memory.host import HostTier

    store = TieredStore([HostTier(8 << 20)])
    try:
        stale, holder = _side(store), _side(store)  # type: ignore[arg-type]
        history = list(range(3 * BS + 5))
        old = FakeRequest("old", list(history), len(history),
                          {"session_id": "s", "session_epoch": 0})
        new = FakeRequest("new", list(history) + [7] * BS, len(history) + BS,
                          {"session_id": "s", "session_epoch": 1,
                           "restore_reason": "failover", "previous_worker": "w1"})
        for side, req in ((stale, old), (holder, new)):
            side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
        _saved(holder, holder.build_connector_meta(_step(new=[(new, [1, 2, 3, 4, 5],
                                                               new.num_tokens)])))
        holder.drain_manifests()
        _saved(stale, stale.build_connector_meta(_step(new=[(old, [1, 2, 3, 4],
                                                             old.num_tokens)])))
        stale.drain_manifests()
        key = SessionKey.of(holder._fp, Namespace("default"), "s")
        manifest = store.get_manifest(key)
        assert manifest is not None and manifest.token_count == 4 * BS  # the holder's
        assert manifest.token_ids == tuple(new.all_token_ids)
        assert stale._counters.snapshot()[Count.MANIFESTS_WRITTEN] == 1  # tried, refused

        # A lagging router replica sends the old worker a request after the takeover, with
        # the old epoch: it began later, and still loses. With the holder's epoch it wins.
        for epoch, wins in ((0, False), (1, True)):
            params = {"session_id": "s", "session_epoch": epoch}
            late = FakeRequest(f"late-{epoch}", list(history), len(history), params)
            side = _side(store)  # type: ignore[arg-type]
            side.get_num_new_matched_tokens(late, 0)  # type: ignore[arg-type]
            _saved(side, side.build_connector_meta(_step(new=[(late, [1, 2, 3, 4],
                                                               late.num_tokens)])))
            side.drain_manifests()
            got = store.get_manifest(key)
            assert got is not None and (got.token_count == 3 * BS) == wins, epoch
    finally:
        store.close()
