"""The scheduler half never waits on the network inside vLLM's `schedule()` (issue 18, item 1).

A store whose tiers all answer from memory is asked inline; one with a tier across the network
answers from its in-memory tiers inline when they hold the whole run, and otherwise hands the
lookup to the background thread and tells vLLM to ask again (None). The slow tier here is a
host tier that sleeps in `contains` and says it is not in-process (a unit-level stand-in for a
remote daemon); the last test uses a real daemon, stopped with SIGSTOP.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.scheduler_side import SchedulerSide
from connectors.vllm.stats import Count, Counts
from deploy.local.daemons import start_daemon
from deploy.local.processes import freeze
from kvstore.keys import BlockKey, ModelFingerprint, Namespace
from kvstore.store import TieredStore
from kvstore.tiers.factory import RemoteSpec, build_tiers
from kvstore.tiers.memory.host import HostTier
from tests.blockframes import make_frame
from tests.test_connector_units import BS, FakeRequest

FP = ModelFingerprint("m", "w", "bfloat16", 2, 2, 32, BS, "cpu/tnhd", "raw")
NS = Namespace("default")


class NetworkLikeTier(HostTier):
    """A host tier that answers `contains` after `delay_s` (or once `gate` opens) and is not
    an in-process index: what the store treats as a network tier."""

    def __init__(self, delay_s: float = 0.05, gate: threading.Event | None = None) -> None:
        super().__init__(8 << 20, name="slow", page_bytes=4096, arena_bytes=1 << 20)
        self.delay_s = delay_s
        self.gate = gate
        self.calls = 0

    @property
    def indexed_in_process(self) -> bool:
        return False

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]:
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(10.0)
        time.sleep(self.delay_s)
        return super().contains(keys)


def _side(store: TieredStore, **extra: object) -> SchedulerSide:
    config = ConnectorConfig.from_extra({"store": {"host_bytes": 1}, **extra})
    return SchedulerSide(config=config, fingerprint=FP, store=store, block_size=BS,
                         num_layers=2, counters=Counts())


def _key(request: FakeRequest, i: int) -> BlockKey:
    return BlockKey.of(FP, NS, bytes(request.block_hashes[i]))


def _fill(tier: HostTier, request: FakeRequest, blocks: range) -> None:
    for i in blocks:
        key = _key(request, i)
        assert tier.put(key, make_frame(key))


def _answer(side: SchedulerSide, request: FakeRequest, timeout: float = 10.0) -> int | None:
    """Ask as vLLM does, once a step (every 5 ms here), until it gets an answer."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        tokens, _ = side.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
        if tokens is not None:
            return tokens
        time.sleep(0.005)
    return None


def test_a_store_of_memory_tiers_is_answered_inline() -> None:
    host = HostTier(8 << 20, page_bytes=4096, arena_bytes=1 << 20)
    store = TieredStore([host])
    try:
        side = _side(store)
        assert side._background is None  # no thread for a store that never waits
        req = FakeRequest("a", list(range(5 * BS + 3)), 5 * BS + 3)
        _fill(host, req, range(3))
        assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, False)  # type: ignore[arg-type]
    finally:
        store.close()


def test_network_lookups_leave_the_scheduler_loop_and_come_back() -> None:
    host, slow = HostTier(8 << 20, page_bytes=4096, arena_bytes=1 << 20), NetworkLikeTier()
    store = TieredStore([host, slow])
    side = _side(store)
    try:
        req = FakeRequest("a", list(range(5 * BS + 3)), 5 * BS + 3)
        _fill(host, req, range(2))
        _fill(slow, req, range(5))
        # The first ask does not wait for the 50 ms tier: vLLM is told to ask again.
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # type: ignore[arg-type]
        assert side.has_pending_work()  # keeps vLLM's loop stepping to ask again
        assert _answer(side, req) == 5 * BS  # the slow tier's blocks count
        assert slow.calls == 1
        # Asked again (vLLM could not schedule it): the answer is reused, no second lookup.
        assert side.get_num_new_matched_tokens(req, 0) == (5 * BS, False)  # type: ignore[arg-type]
        assert slow.calls == 1

        # The in-memory tiers hold the whole run: answered inline, the slow tier not asked.
        short = FakeRequest("b", list(range(2 * BS + 3)), 2 * BS + 3)
        short.block_hashes = req.block_hashes[:2]
        assert side.get_num_new_matched_tokens(short, 0) == (2 * BS, False)  # type: ignore[arg-type]
        assert slow.calls == 1
        counters = side._counters.snapshot()
        assert counters[Count.LOOKUPS] == 2 and counters[Count.LOOKUP_DEADLINE] == 0
    finally:
        side.shutdown()
        store.close()


