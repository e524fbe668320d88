"""Conversions between kvstore types and the gRPC messages of proto/kvstore.proto, and the limits
both ends of the wire agree on.

Both the daemon and the remote tier client import this module, so a limit is raised on both
ends at once and a scope is encoded exactly one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidKey
from kvstore.frame import LayerRange
from kvstore.keys import BlockHash, BlockKey, Namespace, SessionKey, validate_session_id
from proto.gen import kvstore_pb2 as pb

__all__ = [
    "CHUNK_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_KEYS_PER_CALL",
    "GRPC_CHANNEL_OPTIONS",
    "KVSTORE_SERVICE",
    "HEALTH_SERVICE",
    "Scope",
    "scope_of",
    "group_by_scope",
    "layers_to_pb",
    "layers_from_pb",
]

CHUNK_BYTES = 4 << 20
"""Payload bytes per streamed message. 4 MiB messages measured fastest here (1 MiB: more
per-message overhead in Python; larger: gRPC buffers whole messages and page-faults more)."""

MAX_MESSAGE_BYTES = CHUNK_BYTES + (1 << 20)
"""The gRPC message limit on both ends: one chunk plus room for a frame header and fields.
Raised deliberately from gRPC's 4 MiB default; anything bigger is RESOURCE_EXHAUSTED."""

MAX_FRAME_BYTES = 1 << 30
"""The largest block frame a daemon admits (a 1 GiB block is ~100x any real model's)."""

MAX_KEYS_PER_CALL = 65536
"""Keys in one Lookup/Get/Delete; a batch of 1,000 is typical, 64 Ki keys of 64 bytes is 4 MiB."""

GRPC_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Big flow-control windows keep a 16 MiB stream from stalling on window updates.
    ("grpc.http2.lookahead_bytes", 16 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)

KVSTORE_SERVICE = "kvkeep.store.v1.KVStore"
HEALTH_SERVICE = "grpc.health.v1.Health"


@dataclass(frozen=True, slots=True)
class Scope:
    """A model fingerprint digest and a namespace: what one request's keys share."""

    fingerprint: bytes
    namespace: Namespace

    def to_pb(self) -> pb.Scope:
        return pb.Scope(fingerprint=self.fingerprint, tenant=self.namespace.tenant,
                        salt=self.namespace.salt)

    @classmethod
    def from_pb(cls, msg: pb.Scope) -> Scope:
        """Validate a scope from the wire; raises InvalidKey."""
        if len(msg.fingerprint) != 16:
            raise InvalidKey("scope fingerprint must be 16 bytes")
        return cls(bytes(msg.fingerprint), Namespace(msg.tenant, msg.salt))

    def key(self, block_hash: bytes) -> BlockKey:
        return BlockKey(self.fingerprint, self.namespace, BlockHash(block_hash))

    def keys(self, block_hashes: Sequence[bytes]) -> list[BlockKey]:
        return [BlockKey(self.fingerprint, self.namespace, BlockHash(h)) for h in block_hashes]

    def session_key(self, session_id: str) -> SessionKey:
        return SessionKey(self.fingerprint, self.namespace, validate_session_id(session_id))


def scope_of(key: BlockKey | SessionKey) -> Scope:
    return Scope(key.fingerprint, key.namespace)


def group_by_scope(keys: Sequence[BlockKey]) -> dict[Scope, list[int]]:
    """Indices of `keys` grouped by scope (almost always one group), in input order."""
    if not keys:
        return {}
    first = keys[0]
    fp, ns = first.fingerprint, first.namespace
    # The common case, fast: keys of one model and namespace usually share the Namespace object
    # (an identity test, not the dataclass's Python-level __eq__).
    if all((k.namespace is ns or k.namespace == ns) and k.fingerprint == fp for k in keys):
        return {Scope(fp, ns): list(range(len(keys)))}
    groups: dict[Scope, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(scope_of(key), []).append(i)
    return groups


def layers_to_pb(layers: LayerRange | None) -> pb.LayerRange | None:
    return None if layers is None else pb.LayerRange(start=layers.start, stop=layers.stop)


def layers_from_pb(msg: pb.LayerRange) -> LayerRange:
    """Raises ValueError for an empty or inverted range."""
    return LayerRange(msg.start, msg.stop)
