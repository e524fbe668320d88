"""Synthetic token ids, their chained block hashes, and their rendering as pseudo-text.

Block hashes chain like vLLM's (block i hashes its tokens seeded with block i-1's hash), so
two sequences share block i exactly when they share every token up to its end. They are the
engine's own and never the router's: the router re-derives its keys from the token ids that
KV events carry, as it does with a real vLLM.

`TextRenderer` turns token ids into text of exactly `CHARS_PER_TOKEN` characters per token,
injectively, so that equal text prefixes are equal token prefixes: the router's text keys
(64-character chunks) then see what they would see of a real tokenizer's output, and its
4-characters-a-token estimate is exact.
"""

from __future__ import annotations

import numpy as np
import xxhash

__all__ = ["block_hashes", "TextRenderer", "CHARS_PER_TOKEN", "ROOT_HASH"]

ROOT_HASH = 0
CHARS_PER_TOKEN = 4
_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
_hash = xxhash.xxh3_64_intdigest


def block_hashes(tokens: np.ndarray, block_size: int, parent: int = ROOT_HASH,
                 start_block: int = 0) -> list[int]:
    """Chained hashes of the full blocks of `tokens` from block `start_block` on, the chain
    continuing from `parent` (the hash of block `start_block - 1`)."""
    out: list[int] = []
    key = parent
    data = np.ascontiguousarray(tokens, dtype=np.int64)
    for b in range(start_block, len(data) // block_size):
        key = _hash(data[b * block_size:(b + 1) * block_size].tobytes(), key)
        out.append(key)
    return out


class TextRenderer:
    """Token id -> 4 characters of [a-zA-Z0-9]; 62^4 covers any real vocabulary."""

    __slots__ = ("_table",)
    _table: np.ndarray

    def __init__(self, vocab: int) -> None:
        n = len(_ALPHABET)
        if vocab > n ** CHARS_PER_TOKEN:
            raise ValueError(f"vocabulary of {vocab} does not fit {CHARS_PER_TOKEN} characters")
        a = np.frombuffer(_ALPHABET.encode("ascii"), dtype=np.uint8)
        ids = np.arange(vocab, dtype=np.int64)
        digits = [a[ids // (n ** k) % n] for k in range(CHARS_PER_TOKEN - 1, -1, -1)]
        self._table = np.stack(digits, axis=1).copy()  # [vocab, 4] ASCII codes

    def render(self, tokens: np.ndarray) -> str:
        return self._table[np.asarray(tokens, dtype=np.int64)].tobytes().decode("ascii")
