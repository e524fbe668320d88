"""A synchronous client of one kvstore daemon: what the remote tier and re-replication call.

Control calls (delete, manifests, stat, health) go over one gRPC channel per daemon, shared
by all threads. Block bytes and lookups go over the `BlockTransport` chosen for this daemon,
once (lookups over gRPC when that is gRPC, or the daemon's data plane predates them):
the TCP data plane when the daemon has one (its address comes from the etcd registration, or
else from one Stat call on first use) and this client may use it (no TLS: the plane is not
encrypted), gRPC otherwise. The choice is revisited only when something says it changed: the
daemon re-registers (`set_data_address`), or the data port cannot be connected to — then gRPC
carries blocks for `DATA_RETRY_S` (the call that found out is retried on gRPC within its
deadline: GET and PUT are idempotent) before the data port is tried again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]

from kvstore._proto import health_pb2
from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import ConfigError, DeadlineExceeded, KVKeepError, TierError
from kvstore.frame import BlockRead, LayerRange
from kvstore.keys import SessionKey
from kvstore.manifest import SessionRecord, decode_session_record
from kvstore.net.grpc_messages import scope_to_pb
from kvstore.net.grpc_options import HEALTH_SERVICE, KVSTORE_SERVICE, Keepalive, channel_options
from kvstore.net.grpc_transport import GrpcBlockTransport, serialize, translate_rpc_error
from kvstore.net.limits import CHUNK_BYTES
from kvstore.net.scope import Scope, scope_of
from kvstore.net.tcp_transport import LookupUnsupported, TcpBlockTransport
from kvstore.net.transport import BlockTransport, FrameBytes, TransportUnreachable
from kvstore.tiers.base import Buffer

_log = logging.getLogger(__name__)

__all__ = ["ClientTLS", "DaemonClient", "DaemonStat", "DATA_RETRY_S"]

DATA_RETRY_S = 5.0
"""After the data plane was found absent or unreachable, blocks travel over gRPC this long."""


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """mTLS material for dialing daemons: the CA that signed them, and our own cert and key.

    The daemon's certificate must name the host of the address dialled, or `server_name` when
    one is given (every daemon carrying one shared name, e.g. in a Kubernetes DaemonSet): that
    check, with the CA's signature, is what proves a registered address is a daemon's.
    """

    ca_file: Path
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None

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
    """The daemon's TCP data plane port; 0 when it has none."""
    pending_writes: int = 0
    """Blocks in the daemon's RAM not yet written to its disk."""

    @classmethod
    def from_pb(cls, r: pb.StatReply) -> DaemonStat:
        return cls(
            node_id=r.node_id, draining=r.draining, blocks=r.blocks, bytes_used=r.bytes_used,
            bytes_budget=r.bytes_budget, put_bytes_received=r.put_bytes_received,
            get_bytes_sent=r.get_bytes_sent, puts=r.puts, rejected_puts=r.rejected_puts,
            invalid_puts=r.invalid_puts, gets=r.gets, hits=r.hits, misses=r.misses,
            lookups=r.lookups, repaired_blocks=r.repaired_blocks,
            tier_blocks=tuple((t.name, t.blocks) for t in r.tiers), data_port=r.data_port,
            pending_writes=r.pending_writes)


