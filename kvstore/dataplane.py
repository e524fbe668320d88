"""The bulk data plane of a kvstore daemon: block GET and PUT over plain TCP, beside gRPC.

Why. gRPC's Python stack moves one multi-MiB block per call at ~1.3-2 GB/s on these machines
(measured with pre-built messages and nothing else in the handlers), against ~3-4 GB/s for
loopback TCP and redis-py. So, like Mooncake's transfer engine and Redis itself, a daemon also
listens on a plain TCP port for the two bulk operations, and both ends move payloads with
`recv_into` preallocated buffers and `sendmsg` of memoryviews: one kernel copy each way, no
per-message objects. gRPC keeps everything else (lookup, delete, manifests, stat, health) and is
the fallback for bulk calls when a daemon has no data port (TLS on, `--data-listen off`, an older
daemon) or the port cannot be reached.

The daemon advertises the port in its etcd registration (`DaemonInfo.data_address`) and in its
Stat reply (`data_port`, on the host the client dialed for gRPC). Data-plane TCP is unencrypted:
a daemon started with TLS does not open it.

Protocol, version 1 (all integers little endian). A connection carries one request at a time:
the client writes a request and reads its reply, then may reuse the connection.

Request::

    head (44 bytes): magic b"KVDQ" | version u8 = 1 | op u8 (1 GET, 2 PUT) | token_len u16 |
                     tenant_len u8 | salt_len u8 | hash_len u8 | flags u8 (bit 0: layer range) |
                     layer_start u32 | layer_stop u32 | body_len u64 | fingerprint (16 bytes)
    token (token_len bytes, UTF-8; empty when the daemon runs without auth)
    tenant, salt (ASCII), block hash (hash_len bytes)
    body (body_len bytes): PUT: the whole frame; GET: nothing (body_len must be 0)

Reply::

    head (32 bytes): magic b"KVDR" | status u8 (a gRPC status code, 0 = OK) |
                     result u8 (GET: 1 found, 0 miss; PUT: 1 stored, 0 not admitted) |
                     flags u8 (bit 0: the daemon closes the connection after this reply) |
                     reserved u8 | message_len u32 | header_len u32 | layer_start u32 |
                     layer_stop u32 | payload_len u64
    message (message_len bytes, UTF-8: why, when status is not 0)
    frame header (header_len bytes; a GET hit only)
    payload (payload_len bytes: the segments of [layer_start, layer_stop), back to back)

Rules, the same as the gRPC service's (kvstore/daemon/service.py):

- Every request carries the bearer token; a missing or unknown one is UNAUTHENTICATED, another
  tenant's scope PERMISSION_DENIED. Nothing is read from or written to the store before both
  checks pass.
- Limits: token <= 4096 bytes, tenant and salt valid names, block hash 1-64 bytes, frames at
  most `MAX_FRAME_BYTES`. A PUT of a frame over the limit is RESOURCE_EXHAUSTED, as are puts
  beyond the daemon's in-flight byte budget.
- A PUT stores the frame only once all of it has arrived and it verifies (every segment's
  checksum, the header's, and the key binding); otherwise INVALID_ARGUMENT and nothing is
  stored. A client that disconnects mid-body leaves nothing behind.
- A draining daemon answers PUT with UNAVAILABLE and still serves GETs.
- A GET of a layer range sends the header and only the segments of that range. GET replies
  are unverified on arrival: the client checks every segment's checksum and the key binding
  before use (the daemon checks the key binding before sending and the checksums too, right
  after sending from RAM; it drops a copy that fails).
- A refused PUT whose declared size is within the limits has its body read and discarded, so the
  connection stays usable. A request that breaks the framing (bad magic, version, op, flags,
  lengths, fields that must be zero) is answered with the close flag set, and the daemon
  closes the connection. A daemon shutting down answers UNAVAILABLE with the close flag.

`DataPlaneClient` below is the client half; the daemon half is kvstore/daemon/dataplane.py.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvstore.errors import (
    ConfigError,
    CorruptBlock,
    DeadlineExceeded,
    KVKeepError,
    TierError,
    TierUnavailable,
)
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.tiers.base import Buffer
from kvstore.wire import MAX_FRAME_BYTES, Scope

__all__ = [
    "MAGIC_REQUEST",
    "MAGIC_REPLY",
    "VERSION",
    "OP_GET",
    "OP_PUT",
    "REQUEST_HEAD",
    "REPLY_HEAD",
    "FLAG_LAYERS",
    "FLAG_CLOSE",
    "MAX_TOKEN_BYTES",
    "MAX_HASH_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_HEADER_BYTES",
    "Status",
    "Request",
    "Reply",
    "DataPlaneClient",
    "DataPlaneUnreachable",
    "encode_request",
    "decode_request_head",
    "encode_reply",
    "decode_reply_head",
    "error_for_status",
    "recv_exact",
    "recv_into_pieces",
    "send_parts",
]

MAGIC_REQUEST = b"KVDQ"
MAGIC_REPLY = b"KVDR"
VERSION = 1
OP_GET = 1
OP_PUT = 2
FLAG_LAYERS = 1  # request: a layer range is given
FLAG_CLOSE = 1  # reply: the daemon closes the connection after this reply

REQUEST_HEAD = struct.Struct("<4sBBHBBBBIIQ16s")
REPLY_HEAD = struct.Struct("<4sBBBxIIIIQ")

MAX_TOKEN_BYTES = 4096
MAX_HASH_BYTES = 64
MAX_MESSAGE_BYTES = 64 << 10
MAX_HEADER_BYTES = 1 << 20
"""A frame header is at most 1 MiB whatever it claims (kvstore/frame.py)."""


class Status:
    """The gRPC status codes the data plane answers with (same numbers as grpc.StatusCode)."""

    OK = 0
    INVALID_ARGUMENT = 3
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16

    NAMES: ClassVar[dict[int, str]] = {
        0: "OK", 3: "INVALID_ARGUMENT", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
        13: "INTERNAL", 14: "UNAVAILABLE", 16: "UNAUTHENTICATED"}


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded request head plus the lengths of what follows it."""

    op: int
    token_len: int
    tenant_len: int
    salt_len: int
    hash_len: int
    layers: tuple[int, int] | None
    body_len: int
    fingerprint: bytes

    @property
    def tail_len(self) -> int:
        """Bytes between the head and the body: token, tenant, salt, block hash."""
        return self.token_len + self.tenant_len + self.salt_len + self.hash_len


