"""What the keys of one request share: a model fingerprint digest and a namespace.

Every block request names exactly one `Scope` (on either transport), and a bearer token may only
touch the tenants it was granted; `Scope.parse` is the one place a scope from the wire is
validated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import InvalidKey
from kvstore.keys import BlockHash, BlockKey, Namespace, SessionKey, validate_session_id

__all__ = ["FINGERPRINT_BYTES", "Scope", "scope_of", "group_by_scope"]

FINGERPRINT_BYTES = 16


@dataclass(frozen=True, slots=True)
class Scope:
    """A model fingerprint digest and a namespace: what one request's keys share."""

    fingerprint: bytes
    namespace: Namespace

    @classmethod
    def parse(cls, fingerprint: bytes, tenant: str, salt: str) -> Scope:
        """Validate a scope from the wire; raises InvalidKey."""
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise InvalidKey(f"scope fingerprint must be {FINGERPRINT_BYTES} bytes")
        return cls(bytes(fingerprint), Namespace(tenant, salt))

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
