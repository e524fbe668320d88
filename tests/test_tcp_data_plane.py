"""The TCP data plane (kvstore/net/tcp_protocol.py, tcp_transport.py, kvstore/daemon/tcp_front.py):
its framing, the one status table both transports share, real daemons serving it (round trips,
layer ranges, auth, bad input, fallback to gRPC, draining), and a fuzzer: random, truncated and
mutated requests never crash a daemon nor store anything."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from deploy.local.daemons import DaemonProcess, start_daemon
from deploy.local.services import free_port
from kvstore.cluster.discovery import DaemonInfo
from kvstore.daemon.auth import TokenTable
from kvstore.daemon.budgets import DaemonLimits
from kvstore.daemon.catalog import KeyCatalog
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.core import BlockServiceCore
from kvstore.daemon.tcp_front import TcpFront
from kvstore.errors import (
    ConfigError,
    CorruptBlock,
    DeadlineExceeded,
    TierError,
    TierFull,
    TierUnavailable,
)
from kvstore.frame import BlockRead, LayerRange
from kvstore.keys import Namespace
from kvstore.net import daemon_client
from kvstore.net import tcp_protocol as tp
from kvstore.net.daemon_client import DaemonClient
from kvstore.net.grpc_transport import translate_rpc_error
from kvstore.net.limits import MAX_FRAME_BYTES
from kvstore.net.refusal import OK, RefusalReason, client_error
from kvstore.net.scope import Scope
from kvstore.net.tcp_protocol import (
    OP_GET,
    OP_GET_MANY,
    OP_LOOKUP,
    OP_PUT,
    OP_PUT_MANY,
    REPLY_HEAD,
    REQUEST_HEAD,
    decode_batch_body,
    decode_put_item,
    decode_reply_head,
    decode_request_head,
    encode_batch,
    encode_put_many,
    encode_reply,
    encode_request,
    recv_exact,
    recv_into_pieces,
    recv_whole,
    send_parts,
)
from kvstore.net.tcp_transport import LookupUnsupported, TcpBlockTransport
from kvstore.net.transport import TransportUnreachable
from kvstore.store import StoreConfig, TieredStore
from kvstore.tiers.memory.host import HostTier
from kvstore.tiers.nvme.tier import NvmeTier
from tests.blockframes import FINGERPRINT, NAMESPACE, block_key, corrupt, make_frame

T = 10.0
TOKEN_A = "token-tenant-a-0123456789"
TOKEN_B = "token-tenant-b-0123456789"
SCOPE = Scope(FINGERPRINT.digest, NAMESPACE)


def data_address(daemon: DaemonProcess) -> str:
    port = daemon.client().stat(timeout=T).data_port
    assert port
    return f"127.0.0.1:{port}"


def exchange(address: str, payload: bytes, *, wait: float = 5.0) -> bytes:
    """Send raw bytes, half-close, and read whatever comes back until the daemon closes."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
        return b"".join(chunks)


def replies(raw: bytes) -> list[tuple[tp.Reply, bytes]]:
    """Parse a byte stream of replies (message text included)."""
    out = []
    while raw:
        head = decode_reply_head(raw[:REPLY_HEAD.size])
        end = REPLY_HEAD.size + head.message_len + head.header_len + head.payload_len
        out.append((head, raw[REPLY_HEAD.size: REPLY_HEAD.size + head.message_len]))
        raw = raw[end:]
    return out


def put_request(key_i: int, frame: bytes, *, token: bytes = b"",
                namespace: Namespace = NAMESPACE) -> bytes:
    key = block_key(key_i, namespace)
    scope = Scope(FINGERPRINT.digest, namespace)
    return encode_request(OP_PUT, scope, key.block_hash, token, body_len=len(frame)) + frame


# -- framing ---------------------------------------------------------------------------------


def test_requests_round_trip_and_bad_heads_are_refused() -> None:
    raw = encode_request(OP_GET, SCOPE, b"h" * 32, b"tok", layers=LayerRange(2, 5))
    head = decode_request_head(raw[:tp.REQUEST_HEAD.size])
    assert (head.op, head.token_len, head.hash_len, head.layers, head.body_len) == (
        OP_GET, 3, 32, (2, 5), 0)
    assert raw[tp.REQUEST_HEAD.size:] == b"tok" + b"tenant-a" + b"h" * 32
    assert head.fingerprint == FINGERPRINT.digest
    good = bytearray(encode_request(OP_PUT, SCOPE, b"h", b"", body_len=10)[:tp.REQUEST_HEAD.size])
    decode_request_head(good)
    for offset, value in [(0, ord("X")), (4, 2), (5, 9), (6, 0xFF), (11, 0x80), (12, 1),
                          (10, 0), (10, 65)]:
        bad = bytearray(good)
        if offset == 6:  # token_len u16 over the limit
            bad[6:8] = (tp.MAX_TOKEN_BYTES + 1).to_bytes(2, "little")
        else:
            bad[offset] = value
        with pytest.raises(ValueError):
            decode_request_head(bad)
    with pytest.raises(ValueError):  # a GET with a body
        decode_request_head(encode_request(OP_GET, SCOPE, b"h", b"", body_len=1)[:44])
    with pytest.raises(ValueError):  # a PUT with a layer range
        decode_request_head(encode_request(OP_PUT, SCOPE, b"h", b"", layers=LayerRange(0, 1),
                                           body_len=1)[:44])


def test_put_many_requests_round_trip_and_bad_ones_are_refused() -> None:
    frames = [b"f" * 10, b"g" * 3]
    parts = encode_put_many(SCOPE, [(b"a", memoryview(frames[0])),
                                    (b"h" * 64, memoryview(frames[1]))], b"tok")
    raw = b"".join(parts)
    head = decode_request_head(raw[:tp.REQUEST_HEAD.size])
    assert (head.op, head.token_len, head.hash_len, head.layers) == (OP_PUT_MANY, 3, 0, None)
    body = raw[tp.REQUEST_HEAD.size + head.tail_len:]
    assert head.body_len == len(body) == 2 * tp.PUT_ITEM_HEAD.size + 13
    item = tp.PUT_ITEM_HEAD.size
    assert decode_put_item(body[:item]) == (10, b"a")
    assert body[item:item + 10] == frames[0]
    assert decode_put_item(body[item + 10:2 * item + 10]) == (3, b"h" * 64)
    # the frames go out as the caller's buffers, not copies
    assert [bytes(p) for p in parts[2::2]] == frames and isinstance(parts[2], memoryview)
    good = bytearray(raw[:tp.REQUEST_HEAD.size])
    for offset, value in [(10, 1), (11, 1), (12, 1), (16, 2)]:  # hash, flags, layers
        bad = bytearray(good)
        bad[offset] = value
        with pytest.raises(ValueError):
            decode_request_head(bad)
    for body_len in (0, tp.PUT_ITEM_HEAD.size):  # not even one item with a byte of frame
        bad = bytearray(good)
        bad[20:28] = body_len.to_bytes(8, "little")
        with pytest.raises(ValueError):
            decode_request_head(bad)
    for broken in (tp.PUT_ITEM_HEAD.pack(1, 0, b""), tp.PUT_ITEM_HEAD.pack(1, 65, b"x" * 64),
                   tp.PUT_ITEM_HEAD.pack(1, 1, b"ab")):  # no hash, too long, padding not zero
        with pytest.raises(ValueError):
            decode_put_item(broken)
    for blocks in ([], [(b"", memoryview(b"x"))], [(b"x" * 65, memoryview(b"x"))],
                   [(b"x", memoryview(b"x"))] * (tp.MAX_PUT_MANY_BLOCKS + 1)):
        with pytest.raises(ValueError):
            encode_put_many(SCOPE, blocks, b"")


