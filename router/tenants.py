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
`cache_salt` (`ApiKeys.cache_salt`): vLLM mixes the salt into every block hash of the prompt,
so tenants never share prefix-cache entries, and the kvkeep connector puts the salt in the
store namespace, so they never share stored blocks either. Without keys there is one tenant,
`default`, and no salt is set.

A salt is an HMAC of the tenant name under a secret no tenant holds, so no tenant can compute
another's and set it on a path that passes salts through (trust-review H5: a public function of
the name let tenant A send B's salt and read B's cache hits). The secret is the salt key file
(`--cache-salt-key-file`, kvstore/mac.py's format) when one is given: the same file on every
replica gives the same salts. Without one, a tenant's salt is keyed by the digests of its own
API keys: the same on every replica that loads the same key file, and across restarts (a
per-process random secret would give every restart and every replica other salts, so stored
blocks, namespaced by the salt, would never be found again), but a tenant whose keys change
gets a new salt and so a cold cache. Only a holder of one of the tenant's keys (the tenant
itself) could compute that salt.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path

from kvstore.cluster.tokens import token_lines
from kvstore.errors import ConfigError, InvalidKey
from kvstore.keys import validate_name

__all__ = ["DEFAULT_TENANT", "OPERATOR", "ApiKeys", "bearer_tenant"]

DEFAULT_TENANT = "default"
"""The tenant of every request when the router has no keys, and of keys given without one."""
OPERATOR = "*"
_MIN_KEY_CHARS = 16


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


_SALT_PERSON = b"kvkeep-salt/v2\x00"


class ApiKeys:
    """Key digest -> tenant, and each tenant's cache salt."""

    __slots__ = ("_by_digest", "_salt_key", "_salts", "source")

    def __init__(self, entries: Mapping[str, str], source: str = "api keys", *,
                 salt_key: bytes | None = None) -> None:
        self.source = source
        self._by_digest: dict[bytes, str] = {}
        self._salt_key = salt_key
        self._salts: dict[str, str] = {}
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
        entries: dict[str, str] = {}
        for lineno, parts in token_lines(path, "API key file"):  # kvstore/cluster/tokens.py
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
        merged = ApiKeys({}, f"{self.source} + {other.source}",
                         salt_key=self._salt_key or other._salt_key)
        merged._by_digest = {**self._by_digest, **other._by_digest}
        return merged

    def with_salt_key(self, secret: bytes) -> ApiKeys:
        """These keys, their salts keyed by `secret` (the salt key file's)."""
        keyed = ApiKeys({}, self.source, salt_key=secret)
        keyed._by_digest = dict(self._by_digest)
        return keyed

    def cache_salt(self, tenant: str) -> str:
        """The vLLM `cache_salt` the router sets on `tenant`'s requests: distinct per tenant,
        not computable without the secret (see the module docstring), the same on every
        replica with the same key files, and a valid kvkeep name (the connector's
        namespace)."""
        salt = self._salts.get(tenant)
        if salt is None:
            secret = self._salt_key
            if secret is None:
                # The tenant's own key digests: what only the tenant (and this file) knows.
                own = sorted(d for d, t in self._by_digest.items() if t == tenant)
                secret = hashlib.sha256(_SALT_PERSON + b"".join(own)).digest()
            salt = "kvkeep-" + hmac.new(secret, _SALT_PERSON + tenant.encode(),
                                        hashlib.sha256).hexdigest()[:32]
            self._salts[tenant] = salt
        return salt

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

