"""The control plane (kvstore/cluster/) and what it believes (trust review H2, L1, earlier
finding 3): a registration counts only while attached to a lease and only under the key its id
names; a forged copy of a worker's record is ignored and counted, never re-points the worker,
and is not resurrected by a router restart; a worker agent or daemon registrar whose own key is
overwritten writes it back; under TLS-only daemon trust, aliases of one address cannot collapse
replicas; a supervised task that dies is run again.

Real etcd, real routers behind HTTP, the real worker agent and daemon registrar; fake workers
stand in for vLLM (one of them plays the attacker's capture server).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Mapping

import aetcd  # type: ignore[import-untyped]
import httpx
import pytest

from deploy.local.services import EtcdServer
from kvstore.cluster.daemon_trust import DaemonTrust, identities
from kvstore.cluster.discovery import DaemonInfo, EtcdDiscovery
from kvstore.cluster.retry import LOOP_RETRY, Backoff, RetryPolicy
from kvstore.cluster.supervisor import supervise
from kvstore.daemon.registration import Registrar
from kvstore.errors import ConfigError
from router.membership.allowlist import WorkerAllowList
from router.membership.workers import WorkerId, WorkerInfo
from router.tasks import cancel_and_wait
from tests.router_harness import FakeWorker, LoopThread, RouterHandle, loop_thread, wait_until
from tests.test_etcd_poison import MODEL, PREFIX, Agents, _ignored, _registered, _router


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    with loop_thread() as thread:
        yield thread


async def _put(etcd: EtcdServer, key: str, value: Mapping[str, object], *, leased: bool
               ) -> None:
    """A write as an attacker with etcd access makes it (its own lease, or none)."""
    client = aetcd.Client(host="127.0.0.1", port=etcd.port)
    try:
        lease = await client.lease(120) if leased else None
        await client.put(key.encode(), json.dumps(value).encode(), lease=lease)
    finally:
        await client.close()


async def _delete(etcd: EtcdServer, *keys: str) -> None:
    client = aetcd.Client(host="127.0.0.1", port=etcd.port)
    try:
        for key in keys:
            await client.delete(key.encode())
    finally:
        await client.close()


async def _stored(etcd: EtcdServer, key: str) -> dict[str, object]:
    """The URL and lease of a worker record as etcd holds it now."""
    client = aetcd.Client(host="127.0.0.1", port=etcd.port)
    try:
        kv = await client.get(key.encode())
        return {"url": json.loads(kv.value)["url"], "lease": int(kv.lease)}
    finally:
        await client.close()


def _workers_of(router: RouterHandle, n: int) -> set[str]:
    with httpx.Client(base_url=router.url, timeout=10) as http:
        seen = set()
        for i in range(n):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": f"p{i}",
                                                   "max_tokens": 2})
            assert r.status_code == 200, r.text
            seen.add(r.headers["X-KVKeep-Worker"])
    return seen


def test_a_forged_worker_record_captures_no_traffic(lt: LoopThread,
                                                    etcd_server: EtcdServer) -> None:
    """The H2 probe. Before: `/kvkeep/workers/zzz {"id":"w1","url":<attacker>}`, lease-less,
    re-pointed w1 at the attacker; deleting zzz did not undo it and a restarted router
    listed it again (zzz sorts after w1)."""
    agents = Agents(lt, etcd_server)
    capture = FakeWorker(model=MODEL)
    lt.run(capture.start())
    routers: list[RouterHandle] = []
    forged = {"id": "w1", "url": capture.url, "models": [MODEL]}
    try:
        w1 = agents.start("w1")
        r1 = _router(lt, etcd_server)
        routers.append(r1)
        wait_until(lambda: _registered(r1) == {"w1"})
        lt.run(_put(etcd_server, f"{PREFIX}/workers/zzz", forged, leased=False))
        lt.run(_put(etcd_server, f"{PREFIX}/workers/zzz2", forged, leased=True))
        wait_until(lambda: _ignored(r1, "workers", "wrong-key") == 2)
        assert _workers_of(r1, 6) == {"w1"}
        assert r1.service is not None
        state = r1.service.core.pool.get(next(iter(r1.service.core.pool)).worker_id)
        assert state is not None and state.info.url == w1.url
        # A lease-less value in w1's own key is not believed: w1 leaves at once (no URL of
        # the attacker's is ever used), and w1's agent finds its key changed and writes it
        # back under its lease.
        lt.run(_put(etcd_server, f"{PREFIX}/workers/w1", forged, leased=False))
        wait_until(lambda: _ignored(r1, "workers", "no-lease") == 1)
        wait_until(lambda: lt.run(_stored(etcd_server, f"{PREFIX}/workers/w1"))["url"]
                   == w1.url)
        wait_until(lambda: _registered(r1) == {"w1"})
        assert _workers_of(r1, 4) == {"w1"}
        # Deleting the forged records changes nothing; a restarted router lists w1 as it is.
        lt.run(_delete(etcd_server, f"{PREFIX}/workers/zzz", f"{PREFIX}/workers/zzz2"))
        r2 = _router(lt, etcd_server)
        routers.append(r2)
        wait_until(lambda: _registered(r2) == {"w1"})
        assert r2.service is not None
        restarted = r2.service.core.pool.get(next(iter(r2.service.core.pool)).worker_id)
        assert restarted is not None and restarted.info.url == w1.url
        assert _workers_of(r2, 4) == {"w1"}
        assert capture.requests == [] and len(w1.requests) == 14
    finally:
        for router in routers:
            router.stop()
        agents.close()
        lt.run(capture.stop())


def test_a_worker_agent_writes_back_its_overwritten_key(lt: LoopThread,
                                                        etcd_server: EtcdServer) -> None:
    """Even a leased forgery in the worker's own key (which passes every check a router can
    make without a proof) lasts at most until the agent's next keepalive (TTL/3)."""
    agents = Agents(lt, etcd_server)
    capture = FakeWorker(model=MODEL)
    lt.run(capture.start())
    try:
        w1 = agents.start("w1")
        key = f"{PREFIX}/workers/w1"
        lease = lt.run(_stored(etcd_server, key))["lease"]
        lt.run(_put(etcd_server, key, {"id": "w1", "url": capture.url, "models": [MODEL]},
                    leased=True))
        assert lt.run(_stored(etcd_server, key))["url"] == capture.url
        wait_until(lambda: lt.run(_stored(etcd_server, key))["url"] == w1.url, timeout=5)
        assert lt.run(_stored(etcd_server, key)) == {"url": w1.url, "lease": lease}
        lt.run(asyncio.sleep(1.0))  # three more keepalives: nothing to rewrite any more
        assert lt.run(_stored(etcd_server, key)) == {"url": w1.url, "lease": lease}
    finally:
        agents.close()
        lt.run(capture.stop())


