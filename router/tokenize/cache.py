"""The router's cache of tokenized prompts: a request's tokenizer inputs -> its token ids.

Keyed by a 128-bit digest of exactly what the worker's `/tokenize` is given (model, endpoint,
prompt or messages, and every option that changes the rendering), so two requests share an
entry only when the worker would give both the same ids. Values are packed 32-bit ids
(4 bytes a token rather than ~36 in a tuple of ints); the cache is an LRU bounded by the
tokens it holds, so memory stays flat whatever the traffic.

Whole prompts, not prefixes: a BPE tokenization of a prefix is not a prefix of the whole's
(merges cross any cut point, and a chat template renders the last message differently), so
a prefix entry would need the tokenizer's offsets to be cut safely. The prompts that repeat
are what a cache can save: llm-d's benchmark replays its 750 prompts over every stage, and
chat sessions' earlier turns come from their own token ids (`router.indexer.SessionBlocks`).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["TokenCache"]

_ID_MAX = (1 << 32) - 1


@dataclass(slots=True)
class TokenCache:
    """Digest -> token ids, least recently used first out once `capacity_tokens` is passed."""

    capacity_tokens: int = 16_000_000
    hits: int = 0
    misses: int = 0
    _entries: OrderedDict[bytes, array[int]] = field(default_factory=OrderedDict)
    _tokens: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Token ids held now (the memory bound is 4 bytes each, plus an entry's overhead)."""
        return self._tokens

    def get(self, key: bytes) -> tuple[int, ...] | None:
        ids = self._entries.get(key)
        if ids is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return tuple(ids)

    def put(self, key: bytes, tokens: Sequence[int]) -> bool:
        """Keep `tokens` under `key`; False (nothing kept) when they cannot be: more than the
        whole capacity, or an id outside 32 bits."""
        if len(tokens) > self.capacity_tokens or \
                any(t < 0 or t > _ID_MAX for t in tokens):
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self._tokens -= len(old)
        self._entries[key] = array("I", tokens)
        self._tokens += len(tokens)
        while self._tokens > self.capacity_tokens:
            _, evicted = self._entries.popitem(last=False)
            self._tokens -= len(evicted)
        return True
