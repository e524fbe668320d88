"""The TCP data plane's protocol: block GET, PUT and LOOKUP over plain TCP, beside gRPC.

Why. gRPC's Python stack moves one multi-MiB block per call at ~1.3-1.6 GB/s on these machines
even with pre-built messages, nothing else in the handlers and tuned options, against ~3-4 GB/s
for loopback TCP and redis-py. So, like Mooncake's transfer engine and Redis itself, a daemon
also listens on a plain TCP port for the two bulk operations, and both ends move payloads with
`recv_into` preallocated buffers (or the host tier's own pages) and `sendmsg` of memoryviews:
one kernel copy each way, no per-message objects. Measured against tuned gRPC in one run of
benchmarks/remote.py (ABBA rounds): 4 MiB blocks ~2.8x faster to get and ~2x to put on a quiet
machine, at a third to a half of gRPC's CPU per byte on both ends together. LOOKUP is here
too: a batched lookup is a small call on every request's critical path (the vLLM connector's
scheduler half, LMCache's lookup-and-lock), and a gRPC round trip costs ~3x this plane's on
these machines (measured with `benchmarks.remote`'s lookup row). gRPC keeps everything else
(delete, manifests, stat, health) and is the block transport when a
daemon has no data port (TLS on, `--data-listen off`, an older daemon) or the port cannot be
reached.

The daemon advertises the port in its etcd registration (`DaemonInfo.data_address`) and in its
Stat reply (`data_port`, on the host the client dialed for gRPC). Data-plane TCP is unencrypted:
a daemon started with TLS does not open it.

Protocol, version 1 (all integers little endian). A connection carries one request at a time:
the client writes a request and reads its reply, then may reuse the connection.

Request::

    head (44 bytes): magic b"KVDQ" | version u8 = 1 |
                     op u8 (1 GET, 2 PUT, 3 LOOKUP, 4 GET_MANY, 5 PUT_MANY) |
                     token_len u16 |
                     tenant_len u8 | salt_len u8 | hash_len u8 | flags u8 (bit 0: layer range) |
                     layer_start u32 | layer_stop u32 | body_len u64 | fingerprint (16 bytes)
    token (token_len bytes, UTF-8; empty when the daemon runs without auth)
    tenant, salt (ASCII), block hash (hash_len bytes; LOOKUP, GET_MANY, PUT_MANY: none,
                                      hash_len 0)
    body (body_len bytes): PUT: the whole frame; GET: nothing (body_len must be 0);
                           LOOKUP, GET_MANY: the block hashes, each as length u8 | hash
                           (1-64 bytes), at most MAX_KEYS_PER_CALL of them;
                           PUT_MANY: 1-MAX_PUT_MANY_BLOCKS blocks, each an item head
                           (73 bytes: frame_len u64 | hash_len u8 | hash, zero-padded to 64)
                           then its whole frame; the items fill body_len exactly

Reply::

    head (32 bytes): magic b"KVDR" | status u8 (0 = OK, else a RefusalReason, numbered as
                     gRPC status codes: kvstore/net/refusal.py) |
                     result u8 (GET: 1 found, 0 miss; PUT: 1 stored, 0 not admitted) |
                     flags u8 (bit 0: the daemon closes the connection after this reply) |
                     reserved u8 | message_len u32 | header_len u32 | layer_start u32 |
                     layer_stop u32 | payload_len u64
    message (message_len bytes, UTF-8: why, when status is not 0)
    frame header (header_len bytes; a GET hit only)
    payload (payload_len bytes: the segments of [layer_start, layer_stop), back to back;
             LOOKUP: one byte per hash asked, 1 held, 0 not, result 1)

GET_MANY is a batch of whole-block GETs in one request: its reply is one GET reply per hash,
in the order asked (each its own hit, miss or refusal), so a client reads it exactly as it
reads the replies of as many pipelined GETs. A refusal of the whole request (its scope, its
tenant's read streams) is repeated in every reply; one that ends the connection (no token,
an unknown one, a daemon shutting down) is sent once, with the close flag. Why: the daemon
spends ~0.16 ms of Python per GET whatever the block's size (parsing, authenticating, budgets,
metrics, one sendmsg each: measured with 1 KiB blocks), as much as moving a 256 KiB block;
a batch pays that once and sends several blocks' replies per sendmsg. A daemon that predates
it answers "unknown op" (INVALID_ARGUMENT, close), and its clients send single GETs again.

PUT_MANY is a batch of PUTs in one request, answered with one PUT reply per block, in order,
all sent together once the last block is in. Each block is admitted, received, verified and
stored (or refused) on its own, exactly as a PUT; a refused block's frame is read and dropped
so the batch stays in step. A refusal of the whole request (no token, an unknown one, another
tenant's scope, a draining daemon), a frame too big to drop, or items that do not fill the body
are answered once, with the close flag (after the replies of the blocks already taken). Why: a
PUT costs the daemon a fixed share of Python and system calls whatever the block's size (the
head, the token and scope, the budgets, one ack sendmsg each: a fifth of its connection
thread's time went to sending acks at 256 KiB, measured with py-spy), and the client one reply
read per block; a batch pays the request's share once. A daemon that predates it answers
"unknown op" (INVALID_ARGUMENT, close), and its clients send pipelined single PUTs again.

Rules, the same as over gRPC: both fronts ask the daemon's one core (kvstore/daemon/core.py):

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
- A refused PUT whose declared size is at most 64 MiB (a client's pipelining window) has its
  body read and discarded, so the connection stays usable; a bigger one is answered with the
  close flag set (its body is never read). A request that breaks the framing (bad magic,
  version, op, flags, lengths, fields that must be zero) is answered with the close flag set,
  and the daemon closes the connection; so is a GET_MANY whose body does not parse (the count
  of replies it is owed is unknown). A missing or unknown token is answered with the close
  flag set too, as is everything by a daemon shutting down (UNAVAILABLE).
- Slow clients (slowloris): a connection must send an authenticated request within a few
  seconds of opening, and each request's head must arrive within a bound however slowly it
  trickles; authenticated connections may idle a while (`--idle-timeout`); a PUT's body must
  arrive by a deadline (`--put-idle-timeout` between bytes, kvstore/daemon/budgets.py overall).

The client half is kvstore/net/tcp_transport.py; the daemon half is kvstore/daemon/tcp_front.py.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import CorruptBlock
from kvstore.frame import LayerRange
from kvstore.net.limits import MAX_FRAME_BYTES, MAX_KEYS_PER_CALL
from kvstore.net.refusal import OK
from kvstore.net.scope import Scope

__all__ = [
    "MAGIC_REQUEST",
    "MAGIC_REPLY",
    "VERSION",
    "OP_GET",
    "OP_PUT",
    "OP_LOOKUP",
    "OP_GET_MANY",
    "OP_PUT_MANY",
    "BATCH_OPS",
    "PUT_ITEM_HEAD",
    "MAX_PUT_MANY_BLOCKS",
    "encode_put_many",
    "decode_put_item",
    "MAX_BATCH_BODY_BYTES",
    "encode_batch",
    "decode_batch_body",
    "OK",
    "REQUEST_HEAD",
    "REPLY_HEAD",
    "FLAG_LAYERS",
    "FLAG_CLOSE",
    "MAX_TOKEN_BYTES",
    "MAX_HASH_BYTES",
    "MAX_REPLY_TEXT_BYTES",
    "MAX_HEADER_BYTES",
    "Request",
    "Reply",
    "encode_request",
    "decode_request_head",
    "encode_reply",
    "decode_reply_head",
    "recv_exact",
    "recv_into_pieces",
    "recv_whole",
    "send_parts",
]

MAGIC_REQUEST = b"KVDQ"
MAGIC_REPLY = b"KVDR"
VERSION = 1
OP_GET = 1
OP_PUT = 2
OP_LOOKUP = 3
OP_GET_MANY = 4
OP_PUT_MANY = 5
BATCH_OPS = (OP_LOOKUP, OP_GET_MANY)
"""The ops that carry their block hashes in their body."""
FLAG_LAYERS = 1  # request: a layer range is given
FLAG_CLOSE = 1  # reply: the daemon closes the connection after this reply

REQUEST_HEAD = struct.Struct("<4sBBHBBBBIIQ16s")
REPLY_HEAD = struct.Struct("<4sBBBxIIIIQ")

MAX_TOKEN_BYTES = 4096
MAX_HASH_BYTES = 64
MAX_REPLY_TEXT_BYTES = 64 << 10
MAX_BATCH_BODY_BYTES = MAX_KEYS_PER_CALL * (1 + 64)
MAX_HEADER_BYTES = 1 << 20
"""A frame header is at most 1 MiB whatever it claims (kvstore/frame.py)."""
PUT_ITEM_HEAD = struct.Struct("<QB64s")
"""A PUT_MANY block's head: frame length, hash length, the hash zero-padded to 64 bytes (one
fixed size, so the daemon reads it together with the previous block's frame)."""
MAX_PUT_MANY_BLOCKS = 256
_MAX_PUT_MANY_BODY = MAX_PUT_MANY_BLOCKS * (PUT_ITEM_HEAD.size + MAX_FRAME_BYTES)