@dataclass(frozen=True, slots=True)
class Reply:
    """A decoded reply head."""

    status: int
    result: bool
    close: bool
    message_len: int
    header_len: int
    layers: tuple[int, int]
    payload_len: int


class DataPlaneUnreachable(TierUnavailable):
    """The data port could not be connected to, or dropped the connection before any reply:
    gRPC may be tried instead (GET and PUT are idempotent)."""


def encode_request(op: int, scope: Scope, block_hash: bytes, token: bytes, *,
                   layers: LayerRange | None = None, body_len: int = 0) -> bytes:
    """The request head and its variable fields (everything but the body)."""
    tenant = scope.namespace.tenant.encode()
    salt = scope.namespace.salt.encode()
    start, stop = (layers.start, layers.stop) if layers is not None else (0, 0)
    head = REQUEST_HEAD.pack(MAGIC_REQUEST, VERSION, op, len(token), len(tenant), len(salt),
                             len(block_hash), FLAG_LAYERS if layers is not None else 0,
                             start, stop, body_len, scope.fingerprint)
    return b"".join((head, token, tenant, salt, block_hash))


def decode_request_head(raw: bytes | bytearray | memoryview) -> Request:
    """Parse a request head; raises ValueError when it breaks the framing or the limits."""
    (magic, version, op, token_len, tenant_len, salt_len, hash_len, flags, start, stop,
     body_len, fingerprint) = REQUEST_HEAD.unpack(raw)
    if magic != MAGIC_REQUEST:
        raise ValueError("bad request magic")
    if version != VERSION:
        raise ValueError(f"unsupported data plane version {version}")
    if op not in (OP_GET, OP_PUT):
        raise ValueError(f"unknown op {op}")
    if token_len > MAX_TOKEN_BYTES:
        raise ValueError(f"token of {token_len} bytes; at most {MAX_TOKEN_BYTES}")
    if not 1 <= hash_len <= MAX_HASH_BYTES:
        raise ValueError(f"block hash of {hash_len} bytes; 1-{MAX_HASH_BYTES} allowed")
    if flags & ~FLAG_LAYERS:
        raise ValueError(f"unknown request flags {flags:#x}")
    if not flags & FLAG_LAYERS and (start or stop):
        raise ValueError("layer fields set without the layer flag")
    if op == OP_GET and body_len:
        raise ValueError("a GET carries no body")
    if op == OP_PUT and flags & FLAG_LAYERS:
        raise ValueError("a PUT stores whole frames: no layer range")
    return Request(op, token_len, tenant_len, salt_len, hash_len,
                   (start, stop) if flags & FLAG_LAYERS else None, body_len, bytes(fingerprint))


