"""The daemon's TCP front: the data plane (kvstore/net/tcp_protocol.py) over the core.

A thin translation, like the gRPC front: every decision is the core's (kvstore/daemon/core.py),
so both paths admit and refuse exactly the same things; a `Refusal` becomes a reply with the
reason's number as its status. Here: one accept thread, and one thread per connection that
serves its requests in order with blocking socket calls (they release the GIL while the kernel
copies). A PUT is received straight into the host-tier pages the core reserved for it, and a
GET is sent straight from the block's pages (`socket.sendmsg` of the core's pieces), so a block
crosses the wire with one kernel copy each way.

Stop: `stop()` closes the listener, waits up to `drain_timeout` for requests in progress to
finish (the core refuses new PUTs once it is draining), then shuts every connection down.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

from kvstore.daemon.core import BlockServiceCore
from kvstore.daemon.metrics import DaemonMetrics, timed_call
from kvstore.net.limits import MAX_FRAME_BYTES
from kvstore.net.refusal import OK, Refusal, RefusalReason
from kvstore.net.scope import Scope
from kvstore.net.tcp_protocol import (
    OP_GET,
    REQUEST_HEAD,
    Request,
    decode_request_head,
    encode_reply,
    recv_exact,
    recv_into_pieces,
    send_parts,
)

__all__ = ["TcpFront"]

_log = logging.getLogger(__name__)
_DISCARD_BYTES = 1 << 20


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


class TcpFront:
    """Serves kvstore/net/tcp_protocol.py for one `BlockServiceCore`."""

    def __init__(self, core: BlockServiceCore, host: str, port: int = 0, *,
                 max_connections: int = 256, idle_timeout: float = 600.0,
                 request_timeout: float = 30.0, rpc_metrics: DaemonMetrics | None = None
                 ) -> None:
        self._core = core
        self._metrics = rpc_metrics
        self._bind = (host, port)
        self._max_connections = max_connections
        self._idle_timeout = idle_timeout
        self._request_timeout = request_timeout
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self._connections: set[socket.socket] = set()
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

    # -- threads ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            with self._lock:
                if self._stopping:
                    return
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping:
                    return
                _log.warning("data plane accept failed: %s", exc)
                time.sleep(0.05)
                continue
            with self._lock:
                if self._stopping or len(self._connections) >= self._max_connections:
                    sock.close()
                    continue
                self._connections.add(sock)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock,), name="kvkeep-data-conn",
                             daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        head = bytearray(REQUEST_HEAD.size)
        try:
            while True:
                sock.settimeout(self._idle_timeout)
                try:
                    n = sock.recv_into(head)
                except OSError:
                    return
                if n == 0:
                    return  # the client closed the connection between requests
                with self._lock:
                    stopping = self._stopping
                    if not stopping:
                        self._busy += 1
                if stopping:  # the client gets a reason, then the connection closes
                    with contextlib.suppress(OSError):
                        send_parts(sock, [encode_reply(RefusalReason.UNAVAILABLE, close=True,
                                                       message="daemon is shutting down")])
                        _linger_close(sock)
                    return
                try:
                    sock.settimeout(self._request_timeout)
                    if n < len(head):
                        recv_exact(sock, memoryview(head)[n:])
                    if not self._handle(sock, head):
                        _linger_close(sock)
                        return
                except (OSError, ValueError) as exc:  # timeouts, resets, a client gone mid-way
                    _log.debug("data plane connection dropped: %s", exc)
                    return
                finally:
                    with self._lock:
                        self._busy -= 1
                        self._lock.notify_all()
        except Exception:
            _log.exception("data plane connection crashed")
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()

    # -- requests -----------------------------------------------------------------------------

    def _handle(self, sock: socket.socket, head: bytearray) -> bool:
        """Serve one request whose head is in `head`; False when the connection must close."""
        try:
            request = decode_request_head(head)
        except ValueError as exc:
            self._core.count(invalid_puts=1)
            send_parts(sock, [encode_reply(RefusalReason.INVALID_ARGUMENT, close=True,
                                           message=f"bad request: {exc}")])
            return False
        tail = bytearray(request.tail_len)
        recv_exact(sock, memoryview(tail))
        with timed_call(self._metrics, "tcp", "Get" if request.op == OP_GET else "Put") as call:
            try:
                if request.op == OP_GET:
                    self._get(sock, request, tail)
                else:
                    self._put(sock, request, tail)
            except _Close as closing:
                call.code = closing.refusal.reason
                send_parts(sock, [encode_reply(closing.refusal.reason, close=True,
                                               message=closing.refusal.message)])
                return False
            except Refusal as refusal:
                call.code = refusal.reason
                send_parts(sock, [encode_reply(refusal.reason, message=refusal.message)])
        return True

    def _scope(self, request: Request, tail: bytearray) -> tuple[Scope, bytes]:
        """The request's scope, once its token may touch its tenant, and its block hash."""
        pos = request.token_len
        try:
            token = bytes(tail[:pos]).decode()
        except UnicodeDecodeError:
            token = ""
        principal = self._core.authenticate(token or None)
        try:
            tenant = bytes(tail[pos:pos + request.tenant_len]).decode()
            pos += request.tenant_len
            salt = bytes(tail[pos:pos + request.salt_len]).decode()
            pos += request.salt_len
        except UnicodeDecodeError as exc:
            raise Refusal(RefusalReason.INVALID_ARGUMENT, f"bad scope: {exc}") from None
        return self._core.scope(principal, request.fingerprint, tenant, salt), bytes(tail[pos:])

    def _get(self, sock: socket.socket, request: Request, tail: bytearray) -> None:
        scope, block_hash = self._scope(request, tail)
        block = self._core.open_read(self._core.key(scope, block_hash), request.layers)
        if block is None:
            send_parts(sock, [encode_reply(OK, result=False)])
            return
        try:
            reply = encode_reply(OK, result=True, header=block.header.pack(),
                                 layers=(block.layers.start, block.layers.stop),
                                 payload_len=block.size)
            self._core.count(get_bytes_sent=block.size)
            send_parts(sock, [reply, *block.pieces])
        finally:
            block.finish()  # a copy lent unverified is checked now, while the client verifies

    def _put(self, sock: socket.socket, request: Request, tail: bytearray) -> None:
        size = request.body_len
        if size > MAX_FRAME_BYTES:  # refused, and too big to read and discard: the end
            try:
                self._core.check_frame_size(size)
            except Refusal as refusal:
                raise _Close(refusal) from None
        try:
            scope, block_hash = self._scope(request, tail)
            self._core.admit_put_call()
            incoming = self._core.begin_put(scope, block_hash, size)
        except Refusal:
            self._discard(sock, size)  # keep the connection in step
            raise
        with incoming:
            recv_into_pieces(sock, incoming.pieces)  # a client gone mid-body: nothing stored
            self._core.count(put_bytes_received=size)
            admitted = incoming.commit()
        send_parts(sock, [encode_reply(OK, result=admitted)])

    def _discard(self, sock: socket.socket, size: int) -> None:
        buf = memoryview(bytearray(min(size, _DISCARD_BYTES)))
        left = size
        while left:
            step = min(left, len(buf))
            recv_exact(sock, buf[:step])
            left -= step