_MAX_IOV = 512  # buffers per sendmsg call (Linux allows 1024)
_TIMEVAL = struct.Struct("@ll")  # struct timeval, for SO_RCVTIMEO


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
    if op not in (OP_GET, OP_PUT, OP_PUT_MANY, *BATCH_OPS):
        raise ValueError(f"unknown op {op}")
    if token_len > MAX_TOKEN_BYTES:
        raise ValueError(f"token of {token_len} bytes; at most {MAX_TOKEN_BYTES}")
    if op == OP_PUT_MANY:
        if hash_len or flags or start or stop:
            raise ValueError("a PUT_MANY carries its hashes in its body, and no flags or "
                             "layers")
        if not PUT_ITEM_HEAD.size < body_len <= _MAX_PUT_MANY_BODY:
            raise ValueError(f"a PUT_MANY body of {body_len} bytes")
        return Request(op, token_len, tenant_len, salt_len, 0, None, body_len,
                       bytes(fingerprint))
    if op in BATCH_OPS:
        if hash_len or flags or start or stop:
            raise ValueError("a LOOKUP or GET_MANY carries its hashes in its body, and no "
                             "flags or layers")
        if not 2 <= body_len <= MAX_BATCH_BODY_BYTES:
            raise ValueError(f"a batch body of {body_len} bytes; 2-{MAX_BATCH_BODY_BYTES}")
        return Request(op, token_len, tenant_len, salt_len, 0, None, body_len,
                       bytes(fingerprint))
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


