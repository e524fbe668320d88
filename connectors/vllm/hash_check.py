"""Refuse an engine whose block hashes no other process can reproduce.

Blocks are stored under vLLM's own chained block hashes, so a block saved by one engine is
found by another only if both hash a prefix the same way. vLLM 0.32 seeds every chain with
`NONE_HASH`, derived from `PYTHONHASHSEED` when it is set; when it is not, a cryptographic
`--prefix-caching-hash-algo` (`sha256`, `sha256_cbor`, the default) uses a fixed seed, but a
non-cryptographic one (`xxhash`, `xxhash_cbor`) draws a random seed per process, on purpose:
its collisions can be forced by anyone who knows the seed
(`vllm/v1/core/kv_cache_utils.py: resolve_none_hash_seed`). Such an engine would save blocks
that nothing, not even itself after a restart, can ever restore: every save wasted, every
failover a recompute. So the connector refuses to start there and says what to change.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvstore.errors import ConfigError

__all__ = ["NON_CRYPTOGRAPHIC_HASH_ALGOS", "check_block_hashes_reproducible"]

NON_CRYPTOGRAPHIC_HASH_ALGOS = frozenset({"xxhash", "xxhash_cbor"})
"""`--prefix-caching-hash-algo` values whose seed is random per process without
PYTHONHASHSEED (a test checks this against vLLM's own list)."""


def check_block_hashes_reproducible(hash_algo: str, environ: Mapping[str, str]) -> None:
    """ConfigError unless block hashes computed under `hash_algo` in a process with
    `environ` are the same in every other process configured alike."""
    if hash_algo in NON_CRYPTOGRAPHIC_HASH_ALGOS and environ.get("PYTHONHASHSEED") is None:
        raise ConfigError(
            f"kvkeep connector: --prefix-caching-hash-algo {hash_algo} without PYTHONHASHSEED "
            "gives block hashes that differ in every process (vLLM seeds them at random), so "
            "nothing this engine saves could ever be restored, here after a restart or on any "
            "other worker. Set PYTHONHASHSEED to the same value (kept secret) in the "
            "environment of every vLLM worker, or use --prefix-caching-hash-algo sha256 "
            "(the default).")
