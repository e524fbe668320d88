"""One real daemon (a subprocess): round trips, layer-range reads, limits, malformed input, drain.

The daemon runs without etcd here; clustering is in test_remote_tier*.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deploy.local.daemons import DaemonProcess, start_daemon
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc
from kvstore.errors import TierUnavailable
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.keys import BlockKey, Namespace
from kvstore.manifest import SessionManifest
from kvstore.net.daemon_client import DaemonClient
from kvstore.net.grpc_messages import scope_to_pb
from kvstore.net.limits import MAX_FRAME_BYTES, MAX_KEYS_PER_CALL, MAX_MESSAGE_BYTES
from kvstore.net.scope import scope_of
from tests.blockframes import FINGERPRINT, block_key, corrupt, make_frame, session_key

T = 10.0  # generous per-call timeout on a loaded 2-core machine


def raw_stub(daemon: DaemonProcess, max_send: int = MAX_MESSAGE_BYTES
             ) -> kvstore_pb2_grpc.KVStoreStub:
    channel = grpc.insecure_channel(daemon.address, options=[
        ("grpc.max_send_message_length", max_send),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
    return kvstore_pb2_grpc.KVStoreStub(channel)


def put_stream(key: BlockKey, frame: bytes, *, size: int | None = None,
               chunk: int = 1 << 20) -> Iterator[pb.PutChunk]:
    for start in range(0, len(frame), chunk):
        msg = pb.PutChunk(data=frame[start:start + chunk])
        if start == 0:
            msg.scope.CopyFrom(scope_to_pb(scope_of(key)))
            msg.block_hash = key.block_hash
            msg.frame_size = len(frame) if size is None else size
        yield msg


def test_round_trip_blocks_and_batches(client: DaemonClient) -> None:
    keys = [block_key(i) for i in range(1000, 1020)]
    frames = [make_frame(k, layers=6, segment_bytes=3000 + i) for i, k in enumerate(keys)]
    scope = scope_of(keys[0])
    assert client.put(scope, [(k.block_hash, f) for k, f in zip(keys, frames, strict=True)],
                      timeout=T) == [True] * len(keys)
    for key, frame in zip(keys, frames, strict=True):
        read = client.get(scope, key.block_hash, timeout=T)
        assert read is not None
        read.verify()
        read.verify_key(key.digest)
        assert read.to_frame() == frame
    many = client.get_many(scope, [keys[0].block_hash, b"absent", keys[5].block_hash], timeout=T)
    assert many[1] is None
    assert many[0] is not None and many[0].to_frame() == frames[0]
    assert many[2] is not None and many[2].to_frame() == frames[5]
    assert client.lookup(scope, [k.block_hash for k in keys[:3]] + [b"absent"], timeout=T) == [
        True, True, True, False]
    assert client.delete(scope, [keys[0].block_hash, b"absent"], timeout=T) == 1
    assert client.get(scope, keys[0].block_hash, timeout=T) is None


def test_large_block_streams_in_chunks_into_caller_buffer(client: DaemonClient) -> None:
    key = block_key(2000)
    frame = make_frame(key, layers=4, segment_bytes=3 << 20)  # 12 MiB: several chunks
    scope = scope_of(key)
    assert client.put(scope, [(key.block_hash, frame)], timeout=T) == [True]
    out = bytearray(len(frame))
    read = client.get(scope, key.block_hash, out=out, timeout=T)
    assert read is not None
    assert isinstance(read.payload, memoryview) and read.payload.obj is out
    read.verify()
    assert read.to_frame() == frame


def test_layer_range_sends_only_those_segments(client: DaemonClient) -> None:
    key = block_key(3000)
    frame = make_frame(key, layers=16, segment_bytes=64 << 10)
    scope = scope_of(key)
    client.put(scope, [(key.block_hash, frame)], timeout=T)
    header = FrameHeader.unpack(frame)
    for layers in (LayerRange(0, 1), LayerRange(5, 9), LayerRange(15, 16)):
        before = client.stat(timeout=T).get_bytes_sent
        read = client.get(scope, key.block_hash, layers, timeout=T)
        sent = client.stat(timeout=T).get_bytes_sent - before
        start, stop = header.span(layers)
        assert sent == stop - start == len(read.payload)  # type: ignore[union-attr]
        assert read is not None and read.layers == layers
        read.verify()
        full = BlockRead.from_frame(frame, layers)
        for layer in range(layers.start, layers.stop):
            assert bytes(read.segment(layer)) == bytes(full.segment(layer))
    # A range past the block's layers cannot be served: a miss, never a partial answer.
    assert client.get(scope, key.block_hash, LayerRange(10, 17), timeout=T) is None


def test_manifests_round_trip_and_generations(client: DaemonClient) -> None:
    key = session_key("sess-1")
    m1 = SessionManifest(key, (block_key(1).block_hash,), token_count=16, generation=1)
    m2 = SessionManifest(key, (block_key(1).block_hash, block_key(2).block_hash),
                         token_count=32, generation=2)
    assert client.get_manifest(key, timeout=T) is None
    client.put_manifest(m2, timeout=T)
    client.put_manifest(m1, timeout=T)  # stale: must not roll the session back
    got = client.get_manifest(key, timeout=T)
    assert got is not None and got.generation == 2 and got.block_hashes == m2.block_hashes
    assert client.delete_manifest(key, timeout=T)
    assert client.get_manifest(key, timeout=T) is None


def _code(call: object) -> grpc.StatusCode:
    try:
        if callable(call):
            call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_malformed_puts_are_refused_and_store_nothing(daemon: DaemonProcess,
                                                      client: DaemonClient) -> None:
    stub = raw_stub(daemon)
    before = client.stat(timeout=T)
    key = block_key(4000)
    good = make_frame(key, layers=4, segment_bytes=4096)
    other = block_key(4001)
    cases = {
        "bit flip": list(put_stream(key, corrupt(good))),
        "bound to another key": list(put_stream(key, make_frame(other))),
        "truncated stream": list(put_stream(key, good, chunk=4096))[:-1],
        "more bytes than announced": list(put_stream(key, good + b"x")),
        "announced size beyond the frame": list(put_stream(key, good, size=len(good) + 10)),
        "garbage": list(put_stream(key, b"\x00" * 5000)),
        "no scope": [pb.PutChunk(block_hash=key.block_hash, frame_size=10, data=b"x" * 10)],
        "data before a block": [pb.PutChunk(scope=scope_to_pb(scope_of(key)), data=b"x")],
        "bad block hash": [pb.PutChunk(scope=scope_to_pb(scope_of(key)), block_hash=b"h" * 65,
                                       frame_size=100, data=b"x" * 100)],
        "bad tenant": [pb.PutChunk(scope=pb.Scope(fingerprint=FINGERPRINT.digest,
                                                  tenant="../etc"),
                                   block_hash=b"h", frame_size=100, data=b"x" * 100)],
    }
    for name, messages in cases.items():
        code = _code(lambda m=messages: stub.Put(iter(m), timeout=T))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, name
    assert client.lookup(scope_of(key), [key.block_hash], timeout=T) == [False]
    # Not one partial block was stored, and the daemon still serves.
    after = client.stat(timeout=T)
    assert after.puts == before.puts
    assert after.invalid_puts >= before.invalid_puts + len(cases) - 2
    assert client.put(scope_of(key), [(key.block_hash, good)], timeout=T) == [True]


def test_size_limits_are_enforced(daemon: DaemonProcess, client: DaemonClient) -> None:
    key = block_key(5000)
    scope = scope_of(key)
    big = raw_stub(daemon, max_send=64 << 20)
    # A message over the limit: refused by gRPC on the daemon's side.
    oversized = pb.PutChunk(scope=scope_to_pb(scope), block_hash=key.block_hash,
                            frame_size=MAX_MESSAGE_BYTES + 10,
                            data=b"\0" * (MAX_MESSAGE_BYTES + 10))
    assert _code(lambda: big.Put(iter([oversized]), timeout=T)) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    # A frame announced bigger than any block may be.
    huge = pb.PutChunk(scope=scope_to_pb(scope), block_hash=key.block_hash,
                       frame_size=MAX_FRAME_BYTES + 1, data=b"\0")
    assert _code(lambda: big.Put(iter([huge]), timeout=T)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    many = pb.LookupRequest(scope=scope_to_pb(scope),
                            block_hashes=[b"k"] * (MAX_KEYS_PER_CALL + 1))
    assert _code(lambda: big.Lookup(many, timeout=T)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.lookup(scope, [key.block_hash], timeout=T) == [False]
    assert client.health(timeout=T) == "SERVING"


def test_namespaces_are_separate(client: DaemonClient) -> None:
    key_a = block_key(6000)
    key_b = block_key(6000, Namespace("tenant-b"))
    client.put(scope_of(key_a), [(key_a.block_hash, make_frame(key_a))], timeout=T)
    assert client.lookup(scope_of(key_b), [key_b.block_hash], timeout=T) == [False]
    assert client.get(scope_of(key_b), key_b.block_hash, timeout=T) is None


def test_restart_serves_what_the_disk_holds_and_drain_refuses_puts(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "drainer")
    try:
        c = d.client()
        keys = [block_key(i) for i in range(7000, 7010)]
        scope = scope_of(keys[0])
        frames = {k: make_frame(k, layers=4, segment_bytes=2 << 20) for k in keys}
        c.put(scope, [(k.block_hash, f) for k, f in frames.items()], timeout=T)
        # Drain while a slow put stream is in flight: the stream finishes, new puts are refused.
        slow_key = block_key(7100)
        slow_frame = make_frame(slow_key, layers=4, segment_bytes=2 << 20)
        stub = raw_stub(d)
        started = threading.Event()

        received_before = c.stat(timeout=T).put_bytes_received

        def slow_chunks() -> Iterator[pb.PutChunk]:
            for i, msg in enumerate(put_stream(slow_key, slow_frame, chunk=1 << 20)):
                if i == 1:
                    # Hold the stream open until the daemon has taken its first chunk.
                    end = time.monotonic() + 10
                    while (c.stat(timeout=T).put_bytes_received == received_before
                           and time.monotonic() < end):
                        time.sleep(0.02)
                    started.set()
                    time.sleep(1.0)
                yield msg

        result: dict[str, object] = {}
        worker = threading.Thread(target=lambda: result.update(
            reply=stub.Put(slow_chunks(), timeout=30)))
        worker.start()
        assert started.wait(10)
        assert d.proc is not None
        d.proc.send_signal(15)
        time.sleep(0.3)
        with pytest.raises(TierUnavailable):
            c.put(scope, [(keys[0].block_hash, frames[keys[0]])], timeout=T)
        worker.join(30)
        assert isinstance(result.get("reply"), pb.PutReply)
        assert list(result["reply"].status) == [pb.PUT_STATUS_STORED]  # type: ignore[attr-defined]
        assert d.proc.wait(30) == 0
        d.close_clients()
        # Restart on the same data dir: everything acknowledged is served from disk.
        d.spawn()
        d.wait_healthy()
        c = d.client()
        for key, frame in [*frames.items(), (slow_key, slow_frame)]:
            read = c.get(scope, key.block_hash, timeout=T)
            assert read is not None and read.to_frame() == frame
    finally:
        d.close_clients()
        d.terminate()
