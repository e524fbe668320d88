"""Approximate prefix index: which worker this router sent which prompt prefixes to.

Like llm-d's approximate prefix scorer and SGLang's per-worker radix tree, it guesses a worker's
cache from the router's own routing history: no worker cooperation needed, but blind to
evictions and to other replicas' traffic. The precise index (`events.py`) corrects both where
workers publish KV events; this one covers workers that do not, and chat prompts whose token
ids the router does not know.

Bounded: an LRU over prefix keys, so memory stays flat however many sessions pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from router.membership.workers import WorkerId

__all__ = ["RoutingHistory", "SessionBlocks", "longest_prefix", "session_scope"]


def session_scope(tenant: str, session_id: str) -> str:
    """The key of a session's record in `SessionBlocks`: per tenant, so that nothing of one
    tenant's session is ever read for another tenant's request."""
    return f"{tenant}\x00{session_id}"


def longest_prefix(keys: Sequence[int], holders_of: Mapping[int, Iterable[WorkerId]]
                   ) -> dict[WorkerId, int]:
    """For each worker, how many leading `keys` it holds consecutively (0 is left out).

    Walks the chain once, keeping the set of workers that matched every key so far; a worker's
    count is fixed when it drops out. Cost is O(keys x holders) set work, not O(keys x workers)
    dict writes, which keeps a 64-worker decision in microseconds.
    """
    result: dict[WorkerId, int] = {}
    alive: set[WorkerId] | None = None
    matched = 0
    for key in keys:
        holders = holders_of.get(key)
        if not holders:
            break
        now = set(holders) if alive is None else alive.intersection(holders)
        if not now:
            break
        if alive is not None:
            for gone in alive - now:
                result[gone] = matched
        alive = now
        matched += 1
    if alive:
        for worker in alive:
            result[worker] = matched
    return result


@dataclass(slots=True)
class RoutingHistory:
    """Prefix key -> workers a request with that prefix was routed to (LRU-bounded)."""

    capacity: int = 1_000_000
    _holders: OrderedDict[int, set[WorkerId]] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, keys: Sequence[int], worker: WorkerId) -> None:
        holders = self._holders
        for key in keys:
            entry = holders.get(key)
            if entry is None:
                holders[key] = {worker}
            else:
                entry.add(worker)
                holders.move_to_end(key)
        while len(holders) > self.capacity:
            holders.popitem(last=False)

    def match(self, keys: Sequence[int]) -> dict[WorkerId, int]:
        return longest_prefix(keys, self._holders)

    def forget_worker(self, worker: WorkerId) -> None:
        """A worker died: its cache is gone. O(entries), but only on a membership change."""
        empty = []
        for key, entry in self._holders.items():
            entry.discard(worker)
            if not entry:
                empty.append(key)
        for key in empty:
            del self._holders[key]


@dataclass(slots=True)
class SessionBlocks:
    """A session's token-block keys from its last turn (prompt + output ids), LRU-bounded.

    The next turn's prompt starts with those tokens, so these keys are that prompt's precise
    prefix even when the router cannot tokenize it (chat templates, no tokenizer configured).
    Local to a replica: another replica falls back to approximate matching for a turn.
    """

    capacity: int = 100_000
    max_keys: int = 4_000_000
    """Keys of all sessions together (each a Python int, ~40 B): the memory bound."""
    max_keys_per_session: int = 8192
    """A longer session keeps its first this many (the prefix is what is matched)."""
    _keys: OrderedDict[str, tuple[int, ...]] = field(default_factory=OrderedDict)
    _total: int = 0

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def total_keys(self) -> int:
        return self._total

    def get(self, session_id: str) -> tuple[int, ...]:
        keys = self._keys.get(session_id)
        if keys is None:
            return ()
        self._keys.move_to_end(session_id)
        return keys

    def put(self, session_id: str, keys: tuple[int, ...]) -> None:
        keys = keys[:self.max_keys_per_session]
        old = self._keys.get(session_id)
        self._total += len(keys) - (len(old) if old is not None else 0)
        self._keys[session_id] = keys
        self._keys.move_to_end(session_id)
        while len(self._keys) > self.capacity or self._total > self.max_keys:
            _, dropped = self._keys.popitem(last=False)
            self._total -= len(dropped)
