"""A synchronous client of one kvstore daemon: the wire half of the remote tier.

One gRPC channel per daemon, shared by all threads (gRPC channels are thread-safe and multiplex
calls over one HTTP/2 connection). Every call takes a timeout; every gRPC error is translated
into the kvkeep exception tree here, at the boundary, so callers never see `grpc.RpcError`.

Single-block gets and puts go over the daemon's bulk data plane (kvstore/dataplane.py) when it
has one: its address comes from the etcd registration, or else from one Stat call on first use.
When the daemon has none, or its data port cannot be connected to, the same call goes over gRPC
within the same deadline, and the data plane is tried again `DATA_RETRY_S` later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]

from kvstore.chunk_codec import GetChunkView, decode_get_chunk, encode_put_chunk
from kvstore.dataplane import DataPlaneClient, DataPlaneUnreachable
from kvstore.errors import (
    ConfigError,
    CorruptBlock,
    DeadlineExceeded,
    InvalidFrame,
    KVKeepError,
    TierError,
    TierUnavailable,
)
from kvstore.frame import BlockRead, FrameHeader
from kvstore.keys import SessionKey
from kvstore.manifest import SessionManifest
from kvstore.tiers.base import Buffer
from kvstore.wire import (
    CHUNK_BYTES,
    GRPC_CHANNEL_OPTIONS,
    HEALTH_SERVICE,
    KVSTORE_SERVICE,
    Scope,
    layers_from_pb,
    layers_to_pb,
)
from proto.gen import health_pb2
from proto.gen import kvstore_pb2 as pb

_log = logging.getLogger(__name__)

__all__ = ["ClientTLS", "DaemonClient", "DaemonStat", "translate_rpc_error", "DATA_RETRY_S"]

FrameBytes = bytes | bytearray | memoryview
DATA_RETRY_S = 5.0
"""After the data plane was found absent or unreachable, bulk calls use gRPC this long."""


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """mTLS material for dialing daemons: the CA that signed them, and our own cert and key."""

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None

    def credentials(self) -> Any:
        def read(path: Path | None) -> bytes | None:
            try:
                return None if path is None else path.read_bytes()
            except OSError as exc:
                raise ConfigError(f"cannot read TLS file {path}: {exc}") from exc

        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file),
                                            read(self.cert_file))


@dataclass(frozen=True, slots=True)
class DaemonStat:
    """A daemon's Stat reply, as plain values."""

    node_id: str
    draining: bool
    blocks: int
    bytes_used: int
    bytes_budget: int
    put_bytes_received: int
    get_bytes_sent: int
    puts: int
    rejected_puts: int
    invalid_puts: int
    gets: int
    hits: int
    misses: int
    lookups: int
    repaired_blocks: int
    tier_blocks: tuple[tuple[str, int], ...] = ()
    """(tier name, blocks held) per tier of the daemon's store, fastest first."""
    data_port: int = 0
    """The daemon's bulk data plane port; 0 when it has none."""
    pending_writes: int = 0
    """Blocks in the daemon's RAM not yet written to its disk."""


_UNAVAILABLE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS,
})


