"""Bearer tokens that map to tenants, and the checks every daemon call makes.

Token file format, one token per line (blank lines and `#` comments ignored)::

    <token> <tenant>[,<tenant>...]
    <token> *            # all tenants: for peer daemons (re-replication) and operators

Tokens are at least 16 characters. Only a digest of each token is kept in memory, and lookups
go through a dict of digests, so the time a check takes does not depend on how many leading
characters of a guess were right.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvstore.cluster.tokens import token_lines
from kvstore.errors import ConfigError
from kvstore.keys import validate_name

__all__ = ["ALL_TENANTS", "ANONYMOUS", "Principal", "TokenTable", "AuthFailure", "bearer_token"]

ALL_TENANTS = "*"
_MIN_TOKEN_CHARS = 16


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a call is made by: the tenants its token may touch."""

    name: str
    tenants: frozenset[str]

    @property
    def is_peer(self) -> bool:
        return ALL_TENANTS in self.tenants

    def may_access(self, tenant: str) -> bool:
        return ALL_TENANTS in self.tenants or tenant in self.tenants


ANONYMOUS = Principal("anonymous", frozenset({ALL_TENANTS}))
"""The principal of every call when auth is off (the daemon then listens on loopback only)."""


@dataclass(frozen=True, slots=True)
class AuthFailure:
    """Why a call is refused: `unauthenticated` (no or unknown token) or `denied` (tenant)."""

    kind: str
    message: str


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenTable:
    """The parsed token file."""

    def __init__(self, entries: Mapping[str, Iterable[str]]) -> None:
        self._by_digest: dict[bytes, Principal] = {}
        for i, (token, tenants) in enumerate(entries.items()):
            if len(token) < _MIN_TOKEN_CHARS or any(c.isspace() for c in token):
                raise ConfigError(f"token #{i + 1} is shorter than {_MIN_TOKEN_CHARS} characters "
                                  "or contains whitespace")
            names = frozenset(tenants)
            if not names:
                raise ConfigError(f"token #{i + 1} grants no tenant")
            for name in names - {ALL_TENANTS}:
                validate_name(name, "tenant")
            self._by_digest[_digest(token)] = Principal(f"token#{i + 1}", names)

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        entries: dict[str, list[str]] = {}
        for lineno, parts in token_lines(path, "token file"):  # kvstore/cluster/tokens.py
            if len(parts) != 2:
                raise ConfigError(f"{path}:{lineno}: expected `<token> <tenant>[,<tenant>...]`")
            token, tenants = parts
            entries.setdefault(token, []).extend(t for t in tenants.split(",") if t)
        if not entries:
            raise ConfigError(f"token file {path} holds no tokens")
        return cls(entries)

    def __len__(self) -> int:
        return len(self._by_digest)

    def authenticate(self, token: str | None) -> Principal | AuthFailure:
        if not token:
            return AuthFailure("unauthenticated", "missing bearer token")
        principal = self._by_digest.get(_digest(token))
        if principal is None:
            return AuthFailure("unauthenticated", "unknown bearer token")
        return principal


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` header, if there is one."""
    for name, value in metadata or ():
        if name.lower() == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None
