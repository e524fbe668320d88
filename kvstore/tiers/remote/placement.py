"""Rendezvous (highest-random-weight) hashing: which daemons hold a block.

Every client and daemon computes the same ranking from the key digest and the set of live node
ids alone, with no coordination. When a node leaves, only the blocks it held change owners (each
moves to the next node in its own ranking); when one joins, it takes over exactly the blocks for
which it now ranks in the top R. That is what keeps re-replication proportional to the lost data.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import xxhash

__all__ = ["node_seed", "rank", "rank_many", "place"]


@functools.lru_cache(maxsize=4096)
def node_seed(node_id: str) -> int:
    """A 64-bit seed per node; the score of (node, key) is xxh3_64(key, seed)."""
    return int(xxhash.xxh3_64_intdigest(node_id.encode()))


def rank(key_digest: bytes, nodes: Iterable[str]) -> list[str]:
    """All `nodes`, best first, for `key_digest`. Ties (never seen in practice) break by id."""
    score = xxhash.xxh3_64_intdigest
    scored = sorted(((score(key_digest, seed=node_seed(n)), n) for n in nodes), reverse=True)
    return [n for _, n in scored]


def rank_many(key_digests: Iterable[bytes], nodes: Iterable[str], depth: int | None = None
              ) -> list[list[str]]:
    """`rank` for many keys at once (seeds computed once): the first `depth` of each ranking.

    Batched lookups rank 1,000 keys per call, so this is on the lookup's latency path: one
    node needs no hashing at all, and the general case sorts the nodes by a key function
    rather than building tuples (same order: the nodes start in descending id order and the
    sort is stable, so ties still break by id, descending, as in `rank`).
    """
    ordered = sorted(nodes, reverse=True)
    if len(ordered) <= 1:
        return [ordered[:depth] for _ in key_digests]
    seeds = {n: node_seed(n) for n in ordered}
    score = xxhash.xxh3_64_intdigest
    out = []
    for digest in key_digests:
        ranking = sorted(ordered, key=lambda n: score(digest, seed=seeds[n]), reverse=True)
        out.append(ranking[:depth])
    return out


def place(key_digest: bytes, nodes: Iterable[str], replicas: int) -> list[str]:
    """The `replicas` best nodes for a key (fewer if fewer nodes exist)."""
    return rank(key_digest, nodes)[:replicas]
