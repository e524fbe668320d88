"""BlockKeys by scope and block hash, so repeated requests skip key construction."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.keys import BlockKey
from kvstore.net.scope import Scope

__all__ = ["KeyCache"]


class KeyCache:
    """Interned BlockKeys per (scope, block hash).

    Building a BlockKey (validation and a blake2b digest) costs ~2 us; routers and schedulers
    ask about the same prefixes over and over, and a 1,000-key lookup must take milliseconds.
    Puts take their keys from here too, so the keys the tiers hold are these very objects and
    their dict lookups usually succeed on an identity test (no Python-level __eq__).
    Bounded: cleared whole when it reaches `limit` keys (no LRU bookkeeping on the hot path).
    Thread-safe (both fronts' threads and the event loop share it).
    """

    def __init__(self, limit: int = 1 << 20) -> None:
        self._limit = limit
        self._size = 0
        self._by_scope: dict[tuple[bytes, str, str], dict[bytes, BlockKey]] = {}
        self._lock = threading.Lock()

    def keys(self, scope: Scope, hashes: Sequence[bytes]) -> list[BlockKey]:
        """The keys of `hashes` in `scope`; raises InvalidKey for a malformed hash."""
        ident = (scope.fingerprint, scope.namespace.tenant, scope.namespace.salt)
        with self._lock:
            cache = self._by_scope.get(ident)
            if cache is None:
                cache = self._by_scope[ident] = {}
            get = cache.get
            out = [get(raw) for raw in hashes]
            # (`None in out` would call BlockKey.__eq__ on every element.)
            missing = [i for i, key in enumerate(out) if key is None]
            for i in missing:
                raw = hashes[i]
                if self._size >= self._limit:
                    self._by_scope = {ident: {}}
                    cache = self._by_scope[ident]
                    self._size = 0
                key = cache.get(raw)
                if key is None:
                    key = cache[raw] = scope.key(bytes(raw))
                    self._size += 1
                out[i] = key
            return out  # type: ignore[return-value]
