"""State backends (in-process and real etcd): leases, CAS bindings, watches, rebinding."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

import pytest

from deploy.local.services import EtcdServer
from kvstore.keys import SessionId
from router.core import RouterCore
from router.decision import RouteReason
from router.membership.workers import WorkerId, WorkerInfo, WorkerPool
from router.policy import build_policy
from router.state import EtcdBackend, MemoryBackend, StateBackend
from router.state.bindings import Binding, VersionedBinding
from router.state.sessions import SessionTable
from router.tasks import BackgroundTasks, cancel_and_wait

W = WorkerId


class Recorder:
    """A worker sink that records what it saw and when."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}
        self.gone: dict[str, float] = {}

    def reset_workers(self, infos: Iterable[WorkerInfo]) -> None:
        self.workers = {i.worker_id: i for i in infos}

    def put_worker(self, info: WorkerInfo) -> None:
        self.workers[info.worker_id] = info

    def delete_worker(self, worker_id: WorkerId) -> None:
        self.workers.pop(worker_id, None)
        self.gone[worker_id] = time.monotonic()


async def until(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError
        await asyncio.sleep(0.01)


def info(wid: str) -> WorkerInfo:
    return WorkerInfo(W(wid), f"http://{wid}", ("m",))


async def _lease_cycle(backend: StateBackend, ttl: float) -> None:
    await backend.start()
    rec = Recorder()
    task = asyncio.create_task(backend.follow_workers(rec))
    try:
        lease = await backend.register_worker(info("a"), ttl)
        # b's lease would outlive the wait below by far: only its revocation can remove it.
        other = await backend.register_worker(info("b"), ttl * 20)
        await until(lambda: set(rec.workers) == {"a", "b"})
        assert await lease.keepalive()
        await lease.update(WorkerInfo(W("a"), "http://a", ("m",), draining=True))
        await until(lambda: rec.workers["a"].draining)
        await other.revoke()  # deregistration is seen at once, no TTL wait
        await until(lambda: "b" not in rec.workers, timeout=ttl * 10)
        # No more keepalives for a: its lease runs out (how fast is the backend's TTL, and
        # timing belongs in benchmarks: here only that it does, with keepalives refused after).
        await until(lambda: "a" in rec.gone, timeout=ttl + 30)
        assert not await lease.keepalive()
    finally:
        await cancel_and_wait([task])
        await backend.close()


def test_memory_leases_and_watch() -> None:
    asyncio.run(_lease_cycle(MemoryBackend(), 0.5))


def test_etcd_leases_and_watch(etcd_server: EtcdServer) -> None:
    asyncio.run(_lease_cycle(EtcdBackend(etcd_server.url, "/t1"), 2.0))


async def _cas(backend: StateBackend) -> None:
    await backend.start()
    try:
        sid = SessionId("s-1")
        b = Binding(sid, W("a"), "m")
        ok, vb = await backend.cas_binding(b, None, 60)
        assert ok and vb is not None
        # a second creator loses and learns the winner
        lost, winner = await backend.cas_binding(Binding(sid, W("b"), "m"), None, 60)
        assert not lost and winner == vb
        # an update against a stale revision loses
        ok2, vb2 = await backend.cas_binding(Binding(sid, W("c"), "m", 1), vb.revision, 60)
        assert ok2 and vb2 is not None and vb2.revision > vb.revision
        stale, now = await backend.cas_binding(Binding(sid, W("d"), "m", 1), vb.revision, 60)
        assert not stale and now is not None and now.worker_id == "c"
        assert await backend.get_binding(sid) == vb2
        assert await backend.get_binding(SessionId("nope")) is None
    finally:
        await backend.close()


def test_memory_cas() -> None:
    asyncio.run(_cas(MemoryBackend()))


def test_etcd_cas(etcd_server: EtcdServer) -> None:
    asyncio.run(_cas(EtcdBackend(etcd_server.url, "/t2")))


def test_etcd_two_tables_agree_under_races(etcd_server: EtcdServer) -> None:
    """Two replicas binding the same 50 new sessions at once to different workers: exactly
    one write per session wins and both caches end equal."""

    async def main() -> None:
        a, b = EtcdBackend(etcd_server.url, "/t3"), EtcdBackend(etcd_server.url, "/t3")
        await a.start()
        await b.start()
        ta, tb = SessionTable(a, 60), SessionTable(b, 60)
        tasks = [asyncio.create_task(a.follow_bindings(ta)),
                 asyncio.create_task(b.follow_bindings(tb))]
        try:
            await asyncio.sleep(0.1)
            sids = [SessionId(f"race-{i}") for i in range(50)]
            results = await asyncio.gather(
                *(ta.bind(s, W("wa"), "m", expected=None, reason="new", restore_from=None)
                  for s in sids),
                *(tb.bind(s, W("wb"), "m", expected=None, reason="new", restore_from=None)
                  for s in sids))
            wins = sum(1 for won, _ in results if won)
            assert wins == 50
            await until(lambda: len(ta) == 50 and len(tb) == 50)
            await until(lambda: all(ta.get(s) == tb.get(s) for s in sids))
            assert ta.conflicts + tb.conflicts == 50
        finally:
            await cancel_and_wait(tasks)
            await a.close()
            await b.close()

    asyncio.run(main())


def test_memory_bindings_expire() -> None:
    async def main() -> None:
        backend = MemoryBackend()
        await backend.start()
        table = SessionTable(backend, ttl_s=0.3)
        task = asyncio.create_task(backend.follow_bindings(table))
        try:
            await table.bind(SessionId("x"), W("a"), "m", expected=None, reason="new",
                             restore_from=None)
            assert table.get(SessionId("x")) is not None
            await until(lambda: table.get(SessionId("x")) is None, timeout=2)
        finally:
            await cancel_and_wait([task])
            await backend.close()

    asyncio.run(main())


def test_session_table_ignores_stale_events_and_settles() -> None:
    async def main() -> None:
        backend = MemoryBackend()
        table = SessionTable(backend, ttl_s=60)
        sid = SessionId("s")
        _, vb = await table.bind(sid, W("b"), "m", expected=None, reason="failover",
                                 restore_from=W("a"))
        assert vb is not None and table.bound_to(W("b")) == [sid]
        table.put(VersionedBinding(Binding(sid, W("z"), "m"), 0))  # older than ours
        assert table.get(sid) == vb
        table.delete(sid, 0)
        assert table.get(sid) == vb
        await table.touch(vb, settle=True)
        settled = table.get(sid)
        assert settled is not None and settled.binding.restore_from is None
        assert settled.worker_id == "b"

    asyncio.run(main())


def test_rebinder_spreads_a_dead_workers_sessions(etcd_server: EtcdServer) -> None:
    """Worker a's lease expires: its 40 sessions move to b and c (spread, with restore_from),
    and a second replica rebinding at the same time changes nothing twice."""

    async def main() -> None:
        backends = [EtcdBackend(etcd_server.url, "/t4") for _ in range(2)]
        replicas: list[tuple[WorkerPool, SessionTable, BackgroundTasks]] = []
        tasks = []
        for backend in backends:
            await backend.start()
            deferred = BackgroundTasks()
            core = RouterCore(build_policy("kvkeep"), backend=backend, session_ttl_s=60,
                              defer=deferred)
            tasks += [asyncio.create_task(backend.follow_workers(core.registry)),
                      asyncio.create_task(backend.follow_bindings(core.sessions))]
            replicas.append((core.pool, core.sessions, deferred))
        leases = {w: await backends[0].register_worker(info(w), 2.0) for w in "abc"}
        try:
            await until(lambda: all(len(p) == 3 for p, _, _ in replicas))
            table0 = replicas[0][1]
            for i in range(40):
                await table0.bind(SessionId(f"s{i}"), W("a"), "m", expected=None,
                                  reason="new", restore_from=None)
            await until(lambda: len(replicas[1][1]) == 40)
            killed = time.monotonic()
            for _ in range(4):  # b and c stay alive; a gets no keepalive
                await asyncio.sleep(0.6)
                await leases["b"].keepalive()
                await leases["c"].keepalive()
            await until(lambda: all(not t.bound_to(W("a")) for _, t, _ in replicas), 5)
            detected = time.monotonic() - killed
            assert detected <= 2.0 + 3.0  # TTL, plus the watch's delivery on a loaded machine
            for _, table, _ in replicas:
                b_count, c_count = len(table.bound_to(W("b"))), len(table.bound_to(W("c")))
                assert b_count + c_count == 40 and min(b_count, c_count) >= 10
                for i in range(40):
                    vb = table.get(SessionId(f"s{i}"))
                    assert vb is not None and vb.binding.restore_from == "a"
                    assert vb.binding.reason == RouteReason.FAILOVER.value
                    assert vb.binding.epoch == 1  # moved exactly once despite two replicas
            assert replicas[0][1].get(SessionId("s0")) == replicas[1][1].get(SessionId("s0"))
        finally:
            await cancel_and_wait(tasks)
            for _, _, deferred in replicas:
                await deferred.close()
            for backend in backends:
                await backend.close()

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["memory", "etcd"])
def test_worker_agent_registers_and_revokes_on_failed_probes(
        kind: str, request: pytest.FixtureRequest) -> None:
    """The agent registers a healthy server, keeps it while healthy, and revokes the lease
    after two failed probes (well inside one TTL)."""
    import aiohttp

    from router.node.agent import AgentConfig, WorkerAgent
    from tests.router_harness import FakeWorker

    async def main() -> None:
        backend: StateBackend = MemoryBackend() if kind == "memory" else \
            EtcdBackend(request.getfixturevalue("etcd_server").url, "/t5")
        await backend.start()
        fake = FakeWorker(model="fm")
        await fake.start()
        rec = Recorder()
        follow = asyncio.create_task(backend.follow_workers(rec))
        async with aiohttp.ClientSession() as http:
            agent = WorkerAgent(backend, AgentConfig(W("w"), fake.url, ttl_s=1.5), http)
            run = asyncio.create_task(agent.run())
            try:
                await until(lambda: "w" in rec.workers)
                assert rec.workers["w"].models == ("fm",)
                await asyncio.sleep(1.8)  # longer than the TTL: keepalives hold it
                assert "w" in rec.workers
                fake.healthy = False
                failed = time.monotonic()
                await until(lambda: "w" not in rec.workers, timeout=3)
                assert rec.gone["w"] - failed <= 1.5 + 0.5
                fake.healthy = True  # back: registered again
                await until(lambda: "w" in rec.workers, timeout=3)
            finally:
                await cancel_and_wait([run])
                await until(lambda: "w" not in rec.workers, timeout=2)  # revoked on exit
                await cancel_and_wait([follow])
                await fake.stop()
                await backend.close()

    asyncio.run(main())


