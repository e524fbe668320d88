"""The daemon's TCP front: the data plane (kvstore/net/tcp_protocol.py) over the core.

A thin translation, like the gRPC front: every decision is the core's (kvstore/daemon/core.py),
so both paths admit and refuse exactly the same things; a `Refusal` becomes a reply with the
reason's number as its status. Here: one accept thread, and one thread per connection that
serves its requests in order with blocking socket calls (they release the GIL while the kernel
copies). A PUT is received straight into the host-tier pages the core reserved for it, and a
GET is sent straight from the block's pages (`socket.sendmsg` of the core's pieces), so a block
crosses the wire with one kernel copy each way. A GET_MANY is served as its GETs would be, one
reply per block in order, but its request is parsed, authenticated and budgeted once, and its
replies go out several to a sendmsg (`_GetReplies`); a PUT_MANY likewise, its blocks each
admitted and stored as a PUT, its replies sent together after the last block.

Timeouts (slowloris): a connection that has not had a request authenticated must send one,
whole, within `preauth_timeout` seconds of opening (or of its last request); a request with a
missing or unknown token is answered and the connection closed. An authenticated connection
may idle `idle_timeout` seconds between requests, and each request's head must arrive within
`request_timeout`, however its bytes trickle in. A PUT's body must arrive by the deadline the
core gives it (kvstore/daemon/budgets.py), with no gap longer than the put idle timeout (each
block of a PUT_MANY likewise); a PUT holds one of its tenant's put streams while its body
arrives, a PUT_MANY one for all its blocks. At `max_connections`, a new
connection takes the place of the longest idle one (unauthenticated first), so idle
connections never lock clients out. Connections that have not authenticated yet are capped
apart (`max_unauthenticated`; at the cap the oldest of them goes, busy or not: one byte no
longer holds a slot), and so are connections from one source address (`max_per_address`),
so reconnecting unauthenticated clients cannot fill the data plane (M5). A GET (each send of
a GET_MANY's replies) must be taken by its reader within `get_deadline` (30 s plus size / the
minimum rate), and holds its tenant's read budgets while it is sent (M1).

Stop: `stop()` closes the listener, waits up to `drain_timeout` for requests in progress to
finish (the core refuses new PUTs once it is draining), then shuts every connection down.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from kvstore.daemon.auth import Principal
from kvstore.daemon.block_io import OutgoingBlock
from kvstore.daemon.core import BlockServiceCore
from kvstore.daemon.metrics import DaemonMetrics, timed_call
from kvstore.keys import BlockKey
from kvstore.net.limits import MAX_FRAME_BYTES
from kvstore.net.refusal import OK, Refusal, RefusalReason
from kvstore.net.scope import Scope
from kvstore.net.tcp_protocol import (
    MAX_PUT_MANY_BLOCKS,
    OP_GET,
    OP_GET_MANY,
    OP_LOOKUP,
    OP_PUT,
    OP_PUT_MANY,
    PUT_ITEM_HEAD,
    REQUEST_HEAD,
    Request,
    decode_batch_body,
    decode_put_item,
    decode_request_head,
    encode_reply,
    recv_exact,
    recv_into_pieces,
    send_parts,
)

__all__ = ["TcpFront"]

_log = logging.getLogger(__name__)
_DISCARD_BYTES = 1 << 20
# A refused PUT's body is read and dropped (the connection stays in step) up to this size, a
# client's pipelining window (tcp_transport.py); past it the connection is closed instead.
_DISCARD_MAX_BYTES = 64 << 20
# Metrics' method labels. A PUT_MANY is a Put, as a gRPC Put stream of several blocks is.
_OP_NAMES = {OP_GET: "Get", OP_GET_MANY: "GetMany", OP_LOOKUP: "Lookup",
             OP_PUT: "Put", OP_PUT_MANY: "Put"}
# A GET_MANY's replies go out together up to these bounds (one sendmsg for several blocks),
# each block's pages pinned and its bytes held against its tenant's read budget until sent.
# Small enough that the client parses the first blocks while the daemon gathers the next:
# 32 x 256 KiB blocks a request, three rounds, GB/s: 1 MiB / 64 pieces 1.92, 1.58, 1.15;
# 512 KiB / 32: 1.46, 1.24, 1.23; 8 MiB / 256: 1.23, 1.18, 1.10 (single GETs: ~0.77).
_BATCH_SEND_BYTES = 1 << 20
_BATCH_SEND_PIECES = 64


def send_by(sock: socket.socket, parts: list[bytes | memoryview], deadline: float) -> None:
    """`send_parts`, but every byte sent by `deadline` (time.monotonic()), however slowly the
    reader takes them: TimeoutError past it (M1: a trickling reader pins the block's pages)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the reader did not take the block within its send deadline")
        sock.settimeout(min(left, 30.0))
        n = sock.sendmsg(views[:512])
        while n:
            if n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0


def _linger_close(sock: socket.socket) -> None:
    """Close after a final reply without losing it: closing a socket that still has unread
    input makes the kernel send a reset, which can destroy the reply before the client reads
    it. So: end our side, then read and drop what the client still sends, briefly."""
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(0.5)
    sink = bytearray(1 << 16)
    for _ in range(64):  # at most 4 MiB, at most ~0.5 s without input
        if not sock.recv_into(sink):
            return


class _Close(Exception):
    """A refusal after which the connection cannot continue (the stream is out of step)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class _Repeated(Exception):
    """A refusal of a whole GET_MANY: answered once for each of its `count` hashes."""

    def __init__(self, refusal: Refusal, count: int) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal
        self.count = count


class _GetReplies:
    """GET replies on their way to one client, gathered so that several go out in one sendmsg.
    A hit's pages stay borrowed, and its bytes held against its tenant's (and token's) read
    budget, until it is sent (M1); a batch is sent once it reaches `_BATCH_SEND_BYTES` or
    `_BATCH_SEND_PIECES`, and at the end. Misses and refused blocks are replies of their own,
    in order."""

    def __init__(self, core: BlockServiceCore, sock: socket.socket, scope: Scope,
                 principal: Principal | None) -> None:
        self._core = core
        self._sock = sock
        self._scope = scope
        self._principal = principal
        self._parts: list[bytes | memoryview] = []
        self._blocks: list[OutgoingBlock] = []
        self._held = contextlib.ExitStack()
        self._bytes = 0
        self.refused: RefusalReason | None = None
        """The first refusal among the replies (the request's status in the metrics)."""

    def add(self, key: BlockKey, layers: tuple[int, int] | None) -> None:
        """One block's reply: a hit, a miss, or a refusal (the tenant's read budget, a bad
        layer range), sending what is gathered first when this block would pass the bounds."""
        core = self._core
        try:
            block = core.open_read(key, layers)
        except Refusal as refusal:
            self._refuse(refusal)
            return
        if block is None:
            self._parts.append(encode_reply(OK, result=False))
            return
        try:
            if self._blocks and (self._bytes + block.size > _BATCH_SEND_BYTES
                                 or len(self._parts) + len(block.pieces) > _BATCH_SEND_PIECES):
                self.send()
            held = self._hold(block)
        except BaseException:
            block.finish()
            raise
        if not held:
            block.finish()
            return
        self._parts += [encode_reply(OK, result=True, header=block.header.pack(),
                                     layers=(block.layers.start, block.layers.stop),
                                     payload_len=block.size), *block.pieces]

    def _hold(self, block: OutgoingBlock) -> bool:
        """Charge the block's bytes to the read budget, sending what is gathered first if the
        budget is short; False (and a refusal as the block's reply) when it is short even
        then."""
        try:
            self._held.enter_context(self._core.read_bytes(self._scope, block.size,
                                                           self._principal))
        except Refusal as refusal:
            if not self._blocks:
                self._refuse(refusal)
                return False
            self.send()
            return self._hold(block)
        self._blocks.append(block)
        self._bytes += block.size
        return True

    def _refuse(self, refusal: Refusal) -> None:
        self._parts.append(encode_reply(refusal.reason, message=refusal.message))
        self.refused = self.refused or refusal.reason

    def send(self) -> None:
        """Send what is gathered, then release its blocks and budget. Counted before the
        send: counted after, a client that has read a block could ask Stat (another
        connection) before this thread counts it. A reader too slow for the batch's
        `get_deadline` loses the connection, so it cannot pin the pages for long (M1)."""
        try:
            if self._parts:
                if self._bytes:
                    self._core.count(get_bytes_sent=self._bytes)
                send_by(self._sock, self._parts,
                        time.monotonic() + self._core.limits.get_deadline(self._bytes))
        finally:
            self.release()

    def release(self) -> None:
        """Give back the blocks (a copy lent unverified is checked now, as the client does)
        and their budget, sent or not."""
        blocks, self._blocks, self._parts, self._bytes = self._blocks, [], [], 0
        try:
            for block in blocks:
                block.finish()
        finally:
            self._held.close()


class _Connection:
    """One client connection's state, under the front's lock."""

    __slots__ = ("address", "authenticated", "busy", "closing", "principal", "since", "sock")

    def __init__(self, sock: socket.socket, address: str = "") -> None:
        self.sock = sock
        self.address = address
        self.principal: Principal | None = None
        self.authenticated = False
        self.busy = False
        self.closing = False
        self.since = time.monotonic()  # opened, or its last request ended


class TcpFront:
    """Serves kvstore/net/tcp_protocol.py for one `BlockServiceCore`."""

    def __init__(self, core: BlockServiceCore, host: str, port: int = 0, *,
                 max_connections: int = 256, idle_timeout: float = 120.0,
                 request_timeout: float = 30.0, preauth_timeout: float = 5.0,
                 max_unauthenticated: int = 32, max_per_address: int = 128,
                 rpc_metrics: DaemonMetrics | None = None) -> None:
        self._core = core
        self._metrics = rpc_metrics
        self._bind = (host, port)
        self._max_connections = max_connections
        self._max_unauthenticated = max_unauthenticated
        self._max_per_address = max_per_address
        self._per_address: dict[str, int] = {}
        self.refused_connections = 0
        """Connections closed on accept: the source address or the front at its limit."""
        self.evicted_unauthenticated = 0
        """Unauthenticated connections closed to make room for newer ones (M5)."""
        self._idle_timeout = idle_timeout
        self._request_timeout = request_timeout
        self._preauth_timeout = preauth_timeout
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self._connections: dict[socket.socket, _Connection] = {}
        self._busy = 0  # requests being served
        self._stopping = False
        self.port = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> int:
        """Bind and start accepting; returns the bound port."""
        family = socket.AF_INET6 if ":" in self._bind[0] else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(self._bind)
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        listener.settimeout(0.2)  # the accept loop polls the stop flag
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvkeep-data-accept",
                                               daemon=True)
        self._accept_thread.start()
        return self.port

    def stop(self, drain_timeout: float) -> None:
        """Stop accepting, let requests in progress finish (up to `drain_timeout`), close all."""
        with self._lock:
            self._stopping = True
        if self._accept_thread is not None:
            self._accept_thread.join(5.0)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            if not self._lock.wait_for(lambda: self._busy == 0, drain_timeout):
                _log.warning("data plane: %d requests still running after %.0fs", self._busy,
                             drain_timeout)
            connections = list(self._connections)
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    @property
    def requests_in_progress(self) -> int:
        with self._lock:
            return self._busy

    # -- threads ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            with self._lock:
                if self._stopping:
                    return
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping:
                    return
                _log.warning("data plane accept failed: %s", exc)
                time.sleep(0.05)
                continue
            conn = _Connection(sock, str(peer[0]) if isinstance(peer, tuple) else "")
            with self._lock:
                admitted = (not self._stopping and self._address_has_room(conn.address)
                            and self._unauthenticated_room()
                            and (len(self._connections) < self._max_connections
                                 or self._make_room()))
                if admitted:
                    self._connections[sock] = conn
                    self._per_address[conn.address] = self._per_address.get(conn.address, 0) + 1
                else:
                    self.refused_connections += 1
            if not admitted:
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="kvkeep-data-conn",
                             daemon=True).start()

    def _address_has_room(self, address: str) -> bool:
        """Below the per-source-address limit (M5). Caller holds the lock."""
        return self._per_address.get(address, 0) < self._max_per_address

    def _unauthenticated_room(self) -> bool:
        """Room for one more connection that has not authenticated yet (M5): at the limit, the
        oldest such connection is closed, busy or not. A client authenticates with its first
        request, within milliseconds of connecting, so it always outlives the churn; one that
        sends a byte and stalls (to look busy) is the first to go. Caller holds the lock."""
        waiting = [c for c in self._connections.values()
                   if not c.authenticated and not c.closing]
        if len(waiting) < self._max_unauthenticated:
            return True
        victim = min(waiting, key=lambda c: c.since)
        victim.closing = True
        with contextlib.suppress(OSError):
            victim.sock.shutdown(socket.SHUT_RDWR)
        self.evicted_unauthenticated += 1
        return True

    def _make_room(self) -> bool:
        """At the connection limit: close the longest idle connection, unauthenticated ones
        first; False when every connection is busy. Caller holds the lock."""
        idle = [c for c in self._connections.values() if not c.busy and not c.closing]
        if not idle:
            return False
        victim = min(idle, key=lambda c: (c.authenticated, c.since))
        victim.closing = True
        with contextlib.suppress(OSError):
            victim.sock.shutdown(socket.SHUT_RDWR)  # its thread sees EOF and cleans up
        return True

    def _serve(self, conn: _Connection) -> None:
        sock = conn.sock
        head = bytearray(REQUEST_HEAD.size)
        try:
            while True:
                wait = self._idle_timeout if conn.authenticated else self._preauth_timeout
                waited_from = conn.since
                sock.settimeout(max(waited_from + wait - time.monotonic(), 0.001))
                try:
                    n = sock.recv_into(head)
                except OSError:
                    return  # idle too long (or unauthenticated too long), or reset
                if n == 0:
                    return  # the client closed the connection between requests
                with self._lock:
                    stopping = self._stopping or conn.closing
                    if not stopping:
                        self._busy += 1
                        conn.busy = True
                if stopping:  # the client gets a reason, then the connection closes
                    with contextlib.suppress(OSError):
                        send_parts(sock, [encode_reply(RefusalReason.UNAVAILABLE, close=True,
                                                       message="daemon is shutting down")])
                        _linger_close(sock)
                    return
                try:
                    limit = self._request_timeout if conn.authenticated else \
                        self._preauth_timeout
                    deadline = time.monotonic() + limit
                    sock.settimeout(limit)
                    if n < len(head):
                        recv_exact(sock, memoryview(head)[n:], deadline)
                    if not self._handle(conn, head, deadline):
                        _linger_close(sock)
                        return
                except (OSError, ValueError) as exc:  # timeouts, resets, a client gone mid-way
                    _log.debug("data plane connection dropped: %s", exc)
                    return
                finally:
                    with self._lock:
                        self._busy -= 1
                        conn.busy = False
                        conn.since = time.monotonic()
                        self._lock.notify_all()
        except Exception:
            _log.exception("data plane connection crashed")
        finally:
            with self._lock:
                if self._connections.pop(sock, None) is not None:
                    left = self._per_address.get(conn.address, 0) - 1
                    if left > 0:
                        self._per_address[conn.address] = left
                    else:
                        self._per_address.pop(conn.address, None)
            sock.close()

    # -- requests -----------------------------------------------------------------------------

    def _handle(self, conn: _Connection, head: bytearray, deadline: float) -> bool:
        """Serve one request whose head is in `head`; False when the connection must close."""
        sock = conn.sock
        try:
            request = decode_request_head(head)
        except ValueError as exc:
            self._core.count(invalid_puts=1)
            send_parts(sock, [encode_reply(RefusalReason.INVALID_ARGUMENT, close=True,
                                           message=f"bad request: {exc}")])
            return False
        tail = bytearray(request.tail_len)
        recv_exact(sock, memoryview(tail), deadline)
        with timed_call(self._metrics, "tcp", _OP_NAMES[request.op]) as call:
            try:
                refused: RefusalReason | None = None  # a block's reply was a refusal
                if request.op == OP_GET:
                    refused = self._get(conn, request, tail)
                elif request.op == OP_GET_MANY:
                    refused = self._get_many(conn, request, tail, deadline)
                elif request.op == OP_LOOKUP:
                    self._lookup(conn, request, tail, deadline)
                elif request.op == OP_PUT_MANY:
                    refused = self._put_many(conn, request, tail, deadline)
                else:
                    refused = self._put(conn, request, tail)
                if refused is not None:
                    call.code = refused
            except _Close as closing:
                call.code = closing.refusal.reason
                send_parts(sock, [encode_reply(closing.refusal.reason, close=True,
                                               message=closing.refusal.message)])
                return False
            except Refusal as refusal:
                call.code = refusal.reason
                send_parts(sock, [encode_reply(refusal.reason, message=refusal.message)])
            except _Repeated as repeated:
                call.code = repeated.refusal.reason
                reply = encode_reply(repeated.refusal.reason, message=repeated.refusal.message)
                send_parts(sock, [reply] * repeated.count)
        return True

    def _scope(self, conn: _Connection, request: Request, tail: bytearray
               ) -> tuple[Scope, bytes]:
        """The request's scope, once its token may touch its tenant, and its block hash. A
        missing or unknown token ends the connection (after its reply)."""
        pos = request.token_len
        try:
            token = bytes(tail[:pos]).decode()
        except UnicodeDecodeError:
            token = ""
        try:
            principal = self._core.authenticate(token or None)
        except Refusal as refusal:
            raise _Close(refusal) from None
        conn.principal = principal
        if not conn.authenticated:
            with self._lock:
                conn.authenticated = True
        try:
            tenant = bytes(tail[pos:pos + request.tenant_len]).decode()
            pos += request.tenant_len
            salt = bytes(tail[pos:pos + request.salt_len]).decode()
            pos += request.salt_len
        except UnicodeDecodeError as exc:
            raise Refusal(RefusalReason.INVALID_ARGUMENT, f"bad scope: {exc}") from None
        return self._core.scope(principal, request.fingerprint, tenant, salt), bytes(tail[pos:])

    def _get(self, conn: _Connection, request: Request, tail: bytearray
             ) -> RefusalReason | None:
        core = self._core
        scope, block_hash = self._scope(conn, request, tail)
        with core.read_stream(scope, conn.principal):  # M1: reads in progress, per tenant
            return self._send_replies(conn, scope, [core.key(scope, block_hash)],
                                      request.layers)

    def _get_many(self, conn: _Connection, request: Request, tail: bytearray,
                  deadline: float) -> RefusalReason | None:
        """One GET reply per hash of the body, in order (tcp_protocol.py: GET_MANY). The body
        is read whole before any refusal of its scope, so the connection stays in step, and a
        refusal of the whole request is repeated for every hash; a body that does not parse
        leaves the count unknown, so it ends the connection."""
        core = self._core
        scope, body = self._batch(conn, request, tail, deadline)
        try:
            hashes = decode_batch_body(body)
        except ValueError as exc:
            raise _Close(Refusal(RefusalReason.INVALID_ARGUMENT, f"bad batch: {exc}")) from None
        try:
            if isinstance(scope, Refusal):
                raise scope
            keys = core.keys(scope, hashes, remember=False)
        except Refusal as refusal:  # nothing sent yet: the same answer for every hash
            raise _Repeated(refusal, len(hashes)) from None
        with contextlib.ExitStack() as holding:
            try:  # M1: one of the tenant's read streams for the whole batch
                holding.enter_context(core.read_stream(scope, conn.principal))
            except Refusal as refusal:
                raise _Repeated(refusal, len(hashes)) from None
            return self._send_replies(conn, scope, keys, None)

    def _send_replies(self, conn: _Connection, scope: Scope, keys: list[BlockKey],
                      layers: tuple[int, int] | None) -> RefusalReason | None:
        """Every key's GET reply, in order; the first refusal among them, if any."""
        replies = _GetReplies(self._core, conn.sock, scope, conn.principal)
        try:
            for key in keys:
                replies.add(key, layers)
        except BaseException:
            replies.release()
            raise
        replies.send()
        return replies.refused

    def _batch(self, conn: _Connection, request: Request, tail: bytearray, deadline: float
               ) -> tuple[Scope | Refusal, bytearray]:
        """A LOOKUP's or GET_MANY's scope (or its refusal) and its body (at most
        MAX_BATCH_BODY_BYTES), read whole either way so the connection stays in step; a
        missing or unknown token (_Close) ends the connection with the body unread."""
        scope: Scope | Refusal
        try:
            scope, _ = self._scope(conn, request, tail)
        except Refusal as refusal:
            scope = refusal
        body = bytearray(request.body_len)
        recv_exact(conn.sock, memoryview(body), deadline)
        return scope, body

    def _lookup(self, conn: _Connection, request: Request, tail: bytearray,
                deadline: float) -> None:
        """Which of the body's hashes the daemon holds, one byte each."""
        sock, core = conn.sock, self._core
        scope, body = self._batch(conn, request, tail, deadline)
        if isinstance(scope, Refusal):
            raise scope
        try:
            hashes = decode_batch_body(body)
        except ValueError as exc:
            raise Refusal(RefusalReason.INVALID_ARGUMENT, f"bad lookup: {exc}") from None
        present = core.lookup(core.keys(scope, hashes))
        send_parts(sock, [encode_reply(OK, result=True, payload_len=len(present)),
                          bytes(present)])

    def _put(self, conn: _Connection, request: Request, tail: bytearray
             ) -> RefusalReason | None:
        sock, core = conn.sock, self._core
        size = request.body_len
        if size > MAX_FRAME_BYTES:  # refused, and too big to read and discard: the end
            try:
                core.check_frame_size(size)
            except Refusal as refusal:
                raise _Close(refusal) from None
        with contextlib.ExitStack() as holding:
            try:
                scope, block_hash = self._open_put(conn, request, tail, holding)
            except Refusal as refusal:
                if size > _DISCARD_MAX_BYTES:  # not worth reading: end the connection
                    raise _Close(refusal) from None
                self._discard(sock, size)  # keep the connection in step
                raise
            reply, refused = self._put_item(sock, scope, conn.principal, block_hash, size, [])
        send_parts(sock, [reply])
        return refused

    def _open_put(self, conn: _Connection, request: Request, tail: bytearray,
                  holding: contextlib.ExitStack) -> tuple[Scope, bytes]:
        """A PUT's or PUT_MANY's scope (and block hash), the call admitted, one of its tenant's
        put streams held in `holding`; raises Refusal (no token or an unknown one: _Close, and
        the body is never read)."""
        scope, block_hash = self._scope(conn, request, tail)
        self._core.admit_put_call()
        holding.enter_context(self._core.put_stream(scope, conn.principal))
        return scope, block_hash

    def _put_many(self, conn: _Connection, request: Request, tail: bytearray,
                  deadline: float) -> RefusalReason | None:
        """Each block of the body stored (or refused) as a PUT; one PUT reply per block, sent
        together at the end (tcp_protocol.py: PUT_MANY). Returns the first block's refusal.
        A refusal of the request itself is answered once and ends the connection (the count
        of replies it is owed is not known before its body is parsed); its body is read and
        dropped first when small enough, so that the client gets to read the answer (no token,
        or an unknown one: never read)."""
        sock, core = conn.sock, self._core
        replies: list[bytes] = []
        refused: RefusalReason | None = None
        with contextlib.ExitStack() as holding:
            try:
                scope, _ = self._open_put(conn, request, tail, holding)
            except Refusal as refusal:
                if request.body_len <= _DISCARD_MAX_BYTES:
                    self._discard(sock, request.body_len)
                raise _Close(refusal) from None
            item = bytearray(PUT_ITEM_HEAD.size)
            recv_exact(sock, memoryview(item), deadline)
            left = request.body_len - len(item)
            try:
                while True:
                    try:
                        size, block_hash = decode_put_item(item)
                    except ValueError as exc:
                        core.count(invalid_puts=1)
                        raise _Close(Refusal(RefusalReason.INVALID_ARGUMENT,
                                             f"bad PUT_MANY item: {exc}")) from None
                    if size > left or 0 < left - size < len(item) or (
                            left > size and len(replies) == MAX_PUT_MANY_BLOCKS - 1):
                        core.count(invalid_puts=1)
                        raise _Close(Refusal(RefusalReason.INVALID_ARGUMENT,
                                             "PUT_MANY items do not fill the body, or are "
                                             f"more than {MAX_PUT_MANY_BLOCKS}"))
                    left -= size
                    # The next block's head is read with this block's frame (one scatter read).
                    after = [memoryview(item)] if left else []
                    reply = self._put_item(sock, scope, conn.principal, block_hash, size,
                                           after)
                    replies.append(reply[0])
                    if reply[1] is not None and refused is None:
                        refused = reply[1]
                    if not left:
                        break
                    left -= len(item)
            except _Close:
                send_parts(sock, replies)  # the blocks already taken, then the close
                raise
        send_parts(sock, replies)
        return refused

    def _put_item(self, sock: socket.socket, scope: Scope, principal: Principal | None,
                  block_hash: bytes, size: int, after: list[memoryview]
                  ) -> tuple[bytes, RefusalReason | None]:
        """One block of a PUT or a PUT_MANY, received (with `after`: a PUT_MANY's next item
        head) and stored: its encoded reply and its refusal, if refused. A refused block's
        frame is dropped unread into the store (or ends the connection when too big to read).
        A client gone mid-body, or too slow for its deadline, drops the connection: nothing
        stored, the budgets given back."""
        core = self._core
        try:
            with core.begin_put(scope, block_hash, size, principal) as incoming:
                sock.settimeout(core.limits.put_idle_s)
                recv_into_pieces(sock, [*incoming.pieces, *after], incoming.deadline)
                core.count(put_bytes_received=size)
                # Waits for the disk if it is behind (back-pressure) on this connection's own
                # thread, which holds no other tenant's work.
                try:
                    admitted = incoming.commit()
                except Refusal as refusal:  # the frame is in: the batch is still in step
                    return encode_reply(refusal.reason, message=refusal.message), \
                        refusal.reason
        except Refusal as refusal:  # not admitted: its frame is read and dropped
            if size > _DISCARD_MAX_BYTES:
                raise _Close(refusal) from None
            self._discard(sock, size)
            if after:
                recv_exact(sock, after[0], time.monotonic() + core.limits.put_deadline(0))
            return encode_reply(refusal.reason, message=refusal.message), refusal.reason
        return encode_reply(OK, result=admitted), None

    def _discard(self, sock: socket.socket, size: int) -> None:
        buf = memoryview(bytearray(min(size, _DISCARD_BYTES)))
        deadline = time.monotonic() + self._core.limits.put_deadline(size)
        sock.settimeout(self._core.limits.put_idle_s)
        left = size
        while left:
            step = min(left, len(buf))
            recv_exact(sock, buf[:step], deadline)
            left -= step
