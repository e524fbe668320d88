"""No poison pill (trust review H4): whatever value anyone writes under workers/, sessions/ or
stores/ (3,000 levels of nesting, fields of the wrong type, not JSON, binary), every watcher
counts it, skips it and keeps following membership: a worker or daemon that dies is removed,
a new one is seen, and a restarted router (or a fresh discovery) lists the good ones.

Real etcd, real routers (`RouterService` behind HTTP), the real worker agent and the real
daemon registrar; fake workers stand in for vLLM, and loopback registrations for daemons (what
is under test is the watch, not the data plane).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aetcd  # type: ignore[import-untyped]
import aiohttp
import httpx
import pytest

from deploy.local.services import EtcdServer, free_port
from kvstore.cluster.discovery import DaemonInfo, EtcdDiscovery
from kvstore.cluster.watcher import PrefixWatcher
from kvstore.daemon.registration import Registrar
from kvstore.keys import SessionId
from router.config import RouterConfig
from router.membership.allowlist import WorkerAllowList
from router.membership.workers import WorkerId, WorkerInfo
from router.node.agent import AgentConfig, WorkerAgent
from router.policy import Thresholds, policy_preset
from router.state import EtcdBackend
from router.state.bindings import Binding
from router.tasks import cancel_and_wait
from tests.router_harness import FakeWorker, LoopThread, RouterHandle, loop_thread, wait_until

MODEL = "fake"
PREFIX = "/poison"
DEEP = b"[" * 3000 + b"]" * 3000


def _poisons(fields: dict[str, Any]) -> dict[str, bytes]:
    """Each kind of bad value; `fields`: a well-formed record's fields, mistyped one by one."""
    out = {"deep": DEEP, "deep-field": b'{"id":' + DEEP + b"}", "not-json": b"{not json",
           "binary": bytes(range(256)) * 4, "array": b"[1,2]", "null": b"null",
           "number": b"17", "empty": b"", "infinite": b'{"x":1e999}'}
    for name, value in fields.items():
        for i, wrong in enumerate(_wrong(value)):
            out[f"{name}-as-{i}"] = json.dumps({**fields, name: wrong}).encode()
    return out


def _wrong(value: Any) -> list[Any]:
    """Values of another type than `value`'s (a bool is no number, a number no string)."""
    if isinstance(value, bool):
        return [{"x": 1}, [value], "yes", 1]
    if isinstance(value, int | float):
        return [{"x": 1}, [value], "1", True]
    if isinstance(value, str):
        return [{"x": 1}, [value], 7, True]
    if isinstance(value, list):
        return [{"x": 1}, [value], "fake", 7]
    return [{"x": 1}, [1], 7, True]  # an optional string, null in the good record


WORKER_FIELDS = {"url": "http://127.0.0.1:1", "models": [MODEL], "kv_events": "tcp://127.0.0.1:9",
                 "draining": False, "gpu_mem_frac": 0.5, "gpu_temp_c": 40.0}
BINDING_FIELDS = {"w": "w2", "m": MODEL, "e": 0, "r": None, "why": "new", "t": 1.0, "o": "default"}
DAEMON_FIELDS = {"address": "127.0.0.1:1", "started_at": 1.0, "data_address": "127.0.0.1:2"}


async def _write(etcd: EtcdServer, prefix: str, values: dict[str, bytes], id_field: str
                 ) -> int:
    """Each poison under its own key, once under a lease and once without (a lease-less
    value is skipped for that alone; a leased one must get past the lease check to the
    decoder). A JSON object claims its own key's id, so that only its bad field fails it.
    Returns how many keys were written."""
    client = aetcd.Client(host="127.0.0.1", port=etcd.port)
    try:
        lease = await client.lease(120)
        for kind, value in values.items():
            for tag, lease_id in (("leased", lease), ("bare", None)):
                name = f"p-{kind}-{tag}"
                stored = value
                if "-as-" in kind and not kind.startswith(f"{id_field}-as-"):
                    stored = json.dumps({**json.loads(value), id_field: name}).encode()
                await client.put(f"{prefix}{name}".encode(), stored, lease=lease_id)
    finally:
        await client.close()
    return 2 * len(values)