@pytest.mark.parametrize("op", [OP_LOOKUP, OP_GET_MANY])
def test_batch_requests_round_trip_and_bad_ones_are_refused(op: int) -> None:
    hashes = [b"a", b"h" * 32, b"z" * 64]
    head_and_tail, body = encode_batch(op, SCOPE, hashes, b"tok")
    head = decode_request_head(head_and_tail[:tp.REQUEST_HEAD.size])
    assert (head.op, head.token_len, head.hash_len, head.layers, head.body_len) == (
        op, 3, 0, None, len(body))
    assert head_and_tail[tp.REQUEST_HEAD.size:] == b"tok" + b"tenant-a"
    assert decode_batch_body(body) == hashes
    good = bytearray(head_and_tail[:tp.REQUEST_HEAD.size])
    # a hash in the head; flags; a layer range
    for offset, value in [(10, 1), (11, 1), (12, 1), (16, 2)]:
        bad = bytearray(good)
        bad[offset] = value
        with pytest.raises(ValueError):
            decode_request_head(bad)
    for body_len in (0, 1, tp.MAX_BATCH_BODY_BYTES + 1):
        bad = bytearray(good)
        bad[20:28] = body_len.to_bytes(8, "little")
        with pytest.raises(ValueError):
            decode_request_head(bad)
    for broken in (b"\x00", b"\x41" + b"x" * 64, b"\x05abc", body + b"\x02a"):
        with pytest.raises(ValueError):
            decode_batch_body(broken)
    for asked in ([], [b""], [b"x" * 65]):
        with pytest.raises(ValueError):
            encode_batch(op, SCOPE, asked, b"")
    with pytest.raises(ValueError):
        encode_batch(OP_GET, SCOPE, hashes, b"")


def test_reply_heads_are_checked() -> None:
    raw = encode_reply(OK, result=True, header=b"H" * 7, layers=(1, 2), payload_len=9)
    head = decode_reply_head(raw[:REPLY_HEAD.size])
    assert (head.status, head.result, head.close, head.header_len, head.layers,
            head.payload_len) == (0, True, False, 7, (1, 2), 9)
    closing = encode_reply(RefusalReason.UNAVAILABLE, close=True, message="m")
    assert decode_reply_head(closing[:32]).close
    with pytest.raises(CorruptBlock):
        decode_reply_head(encode_reply(OK, payload_len=MAX_FRAME_BYTES + 1)[:32])
    with pytest.raises(CorruptBlock):
        decode_reply_head(b"XXXX" + raw[4:REPLY_HEAD.size])


def test_one_status_table_for_both_transports() -> None:
    class Rpc(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode) -> None:
            self._code = code

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return "x"

    # Refusal reasons are numbered (and named) as gRPC's status codes: both fronts write the
    # same number, and both clients read it through the same table.
    for reason in RefusalReason:
        assert grpc.StatusCode[reason.name].value[0] == reason
    kinds = {code: type(translate_rpc_error(Rpc(code), "op")) for code in grpc.StatusCode
             if code is not grpc.StatusCode.OK}
    for code, kind in kinds.items():
        assert type(client_error(code.value[0], "op", "x")) is kind, code
    assert kinds[grpc.StatusCode.UNAUTHENTICATED] is ConfigError
    assert kinds[grpc.StatusCode.PERMISSION_DENIED] is ConfigError
    assert kinds[grpc.StatusCode.DEADLINE_EXCEEDED] is DeadlineExceeded
    for sick in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                 grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED):
        assert kinds[sick] is TierUnavailable, sick  # the breaker counts these ...
    assert kinds[grpc.StatusCode.INVALID_ARGUMENT] is TierError  # ... not a refusal of one
    # A full disk or a spent budget: another replica, now; the daemon is well (no breaker).
    assert kinds[grpc.StatusCode.RESOURCE_EXHAUSTED] is TierFull
    assert issubclass(TierFull, TierError) and not issubclass(TierFull, TierUnavailable)
    error = client_error(RefusalReason.PERMISSION_DENIED, "get from d1", "tenant 'b'")
    assert str(error) == "get from d1: PERMISSION_DENIED: tenant 'b'"


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 70_000), min_size=1, max_size=8))
def test_scatter_send_and_receive_move_every_byte_in_order(sizes: list[int]) -> None:
    parts = [os.urandom(n) for n in sizes]
    a, b = socket.socketpair()
    try:
        sender = threading.Thread(target=send_parts, args=(a, parts))
        sender.start()
        into = [memoryview(bytearray(n)) for n in reversed(sizes)]  # other boundaries
        recv_into_pieces(b, into)
        sender.join()
        assert b"".join(bytes(p) for p in into) == b"".join(parts)
        a.close()
        with pytest.raises(ConnectionError):
            recv_exact(b, memoryview(bytearray(1)))
    finally:
        a.close()
        b.close()


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300_000), min_size=1, max_size=6))
def test_waiting_reads_fill_every_piece_in_order(sizes: list[int]) -> None:
    """recv_whole, the client's reply reader: a blocking socket, each read waiting for all it
    asked (pieces larger than the socket's buffer included)."""
    parts = [os.urandom(n) for n in sizes]
    a, b = socket.socketpair()
    try:
        b.settimeout(None)
        sender = threading.Thread(target=send_parts, args=(a, parts))
        sender.start()
        into = [memoryview(bytearray(n)) for n in reversed(sizes)]  # other boundaries
        recv_whole(b, into, time.monotonic() + T)
        sender.join()
        assert b"".join(bytes(p) for p in into) == b"".join(parts)
    finally:
        a.close()
        b.close()


def test_waiting_reads_end_at_the_deadline_or_the_peers_close() -> None:
    a, b = socket.socketpair()
    try:
        b.settimeout(None)
        # Nothing at all arrives: the deadline ends the read.
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            recv_whole(b, [memoryview(bytearray(10))], started + 0.3)
        assert time.monotonic() - started < 1.5

        # Bytes trickling in slower than asked: the deadline still ends the read.
        def trickle() -> None:
            with contextlib.suppress(OSError):
                for _ in range(20):
                    a.sendall(b"x")
                    time.sleep(0.05)

        sender = threading.Thread(target=trickle)
        sender.start()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            recv_whole(b, [memoryview(bytearray(1000))], started + 0.5)
        assert 0.4 < time.monotonic() - started < 1.5
        sender.join()
    finally:
        a.close()
        b.close()
    a, b = socket.socketpair()
    try:
        b.settimeout(None)
        # No deadline at all (infinity) is a valid one; then the peer closes part way through
        # a piece.
        a.sendall(b"abc")
        first = bytearray(2)
        recv_whole(b, [memoryview(first)], math.inf)
        assert first == b"ab"
        a.close()
        with pytest.raises(ConnectionError):
            recv_whole(b, [memoryview(bytearray(10))], time.monotonic() + T)
    finally:
        a.close()
        b.close()