def translate_rpc_error(exc: grpc.RpcError, what: str) -> KVKeepError:
    """Map a gRPC status to the kvkeep exception a caller acts on."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    message = f"{what}: {code.name if code else 'UNKNOWN'}: {detail}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return ConfigError(message)  # a missing or wrong token is a deployment mistake
    if code in _UNAVAILABLE_CODES:
        return TierUnavailable(message)
    return TierError(message)


class DaemonClient:
    """Calls to one daemon. Thread-safe; `close()` releases the channel and connections.

    data_address: the daemon's data plane host:port when known (its etcd registration); None
    asks Stat on first use. data_plane=False keeps every call on gRPC (and TLS does too: the
    data plane is unencrypted, so a TLS client never uses it).
    """

    def __init__(self, node_id: str, address: str, *, token: str | None = None,
                 tls: ClientTLS | None = None, chunk_bytes: int = CHUNK_BYTES,
                 data_address: str | None = None, data_plane: bool = True) -> None:
        self.node_id = node_id
        self.address = address
        self._chunk = chunk_bytes
        self._token = token
        self._use_data = data_plane and tls is None
        self._data_address = data_address or None
        self._data: DataPlaneClient | None = None
        self._data_retry_at = 0.0
        self._data_lock = threading.Lock()
        options = list(GRPC_CHANNEL_OPTIONS)
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, tls.credentials(), options=options)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ())
        method = f"/{KVSTORE_SERVICE}/"
        ch = self._channel
        # Bulk messages go through the zero-copy codec (kvstore/chunk_codec.py).
        self._put = ch.stream_unary(method + "Put", request_serializer=None,
                                    response_deserializer=pb.PutReply.FromString)
        self._get = ch.unary_stream(method + "Get", request_serializer=_serialize,
                                    response_deserializer=decode_get_chunk)
        # The same two methods invoked as unary calls, for a request or reply that is one
        # message: on the wire a one-message stream is exactly that, and the sync client reads
        # a unary reply ~1.4x faster than it iterates a stream (no hand-off between threads).
        self._put_one = ch.unary_unary(method + "Put", request_serializer=None,
                                       response_deserializer=pb.PutReply.FromString)
        self._get_one = ch.unary_unary(method + "Get", request_serializer=_serialize,
                                       response_deserializer=decode_get_chunk)
        self._lookup = ch.unary_unary(method + "Lookup", request_serializer=_serialize,
                                      response_deserializer=pb.LookupReply.FromString)
        self._delete = ch.unary_unary(method + "Delete", request_serializer=_serialize,
                                      response_deserializer=pb.DeleteReply.FromString)
        self._put_manifest = ch.unary_unary(
            method + "PutManifest", request_serializer=_serialize,
            response_deserializer=pb.PutManifestReply.FromString)
        self._get_manifest = ch.unary_unary(
            method + "GetManifest", request_serializer=_serialize,
            response_deserializer=pb.GetManifestReply.FromString)
        self._delete_manifest = ch.unary_unary(
            method + "DeleteManifest", request_serializer=_serialize,
            response_deserializer=pb.DeleteReply.FromString)
        self._stat = ch.unary_unary(method + "Stat", request_serializer=_serialize,
                                    response_deserializer=pb.StatReply.FromString)
        self._health = ch.unary_unary(
            f"/{HEALTH_SERVICE}/Check", request_serializer=_serialize,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)

    # -- blocks ---------------------------------------------------------------------------

    def put(self, scope: Scope, blocks: Sequence[tuple[bytes, FrameBytes]], *,
            timeout: float) -> list[bool]:
        """Store whole frames; one admitted flag per block. Raises on transport errors."""
        if not blocks:
            return []
        deadline = time.monotonic() + timeout
        data = self._data_client(deadline)
        if data is not None:
            try:
                return data.put_many(scope, blocks,
                                     timeout=_left(deadline, f"put to {self.node_id}"))
            except DataPlaneUnreachable as exc:
                self._data_unreachable(exc)  # puts are idempotent: all of it goes over gRPC
            timeout = _left(deadline, f"put to {self.node_id}")
        try:
            if len(blocks) == 1 and len(blocks[0][1]) <= self._chunk:
                (message,) = self._put_stream(scope, blocks)
                reply = self._put_one(message, timeout=timeout, metadata=self._metadata)
            else:
                reply = self._put(self._put_stream(scope, blocks), timeout=timeout,
                                  metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, f"put to {self.node_id}") from exc
        if len(reply.status) != len(blocks):
            raise TierError(f"put to {self.node_id}: {len(reply.status)} results for "
                            f"{len(blocks)} blocks")
        return [s == pb.PUT_STATUS_STORED for s in reply.status]

    def get(self, scope: Scope, block_hash: bytes, layers: Any = None, *,
            out: Buffer | None = None, timeout: float) -> BlockRead | None:
        """One block (or the segments of `layers`), unverified; None on a miss.

        With `out` large enough, the payload lands in it and the result is a view of it.
        """
        deadline = time.monotonic() + timeout
        data = self._data_client(deadline)
        if data is not None:
            try:
                return data.get(scope, block_hash, layers, out=out,
                                timeout=_left(deadline, f"get from {self.node_id}"))
            except DataPlaneUnreachable as exc:
                self._data_unreachable(exc)
            timeout = _left(deadline, f"get from {self.node_id}")
        request = pb.GetRequest(scope=scope.to_pb(), block_hashes=[block_hash],
                                layers=layers_to_pb(layers))
        try:
            if out is None or len(out) <= self._chunk:
                request.single_reply = True
                reply = self._get_one(request, timeout=timeout, metadata=self._metadata)
                if not reply.found or len(reply.data) == reply.payload_size:
                    return next(_assemble(iter((reply,)), 1, out))
                request.single_reply = False  # bigger than one message: stream it
            stream = self._get(request, timeout=timeout, metadata=self._metadata)
            reads = list(_assemble(stream, 1, out))
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, f"get from {self.node_id}") from exc
        if len(reads) != 1:
            raise TierError(f"get from {self.node_id}: {len(reads)} replies for 1 key")
        return reads[0]

    def get_many(self, scope: Scope, block_hashes: Sequence[bytes], layers: Any = None, *,
                 timeout: float) -> list[BlockRead | None]:
        """Several blocks in one stream (re-replication, benchmarks); unverified."""
        if not block_hashes:
            return []
        request = pb.GetRequest(scope=scope.to_pb(), block_hashes=list(block_hashes),
                                layers=layers_to_pb(layers))
        try:
            stream = self._get(request, timeout=timeout, metadata=self._metadata)
            reads = list(_assemble(stream, len(block_hashes), None))
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, f"get from {self.node_id}") from exc
        if len(reads) != len(block_hashes):
            raise TierError(f"get from {self.node_id}: {len(reads)} replies for "
                            f"{len(block_hashes)} keys")
        return reads

    def lookup(self, scope: Scope, block_hashes: Sequence[bytes], *,
               timeout: float) -> list[bool]:
        request = pb.LookupRequest(scope=scope.to_pb(), block_hashes=list(block_hashes))
        try:
            reply = self._lookup(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, f"lookup on {self.node_id}") from exc
        if len(reply.present) != len(block_hashes):
            raise TierError(f"lookup on {self.node_id}: wrong number of results")
        return list(reply.present)

    def delete(self, scope: Scope, block_hashes: Sequence[bytes], *, timeout: float) -> int:
        request = pb.DeleteRequest(scope=scope.to_pb(), block_hashes=list(block_hashes))
        try:
            reply = self._delete(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, f"delete on {self.node_id}") from exc
        return int(reply.deleted)

    # -- manifests ------------------------------------------------------------------------

    def put_manifest(self, manifest: SessionManifest, *, timeout: float) -> None:
        try:
            self._put_manifest(pb.PutManifestRequest(manifest=manifest.encode()),
                               timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, f"put manifest to {self.node_id}") from exc

    def get_manifest(self, key: SessionKey, *, timeout: float) -> SessionManifest | None:
        """The stored manifest, verified and checked to be bound to `key`; None when absent."""
        request = pb.ManifestKey(scope=Scope(key.fingerprint, key.namespace).to_pb(),
                                 session_id=key.session_id)
        try:
            reply = self._get_manifest(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, f"get manifest from {self.node_id}") from exc
        if not reply.found:
            return None
        return SessionManifest.decode(reply.manifest, expected=key)

    def delete_manifest(self, key: SessionKey, *, timeout: float) -> bool:
        request = pb.ManifestKey(scope=Scope(key.fingerprint, key.namespace).to_pb(),
                                 session_id=key.session_id)
        try:
            reply = self._delete_manifest(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, f"delete manifest on {self.node_id}") from exc
        return bool(reply.deleted)

    # -- operations -----------------------------------------------------------------------

    def stat(self, *, timeout: float) -> DaemonStat:
        try:
            r = self._stat(pb.StatRequest(), timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, f"stat of {self.node_id}") from exc
        return DaemonStat(
            node_id=r.node_id, draining=r.draining, blocks=r.blocks, bytes_used=r.bytes_used,
            bytes_budget=r.bytes_budget, put_bytes_received=r.put_bytes_received,
            get_bytes_sent=r.get_bytes_sent, puts=r.puts, rejected_puts=r.rejected_puts,
            invalid_puts=r.invalid_puts, gets=r.gets, hits=r.hits, misses=r.misses,
            lookups=r.lookups, repaired_blocks=r.repaired_blocks,
            tier_blocks=tuple((t.name, t.blocks) for t in r.tiers), data_port=r.data_port,
            pending_writes=r.pending_writes)

    def health(self, *, timeout: float) -> str:
        """SERVING, NOT_SERVING, ... as the standard health service reports it."""
        try:
            reply = self._health(health_pb2.HealthCheckRequest(service=""), timeout=timeout,
                                 metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, f"health of {self.node_id}") from exc
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def close(self) -> None:
        with self._data_lock:
            data, self._data = self._data, None
            self._use_data = False
        if data is not None:
            data.close()
        self._channel.close()

    def set_data_address(self, address: str | None) -> None:
        """A new data plane address (the daemon re-registered); None: ask Stat again."""
        with self._data_lock:
            if (address or None) == self._data_address and self._data is not None:
                return
            old, self._data = self._data, None
            self._data_address = address or None
            self._data_retry_at = 0.0
        if old is not None:
            old.close()

    @property
    def data_plane_address(self) -> str | None:
        """The data plane address in use, once known; None while calls go over gRPC."""
        data = self._data
        return data.address if data is not None else None

    # -- the data plane -------------------------------------------------------------------

    def _data_client(self, deadline: float) -> DataPlaneClient | None:
        """The data plane client, or None while bulk calls should use gRPC."""
        data = self._data
        if data is not None or not self._use_data:
            return data
        with self._data_lock:
            if self._data is not None or not self._use_data:
                return self._data
            now = time.monotonic()
            if now < self._data_retry_at:
                return None
            address = self._data_address
            if address is None:
                # One Stat call learns the port; it shares the caller's deadline. The answer is
                # not kept beyond this client object: after a failure it is asked again (a
                # restarted daemon listens on a new port unless --data-listen fixes one).
                try:
                    port = self.stat(timeout=min(max(deadline - now, 1e-3), 2.0)).data_port
                except KVKeepError as exc:
                    _log.debug("data plane probe of %s failed: %s", self.node_id, exc)
                    self._data_retry_at = now + DATA_RETRY_S
                    return None
                if not port:
                    self._data_retry_at = now + DATA_RETRY_S
                    return None
                host = self.address.rpartition(":")[0]
                address = f"{host}:{port}"
            self._data = DataPlaneClient(self.node_id, address, token=self._token)
            return self._data

    def _data_unreachable(self, exc: DataPlaneUnreachable) -> None:
        _log.info("%s; using gRPC for %.0fs", exc, DATA_RETRY_S)
        with self._data_lock:
            old, self._data = self._data, None
            self._data_retry_at = time.monotonic() + DATA_RETRY_S
        if old is not None:
            old.close()

    # -- private --------------------------------------------------------------------------

    def _put_stream(self, scope: Scope, blocks: Sequence[tuple[bytes, FrameBytes]]
                    ) -> Iterator[bytes]:
        first: pb.Scope | None = scope.to_pb()
        step = self._chunk
        for block_hash, frame in blocks:
            view = memoryview(frame).cast("B")
            size = len(view)
            yield encode_put_chunk(view[:step], scope=first, block_hash=block_hash,
                                   frame_size=size)
            first = None
            for start in range(step, size, step):
                yield encode_put_chunk(view[start:start + step])


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(f"{what}: deadline passed")
    return left


def _assemble(stream: Iterator[GetChunkView], expected: int, out: Buffer | None
              ) -> Iterator[BlockRead | None]:
    """Turn a Get stream back into one BlockRead (or None) per requested key, in order."""
    current: tuple[FrameHeader, Any, memoryview, int] | None = None
    filled = 0
    next_index = 0
    for msg in stream:
        if current is None:
            if msg.index != next_index or next_index >= expected:
                raise TierError(f"get stream out of order: index {msg.index}, "
                                f"expected {next_index}")
            next_index += 1
            if not msg.found:
                yield None
                continue
            if msg.layers is None:
                raise CorruptBlock("get reply without a layer range")
            try:
                header = FrameHeader.unpack(msg.header)
                layers = layers_from_pb(msg.layers)
                start, stop = header.span(layers)
            except ValueError as exc:  # InvalidFrame is a ValueError too
                raise CorruptBlock(f"bad header in get reply: {exc}") from exc
            size = int(msg.payload_size)
            if size != stop - start:
                raise InvalidFrame(f"payload of {size} bytes for a span of {stop - start}")
            if out is None and len(msg.data) == size:
                # The whole payload in one message: keep the view, copy nothing.
                yield BlockRead(header, layers, msg.data)
                continue
            if out is not None and len(out) >= size:
                buf = memoryview(out)[:size]
            else:
                buf = memoryview(bytearray(size))
            current, filled = (header, layers, buf, size), 0
        header, layers, buf, size = current
        data = msg.data
        if filled + len(data) > size:
            raise CorruptBlock("get reply carries more bytes than announced")
        buf[filled:filled + len(data)] = data
        filled += len(data)
        if filled == size:
            yield BlockRead(header, layers, buf)
            current = None
    if current is not None:
        raise TierUnavailable("get stream ended mid-block")
