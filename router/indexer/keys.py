"""Chained prefix keys: of prompt text (approximate) and of token blocks (precise).

Both chain like vLLM's block hashes: key i hashes chunk i seeded with key i-1, so two prompts
share key i exactly when they share everything up to the end of chunk i. xxh3-64 keeps it fast
(~10 us for 4 KiB of text) and, unlike `hash()`, equal in every process, so router replicas and
restarts agree.

Token-block keys are the router's own, not vLLM's hashes: vLLM seeds its chain with a value that
depends on PYTHONHASHSEED and its hash function is configurable. The indexer re-derives our keys
from the token ids every `BlockStored` event carries, so no worker setting has to match.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

__all__ = ["text_prefix_keys", "token_block_keys", "ROOT_KEY", "TEXT_CHUNK_CHARS",
           "MAX_TEXT_CHUNKS"]

ROOT_KEY = 0
TEXT_CHUNK_CHARS = 64
# Matching beyond ~32k characters changes no decision but costs time on every request.
MAX_TEXT_CHUNKS = 512

_hash = xxhash.xxh3_64_intdigest


def text_prefix_keys(text: str, chunk: int = TEXT_CHUNK_CHARS,
                     limit: int = MAX_TEXT_CHUNKS) -> tuple[int, ...]:
    """Chained keys of the full `chunk`-character pieces of `text` (a partial tail is ignored)."""
    data = text.encode("utf-8", "surrogatepass")
    keys: list[int] = []
    key = ROOT_KEY
    # Chunk the UTF-8 bytes, not characters: cheaper and still deterministic.
    end = min(len(data) // chunk, limit) * chunk
    for start in range(0, end, chunk):
        key = _hash(data[start:start + chunk], key)
        keys.append(key)
    return tuple(keys)


def token_block_keys(tokens: Sequence[int], block_size: int, parent: int = ROOT_KEY
                     ) -> tuple[int, ...]:
    """Chained keys of the full `block_size`-token blocks of `tokens`, starting after `parent`."""
    keys: list[int] = []
    key = parent
    end = len(tokens) // block_size * block_size
    for start in range(0, end, block_size):
        key = _hash(array("q", tokens[start:start + block_size]).tobytes(), key)
        keys.append(key)
    return tuple(keys)