def test_daemon_info_carries_the_data_address() -> None:
    info = DaemonInfo("n1", "h:1", 5.0, "h:2")
    assert DaemonInfo.decode(info.encode()) == info
    old = DaemonInfo("n1", "h:1", 5.0)
    assert b"data_address" not in old.encode()
    assert DaemonInfo.decode(old.encode()).data_address == ""
    with pytest.raises(ConfigError):
        DaemonInfo("n1", "h:1", 0.0, "nonsense")


def test_data_listen_configuration(tmp_path: Path) -> None:
    base = {"listen": "127.0.0.1:7000", "data_dir": tmp_path, "mem_budget": 1 << 20,
            "disk_budget": 1 << 20, "node_id": "n"}
    assert DaemonConfig(**base).data_bind() == ("127.0.0.1", 0)  # type: ignore[arg-type]
    assert DaemonConfig(**base, data_listen="off").data_bind() is None  # type: ignore[arg-type]
    fixed = DaemonConfig(**base, data_listen="127.0.0.1:7001", advertise="node7:7000")  # type: ignore[arg-type]
    assert fixed.data_bind() == ("127.0.0.1", 7001)
    assert fixed.advertised_data_address(7001) == "node7:7001"
    tls = DaemonConfig(**base, tls_cert=tmp_path / "c", tls_key=tmp_path / "k")  # type: ignore[arg-type]
    assert tls.data_bind() is None  # plain TCP is never opened beside TLS
    with pytest.raises(ConfigError):  # no token file: loopback only, for the data plane too
        DaemonConfig(**base, data_listen="0.0.0.0:7001")  # type: ignore[arg-type]


# -- the server in this process ----------------------------------------------------------------


@contextlib.contextmanager
def in_process_daemon(tmp_path: Path, *, ram: int = 256 << 20,
                      front: dict[str, float] | None = None, tokens: TokenTable | None = None,
                      **limits: object) -> Iterator[tuple[BlockServiceCore, TcpFront, str]]:
    """A daemon's core and TCP front in this process (RAM only, `limits` over the scaled
    defaults, `front` for TcpFront): for what a test must reach into, such as a tenant's read
    budget held from outside, or the front's connection limits."""
    store = TieredStore([HostTier(ram)])
    catalog = KeyCatalog(tmp_path / "keys.log")
    core = BlockServiceCore("local", store, catalog, tokens=tokens, limits=dataclasses.replace(
        DaemonLimits.scaled(ram, ram), **limits))  # type: ignore[arg-type]
    server = TcpFront(core, "127.0.0.1", **(front or {}))  # type: ignore[arg-type]
    try:
        yield core, server, f"127.0.0.1:{server.start()}"
    finally:
        server.stop(1.0)
        store.close()
        catalog.close()


@pytest.fixture
def local_server(tmp_path: Path) -> Iterator[tuple[TcpFront, str]]:
    with in_process_daemon(tmp_path, ram=64 << 20, put_idle_s=2.0,
                           front={"max_connections": 1, "request_timeout": 2.0}
                           ) as (_, server, address):
        yield server, address


def _wait_idle(server: TcpFront) -> None:
    """Until the server has finished the request whose reply the client already read."""
    deadline = time.monotonic() + 5
    while server.requests_in_progress and time.monotonic() < deadline:
        time.sleep(0.005)


def test_idle_connections_make_room_and_busy_ones_do_not(
        local_server: tuple[TcpFront, str]) -> None:
    server, address = local_server
    first, second = TcpBlockTransport("l", address), TcpBlockTransport("l", address)
    key = block_key(3)
    assert first.put(SCOPE, [(key.block_hash, make_frame(key))], timeout=T) == [True]  # 1 slot
    _wait_idle(server)
    # The only slot is held by an idle connection: it is closed to let the new one in ...
    read = second.get(SCOPE, key.block_hash, timeout=T)
    assert read is not None
    read.verify()
    _wait_idle(server)
    # ... and its client's next call finds it closed and reconnects (evicting the idle other).
    assert first.get(SCOPE, key.block_hash, timeout=T) is not None
    _wait_idle(server)
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=T) as busy:
        busy.sendall(put_request(3, make_frame(key))[:REQUEST_HEAD.size + 3])  # mid-request
        deadline = time.monotonic() + 5
        while server.requests_in_progress != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.requests_in_progress == 1
        # A connection in the middle of a request is never closed to make room: a client
        # that finds no slot can fall back to gRPC (TransportUnreachable).
        with pytest.raises(TransportUnreachable):
            second.get(SCOPE, key.block_hash, timeout=T)
    first.close()
    second.close()


def test_a_stopped_server_refuses_and_a_stalled_request_times_out(
        local_server: tuple[TcpFront, str]) -> None:
    server, address = local_server
    host, port = address.rsplit(":", 1)
    key = block_key(4)
    frame = make_frame(key)
    with socket.create_connection((host, int(port)), timeout=T) as sock:
        sock.sendall(put_request(4, frame)[:-10])  # and then nothing: the request times out
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed by the daemon after its request timeout (2 s)
        assert 1.5 < time.monotonic() - started < 10
    c = TcpBlockTransport("l", address)
    assert c.get(SCOPE, key.block_hash, timeout=T) is None  # nothing of it was stored
    server.stop(1.0)
    with pytest.raises(TierUnavailable):
        c.get(SCOPE, key.block_hash, timeout=T)
    c.close()


def test_a_corrupt_copy_in_ram_is_caught_by_the_client_and_dropped_by_the_daemon(
        tmp_path: Path) -> None:
    # The put's check of the pages it was received into counts for `lent_recheck_s`: a short
    # one here, and the flip below is looked for once it has passed.
    store = TieredStore([HostTier(64 << 20), NvmeTier(tmp_path / "nvme", 64 << 20)],
                        config=StoreConfig(lent_recheck_s=0.2))
    catalog = KeyCatalog(tmp_path / "keys.log")
    core = BlockServiceCore("local", store, catalog, tokens=None)
    server = TcpFront(core, "127.0.0.1")
    c = TcpBlockTransport("l", f"127.0.0.1:{server.start()}")
    try:
        key = block_key(5)
        frame = make_frame(key, layers=4, segment_bytes=100_000)
        assert c.put(SCOPE, [(key.block_hash, frame)], timeout=T) == [True]
        assert store.flush(10)
        host = store.tiers[0]
        assert isinstance(host, HostTier)
        entry = host._index[key.digest]  # white box: a bit flips in the daemon's RAM
        host._page_views[entry.pages[-1]][7] ^= 0x10
        time.sleep(0.25)
        bad = c.get(SCOPE, key.block_hash, timeout=T)
        assert bad is not None
        with pytest.raises(CorruptBlock):
            bad.verify()  # what the remote tier does with every block
        # The daemon checks a RAM block right after sending it (off the get's critical path),
        # so its drop of the corrupt copy lands shortly after the client has the bytes.
        deadline = time.monotonic() + 5.0
        while host.contains([key]) != [False] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert host.contains([key]) == [False]  # the daemon dropped its RAM copy ...
        good = c.get(SCOPE, key.block_hash, timeout=T)  # ... and serves the disk's
        assert good is not None
        good.verify()
        assert good.to_frame() == frame
        assert store.stats().corrupt >= 1
    finally:
        c.close()
        server.stop(1.0)
        store.close()
        catalog.close()


