"""What the store keeps under a session key: a KV session manifest or a conversation record.

A `SessionManifest` is what failover reads: which blocks, in order, make up one conversation's
KV; a worker that takes over a session looks it up, then restores its blocks from the store.
A `ConversationRecord` is the router's: one conversation's token ids between turns
(router/conversations/records.py), no blocks and no model layout.

The store, the tiers and the daemons keep either alike (`SessionRecord`): small, checksummed,
bound to their key, and ordered by a generation number so that a stale writer can never roll a
session back (a tier keeps the higher generation, whatever the kind of either). A reader asks
for the kind it expects (`expect_kind`): the other kind under its key is `CorruptBlock`,
never read as its own. The two encodings cannot be mistaken for each other: a conversation
record's bytes start with a kind and version tag (`CONVERSATION_TAG`) where a manifest's start
with its checksum, and each decoder refuses the other's bytes with `CorruptBlock`.

Conversation records are filed under `SessionKey.conversation` (kvstore/keys.py): a digest of
their scope takes the place of the model fingerprint, so their keys never meet a manifest's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TypeVar

import xxhash

from kvstore.errors import CorruptBlock
from kvstore.keys import BlockHash, Namespace, SessionId, SessionKey, validate_session_id

__all__ = ["SessionManifest", "ConversationRecord", "SessionRecord", "CONVERSATION_TAG",
           "decode_session_record", "expect_kind"]

_MAX_RECORD_BYTES = 16 << 20
_CHECKSUM_BYTES = 8
CONVERSATION_TAG = b"kvkconv"
"""The first bytes of an encoded `ConversationRecord` (its version byte follows). A manifest's
bytes start with its body's xxh3 instead; a manifest whose checksum happened to start with the
tag (1 in 2**56) would be refused by both decoders: a miss, never the other kind."""
_CONVERSATION_VERSION = 1
_CONVERSATION_HEADER = CONVERSATION_TAG + bytes([_CONVERSATION_VERSION])


def _seal(body: bytes) -> bytes:
    return xxhash.xxh3_64_digest(body) + body


def _unseal(raw: bytes, what: str) -> bytes:
    """The body of checksum + body, or CorruptBlock."""
    if len(raw) > _MAX_RECORD_BYTES or len(raw) <= _CHECKSUM_BYTES:
        raise CorruptBlock(f"{what} has an implausible size")
    checksum, body = raw[:_CHECKSUM_BYTES], raw[_CHECKSUM_BYTES:]
    if xxhash.xxh3_64_digest(body) != checksum:
        raise CorruptBlock(f"{what} checksum mismatch")
    return body


@dataclass(frozen=True, slots=True)
class SessionManifest:
    key: SessionKey
    block_hashes: tuple[BlockHash, ...]
    token_count: int
    generation: int = 0
    updated_at: float = field(default_factory=time.time)
    token_ids: tuple[int, ...] = ()
    """Optional: the session's token ids so far, so a new worker can recompute what is missing."""

    def encode(self) -> bytes:
        # A "mac" field, which conversation records carried while they were manifests, is gone:
        # decoding ignores it in what an older writer left.
        fields: dict[str, object] = {
            "v": 1,
            "fingerprint": self.key.fingerprint.hex(),
            "namespace": self.key.namespace.label,
            "session_id": self.key.session_id,
            "block_hashes": [h.hex() for h in self.block_hashes],
            "token_count": self.token_count,
            "generation": self.generation,
            "updated_at": self.updated_at,
            "token_ids": list(self.token_ids),
        }
        return _seal(json.dumps(fields, separators=(",", ":")).encode())

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, expected: SessionKey | None = None
               ) -> SessionManifest:
        """Parse and verify; raises CorruptBlock on a checksum, format or key-binding error,
        and for a conversation record's bytes."""
        raw = bytes(data)
        if raw.startswith(CONVERSATION_TAG):
            raise CorruptBlock("a conversation record, not a session manifest")
        body = _unseal(raw, "manifest")
        try:
            obj = json.loads(body)
            key = SessionKey(bytes.fromhex(obj["fingerprint"]),
                             Namespace.from_label(obj["namespace"]),
                             validate_session_id(obj["session_id"]))
            manifest = cls(
                key=key,
                block_hashes=tuple(BlockHash(bytes.fromhex(h)) for h in obj["block_hashes"]),
                token_count=int(obj["token_count"]),
                generation=int(obj["generation"]),
                updated_at=float(obj["updated_at"]),
                token_ids=tuple(int(t) for t in obj.get("token_ids", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptBlock(f"malformed manifest: {exc}") from exc
        if expected is not None and manifest.key != expected:
            raise CorruptBlock("manifest is bound to a different session key")
        return manifest


@dataclass(frozen=True, slots=True)
class ConversationRecord:
    """One session's conversation as the router recorded it: its token ids under `scope` (the
    served model and the API tenant, router/conversations/records.py's `record_scope`), with
    the router's MAC over them. The store keeps the MAC as it is and vouches for nothing.

    Its key is derived, never given: `SessionKey.conversation(scope, namespace, session_id)`,
    so a record always sits under its own scope's key. Empty `token_ids` is a tombstone.
    """

    scope: str
    namespace: Namespace
    session_id: SessionId
    generation: int
    token_ids: tuple[int, ...] = ()
    mac: bytes = b""
    key: SessionKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key",
                           SessionKey.conversation(self.scope, self.namespace, self.session_id))

    def encode(self) -> bytes:
        body = json.dumps({
            "scope": self.scope,
            "namespace": self.namespace.label,
            "session_id": self.session_id,
            "generation": self.generation,
            "token_ids": list(self.token_ids),
            "mac": self.mac.hex(),
        }, separators=(",", ":"), ensure_ascii=True).encode()
        return _CONVERSATION_HEADER + _seal(body)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, expected: SessionKey | None = None
               ) -> ConversationRecord:
        """Parse and verify; raises CorruptBlock on a tag, checksum, format or key-binding
        error (a session manifest's bytes, among them a record the router wrote before it had
        this type, fail on the tag)."""
        raw = bytes(data)
        if not raw.startswith(CONVERSATION_TAG):
            raise CorruptBlock("not a conversation record (a session manifest's bytes?)")
        if raw[len(CONVERSATION_TAG):len(_CONVERSATION_HEADER)] != _CONVERSATION_HEADER[-1:]:
            raise CorruptBlock("a conversation record of an unknown version")
        body = _unseal(raw[len(_CONVERSATION_HEADER):], "conversation record")
        try:
            obj = json.loads(body)
            record = cls(scope=obj["scope"],  # its key checks it: a non-empty string
                         namespace=Namespace.from_label(obj["namespace"]),
                         session_id=validate_session_id(obj["session_id"]),
                         generation=_integer(obj["generation"]),
                         token_ids=tuple(_integer(t) for t in obj["token_ids"]),
                         mac=bytes.fromhex(obj["mac"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptBlock(f"malformed conversation record: {exc}") from exc
        if expected is not None and record.key != expected:
            raise CorruptBlock("conversation record is bound to a different session key")
        return record


def _integer(value: object) -> int:
    # int("7") or int(7.9) would accept what no writer encodes; bool is an int to Python.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{value!r} is not an integer")
    return value


SessionRecord = SessionManifest | ConversationRecord
"""What one session key holds in the store: the store and the daemons need only its key,
generation and bytes, whatever its kind."""

_Kind = TypeVar("_Kind", SessionManifest, ConversationRecord)


def decode_session_record(data: bytes | bytearray | memoryview,
                          expected: SessionKey | None = None) -> SessionRecord:
    """Either kind, by its tag (tiers and daemons, which keep both); CorruptBlock as the
    kind's own decoder raises it."""
    if bytes(data[:len(CONVERSATION_TAG)]) == CONVERSATION_TAG:
        return ConversationRecord.decode(data, expected)
    return SessionManifest.decode(data, expected)


def expect_kind(record: SessionRecord | None, kind: type[_Kind]) -> _Kind | None:
    """`record` if it is a `kind` (or None); CorruptBlock for the other kind under its key."""
    if record is None or isinstance(record, kind):
        return record
    raise CorruptBlock(f"session {record.key.session_id!r} holds a {type(record).__name__}, "
                       f"not a {kind.__name__}")
