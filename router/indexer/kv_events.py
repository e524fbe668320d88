"""The KV events vLLM publishes (and the kvkeep connector adds to its stream), typed.

Field names are vLLM's (`vllm.distributed.kv_events`): on the wire (ZMQ, msgpack) each is a
map with a `type` tag, which `KVBlockIndex.apply` also takes. These types are for whoever feeds
the index directly, without ZMQ: a simulator, a test, an in-process engine.

`medium`: None or "GPU" for vLLM's device cache, "CPU" / "STORAGE" for offloaded tiers,
"KVKEEP_LOCAL" for a kvkeep store on the worker's node, "KVKEEP_SHARED" for a kvkeep store with
remote daemons that every worker can restore from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEvent"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks cached, in order: `block_hashes[i]` holds
    `token_ids[i * block_size:(i + 1) * block_size]`, the first chained to `parent_block_hash`
    (None: the prompt's start)."""

    block_hashes: Sequence[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: Sequence[int]
    block_size: int
    medium: str | None = None
    extra_keys: Sequence[Sequence[object] | None] | None = None
    """Per block, what vLLM hashed besides its tokens (untagged: the cache salt, a LoRA name,
    multimodal identifiers), or None."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[int | bytes]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The worker's device cache was emptied (a prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