def encode_reply(status: int, *, result: bool = False, close: bool = False, message: str = "",
                 header: bytes = b"", layers: tuple[int, int] = (0, 0),
                 payload_len: int = 0) -> bytes:
    """A reply head, its message and the frame header (the payload is sent after it)."""
    text = message.encode(errors="replace")[:MAX_MESSAGE_BYTES]
    head = REPLY_HEAD.pack(MAGIC_REPLY, status, int(result), FLAG_CLOSE if close else 0,
                           len(text), len(header), layers[0], layers[1], payload_len)
    return b"".join((head, text, header))


def decode_reply_head(raw: bytes | bytearray | memoryview) -> Reply:
    """Parse a reply head; raises CorruptBlock when it is not one (a confused or hostile peer)."""
    (magic, status, result, flags, message_len, header_len, start, stop,
     payload_len) = REPLY_HEAD.unpack(raw)
    if magic != MAGIC_REPLY:
        raise CorruptBlock("bad data plane reply magic")
    if message_len > MAX_MESSAGE_BYTES or header_len > MAX_HEADER_BYTES:
        raise CorruptBlock("data plane reply fields over their limits")
    if payload_len > MAX_FRAME_BYTES:
        raise CorruptBlock(f"data plane reply announces {payload_len} payload bytes")
    return Reply(status, bool(result), bool(flags & FLAG_CLOSE), message_len, header_len,
                 (start, stop), payload_len)


def error_for_status(status: int, what: str, message: str) -> KVKeepError:
    """The kvkeep exception for a refusal, exactly as the gRPC path maps the same status."""
    text = f"{what}: {Status.NAMES.get(status, str(status))}: {message}"
    if status in (Status.UNAUTHENTICATED, Status.PERMISSION_DENIED):
        return ConfigError(text)  # a missing or wrong token is a deployment mistake
    if status in (Status.UNAVAILABLE, Status.INTERNAL):
        return TierUnavailable(text)
    return TierError(text)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from `sock`; raises ConnectionError on EOF (socket timeouts propagate)."""
    pos, size = 0, len(view)
    while pos < size:
        n = sock.recv_into(view[pos:], size - pos)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        pos += n


def recv_into_pieces(sock: socket.socket, pieces: Sequence[memoryview]) -> None:
    """Fill every buffer of `pieces`, in order, from `sock` (scatter reads: one syscall may
    fill several); raises ConnectionError on EOF (socket timeouts propagate)."""
    views = [p for p in pieces if len(p)]
    i = 0
    while i < len(views):
        n = sock.recvmsg_into(views[i:i + _MAX_IOV])[0]
        if n == 0:
            raise ConnectionError("connection closed by peer")
        i = _advance(views, i, n)


def send_parts(sock: socket.socket, parts: Sequence[bytes | bytearray | memoryview]) -> None:
    """Send every byte of `parts` with as few syscalls as the kernel allows (no joining)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    i = 0
    while i < len(views):
        i = _advance(views, i, sock.sendmsg(views[i:i + _MAX_IOV]))


def _advance(views: list[memoryview], i: int, n: int) -> int:
    """Consume `n` bytes of views[i:]; returns the index of the first unfinished view (which is
    re-sliced to what is left of it)."""
    while n:
        head = views[i]
        if n >= len(head):
            n -= len(head)
            i += 1
        else:
            views[i] = head[n:]
            n = 0
    return i


_MAX_IOV = 512  # buffers per sendmsg call (Linux allows 1024)
# A pipelined put window: the replies of this many requests wait in the client's receive buffer
# (32 bytes each) while it sends, so a window must not outgrow that buffer.
_WINDOW_BLOCKS = 256
_WINDOW_BYTES = 64 << 20


def _flat(buf: bytes | Buffer) -> memoryview:
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise TierError("buffer is not C-contiguous")
        view = view.cast("B")
    return view


