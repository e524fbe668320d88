"""The TCP data plane's client half: a `BlockTransport` over kvstore/net/tcp_protocol.py.

A small pool of connections per daemon; each call takes one (or opens one) and gives it back
only after a complete exchange. A connection that saw any error or timeout is closed, never
reused. A batch of puts is one PUT_MANY request per window, and a batch of gets one GET_MANY
(pipelined single PUTs and GETs to a daemon that predates them).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence

from kvstore.errors import (
    ConfigError,
    CorruptBlock,
    DeadlineExceeded,
    KVKeepError,
    TierError,
    TierUnavailable,
)
from kvstore.frame import BlockRead, FrameHeader, LayerRange
from kvstore.net.limits import MAX_FRAME_BYTES
from kvstore.net.refusal import OK, client_error
from kvstore.net.scope import Scope
from kvstore.net.tcp_protocol import (
    MAX_PUT_MANY_BLOCKS,
    MAX_TOKEN_BYTES,
    OP_GET,
    OP_GET_MANY,
    OP_LOOKUP,
    OP_PUT,
    OP_PUT_MANY,
    REPLY_HEAD,
    Reply,
    decode_reply_head,
    encode_batch,
    encode_put_many,
    encode_request,
    recv_whole,
    send_parts,
)
from kvstore.net.transport import FrameBytes, TransportUnreachable
from kvstore.tiers.base import Buffer

__all__ = ["TcpBlockTransport", "LookupUnsupported"]

# A window of blocks: one PUT_MANY (or GET_MANY) request. To a daemon that predates PUT_MANY
# the window's single PUTs are pipelined, and their replies wait in the client's receive buffer
# (32 bytes each) while it sends, so a window must not outgrow that buffer.
_WINDOW_BLOCKS = MAX_PUT_MANY_BLOCKS
_WINDOW_BYTES = 64 << 20


def _flat(buf: FrameBytes | Buffer) -> memoryview:
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise TierError("buffer is not C-contiguous")
        view = view.cast("B")
    return view


class TcpBlockTransport:
    """Blocks to and from one daemon's data port (see the module docstring). Thread-safe."""

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
        self._get_many = True  # until the daemon answers GET_MANY as an unknown op
        self._put_many: bool | None = None  # known once a PUT_MANY succeeds or cannot

    @property
    def kind(self) -> str:
        return "tcp"

    def get(self, scope: Scope, block_hash: bytes, layers: LayerRange | None = None, *,
            out: Buffer | None = None, timeout: float) -> BlockRead | None:
        """One block (or the segments of `layers`), unverified; None on a miss.

        With `out` large enough, the payload is received straight into it."""
        request = encode_request(OP_GET, scope, block_hash, self._token, layers=layers)
        (result,) = self._exchange(f"get from {self.node_id}", OP_GET, [request], 1, [out],
                                   time.monotonic() + timeout)
        assert result is None or isinstance(result, BlockRead)
        return result

    def get_into(self, scope: Scope, items: Sequence[tuple[bytes, Buffer | None]], *,
                 timeout: float, digests: Sequence[bytes] = ()) -> list[BlockRead | None]:
        """Whole blocks, batched: a window of hashes goes out as one GET_MANY request, then
        its replies are read, each payload straight into its `out` (when large enough), so a
        batch of blocks costs one round trip per window, not per block. None per miss. Raises
        the first refusal of a window (after reading the rest of it).

        With `digests` (each item's key digest), each read is verified as soon as it arrives
        (`BlockRead.verified_for`) and comes back marked verified: its checksums then run while
        the payload is still in the CPU's cache and while the daemon sends the next blocks,
        not over the whole batch afterwards. A read that fails comes back unmarked (the
        caller's own check finds it corrupt). Without, reads are unverified."""
        what = f"get from {self.node_id}"
        deadline = time.monotonic() + timeout
        reads: list[BlockRead | None] = []
        for start in range(0, len(items), _WINDOW_BLOCKS):
            stop = start + _WINDOW_BLOCKS
            for result in self._get_window(what, scope, items[start:stop], digests[start:stop],
                                           deadline):
                assert result is None or isinstance(result, BlockRead)
                reads.append(result)
        return reads

    def _get_window(self, what: str, scope: Scope, window: Sequence[tuple[bytes, Buffer | None]],
                    digests: Sequence[bytes], deadline: float
                    ) -> list[BlockRead | bool | bytes | None]:
        """One GET_MANY for the window; pipelined single GETs to a daemon that predates it
        (from then on)."""
        hashes = [block_hash for block_hash, _ in window]
        outs = [out for _, out in window]
        if self._get_many:
            parts: list[bytes | memoryview] = [
                *encode_batch(OP_GET_MANY, scope, hashes, self._token)]
            try:
                return self._exchange(what, OP_GET_MANY, parts, len(window), outs, deadline,
                                      digests)
            except TierError as exc:
                if not _unknown_op(exc):
                    raise
                self._get_many = False
        parts = [encode_request(OP_GET, scope, block_hash, self._token) for block_hash in hashes]
        return self._exchange(what, OP_GET, parts, len(window), outs, deadline, digests)

    def lookup(self, scope: Scope, block_hashes: Sequence[bytes], *,
               timeout: float) -> list[bool]:
        """Which of `block_hashes` the daemon holds (one round trip; at most
        MAX_KEYS_PER_CALL). Raises `LookupUnsupported` when the daemon predates LOOKUP."""
        if not block_hashes:
            return []
        what = f"lookup on {self.node_id}"
        try:
            parts: list[bytes | memoryview] = [
                *encode_batch(OP_LOOKUP, scope, block_hashes, self._token)]
        except ValueError as exc:
            raise TierError(f"{what}: {exc}") from None
        try:
            (result,) = self._exchange(what, OP_LOOKUP, parts, 1, [],
                                       time.monotonic() + timeout)
        except TierError as exc:
            if _unknown_op(exc):
                raise LookupUnsupported(f"{what}: the daemon's data plane has no LOOKUP"
                                        ) from exc
            raise
        assert isinstance(result, bytes)
        if len(result) != len(block_hashes) or result.strip(b"\x00\x01"):
            raise CorruptBlock(f"{what}: {len(result)} answers for {len(block_hashes)} hashes")
        return [flag == 1 for flag in result]

    def put(self, scope: Scope, blocks: Sequence[tuple[bytes, FrameBytes]], *,
            timeout: float) -> list[bool]:
        """Store whole frames, a window of blocks a PUT_MANY request (pipelined single PUTs to
        a daemon that predates it), so a batch of small blocks costs one round trip per
        window, not per block. One flag per block; raises the first refusal (after the rest
        of its window was answered: each block is stored whole or not at all,
        independently)."""
        what = f"put to {self.node_id}"
        deadline = time.monotonic() + timeout
        done: list[bool] = []
        window: list[tuple[bytes, memoryview]] = []
        size = 0
        for i, (block_hash, frame) in enumerate(blocks):
            view = _flat(frame)
            if len(view) > MAX_FRAME_BYTES:
                raise TierError(f"{what}: RESOURCE_EXHAUSTED: frame of {len(view)} bytes "
                                f"exceeds {MAX_FRAME_BYTES}")
            window.append((block_hash, view))
            size += len(view)
            if len(window) == _WINDOW_BLOCKS or size >= _WINDOW_BYTES or i == len(blocks) - 1:
                done.extend(r is True for r in self._put_window(what, scope, window, deadline))
                window, size = [], 0
        return done

    def _put_window(self, what: str, scope: Scope, window: list[tuple[bytes, memoryview]],
                    deadline: float) -> list[BlockRead | bool | bytes | None]:
        """One PUT_MANY for the window, or pipelined PUTs to a daemon that predates it.

        An older daemon answers PUT_MANY as an unknown op and closes the connection, reading
        only a few MiB of the body first: a larger window may then lose the connection before
        that answer arrives. So until a PUT_MANY has succeeded once, a window whose PUT_MANY
        fails either way is sent again as single PUTs, and if those succeed the daemon is
        taken to predate PUT_MANY."""
        if self._put_many is not False:
            try:
                parts = encode_put_many(scope, window, self._token)
            except ValueError as exc:
                raise TierError(f"{what}: {exc}") from None
            try:
                results = self._exchange(what, OP_PUT_MANY, parts, len(window), [], deadline)
            except TierError as exc:
                if self._put_many or not (_unknown_op(exc)
                                          or isinstance(exc, TransportUnreachable)):
                    raise
            else:
                self._put_many = True
                return results
        parts = []
        for block_hash, view in window:
            parts += [encode_request(OP_PUT, scope, block_hash, self._token,
                                     body_len=len(view)), view]
        results = self._exchange(what, OP_PUT, parts, len(window), [], deadline)
        if self._put_many is None:
            self._put_many = False
        return results

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # -- private ------------------------------------------------------------------------------

    def _exchange(self, what: str, op: int, parts: list[bytes | memoryview], count: int,
                  outs: Sequence[Buffer | None], deadline: float, digests: Sequence[bytes] = ()
                  ) -> list[BlockRead | bool | bytes | None]:
        # A pooled connection may have been closed by a restarted daemon; that shows only when
        # it is used. Such a failure before any reply byte arrived is retried once on a fresh
        # connection (GET and PUT are both idempotent).
        for attempt in range(2):
            sock, reused = self._connection(what, deadline)
            keep = False
            try:
                results, keep = self._on(sock, what, op, parts, count, outs, deadline,
                                         digests)
                return results
            except _Refusal as refusal:
                keep = refusal.keep
                raise refusal.error from None
            except _Stale as exc:
                if reused and attempt == 0:
                    continue
                # Dropped before any reply (a daemon at its connection limit, or going away):
                # the caller may try another transport (both operations are idempotent).
                raise TransportUnreachable(f"{what}: connection dropped before a reply: "
                                           f"{exc.__cause__}") from exc
            finally:
                if keep:
                    self._release(sock)
                else:
                    sock.close()
        raise AssertionError("unreachable")

    def _on(self, sock: socket.socket, what: str, op: int, parts: list[bytes | memoryview],
            count: int, outs: Sequence[Buffer | None], deadline: float,
            digests: Sequence[bytes]) -> tuple[list[BlockRead | bool | bytes | None], bool]:
        """Send `count` requests, read their replies (a GET's payload into `outs[i]` when
        given, verified against `digests[i]` when given): (results, whether the connection may
        be reused). A refusal is raised as _Refusal once every reply was read."""
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
        results: list[BlockRead | bool | bytes | None] = []
        refused: KVKeepError | None = None
        keep = True
        try:
            # Blocking from here on: each reply's rest and the next reply's head are one
            # waiting read (recv_whole). A pooled socket's next use sets a timeout again.
            sock.settimeout(None)
            if n < len(head):
                recv_whole(sock, [memoryview(head)[n:]], deadline)
            for i in range(count):
                reply = decode_reply_head(head)
                _check_shape(op, reply, what)
                # A refusal carrying data is out of step: its data is not read, the connection
                # not kept.
                keep = not reply.close and (reply.status == OK or not (
                    reply.header_len or reply.payload_len))
                message = bytearray(reply.message_len)
                header = bytearray(reply.header_len if reply.status == OK else 0)
                payload = _payload_buffer(op, reply, outs[i] if i < len(outs) else None)
                pieces = [memoryview(message), memoryview(header), payload]
                if keep and i < count - 1:
                    pieces.append(memoryview(head))
                recv_whole(sock, pieces, deadline)
                # A refusal that closes the connection early is raised as its own status (a
                # missing token is ConfigError, not an unwell daemon for the breakers).
                if reply.close and reply.status == OK and i < count - 1:
                    refused = refused or TierUnavailable(
                        f"{what}: the daemon closed the connection after {i + 1} of {count} "
                        f"replies: {message.decode(errors='replace')}")
                if reply.status != OK:
                    refused = refused or client_error(reply.status, what,
                                                      message.decode(errors="replace"))
                    if not keep:
                        raise _Refusal(refused, False)
                    results.append(None)
                elif op in (OP_PUT, OP_PUT_MANY):
                    results.append(reply.result)
                elif op == OP_LOOKUP:
                    results.append(bytes(payload))
                else:
                    block = _block(reply, what, header, payload)
                    if block is not None and i < len(digests):
                        with contextlib.suppress(CorruptBlock):  # found again by the caller
                            block = block.verified_for(digests[i])
                    results.append(block)
                if not keep:
                    break
            if refused is not None:
                raise _Refusal(refused, keep)
            return results, keep
        except TimeoutError as exc:  # DeadlineExceeded included
            raise DeadlineExceeded(f"{what}: deadline passed") from exc
        except OSError as exc:  # ConnectionError included
            raise TierUnavailable(f"{what}: connection lost: {exc}") from exc

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
            raise TransportUnreachable(f"{what}: connecting to {self.address} timed out") from exc
        except OSError as exc:
            raise TransportUnreachable(f"{what}: cannot connect to {self.address}: {exc}"
                                       ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(sock)
                return
        sock.close()


class LookupUnsupported(TierError):
    """The daemon's data plane answered LOOKUP as an unknown op (a daemon of an older
    release): its lookups go over gRPC."""


class _Stale(Exception):
    """Sending the request or reading the first reply byte failed (the cause is chained)."""


class _Refusal(Exception):
    """The daemon refused the request: the error to raise, and whether the connection is
    still in step (reusable)."""

    def __init__(self, error: KVKeepError, keep: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.keep = keep


def _check_shape(op: int, reply: Reply, what: str) -> None:
    """Refuse, before reading it, a reply its op never has (a confused or hostile daemon)."""
    if reply.status != OK:
        return
    has_data = bool(reply.header_len or reply.payload_len)
    if op in (OP_PUT, OP_PUT_MANY) and has_data:
        raise CorruptBlock(f"{what}: a put reply carrying data")
    if op == OP_LOOKUP and (reply.header_len or not reply.result):
        raise CorruptBlock(f"{what}: a lookup reply with a frame header")
    if op in (OP_GET, OP_GET_MANY) and not reply.result and has_data:
        raise CorruptBlock(f"{what}: a miss carrying data")


def _payload_buffer(op: int, reply: Reply, out: Buffer | None) -> memoryview:
    """Where a reply's payload lands: the caller's buffer for a GET hit that fits in it, else a
    fresh one (none for a refusal: its data is not read)."""
    size = reply.payload_len if reply.status == OK else 0
    if op in (OP_GET, OP_GET_MANY) and out is not None and size:
        dst = _flat(out)
        if not dst.readonly and len(dst) >= size:
            return dst[:size]
    return memoryview(bytearray(size))


def _block(reply: Reply, what: str, raw_header: bytearray, payload: memoryview
           ) -> BlockRead | None:
    """A GET reply read whole: None on a miss, else its header and payload, checked to agree."""
    if not reply.result:
        return None
    try:
        header = FrameHeader.unpack(raw_header)
        layers = LayerRange(*reply.layers)
        start, stop = header.span(layers)
    except ValueError as exc:  # InvalidFrame is a ValueError too
        raise CorruptBlock(f"{what}: bad header in reply: {exc}") from exc
    if reply.payload_len != stop - start:
        raise CorruptBlock(f"{what}: payload of {reply.payload_len} bytes for a span "
                           f"of {stop - start}")
    return BlockRead(header, layers, payload)


def _unknown_op(exc: TierError) -> bool:
    """A daemon of an older release refused an op it does not know (INVALID_ARGUMENT, then it
    closed the connection)."""
    return "unknown op" in str(exc)


def _remaining(what: str, deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(f"{what}: deadline passed")
    return left
