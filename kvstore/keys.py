"""What identifies stored KV: model fingerprints, namespaces, block keys and session keys.

A block is found only under the exact (fingerprint, namespace, block hash) it was stored with.
The fingerprint hashes everything that makes stored KV valid for a model, so a change of weights,
dtype, shape, block size, layout or codec makes old blocks unreachable instead of wrong.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import NewType

from kvstore.errors import InvalidKey

__all__ = [
    "BlockHash",
    "SessionId",
    "ModelFingerprint",
    "Namespace",
    "BlockKey",
    "SessionKey",
    "conversation_scope_digest",
    "validate_session_id",
    "validate_name",
    "MAX_BLOCK_HASH_BYTES",
]

BlockHash = NewType("BlockHash", bytes)
"""vLLM's chained prefix hash of one full block (32 bytes with sha256; any 1-64 bytes accepted)."""

SessionId = NewType("SessionId", str)

MAX_BLOCK_HASH_BYTES = 64
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Session ids come from clients (headers, body fields), so they are kept to a charset that is
# safe as a file name, an etcd key segment and an HTTP header value.
_SESSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
_DIGEST_BYTES = 16


def validate_name(value: str, what: str = "name") -> str:
    """Validate a tenant, salt or node name: 1-64 of [A-Za-z0-9._-], starting alphanumeric."""
    if not isinstance(value, str) or _NAME_RE.fullmatch(value) is None:
        raise InvalidKey(f"invalid {what} {value!r}: 1-64 chars of [A-Za-z0-9._-], starting alnum")
    return value


def validate_session_id(value: str) -> SessionId:
    """Validate a session id: 1-128 of [A-Za-z0-9._:-], starting alphanumeric."""
    if not isinstance(value, str) or _SESSION_RE.fullmatch(value) is None:
        raise InvalidKey(
            f"invalid session id {value!r}: 1-128 chars of [A-Za-z0-9._:-], starting alnum"
        )
    return SessionId(value)


def _validate_block_hash(value: bytes) -> BlockHash:
    if not isinstance(value, bytes) or not 1 <= len(value) <= MAX_BLOCK_HASH_BYTES:
        raise InvalidKey(f"block hash must be 1-{MAX_BLOCK_HASH_BYTES} bytes")
    return BlockHash(value)


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Everything that decides whether stored KV is valid for a running model.

    `weights_digest` is a digest of the weights files or a user-given revision string; leaving it
    empty is allowed but means two revisions of one model id share blocks, so the connector
    always fills it.
    """

    model_id: str
    weights_digest: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    layout_id: str
    codec: str
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            if getattr(self, name) <= 0:
                raise InvalidKey(f"fingerprint {name} must be positive")
        canonical = json.dumps(
            {
                "v": 1,
                "model_id": self.model_id,
                "weights_digest": self.weights_digest,
                "dtype": self.dtype,
                "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads,
                "head_size": self.head_size,
                "block_size": self.block_size,
                "layout_id": self.layout_id,
                "codec": self.codec,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        object.__setattr__(self, "digest", hashlib.blake2b(canonical, digest_size=16).digest())

    @property
    def hex(self) -> str:
        return self.digest.hex()


@dataclass(frozen=True, slots=True)
class Namespace:
    """A tenant plus an optional cache salt; blocks never cross namespaces."""

    tenant: str
    salt: str = ""

    def __post_init__(self) -> None:
        validate_name(self.tenant, "tenant")
        if self.salt:
            validate_name(self.salt, "cache salt")

    @property
    def label(self) -> str:
        """A path- and key-safe rendering (`tenant` or `tenant~salt`)."""
        return f"{self.tenant}~{self.salt}" if self.salt else self.tenant

    @classmethod
    def from_label(cls, label: str) -> Namespace:
        tenant, _, salt = label.partition("~")
        return cls(tenant, salt)


_CONVERSATION_PERSON = b"kvkeep-conv/v1"


def conversation_scope_digest(scope: str) -> bytes:
    """The 16 bytes a conversation record's `SessionKey` has where a manifest's has its model
    fingerprint digest (`SessionKey.conversation`)."""
    if not isinstance(scope, str) or not scope:
        raise InvalidKey("a conversation scope must be a non-empty string")
    return hashlib.blake2b(scope.encode(), digest_size=_DIGEST_BYTES,
                           person=_CONVERSATION_PERSON).digest()


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for part in parts:
        # Length-prefix every part so that ("ab", "c") and ("a", "bc") never collide.
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


@dataclass(frozen=True, slots=True)
class BlockKey:
    """(model fingerprint digest, namespace, block hash): the address of one stored block."""

    fingerprint: bytes
    namespace: Namespace
    block_hash: BlockHash
    digest: bytes = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.fingerprint) != _DIGEST_BYTES:
            raise InvalidKey("fingerprint digest must be 16 bytes")
        _validate_block_hash(self.block_hash)
        digest = _digest(b"block", self.fingerprint, self.namespace.label.encode(), self.block_hash)
        object.__setattr__(self, "digest", digest)
        object.__setattr__(self, "_hash", hash(digest))

    def __hash__(self) -> int:
        # Equal keys have equal digests. Tiers and the daemon look up thousands of keys per
        # batched lookup; the generated hash would rehash all three fields (and the Namespace,
        # in Python) on every dict access.
        return self._hash

    @classmethod
    def of(cls, fingerprint: ModelFingerprint, namespace: Namespace, block_hash: bytes) -> BlockKey:
        return cls(fingerprint.digest, namespace, BlockHash(block_hash))

    @property
    def storage_name(self) -> str:
        """A fixed-length, path-safe name (hex of the key digest) for files and remote keys."""
        return self.digest.hex()


@dataclass(frozen=True, slots=True)
class SessionKey:
    """(fingerprint, namespace, session id): the address of what the store keeps for a session
    (kvstore/manifest.py). `fingerprint` is 16 bytes saying what kind of record, for what, the
    key holds: a `ModelFingerprint.digest` for a KV session manifest (`of`), a conversation
    scope's digest for a router conversation record (`conversation`). The two never meet: the
    second is a BLAKE2b personalised for conversation scopes, the first an unpersonalised one
    of a fingerprint's canonical JSON."""

    fingerprint: bytes
    namespace: Namespace
    session_id: SessionId
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.fingerprint) != _DIGEST_BYTES:
            raise InvalidKey("fingerprint digest must be 16 bytes")
        validate_session_id(self.session_id)
        object.__setattr__(
            self,
            "digest",
            _digest(b"session", self.fingerprint, self.namespace.label.encode(),
                    self.session_id.encode()),
        )

    @classmethod
    def of(cls, fingerprint: ModelFingerprint, namespace: Namespace, session_id: str) -> SessionKey:
        """A KV session manifest's key."""
        return cls(fingerprint.digest, namespace, validate_session_id(session_id))

    @classmethod
    def conversation(cls, scope: str, namespace: Namespace, session_id: str) -> SessionKey:
        """A conversation record's key: `scope` (the served model and API tenant) in place of
        a model fingerprint. A conversation depends on no KV layout, so none is named; a
        daemon indexes the key as it does any other, by its digest."""
        return cls(conversation_scope_digest(scope), namespace, validate_session_id(session_id))

    @property
    def storage_name(self) -> str:
        return self.digest.hex()