def test_etcd_outage_is_survived(etcd_server: EtcdServer) -> None:
    """etcd goes away: writes fail as StateUnavailable (the proxy then routes unrecorded);
    when it is back, the watch re-lists and the worker re-registers without a restart."""
    from router.errors import StateUnavailable

    async def main() -> None:
        backend = EtcdBackend(etcd_server.url, "/t6", timeout_s=1.0)
        await backend.start()
        rec = Recorder()
        follow = asyncio.create_task(backend.follow_workers(rec))
        try:
            lease = await backend.register_worker(info("a"), 5.0)
            await until(lambda: "a" in rec.workers)
            etcd_server.restart()  # a clean restart keeps the data: the lease survives
            with pytest.raises(StateUnavailable):
                etcd_server.kill()
                await backend.cas_binding(Binding(SessionId("o"), W("a"), "m"), None, 60)
            etcd_server.restart()
            deadline = time.monotonic() + 10
            while True:  # the client reconnects on its own
                try:
                    ok, _ = await backend.cas_binding(Binding(SessionId("o"), W("a"), "m"),
                                                      None, 60)
                    break
                except StateUnavailable:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.2)
            assert ok
            if not await lease.keepalive():  # expired meanwhile: register again
                lease = await backend.register_worker(info("a"), 5.0)
            await backend.register_worker(info("b"), 5.0)
            await until(lambda: {"a", "b"} <= set(rec.workers), timeout=10)
        finally:
            await cancel_and_wait([follow])
            await backend.close()

    asyncio.run(main())


