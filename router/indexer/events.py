"""Precise prefix index: which worker (and tier) holds which token block, from KV events.

vLLM publishes `BlockStored` / `BlockRemoved` / `AllBlocksCleared` for its cache (and a store or
offloading connector can publish the same for CPU and storage tiers, with `medium` set). Each
stored block is re-keyed with the router's own chained key (`keys.token_block_keys`), derived
from the event's token ids and its parent's key, so lookups need no knowledge of the worker's
hash function or seed. A block whose parent the index never saw (a missed event) is skipped:
an under-estimate, never a false match.

Tiers weigh differently, as in llm-d's precise scorer: a block in device memory is a free hit,
one in host memory costs a copy (0.8), one in storage a read (0.5).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.indexer.keys import ROOT_KEY, token_block_keys
from router.workers import WorkerId

__all__ = ["KVBlockIndex", "MEDIUM_WEIGHTS"]

MEDIUM_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
_MEDIUM_BITS = {"GPU": 1, "CPU": 2, "STORAGE": 4}
_BIT_WEIGHTS = {bit: MEDIUM_WEIGHTS[m] for m, bit in _MEDIUM_BITS.items()}


def _bits(medium: object) -> int:
    # vLLM leaves medium unset for its own device cache.
    return _MEDIUM_BITS.get(str(medium).upper(), 1) if medium is not None else 1


def _weight(mask: int) -> float:
    return max((w for bit, w in _BIT_WEIGHTS.items() if mask & bit), default=0.0)


@dataclass(slots=True)
class _WorkerBlocks:
    # vLLM's block hash -> our chained key, to find parents and to apply removals.
    by_hash: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class KVBlockIndex:
    """Block key -> {worker: tier bitmask}, maintained from each worker's KV events."""

    block_size: int = 32
    _holders: dict[int, dict[WorkerId, int]] = field(default_factory=dict)
    _workers: dict[WorkerId, _WorkerBlocks] = field(default_factory=dict)
    events_applied: int = 0
    blocks_skipped: int = 0

    def __len__(self) -> int:
        return len(self._holders)

    def keys_for(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return token_block_keys(tokens, self.block_size)

    def match(self, keys: Sequence[int]) -> dict[WorkerId, float]:
        """Per worker, the tier-weighted count of leading `keys` it holds consecutively."""
        result: dict[WorkerId, float] = {}
        alive: dict[WorkerId, float] | None = None
        for key in keys:
            holders = self._holders.get(key)
            if not holders:
                break
            if alive is None:
                now = {w: _weight(mask) for w, mask in holders.items()}
            else:
                now = {w: score + _weight(holders[w]) for w, score in alive.items()
                       if w in holders}
                for gone in alive.keys() - now.keys():
                    result[gone] = alive[gone]
            if not now:
                alive = None
                break
            alive = now
        if alive:
            result.update(alive)
        return result

    def apply(self, worker: WorkerId, event: Mapping[str, Any]) -> None:
        """Apply one decoded vLLM KV event (a msgpack map with a `type` tag)."""
        kind = event.get("type")
        if kind == "BlockStored":
            self._stored(worker, event)
        elif kind == "BlockRemoved":
            self._removed(worker, event)
        elif kind == "AllBlocksCleared":
            self.forget_worker(worker)
        else:
            return
        self.events_applied += 1

    def forget_worker(self, worker: WorkerId) -> None:
        blocks = self._workers.pop(worker, None)
        if blocks is None:
            return
        for key in set(blocks.by_hash.values()):
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(worker, None)
                if not holders:
                    del self._holders[key]

    def holds(self, worker: WorkerId, key: int) -> bool:
        return worker in self._holders.get(key, {})

    def _stored(self, worker: WorkerId, event: Mapping[str, Any]) -> None:
        hashes: list[int] = list(event.get("block_hashes") or ())
        tokens: list[int] = list(event.get("token_ids") or ())
        size = int(event.get("block_size") or self.block_size)
        parent_hash = event.get("parent_block_hash")
        blocks = self._workers.setdefault(worker, _WorkerBlocks())
        if parent_hash is None:
            parent = ROOT_KEY
        else:
            found = blocks.by_hash.get(_as_int(parent_hash))
            if found is None:
                self.blocks_skipped += len(hashes)
                return
            parent = found
        if size != self.block_size or len(tokens) < len(hashes) * size:
            # Another block size cannot be matched against our keys; skip rather than guess.
            self.blocks_skipped += len(hashes)
            return
        keys = token_block_keys(tokens[: len(hashes) * size], size, parent)
        bits = _bits(event.get("medium"))
        for vllm_hash, key in zip(hashes, keys, strict=True):
            blocks.by_hash[_as_int(vllm_hash)] = key
            holders = self._holders.setdefault(key, {})
            holders[worker] = holders.get(worker, 0) | bits

    def _removed(self, worker: WorkerId, event: Mapping[str, Any]) -> None:
        blocks = self._workers.get(worker)
        if blocks is None:
            return
        bits = _bits(event.get("medium"))
        for vllm_hash in event.get("block_hashes") or ():
            key = blocks.by_hash.get(_as_int(vllm_hash))
            if key is None:
                continue
            holders = self._holders.get(key)
            if holders is None or worker not in holders:
                continue
            mask = holders[worker] & ~bits
            if mask:
                holders[worker] = mask
            else:
                del holders[worker]
                blocks.by_hash.pop(_as_int(vllm_hash), None)
                if not holders:
                    del self._holders[key]


def _as_int(value: object) -> int:
    """vLLM sends hashes as 64-bit ints by default, as bytes when configured to."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value[:8], "big")
    if isinstance(value, int):
        return value
    return int(str(value))
