"""Session manifests: which blocks, in order, make up one conversation's KV.

A manifest is what failover reads: a worker that takes over a session looks it up, then restores
its blocks from the store. Manifests are small, JSON-encoded with a checksum and bound to their
key, and carry a generation number so that a stale writer can never roll a session back.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import xxhash

from kvstore.errors import CorruptBlock
from kvstore.keys import BlockHash, Namespace, SessionKey, validate_session_id

__all__ = ["SessionManifest"]

_MAX_MANIFEST_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class SessionManifest:
    key: SessionKey
    block_hashes: tuple[BlockHash, ...]
    token_count: int
    generation: int = 0
    updated_at: float = field(default_factory=time.time)
    token_ids: tuple[int, ...] = ()
    """Optional: the session's token ids so far, so a new worker can recompute what is missing."""
    mac: bytes = b""
    """Optional: a writer's keyed MAC over the manifest (the router's conversation records,
    router/conversations/records.py); the store keeps it as it is and vouches for nothing."""

    def encode(self) -> bytes:
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
        if self.mac:  # absent when empty: unsigned manifests encode as they always have
            fields["mac"] = self.mac.hex()
        body = json.dumps(fields, separators=(",", ":")).encode()
        return xxhash.xxh3_64_digest(body) + body

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview, expected: SessionKey | None = None
               ) -> SessionManifest:
        """Parse and verify; raises CorruptBlock on a checksum, format or key-binding error."""
        raw = bytes(data)
        if len(raw) > _MAX_MANIFEST_BYTES or len(raw) < 9:
            raise CorruptBlock("manifest has an implausible size")
        checksum, body = raw[:8], raw[8:]
        if xxhash.xxh3_64_digest(body) != checksum:
            raise CorruptBlock("manifest checksum mismatch")
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
                mac=bytes.fromhex(obj.get("mac", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptBlock(f"malformed manifest: {exc}") from exc
        if expected is not None and manifest.key != expected:
            raise CorruptBlock("manifest is bound to a different session key")
        return manifest
