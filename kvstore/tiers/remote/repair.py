"""Read repair: a read that found a block's owners lacking it, or holding it corrupt, copies the
good copy to them in the background. (A manifest read repairs its lagging owners itself,
before it returns: `RemoteTier.get_manifest`.)

The source copy is read again and verified in full before it is written anywhere: a repair
never spreads a copy it has not checked.
"""

from __future__ import annotations

import time

from kvstore.keys import BlockKey
from kvstore.net.scope import scope_of
from kvstore.tiers.remote.peers import PeerSet, call_timeout

__all__ = ["repair_block"]


def repair_block(peers: PeerSet, owners: list[str], key: BlockKey, source: str,
                 lacking: list[str], corrupt: list[str]) -> None:
    """Schedule copying `key` from `source` to those of `owners` that lack it or hold it
    corrupt."""
    targets = [n for n in lacking + corrupt if n in owners]
    if targets:
        peers.submit(_copy_block, peers, key, source, targets, set(corrupt))


def _copy_block(peers: PeerSet, key: BlockKey, source: str, targets: list[str],
                corrupt: set[str]) -> None:
    """Copy the whole block from `source` to `targets` (deleting corrupt copies first)."""
    cap = peers.config.call_timeout
    deadline = time.monotonic() + cap
    scope = scope_of(key)
    peer = peers.checked(source)
    read = peers.guard(peer, peer.client.get, scope, key.block_hash, None,
                       timeout=call_timeout(deadline, cap))
    if read is None:
        return
    read.verify()
    read.verify_key(key.digest)
    frame = read.to_frame()
    for node in targets:
        target = peers.checked(node)
        if node in corrupt:
            peers.guard(target, target.client.delete, scope, [key.block_hash],
                        timeout=call_timeout(deadline, cap))
        stored = peers.guard(target, target.client.put, scope, [(key.block_hash, frame)],
                             timeout=call_timeout(deadline, cap))
        if all(stored):
            peers.count("repairs")