class Agents:
    """Real worker agents on one loop thread, each beside its fake worker."""

    def __init__(self, lt: LoopThread, etcd: EtcdServer) -> None:
        self.lt = lt
        self.backend = EtcdBackend(etcd.url, PREFIX)
        self.workers: dict[str, FakeWorker] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.http: aiohttp.ClientSession | None = None

    def start(self, worker_id: str) -> FakeWorker:
        worker = FakeWorker(model=MODEL)
        self.workers[worker_id] = worker

        async def go() -> None:
            await worker.start()
            if self.http is None:
                self.http = aiohttp.ClientSession()
            agent = WorkerAgent(self.backend, AgentConfig(
                WorkerId(worker_id), worker.url, ttl_s=1.0, models=(MODEL,), report_gpu=False),
                self.http)
            self.tasks[worker_id] = asyncio.get_running_loop().create_task(agent.run())
            await asyncio.wait_for(agent.registered.wait(), 10)

        self.lt.run(go())
        return worker

    def kill(self, worker_id: str) -> None:
        """The worker dies (its server stops answering): its agent revokes the lease."""
        self.lt.run(self.workers[worker_id].stop())

    def close(self) -> None:
        async def go() -> None:
            await cancel_and_wait(self.tasks.values())
            for worker in self.workers.values():
                await worker.stop()
            if self.http is not None:
                await self.http.close()
            await self.backend.close()
        self.lt.run(go())


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    with loop_thread() as thread:
        yield thread


def _router(lt: LoopThread, etcd: EtcdServer, allow: WorkerAllowList | None = None
            ) -> RouterHandle:
    config = RouterConfig(port=free_port(), scrape_interval_s=0.05, static_ttl_s=1.0,
                          policy=replace(policy_preset("kvkeep"),
                                         thresholds=Thresholds(migrate_cooldown_s=0.0)))
    if allow is not None:
        config = replace(config, workers_allow=allow)
    backend = EtcdBackend(etcd.url, PREFIX, worker_delete_grace_s=0.3)
    return RouterHandle(lt, config, backend=backend).start()


def _registered(router: RouterHandle) -> set[str]:
    assert router.service is not None
    return {w.worker_id for w in router.service.core.workers()}


def _ignored(router: RouterHandle, prefix: str, reason: str) -> float:
    assert router.service is not None
    return router.service.metrics.registry.get_sample_value(
        "kvkeep_router_etcd_records_ignored_total", {"prefix": prefix, "reason": reason}) or 0.0


def test_the_decoders_refuse_every_bad_value_with_their_own_error() -> None:
    """Before: deep nesting raised RecursionError and a dict-valued kv_events became a
    WorkerInfo whose later `.partition` raised AttributeError."""
    from kvstore.errors import ConfigError

    for kind, value in _poisons({"id": "p", **WORKER_FIELDS}).items():
        with pytest.raises(ConfigError):
            WorkerInfo.from_json(value, "p")
            pytest.fail(f"worker record {kind} was accepted")
    for kind, value in _poisons({"s": "p", **BINDING_FIELDS}).items():
        with pytest.raises(ConfigError):
            Binding.from_json(value, "p")
            pytest.fail(f"binding {kind} was accepted")
    for kind, value in _poisons({"node_id": "p", **DAEMON_FIELDS}).items():
        with pytest.raises(ConfigError):
            DaemonInfo.decode(value)
            pytest.fail(f"daemon registration {kind} was accepted")
    good = WorkerInfo(WorkerId("p"), "http://127.0.0.1:1", (MODEL,), "tcp://127.0.0.1:9")
    assert WorkerInfo.from_json(good.to_json(), "p") == good
    with pytest.raises(ConfigError, match="claims the id"):
        WorkerInfo.from_json(good.to_json(), "zzz")


