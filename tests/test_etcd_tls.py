"""Issue 13 item 1: TLS and authentication for every etcd client, from one typed `EtcdSpec`.

Against real etcd processes: one started with `--cert-file/--key-file/--trusted-ca-file
--client-cert-auth` and etcd's own auth enabled (`etcdctl user add`, `auth enable`), one with
server TLS and user/password only, and a plaintext one for the rule that an `https://` URL
means TLS or an error. Every client kind is exercised: the daemons' registration and
membership watch (which re-replication reads), the connector's remote-store discovery, the
router's state backend and the worker agents, and the `kvkeep` command lines that build them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import pytest

from connectors.lmcache.config import PluginSettings
from connectors.lmcache.transport import connect
from connectors.vllm.config import ConnectorConfig
from connectors.vllm.stores import tier_specs
from deploy.local.daemons import REPO_ROOT, start_daemon
from deploy.local.services import EtcdServer, free_port, stop_process
from deploy.pki import Authority, registration_keypair
from kvstore.cluster.discovery import DaemonInfo, EtcdDiscovery, MembershipWatcher
from kvstore.commands.kvkeep import build_parser
from kvstore.daemon.registration import Registrar
from kvstore.errors import ConfigError
from kvstore.etcd import EtcdSpec, etcd_client
from kvstore.etcd.flags import etcd_spec_from_args
from kvstore.keys import SessionId
from kvstore.tiers.factory import build_tiers
from kvstore.tiers.remote.tier import RemoteTier
from router.commands import config_from_args
from router.errors import StateUnavailable
from router.membership.workers import WorkerId, WorkerInfo
from router.state.bindings import Binding
from router.state.etcd import EtcdBackend
from router.tasks import cancel_and_wait
from tests.etcd_secure import SecureEtcd, start_secure_etcd
from tests.router_harness import FakeWorker, loop_thread, wait_until

T = TypeVar("T")
PASSWORD = "kvkeep-etcd-password-0123"


def _run(coro: Awaitable[T], timeout: float = 30.0) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coro
    return asyncio.run(bounded())


async def _synced(watcher: MembershipWatcher, within: float) -> bool:
    task = asyncio.create_task(watcher.run())
    try:
        async with asyncio.timeout(within):
            await watcher.synced.wait()
        return True
    except TimeoutError:
        return False
    finally:
        await cancel_and_wait([task])


async def _registers(registrar: Registrar, within: float) -> bool:
    task = asyncio.create_task(registrar.run())
    try:
        async with asyncio.timeout(within):
            await registrar.registered.wait()
        return True
    except TimeoutError:
        return False
    finally:
        await cancel_and_wait([task])
        await registrar.deregister()


# -- https:// never means plaintext -----------------------------------------------------------

def test_an_https_url_never_talks_plaintext(etcd_server: EtcdServer) -> None:
    """Before: every client dialed an https:// URL in plaintext (aetcd only knows insecure
    channels), so a plaintext etcd answered it. Now each one fails the TLS handshake."""
    https = etcd_server.url.replace("http://", "https://")
    info = DaemonInfo("d1", "127.0.0.1:7000")

    async def over(url: str) -> dict[str, bool]:
        backend = EtcdBackend(url, "/p", timeout_s=1.0)
        try:
            await backend.list_workers()
            router = True
        except StateUnavailable:
            router = False
        finally:
            await backend.close()
        return {"router": router,
                "registrar": await _registers(Registrar(url, info, request_timeout=1.0), 3.0),
                "watcher": await _synced(MembershipWatcher(url, request_timeout=1.0), 3.0)}

    assert _run(over(etcd_server.url)) == {"router": True, "registrar": True, "watcher": True}
    assert _run(over(https)) == {"router": False, "registrar": False, "watcher": False}
    discovery = EtcdDiscovery(https, wait_synced=2.0)  # the connector's and the router's kind
    try:
        assert not discovery.wait_synced(0.5)
    finally:
        discovery.close()


def test_the_spec_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    with pytest.raises(ConfigError, match="plain http"):
        EtcdSpec("http://etcd:2379", ca_file=ca)
    with pytest.raises(ConfigError, match="plain http"):
        EtcdSpec("etcd:2379", cert_file=ca, key_file=ca)  # no scheme is http
    with pytest.raises(ConfigError, match="mix"):
        EtcdSpec("https://a:2379,http://b:2379")
    with pytest.raises(ConfigError, match="both"):
        EtcdSpec("https://a:2379", cert_file=ca)
    with pytest.raises(ConfigError, match="both"):
        EtcdSpec("https://a:2379", user="kvkeep")
    with pytest.raises(ConfigError, match="scheme"):
        EtcdSpec("unix:///run/etcd.sock")
    with pytest.raises(ConfigError, match="no etcd endpoint"):
        EtcdSpec(" , ")
    spec = EtcdSpec("https://a:2379, https://b", ca_file=ca, user="u",
                    password_file=tmp_path / "missing")
    assert spec.secure and spec.endpoints == (("a", 2379), ("b", 2379))
    with pytest.raises(ConfigError, match="cannot read"):
        spec.check_files()
    (tmp_path / "pw").write_text("s3cret-value\n")
    ca.write_bytes(Authority.create().cert_pem)
    told = EtcdSpec("https://a:2379", ca_file=ca, user="u", password_file=tmp_path / "pw")
    told.check_files()
    assert told.password() == "s3cret-value"
    assert "s3cret" not in told.describe() + repr(told)
    assert "TLS" in told.describe() and "plaintext" in EtcdSpec("http://a:1").describe()


# -- TLS + client certificates + etcd auth -----------------------------------------------------

def _specs(etcd: SecureEtcd) -> dict[str, EtcdSpec]:
    client = etcd.client("kvkeep")  # the CN is the etcd user under --client-cert-auth
    return {
        "certificate": EtcdSpec(etcd.url, ca_file=etcd.ca, cert_file=client.cert,
                                key_file=client.key),
        "certificate+password": EtcdSpec(etcd.url, ca_file=etcd.ca, cert_file=client.cert,
                                         key_file=client.key, user="kvkeep",
                                         password_file=etcd.password_file("kvkeep")),
    }


async def _every_client(spec: EtcdSpec, tag: str) -> None:
    """Registration, membership watch, the router's backend (workers, bindings): all work."""
    info = DaemonInfo(f"node-{tag}", "127.0.0.1:7400", time.time())
    registrar = Registrar(spec, info, prefix=f"/{tag}/stores/", ttl=3)
    watcher = MembershipWatcher(spec, f"/{tag}/stores/", request_timeout=2.0)
    tasks = [asyncio.create_task(registrar.run()), asyncio.create_task(watcher.run())]
    try:
        async with asyncio.timeout(15):
            await registrar.registered.wait()
            await watcher.synced.wait()
            while info.node_id not in watcher.members():
                await asyncio.sleep(0.05)
        assert watcher.members()[info.node_id] == info
    finally:
        await cancel_and_wait(tasks)
        await registrar.deregister()

    backend = EtcdBackend(spec, f"/{tag}")
    try:
        worker = WorkerInfo(WorkerId("w1"), "http://127.0.0.1:8001", ("m",), None)
        lease = await backend.register_worker(worker, 3.0)
        assert [w.worker_id for w in await backend.list_workers()] == ["w1"]
        assert await lease.keepalive()
        ok, current = await backend.cas_binding(
            Binding(SessionId("s1"), WorkerId("w1"), "m", updated=time.time()), None, 60.0)
        assert ok and current is not None
        assert (await backend.get_binding(SessionId("s1"))) is not None
        await lease.revoke()
    finally:
        await backend.close()


