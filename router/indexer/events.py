"""Precise prefix index: which worker (and tier) holds which token block, from KV events.

vLLM publishes `BlockStored` / `BlockRemoved` / `AllBlocksCleared` for its cache (and a store or
offloading connector can publish the same for CPU and storage tiers, with `medium` set). Each
stored block is re-keyed with the router's own chained key (`keys.token_block_keys`), derived
from the event's token ids and its parent's key, so lookups need no knowledge of the worker's
hash function or seed. A block whose parent the index never saw (a missed event) is skipped:
an under-estimate, never a false match.

Tiers weigh differently, as in llm-d's precise scorer: a block in device memory is a free hit,
one in host memory costs a copy (0.8), one in storage a read (0.5).

The kvkeep connector publishes the blocks it has checkpointed, through the same vLLM event
stream, with medium `KVKEEP_LOCAL` (a store on that worker's node: storage, for that worker) or
`KVKEEP_SHARED` (a store with remote daemons: any worker can restore the block, so it counts
for every worker, at the storage weight). A worker's own cached block and the shared store's
copy chain together: a worker that holds blocks 0-3 on its GPU and finds 4-7 in the store
scores 4 x 1.0 + 4 x 0.5. The store evicts silently, so shared entries are hints kept for at
most `shared_capacity` blocks (oldest forgotten first); a stale hint costs a restore miss and a
recompute, never wrong KV (the connector verifies every block it loads).

Keys are rooted in what vLLM hashed besides the tokens of a prompt's first block (the event's
`extra_keys`: a tenant's `cache_salt`), so a tenant's blocks match only its own prompts; a
later block hashed with extra keys (multimodal inputs) ends the chain, since token ids alone
cannot say what it holds. A worker's entries are capped (`max_blocks_per_worker`): a worker
that announces more than that (vLLM removes what it evicts) has the excess dropped and
counted, so a hostile or broken event stream cannot grow the index without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.indexer.keys import extra_root, salt_root, token_block_keys
from router.indexer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from router.membership.workers import WorkerId

__all__ = ["KVBlockIndex", "MEDIUM_WEIGHTS", "SHARED"]

MEDIUM_WEIGHTS: Mapping[str, float] = {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
_MEDIUM_BITS = {"GPU": 1, "CPU": 2, "STORAGE": 4, "KVKEEP_LOCAL": 4}
_BIT_WEIGHTS = {bit: MEDIUM_WEIGHTS[m] for m, bit in _MEDIUM_BITS.items() if m in MEDIUM_WEIGHTS}
_STORAGE_BIT = _MEDIUM_BITS["STORAGE"]
SHARED_MEDIUM = "KVKEEP_SHARED"
SHARED = WorkerId("*shared-store*")
"""The holder of blocks in a store every worker can read; `match` reports its chain under this
name, the score of any worker that holds nothing itself."""


def _bits(medium: object) -> int:
    # vLLM leaves medium unset for its own device cache; a medium we do not know is counted
    # as the dearest tier (storage), never as a free hit.
    if medium is None:
        return 1
    return _MEDIUM_BITS.get(str(medium).upper(), 4)


def _weight(mask: int, storage: float | None = None) -> float:
    """The best tier `mask` names; `storage` replaces the storage tier's weight."""
    if storage is None:
        return max((w for bit, w in _BIT_WEIGHTS.items() if mask & bit), default=0.0)
    return max((storage if bit == _STORAGE_BIT else w for bit, w in _BIT_WEIGHTS.items()
                if mask & bit), default=0.0)


