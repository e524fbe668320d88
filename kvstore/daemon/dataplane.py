"""The daemon half of the bulk data plane: a plain TCP listener for block GET and PUT.

The protocol, and why it exists, are in kvstore/dataplane.py. Here: one accept thread, and one
thread per connection that serves its requests in order with blocking socket calls (they release
the GIL while the kernel copies). Store calls run on that thread directly; every check is the
gRPC service's own (`KVStoreService.authenticate_token`, `reserve_put_bytes`,
`verify_and_store`, `read_block`), so both paths admit and refuse exactly the same things.

Verification: a PUT is verified whole (every segment's checksum, the header's, the key
binding) before it is stored, as over gRPC. A GET served from host RAM is sent straight from
the block's pages and hashed right after it was sent, while the client receives it: the
client verifies every block it is given anyway (DaemonClient's contract is "unverified"; the
remote tier checks checksums and key binding before use), and hashing first would put ~0.1 ms
per 4 MiB on the critical path (measured: 3.4-3.7 -> 4.0-4.4 GB/s without it). A copy that
fails the daemon's check is dropped at once, as a failed read drops it, so the next read finds
the nvme copy or a replica. The key binding is checked before anything is sent. Reads from
the nvme tier are verified before they are sent, as ever.

Buffers: a small pool of 64 MiB scratch buffers, allocated lazily (only the pages a request
touches become resident) and reused, receives PUT bodies and holds GET payloads, so a warm
daemon does not page-fault per request; frames larger than a scratch buffer get a fresh one.

Stop: `stop()` closes the listener, waits up to `drain_timeout` for requests in progress to
finish (the service refuses new PUTs once it is draining), then shuts every connection down.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]

from kvstore.daemon.auth import AuthFailure
from kvstore.daemon.service import Abort, Counters, KVStoreService
from kvstore.dataplane import (
    OP_GET,
    REQUEST_HEAD,
    Request,
    Status,
    decode_request_head,
    encode_reply,
    recv_exact,
    recv_into_pieces,
    send_parts,
)
from kvstore.errors import InvalidKey
from kvstore.frame import HEADER_PREFIX_BYTES, BlockRead, LayerRange
from kvstore.keys import BlockKey, Namespace
from kvstore.wire import MAX_FRAME_BYTES, Scope

__all__ = ["DataPlaneServer", "SCRATCH_BYTES"]

_log = logging.getLogger(__name__)
SCRATCH_BYTES = 64 << 20
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


class _Refuse(Exception):
    """A request refused with a status; `close` when the connection cannot continue."""

    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.close = close


class _ScratchPool:
    """Reused receive/read buffers: at most `keep` idle ones are kept."""

    def __init__(self, size: int, keep: int) -> None:
        self._size = size
        self._keep = keep
        self._idle: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self) -> bytearray:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return bytearray(self._size)  # calloc'd: pages become resident only when touched

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(buf)


_STATUS_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: Status.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED: Status.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Status.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: Status.UNAVAILABLE,
    grpc.StatusCode.UNAUTHENTICATED: Status.UNAUTHENTICATED,
}


def _status(code: Any) -> int:
    return _STATUS_OF.get(code, Status.INTERNAL)


class DataPlaneServer:
    """Serves kvstore/dataplane.py's protocol for one `KVStoreService`."""

    def __init__(self, service: KVStoreService, host: str, port: int = 0, *,
                 max_connections: int = 256, idle_timeout: float = 600.0,
                 request_timeout: float = 30.0, scratch_buffers: int = 8) -> None:
        self._service = service
        self._bind = (host, port)
        self._max_connections = max_connections
        self._idle_timeout = idle_timeout
        self._request_timeout = request_timeout
        self._pool = _ScratchPool(SCRATCH_BYTES, scratch_buffers)
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._lock = threading.Condition()
        self._connections: set[socket.socket] = set()
        self._busy = 0  # requests being served
        self._stopping = False
        self._counters = Counters()
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
        self._service.add_counter_source(self.counters)
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

    def counters(self) -> Counters:
        with self._lock:
            return Counters(*(getattr(self._counters, f) for f in Counters.__slots__))

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
                        send_parts(sock, [encode_reply(Status.UNAVAILABLE, close=True,
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
            self._count(invalid_puts=1)
            send_parts(sock, [encode_reply(Status.INVALID_ARGUMENT, close=True,
                                           message=f"bad request: {exc}")])
            return False
        tail = bytearray(request.tail_len)
        recv_exact(sock, memoryview(tail))
        try:
            if request.op == OP_GET:
                self._get(sock, request, tail)
            else:
                self._put(sock, request, tail)
        except _Refuse as refusal:
            send_parts(sock, [encode_reply(refusal.status, close=refusal.close,
                                           message=str(refusal))])
            return not refusal.close
        return True

    def _key(self, request: Request, tail: bytearray) -> BlockKey:
        """The request's key, once its token may touch its tenant; raises _Refuse."""
        pos = request.token_len
        try:
            token = bytes(tail[:pos]).decode()
        except UnicodeDecodeError:
            token = ""
        principal = self._service.authenticate_token(token or None)
        if isinstance(principal, AuthFailure):
            raise _Refuse(Status.UNAUTHENTICATED, principal.message)
        try:
            tenant = bytes(tail[pos:pos + request.tenant_len]).decode()
            pos += request.tenant_len
            salt = bytes(tail[pos:pos + request.salt_len]).decode()
            pos += request.salt_len
            namespace = Namespace(tenant, salt)
        except (UnicodeDecodeError, InvalidKey) as exc:
            raise _Refuse(Status.INVALID_ARGUMENT, f"bad scope: {exc}") from None
        if not principal.may_access(namespace.tenant):
            raise _Refuse(Status.PERMISSION_DENIED,
                          f"tenant {namespace.tenant!r} is not granted to this token")
        try:
            return self._service.key(Scope(request.fingerprint, namespace), bytes(tail[pos:]))
        except InvalidKey as exc:
            raise _Refuse(Status.INVALID_ARGUMENT, str(exc)) from None

    def _get(self, sock: socket.socket, request: Request, tail: bytearray) -> None:
        key = self._key(request, tail)
        layers: LayerRange | None = None
        if request.layers is not None:
            try:
                layers = LayerRange(*request.layers)
            except ValueError as exc:
                raise _Refuse(Status.INVALID_ARGUMENT, str(exc)) from None
        # In host RAM: sent straight from its pages (no copy), and hashed right after, while the
        # client receives and verifies (see the module docstring).
        block = self._service.borrow_block(key, layers, verify=False)
        if block is not None:
            try:
                reply = encode_reply(Status.OK, result=True, header=block.header.pack(),
                                     layers=(block.layers.start, block.layers.stop),
                                     payload_len=block.size)
                self._count(gets=1, hits=1, get_bytes_sent=block.size)
                send_parts(sock, [reply, *block.pieces])
                if not self._service.check_borrowed(key, block):
                    _log.warning("sent a corrupt copy of %s (dropped now; the client's own "
                                 "check rejects it)", key.storage_name)
            finally:
                block.release()
            return
        scratch = self._pool.take()
        try:
            outcome = self._service.read_block(key, layers, scratch)
            if isinstance(outcome, Abort):
                raise _Refuse(_status(outcome.code), outcome.message)
            if outcome is None:
                self._count(gets=1, misses=1)
                send_parts(sock, [encode_reply(Status.OK, result=False)])
                return
            self._send_block(sock, outcome)
        finally:
            self._pool.give(scratch)

    def _send_block(self, sock: socket.socket, read: BlockRead) -> None:
        payload = memoryview(read.payload).cast("B")
        reply = encode_reply(Status.OK, result=True, header=read.header.pack(),
                             layers=(read.layers.start, read.layers.stop),
                             payload_len=len(payload))
        self._count(gets=1, hits=1, get_bytes_sent=len(payload))
        send_parts(sock, [reply, payload])

    def _put(self, sock: socket.socket, request: Request, tail: bytearray) -> None:
        size = request.body_len
        if size > MAX_FRAME_BYTES:
            self._count(invalid_puts=1)
            raise _Refuse(Status.RESOURCE_EXHAUSTED,
                          f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}", close=True)
        try:
            key = self._key(request, tail)
            if self._service.draining:
                raise _Refuse(Status.UNAVAILABLE, "daemon is draining")
            if size < HEADER_PREFIX_BYTES:
                self._count(invalid_puts=1)
                raise _Refuse(Status.INVALID_ARGUMENT, f"frame size {size} is too small")
            if not self._service.reserve_put_bytes(size):
                raise _Refuse(Status.RESOURCE_EXHAUSTED,
                              "too many put bytes in flight; retry later")
        except _Refuse:
            self._discard(sock, size)  # keep the connection in step
            raise
        try:
            reservation = self._service.begin_put(key, size)
            if reservation is not None:
                # Straight into the host tier's pages: no receive buffer, no copy out of it.
                try:
                    recv_into_pieces(sock, reservation.pieces)
                except BaseException:  # a client gone mid-body: nothing is stored
                    reservation.abort()
                    raise
                self._count(put_bytes_received=size)
                outcome = self._service.finish_put(reservation)
            else:
                outcome = self._put_buffered(sock, key, size)
        finally:
            self._service.release_put_bytes(size)
        if isinstance(outcome, Abort):
            if outcome.code == grpc.StatusCode.INVALID_ARGUMENT:
                self._count(invalid_puts=1)
            raise _Refuse(_status(outcome.code), outcome.message)
        self._count(puts=1, rejected_puts=0 if outcome else 1)
        send_parts(sock, [encode_reply(Status.OK, result=outcome)])

    def _put_buffered(self, sock: socket.socket, key: BlockKey, size: int) -> bool | Abort:
        scratch = self._pool.take() if size <= SCRATCH_BYTES else bytearray(size)
        try:
            frame = memoryview(scratch)[:size]
            recv_exact(sock, frame)  # a client gone mid-body raises: nothing is stored
            self._count(put_bytes_received=size)
            return self._service.verify_and_store(key, frame)
        finally:
            if size <= SCRATCH_BYTES:
                self._pool.give(scratch)

    def _discard(self, sock: socket.socket, size: int) -> None:
        buf = memoryview(bytearray(min(size, _DISCARD_BYTES)))
        left = size
        while left:
            step = min(left, len(buf))
            recv_exact(sock, buf[:step])
            left -= step

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)
