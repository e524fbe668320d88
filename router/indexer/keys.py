"""Chained prefix keys: of prompt text (approximate) and of token blocks (precise).

Both chain like vLLM's block hashes: key i hashes chunk i seeded with key i-1, so two prompts
share key i exactly when they share everything up to the end of chunk i. xxh3-64 keeps it fast
(~10 us for 4 KiB of text) and, unlike `hash()`, equal in every process, so router replicas and
restarts agree.

Token-block keys are the router's own, not vLLM's hashes: vLLM seeds its chain with a value that
depends on PYTHONHASHSEED and its hash function is configurable. The indexer re-derives our keys
from the token ids every `BlockStored` event carries, so no worker setting has to match.

What vLLM hashes besides the tokens of a prompt's first block (its `extra_keys`: the request's
`cache_salt`, a LoRA name) roots the chain (`extra_root`): a salted prompt's keys then differ
from the same tokens' unsalted (or differently salted) keys, as vLLM's cache entries do, so
one tenant's cached prefix never matches another tenant's prompt in the router's indexes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

__all__ = ["text_prefix_keys", "token_block_keys", "ROOT_KEY", "TEXT_CHUNK_CHARS",
           "MAX_TEXT_CHUNKS", "extra_root", "salt_root"]

ROOT_KEY = 0
TEXT_CHUNK_CHARS = 64
# Matching beyond ~32k characters changes no decision but costs time on every request.
MAX_TEXT_CHUNKS = 512

_hash = xxhash.xxh3_64_intdigest


def extra_root(extra: Sequence[object] | None) -> int:
    """The chain's root for a first block hashed with `extra` (vLLM's untagged extra keys of
    that block, as its KV events publish them): `ROOT_KEY` when there are none."""
    if not extra:
        return ROOT_KEY
    return _hash("\x1f".join(map(repr, extra)).encode("utf-8", "surrogatepass"), ROOT_KEY)


def salt_root(cache_salt: str | None) -> int:
    """The root of a prompt sent with `cache_salt` (vLLM's only extra key of a text prompt's
    first block)."""
    return extra_root((cache_salt,) if cache_salt else None)


def text_prefix_keys(text: str, chunk: int = TEXT_CHUNK_CHARS,
                     limit: int = MAX_TEXT_CHUNKS, root: int = ROOT_KEY) -> tuple[int, ...]:
    """Chained keys of the full `chunk`-character pieces of `text` (a partial tail is ignored),
    starting after `root`."""
    data = text.encode("utf-8", "surrogatepass")
    keys: list[int] = []
    key = root
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