def test_every_client_over_mutual_tls_with_etcd_auth(tmp_path: Path) -> None:
    with start_secure_etcd(tmp_path, client_cert_auth=True,
                           users={"kvkeep": PASSWORD}) as etcd:
        for tag, spec in _specs(etcd).items():
            _run(_every_client(spec, tag.replace("+", "-")))
        # What the etcd refuses, it refuses to every client kind.
        stranger = Authority.create("another-ca").issue_to(tmp_path / "other", "kvkeep",
                                                           "kvkeep")
        refused = {
            "no client certificate": EtcdSpec(etcd.url, ca_file=etcd.ca, user="kvkeep",
                                              password_file=etcd.password_file("kvkeep")),
            "a certificate of another CA": EtcdSpec(etcd.url, ca_file=etcd.ca,
                                                    cert_file=stranger.cert,
                                                    key_file=stranger.key),
            "a server of another CA": EtcdSpec(etcd.url, ca_file=stranger.ca,
                                               cert_file=etcd.client("kvkeep").cert,
                                               key_file=etcd.client("kvkeep").key),
        }
        for what, spec in refused.items():
            assert not _run(_synced(MembershipWatcher(spec, request_timeout=1.0), 2.0)), what

        # The client kvkeep used before (aetcd, plaintext): no answer from this etcd at all.
        async def plain_aetcd() -> None:
            client = aetcd.Client("127.0.0.1", etcd.port, timeout=1)
            try:
                await client.get(b"/x")
            finally:
                await client.close()
        with pytest.raises(aetcd.ClientError):
            _run(plain_aetcd())


