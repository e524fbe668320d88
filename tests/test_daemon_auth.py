"""Auth (bearer tokens -> tenants, mTLS, loopback-only without auth) and fuzzing of the gRPC API."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.local.daemons import REPO_ROOT, DaemonProcess, running_daemon, start_daemon
from deploy.local.services import free_port
from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.manifest import SessionManifest
from kvstore.net.daemon_client import ClientTLS, DaemonClient
from kvstore.net.grpc_messages import scope_to_pb
from kvstore.net.limits import MAX_MESSAGE_BYTES
from kvstore.net.scope import scope_of
from tests.blockframes import block_key, make_frame, session_key

T = 10.0
TOKEN_A = "token-tenant-a-0123456789"
TOKEN_B = "token-tenant-b-0123456789"
TOKEN_PEER = "token-peer-all-0123456789"
METHODS = ("Put", "Get", "Lookup", "Delete", "PutManifest", "GetManifest", "DeleteManifest",
           "Stat")


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    tmp = tmp_path_factory.mktemp("auth")
    tokens = tmp / "tokens"
    tokens.write_text(f"# token tenants\n{TOKEN_A} tenant-a\n{TOKEN_B} tenant-b\n"
                      f"{TOKEN_PEER} *\n")
    with running_daemon(tmp, "secured", token_file=tokens) as d:
        yield d


def _raw(channel: grpc.Channel, method: str) -> Callable[..., Any]:
    path = f"/kvkeep.store.v1.KVStore/{method}"
    ident = (lambda b: b)  # noqa: E731  (bytes in, bytes out: the fuzzer speaks the raw wire)
    if method == "Put":
        return channel.stream_unary(path, request_serializer=ident, response_deserializer=ident)
    if method == "Get":
        return channel.unary_stream(path, request_serializer=ident, response_deserializer=ident)
    return channel.unary_unary(path, request_serializer=ident, response_deserializer=ident)


def _requests() -> dict[str, bytes | list[bytes]]:
    """One valid request per method, for tenant-a."""
    key = block_key(1)
    scope = scope_to_pb(scope_of(key))
    frame = make_frame(key)
    # Fixed timestamps: the fuzzer's draws depend on message lengths, which must not vary.
    manifest = SessionManifest(session_key("auth-1"), (key.block_hash,), token_count=16,
                               updated_at=1.0)
    mkey = pb.ManifestKey(scope=scope, session_id="auth-1")
    return {
        "Put": [pb.PutChunk(scope=scope, block_hash=key.block_hash, frame_size=len(frame),
                            data=frame).SerializeToString()],
        "Get": pb.GetRequest(scope=scope, block_hashes=[key.block_hash]).SerializeToString(),
        "Lookup": pb.LookupRequest(scope=scope, block_hashes=[key.block_hash]
                                   ).SerializeToString(),
        "Delete": pb.DeleteRequest(scope=scope, block_hashes=[b"zz"]).SerializeToString(),
        "PutManifest": pb.PutManifestRequest(manifest=manifest.encode()).SerializeToString(),
        "GetManifest": mkey.SerializeToString(),
        "DeleteManifest": pb.ManifestKey(scope=scope, session_id="auth-gone").SerializeToString(),
        "Stat": pb.StatRequest().SerializeToString(),
    }


def _call(channel: grpc.Channel, method: str, request: bytes | list[bytes],
          token: str | None) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    fn = _raw(channel, method)
    try:
        if method == "Put":
            assert isinstance(request, list)
            fn(iter(request), timeout=T, metadata=metadata)
        elif method == "Get":
            list(fn(request, timeout=T, metadata=metadata))
        else:
            fn(request, timeout=T, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_every_call_needs_the_right_token(secured: DaemonProcess) -> None:
    channel = grpc.insecure_channel(secured.address)
    requests = _requests()
    for method in METHODS:
        request = requests[method]
        assert _call(channel, method, request, None) == grpc.StatusCode.UNAUTHENTICATED, method
        assert _call(channel, method, request, "not-a-token-at-all-xx") == \
            grpc.StatusCode.UNAUTHENTICATED, method
        expected_b = grpc.StatusCode.OK if method == "Stat" else grpc.StatusCode.PERMISSION_DENIED
        assert _call(channel, method, request, TOKEN_B) == expected_b, method
        assert _call(channel, method, request, TOKEN_A) == grpc.StatusCode.OK, method
    # Malformed authorization headers are refused the same way.
    for header in ("Basic abc", "Bearer", TOKEN_A):
        fn = _raw(channel, "Stat")
        with pytest.raises(grpc.RpcError) as info:
            fn(requests["Stat"], timeout=T, metadata=(("authorization", header),))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The health service answers without a token (probes carry none).
    assert DaemonClient("x", secured.address).health(timeout=T) == "SERVING"
    channel.close()


def test_client_with_token_stays_in_its_namespace(secured: DaemonProcess) -> None:
    a = DaemonClient("s", secured.address, token=TOKEN_A)
    key = block_key(10)
    a.put(scope_of(key), [(key.block_hash, make_frame(key))], timeout=T)
    assert a.lookup(scope_of(key), [key.block_hash], timeout=T) == [True]
    other = block_key(10, Namespace("tenant-b"))
    with pytest.raises(ConfigError, match="PERMISSION_DENIED"):
        a.lookup(scope_of(other), [other.block_hash], timeout=T)
    peer = DaemonClient("s", secured.address, token=TOKEN_PEER)
    assert peer.lookup(scope_of(key), [key.block_hash], timeout=T) == [True]
    with pytest.raises(ConfigError, match="UNAUTHENTICATED"):
        DaemonClient("s", secured.address).lookup(scope_of(key), [key.block_hash], timeout=T)
    a.close()
    peer.close()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(method=st.sampled_from(METHODS), data=st.data())
def test_fuzz_random_and_truncated_messages_never_crash(secured: DaemonProcess, method: str,
                                                        data: st.DataObject) -> None:
    channel = _fuzz_channel(secured)
    valid = _requests()[method]
    kind = data.draw(st.sampled_from(["random", "truncated", "flipped"]))

    def mutate(msg: bytes) -> bytes:
        if kind == "random":
            return data.draw(st.binary(max_size=2048))
        if kind == "truncated":
            return msg[: data.draw(st.integers(0, max(len(msg) - 1, 0)))]
        buf = bytearray(msg)
        if buf:
            pos = data.draw(st.integers(0, len(buf) - 1))
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        return bytes(buf)

    request: bytes | list[bytes]
    if isinstance(valid, list):
        request = [mutate(m) for m in valid] + data.draw(
            st.lists(st.binary(max_size=512), max_size=3))
    else:
        request = mutate(valid)
    code = _call(channel, method, request, TOKEN_A)
    # Anything but a crash: OK (the junk happened to parse), or a clean refusal.
    assert code in {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.RESOURCE_EXHAUSTED
                    }, (method, code)


_channels: dict[str, grpc.Channel] = {}


def _fuzz_channel(d: DaemonProcess) -> grpc.Channel:
    if d.address not in _channels:
        _channels[d.address] = grpc.insecure_channel(d.address, options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    return _channels[d.address]


def test_daemon_survives_the_fuzzing(secured: DaemonProcess) -> None:
    """Runs after the fuzz test: the daemon is alive, serving and its data intact."""
    client = DaemonClient("s", secured.address, token=TOKEN_A)
    assert secured.alive
    assert client.health(timeout=T) == "SERVING"
    key = block_key(10)
    read = client.get(scope_of(key), key.block_hash, timeout=T)
    assert read is not None and read.to_frame() == make_frame(key)
    client.close()


def test_without_auth_a_network_address_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvstore.daemon", "--listen", f"0.0.0.0:{free_port()}",
         "--data-dir", str(tmp_path / "d"), "--node-id", "open"],
        check=False, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "KVKEEP_NO_MALLOC_TUNING": "1",
             "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 2
    assert "loopback" in proc.stderr


def test_loopback_without_auth_says_so(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "open")
    try:
        assert "loopback only" in d.log_text()
    finally:
        d.terminate()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_mutual_tls(tmp_path: Path) -> None:
    ca_key, ca = tmp_path / "ca.key", tmp_path / "ca.pem"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out",
             str(ca), "-days", "1", "-subj", "/CN=kvkeep-test-ca")
    ext = tmp_path / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def issue(name: str) -> tuple[Path, Path]:
        key, csr, cert = (tmp_path / f"{name}.key", tmp_path / f"{name}.csr",
                          tmp_path / f"{name}.pem")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
                 "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
                 "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext))
        return cert, key

    server_cert, server_key = issue("server")
    client_cert, client_key = issue("client")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A} tenant-a\n")
    port = free_port()
    d = DaemonProcess("tls", port, tmp_path / "data", tmp_path / "tls.log", [
        "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "data"),
        "--node-id", "tls", "--token-file", str(tokens), "--tls-cert", str(server_cert),
        "--tls-key", str(server_key), "--tls-ca", str(ca)])
    d.spawn()
    try:
        tls = ClientTLS(ca, client_cert, client_key)
        good = DaemonClient("tls", d.address, token=TOKEN_A, tls=tls)
        key = block_key(20)
        for _ in range(200):  # wait until it serves
            try:
                good.health(timeout=1)
                break
            except Exception:
                import time
                time.sleep(0.05)
        good.put(scope_of(key), [(key.block_hash, make_frame(key))], timeout=T)
        assert good.lookup(scope_of(key), [key.block_hash], timeout=T) == [True]
        # Without a client certificate the handshake fails; a plaintext client gets nowhere.
        no_cert = DaemonClient("tls", d.address, token=TOKEN_A, tls=ClientTLS(ca))
        with pytest.raises(Exception):  # noqa: B017  (UNAVAILABLE, as TierUnavailable)
            no_cert.lookup(scope_of(key), [key.block_hash], timeout=2)
        plain = DaemonClient("tls", d.address, token=TOKEN_A)
        with pytest.raises(Exception):  # noqa: B017
            plain.lookup(scope_of(key), [key.block_hash], timeout=2)
        for c in (good, no_cert, plain):
            c.close()
    finally:
        d.terminate()
