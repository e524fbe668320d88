"""Issue 16 item 2 (review H2, earlier finding 1): etcd roles, so that a component's etcd
credential writes only its own keys (kvstore/etcd/roles.py, `kvkeep etcd roles`).

Against a real etcd (TLS, etcd's auth enabled by the command itself): a worker's credential
registers its own `workers/<id>` under a lease (the real worker agent, in process, in front of
a fake vLLM) and is refused every other worker's key, the sessions and the stores; a daemon's
registers (the real registrar) and is refused everyone else's keys; a router's watches the
workers, binds sessions and reads the daemons, and is refused writing workers and stores or
revoking a worker's lease. Then deploy/k8s's own Job command line, run against an etcd
started with the manifest's TLS flags and the generated certificates: each component's
certificate (its CN is its etcd user) can do its own part and no other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from deploy.local.services import free_port, stop_process, wait_for_port
from deploy.local.tls import LocalPki
from kvstore.cluster.discovery import DaemonInfo, MembershipWatcher
from kvstore.commands.kvkeep import build_parser
from kvstore.daemon.registration import Registrar
from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec, etcd_client
from kvstore.etcd.flags import etcd_spec_from_args
from kvstore.etcd.roles import Layout, principals, worker
from kvstore.keys import SessionId
from router.commands import config_from_args
from router.membership.workers import WorkerId, WorkerInfo
from router.node.agent import AgentConfig, WorkerAgent
from router.state.bindings import Binding, VersionedBinding
from router.state.etcd import EtcdBackend, EtcdLease
from router.tasks import cancel_and_wait
from tests.etcd_secure import SecureEtcd, start_secure_etcd
from tests.router_harness import FakeWorker
from tests.test_deploy_k8s_trust import _container, _localize, _materialize, _start_manifest_etcd
from tests.test_deploy_manifests import POD_ENV

T = TypeVar("T")


def _run(coro: Awaitable[T], timeout: float = 60.0) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro
    return asyncio.run(bounded())


def _roles(etcd: SecureEtcd, *args: str, root: Path | None = None) -> int:
    """`kvkeep etcd roles` as a command line (root's credential: none while auth is off)."""
    creds = [] if root is None else ["--etcd-user", "root", "--etcd-password-file", str(root)]
    parsed = build_parser().parse_args(["etcd", "roles", "--etcd", etcd.url, "--etcd-ca",
                                        str(etcd.ca), *creds, *args])
    result: int = parsed.handler(parsed)
    return result


def _as(etcd: SecureEtcd, passwords: Path, user: str) -> EtcdSpec:
    return EtcdSpec(etcd.url, ca_file=etcd.ca, user=user, password_file=passwords / user)


async def _refused(call: Awaitable[Any]) -> bool:
    """True iff etcd refuses the call for want of permission (any other error fails)."""
    try:
        await call
    except Exception as exc:
        if "permission denied" in str(exc).lower():
            return True
        raise
    return False


async def _writes(spec: EtcdSpec, keys: Iterable[bytes]) -> dict[bytes, bool]:
    """For each key: did a put (under a fresh lease, as every registration is) go through?"""
    client = etcd_client(spec, timeout=5)
    try:
        lease = await client.lease(5)
        return {key: not await _refused(client.put(key, b'{"x":1}', lease=lease.id))
                for key in keys}
    finally:
        await client.close()


class _Workers:
    def __init__(self) -> None:
        self.seen: dict[str, WorkerInfo] = {}
        self.changed = asyncio.Event()

    def reset_workers(self, infos: Iterable[WorkerInfo]) -> None:
        self.seen = {i.worker_id: i for i in infos}
        self.changed.set()

    def put_worker(self, info: WorkerInfo) -> None:
        self.seen[info.worker_id] = info
        self.changed.set()

    def delete_worker(self, worker_id: WorkerId) -> None:
        self.seen.pop(worker_id, None)
        self.changed.set()


class _Bindings:
    def __init__(self) -> None:
        self.seen: dict[str, VersionedBinding] = {}
        self.changed = asyncio.Event()

    def reset(self, bindings: Iterable[VersionedBinding]) -> None:
        self.seen = {b.binding.session_id: b for b in bindings}
        self.changed.set()

    def put(self, vb: VersionedBinding) -> None:
        self.seen[vb.binding.session_id] = vb
        self.changed.set()

    def delete(self, session_id: SessionId, revision: int) -> None:
        self.seen.pop(session_id, None)
        self.changed.set()


async def _until(predicate: Any, event: asyncio.Event, within: float = 15.0) -> None:
    async with asyncio.timeout(within):
        while not predicate():
            event.clear()
            await event.wait()


PREFIX, STORES = "/kvkeep", "/kvkeep/stores/"
W1, W2 = b"/kvkeep/workers/w1", b"/kvkeep/workers/w2"
W10 = b"/kvkeep/workers/w10"  # an exact grant on w1 must not cover w10
SESSION, D1, D2 = b"/kvkeep/sessions/s-forged", b"/kvkeep/stores/d1", b"/kvkeep/stores/d2"
ALL = (W1, W2, W10, SESSION, D1, D2)


def test_each_credential_writes_only_its_own_keys(tmp_path: Path) -> None:
    passwords = tmp_path / "passwords"
    with start_secure_etcd(tmp_path, client_cert_auth=False) as etcd:
        # Before: etcd without auth takes every write from anyone.
        anyone = EtcdSpec(etcd.url, ca_file=etcd.ca)
        assert _run(_writes(anyone, ALL)) == dict.fromkeys(ALL, True)

        assert _roles(etcd, "--passwords", str(passwords), "--router", "kvkeep-router",
                      "--worker", "w1", "--worker", "w2", "--daemon", "d1", "--daemon", "d2",
                      "--connector", "kvkeep-connector") == 0
        for user in ("root", "kvkeep-router", "kvkeep-worker-w1", "kvkeep-daemon-d1"):
            assert (passwords / user).stat().st_mode & 0o077 == 0, user
        # Auth is on: no credential, or a wrong password, gets nothing.
        with pytest.raises(Exception, match=r"(?i)user name is empty|permission denied"):
            _run(_writes(anyone, (W1,)))
        (tmp_path / "wrong").write_text("not-the-password\n")
        with pytest.raises(Exception, match=r"(?i)authentication failed"):
            _run(_writes(EtcdSpec(etcd.url, ca_file=etcd.ca, user="kvkeep-worker-w1",
                                  password_file=tmp_path / "wrong"), (W1,)))

        w1, d1 = _as(etcd, passwords, "kvkeep-worker-w1"), _as(etcd, passwords, "kvkeep-daemon-d1")
        router = _as(etcd, passwords, "kvkeep-router")
        connector = _as(etcd, passwords, "kvkeep-connector")
        allowed = {w1: {W1}, d1: {D1}, router: {SESSION}, connector: set()}
        for spec, own in allowed.items():
            assert _run(_writes(spec, ALL)) == {k: k in own for k in ALL}, spec.user

        # What the roles do not stop (docs/threat-model.md says so): etcd checks no key on a
        # lease keepalive, so w2's credential can keep w1's lease alive, given its id.
        assert _run(_keeps_alive(w1, _as(etcd, passwords, "kvkeep-worker-w2")))

        _run(_components_work(w1, d1, router, connector))


async def _keeps_alive(owner: EtcdSpec, other: EtcdSpec) -> bool:
    mine, theirs = etcd_client(owner, timeout=5), etcd_client(other, timeout=5)
    try:
        lease = await mine.lease(5)
        await mine.put(W1, b"{}", lease=lease.id)
        reply = await theirs.refresh_lease(lease.id)
        await mine.revoke_lease(lease.id)
        return reply is not None and int(reply.TTL) > 0
    finally:
        await mine.close()
        await theirs.close()


async def _components_work(w1: EtcdSpec, d1: EtcdSpec, router: EtcdSpec,
                           connector: EtcdSpec) -> None:
    """The real parts, each under its own credential."""
    fake = FakeWorker()
    await fake.start()
    backend = EtcdBackend(router, PREFIX, timeout_s=5.0)
    agent_backend = EtcdBackend(w1, PREFIX, timeout_s=5.0)
    registrar = Registrar(d1, DaemonInfo("d1", "127.0.0.1:7070"), prefix=STORES,
                          ttl=3, request_timeout=5.0)
    workers, bindings = _Workers(), _Bindings()
    tasks: list[asyncio.Task[None]] = []
    try:
        async with aiohttp.ClientSession() as http:
            agent = WorkerAgent(agent_backend, AgentConfig(WorkerId("w1"), fake.url, ttl_s=3.0,
                                                          report_gpu=False), http)
            tasks += [asyncio.create_task(agent.run()), asyncio.create_task(registrar.run()),
                      asyncio.create_task(backend.follow_workers(workers)),
                      asyncio.create_task(backend.follow_bindings(bindings))]
            # The agent registered w1 under its lease; the router's watch sees it.
            await asyncio.wait_for(agent.registered.wait(), 15)
            await _until(lambda: "w1" in workers.seen and workers.seen["w1"].url == fake.url,
                         workers.changed)
            # The agent's keepalive reads its own key back: a refresh through its credential.
            lease = agent._lease
            assert isinstance(lease, EtcdLease) and await lease.keepalive()
            # The router binds a session (a transaction that reads and writes sessions/) and
            # its bindings watch sees it.
            binding = Binding(SessionId("s1"), WorkerId("w1"), "fake")
            ok, stored = await backend.cas_binding(binding, None, 30.0)
            assert ok and stored is not None
            await _until(lambda: "s1" in bindings.seen, bindings.changed)
            # The daemon registered; the router (continuation records) and the connector
            # find it by reading stores.
            await asyncio.wait_for(registrar.registered.wait(), 15)
            for reader in (router, connector, d1):
                watcher = MembershipWatcher(reader, STORES, request_timeout=5.0)
                watch = asyncio.create_task(watcher.run())
                try:
                    await asyncio.wait_for(watcher.synced.wait(), 15)
                    assert list(watcher.members()) == ["d1"], reader.user
                finally:
                    await cancel_and_wait([watch])
            # A stolen router credential cannot kill a worker by revoking its lease (etcd
            # wants write access to every key attached), nor can another worker's.
            client = etcd_client(router, timeout=5)
            try:
                assert await _refused(client.revoke_lease(lease.lease_id))
            finally:
                await client.close()
            # Nor can it read what it does not own: a worker cannot list the other workers.
            client = etcd_client(w1, timeout=5)
            try:
                assert await _refused(client.get_prefix(b"/kvkeep/workers/"))
                assert await _refused(client.get(SESSION))
            finally:
                await client.close()
            assert "w1" in workers.seen  # still registered
            # And the agent's own clean stop (LeaseRevoke) is allowed: the router sees w1 go.
            await cancel_and_wait([tasks[0]])
            await _until(lambda: "w1" not in workers.seen, workers.changed)
    finally:
        await cancel_and_wait(tasks)
        await registrar.deregister()
        await backend.close()
        await agent_backend.close()
        await fake.stop()


def test_the_command_is_idempotent_and_corrects_drift(tmp_path: Path) -> None:
    passwords = tmp_path / "passwords"
    with start_secure_etcd(tmp_path, client_cert_auth=False) as etcd:
        # A root without a password, by an administrator who shows no certificate, would
        # lock everyone out once auth is on: refused before anything changes.
        with pytest.raises(ConfigError, match="certificate"):
            _roles(etcd, "--certificates-only", "--worker", "w1")
        assert "kvkeep-worker-w1" not in etcd.etcdctl("role", "list")
        assert _roles(etcd, "--passwords", str(passwords), "--worker", "w1") == 0
        root = passwords / "root"
        etcd.passwords["root"] = root.read_text().strip()
        before = etcd.etcdctl("role", "get", "kvkeep-worker-w1")
        # Someone widens the worker's role by hand: the next run takes it back.
        etcd.etcdctl("role", "grant-permission", "kvkeep-worker-w1", "--prefix=true",
                     "readwrite", "/kvkeep/sessions/")
        w1 = _as(etcd, passwords, "kvkeep-worker-w1")
        assert _run(_writes(w1, (SESSION,))) == {SESSION: True}
        # A new worker joins; the run (now with root's password, auth on) adds it.
        assert _roles(etcd, "--passwords", str(passwords), "--worker", "w1", "--worker", "w2",
                      root=root) == 0
        assert etcd.etcdctl("role", "get", "kvkeep-worker-w1") == before
        assert _run(_writes(w1, (SESSION, W1))) == {SESSION: False, W1: True}
        w2 = _as(etcd, passwords, "kvkeep-worker-w2")
        assert _run(_writes(w2, (W1, W2))) == {W1: False, W2: True}
        # A rotated password file is taken up; the old password stops working.
        old = (passwords / "kvkeep-worker-w1").read_text()
        (tmp_path / "old").write_text(old)
        (passwords / "kvkeep-worker-w1").write_text("rotated-password-0123\n")
        assert _roles(etcd, "--passwords", str(passwords), "--worker", "w1", "--worker", "w2",
                      root=root) == 0
        assert _run(_writes(w1, (W1,))) == {W1: True}
        with pytest.raises(Exception, match=r"(?i)authentication failed"):
            _run(_writes(dataclasses.replace(w1, password_file=tmp_path / "old"), (W1,)))


def test_the_table_refuses_what_would_widen_a_grant() -> None:
    layout = Layout(PREFIX, STORES)
    # Exact keys per id: w1's grant is the one key, not a prefix that covers w10.
    (own, stores) = worker(layout, "w1").grants
    assert (own.key, own.range_end, own.perm) == (W1, b"", "readwrite")
    assert (stores.key, stores.range_end, stores.perm) == (b"/kvkeep/stores/",
                                                           b"/kvkeep/stores0", "read")
    with pytest.raises(ConfigError):
        worker(layout, "a/b")  # an id with a slash would name another key
    with pytest.raises(ConfigError):
        Layout("/", STORES)  # a grant on "/" is everything
    with pytest.raises(ConfigError):
        principals(layout, routers=["root"])
    with pytest.raises(ConfigError):
        principals(layout, routers=["kvkeep-worker-w1"], workers=["w1"])


# -- deploy/k8s: the Job's own command line, against the manifest's etcd -----------------------

def test_the_k8s_job_gives_each_certificate_its_own_kind_of_keys(tmp_path: Path) -> None:
    """etcd started with deploy/k8s/etcd.yaml's TLS flags and the certificates
    `deploy.k8s_secrets` makes; the roles Job's arguments, mount paths moved to a temp dir.
    Before the Job every certificate of the CA is root; after it, each component's writes only
    its own prefix, and the components still work from their manifests' command lines."""
    dirs = _materialize(tmp_path)
    proc, port = _start_manifest_etcd(tmp_path, dirs)
    url = f"https://127.0.0.1:{port}"
    hosts = {"https://kvkeep-etcd:2379": url, POD_ENV["$(POD_IP)"]: "127.0.0.1"}

    def cert(secret: str) -> EtcdSpec:
        d = dirs[secret]
        return EtcdSpec(url, ca_file=d / "ca.crt", cert_file=d / "tls.crt",
                        key_file=d / "tls.key")

    def job() -> int:
        doc, c = _container("Job", "kvkeep-etcd-roles", "roles")
        parsed = build_parser().parse_args(_localize(c["args"], doc, c, dirs, hosts))
        result: int = parsed.handler(parsed)
        return result

    parser = build_parser()
    try:
        assert _run(_writes(cert("kvkeep-connector-tls"), ALL)) == dict.fromkeys(ALL, True)
        assert job() == 0
        allowed = {"kvkeep-router-tls": {SESSION}, "kvkeep-agent-tls": {W1, W2, W10},
                   "kvkeep-store-tls": {D1, D2}, "kvkeep-connector-tls": set(),
                   # a certificate of the CA whose CN is no etcd user: nothing
                   "kvkeep-etcd-tls": set()}
        for secret, own in allowed.items():
            assert _run(_writes(cert(secret), ALL)) == {k: k in own for k in ALL}, secret
        assert job() == 0  # again, now under auth, as root's certificate: nothing changes

        # The components, from their own manifests' command lines.
        specs = {}
        for kind, name, cname in (("Deployment", "kvkeep-router", "router"),
                                  ("Deployment", "kvkeep-worker", "kvkeep-agent"),
                                  ("DaemonSet", "kvkeep-store", "kvstore")):
            doc, c = _container(kind, name, cname)
            args = parser.parse_args(_localize(c["args"], doc, c, dirs, hosts))
            spec = config_from_args(args).etcd_url if cname == "router" else \
                etcd_spec_from_args(args)
            assert isinstance(spec, EtcdSpec)
            specs[cname] = spec
        _run(_k8s_components_work(specs["router"], specs["kvkeep-agent"], specs["kvstore"]))
    finally:
        stop_process(proc)


async def _k8s_components_work(router: EtcdSpec, agent: EtcdSpec, store: EtcdSpec) -> None:
    routers, agents = EtcdBackend(router, PREFIX), EtcdBackend(agent, PREFIX)
    registrar = Registrar(store, DaemonInfo("node-a", "127.0.0.1:7070"), prefix=STORES,
                          ttl=3, request_timeout=5.0)
    task = asyncio.create_task(registrar.run())
    try:
        lease = await agents.register_worker(
            WorkerInfo(WorkerId("w-k8s"), "http://127.0.0.1:1", ("m",), None), 3.0)
        assert [w.worker_id for w in await routers.list_workers()] == ["w-k8s"]
        assert await lease.keepalive()
        ok, _ = await routers.cas_binding(Binding(SessionId("s"), WorkerId("w-k8s"), "m"),
                                          None, 30.0)
        assert ok
        await asyncio.wait_for(registrar.registered.wait(), 15)
        watcher = MembershipWatcher(router, STORES, request_timeout=5.0)
        watch = asyncio.create_task(watcher.run())
        try:
            await asyncio.wait_for(watcher.synced.wait(), 15)
            assert list(watcher.members()) == ["node-a"]
        finally:
            await cancel_and_wait([watch])
        await lease.revoke()
    finally:
        await cancel_and_wait([task])
        await registrar.deregister()
        await routers.close()
        await agents.close()


# -- deploy/local's TLS mode: every part under its own etcd user --------------------------------

def test_the_local_tls_cluster_gives_each_part_its_own_user(tmp_path: Path) -> None:
    """The etcd flags deploy/local's TLS mode gives each part (deploy/local/tls.py), through
    the real parsers, against an etcd started with its server flags and the roles it sets:
    per id, not per kind (w1's agent cannot write w2's key). `kvkeep demo --tls`
    (tests/test_deploy_demo.py) runs the whole cluster so."""
    pki = LocalPki.create(tmp_path / "pki")
    port, peer = free_port(), free_port()
    url, peer_url = f"https://127.0.0.1:{port}", f"http://127.0.0.1:{peer}"
    etcd_bin = shutil.which("etcd")
    assert etcd_bin is not None
    proc = subprocess.Popen(
        [etcd_bin, "--name", "l", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
         "--initial-cluster", f"l={peer_url}", "--unsafe-no-fsync", "--log-level", "error",
         *pki.etcd_server_args()], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc=proc)
        pki.enable_etcd_roles(url, ["w1", "w2"], ["d1", "d2"])
        parser = build_parser()

        def spec(argv: list[str]) -> EtcdSpec:
            found = etcd_spec_from_args(parser.parse_args(argv), check_files=True)
            assert found is not None
            return found

        parts = {
            "agent w1": (spec(["worker", "--etcd", url, *pki.agent_flags("w1"), "--url",
                               "http://127.0.0.1:1", "--id", "w1"]), {W1}),
            "daemon d1": (spec(["store", "serve", "--listen", "127.0.0.1:0", "--data-dir",
                                "/d", "--node-id", "d1", "--etcd", url,
                                *pki.daemon_flags("d1")]), {D1}),
            "router": (spec(["router", "serve", "--etcd", url, *pki.router_flags()]),
                       {SESSION}),
            # the connector's certificate alone (its CN is the read-only user)
            "connector": (EtcdSpec(url, ca_file=pki.client.ca, cert_file=pki.client.cert,
                                   key_file=pki.client.key), set()),
        }
        for name, (part, own) in parts.items():
            assert _run(_writes(part, ALL)) == {k: k in own for k in ALL}, name
    finally:
        stop_process(proc)