def test_password_auth_over_tls_survives_an_etcd_restart(tmp_path: Path) -> None:
    """etcd forgets its simple tokens when it restarts: the client authenticates again by
    itself (aetcd alone would fail every call until rebuilt)."""
    with start_secure_etcd(tmp_path, client_cert_auth=False,
                           users={"kvkeep": PASSWORD}) as etcd:
        spec = EtcdSpec(etcd.url, ca_file=etcd.ca, user="kvkeep",
                        password_file=etcd.password_file("kvkeep"))
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-password\n")
        bad = EtcdSpec(etcd.url, ca_file=etcd.ca, user="kvkeep", password_file=wrong)

        async def scenario() -> int:
            client = etcd_client(spec, timeout=2.0)
            backend = EtcdBackend(spec, "/r")
            try:
                await client.put(b"/r/x", b"1")
                assert [w.worker_id for w in await backend.list_workers()] == []
                etcd.restart()
                for _ in range(100):  # the first calls after the restart may meet no leader
                    try:
                        await client.put(b"/r/x", b"2")
                        await backend.list_workers()
                        break
                    except (aetcd.ClientError, StateUnavailable):
                        await asyncio.sleep(0.1)
                value = await client.get(b"/r/x")
                assert value is not None and value.value == b"2"
                assert client.auth is not None
                return int(client.auth.authentications)
            finally:
                await client.close()
                await backend.close()

        assert _run(scenario(), 60) == 2  # one token before the restart, one after

        async def refused() -> None:
            client = etcd_client(bad, timeout=2.0)
            try:
                await client.get(b"/r/x")
            finally:
                await client.close()
        with pytest.raises(aetcd.ClientError):
            _run(refused())


# -- the command lines and the connector's config ---------------------------------------------

def test_every_command_takes_the_etcd_flags(tmp_path: Path) -> None:
    files = ["--etcd", "https://e1:2379,https://e2:2379", "--etcd-ca", "/pki/ca.pem",
             "--etcd-cert", "/pki/c.pem", "--etcd-key", "/pki/c.key", "--etcd-user", "kvkeep",
             "--etcd-password-file", "/pki/pw"]
    expected = EtcdSpec("https://e1:2379,https://e2:2379", ca_file=Path("/pki/ca.pem"),
                        cert_file=Path("/pki/c.pem"), key_file=Path("/pki/c.key"),
                        user="kvkeep", password_file=Path("/pki/pw"))
    parser = build_parser()
    store = parser.parse_args(["store", "serve", "--listen", "127.0.0.1:0", "--data-dir", "/d",
                               "--node-id", "n", *files])
    router = parser.parse_args(["router", "serve", *files])
    worker = parser.parse_args(["worker", "--url", "http://127.0.0.1:1", *files])
    for args in (store, router, worker):
        assert etcd_spec_from_args(args) == expected
    assert config_from_args(router).etcd_url == expected
    # The router's conversation records (--continuation) use its etcd with the same TLS, and
    # take how the daemons prove their identity.
    continued = config_from_args(parser.parse_args([
        "router", "serve", *files, "--continuation", "--store-tls-ca", "/pki/ca.pem",
        "--store-tls-server-name", "kvkeep-store", "--store-registration-pubkey", "/pki/r.pub"]))
    assert continued.continuation is not None
    remote = continued.continuation.remote_spec()
    assert remote.etcd == expected and remote.tls_server_name == "kvkeep-store"
    assert remote.tls_ca == "/pki/ca.pem" and remote.registration_public_key == "/pki/r.pub"
    with pytest.raises(ConfigError, match="without --etcd"):
        etcd_spec_from_args(parser.parse_args(["router", "serve", "--etcd-ca", "/ca"]))
    with pytest.raises(ConfigError, match="plain http"):
        config_from_args(parser.parse_args(["router", "serve", "--etcd", "http://e:2379",
                                            "--etcd-ca", "/ca"]))
    # A file that cannot be read fails the command at once, with exit status 2.
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVKEEP_NO_MALLOC_TUNING": "1"}
    for argv in (["store", "serve", "--listen", "127.0.0.1:0", "--data-dir",
                  str(tmp_path / "d"), "--node-id", "n"], ["router", "serve"],
                 ["worker", "--url", "http://127.0.0.1:1"]):
        done = subprocess.run([sys.executable, "-m", "kvstore.commands", *argv, "--etcd",
                               "https://127.0.0.1:1", "--etcd-ca", str(tmp_path / "nope.pem")],
                              capture_output=True, text=True, timeout=60, env=env, check=False)
        assert done.returncode == 2, (argv, done.stderr)
        assert "nope.pem" in done.stderr, argv