def encode_batch(op: int, scope: Scope, block_hashes: Sequence[bytes], token: bytes
                 ) -> list[bytes]:
    """A LOOKUP or GET_MANY request: its head (with scope and token) and its body of hashes."""
    if op not in BATCH_OPS:
        raise ValueError(f"op {op} carries no batch of hashes")
    if not block_hashes or len(block_hashes) > MAX_KEYS_PER_CALL:
        raise ValueError(f"a batch asks 1-{MAX_KEYS_PER_CALL} hashes, not {len(block_hashes)}")
    body = bytearray()
    for block_hash in block_hashes:
        if not 1 <= len(block_hash) <= MAX_HASH_BYTES:
            raise ValueError(f"block hash of {len(block_hash)} bytes; 1-{MAX_HASH_BYTES}")
        body.append(len(block_hash))
        body += block_hash
    return [_body_request_head(op, scope, token, len(body)), bytes(body)]


def decode_batch_body(body: bytes | bytearray | memoryview) -> list[bytes]:
    """The hashes of a LOOKUP or GET_MANY body; raises ValueError when the lengths do not add
    up."""
    view = memoryview(body)
    hashes: list[bytes] = []
    pos = 0
    while pos < len(view):
        size = view[pos]
        if not 1 <= size <= MAX_HASH_BYTES or pos + 1 + size > len(view):
            raise ValueError(f"a hash of {size} bytes at offset {pos}")
        hashes.append(bytes(view[pos + 1:pos + 1 + size]))
        pos += 1 + size
        if len(hashes) > MAX_KEYS_PER_CALL:
            raise ValueError(f"more than {MAX_KEYS_PER_CALL} hashes in one batch")
    return hashes


def encode_put_many(scope: Scope, blocks: Sequence[tuple[bytes, memoryview]], token: bytes
                    ) -> list[bytes | memoryview]:
    """A PUT_MANY request: its head (with scope and token), then each block's item head and
    frame (the frames are not copied)."""
    if not 1 <= len(blocks) <= MAX_PUT_MANY_BLOCKS:
        raise ValueError(f"a PUT_MANY carries 1-{MAX_PUT_MANY_BLOCKS} blocks, not {len(blocks)}")
    parts: list[bytes | memoryview] = [b""]
    body_len = 0
    for block_hash, frame in blocks:
        if not 1 <= len(block_hash) <= MAX_HASH_BYTES:
            raise ValueError(f"block hash of {len(block_hash)} bytes; 1-{MAX_HASH_BYTES}")
        parts += [PUT_ITEM_HEAD.pack(len(frame), len(block_hash), block_hash), frame]
        body_len += PUT_ITEM_HEAD.size + len(frame)
    parts[0] = _body_request_head(OP_PUT_MANY, scope, token, body_len)
    return parts


def _body_request_head(op: int, scope: Scope, token: bytes, body_len: int) -> bytes:
    """The head, token, tenant and salt of a request whose hashes are in its body."""
    tenant = scope.namespace.tenant.encode()
    salt = scope.namespace.salt.encode()
    head = REQUEST_HEAD.pack(MAGIC_REQUEST, VERSION, op, len(token), len(tenant), len(salt),
                             0, 0, 0, 0, body_len, scope.fingerprint)
    return b"".join((head, token, tenant, salt))


