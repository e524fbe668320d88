"""TieredStore: tier order, write-behind, promotion, lookup, deadlines, corruption, failing tiers,
read priority, manifests, metrics, and a mixed threaded + asyncio stress run."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from kvstore.errors import DeadlineExceeded, InvalidFrame, KVKeepError, TierUnavailable
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionManifest
from kvstore.metrics import StoreMetrics
from kvstore.store import AsyncTieredStore, StoreConfig, TieredStore
from kvstore.tiers.base import Buffer, TierStats
from kvstore.tiers.factory import HbmSpec, HostSpec, NvmeSpec, RemoteSpec, build_tiers
from kvstore.tiers.memory.hbm import cuda_available
from kvstore.tiers.memory.host import HostTier
from tests.blockframes import block_key, corrupt, make_frame, session_key

MiB = 1 << 20


def host(name: str, budget: int = 4 * MiB) -> HostTier:
    return HostTier(budget, name=name, page_bytes=4096, arena_bytes=MiB)


def sample(store: TieredStore, metric: str, **labels: str) -> float:
    value = store.metrics.registry.get_sample_value(f"kvkeep_store_{metric}", labels)
    return 0.0 if value is None else value


@pytest.fixture
def two_hosts() -> Iterator[tuple[TieredStore, HostTier, HostTier]]:
    upper, lower = host("host"), host("lower")
    store = TieredStore([upper, lower])
    yield store, upper, lower
    store.close()


class FailingTier:
    """A tier that fails every call with `error` (a unit fake: a sick tier)."""

    def __init__(self, name: str, error: Exception) -> None:
        self._name, self._error = name, error

    @property
    def name(self) -> str:
        return self._name

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        raise self._error

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        raise self._error

    def put(self, key: BlockKey, frame: bytes | bytearray | memoryview) -> bool:
        raise self._error

    def delete(self, keys: Sequence[BlockKey]) -> int:
        raise self._error

    def put_manifest(self, manifest: SessionManifest) -> None:
        raise self._error

    def get_manifest(self, key: SessionKey) -> SessionManifest | None:
        raise self._error

    def delete_manifest(self, key: SessionKey) -> bool:
        raise self._error

    def stats(self) -> TierStats:
        raise self._error

    def close(self) -> None:
        pass


class GatedTier(HostTier):
    """A host tier whose gets and/or puts wait for an event (a slow or busy tier)."""

    def __init__(self, name: str, *, gate_gets: bool = False, gate_puts: bool = False,
                 get_delay: float = 0.0, budget: int = 4 * MiB) -> None:
        super().__init__(budget, name=name, page_bytes=4096, arena_bytes=MiB)
        self.gate_gets, self.gate_puts, self.get_delay = gate_gets, gate_puts, get_delay
        self.release = threading.Event()
        self.get_entered = threading.Event()
        self.put_entered = threading.Event()
        self.put_keys: list[BlockKey] = []

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        self.get_entered.set()
        if self.gate_gets:
            assert self.release.wait(10)
        if self.get_delay:
            time.sleep(self.get_delay)
        return super().get(key, layers, out=out, deadline=deadline)

    def put(self, key: BlockKey, frame: bytes | bytearray | memoryview) -> bool:
        self.put_entered.set()
        if self.gate_puts:
            assert self.release.wait(10)
        self.put_keys.append(key)
        return super().put(key, frame)


def test_put_writes_through_then_behind(two_hosts: tuple[TieredStore, HostTier, HostTier]
                                        ) -> None:
    store, upper, lower = two_hosts
    key = block_key(1)
    frame = bytearray(make_frame(key))
    assert store.put(key, frame)
    assert upper.contains([key]) == [True]
    frame[-1] ^= 0xFF  # the caller reuses its buffer at once: the store kept no reference
    assert store.flush(5)
    read = lower.get(key)
    assert read is not None and read.to_frame() == make_frame(key)
    assert sample(store, "written_bytes_total", tier="host") == len(frame)
    assert sample(store, "written_bytes_total", tier="lower") == len(frame)
    assert store.pending_writes == 0


def test_repeated_puts_write_behind_only_once() -> None:
    upper, lower = host("host"), GatedTier("lower")
    store = TieredStore([upper, lower])
    try:
        key = block_key(1)
        for _ in range(4):  # a shared prefix block is saved by every request that has it
            assert store.put(key, make_frame(key))
            assert store.flush(5)
        assert lower.put_keys == [key]
    finally:
        store.close()


def test_get_walks_in_order_verifies_and_promotes(
        two_hosts: tuple[TieredStore, HostTier, HostTier]) -> None:
    store, upper, lower = two_hosts
    key = block_key(1)
    frame = make_frame(key)
    lower.put(key, frame)
    out = bytearray(len(frame))
    read = store.get(key, out=out)
    assert read is not None and read.to_frame() == frame
    assert sample(store, "hits_total", tier="lower") == 1
    assert sample(store, "tier_misses_total", tier="host") == 1
    assert store.flush(5)
    assert upper.contains([key]) == [True]
    assert sample(store, "promotions_total", tier="host") == 1
    assert store.get(key) is not None
    assert sample(store, "hits_total", tier="host") == 1
    assert sample(store, "read_bytes_total", tier="host") == len(read.payload)


def test_layer_range_hit_promotes_the_whole_block(
        two_hosts: tuple[TieredStore, HostTier, HostTier]) -> None:
    store, upper, lower = two_hosts
    key = block_key(1)
    frame = make_frame(key)
    lower.put(key, frame)
    for layer in range(4):  # a layer-by-layer restore: one promotion, not four
        read = store.get(key, LayerRange(layer, layer + 1))
        assert read is not None
        assert bytes(read.segment(layer)) == bytes(BlockRead.from_frame(frame).segment(layer))
    assert store.flush(5)
    whole = upper.get(key)
    assert whole is not None and whole.to_frame() == frame
    assert sample(store, "promotions_total", tier="host") == 1


def test_corrupt_copy_in_upper_tier_falls_through_to_good_copy(
        two_hosts: tuple[TieredStore, HostTier, HostTier]) -> None:
    store, upper, lower = two_hosts
    key = block_key(1)
    frame = make_frame(key)
    upper.put(key, corrupt(frame))  # the host tier checks headers, not segments, on put
    lower.put(key, frame)
    read = store.get(key)
    assert read is not None and read.to_frame() == frame
    assert sample(store, "corrupt_blocks_total", tier="host") == 1
    assert store.flush(5)
    repaired = upper.get(key)  # the corrupt copy was deleted and the good one promoted
    assert repaired is not None and repaired.to_frame() == frame


def test_corrupt_everywhere_is_a_miss_and_deleted(
        two_hosts: tuple[TieredStore, HostTier, HostTier]) -> None:
    store, upper, lower = two_hosts
    key = block_key(1)
    upper.put(key, corrupt(make_frame(key)))
    lower.put(key, corrupt(make_frame(key), 100))
    assert store.get(key) is None
    assert sample(store, "misses_total") == 1
    assert upper.contains([key]) == lower.contains([key]) == [False]
    assert store.stats().corrupt == 2


def test_frame_for_another_key_is_never_served() -> None:
    wrong = make_frame(block_key(2))

    class Confused(HostTier):
        def get(self, key: BlockKey, layers: LayerRange | None = None, *,
                out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
            return BlockRead.from_frame(wrong, layers)

    confused = TieredStore([Confused(MiB, name="confused")])
    try:
        assert confused.get(block_key(1)) is None
        assert sample(confused, "corrupt_blocks_total", tier="confused") == 1
    finally:
        confused.close()


@pytest.mark.parametrize("error", [TierUnavailable("down"), OSError(5, "EIO"),
                                   RuntimeError("bug")])
def test_failing_tier_is_treated_as_empty(error: Exception) -> None:
    good = host("good")
    store = TieredStore([FailingTier("sick", error), good])
    try:
        key = block_key(1)
        frame = make_frame(key)
        assert store.put(key, frame)  # the sick first tier refused; the write went behind
        assert store.flush(5)
        assert good.contains([key]) == [True]
        read = store.get(key)
        assert read is not None and read.to_frame() == frame
        assert store.lookup([key, block_key(2)]) == 1
        assert sample(store, "errors_total", tier="sick", op="get") == 1
        assert sample(store, "errors_total", tier="sick", op="put") == 1
        assert sample(store, "errors_total", tier="sick", op="contains") == 1
        assert store.stats().tiers[0] == TierStats("sick", 0, 0, 0)
    finally:
        store.close()


def test_lookup_is_the_contiguous_prefix_across_tiers(
        two_hosts: tuple[TieredStore, HostTier, HostTier]) -> None:
    store, upper, lower = two_hosts
    keys = [block_key(i) for i in range(10)]
    for i in (0, 1, 2):
        upper.put(keys[i], make_frame(keys[i]))
    for i in (2, 3, 4, 6, 7):
        lower.put(keys[i], make_frame(keys[i]))
    assert store.lookup(keys) == 5
    assert store.lookup(keys[5:]) == 0
    assert store.lookup([]) == 0
    assert store.lookup(keys[:5]) == 5


def test_deadline_passed_between_tiers_is_a_miss() -> None:
    slow = GatedTier("slow", get_delay=0.15)
    fast = host("fast")
    store = TieredStore([slow, fast], config=StoreConfig(get_deadline_s=0.05))
    try:
        key = block_key(1)
        fast.put(key, make_frame(key))
        started = time.monotonic()
        assert store.get(key) is None  # the slow tier used up the deadline
        assert time.monotonic() - started < 5.0  # not a hang: the lower tier was not asked
        assert sample(store, "deadline_misses_total") == 1
        assert store.get(key, deadline=time.monotonic() + 5) is not None
    finally:
        store.close()


def test_deadline_exceeded_from_a_tier_is_a_miss() -> None:
    class Expired(HostTier):
        def get(self, key: BlockKey, layers: LayerRange | None = None, *,
                out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
            raise DeadlineExceeded("remote took too long")

    below = host("below")
    store = TieredStore([Expired(MiB, name="remote"), below])
    try:
        key = block_key(1)
        below.put(key, make_frame(key))
        assert store.get(key) is None  # the deadline is gone: lower tiers are not asked
        assert sample(store, "deadline_misses_total") == 1
        assert sample(store, "errors_total", tier="remote", op="get") == 0
    finally:
        store.close()


def test_full_queue_drops_the_write_behind_without_blocking() -> None:
    upper, lower = host("host"), GatedTier("lower", gate_puts=True)
    store = TieredStore([upper, lower], config=StoreConfig(write_queue_depth=2, write_batch=1))
    try:
        keys = [block_key(i) for i in range(8)]
        started = time.monotonic()
        assert all(store.put(key, make_frame(key)) for key in keys)
        assert time.monotonic() - started < 10.0  # the gate never opens: a block would hang
        assert upper.contains(keys) == [True] * 8
        # One job is in the writer's hands, two wait in the queue, the rest were dropped.
        assert store.stats().write_behind_dropped >= 5
        assert sample(store, "write_behind_dropped_total", reason="queue_full") >= 5
        lower.release.set()
        assert store.flush(5)
        assert sum(lower.contains(keys)) == 8 - store.stats().write_behind_dropped
    finally:
        lower.release.set()
        store.close()


def test_a_block_waiting_for_its_write_behind_is_not_evicted() -> None:
    """The write-behind reads a put back from the first tier: until then the block is held
    there (evicted first, an acknowledged block would be lost; tests/test_write_behind_holds.py).
    A put that finds the first tier full of such blocks goes down with its own copy."""
    key_size = len(make_frame(block_key(0)))
    upper = HostTier(2 * key_size, name="host", page_bytes=1024, arena_bytes=64 << 10)
    lower = GatedTier("lower", gate_puts=True)
    store = TieredStore([upper, lower], config=StoreConfig(write_batch=1))
    try:
        first, waiting, last = block_key(1), block_key(2), block_key(3)
        store.put(first, make_frame(first))
        assert lower.put_entered.wait(5)  # the writer holds `first`, stuck in the lower tier
        held = []
        for key in (waiting, last):  # the host tier has room for one block at most
            assert store.put(key, make_frame(key))
            held += [k for k in (first, waiting, last) if upper.contains([k])[0]]
        # `first`, being written, stayed; what the host tier did not take went down as a copy.
        assert upper.contains([first]) == [True] and held.count(first) == 2
        lower.release.set()
        assert store.flush(5)
        assert lower.contains([first, waiting, last]) == [True, True, True]
        assert sample(store, "write_behind_dropped_total", reason="source_gone") == 0
    finally:
        lower.release.set()
        store.close()


def test_delete_cancels_queued_write_behind() -> None:
    upper, lower = host("host"), GatedTier("lower", gate_puts=True)
    store = TieredStore([upper, lower], config=StoreConfig(write_batch=1))
    try:
        busy, doomed = block_key(1), block_key(2)
        store.put(busy, make_frame(busy))
        assert lower.put_entered.wait(5)
        store.put(doomed, bytes(make_frame(doomed)))
        assert store.delete([doomed]) == 1
        lower.release.set()
        assert store.flush(5)
        assert lower.contains([busy, doomed]) == [True, False]
        assert doomed not in lower.put_keys
    finally:
        lower.release.set()
        store.close()


def test_writers_yield_to_reads_in_flight() -> None:
    upper = host("host")
    lower = GatedTier("lower", gate_gets=True)
    store = TieredStore([upper, lower], config=StoreConfig(read_priority_max_wait_s=5.0,
                                                           promote=False))
    try:
        read_key, write_key = block_key(1), block_key(2)
        lower.put(read_key, make_frame(read_key))
        reader = threading.Thread(target=store.get, args=(read_key,),
                                  kwargs={"deadline": time.monotonic() + 10})
        reader.start()
        assert lower.get_entered.wait(5)
        store.put(write_key, make_frame(write_key))
        time.sleep(0.3)
        assert lower.contains([write_key]) == [False]  # held back while the read runs
        lower.release.set()
        reader.join(5)
        assert store.flush(5)
        assert lower.contains([write_key]) == [True]
    finally:
        lower.release.set()
        store.close()


def test_batched_forms_and_out_buffers(two_hosts: tuple[TieredStore, HostTier, HostTier]
                                       ) -> None:
    store, _, _ = two_hosts
    keys = [block_key(i) for i in range(4)]
    frames = [make_frame(key) for key in keys]
    assert store.put_many(list(zip(keys, frames, strict=True))) == [True] * 4
    outs = [bytearray(8192) for _ in keys]
    reads = store.get_many([*keys[:3], block_key(99)], LayerRange(1, 3),
                           outs=[*outs[:3], bytearray(8192)])
    assert reads[3] is None
    for read, frame, out in zip(reads[:3], frames[:3], outs[:3], strict=True):
        assert read is not None
        start, stop = FrameHeader.unpack(frame).span(LayerRange(1, 3))
        assert bytes(read.payload) == frame[start:stop] == out[: stop - start]


def test_invalid_frames_are_rejected_at_put(two_hosts: tuple[TieredStore, HostTier, HostTier]
                                            ) -> None:
    store, _, _ = two_hosts
    with pytest.raises(InvalidFrame):
        store.put(block_key(1), make_frame(block_key(2)))
    with pytest.raises(InvalidFrame):
        store.put(block_key(1), b"garbage" * 10)
    header_flip = bytearray(make_frame(block_key(1)))
    header_flip[20] ^= 1
    with pytest.raises(InvalidFrame):
        store.put(block_key(1), header_flip)


def test_manifests_highest_generation_wins_and_repairs_upper_tiers(
        two_hosts: tuple[TieredStore, HostTier, HostTier]) -> None:
    store, upper, lower = two_hosts
    skey = session_key()
    store.put_manifest(SessionManifest(skey, (), token_count=16, generation=1))
    assert upper.get_manifest(skey) is not None
    assert store.flush(5)
    assert lower.get_manifest(skey) is not None
    newer = SessionManifest(skey, (), token_count=64, generation=5)
    lower.put_manifest(newer)  # e.g. written by another worker through the shared tier
    assert store.get_manifest(skey) == newer
    assert upper.get_manifest(skey) == newer
    assert store.get_manifest(session_key("other")) is None
    assert store.delete_manifest(skey)
    assert store.get_manifest(skey) is None


def test_metrics_registries_are_per_store_or_injected() -> None:
    first, second = TieredStore([host("host")]), TieredStore([host("host")])
    registry = CollectorRegistry()
    third = TieredStore([host("host")], metrics=StoreMetrics(registry))
    try:
        key = block_key(1)
        for store in (first, second, third):
            store.put(key, make_frame(key))
            store.get(key)
        assert registry.get_sample_value("kvkeep_store_hits_total", {"tier": "host"}) == 1
        assert sample(first, "hits_total", tier="host") == 1
        assert registry.get_sample_value("kvkeep_store_latency_seconds_count",
                                         {"tier": "host", "op": "get"}) == 1
    finally:
        for store in (first, second, third):
            store.close()


def test_close_flushes_and_then_refuses() -> None:
    upper, lower = host("host"), host("lower")
    store = TieredStore([upper, lower], close_tiers=False)
    key = block_key(1)
    store.put(key, make_frame(key))
    store.close()
    assert lower.contains([key]) == [True]
    with pytest.raises(TierUnavailable):
        store.get(key)
    with pytest.raises(TierUnavailable):
        store.put(key, make_frame(key))
    store.close()


def test_factory_skips_hbm_without_cuda_and_builds_the_rest(tmp_path: Path) -> None:
    specs = [HbmSpec(64 * MiB), HostSpec(8 * MiB, name="ram"),
             NvmeSpec(str(tmp_path / "nvme"), 16 * MiB, durable=False)]
    store = TieredStore.from_specs(specs)
    try:
        names = [tier.name for tier in store.tiers]
        assert names == (["hbm", "ram", "nvme"] if cuda_available() else ["ram", "nvme"])
        key = block_key(1)
        assert store.put(key, make_frame(key)) and store.flush(5)
        assert store.tiers[-1].contains([key]) == [True]
    finally:
        store.close()
    from kvstore.errors import ConfigError

    if not cuda_available():
        with pytest.raises(ConfigError):
            build_tiers([HbmSpec(MiB, optional=False)])
        with pytest.raises(ConfigError, match="no tier"):
            build_tiers([HbmSpec(MiB)])
    with pytest.raises(ConfigError):
        NvmeSpec("", MiB)
    with pytest.raises(ConfigError):
        HostSpec(0)
    with pytest.raises(ConfigError):  # exactly one of etcd and a daemon list
        RemoteSpec(etcd="http://127.0.0.1:2379", daemons=(("a", "127.0.0.1:1"),))
    with pytest.raises(ConfigError):
        RemoteSpec()


def test_factory_closes_what_it_built_when_a_later_tier_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("not a directory")
    closed: list[str] = []
    real_close = HostTier.close

    def recording_close(self: HostTier) -> None:
        closed.append(self.name)
        real_close(self)

    monkeypatch.setattr(HostTier, "close", recording_close)
    with pytest.raises(KVKeepError):
        build_tiers([HostSpec(MiB, name="first"), NvmeSpec(str(tmp_path / "file"), MiB)])
    assert closed == ["first"]


def test_async_wrappers(two_hosts: tuple[TieredStore, HostTier, HostTier]) -> None:
    store, _, _ = two_hosts
    keys = [block_key(i) for i in range(6)]

    aio = AsyncTieredStore(store)

    async def main() -> None:
        assert all(await asyncio.gather(*(aio.put(k, make_frame(k)) for k in keys)))
        reads = await asyncio.gather(*(aio.get(k) for k in keys))
        assert [r.to_frame() if r else None for r in reads] == [make_frame(k) for k in keys]
        assert all(r is not None and r.verified for r in reads)
        assert await aio.lookup(keys) == 6
        assert await aio.flush(5)
        many = await aio.get_many(keys[:2], LayerRange(1, 2))
        assert all(r is not None and r.layers == LayerRange(1, 2) for r in many)
        assert await aio.delete(keys[:1]) == 1
        assert await aio.lookup(keys) == 0
        # A deadline is fixed before the hop to a thread: one already past is a miss.
        assert await aio.get(keys[1], deadline=time.monotonic() - 1) is None
        skey = session_key()
        await aio.put_manifest(SessionManifest(skey, (), token_count=16, generation=1))
        assert (await aio.get_manifest(skey)) is not None
        assert await aio.delete_manifest(skey)

    asyncio.run(main())


def _nvme_tier_class() -> type | None:
    try:
        from kvstore.tiers.nvme.tier import NvmeTier
    except ImportError:
        return None
    return NvmeTier


@pytest.mark.skipif(_nvme_tier_class() is None, reason="kvstore.tiers.nvme.tier not available yet")
def test_host_over_nvme(tmp_path: Path) -> None:
    nvme_cls = _nvme_tier_class()
    assert nvme_cls is not None
    keys = [block_key(i) for i in range(6)]
    frames = {key: make_frame(key, segment_bytes=8192) for key in keys}
    store = TieredStore([host("host"), nvme_cls(tmp_path / "nvme", 16 * MiB)])
    try:
        assert store.put_many(list(frames.items())) == [True] * len(keys)
        assert store.flush(10)
    finally:
        store.close()
    # A restart: RAM is empty, the disk still has every block, and hits are promoted.
    upper = host("host")
    store = TieredStore([upper, nvme_cls(tmp_path / "nvme", 16 * MiB)])
    try:
        assert store.lookup(keys) == len(keys)
        for key in keys:
            read = store.get(key, deadline=time.monotonic() + 5)
            assert read is not None and read.to_frame() == frames[key]
        assert store.flush(10)
        assert upper.contains(keys) == [True] * len(keys)
        assert sample(store, "hits_total", tier="nvme") == len(keys)
    finally:
        store.close()


def test_concurrent_threads_and_asyncio_read_only_what_was_written() -> None:
    # A small upper tier forces evictions, promotions and write-behind drops all the time.
    upper = host("host", budget=24 * 5 * 4096)
    lower = host("lower", budget=4 * MiB)
    store = TieredStore([upper, lower], config=StoreConfig(write_queue_depth=16,
                                                           get_deadline_s=5.0))
    keys = [block_key(i) for i in range(64)]
    frames = {key: make_frame(key, segment_bytes=4096) for key in keys}
    full = LayerRange(0, 4)
    errors: list[str] = []
    reads_checked = [0]
    stop_at = time.monotonic() + 2.0

    def check(key: BlockKey, read: BlockRead | None, layers: LayerRange) -> None:
        if read is None:
            return
        if not read.verified:
            errors.append("the store returned a read not marked verified")
        # Hash it again here (an unmarked copy of the read), whatever the store did.
        BlockRead(read.header, read.layers, read.payload).verified_for(key.digest)
        start, stop = FrameHeader.unpack(frames[key]).span(layers)
        if bytes(read.payload) != frames[key][start:stop]:
            errors.append(f"wrong bytes for {key.block_hash!r}")
        reads_checked[0] += 1

    def thread_main(seed: int) -> None:
        rng = random.Random(seed)
        out = bytearray(32 << 10)
        try:
            while time.monotonic() < stop_at:
                key = rng.choice(keys)
                action = rng.random()
                if action < 0.35:
                    store.put(key, frames[key])
                elif action < 0.8:
                    layers = rng.choice([full, LayerRange(1, 3), LayerRange(3, 4)])
                    check(key, store.get(key, layers, out=out), layers)
                elif action < 0.95:
                    start = rng.randrange(len(keys))
                    prefix = store.lookup(keys[start: start + 8])
                    if not 0 <= prefix <= 8:
                        errors.append(f"bad prefix {prefix}")
                else:
                    store.delete([key])
        except Exception as exc:
            errors.append(repr(exc))

    aio = AsyncTieredStore(store)

    async def async_main() -> None:
        rng = random.Random(99)
        while time.monotonic() < stop_at:
            batch = rng.sample(keys, 4)
            await asyncio.gather(*(aio.put(k, frames[k]) for k in batch[:2]))
            reads = await asyncio.gather(*(aio.get(k) for k in batch))
            for key, read in zip(batch, reads, strict=True):
                check(key, read, full)
            await aio.lookup(batch)

    threads = [threading.Thread(target=thread_main, args=(n,)) for n in range(4)]
    try:
        for thread in threads:
            thread.start()
        asyncio.run(async_main())
        for thread in threads:
            thread.join(10)
        assert not errors, errors[:5]
        assert reads_checked[0] > 100
        assert store.flush(10)
        assert store.stats().corrupt == 0
        assert upper.pinned_blocks == 0 and lower.pinned_blocks == 0
        for key in keys:  # whatever is still stored anywhere is exactly what was written
            check(key, store.get(key), full)
        assert not errors
    finally:
        store.close()