def test_an_id_bound_allow_list_refuses_even_a_leased_forgery(lt: LoopThread,
                                                                etcd_server: EtcdServer) -> None:
    """With `w1=HOST:PORT` in the allow-list, a forgery in w1's own key under the attacker's
    lease (believed, without it, until the agent's next keepalive) is refused outright:
    requests sent all the while never reach the capture server. Without the binding the same
    forgery is believed for that moment (the unbound list below accepts it)."""
    agents = Agents(lt, etcd_server)
    capture = FakeWorker(model=MODEL)
    lt.run(capture.start())
    routers: list[RouterHandle] = []
    try:
        w1 = agents.start("w1")
        key = f"{PREFIX}/workers/w1"
        forged = {"id": "w1", "url": capture.url, "models": [MODEL]}

        allow = WorkerAllowList.parse([f"w1=127.0.0.1:{w1.port}", "127.0.0.1"])
        router = _router(lt, etcd_server, allow)
        routers.append(router)
        wait_until(lambda: _registered(router) == {"w1"})
        lt.run(_put(etcd_server, key, forged, leased=True))
        with httpx.Client(base_url=router.url, timeout=10) as http:
            for i in range(30):  # while the forgery stands and after the agent undid it
                http.post("/v1/completions", json={"model": MODEL, "prompt": f"q{i}",
                                                   "max_tokens": 2})
                lt.run(asyncio.sleep(0.02))
        wait_until(lambda: lt.run(_stored(etcd_server, key))["url"] == w1.url)
        wait_until(lambda: _registered(router) == {"w1"})
        assert capture.requests == [] and w1.requests
        assert router.service is not None
        assert (router.service.metrics.registry.get_sample_value(
            "kvkeep_router_worker_registrations_refused_total", {"reason": "url"}) or 0) >= 1
        # What the binding adds, registration by registration: without it the forgery passes.
        fake = WorkerInfo(WorkerId("w1"), capture.url, (MODEL,))
        assert allow.url_refusal(fake.url, "w1") is not None
        assert allow.url_refusal(w1.url, "w1") is None
        assert allow.url_refusal(capture.url, "w2") is None  # unbound ids: the other entries
        only_w1 = WorkerAllowList.parse([f"w1=127.0.0.1:{w1.port}"])
        assert only_w1.url_refusal(w1.url, "w2") is not None  # w1's entry allows w1 only
        assert WorkerAllowList.parse(["127.0.0.1"]).url_refusal(fake.url, "w1") is None
        with pytest.raises(ConfigError, match="bad worker id"):
            WorkerAllowList.parse(["=127.0.0.1"])
    finally:
        for router in routers:
            router.stop()
        agents.close()
        lt.run(capture.stop())


