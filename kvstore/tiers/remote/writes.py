"""Replicated puts: each block to its R best-ranked daemons that are up, in waves.

A wave sends every unfinished block to its next usable daemons in rank order, batched per
daemon and in parallel; a daemon that fails or does not admit a copy hands it to the next in
rank, so a block still gets R copies while one owner is down. Once `sync_needed` daemons have
acknowledged a block the caller has its answer; the rest of its R copies go in the background.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence

from kvstore.errors import KVKeepError
from kvstore.frame import FrameBytes
from kvstore.keys import BlockKey
from kvstore.tiers.remote.calls import put_call
from kvstore.tiers.remote.peers import PeerSet, capture
from kvstore.tiers.remote.placement import rank_many

__all__ = ["put_blocks"]


def put_blocks(peers: PeerSet, items: Sequence[tuple[BlockKey, FrameBytes]], sync_needed: int,
               deadline: float | None) -> list[bool]:
    """Each block to its owners in rank order until `sync_needed` acknowledged it; the rest
    of its R copies in the background. True per block that reached `sync_needed`."""
    if not items:
        return []
    sized = peers.config.batch_deadline(sum(len(frame) for _, frame in items))
    deadline = sized if deadline is None else min(deadline, sized)
    replicas = peers.config.replicas
    rankings = rank_many([key.digest for key, _ in items], peers.members())
    acks = [0] * len(items)
    cursor = [0] * len(items)
    placed = [0] * len(items)
    while True:
        # Assign each unfinished block to its next usable daemons in rank order.
        wave: dict[str, list[int]] = defaultdict(list)
        for i, ranking in enumerate(rankings):
            want = sync_needed - acks[i]
            while want > 0 and cursor[i] < len(ranking) and placed[i] < replicas:
                node = ranking[cursor[i]]
                cursor[i] += 1
                if peers.usable(node):
                    wave[node].append(i)
                    placed[i] += 1
                    want -= 1
        if not wave:
            break
        calls = {node: put_call(peers, node, [items[i] for i in idx], deadline)
                 for node, idx in wave.items()}
        for node, result in peers.fanout(calls).items():
            idx = wave[node]
            if isinstance(result, list):
                for i, ok in zip(idx, result, strict=True):
                    acks[i] += int(ok)
                    placed[i] -= int(not ok)  # not admitted there: the next in rank
            else:
                for i in idx:
                    placed[i] -= 1  # that copy failed: let the next in rank take it
        if time.monotonic() >= deadline:
            break
    if sync_needed < replicas:
        _copy_in_background(peers, items, rankings, acks, cursor, placed)
    results = [a >= sync_needed for a in acks]
    for ok in results:
        peers.count("puts" if ok else "rejected_puts")
    return results


def _copy_in_background(peers: PeerSet, items: Sequence[tuple[BlockKey, FrameBytes]],
                        rankings: list[list[str]], acks: list[int], cursor: list[int],
                        placed: list[int]) -> None:
    """The copies beyond those acknowledged, up to R, of every block stored at least once."""
    background: dict[str, list[int]] = defaultdict(list)
    for i, ranking in enumerate(rankings):
        extra = peers.config.replicas - placed[i]
        while acks[i] and extra > 0 and cursor[i] < len(ranking):
            node = ranking[cursor[i]]
            cursor[i] += 1
            if peers.usable(node):
                background[node].append(i)
                extra -= 1
    for node, idx in background.items():
        # Copies, since the caller may reuse its buffers as soon as we return.
        batch = [(items[i][0], bytes(items[i][1])) for i in idx]
        peers.submit(_background_put, peers, node, batch)


def _background_put(peers: PeerSet, node: str, batch: list[tuple[BlockKey, bytes]]) -> None:
    deadline = peers.config.batch_deadline(sum(len(frame) for _, frame in batch))
    result = capture(put_call(peers, node, list(batch), deadline))
    if isinstance(result, KVKeepError):
        raise result
