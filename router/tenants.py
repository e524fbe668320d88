"""API keys and the tenants they stand for.

Key file (`--api-keys FILE`), like the kvstore daemon's token file, one key per line (blank
lines and `#` comments ignored)::

    <key> <tenant>
    <key> *          # an operator: may also read /kvkeep/workers and every session

Keys are at least 16 characters; tenants are kvkeep names (1-64 of [A-Za-z0-9._-]). Only a
digest of each key is kept, and a lookup is one dict probe on the digest, so a check takes the
same time whichever characters of a guess were right. Keys given without a tenant (`--api-key`,
`KVKEEP_API_KEYS`) belong to the tenant `default`.

A tenant owns the sessions its requests create, and its requests carry its own vLLM
`cache_salt` (`cache_salt_for`): vLLM mixes the salt into every block hash of the prompt, so
tenants never share prefix-cache entries, and the kvkeep connector puts the salt in the store
namespace, so they never share stored blocks either. Without keys there is one tenant,
`default`, and no salt is set.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvstore.errors import ConfigError, InvalidKey
from kvstore.keys import validate_name

__all__ = ["DEFAULT_TENANT", "OPERATOR", "ApiKeys", "cache_salt_for"]

DEFAULT_TENANT = "default"
"""The tenant of every request when the router has no keys, and of keys given without one."""
OPERATOR = "*"
_MIN_KEY_CHARS = 16


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def cache_salt_for(tenant: str) -> str:
    """The vLLM `cache_salt` the router sets on a tenant's requests: the same on every
    replica, distinct per tenant, and a valid kvkeep name (the connector's namespace)."""
    return "kvkeep-" + hashlib.blake2b(tenant.encode(), digest_size=16,
                                       person=b"kvkeep-tenant").hexdigest()


class ApiKeys:
    """Key digest -> tenant."""

    __slots__ = ("_by_digest", "source")

    def __init__(self, entries: Mapping[str, str], source: str = "api keys") -> None:
        self.source = source
        self._by_digest: dict[bytes, str] = {}
        for i, (key, tenant) in enumerate(entries.items()):
            if len(key) < _MIN_KEY_CHARS or any(c.isspace() for c in key):
                raise ConfigError(f"{source}: key #{i + 1} is shorter than {_MIN_KEY_CHARS} "
                                  "characters or contains whitespace")
            if tenant != OPERATOR:
                try:
                    validate_name(tenant, "tenant")
                except InvalidKey as exc:
                    raise ConfigError(f"{source}: key #{i + 1}: {exc}") from exc
            self._by_digest[_digest(key)] = tenant

    @classmethod
    def load(cls, path: str | Path) -> ApiKeys:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read API key file {path}: {exc}") from exc
        entries: dict[str, str] = {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(f"{path}:{lineno}: expected `<key> <tenant>`")
            key, tenant = parts
            if entries.get(key, tenant) != tenant:
                raise ConfigError(f"{path}:{lineno}: a key maps to one tenant only")
            entries[key] = tenant
        if not entries:
            raise ConfigError(f"API key file {path} holds no keys")
        return cls(entries, str(path))

    @classmethod
    def of_keys(cls, keys: Iterable[str], tenant: str = DEFAULT_TENANT) -> ApiKeys:
        """Keys given without tenants (`--api-key`, `KVKEEP_API_KEYS`): all `tenant`'s."""
        return cls(dict.fromkeys(keys, tenant), "--api-key")

    def merged(self, other: ApiKeys) -> ApiKeys:
        merged = ApiKeys({}, f"{self.source} + {other.source}")
        merged._by_digest = {**self._by_digest, **other._by_digest}
        return merged

    def __len__(self) -> int:
        return len(self._by_digest)

    def tenants(self) -> frozenset[str]:
        return frozenset(self._by_digest.values())

    def tenant_of(self, key: str | None) -> str | None:
        """The tenant of a bearer key, or None for a missing or unknown one."""
        if not key:
            return None
        return self._by_digest.get(_digest(key))


def bearer_tenant(keys: ApiKeys | None, authorization: str | None) -> str | None:
    """The tenant an `Authorization: Bearer KEY` header names: the default tenant when no keys
    are configured, None when keys are configured and the header names none of them. One rule
    for the HTTP front and the Envoy ext_proc picker (which sees the client's headers)."""
    if not keys:
        return DEFAULT_TENANT
    scheme, _, token = (authorization or "").strip().partition(" ")
    return keys.tenant_of(token.strip()) if scheme.lower() == "bearer" else None