def decode_put_item(raw: bytes | bytearray | memoryview) -> tuple[int, bytes]:
    """A PUT_MANY item head: (frame length, block hash); ValueError when it breaks the
    framing (a hash length out of range, padding that is not zero)."""
    frame_len, hash_len, padded = PUT_ITEM_HEAD.unpack(raw)
    if not 1 <= hash_len <= MAX_HASH_BYTES or any(padded[hash_len:]):
        raise ValueError(f"a PUT_MANY item with a hash of {hash_len} bytes")
    return frame_len, bytes(padded[:hash_len])


def encode_reply(status: int, *, result: bool = False, close: bool = False, message: str = "",
                 header: bytes = b"", layers: tuple[int, int] = (0, 0),
                 payload_len: int = 0) -> bytes:
    """A reply head, its message and the frame header (the payload is sent after it)."""
    text = message.encode(errors="replace")[:MAX_REPLY_TEXT_BYTES]
    head = REPLY_HEAD.pack(MAGIC_REPLY, status, int(result), FLAG_CLOSE if close else 0,
                           len(text), len(header), layers[0], layers[1], payload_len)
    return b"".join((head, text, header))


def decode_reply_head(raw: bytes | bytearray | memoryview) -> Reply:
    """Parse a reply head; raises CorruptBlock when it is not one (a confused or hostile peer)."""
    (magic, status, result, flags, message_len, header_len, start, stop,
     payload_len) = REPLY_HEAD.unpack(raw)
    if magic != MAGIC_REPLY:
        raise CorruptBlock("bad data plane reply magic")
    if message_len > MAX_REPLY_TEXT_BYTES or header_len > MAX_HEADER_BYTES:
        raise CorruptBlock("data plane reply fields over their limits")
    if payload_len > MAX_FRAME_BYTES:
        raise CorruptBlock(f"data plane reply announces {payload_len} payload bytes")
    return Reply(status, bool(result), bool(flags & FLAG_CLOSE), message_len, header_len,
                 (start, stop), payload_len)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from `sock`; raises ConnectionError on EOF. Socket timeouts propagate;
    with `deadline` (a time.monotonic() instant) the whole read must end by then, however the
    bytes trickle in (TimeoutError otherwise)."""
    pos, size = 0, len(view)
    while pos < size:
        _time_left(sock, deadline)
        n = sock.recv_into(view[pos:], size - pos)
        if n == 0:
            raise ConnectionError("connection closed by peer")
        pos += n


def recv_into_pieces(sock: socket.socket, pieces: Sequence[memoryview],
                     deadline: float | None = None) -> None:
    """Fill every buffer of `pieces`, in order, from `sock` (scatter reads: one syscall may
    fill several); raises ConnectionError on EOF, TimeoutError past `deadline` as recv_exact."""
    views = [p for p in pieces if len(p)]
    i = 0
    while i < len(views):
        _time_left(sock, deadline)
        n = sock.recvmsg_into(views[i:i + _MAX_IOV])[0]
        if n == 0:
            raise ConnectionError("connection closed by peer")
        i = _advance(views, i, n)


def recv_whole(sock: socket.socket, pieces: Sequence[memoryview], deadline: float) -> None:
    """Fill every buffer of `pieces`, in order, from a socket in blocking mode
    (`settimeout(None)`), each syscall waiting for all that is asked (MSG_WAITALL) up to what is
    left of `deadline` (SO_RCVTIMEO); raises ConnectionError on EOF, TimeoutError past the
    deadline.

    Why not recv_into_pieces: with a Python timeout the socket is non-blocking, and each read
    is a poll and a recv returning whatever has arrived, ~4-8 per 256 KiB block on loopback,
    each releasing and retaking the interpreter lock. Under another busy Python thread (LMCache's
    own, in the same process) every retake waits its turn. Here a block's message, frame
    header, payload and the next reply's head are one syscall and one release."""
    views = [p for p in pieces if len(p)]
    i = 0
    while i < len(views):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        # A zero timeval means "no timeout": at least 1 us. At most a day a syscall (the loop
        # sets it again), so that a very distant deadline still fits a timeval.
        seconds, micros = divmod(max(1, int(min(left, 86_400.0) * 1e6)), 1_000_000)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(seconds, micros))
        try:
            n = sock.recvmsg_into(views[i:i + _MAX_IOV], 0, socket.MSG_WAITALL)[0]
        except BlockingIOError:  # SO_RCVTIMEO passed with nothing read: the loop checks time
            continue
        if n == 0:
            raise ConnectionError("connection closed by peer")
        i = _advance(views, i, n)


def _time_left(sock: socket.socket, deadline: float | None) -> None:
    """Bound the next socket call by `deadline` (no change without one)."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    current = sock.gettimeout()
    sock.settimeout(left if current is None else min(current, left))


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