def read_replies(sock: socket.socket, count: int) -> list[tuple[tp.Reply, bytes, bytes]]:
    """`count` replies read off a live connection: (head, message, header + payload)."""
    def take(size: int) -> bytes:
        buf = bytearray(size)
        recv_exact(sock, memoryview(buf))
        return bytes(buf)

    out = []
    for _ in range(count):
        head = decode_reply_head(take(REPLY_HEAD.size))
        out.append((head, take(head.message_len), take(head.header_len + head.payload_len)))
    return out


def test_get_many_answers_every_hash_in_order_in_one_request(tmp_path: Path) -> None:
    """GET_MANY: one reply per hash, in order, hits and misses mixed, payloads straight into
    the callers' buffers; more blocks than one send of the daemon holds (8 MiB, 256 pieces),
    so its batches are cut and sent in turn."""
    with in_process_daemon(tmp_path) as (core, _, address):
        c = TcpBlockTransport("l", address)
        keys = [block_key(i) for i in range(3000, 3040)]
        frames = [make_frame(k, layers=4, segment_bytes=75_000 + 1000 * (i % 3))
                  for i, k in enumerate(keys)]
        stored = [i % 5 != 2 for i in range(len(keys))]
        assert c.put(SCOPE, [(k.block_hash, f) for k, f, s in zip(keys, frames, stored, strict=True)
                             if s], timeout=T) == [True] * sum(stored)
        before = core.counters()
        outs = [bytearray(len(f)) for f in frames]
        reads = c.get_into(SCOPE, [(k.block_hash, o) for k, o in zip(keys, outs, strict=True)],
                           timeout=T)
        after = core.counters()
        for key, frame, out, held, read in zip(keys, frames, outs, stored, reads, strict=True):
            if not held:
                assert read is None
                continue
            assert read is not None
            read.verify()
            read.verify_key(key.digest)
            assert read.to_frame() == frame and bytes(out[:len(read.payload)]) == bytes(
                read.payload)
        assert after.hits - before.hits == sum(stored)
        assert after.misses - before.misses == len(keys) - sum(stored)
        assert after.get_bytes_sent - before.get_bytes_sent == sum(
            len(r.payload) for r in reads if r is not None)
        # On the wire: one request, its replies in the order asked.
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=T) as sock:
            asked = [keys[0], block_key(9999), keys[1]]
            send_parts(sock, encode_batch(OP_GET_MANY, SCOPE, [k.block_hash for k in asked],
                                          b""))
            got = read_replies(sock, 3)
            assert [(h.status, h.result, h.close) for h, _, _ in got] == [
                (OK, True, False), (OK, False, False), (OK, True, False)]
            assert got[2][2][got[2][0].header_len:] == bytes(reads[1].payload)  # type: ignore[union-attr]
            # A body that does not parse leaves the count unknown: one refusal, then the end.
            head_and_tail, body = encode_batch(OP_GET_MANY, SCOPE, [b"x"], b"")
            sock.sendall(head_and_tail + b"\x00" * len(body))
            ((head, message, _),) = read_replies(sock, 1)
            assert (head.status, head.close) == (RefusalReason.INVALID_ARGUMENT, True)
            assert b"bad batch" in message
            assert sock.recv(1) == b""
        c.close()


def test_reads_verified_as_they_arrive_come_back_marked_and_bad_ones_unmarked(
        tmp_path: Path) -> None:
    """With the keys' digests, `get_into` verifies each read as it lands (checksums and key
    binding) and marks it; a corrupt copy, or a read asked for another key's digest, comes
    back unmarked for the caller's own check to find, and the rest of the batch is unharmed."""
    with in_process_daemon(tmp_path) as (core, _, address):
        c = TcpBlockTransport("l", address)
        keys = [block_key(i) for i in range(4100, 4104)]
        frames = [make_frame(k, layers=3, segment_bytes=50_000) for k in keys]
        assert c.put(SCOPE, list(zip([k.block_hash for k in keys], frames, strict=True)),
                     timeout=T) == [True] * 4
        host = core._store.tiers[0]
        assert isinstance(host, HostTier)
        entry = host._index[keys[1].digest]  # white box: a bit flips in the daemon's RAM
        host._page_views[entry.pages[0]][3000] ^= 0x04
        digests = [k.digest for k in keys]
        digests[3] = keys[0].digest  # asked for under another key's digest
        reads = c.get_into(SCOPE, [(k.block_hash, None) for k in keys], timeout=T,
                           digests=digests)
        assert [r is not None and r.verified for r in reads] == [True, False, True, False]
        assert reads[0] is not None and reads[0].to_frame() == frames[0]
        assert reads[1] is not None and reads[3] is not None
        with pytest.raises(CorruptBlock):
            reads[1].verified_for(keys[1].digest)  # what the remote tier does with it
        assert reads[3].verified_for(keys[3].digest).to_frame() == frames[3]
        # Without digests nothing is marked (the caller verifies).
        plain = c.get_into(SCOPE, [(keys[2].block_hash, None)], timeout=T)
        assert plain[0] is not None and not plain[0].verified
        c.close()


def reads_given_back(core: BlockServiceCore) -> dict[str, tuple[int, int]]:
    """The reads still held once the daemon's threads are past their sends (a client can
    read the last reply before the thread that sent it gives its budget back)."""
    deadline = time.monotonic() + 5
    while core.budgets.reads_held() and time.monotonic() < deadline:
        time.sleep(0.005)
    return core.budgets.reads_held()


def test_get_many_under_a_short_read_budget(tmp_path: Path) -> None:
    """A tenant's read budget (M1) holds a GET_MANY's blocks only until they are sent: a
    batch whose next block would pass it is sent first, so a budget of two blocks still
    serves ten; with most of the budget held elsewhere, every block is refused
    (RESOURCE_EXHAUSTED), the connection stays in step, and nothing stays held."""
    with in_process_daemon(tmp_path, read_bytes=3 << 20) as (core, _, address):
        c = TcpBlockTransport("l", address)
        keys = [block_key(i) for i in range(3100, 3110)]
        frames = [make_frame(k, layers=4, segment_bytes=300_000) for k in keys]  # 1.2 MB
        assert c.put(SCOPE, [(k.block_hash, f) for k, f in zip(keys, frames, strict=True)],
                     timeout=T) == [True] * 10
        items: list[tuple[bytes, bytearray | None]] = [(k.block_hash, None) for k in keys]
        reads = c.get_into(SCOPE, items, timeout=T)
        assert [r.to_frame() if r else None for r in reads] == frames
        assert reads_given_back(core) == {}
        # another reader of tenant-a holds all but 1 MB of the budget
        with core.read_bytes(SCOPE, (3 << 20) - 1_000_000), \
                pytest.raises(TierError, match="RESOURCE_EXHAUSTED"):
            c.get_into(SCOPE, items, timeout=T)
        assert reads_given_back(core) == {}
        reads = c.get_into(SCOPE, items, timeout=T)  # the same pooled connection, in step
        assert all(r is not None for r in reads)
        c.close()