class DataPlaneClient:
    """GET/PUT of single blocks on one daemon's data port. Thread-safe: each call takes a
    pooled connection (or opens one) and gives it back only after a complete exchange; a
    connection that saw any error or timeout is closed, never reused."""

    def __init__(self, node_id: str, address: str, *, token: str | None = None,
                 max_idle: int = 8) -> None:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"data plane address {address!r} is not host:port")
        self.node_id = node_id
        self.address = address
        self._target = (host.strip("[]"), int(port))
        self._token = (token or "").encode()
        if len(self._token) > MAX_TOKEN_BYTES:
            raise ConfigError(f"token longer than {MAX_TOKEN_BYTES} bytes")
        self._max_idle = max_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def get(self, scope: Scope, block_hash: bytes, layers: LayerRange | None = None, *,
            out: Buffer | None = None, timeout: float) -> BlockRead | None:
        """One block (or the segments of `layers`), unverified; None on a miss.

        With `out` large enough, the payload is received straight into it."""
        request = encode_request(OP_GET, scope, block_hash, self._token, layers=layers)
        (result,) = self._exchange(f"get from {self.node_id}", OP_GET, [request], 1, out,
                                   time.monotonic() + timeout)
        assert not isinstance(result, bool)
        return result

    def put(self, scope: Scope, block_hash: bytes, frame: bytes | bytearray | memoryview, *,
            timeout: float) -> bool:
        """Store one whole frame; True when stored (or already present), False when the daemon
        did not admit it. Raises on refusals and transport errors."""
        return self.put_many(scope, [(block_hash, frame)], timeout=timeout)[0]

    def put_many(self, scope: Scope,
                 blocks: Sequence[tuple[bytes, bytes | bytearray | memoryview]], *,
                 timeout: float) -> list[bool]:
        """Store whole frames, pipelined: a window of requests goes out back to back and then
        its replies are read, so a batch of small blocks costs one round trip per window, not
        per block. One flag per block; raises the first refusal (after the rest of its window
        was answered: each block is stored whole or not at all, independently)."""
        what = f"put to {self.node_id}"
        deadline = time.monotonic() + timeout
        done: list[bool] = []
        window: list[bytes | memoryview] = []
        count = size = 0
        for i, (block_hash, frame) in enumerate(blocks):
            view = _flat(frame)
            if len(view) > MAX_FRAME_BYTES:
                raise TierError(f"{what}: RESOURCE_EXHAUSTED: frame of {len(view)} bytes "
                                f"exceeds {MAX_FRAME_BYTES}")
            window += [encode_request(OP_PUT, scope, block_hash, self._token,
                                      body_len=len(view)), view]
            count, size = count + 1, size + len(view)
            if count == _WINDOW_BLOCKS or size >= _WINDOW_BYTES or i == len(blocks) - 1:
                results = self._exchange(what, OP_PUT, window, count, None, deadline)
                done.extend(r is True for r in results)
                window, count, size = [], 0, 0
        return done

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # -- private ------------------------------------------------------------------------------

    def _exchange(self, what: str, op: int, parts: list[bytes | memoryview], count: int,
                  out: Buffer | None, deadline: float) -> list[BlockRead | bool | None]:
        # A pooled connection may have been closed by a restarted daemon; that shows only when
        # it is used. Such a failure before any reply byte arrived is retried once on a fresh
        # connection (GET and PUT are both idempotent).
        for attempt in range(2):
            sock, reused = self._connection(what, deadline)
            keep = False
            try:
                results, keep = self._on(sock, what, op, parts, count, out, deadline)
                return results
            except _Refusal as refusal:
                keep = refusal.keep
                raise refusal.error from None
            except _Stale as exc:
                if reused and attempt == 0:
                    continue
                # Dropped before any reply (a daemon at its connection limit, or going away):
                # the caller may try gRPC instead (both operations are idempotent).
                raise DataPlaneUnreachable(f"{what}: connection dropped before a reply: "
                                           f"{exc.__cause__}") from exc
            finally:
                if keep:
                    self._release(sock)
                else:
                    sock.close()
        raise AssertionError("unreachable")

    def _on(self, sock: socket.socket, what: str, op: int, parts: list[bytes | memoryview],
            count: int, out: Buffer | None, deadline: float
            ) -> tuple[list[BlockRead | bool | None], bool]:
        """Send `count` requests, read their replies: (results, whether the connection may be
        reused). A refusal is raised as _Refusal once every reply was read."""
        head = bytearray(REPLY_HEAD.size)
        try:
            sock.settimeout(_remaining(what, deadline))
            send_parts(sock, parts)
            sock.settimeout(_remaining(what, deadline))
            n = sock.recv_into(head)
            if n == 0:
                raise ConnectionError("connection closed by peer")
        except TimeoutError as exc:  # DeadlineExceeded included
            raise DeadlineExceeded(f"{what}: deadline passed") from exc
        except OSError as exc:
            raise _Stale() from exc
        results: list[BlockRead | bool | None] = []
        refused: KVKeepError | None = None
        keep = True
        try:
            for i in range(count):
                if i:
                    n = 0
                sock.settimeout(_remaining(what, deadline))
                if n < len(head):
                    recv_exact(sock, memoryview(head)[n:])
                reply = decode_reply_head(head)
                message = self._read(sock, reply.message_len, what, deadline)
                keep = not reply.close
                if reply.close and i < count - 1:
                    refused = refused or TierUnavailable(
                        f"{what}: the daemon closed the connection after {i + 1} of {count} "
                        f"replies: {message.decode(errors='replace')}")
                if reply.status != Status.OK:
                    refused = refused or error_for_status(reply.status, what,
                                                          message.decode(errors="replace"))
                    if reply.close or reply.header_len or reply.payload_len:
                        raise _Refusal(refused, False)
                    results.append(None)
                elif op == OP_PUT:
                    if reply.header_len or reply.payload_len:
                        raise CorruptBlock(f"{what}: a put reply carrying data")
                    results.append(reply.result)
                else:
                    results.append(self._block(sock, reply, what, out, deadline))
                if not keep:
                    break
            if refused is not None:
                raise _Refusal(refused, keep)
            return results, keep
        except TimeoutError as exc:  # DeadlineExceeded included
            raise DeadlineExceeded(f"{what}: deadline passed") from exc
        except OSError as exc:  # ConnectionError included
            raise TierUnavailable(f"{what}: connection lost: {exc}") from exc

    def _block(self, sock: socket.socket, reply: Reply, what: str, out: Buffer | None,
               deadline: float) -> BlockRead | None:
        """The rest of a GET reply: None on a miss, else the header and the payload."""
        if not reply.result:
            if reply.header_len or reply.payload_len:
                raise CorruptBlock(f"{what}: a miss carrying data")
            return None
        raw_header = self._read(sock, reply.header_len, what, deadline)
        try:
            header = FrameHeader.unpack(raw_header)
            layers = LayerRange(*reply.layers)
            start, stop = header.span(layers)
        except ValueError as exc:  # InvalidFrame is a ValueError too
            raise CorruptBlock(f"{what}: bad header in reply: {exc}") from exc
        if reply.payload_len != stop - start:
            raise CorruptBlock(f"{what}: payload of {reply.payload_len} bytes for a span "
                               f"of {stop - start}")
        size = reply.payload_len
        dst = _flat(out) if out is not None else None
        if dst is not None and not dst.readonly and len(dst) >= size:
            payload: memoryview = dst[:size]
        else:
            payload = memoryview(bytearray(size))
        sock.settimeout(_remaining(what, deadline))
        recv_exact(sock, payload)
        return BlockRead(header, layers, payload)

    def _read(self, sock: socket.socket, size: int, what: str, deadline: float) -> bytes:
        if not size:
            return b""
        buf = bytearray(size)
        sock.settimeout(_remaining(what, deadline))
        recv_exact(sock, memoryview(buf))
        return bytes(buf)

    def _connection(self, what: str, deadline: float) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._closed:
                raise TierUnavailable(f"{what}: client closed")
            if self._idle:
                return self._idle.pop(), True
        connect_timeout = _remaining(what, deadline)
        try:
            sock = socket.create_connection(self._target, timeout=connect_timeout)
        except TimeoutError as exc:
            raise DataPlaneUnreachable(f"{what}: connecting to {self.address} timed out") from exc
        except OSError as exc:
            raise DataPlaneUnreachable(f"{what}: cannot connect to {self.address}: {exc}"
                                       ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(sock)
                return
        sock.close()


class _Stale(Exception):
    """Sending the request or reading the first reply byte failed (the cause is chained)."""


class _Refusal(Exception):
    """The daemon refused the request: the error to raise, and whether the connection is
    still in step (reusable)."""

    def __init__(self, error: KVKeepError, keep: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.keep = keep


def _remaining(what: str, deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(f"{what}: deadline passed")
    return left