def test_poison_under_workers_and_sessions_stops_no_router(lt: LoopThread,
                                                           etcd_server: EtcdServer) -> None:
    """The H4 probe: before, `follow-workers` died on the nested value, a killed worker was
    still listed 20 s later, and a restarted router had 0 workers."""
    agents = Agents(lt, etcd_server)
    routers: list[RouterHandle] = []
    try:
        agents.start("w1")
        agents.start("w2")
        r1 = _router(lt, etcd_server)
        routers.append(r1)
        wait_until(lambda: _registered(r1) == {"w1", "w2"})
        n_workers = lt.run(_write(etcd_server, f"{PREFIX}/workers/",
                                  _poisons({"id": "p", **WORKER_FIELDS}), "id"))
        n_sessions = lt.run(_write(etcd_server, f"{PREFIX}/sessions/",
                                   _poisons({"s": "p", **BINDING_FIELDS}), "s"))
        wait_until(lambda: _ignored(r1, "workers", "malformed") == n_workers)
        wait_until(lambda: _ignored(r1, "sessions", "malformed") == n_sessions)
        # Membership still follows: a dead worker leaves, a new one joins.
        agents.kill("w1")
        wait_until(lambda: _registered(r1) == {"w2"})
        agents.start("w3")
        wait_until(lambda: _registered(r1) == {"w2", "w3"})
        # Sessions still follow: a binding r1 writes reaches a second replica's table.
        r2 = _router(lt, etcd_server)
        routers.append(r2)
        wait_until(lambda: _registered(r2) == {"w2", "w3"})  # a fresh router lists them
        assert _ignored(r2, "workers", "malformed") == n_workers  # counted in the listing
        with httpx.Client(base_url=r1.url, timeout=10) as http:
            r = http.post("/v1/completions", headers={"X-Session-Id": "s1"},
                          json={"model": MODEL, "prompt": "hello", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.headers["X-KVKeep-Worker"] in {"w2", "w3"}
        assert r2.service is not None
        table = r2.service.core.sessions
        wait_until(lambda: table.get(SessionId("s1")) is not None)
        # The watch tasks are alive: nothing killed them.
        assert r1.service is not None
        tasks = {t.get_name(): t for t in r1.service._tasks}
        assert not tasks["follow-workers"].done() and not tasks["follow-bindings"].done()
    finally:
        for router in routers:
            router.stop()
        agents.close()


def test_poison_under_stores_stops_no_discovery(lt: LoopThread,
                                                etcd_server: EtcdServer) -> None:
    """Before: the membership watcher failed its re-listing on every retry and never synced."""
    prefix = "/kvkeep/stores/"

    def registrar(node: str, port: int) -> tuple[Registrar, asyncio.Task[None]]:
        reg = Registrar(etcd_server.url, DaemonInfo(node, f"127.0.0.1:{port}", 1.0),
                        prefix=prefix, ttl=1)

        async def go() -> asyncio.Task[None]:
            task = asyncio.get_running_loop().create_task(reg.run())
            await asyncio.wait_for(reg.registered.wait(), 10)
            return task
        return reg, lt.run(go())

    async def cancel(task: asyncio.Task[None]) -> None:
        await cancel_and_wait([task])  # no deregistration: as if killed, the lease runs out

    n = lt.run(_write(etcd_server, prefix, _poisons({"node_id": "p", **DAEMON_FIELDS}),
                      "node_id"))
    _, t1 = registrar("d1", 7001)
    _, t2 = registrar("d2", 7002)
    discovery = EtcdDiscovery(etcd_server.url, prefix, delete_grace_s=0.3)
    tasks = [t1, t2]
    try:
        wait_until(lambda: set(discovery.members()) == {"d1", "d2"})
        assert sum(discovery.rejected.values()) == n
        lt.run(_write(etcd_server, prefix, {"deep": DEEP, "not-json": b"\x00\xff"}, "node_id"))
        lt.run(cancel(t1))
        wait_until(lambda: set(discovery.members()) == {"d2"})
        _, t3 = registrar("d3", 7003)
        tasks.append(t3)
        wait_until(lambda: set(discovery.members()) == {"d2", "d3"})
        fresh = EtcdDiscovery(etcd_server.url, prefix)
        try:
            assert set(fresh.members()) == {"d2", "d3"}
        finally:
            fresh.close()
    finally:
        discovery.close()
        for task in tasks:
            lt.run(cancel(task))


def test_the_watcher_survives_a_sink_that_raises(lt: LoopThread,
                                                 etcd_server: EtcdServer) -> None:
    """A record the decoder accepts but the sink chokes on is counted, and later records
    still arrive."""
    from kvstore.cluster.clients import FreshClients

    seen: list[str] = []

    class Sink:
        def reset(self, items: Any) -> None:
            seen.extend(items)

        def put(self, name: str, item: bytes) -> None:
            if item == b"boom":
                raise AttributeError("the sink's own bug")
            seen.append(name)

        def delete(self, name: str, revision: int) -> None:
            seen.append(f"-{name}")

    async def go() -> dict[str, int]:
        watcher: PrefixWatcher[bytes] = PrefixWatcher(
            FreshClients(etcd_server.url), b"/sink/", lambda r: r.value, Sink())
        task = asyncio.get_running_loop().create_task(watcher.run())
        client = aetcd.Client(host="127.0.0.1", port=etcd_server.port)
        try:
            await asyncio.wait_for(watcher.synced.wait(), 10)
            await client.put(b"/sink/a", b"boom")
            await client.put(b"/sink/b", b"fine")
            for _ in range(500):
                if "b" in seen:
                    break
                await asyncio.sleep(0.01)
            return dict(watcher.rejected)
        finally:
            await cancel_and_wait([task])
            await client.close()

    assert lt.run(go()) == {"sink-error": 1}
    assert seen == ["b"]


def test_a_daemon_counts_the_registrations_it_does_not_believe(
        lt: LoopThread, etcd_server: EtcdServer, tmp_path: Path) -> None:
    """A real daemon beside poison and forged records under stores/: it keeps serving and
    exports what it ignored on /metrics (kvkeep_daemon_etcd_records_ignored_total)."""
    from deploy.local.daemons import start_daemon
    from tests.metrics_scrape import wait_for_sample

    prefix = "/kvkeep/stores/"
    n = lt.run(_write(etcd_server, prefix, {"deep": DEEP, "not-json": b"{not json"},
                      "node_id"))

    async def forge() -> None:  # a well-formed record, without a lease
        client = aetcd.Client(host="127.0.0.1", port=etcd_server.port)
        try:
            await client.put(f"{prefix}forged".encode(),
                             json.dumps({"node_id": "forged", **DAEMON_FIELDS}).encode())
        finally:
            await client.close()
    lt.run(forge())
    n += 1
    port = free_port()
    daemon = start_daemon(tmp_path, "d1", etcd_url=etcd_server.url,
                          extra=["--metrics-listen", f"127.0.0.1:{port}"])
    try:
        scrape = wait_for_sample(
            f"http://127.0.0.1:{port}/metrics",
            lambda s: sum(s.value("kvkeep_daemon_etcd_records_ignored_total", reason=r)
                          for r in s.label_values("kvkeep_daemon_etcd_records_ignored_total",
                                                  "reason")) >= n)
        reasons = scrape.label_values("kvkeep_daemon_etcd_records_ignored_total", "reason")
        assert {"no-lease", "malformed"} <= reasons, reasons
        assert daemon.alive
    finally:
        daemon.kill()