def test_a_worker_deleted_and_reregistered_at_once_never_leaves(etcd_server: EtcdServer) -> None:
    """After an etcd stall past the lease TTL, etcd expires every lease and each live agent
    re-registers within milliseconds: the router must not drop those workers (it did: every
    healthy worker left for that moment). A worker that stays deleted leaves after the grace."""

    class Sink:
        def __init__(self) -> None:
            self.deleted: list[str] = []
            self.put: list[str] = []

        def reset_workers(self, infos: list[WorkerInfo]) -> None:
            self.put.extend(i.worker_id for i in infos)

        def put_worker(self, info: WorkerInfo) -> None:
            self.put.append(info.worker_id)

        def delete_worker(self, worker_id: str) -> None:
            self.deleted.append(worker_id)

    async def main() -> None:
        backend = EtcdBackend(etcd_server.url, "/t7", worker_delete_grace_s=0.5)
        writer = EtcdBackend(etcd_server.url, "/t7")
        await backend.start()
        await writer.start()
        sink = Sink()
        task = asyncio.create_task(backend.follow_workers(sink))
        try:
            infos = {w: WorkerInfo(W(w), f"http://127.0.0.1:{9000 + i}", ("m",))
                     for i, w in enumerate(("stays", "goes"))}
            leases = {w: await writer.register_worker(info, 5.0) for w, info in infos.items()}
            await until(lambda: {"stays", "goes"} <= set(sink.put))
            # Both registrations vanish (as at a mass lease expiry); one comes straight back.
            for lease in leases.values():
                await lease.revoke()
            await writer.register_worker(infos["stays"], 5.0)
            await until(lambda: "goes" in sink.deleted, timeout=5)
            await asyncio.sleep(0.6)  # past the grace: "stays" was re-registered in time
            assert sink.deleted == ["goes"]
        finally:
            await cancel_and_wait([task])
            await backend.close()
            await writer.close()

    asyncio.run(main())