def older_daemon(monkeypatch: pytest.MonkeyPatch, unknown: int) -> list[int]:
    """Make the in-process daemon answer op `unknown` as a daemon of an older release would
    (unknown op: INVALID_ARGUMENT, then it closes); returns the ops it is asked, in order."""
    from kvstore.daemon import tcp_front

    asked: list[int] = []

    def older(raw: bytes | bytearray | memoryview) -> tp.Request:
        asked.append(raw[5])
        if raw[5] == unknown:
            raise ValueError(f"unknown op {raw[5]}")
        return decode_request_head(raw)

    monkeypatch.setattr(tcp_front, "decode_request_head", older)
    return asked


def test_a_daemon_without_get_many_is_sent_single_gets(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon of an older release answers GET_MANY as an unknown op (INVALID_ARGUMENT, then
    it closes the connection): the client sends that window again as single pipelined GETs,
    and only single GETs from then on."""
    asked = older_daemon(monkeypatch, OP_GET_MANY)
    with in_process_daemon(tmp_path) as (_, _, address):
        c = TcpBlockTransport("l", address)
        keys = [block_key(i) for i in range(3200, 3203)]
        frames = [make_frame(k) for k in keys]
        assert c.put(SCOPE, [(k.block_hash, f) for k, f in zip(keys, frames, strict=True)],
                     timeout=T) == [True] * 3
        items: list[tuple[bytes, bytearray | None]] = [(k.block_hash, None) for k in keys]
        for _ in range(2):
            reads = c.get_into(SCOPE, items, timeout=T)
            assert [r.to_frame() if r else None for r in reads] == frames
        assert asked == [OP_PUT_MANY] + [OP_GET_MANY] + [OP_GET] * 6
        c.close()


def put_many_request(blocks: list[tuple[int, bytes]], *, token: bytes = b"",
                     namespace: Namespace = NAMESPACE) -> bytes:
    scope = Scope(FINGERPRINT.digest, namespace)
    return b"".join(encode_put_many(
        scope, [(block_key(i, namespace).block_hash, memoryview(f)) for i, f in blocks], token))


def test_put_many_stores_each_block_as_a_put_and_answers_each_in_order(
        tmp_path: Path) -> None:
    """PUT_MANY: one reply per block, in order, after the last; a refused block (corrupt,
    another key's frame, too short for a header) is refused alone and its neighbours are
    stored; the connection stays in step. Items that break the framing end it, after the
    replies of the blocks already taken."""
    with in_process_daemon(tmp_path) as (core, _, address):
        keys = [block_key(i) for i in range(4000, 4006)]
        frames = [make_frame(k, layers=2, segment_bytes=30_000 + 7 * i)
                  for i, k in enumerate(keys)]
        sent = [(4000, frames[0]), (4001, corrupt(frames[1])), (4002, frames[3]),
                (4003, frames[3]), (4004, b"KVKB"), (4005, frames[5])]
        before = core.counters()
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=T) as sock:
            sock.sendall(put_many_request(sent))
            got = read_replies(sock, len(sent))
            assert [(h.status, h.result, h.close) for h, _, _ in got] == [
                (OK, True, False), (RefusalReason.INVALID_ARGUMENT, False, False),
                (RefusalReason.INVALID_ARGUMENT, False, False), (OK, True, False),
                (RefusalReason.INVALID_ARGUMENT, False, False), (OK, True, False)]
            # still in step: a GET on the same connection is answered
            sock.sendall(encode_request(OP_GET, SCOPE, keys[3].block_hash, b""))
            ((head, _, _),) = read_replies(sock, 1)
            assert (head.status, head.result) == (OK, True)
            # An item whose frame runs past the body: the blocks before it are answered, then
            # one refusal with the close flag.
            raw = bytearray(put_many_request([(4010, make_frame(block_key(4010))),
                                              (4011, make_frame(block_key(4011)))]))
            second = raw.rindex(tp.PUT_ITEM_HEAD.pack(
                len(make_frame(block_key(4011))), len(block_key(4011).block_hash),
                block_key(4011).block_hash))
            raw[second:second + 8] = (10 << 20).to_bytes(8, "little")
            sock.sendall(raw)
            got = read_replies(sock, 2)
            assert [(h.status, h.result, h.close) for h, _, _ in got] == [
                (OK, True, False), (RefusalReason.INVALID_ARGUMENT, False, True)]
            assert b"do not fill the body" in got[1][1]
            assert sock.recv(1) == b""
        after = core.counters()
        assert after.puts - before.puts == 4
        assert after.invalid_puts - before.invalid_puts == 4
        c = TcpBlockTransport("l", address)
        assert c.lookup(SCOPE, [k.block_hash for k in keys], timeout=T) == [
            True, False, False, True, False, True]
        assert c.lookup(SCOPE, [block_key(i).block_hash for i in (4010, 4011)],
                        timeout=T) == [True, False]
        for i in (0, 3, 5):
            read = c.get(SCOPE, keys[i].block_hash, timeout=T)
            assert read is not None and read.to_frame() == frames[i]
        c.close()


def test_put_many_refused_whole_is_answered_once_and_stores_nothing(tmp_path: Path) -> None:
    """Another tenant's scope, no token, a draining daemon: one refusal with the close flag
    (the body read and dropped first, so the client reads the answer), nothing stored."""
    tokens = TokenTable({TOKEN_A: ["tenant-a"]})
    with in_process_daemon(tmp_path, tokens=tokens) as (core, _, address):
        other = Namespace("tenant-b", "s")
        blocks = [(4100 + i, make_frame(block_key(4100 + i, other), segment_bytes=200_000))
                  for i in range(3)]
        for request, status in [
                (put_many_request(blocks, token=TOKEN_A.encode(), namespace=other),
                 RefusalReason.PERMISSION_DENIED),
                (put_many_request(blocks, namespace=other), RefusalReason.UNAUTHENTICATED)]:
            got = replies(exchange(address, request))
            assert [(h.status, h.close) for h, _ in got] == [(status, True)]
        core.start_draining()
        mine = [(4200, make_frame(block_key(4200)))]
        got = replies(exchange(address, put_many_request(mine, token=TOKEN_A.encode())))
        assert [(h.status, h.close) for h, _ in got] == [(RefusalReason.UNAVAILABLE, True)]
        assert core.counters().puts == 0
        c = TcpBlockTransport("l", address, token=TOKEN_A)
        assert c.lookup(SCOPE, [block_key(4200).block_hash], timeout=T) == [False]
        c.close()


def test_a_daemon_without_put_many_is_sent_single_puts(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon of an older release answers PUT_MANY as an unknown op and closes, reading
    only a few MiB of the body: a window larger than that loses its connection before the
    answer. Either way the window is sent again as single PUTs, and only those from then on;
    a daemon that took one PUT_MANY is never sent single PUTs."""
    with in_process_daemon(tmp_path) as (_, _, address):
        for frame_bytes in (20_000, 3_000_000):  # a window of 60 KB, and of 9 MB
            asked = older_daemon(monkeypatch, OP_PUT_MANY)
            c = TcpBlockTransport("l", address)
            first = 4300 if frame_bytes < 1_000_000 else 4400
            keys = [block_key(i) for i in range(first, first + 6)]
            frames = [make_frame(k, layers=1, segment_bytes=frame_bytes) for k in keys]
            for window in (slice(0, 3), slice(3, 6)):
                assert c.put(SCOPE, [(k.block_hash, f) for k, f in
                                     zip(keys[window], frames[window], strict=True)],
                             timeout=T) == [True] * 3
            assert asked[0] == OP_PUT_MANY and asked[1:] == [OP_PUT] * 6, asked
            reads = c.get_into(SCOPE, [(k.block_hash, None) for k in keys], timeout=T)
            assert [r.to_frame() if r else None for r in reads] == frames
            c.close()
        # A daemon that knows PUT_MANY: one request per window, and a later failure of one is
        # the caller's error, not a reason to fall back.
        monkeypatch.undo()
        c = TcpBlockTransport("l", address)
        keys = [block_key(i) for i in range(4500, 4503)]
        assert c.put(SCOPE, [(k.block_hash, make_frame(k)) for k in keys], timeout=T) == \
            [True] * 3
        asked = older_daemon(monkeypatch, OP_PUT_MANY)
        with pytest.raises(TierError, match="INVALID_ARGUMENT"):
            c.put(SCOPE, [(block_key(4503).block_hash, make_frame(block_key(4503)))],
                  timeout=T)
        assert asked == [OP_PUT_MANY]
        c.close()


# -- a real daemon -----------------------------------------------------------------------------


def test_blocks_travel_over_the_data_plane(daemon: DaemonProcess, client: DaemonClient) -> None:
    keys = [block_key(i) for i in range(10)]
    frames = [make_frame(k, layers=4, segment_bytes=4096) for k in keys]
    before = client.stat(timeout=T)
    assert client.put(SCOPE, [(k.block_hash, f) for k, f in zip(keys, frames, strict=True)],
                      timeout=T) == [True] * 10
    assert client.data_plane_address == data_address(daemon)
    for key, frame in zip(keys, frames, strict=True):
        read = client.get(SCOPE, key.block_hash, timeout=T)
        assert read is not None
        read.verify()
        read.verify_key(key.digest)
        assert read.to_frame() == frame
    assert client.get(SCOPE, block_key(999).block_hash, timeout=T) is None
    after = client.stat(timeout=T)
    assert after.puts - before.puts == 10
    assert after.put_bytes_received - before.put_bytes_received == sum(map(len, frames))
    assert (after.hits - before.hits, after.misses - before.misses) == (10, 1)


def test_batches_are_pipelined_and_a_bad_block_spoils_only_itself(daemon: DaemonProcess,
                                                                   client: DaemonClient) -> None:
    keys = [block_key(i) for i in range(1000, 1600)]  # more than one window
    frames = [make_frame(k, layers=2, segment_bytes=512) for k in keys]
    assert client.put(SCOPE, [(k.block_hash, f) for k, f in zip(keys, frames, strict=True)],
                      timeout=T) == [True] * len(keys)
    assert client.lookup(SCOPE, [k.block_hash for k in keys], timeout=T) == [True] * len(keys)
    c = TcpBlockTransport(daemon.node_id, data_address(daemon))
    fresh = [block_key(i) for i in range(2000, 2010)]
    batch = [(k.block_hash, make_frame(k)) for k in fresh]
    batch[4] = (fresh[4].block_hash, corrupt(batch[4][1]))
    with pytest.raises(TierError, match="INVALID_ARGUMENT"):
        c.put(SCOPE, batch, timeout=T)
    assert client.lookup(SCOPE, [k.block_hash for k in fresh], timeout=T) == [
        i != 4 for i in range(10)]
    assert c.get(SCOPE, fresh[0].block_hash, timeout=T) is not None  # still in step
    c.close()


def test_layer_range_reads_send_only_those_segments(client: DaemonClient) -> None:
    key = block_key(20)
    frame = make_frame(key, layers=8, segment_bytes=10_000)
    assert client.put(SCOPE, [(key.block_hash, frame)], timeout=T) == [True]
    before = client.stat(timeout=T).get_bytes_sent
    read = client.get(SCOPE, key.block_hash, LayerRange(2, 5), timeout=T)
    assert read is not None and read.layers == LayerRange(2, 5)
    read.verify()
    assert bytes(read.payload) == bytes(BlockRead.from_frame(frame, LayerRange(2, 5)).payload)
    assert client.stat(timeout=T).get_bytes_sent - before == 30_000
    # Beyond the block's layers: a miss (as over gRPC), never a partial answer.
    assert client.get(SCOPE, key.block_hash, LayerRange(6, 12), timeout=T) is None


def test_a_big_block_lands_in_the_callers_buffer(client: DaemonClient) -> None:
    key = block_key(21)
    frame = make_frame(key, layers=4, segment_bytes=5 << 20)  # 20 MiB, several MiB per layer
    assert client.put(SCOPE, [(key.block_hash, frame)], timeout=T) == [True]
    out = bytearray(len(frame))
    read = client.get(SCOPE, key.block_hash, out=out, timeout=T)
    assert read is not None
    read.verify()
    assert read.to_frame() == frame
    payload = memoryview(read.payload)
    assert payload.obj is out  # received straight into it
    small = bytearray(10)  # too small: a buffer of its own
    read = client.get(SCOPE, key.block_hash, out=small, timeout=T)
    assert read is not None and read.to_frame() == frame


def test_bad_puts_are_refused_and_store_nothing(daemon: DaemonProcess,
                                                client: DaemonClient) -> None:
    address = data_address(daemon)
    key = block_key(30)
    frame = make_frame(key, layers=4, segment_bytes=50_000)
    cases = {
        "corrupt segment": put_request(30, corrupt(frame)),
        "another key's frame": put_request(31, frame),
        "header of another size": put_request(30, frame + b"\0" * 100),
        "shorter than a header prefix": put_request(30, b"KVKB"),
    }
    before = client.stat(timeout=T)
    for name, request in cases.items():
        # Two requests on one connection: the refused one is consumed whole, so the next
        # request (a GET) is read in step and answered.
        get = encode_request(OP_GET, SCOPE, key.block_hash, b"")
        got = replies(exchange(address, request + get))
        assert [r.status for r, _ in got] == [RefusalReason.INVALID_ARGUMENT, OK], name
        assert got[1][0].result is False, name  # and nothing was stored
    assert client.lookup(SCOPE, [key.block_hash, block_key(31).block_hash],
                         timeout=T) == [False, False]
    after = client.stat(timeout=T)
    assert after.puts == before.puts
    assert after.invalid_puts - before.invalid_puts == len(cases)
    # Framing errors and oversized frames: refused, and the daemon closes the connection.
    over = encode_request(OP_PUT, SCOPE, key.block_hash, b"", body_len=MAX_FRAME_BYTES + 1)
    for request, status in [(over, RefusalReason.RESOURCE_EXHAUSTED),
                            (b"GET / HTTP/1.1\r\n" * 4, RefusalReason.INVALID_ARGUMENT)]:
        got = replies(exchange(address, request + encode_request(OP_GET, SCOPE, b"h", b"")))
        assert len(got) == 1 and got[0][0].status == status and got[0][0].close
    # A client that dies mid-body leaves nothing behind, and the daemon carries on.
    assert replies(exchange(address, put_request(30, frame)[:-1000])) == []
    assert client.lookup(SCOPE, [key.block_hash], timeout=T) == [False]
    assert client.put(SCOPE, [(key.block_hash, frame)], timeout=T) == [True]
    assert client.health(timeout=T) == "SERVING"


def test_lookups_travel_over_the_data_plane(daemon: DaemonProcess,
                                            client: DaemonClient) -> None:
    """A batched lookup is one data-plane round trip once blocks use the plane, and answers
    exactly as the gRPC lookup does (a client kept on gRPC asks the same daemon)."""
    keys = [block_key(i) for i in range(200, 260)]
    held = keys[::3]
    assert client.put(SCOPE, [(k.block_hash, make_frame(k)) for k in held], timeout=T) == \
        [True] * len(held)
    assert client.data_plane_address == data_address(daemon)
    over_grpc = DaemonClient(daemon.node_id, daemon.address, data_plane=False)
    try:
        asked = [k.block_hash for k in keys] * 50  # 3,000 hashes, duplicates included
        before = daemon.client().stat(timeout=T)
        present = client.lookup(SCOPE, asked, timeout=T)
        assert present == [k in held for k in keys] * 50
        assert over_grpc.lookup(SCOPE, asked, timeout=T) == present
        assert client.lookup(SCOPE, [b"\x01"], timeout=T) == [False]  # a 1-byte hash
        after = daemon.client().stat(timeout=T)
        assert after.lookups - before.lookups == 3
        transport = client.block_transport()
        assert isinstance(transport, TcpBlockTransport)
        assert transport.lookup(SCOPE, [held[0].block_hash], timeout=T) == [True]
        with pytest.raises(TierError):  # over the daemon's per-call limit: refused
            transport.lookup(SCOPE, [b"k"] * 70_000, timeout=T)
    finally:
        over_grpc.close()


def test_a_daemon_without_lookup_on_its_data_plane_is_asked_over_grpc(
        daemon: DaemonProcess) -> None:
    """A daemon of an older release answers LOOKUP as an unknown op (INVALID_ARGUMENT, then it
    closes the connection): the client asks it over gRPC from then on, and gets the answer."""
    key = block_key(270)
    assert daemon.client().put(SCOPE, [(key.block_hash, make_frame(key))], timeout=T) == [True]
    listener = socket.create_server(("127.0.0.1", 0))
    asked: list[int] = []

    def old_daemon() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            with sock:
                head = sock.recv(tp.REQUEST_HEAD.size, socket.MSG_WAITALL)
                if len(head) == tp.REQUEST_HEAD.size:
                    asked.append(head[5])
                    sock.sendall(encode_reply(RefusalReason.INVALID_ARGUMENT, close=True,
                                              message=f"bad request: unknown op {head[5]}"))

    thread = threading.Thread(target=old_daemon, daemon=True)
    thread.start()
    old = DaemonClient(daemon.node_id, daemon.address,
                       data_address=f"127.0.0.1:{listener.getsockname()[1]}")
    try:
        transport = old.block_transport()
        assert isinstance(transport, TcpBlockTransport)
        with pytest.raises(LookupUnsupported):
            transport.lookup(SCOPE, [key.block_hash], timeout=T)
        for _ in range(3):
            assert old.lookup(SCOPE, [key.block_hash, b"none"], timeout=T) == [True, False]
        assert asked == [OP_LOOKUP, OP_LOOKUP]  # the direct call, then the first lookup only
    finally:
        old.close()
        listener.close()
        thread.join(5)


def test_auth_and_tenants_on_the_data_plane(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A} tenant-a\n{TOKEN_B} tenant-b\n")
    d = start_daemon(tmp_path, "sec", token_file=tokens)
    try:
        port = DaemonClient("sec", d.address, token=TOKEN_A).stat(timeout=T).data_port
        address = f"127.0.0.1:{port}"
        key = block_key(40)
        frame = make_frame(key)
        for token in (None, "not-a-token-at-all-000", TOKEN_B):
            c = TcpBlockTransport("sec", address, token=token)
            with pytest.raises(ConfigError):
                c.put(SCOPE, [(key.block_hash, frame)], timeout=T)
            with pytest.raises(ConfigError):
                c.get(SCOPE, key.block_hash, timeout=T)
            with pytest.raises(ConfigError):
                c.lookup(SCOPE, [key.block_hash], timeout=T)
            with pytest.raises(ConfigError):  # not an unwell daemon (the breakers' kind)
                c.get_into(SCOPE, [(key.block_hash, None)] * 3, timeout=T)
            c.close()
        owner = DaemonClient("sec", d.address, token=TOKEN_A)
        assert owner.lookup(SCOPE, [key.block_hash], timeout=T) == [False]  # nothing stored
        assert owner.put(SCOPE, [(key.block_hash, frame)], timeout=T) == [True]
        assert owner.data_plane_address == address
        read = owner.get(SCOPE, key.block_hash, timeout=T)
        assert read is not None and read.to_frame() == frame
        assert owner.lookup(SCOPE, [key.block_hash], timeout=T) == [True]
        other = DaemonClient("sec", d.address, token=TOKEN_B)
        with pytest.raises(ConfigError):
            other.get(SCOPE, key.block_hash, timeout=T)
        # Refused for its scope (tenant-a's, with tenant-b's token) after its body was read:
        # the connection stays in step, and the token's own scope is answered on it.
        b_scope = Scope(FINGERPRINT.digest, Namespace("tenant-b", ""))
        b_transport = TcpBlockTransport("sec", address, token=TOKEN_B)
        for _ in range(2):
            with pytest.raises(ConfigError):
                b_transport.lookup(SCOPE, [key.block_hash], timeout=T)
            assert b_transport.lookup(b_scope, [key.block_hash], timeout=T) == [False]
            with pytest.raises(ConfigError):
                b_transport.get_into(SCOPE, [(key.block_hash, None)] * 3, timeout=T)
            assert b_transport.get_into(b_scope, [(key.block_hash, None)] * 3,
                                        timeout=T) == [None] * 3
        b_transport.close()
        # On the wire: a GET_MANY refused for its scope is answered once per hash and the
        # connection stays in step; one without a token is answered once, and closed.
        with socket.create_connection(("127.0.0.1", port), timeout=T) as sock:
            hashes = [key.block_hash, b"other", key.block_hash]
            send_parts(sock, encode_batch(OP_GET_MANY, SCOPE, hashes, TOKEN_B.encode()))
            assert [(h.status, h.close) for h, _, _ in read_replies(sock, 3)] == [
                (RefusalReason.PERMISSION_DENIED, False)] * 3
            send_parts(sock, encode_batch(OP_GET_MANY, SCOPE, hashes, TOKEN_A.encode()))
            assert [(h.status, h.result, len(data) > 0) for h, _, data in read_replies(
                sock, 3)] == [(OK, True, True), (OK, False, False), (OK, True, True)]
            send_parts(sock, encode_batch(OP_GET_MANY, SCOPE, hashes, b""))
            ((head, _, _),) = read_replies(sock, 1)
            assert (head.status, head.close) == (RefusalReason.UNAUTHENTICATED, True)
            assert sock.recv(1) == b""
        owner.close()
        other.close()
    finally:
        d.terminate()


def test_without_a_data_plane_everything_goes_over_grpc(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "nodp", extra=["--data-listen", "off"])
    try:
        c = d.client()
        assert c.stat(timeout=T).data_port == 0
        key = block_key(50)
        frame = make_frame(key)
        assert c.put(SCOPE, [(key.block_hash, frame)], timeout=T) == [True]
        read = c.get(SCOPE, key.block_hash, timeout=T)
        assert read is not None and read.to_frame() == frame
        assert c.data_plane_address is None
    finally:
        d.close_clients()
        d.terminate()


def test_an_unreachable_data_port_falls_back_to_grpc_then_recovers(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_client, "DATA_RETRY_S", 0.2)
    c = DaemonClient(daemon.node_id, daemon.address, data_address=f"127.0.0.1:{free_port()}")
    try:
        key = block_key(60)
        frame = make_frame(key)
        started = time.monotonic()
        assert c.put(SCOPE, [(key.block_hash, frame)], timeout=T) == [True]  # via gRPC
        read = c.get(SCOPE, key.block_hash, timeout=T)
        assert read is not None and read.to_frame() == frame
        assert time.monotonic() - started < T / 2  # a refused dial, not a timed-out call
        assert c.data_plane_address is None
        c.set_data_address(None)  # e.g. the daemon re-registered: ask Stat
        assert c.get(SCOPE, key.block_hash, timeout=T) is not None
        assert c.data_plane_address == data_address(daemon)
    finally:
        c.close()


def test_a_restarted_daemon_is_found_again(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon_client, "DATA_RETRY_S", 0.2)
    d = start_daemon(tmp_path, "again")
    try:
        c = d.client()
        key = block_key(70)
        frame = make_frame(key)
        assert c.put(SCOPE, [(key.block_hash, frame)], timeout=T) == [True]
        first = c.data_plane_address
        assert first is not None
        assert d.terminate() == 0  # drained: the block is on disk
        d.spawn()
        d.wait_healthy()
        # The pooled connection is dead and the port is new: this call still succeeds (gRPC).
        read = c.get(SCOPE, key.block_hash, timeout=T)
        assert read is not None and read.to_frame() == frame
        time.sleep(0.3)
        assert c.get(SCOPE, key.block_hash, timeout=T) is not None
        assert c.data_plane_address not in (None, first)
    finally:
        d.close_clients()
        d.terminate()


def test_a_put_in_flight_at_sigterm_finishes_and_new_ones_are_refused(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "drainer")
    try:
        address = data_address(d)
        key = block_key(80)
        frame = make_frame(key, layers=4, segment_bytes=1 << 20)
        request = put_request(80, frame)
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=T) as sock:
            sock.sendall(request[: len(request) // 2])
            time.sleep(0.2)  # the daemon is inside this request now
            assert d.proc is not None
            d.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            late = TcpBlockTransport("drainer", address)
            with pytest.raises(TierUnavailable):
                late.put(SCOPE, [(block_key(81).block_hash, make_frame(block_key(81)))],
                         timeout=T)
            late.close()
            sock.sendall(request[len(request) // 2:])
            got = replies(recv_all(sock))
            assert [(r.status, r.result) for r, _ in got] == [(OK, True)]
        assert d.proc.wait(30) == 0
        d.spawn()
        d.wait_healthy()
        c = d.client()
        read = c.get(SCOPE, key.block_hash, timeout=T)
        assert read is not None and read.to_frame() == frame
        assert c.get(SCOPE, block_key(81).block_hash, timeout=T) is None
    finally:
        d.close_clients()
        d.terminate()


def recv_all(sock: socket.socket) -> bytes:
    head = bytearray(REPLY_HEAD.size)
    recv_exact(sock, memoryview(head))
    reply = decode_reply_head(head)
    rest = bytearray(reply.message_len + reply.header_len + reply.payload_len)
    recv_exact(sock, memoryview(rest))
    return bytes(head + rest)


def test_a_call_past_its_deadline_raises_deadline_exceeded(daemon: DaemonProcess) -> None:
    c = TcpBlockTransport(daemon.node_id, data_address(daemon))
    key = block_key(90)
    with pytest.raises(DeadlineExceeded):
        c.put(SCOPE, [(key.block_hash, make_frame(key, segment_bytes=1 << 20))], timeout=1e-6)
    assert c.get(SCOPE, key.block_hash, timeout=T) is None  # the next call is in step
    c.close()


# -- fuzzing -----------------------------------------------------------------------------------


def _valid_requests() -> list[bytes]:
    key = block_key(100)
    frame = make_frame(key, layers=3, segment_bytes=256)
    return [put_request(100, frame),
            encode_request(OP_GET, SCOPE, key.block_hash, b"", layers=LayerRange(0, 2)),
            encode_request(OP_GET, SCOPE, key.block_hash, b""),
            b"".join(encode_batch(OP_LOOKUP, SCOPE, [key.block_hash, b"other"], b"")),
            b"".join(encode_batch(OP_GET_MANY, SCOPE, [b"other", key.block_hash], b"")),
            # A batch's blocks are stored independently: a base of two valid blocks, cut in
            # the second, stores the first. So one valid block, and two that never verify.
            put_many_request([(100, frame)]),
            put_many_request([(100, b"KVKB"), (101, frame[:-1])])]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_random_truncated_and_mutated_requests(daemon: DaemonProcess,
                                                    data: st.DataObject) -> None:
    address = data_address(daemon)
    base = data.draw(st.sampled_from(_valid_requests()))
    kind = data.draw(st.sampled_from(["random", "truncated", "mutated"]))
    if kind == "random":
        payload = data.draw(st.binary(max_size=300))
    elif kind == "truncated":
        payload = base[: data.draw(st.integers(0, len(base) - 1))]
    else:
        payload = bytearray(base)
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(payload) - 1))
            payload[at] ^= data.draw(st.integers(1, 255))
        payload = bytes(payload)
        assume(payload != base)  # two flips of one byte can cancel out
    stat = DaemonClient(daemon.node_id, daemon.address, data_plane=False)
    try:
        before = stat.stat(timeout=T)
        for head, _ in replies(exchange(address, payload)):  # whatever it answers parses
            assert head.status == OK or head.status in set(RefusalReason)
        after = stat.stat(timeout=T)
        assert after.puts == before.puts, "a broken request stored something"
        assert stat.lookup(SCOPE, [block_key(100).block_hash], timeout=T) == [False]
        assert stat.health(timeout=T) == "SERVING"
    finally:
        stat.close()