def test_a_registrar_writes_back_its_overwritten_key(lt: LoopThread,
                                                     etcd_server: EtcdServer) -> None:
    info = DaemonInfo("d1", "127.0.0.1:7001", 1.0)
    registrar = Registrar(etcd_server.url, info, ttl=1)

    async def go() -> tuple[int, bytes]:
        task = asyncio.get_running_loop().create_task(registrar.run())
        client = aetcd.Client(host="127.0.0.1", port=etcd_server.port)
        try:
            await asyncio.wait_for(registrar.registered.wait(), 10)
            lease = await client.lease(60)
            await client.put(registrar.key, DaemonInfo("d1", "10.9.9.9:1").encode(), lease=lease)
            for _ in range(300):
                if registrar.rewrites:
                    break
                await asyncio.sleep(0.01)
            kv = await client.get(registrar.key)
            return registrar.registrations, bytes(kv.value)
        finally:
            await cancel_and_wait([task])
            await registrar.deregister()
            await client.close()

    registrations, value = lt.run(go())
    assert registrar.rewrites == 1 and registrations == 1  # same lease, value written back
    assert DaemonInfo.decode(value) == info


def test_aliases_of_one_daemon_cannot_collapse_replicas(lt: LoopThread,
                                                        etcd_server: EtcdServer) -> None:
    """L1: under TLS-only trust (the handshake proves a CA key, not a node id), aliases
    `a1..a8` naming d1's address in other spellings were eight more members, and placement
    put both replicas of many blocks on d1."""
    prefix = "/kvkeep/stores/"
    registrar = Registrar(etcd_server.url, DaemonInfo("d1", "127.0.0.1:7001", 1.0),
                          prefix=prefix, ttl=2)
    d2 = Registrar(etcd_server.url, DaemonInfo("d2", "127.0.0.1:7002", 1.0), prefix=prefix,
                   ttl=2)

    async def start(reg: Registrar) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(reg.run())
        await asyncio.wait_for(reg.registered.wait(), 10)
        return task

    tasks = [lt.run(start(registrar)), lt.run(start(d2))]
    discovery = EtcdDiscovery(etcd_server.url, prefix, trust=DaemonTrust(tls=True),
                              delete_grace_s=0.2)
    spellings = ["127.0.0.1:7001", "localhost:7001", "[::ffff:127.0.0.1]:7001",
                 "LOCALHOST:7001", "127.0.0.1:07001", "[::ffff:7f00:1]:7001",
                 "localhost.:7001", "127.0.0.1:7001"]
    try:
        wait_until(lambda: set(discovery.members()) == {"d1", "d2"})
        assert len({identities(DaemonInfo("x", s))[0] for s in spellings}) == 1
        for i, address in enumerate(spellings):
            lt.run(_put(etcd_server, f"{prefix}a{i}", {"node_id": f"a{i}", "address": address},
                        leased=True))
        lt.run(_put(etcd_server, f"{prefix}bare", {"node_id": "bare",
                                                   "address": "127.0.0.1:7009"}, leased=False))
        wait_until(lambda: discovery.rejected.get("duplicate") == len(spellings))
        wait_until(lambda: discovery.rejected.get("no-lease") == 1)
        assert set(discovery.members()) == {"d1", "d2"}
        # The older registration holds the address; another daemon there later is no alias.
        fresh = EtcdDiscovery(etcd_server.url, prefix, trust=DaemonTrust(tls=True))
        try:
            assert set(fresh.members()) == {"d1", "d2"}
        finally:
            fresh.close()
        # When d1 is gone, one (and only one) claim on its address may come in.
        lt.loop.call_soon_threadsafe(tasks[0].cancel)
        wait_until(lambda: "d1" not in discovery.members(), timeout=10)
        members = discovery.members()
        assert len([m for m in members.values() if identities(m) == identities(
            DaemonInfo("x", "127.0.0.1:7001"))]) <= 1
        assert "d2" in members
    finally:
        discovery.close()
        for task in tasks:
            lt.loop.call_soon_threadsafe(task.cancel)


def test_a_supervised_task_that_dies_runs_again() -> None:
    runs: list[int] = []
    restarts: list[str] = []

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RecursionError("a poison value the task did not foresee")
        await asyncio.sleep(3600)

    async def go() -> None:
        task = asyncio.create_task(supervise(
            "flaky", flaky, retry=RetryPolicy(attempts=1, base_delay=0.01, max_delay=0.02),
            on_restart=restarts.append))
        for _ in range(500):
            if len(runs) == 3:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert runs == [0, 1, 2] and restarts == ["flaky", "flaky"]


def test_one_backoff_schedule() -> None:
    backoff = Backoff(LOOP_RETRY.capped(0.3))
    delays = [backoff.next_delay() for _ in range(8)]
    assert all(0 < d <= 0.3 for d in delays)
    assert delays[0] <= LOOP_RETRY.base_delay < delays[-1]  # grows, jittered, capped
    backoff.reset()
    assert backoff.next_delay() <= LOOP_RETRY.base_delay
    assert len(list(RetryPolicy(attempts=4).delays())) == 3
