"""Where prefixes are cached: routing history (approximate) and KV events (precise)."""

from router.indexer.events import MEDIUM_WEIGHTS, KVBlockIndex
from router.indexer.history import RoutingHistory, SessionBlocks, longest_prefix
from router.indexer.keys import text_prefix_keys, token_block_keys
from router.indexer.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["KVBlockIndex", "MEDIUM_WEIGHTS", "RoutingHistory", "SessionBlocks", "longest_prefix",
           "text_prefix_keys", "token_block_keys", "BlockStored", "BlockRemoved",
           "AllBlocksCleared", "KVEvent"]