@dataclass(slots=True)
class _WorkerBlocks:
    # vLLM's block hash -> our chained key, to find parents and to apply removals.
    by_hash: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class KVBlockIndex:
    """Block key -> {worker: tier bitmask}, maintained from each worker's KV events."""

    block_size: int = 32
    shared_capacity: int = 1_000_000
    max_blocks_per_worker: int = 262_144
    on_over_cap: Callable[[int], None] | None = field(default=None, repr=False)
    """Told how many blocks a worker's event announced past its cap (a metric)."""
    _holders: dict[int, dict[WorkerId, int]] = field(default_factory=dict)
    _workers: dict[WorkerId, _WorkerBlocks] = field(default_factory=dict)
    _shared: OrderedDict[int, int] = field(default_factory=OrderedDict)
    """Keys the shared store holds, oldest first, each with the vLLM hash it was published as."""
    _shared_hashes: dict[int, int] = field(default_factory=dict)
    """vLLM hash -> key of shared blocks: parents for any worker's later blocks (vLLM's
    sha256-based hashes are the same on every worker for the same tokens)."""
    events_applied: int = 0
    blocks_skipped: int = 0
    blocks_over_cap: int = 0

    def __len__(self) -> int:
        return len(self._holders)

    def held_by(self, worker: WorkerId) -> int:
        """Entries the index keeps for `worker` (its own cache, not the shared store)."""
        blocks = self._workers.get(worker)
        return 0 if blocks is None else len(blocks.by_hash)

    def keys_for(self, tokens: Sequence[int], cache_salt: str | None = None
                 ) -> tuple[int, ...]:
        return token_block_keys(tokens, self.block_size, salt_root(cache_salt))

    def match(self, keys: Sequence[int], storage_weight: float | None = None
              ) -> dict[WorkerId, float]:
        """Per worker, the tier-weighted count of leading `keys` it can use consecutively: its
        own blocks, or the shared store's where it lacks one. `SHARED` maps to what the shared
        store alone gives, which is what every worker not named scores. `storage_weight`
        replaces `MEDIUM_WEIGHTS["STORAGE"]` (blocks on storage and in kvkeep's store)."""
        result: dict[WorkerId, float] = {}
        alive: dict[WorkerId, float] = {}
        shared = 0.0  # the shared store's chain so far (0 once it is broken)
        shared_alive = True
        for position, key in enumerate(keys):
            holders = self._holders.get(key) or {}
            via_store = _weight(holders.get(SHARED, 0), storage_weight) if shared_alive \
                else 0.0
            now: dict[WorkerId, float] = {}
            for w, mask in holders.items():
                if w == SHARED:
                    continue
                if w in alive:
                    now[w] = alive[w] + max(_weight(mask, storage_weight), via_store)
                elif position == 0 or (shared_alive and shared > 0):
                    now[w] = shared + max(_weight(mask, storage_weight), via_store)  # via the store
            if via_store > 0:
                for w, score in alive.items():
                    now.setdefault(w, score + via_store)
            for gone in alive.keys() - now.keys():
                result[gone] = alive[gone]
            alive = now
            if via_store > 0:
                shared += via_store
            else:
                shared_alive = False
            if not alive and not shared_alive:
                break
        result.update(alive)
        if shared > 0:
            result[SHARED] = shared
        return result

    def apply(self, worker: WorkerId, event: Mapping[str, Any] | KVEvent) -> None:
        """Apply one KV event of `worker`: a decoded vLLM event (a msgpack map with a `type`
        tag, as the ZMQ subscriber receives it) or a typed one (`kv_events`)."""
        if isinstance(event, Mapping):
            kind = event.get("type")
            if kind == "BlockStored":
                self._stored(worker, list(event.get("block_hashes") or ()),
                             list(event.get("token_ids") or ()),
                             int(event.get("block_size") or self.block_size),
                             event.get("parent_block_hash"), event.get("medium"),
                             event.get("extra_keys"))
            elif kind == "BlockRemoved":
                self._removed(worker, event.get("block_hashes") or (), event.get("medium"))
            elif kind == "AllBlocksCleared":
                self._cleared(worker)
            else:
                return
        elif isinstance(event, BlockStored):
            self._stored(worker, list(event.block_hashes), list(event.token_ids),
                         event.block_size, event.parent_block_hash, event.medium,
                         event.extra_keys)
        elif isinstance(event, BlockRemoved):
            self._removed(worker, event.block_hashes, event.medium)
        elif isinstance(event, AllBlocksCleared):
            self._cleared(worker)
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

    def _cleared(self, worker: WorkerId) -> None:
        """vLLM emptied its device cache (a prefix-cache reset): the worker's device blocks
        go; what it announced in other tiers (a store on its node) stays."""
        blocks = self._workers.get(worker)
        if blocks is None:
            return
        for vllm_hash, key in list(blocks.by_hash.items()):
            self._unmark(worker, blocks, vllm_hash, key, _MEDIUM_BITS["GPU"])

    def holds(self, worker: WorkerId, key: int) -> bool:
        return worker in self._holders.get(key, {})

    def _stored(self, worker: WorkerId, hashes: list[Any], tokens: list[int], size: int,
                parent_hash: object, medium: object, extra: object = None) -> None:
        blocks = self._workers.setdefault(worker, _WorkerBlocks())
        extras = list(extra) if isinstance(extra, list | tuple) else []
        if parent_hash is None:
            first = extras[0] if extras else None
            parent = extra_root(first if isinstance(first, list | tuple) else None)
        else:
            found = blocks.by_hash.get(_as_int(parent_hash))
            if found is None:
                found = self._shared_hashes.get(_as_int(parent_hash))
            if found is None:
                self.blocks_skipped += len(hashes)
                return
            parent = found
        if size != self.block_size or len(tokens) < len(hashes) * size:
            # Another block size cannot be matched against our keys; skip rather than guess.
            self.blocks_skipped += len(hashes)
            return
        # A block hashed with more than its tokens (after the root's) cannot be keyed from
        # token ids: the chain is known up to it.
        usable = len(hashes)
        for i, keys_of_block in enumerate(extras[:len(hashes)]):
            if keys_of_block and (i > 0 or parent_hash is not None):
                usable = i
                break
        if usable < len(hashes):
            self.blocks_skipped += len(hashes) - usable
            hashes = hashes[:usable]
        keys = token_block_keys(tokens[: len(hashes) * size], size, parent)
        if str(medium).upper() == SHARED_MEDIUM:
            for vllm_hash, key in zip(hashes, keys, strict=True):
                self._holders.setdefault(key, {})[SHARED] = _MEDIUM_BITS["STORAGE"]
                self._shared[key] = _as_int(vllm_hash)
                self._shared.move_to_end(key)
                self._shared_hashes[_as_int(vllm_hash)] = key
            while len(self._shared) > self.shared_capacity:
                old, old_hash = self._shared.popitem(last=False)
                if self._shared_hashes.get(old_hash) == old:
                    del self._shared_hashes[old_hash]
                holders = self._holders.get(old)
                if holders is not None:
                    holders.pop(SHARED, None)
                    if not holders:
                        del self._holders[old]
            return
        bits = _bits(medium)
        over = 0
        for i, (vllm_hash, key) in enumerate(zip(hashes, keys, strict=True)):
            h = _as_int(vllm_hash)
            if h not in blocks.by_hash and len(blocks.by_hash) >= self.max_blocks_per_worker:
                over = len(hashes) - i  # the rest chain through this one: dropped with it
                break
            blocks.by_hash[h] = key
            holders = self._holders.setdefault(key, {})
            holders[worker] = holders.get(worker, 0) | bits
        if over:
            self.blocks_over_cap += over
            if self.on_over_cap is not None:
                self.on_over_cap(over)

    def _removed(self, worker: WorkerId, hashes: Iterable[Any], medium: object) -> None:
        blocks = self._workers.get(worker)
        if blocks is None:
            return
        bits = _bits(medium)
        for vllm_hash in hashes:
            key = blocks.by_hash.get(_as_int(vllm_hash))
            if key is not None:
                self._unmark(worker, blocks, _as_int(vllm_hash), key, bits)

    def _unmark(self, worker: WorkerId, blocks: _WorkerBlocks, vllm_hash: int, key: int,
                bits: int) -> None:
        """Clear `bits` of `worker`'s hold on `key`; a hold left empty goes, with its hash."""
        holders = self._holders.get(key)
        if holders is None or worker not in holders:
            return
        mask = holders[worker] & ~bits
        if mask:
            holders[worker] = mask
            return
        del holders[worker]
        blocks.by_hash.pop(vllm_hash, None)
        if not holders:
            del self._holders[key]


def _as_int(value: object) -> int:
    """vLLM sends hashes as 64-bit ints by default, as bytes when configured to."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value[:8], "big")
    if isinstance(value, int):
        return value
    return int(str(value))