class DaemonClient:
    """Calls to one daemon. Thread-safe; `close()` releases the channel and connections.

    data_address: the daemon's data plane host:port when known (its etcd registration); None
    asks Stat on first use. data_plane=False keeps blocks on gRPC (and TLS does too).
    """

    def __init__(self, node_id: str, address: str, *, token: str | None = None,
                 tls: ClientTLS | None = None, chunk_bytes: int = CHUNK_BYTES,
                 data_address: str | None = None, data_plane: bool = True,
                 keepalive: Keepalive | None = None) -> None:
        self.node_id = node_id
        self.address = address
        self._token = token
        self._tcp_allowed = data_plane and tls is None
        self._data_address = data_address or None
        self._lock = threading.Lock()
        options: list[tuple[str, int | str]] = list(channel_options(keepalive))
        if tls is not None and tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, tls.credentials(), options=options)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ())
        self._grpc_blocks = GrpcBlockTransport(node_id, address, self._channel, self._metadata,
                                               chunk_bytes=chunk_bytes)
        self._blocks: BlockTransport | None = None if self._tcp_allowed else self._grpc_blocks
        self._revisit_at = 0.0  # when a gRPC choice made for want of TCP is reconsidered
        self._tcp_lookups = True  # until a daemon of an older release refuses the op
        method = f"/{KVSTORE_SERVICE}/"
        ch = self._channel
        self._lookup = ch.unary_unary(method + "Lookup", request_serializer=serialize,
                                      response_deserializer=pb.LookupReply.FromString)
        self._delete = ch.unary_unary(method + "Delete", request_serializer=serialize,
                                      response_deserializer=pb.DeleteReply.FromString)
        self._put_manifest = ch.unary_unary(
            method + "PutManifest", request_serializer=serialize,
            response_deserializer=pb.PutManifestReply.FromString)
        self._get_manifest = ch.unary_unary(
            method + "GetManifest", request_serializer=serialize,
            response_deserializer=pb.GetManifestReply.FromString)
        self._delete_manifest = ch.unary_unary(
            method + "DeleteManifest", request_serializer=serialize,
            response_deserializer=pb.DeleteReply.FromString)
        self._stat = ch.unary_unary(method + "Stat", request_serializer=serialize,
                                    response_deserializer=pb.StatReply.FromString)
        self._health = ch.unary_unary(
            f"/{HEALTH_SERVICE}/Check", request_serializer=serialize,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)

    # -- blocks (over the chosen transport) ---------------------------------------------------

    def put(self, scope: Scope, blocks: Sequence[tuple[bytes, FrameBytes]], *,
            timeout: float) -> list[bool]:
        """Store whole frames; one admitted flag per block. Raises on transport errors."""
        if not blocks:
            return []
        deadline = time.monotonic() + timeout
        transport = self.block_transport(deadline)
        what = f"put to {self.node_id}"
        try:
            return transport.put(scope, blocks, timeout=_left(deadline, what))
        except TransportUnreachable as exc:
            self._unreachable(transport, exc)
        return self._grpc_blocks.put(scope, blocks, timeout=_left(deadline, what))

    def get(self, scope: Scope, block_hash: bytes, layers: LayerRange | None = None, *,
            out: Buffer | None = None, timeout: float) -> BlockRead | None:
        """One block (or the segments of `layers`), unverified; None on a miss.

        With `out` large enough, the payload lands in it and the result is a view of it.
        """
        deadline = time.monotonic() + timeout
        transport = self.block_transport(deadline)
        what = f"get from {self.node_id}"
        try:
            return transport.get(scope, block_hash, layers, out=out,
                                 timeout=_left(deadline, what))
        except TransportUnreachable as exc:
            self._unreachable(transport, exc)
        return self._grpc_blocks.get(scope, block_hash, layers, out=out,
                                     timeout=_left(deadline, what))

    def get_into(self, scope: Scope, items: Sequence[tuple[bytes, Buffer | None]], *,
                 timeout: float, digests: Sequence[bytes] = ()) -> list[BlockRead | None]:
        """Whole blocks, each payload into its buffer where large enough; None per miss.
        Pipelined over the data plane (one round trip per window of blocks; with `digests`,
        each read verified as it arrives: `TcpBlockTransport.get_into`); over gRPC, one call
        per block, unverified."""
        deadline = time.monotonic() + timeout
        what = f"get from {self.node_id}"
        transport = self.block_transport(deadline)
        if isinstance(transport, TcpBlockTransport):
            try:
                return transport.get_into(scope, items, timeout=_left(deadline, what),
                                          digests=digests)
            except TransportUnreachable as exc:
                self._unreachable(transport, exc)
        return [self._grpc_blocks.get(scope, block_hash, out=out, timeout=_left(deadline, what))
                for block_hash, out in items]

    def get_many(self, scope: Scope, block_hashes: Sequence[bytes],
                 layers: LayerRange | None = None, *, timeout: float) -> list[BlockRead | None]:
        """Several blocks in one gRPC stream (re-replication, benchmarks); unverified."""
        return self._grpc_blocks.get_many(scope, block_hashes, layers, timeout=timeout)

    def block_transport(self, deadline: float | None = None) -> BlockTransport:
        """The transport this daemon's blocks travel over (chosen on first use, see the module
        docstring); `deadline` bounds the one Stat call that may take."""
        chosen = self._blocks
        if chosen is not None and not (self._revisit_at and time.monotonic() >= self._revisit_at):
            return chosen
        with self._lock:
            if self._blocks is None or (self._revisit_at and
                                        time.monotonic() >= self._revisit_at):
                self._blocks = self._choose(deadline or time.monotonic() + 2.0)
            return self._blocks

    def set_data_address(self, address: str | None) -> None:
        """A new data plane address (the daemon re-registered); None: ask Stat again."""
        with self._lock:
            if (address or None) == self._data_address and self._blocks is not None \
                    and self._blocks.kind == "tcp":
                return
            old, self._blocks = self._blocks, None if self._tcp_allowed else self._grpc_blocks
            self._data_address = address or None
            self._revisit_at = 0.0
        if old is not None and old is not self._grpc_blocks:
            old.close()

    @property
    def data_plane_address(self) -> str | None:
        """The data plane address blocks travel to, once chosen; None while they use gRPC."""
        blocks = self._blocks
        return blocks.address if blocks is not None and blocks.kind == "tcp" else None

    # -- control calls (gRPC) -----------------------------------------------------------------

    def lookup(self, scope: Scope, block_hashes: Sequence[bytes], *,
               timeout: float) -> list[bool]:
        """Which of `block_hashes` the daemon holds: over the data plane when blocks use it
        (or its address is known from the registration), else (or for a daemon without the
        op) over gRPC."""
        deadline = time.monotonic() + timeout
        what = f"lookup on {self.node_id}"
        # The transport blocks already use; a lookup never pays for the Stat probe that
        # choosing one may take (a one-off client asks over gRPC, in one call as before).
        transport = self._blocks
        if transport is None and self._tcp_allowed and self._data_address is not None:
            transport = self.block_transport(deadline)  # the address is known: no probe
        if isinstance(transport, TcpBlockTransport) and self._tcp_lookups:
            try:
                return transport.lookup(scope, block_hashes, timeout=_left(deadline, what))
            except TransportUnreachable as exc:
                self._unreachable(transport, exc)
            except LookupUnsupported as exc:
                _log.info("%s; its lookups go over gRPC", exc)
                self._tcp_lookups = False
        request = pb.LookupRequest(scope=scope_to_pb(scope), block_hashes=list(block_hashes))
        reply = self._call(self._lookup, request, _left(deadline, what), what)
        if len(reply.present) != len(block_hashes):
            raise TierError(f"lookup on {self.node_id}: wrong number of results")
        return list(reply.present)

    def delete(self, scope: Scope, block_hashes: Sequence[bytes], *, timeout: float) -> int:
        request = pb.DeleteRequest(scope=scope_to_pb(scope), block_hashes=list(block_hashes))
        return int(self._call(self._delete, request, timeout,
                              f"delete on {self.node_id}").deleted)

    def put_manifest(self, record: SessionRecord, *, timeout: float) -> None:
        self._call(self._put_manifest, pb.PutManifestRequest(manifest=record.encode()),
                   timeout, f"put manifest to {self.node_id}")

    def get_manifest(self, key: SessionKey, *, timeout: float) -> SessionRecord | None:
        """The session's record (a manifest or a conversation record), verified and checked to
        be bound to `key`; None when absent."""
        request = pb.ManifestKey(scope=scope_to_pb(scope_of(key)), session_id=key.session_id)
        reply = self._call(self._get_manifest, request, timeout,
                           f"get manifest from {self.node_id}")
        if not reply.found:
            return None
        return decode_session_record(reply.manifest, expected=key)

    def delete_manifest(self, key: SessionKey, *, timeout: float) -> bool:
        request = pb.ManifestKey(scope=scope_to_pb(scope_of(key)), session_id=key.session_id)
        return bool(self._call(self._delete_manifest, request, timeout,
                               f"delete manifest on {self.node_id}").deleted)

    def stat(self, *, timeout: float) -> DaemonStat:
        return DaemonStat.from_pb(self._call(self._stat, pb.StatRequest(), timeout,
                                             f"stat of {self.node_id}"))

    def health(self, *, timeout: float) -> str:
        """SERVING, NOT_SERVING, ... as the standard health service reports it."""
        reply = self._call(self._health, health_pb2.HealthCheckRequest(service=""), timeout,
                           f"health of {self.node_id}")
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def close(self) -> None:
        with self._lock:
            blocks, self._blocks = self._blocks, self._grpc_blocks
            self._tcp_allowed = False
        if blocks is not None and blocks is not self._grpc_blocks:
            blocks.close()
        self._channel.close()

    # -- private ------------------------------------------------------------------------------

    def _call(self, method: Any, request: Any, timeout: float, what: str) -> Any:
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, what) from exc

    def _choose(self, deadline: float) -> BlockTransport:
        """TCP when this daemon has a data plane we may use, else gRPC (under the lock)."""
        self._revisit_at = 0.0
        if not self._tcp_allowed:
            return self._grpc_blocks
        address = self._data_address
        if address is None:
            # One Stat call learns the port; it shares the caller's deadline. The answer is
            # not kept beyond this choice: after a failure it is asked again (a restarted
            # daemon listens on a new port unless --data-listen fixes one).
            now = time.monotonic()
            try:
                port = self.stat(timeout=min(max(deadline - now, 1e-3), 2.0)).data_port
            except KVKeepError as exc:
                _log.debug("data plane probe of %s failed: %s", self.node_id, exc)
                port = 0
            if not port:
                self._revisit_at = now + DATA_RETRY_S
                return self._grpc_blocks
            address = f"{self.address.rpartition(':')[0]}:{port}"
        return TcpBlockTransport(self.node_id, address, token=self._token)

    def _unreachable(self, transport: BlockTransport, exc: TransportUnreachable) -> None:
        """The chosen data port cannot be reached: gRPC carries blocks for DATA_RETRY_S."""
        _log.info("%s; blocks go over gRPC for %.0fs", exc, DATA_RETRY_S)
        with self._lock:
            if self._blocks is transport:
                self._blocks = self._grpc_blocks
                self._revisit_at = time.monotonic() + DATA_RETRY_S
        if transport is not self._grpc_blocks:
            transport.close()


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(f"{what}: deadline passed")
    return left
