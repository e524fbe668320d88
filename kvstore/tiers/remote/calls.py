"""The remote tier's calls to one daemon, each a thunk for `PeerSet.fanout`.

A thunk groups its keys by scope (one daemon call per scope), checks the daemon's breaker when
it runs (not when it is built), and spends at most what is left of the deadline it was given.
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.errors import CorruptBlock
from kvstore.frame import BlockRead, FrameBytes
from kvstore.keys import BlockKey, SessionKey
from kvstore.manifest import SessionRecord
from kvstore.net.scope import group_by_scope
from kvstore.tiers.base import Buffer
from kvstore.tiers.remote.peers import PeerSet, call_timeout

__all__ = ["delete_call", "get_into_call", "lookup_call", "manifest_delete_call",
           "manifest_get_call", "manifest_put_call", "put_call"]


def lookup_call(peers: PeerSet, node: str, keys: list[BlockKey], deadline: float
                ) -> Callable[[], list[bool]]:
    def call() -> list[bool]:
        peer = peers.checked(node)
        hits = [False] * len(keys)
        for scope, idx in group_by_scope(keys).items():
            timeout = call_timeout(deadline, peers.config.lookup_timeout)
            flags = peers.guard(peer, peer.client.lookup, scope,
                                [keys[i].block_hash for i in idx], timeout=timeout)
            for i, hit in zip(idx, flags, strict=True):
                hits[i] = hit
        return hits
    return call


def get_into_call(peers: PeerSet, node: str, keys: list[BlockKey], outs: list[Buffer | None],
                  deadline: float) -> Callable[[], list[BlockRead | None]]:
    """Whole blocks from one daemon, batched (its client's `get_into`: one GET_MANY request a
    window over the data plane), each payload into its buffer; per key the read or None. Reads
    over the data plane come back verified for their keys where they passed (checked as they
    arrive), others unverified: the tier verifies what is not marked."""
    def call() -> list[BlockRead | None]:
        peer = peers.checked(node)
        reads: list[BlockRead | None] = [None] * len(keys)
        for scope, idx in group_by_scope(keys).items():
            timeout = call_timeout(deadline, peers.config.call_timeout)
            got = peers.guard(peer, peer.client.get_into, scope,
                              [(keys[i].block_hash, outs[i]) for i in idx], timeout=timeout,
                              digests=[keys[i].digest for i in idx])
            for i, read in zip(idx, got, strict=True):
                reads[i] = read
        return reads
    return call


def put_call(peers: PeerSet, node: str, items: list[tuple[BlockKey, FrameBytes]],
             deadline: float) -> Callable[[], list[bool]]:
    def call() -> list[bool]:
        peer = peers.checked(node)
        admitted = [False] * len(items)
        for scope, idx in group_by_scope([k for k, _ in items]).items():
            batch = [(items[i][0].block_hash, items[i][1]) for i in idx]
            flags = peers.with_retry(peer, deadline, peer.client.put, scope, batch)
            for i, ok in zip(idx, flags, strict=True):
                admitted[i] = ok
        return admitted
    return call


def delete_call(peers: PeerSet, node: str, keys: list[BlockKey], deadline: float
                ) -> Callable[[], int]:
    def call() -> int:
        peer = peers.checked(node)
        total = 0
        for scope, idx in group_by_scope(keys).items():
            timeout = call_timeout(deadline, peers.config.call_timeout)
            total += peers.guard(peer, peer.client.delete, scope,
                                 [keys[i].block_hash for i in idx], timeout=timeout)
        return total
    return call


def manifest_put_call(peers: PeerSet, node: str, record: SessionRecord, deadline: float
                      ) -> Callable[[], bool]:
    def call() -> bool:
        peer = peers.checked(node)
        peers.with_retry(peer, deadline, peer.client.put_manifest, record)
        return True
    return call


def manifest_get_call(peers: PeerSet, node: str, key: SessionKey, deadline: float
                      ) -> Callable[[], SessionRecord | None]:
    def call() -> SessionRecord | None:
        peer = peers.checked(node)
        timeout = call_timeout(deadline, peers.config.call_timeout)
        try:
            return peers.guard(peer, peer.client.get_manifest, key, timeout=timeout)
        except CorruptBlock:
            peers.count("corrupt")
            return None
    return call


def manifest_delete_call(peers: PeerSet, node: str, key: SessionKey, deadline: float
                         ) -> Callable[[], bool]:
    def call() -> bool:
        peer = peers.checked(node)
        timeout = call_timeout(deadline, peers.config.call_timeout)
        return peers.guard(peer, peer.client.delete_manifest, key, timeout=timeout)
    return call
