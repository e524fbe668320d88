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
    Puts look their keys up here but do not add them (`remember=False`): a stream of new blocks
    would otherwise fill the cache with keys asked for once.
    Bounded: cleared whole when it reaches `limit` keys (no LRU bookkeeping on the hot path).
    The default, 64 Ki keys, is ~20 MiB at most (a key and its entries take ~300 bytes), and
    covers the prefixes a node's routers and schedulers ask about over and over; 1 Mi keys
    used to let a daemon grow by ~300 MiB of keys asked for once (issue 13 item 11).
    Thread-safe (both fronts' threads and the event loop share it).
    """

    def __init__(self, limit: int = 1 << 16) -> None:
        self._limit = limit
        self._size = 0
        self._by_scope: dict[tuple[bytes, str, str], dict[bytes, BlockKey]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return self._size

    def keys(self, scope: Scope, hashes: Sequence[bytes], *, remember: bool = True
             ) -> list[BlockKey]:
        """The keys of `hashes` in `scope`; raises InvalidKey for a malformed hash."""
        ident = (scope.fingerprint, scope.namespace.tenant, scope.namespace.salt)
        with self._lock:
            cache = self._by_scope.get(ident)
            if cache is None:
                if not remember:
                    return scope.keys([bytes(raw) for raw in hashes])
                if self._size >= self._limit:
                    self._by_scope, self._size = {}, 0
                cache = self._by_scope[ident] = {}
                self._size += 1  # scopes count too: a stream of new ones is bounded alike
            get = cache.get
            out = [get(raw) for raw in hashes]
            # (`None in out` would call BlockKey.__eq__ on every element.)
            missing = [i for i, key in enumerate(out) if key is None]
            if not remember:
                for i in missing:
                    out[i] = scope.key(bytes(hashes[i]))
                return out  # type: ignore[return-value]
            for i in missing:
                raw = hashes[i]
                if self._size >= self._limit:
                    self._by_scope = {ident: {}}
                    cache = self._by_scope[ident]
                    self._size = 1
                key = cache.get(raw)
                if key is None:
                    key = cache[raw] = scope.key(bytes(raw))
                    self._size += 1
                out[i] = key
            return out  # type: ignore[return-value]
