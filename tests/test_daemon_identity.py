"""Issue 13 item 2 (daemons): a registration in etcd is a claim. A client sends its tenant
token, and re-replication the `*` peer token, only to a daemon that proves its identity:
mTLS against the cluster CA, or a registration signed with the cluster's Ed25519 key.

Every test forges registrations in a real etcd pointing at real listeners (tests/impostor.py)
and asserts they never see a bearer token, while a real daemon beside them keeps serving the
same client (so the client did run, and did send its token where it was due). Before this
change, the impostors received the token: nothing checked a registration beyond its JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from connectors.vllm.config import ConnectorConfig
from connectors.vllm.stores import tier_specs
from deploy.local.daemons import DaemonProcess, start_daemon
from deploy.local.services import EtcdServer
from deploy.pki import Authority, registration_keypair
from kvstore.cluster.daemon_trust import DaemonTrust, RegistrationSigner, load_verify_keys
from kvstore.cluster.discovery import DEFAULT_PREFIX, DaemonInfo, EtcdDiscovery
from kvstore.daemon.registration import Registrar
from kvstore.errors import ConfigError, KVKeepError, UntrustedRegistration
from kvstore.etcd import etcd_client
from kvstore.keys import BlockKey
from kvstore.net.daemon_client import ClientTLS, DaemonClient
from kvstore.net.scope import scope_of
from kvstore.tiers.factory import build_tiers
from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier
from router.tasks import cancel_and_wait
from tests.blockframes import block_key, make_frame
from tests.impostor import GrpcImpostor, RawImpostor, non_loopback_ip
from tests.router_harness import wait_until

TOKEN = "tenant-token-must-not-leak-0123"
PEER_TOKEN = "peer-token-must-not-leak-456789"
PREFIX = DEFAULT_PREFIX.encode()


def _tokens(tmp: Path) -> Path:
    path = tmp / "tokens"
    path.write_text(f"{TOKEN} tenant-a\n{PEER_TOKEN} *\n")
    return path


def _keys(tmp: Path, name: str) -> tuple[Path, Path]:
    private, public = registration_keypair()
    key, pub = tmp / f"{name}.key", tmp / f"{name}.pub"
    key.write_bytes(private)
    pub.write_bytes(public)
    return key, pub


async def _put(etcd: EtcdServer, key: bytes, value: bytes, *, ttl: int | None = 60) -> int:
    """Write a registration as an attacker with etcd access would; returns its lease id."""
    client = etcd_client(etcd.url, timeout=5)
    try:
        lease = None if ttl is None else await client.lease(ttl)
        await client.put(key, value, lease=lease)
        return 0 if lease is None else int(lease.id)
    finally:
        await client.close()


def _forge(etcd: EtcdServer, node: str, value: bytes, *, ttl: int | None = 60) -> int:
    return asyncio.run(_put(etcd, PREFIX + node.encode(), value, ttl=ttl))


def _exercise(tier: RemoteTier, keys: list[BlockKey]) -> None:
    """What a connector does: look up, store, read (each key ranks some daemon first). An
    impostor that never answers can make a call run out its deadline: a miss to the store."""
    tier.contains(keys)
    for key in keys:
        with contextlib.suppress(KVKeepError):
            tier.put(key, make_frame(key))
    for key in keys:
        with contextlib.suppress(KVKeepError):
            tier.get(key)


@pytest.fixture
def impostors() -> Iterator[tuple[GrpcImpostor, RawImpostor]]:
    grpc_side, data_side = GrpcImpostor(), RawImpostor()
    try:
        yield grpc_side, data_side
    finally:
        grpc_side.close()
        data_side.close()


def _never_saw_a_token(grpc_side: GrpcImpostor, data_side: RawImpostor) -> None:
    seen = grpc_side.seen()
    assert TOKEN not in seen and PEER_TOKEN not in seen, seen
    assert TOKEN.encode() not in data_side.received
    assert PEER_TOKEN.encode() not in data_side.received


# -- unit: what a signature binds ---------------------------------------------------------------

def test_a_signature_binds_key_lease_and_every_field(tmp_path: Path) -> None:
    key_file, pub_file = _keys(tmp_path, "cluster")
    _, other_pub = _keys(tmp_path, "other")
    signer = RegistrationSigner.from_file(key_file)
    trust = DaemonTrust.of(public_key_file=pub_file, tls=False)
    info = DaemonInfo("d1", "10.0.0.5:7070", 1234.5, "10.0.0.5:7071")
    key = PREFIX + b"d1"
    value = signer.encode(key, 77, info)
    assert trust.admit(PREFIX, key, value, 77) == info
    assert DaemonInfo.decode(value) == info  # readers that do not verify still parse it

    def reason(k: bytes, v: bytes, lease: int, t: DaemonTrust = trust) -> str:
        with pytest.raises(UntrustedRegistration) as caught:
            t.admit(PREFIX, k, v, lease)
        return caught.value.reason

    assert reason(key, value, 78) == "bad signature"  # replayed under another lease
    assert reason(key, value, 0) == "no lease"
    assert reason(PREFIX + b"d2", value, 77) == "wrong key"  # moved to another key
    tampered = value.replace(b"10.0.0.5:7071", b"10.0.0.6:7071")
    assert reason(key, tampered, 77) == "bad signature"
    assert reason(key, info.encode(), 77) == "unsigned"
    assert reason(key, b"{not json", 77) == "malformed"
    assert reason(key, value, 77, DaemonTrust.of(public_key_file=other_pub, tls=False)
                  ) == "bad signature"
    # Rotation: a file with the old and the new public key accepts both signers.
    both = tmp_path / "both.pub"
    both.write_bytes(other_pub.read_bytes() + pub_file.read_bytes())
    assert len(load_verify_keys(both)) == 2
    assert DaemonTrust.of(public_key_file=both, tls=False).admit(PREFIX, key, value, 77) == info
    # Without a key or TLS only loopback daemons are believed.
    plain = DaemonTrust()
    assert plain.admit(PREFIX, b"%sd3" % PREFIX, DaemonInfo("d3", "127.0.0.1:1").encode(), 0)
    assert reason(PREFIX + b"d1", info.encode(), 0, plain) == "unproven"
    with pytest.raises(ConfigError):
        RegistrationSigner.from_file(pub_file)  # a public key cannot sign
    with pytest.raises(ConfigError):
        load_verify_keys(key_file)


# -- the connector's remote tier ----------------------------------------------------------------

def test_without_proof_a_network_registration_gets_no_token(
        tmp_path: Path, etcd_server: EtcdServer) -> None:
    """No TLS and no registration key on the client: a registration naming a network address
    is not believed (before: it became a daemon and got the tenant's token at once)."""
    host = non_loopback_ip()
    if host is None:
        pytest.skip("this machine has no non-loopback address to listen on")
    grpc_side, data_side = GrpcImpostor(host), RawImpostor(host)
    tier = RemoteTier.from_etcd(etcd_server.url, RemoteConfig(replicas=1, token=TOKEN,
                                                              call_timeout=1.0))
    try:
        _forge(etcd_server, "evil", DaemonInfo("evil", grpc_side.address, time.time(),
                                               data_side.address).encode())
        wait_until(lambda: bool(tier._discovery.rejected), timeout=10)  # type: ignore[attr-defined]
        _exercise(tier, [block_key(i) for i in range(4)])
        assert tier.members() == []
        assert tier._discovery.rejected == {"unproven": 1}  # type: ignore[attr-defined]
        _never_saw_a_token(grpc_side, data_side)
    finally:
        tier.close()
        grpc_side.close()
        data_side.close()


def test_signed_registrations_only(tmp_path: Path, etcd_server: EtcdServer,
                                   impostors: tuple[GrpcImpostor, RawImpostor]) -> None:
    grpc_side, data_side = impostors
    key_file, pub_file = _keys(tmp_path, "cluster")
    other_key, _ = _keys(tmp_path, "other")
    daemon = start_daemon(tmp_path, "d1", etcd_url=etcd_server.url,
                          token_file=_tokens(tmp_path),
                          extra=["--registration-key", str(key_file)])
    token_file = tmp_path / "connector-token"
    token_file.write_text(TOKEN + "\n")
    # Built the way the vLLM connector builds it, from its `store.remote` config.
    config = ConnectorConfig.from_extra({"store": {"remote": {
        "etcd": etcd_server.url, "replicas": 1, "token_file": str(token_file),
        "registration_public_key": str(pub_file)}}})
    (tier,) = build_tiers(tier_specs(config.store))
    assert isinstance(tier, RemoteTier)
    try:
        wait_until(lambda: tier.members() == ["d1"], timeout=15)
        evil = DaemonInfo("evil", grpc_side.address, time.time(), data_side.address)
        _forge(etcd_server, "evil", evil.encode())                       # unsigned
        signed_by_other = RegistrationSigner.from_file(other_key)
        lease = asyncio.run(_lease(etcd_server))
        asyncio.run(_put_value(etcd_server, PREFIX + b"evil2", signed_by_other.encode(
            PREFIX + b"evil2", lease, DaemonInfo("evil2", grpc_side.address)), lease))
        genuine = asyncio.run(_get(etcd_server, PREFIX + b"d1"))
        _forge(etcd_server, "evil3", genuine)                            # moved to another key
        # A registration the cluster key really signed, for an address a daemon once had
        # and an attacker holds now, replayed after that daemon's lease ended.
        old = Registrar(etcd_server.url, DaemonInfo("gone", grpc_side.address, 1.0),
                        signer=RegistrationSigner.from_file(key_file))
        replay = asyncio.run(_register_and_leave(old, etcd_server))
        _forge(etcd_server, "gone", replay)
        wait_until(lambda: sum(tier._discovery.rejected.values()) >= 4,  # type: ignore[attr-defined]
                   timeout=10)
        keys = [block_key(i) for i in range(6)]
        _exercise(tier, keys)
        assert tier.members() == ["d1"]
        assert tier._discovery.rejected == {  # type: ignore[attr-defined]
            "unsigned": 1, "bad signature": 2, "wrong key": 1}
        assert all(read is not None for read in (tier.get(k) for k in keys))  # d1 served
        _never_saw_a_token(grpc_side, data_side)
        assert tier.data_plane_addresses()["d1"] is not None  # signed: the TCP plane is used
    finally:
        tier.close()
        daemon.terminate()


async def _lease(etcd: EtcdServer) -> int:
    client = etcd_client(etcd.url, timeout=5)
    try:
        return int((await client.lease(60)).id)
    finally:
        await client.close()


async def _put_value(etcd: EtcdServer, key: bytes, value: bytes, lease: int) -> None:
    client = etcd_client(etcd.url, timeout=5)
    try:
        await client.put(key, value, lease=lease)
    finally:
        await client.close()


async def _get(etcd: EtcdServer, key: bytes) -> bytes:
    client = etcd_client(etcd.url, timeout=5)
    try:
        found = await client.get(key)
        assert found is not None
        return bytes(found.value)
    finally:
        await client.close()


async def _register_and_leave(registrar: Registrar, etcd: EtcdServer) -> bytes:
    task = asyncio.create_task(registrar.run())
    try:
        async with asyncio.timeout(10):
            await registrar.registered.wait()
        client = etcd_client(etcd.url, timeout=5)
        try:
            found = await client.get(registrar.key)
            assert found is not None
            value = bytes(found.value)
        finally:
            await client.close()
    finally:
        await cancel_and_wait([task])
        await registrar.deregister()
    return value


def _tls_daemon(tmp: Path, etcd: EtcdServer, authority: Authority, node: str,
                extra: list[str] | None = None) -> DaemonProcess:
    paths = authority.issue_to(tmp / f"pki-{node}", node, node, ips=("127.0.0.1",))
    daemon = start_daemon(tmp, node, etcd_url=etcd.url, token_file=_tokens(tmp), wait=False,
                          extra=["--tls-cert", str(paths.cert), "--tls-key", str(paths.key),
                                 "--tls-ca", str(paths.ca), *(extra or [])])
    probe = DaemonClient(node, daemon.address, tls=ClientTLS(paths.ca, paths.cert, paths.key))
    try:
        wait_until(lambda: _serving(probe), timeout=30, step=0.1)
    except TimeoutError:
        daemon.kill()
        raise AssertionError(daemon.log_text()) from None
    finally:
        probe.close()
    return daemon


def _serving(client: DaemonClient) -> bool:
    try:
        return client.health(timeout=0.5) == "SERVING"
    except KVKeepError:
        return False


def test_mtls_clients_send_tokens_only_through_a_verified_handshake(
        tmp_path: Path, etcd_server: EtcdServer,
        impostors: tuple[GrpcImpostor, RawImpostor]) -> None:
    """With TLS to the daemons, any registration is dialled, but the token travels only once
    the daemon's certificate verified (the cluster CA, naming the address): a plaintext
    listener, one with another CA's certificate and one with a cluster-CA certificate for
    another name all see a handshake and no token. The TCP data plane is not used."""
    grpc_side, data_side = impostors
    authority = Authority.create("kvkeep-cluster-ca")
    daemon = _tls_daemon(tmp_path, etcd_server, authority, "d1")
    client_cert = authority.issue_to(tmp_path / "pki-client", "client", "connector")
    foreign = Authority.create("attacker-ca").issue_to(tmp_path / "pki-foreign", "x", "x",
                                                       ips=("127.0.0.1",))
    wrong_name = authority.issue_to(tmp_path / "pki-wrong", "w", "connector",
                                    dns=("not-a-daemon",))
    listeners = [RawImpostor(),  # plaintext: sees a TLS ClientHello, nothing else
                 RawImpostor(cert=foreign.cert, key=foreign.key),
                 RawImpostor(cert=wrong_name.cert, key=wrong_name.key)]
    tier = RemoteTier.from_etcd(etcd_server.url, RemoteConfig(
        replicas=1, token=TOKEN, call_timeout=1.0, breaker_cooldown=0.05,
        tls=ClientTLS(client_cert.ca, client_cert.cert, client_cert.key)))
    remote = ConnectorConfig.from_extra({"store": {"remote": {
        "etcd": etcd_server.url, "tls_ca": str(client_cert.ca), "tls_cert": str(client_cert.cert),
        "tls_key": str(client_cert.key)}}}).store.remote
    assert remote is not None and remote.tls_ca == str(client_cert.ca)  # the connector's keys
    with pytest.raises(ConfigError, match="tls_ca"):
        ConnectorConfig.from_extra({"store": {"remote": {"etcd": etcd_server.url,
                                                         "tls_server_name": "kvkeep-store"}}})
    try:
        for i, listener in enumerate(listeners):
            _forge(etcd_server, f"evil{i}", DaemonInfo(
                f"evil{i}", listener.address, time.time(), data_side.address).encode())
        wait_until(lambda: len(tier.members()) == 4, timeout=15)
        keys = [block_key(i) for i in range(24)]
        for _ in range(3):  # past the breakers' cool-down, every impostor is dialled again
            _exercise(tier, keys)
            time.sleep(0.1)
        assert all(listener.connections > 0 for listener in listeners), [
            listener.connections for listener in listeners]
        for listener in listeners:
            assert TOKEN.encode() not in listener.received
        assert bytes(listeners[0].received[:1]) == b"\x16"  # a TLS handshake record
        assert listeners[1].received == bytearray() == listeners[2].received
        _never_saw_a_token(grpc_side, data_side)
        assert data_side.connections == 0
        held = [k for k in keys if tier.placement(k)[0] == "d1"]
        assert held and all(tier.get(k) is not None for k in held)  # d1 got its token, served
    finally:
        tier.close()
        for listener in listeners:
            listener.close()
        daemon.terminate()


def test_mtls_with_one_shared_daemon_name(tmp_path: Path, etcd_server: EtcdServer) -> None:
    """Every daemon carries one certificate name (a Kubernetes DaemonSet's shared Secret):
    clients check that name instead of the address; a certificate without it is refused."""
    authority = Authority.create("kvkeep-cluster-ca")
    shared = authority.issue_to(tmp_path / "pki-shared", "store", "kvkeep-store",
                                dns=("kvkeep-store",))
    daemon = start_daemon(tmp_path, "d1", etcd_url=etcd_server.url, token_file=_tokens(tmp_path),
                          wait=False, extra=["--tls-cert", str(shared.cert), "--tls-key",
                                             str(shared.key), "--tls-ca", str(shared.ca),
                                             "--tls-server-name", "kvkeep-store"])
    client = authority.issue_to(tmp_path / "pki-client", "client", "connector")
    good = ClientTLS(client.ca, client.cert, client.key, server_name="kvkeep-store")
    try:
        probe = DaemonClient("d1", daemon.address, tls=good)
        wait_until(lambda: _serving(probe), timeout=30, step=0.1)
        probe.close()
        key = block_key(1)
        right = DaemonClient("d1", daemon.address, token=TOKEN, tls=good)
        right.put(scope_of(key), [(key.block_hash, make_frame(key))], timeout=5)
        assert right.lookup(scope_of(key), [key.block_hash], timeout=5) == [True]
        right.close()
        # Dialled by address, the shared certificate (no IP in it) does not verify.
        by_address = DaemonClient("d1", daemon.address, token=TOKEN,
                                  tls=ClientTLS(client.ca, client.cert, client.key))
        with pytest.raises(KVKeepError):
            by_address.lookup(scope_of(key), [key.block_hash], timeout=2)
        by_address.close()
    finally:
        daemon.terminate()


# -- re-replication (the `*` peer token) -------------------------------------------------------

def _repaired_to(daemon: DaemonProcess, key: BlockKey) -> bool:
    client = DaemonClient(daemon.node_id, daemon.address, token=TOKEN)
    try:
        return client.lookup(scope_of(key), [key.block_hash], timeout=2) == [True]
    except KVKeepError:
        return False
    finally:
        client.close()


def _seed(daemon: DaemonProcess, keys: list[BlockKey]) -> None:
    client = DaemonClient(daemon.node_id, daemon.address, token=TOKEN)
    try:
        for key in keys:
            client.put(scope_of(key), [(key.block_hash, make_frame(key))], timeout=5)
    finally:
        client.close()


def test_rereplication_sends_the_peer_token_only_to_signed_peers(
        tmp_path: Path, etcd_server: EtcdServer,
        impostors: tuple[GrpcImpostor, RawImpostor]) -> None:
    grpc_side, data_side = impostors
    key_file, _ = _keys(tmp_path, "cluster")
    signing = ["--registration-key", str(key_file)]
    d1 = start_daemon(tmp_path, "d1", etcd_url=etcd_server.url, token_file=_tokens(tmp_path),
                      rereplicate_after=0.3, extra=signing)
    d2: DaemonProcess | None = None
    try:
        keys = [block_key(i) for i in range(8)]
        _seed(d1, keys)
        _forge(etcd_server, "evil", DaemonInfo("evil", grpc_side.address, time.time(),
                                               data_side.address).encode())
        # A genuine peer joins: d1 repairs toward it (so passes do run), never toward evil.
        d2 = start_daemon(tmp_path, "d2", etcd_url=etcd_server.url,
                          token_file=_tokens(tmp_path), rereplicate_after=0.3, extra=signing)
        wait_until(lambda: all(_repaired_to(d2, k) for k in keys), timeout=30, step=0.2)
        time.sleep(1.0)
        _never_saw_a_token(grpc_side, data_side)
        assert "ignoring registration" in d1.log_text()
    finally:
        if d2 is not None:
            d2.terminate()
        d1.terminate()


def test_rereplication_without_proof_ignores_network_peers(tmp_path: Path,
                                                           etcd_server: EtcdServer) -> None:
    """Before: the daemon pushed its blocks, with the `*` token, to any registered address."""
    host = non_loopback_ip()
    if host is None:
        pytest.skip("this machine has no non-loopback address to listen on")
    grpc_side, data_side = GrpcImpostor(host), RawImpostor(host)
    d1 = start_daemon(tmp_path, "d1", etcd_url=etcd_server.url, token_file=_tokens(tmp_path),
                      rereplicate_after=0.3)
    try:
        _seed(d1, [block_key(i) for i in range(8)])
        _forge(etcd_server, "evil", DaemonInfo("evil", grpc_side.address, time.time(),
                                               data_side.address).encode())
        wait_until(lambda: "ignoring registration" in d1.log_text(), timeout=15)
        time.sleep(2.0)  # several grace periods: a repair pass would have run
        _never_saw_a_token(grpc_side, data_side)
        assert grpc_side.calls == []
    finally:
        d1.terminate()
        grpc_side.close()
        data_side.close()


def test_an_untrusted_overwrite_removes_the_member_until_it_registers_again(
        tmp_path: Path, etcd_server: EtcdServer,
        impostors: tuple[GrpcImpostor, RawImpostor]) -> None:
    """An attacker overwriting a daemon's own key with their address: clients drop the entry
    (never dial the impostor with the token), and the daemon's registrar, finding its key
    gone from its lease, writes it back."""
    grpc_side, data_side = impostors
    key_file, pub_file = _keys(tmp_path, "cluster")
    daemon = start_daemon(tmp_path, "d1", etcd_url=etcd_server.url, lease_ttl=1,
                          token_file=_tokens(tmp_path),
                          extra=["--registration-key", str(key_file)])
    discovery = EtcdDiscovery(etcd_server.url, trust=DaemonTrust.of(public_key_file=pub_file,
                                                                    tls=False))
    try:
        wait_until(lambda: list(discovery.members()) == ["d1"], timeout=15)
        _forge(etcd_server, "d1", DaemonInfo("d1", grpc_side.address, time.time(),
                                             data_side.address).encode(), ttl=None)
        wait_until(lambda: discovery.rejected.get("unsigned") == 1, timeout=10)
        wait_until(lambda: discovery.members().get("d1", DaemonInfo("x", "h:1")).address
                   == daemon.address, timeout=15)
        _never_saw_a_token(grpc_side, data_side)
    finally:
        discovery.close()
        daemon.terminate()