def test_one_steps_arrivals_share_one_store_call() -> None:
    gate = threading.Event()
    host, slow = HostTier(8 << 20, page_bytes=4096, arena_bytes=1 << 20), \
        NetworkLikeTier(delay_s=0.0, gate=gate)
    store = TieredStore([host, slow])
    side = _side(store)
    try:
        requests = []
        for n in range(6):
            req = FakeRequest(f"r{n}", [n] * (4 * BS + 1), 4 * BS + 1)
            req.block_hashes = [bytes([n, i]) * 16 for i in range(4)]
            _fill(slow, req, range(n % 4 + 1))
            requests.append(req)
        for req in requests:  # one step's waiting requests
            assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # type: ignore[arg-type]
        gate.set()
        answers = [_answer(side, req) for req in requests]
        assert answers == [(n % 4 + 1) * BS for n in range(6)]
        # The thread may have started on the first request before the rest were queued.
        assert side._background is not None and side._background.passes <= 2
        assert slow.calls == side._background.passes
    finally:
        gate.set()
        side.shutdown()
        store.close()


def test_a_late_network_tier_restores_what_memory_holds_and_counts_the_deadline() -> None:
    host, slow = HostTier(8 << 20, page_bytes=4096, arena_bytes=1 << 20), \
        NetworkLikeTier(delay_s=0.6)
    store = TieredStore([host, slow])
    side = _side(store, restore_deadline_ms=100)
    try:
        req = FakeRequest("a", list(range(5 * BS + 3)), 5 * BS + 3)
        _fill(host, req, range(2))
        _fill(slow, req, range(5))
        assert side.get_num_new_matched_tokens(req, 0) == (None, False)  # type: ignore[arg-type]
        assert _answer(side, req) == 2 * BS  # past 100 ms: the host tier's two blocks
        assert side._counters.snapshot()[Count.LOOKUP_DEADLINE] == 1
        # The late answer, when it comes, is dropped rather than kept for a request that
        # already moved on.
        background = side._background
        assert background is not None
        give_up = time.monotonic() + 5
        while background.pending and time.monotonic() < give_up:
            time.sleep(0.02)
        assert not background.pending
    finally:
        side.shutdown()
        store.close()


@pytest.fixture
def stopped_daemon(tmp_path: Path) -> Iterator[str]:
    daemon = start_daemon(tmp_path, "d1")
    assert daemon.proc is not None
    freeze(daemon.proc.pid)
    try:
        yield daemon.address
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        daemon.kill()


def test_a_stopped_daemon_never_holds_the_scheduler(stopped_daemon: str) -> None:
    """A real daemon that accepts connections and never answers (SIGSTOP): each ask returns
    at once, and at the deadline the request restores what the host tier holds."""
    host = HostTier(8 << 20, page_bytes=4096, arena_bytes=1 << 20)
    (remote,) = build_tiers([RemoteSpec(daemons=(("d1", stopped_daemon),), replicas=1,
                                        timeout_s=2.0)])
    store = TieredStore([host, remote])
    side = _side(store, restore_deadline_ms=300)
    try:
        req = FakeRequest("a", list(range(4 * BS + 1)), 4 * BS + 1)
        _fill(host, req, range(1))
        asks = 0
        answer: int | None = None
        while answer is None:
            answer, _ = side.get_num_new_matched_tokens(req, 0)  # type: ignore[arg-type]
            asks += 1
            time.sleep(0.01)
        assert answer == BS and asks > 1  # never blocked: vLLM was told to ask again
        assert side._counters.snapshot()[Count.LOOKUP_DEADLINE] == 1
    finally:
        side.shutdown()
        store.close()