def test_connector_remote_store_discovers_over_mutual_tls(tmp_path: Path) -> None:
    with start_secure_etcd(tmp_path, client_cert_auth=True,
                           users={"kvkeep": PASSWORD}) as etcd:
        client = etcd.client("kvkeep")
        extra: dict[str, Any] = {"store": {"remote": {
            "etcd": etcd.url, "etcd_ca": str(etcd.ca), "etcd_cert": str(client.cert),
            "etcd_key": str(client.key), "etcd_user": "kvkeep",
            "etcd_password_file": str(etcd.password_file("kvkeep")), "replicas": 1}}}
        config = ConnectorConfig.from_extra(extra)
        assert config.store.remote is not None
        spec = config.store.remote.etcd
        assert isinstance(spec, EtcdSpec) and spec.secure and spec.user == "kvkeep"
        with pytest.raises(ConfigError, match="unknown key"):
            ConnectorConfig.from_extra({"store": {"remote": {"etcd": etcd.url,
                                                             "etcd_cafile": "/x"}}})
        private, public = registration_keypair()
        (tmp_path / "reg.key").write_bytes(private)
        (tmp_path / "reg.pub").write_bytes(public)
        daemon = start_daemon(tmp_path, "d1", etcd_url=etcd.url, extra=[
            "--etcd-ca", str(etcd.ca), "--etcd-cert", str(client.cert), "--etcd-key",
            str(client.key), "--registration-key", str(tmp_path / "reg.key")])
        # The LMCache plugin's store: the same etcd keys, and a key to believe daemons with.
        plugin = PluginSettings.from_params({
            "etcd": etcd.url, "etcd_ca": str(etcd.ca), "etcd_cert": str(client.cert),
            "etcd_key": str(client.key), "registration_public_key": str(tmp_path / "reg.pub"),
            "replicas": 1})
        assert isinstance(plugin.etcd, EtcdSpec) and plugin.etcd.cert_file == client.cert
        try:
            (tier,) = build_tiers(tier_specs(config.store))
            assert isinstance(tier, RemoteTier)
            lmcache = connect(plugin)
            assert isinstance(lmcache, RemoteTier)
            try:
                wait_until(lambda: tier.members() == ["d1"] == lmcache.members(), timeout=20)
            finally:
                tier.close()
                lmcache.close()
        finally:
            daemon.terminate()
        assert "etcd" in daemon.log_text()


def test_agent_and_router_processes_over_mutual_tls(tmp_path: Path) -> None:
    """`kvkeep worker` and `kvkeep router serve` with the etcd flags, against a TLS etcd with
    client-certificate auth: the router sees the worker the agent registered and serves."""
    with start_secure_etcd(tmp_path, client_cert_auth=True,
                           users={"kvkeep": PASSWORD}) as etcd, loop_thread() as lt:
        fake = FakeWorker()
        lt.run(fake.start())
        client = etcd.client("kvkeep")
        flags = ["--etcd", etcd.url, "--etcd-ca", str(etcd.ca), "--etcd-cert", str(client.cert),
                 "--etcd-key", str(client.key), "--etcd-user", "kvkeep",
                 "--etcd-password-file", str(etcd.password_file("kvkeep"))]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        port = free_port()
        procs: list[subprocess.Popen[bytes]] = []
        logs = [tmp_path / "agent.log", tmp_path / "router.log"]
        try:
            for argv, log in ((["worker", "--url", fake.url, "--id", "w1", "--ttl", "2",
                                *flags], logs[0]),
                              (["router", "serve", "--listen", f"127.0.0.1:{port}",
                                *flags], logs[1])):
                with log.open("wb") as out:
                    procs.append(subprocess.Popen([sys.executable, "-m", "kvstore.commands", *argv],
                                                  env=env, stdout=out,
                                                  stderr=subprocess.STDOUT))

            def sees_worker() -> bool:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/kvkeep/workers",
                                                timeout=1) as resp:
                        listed = json.loads(resp.read())
                except OSError:
                    return False
                return any(w.get("id") == "w1" and w.get("usable") for w in listed)

            try:
                wait_until(sees_worker, timeout=40, step=0.2)
            except TimeoutError:
                raise AssertionError("\n".join(p.read_text() for p in logs)) from None
            body = json.dumps({"model": "fake", "prompt": "a b c", "max_tokens": 4}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as resp:
                assert resp.status == 200 and json.loads(resp.read())["choices"]
            assert any(r.get("prompt") == "a b c" for r in fake.requests)
            registered = etcd.etcdctl("get", "--prefix", "/kvkeep/workers/", user="kvkeep")
            assert fake.url in registered
        finally:
            for proc in procs:
                stop_process(proc)
            lt.run(fake.stop())

