"""The plugin's way to the daemons: kvkeep's remote tier, built from the plugin's settings.

This is the only module of the plugin that imports kvkeep's networking code (the remote tier,
its discovery and its daemon client), so that a move of those modules touches one file.

The remote tier brings everything a worker of the vLLM connector gets: rendezvous placement on
R daemons, a circuit breaker per daemon (a dead one costs one deadline, then is skipped),
verification of every read (checksums and key binding; a corrupt copy is skipped and
repaired from a good one), the daemons' TCP bulk plane where they offer one, gRPC otherwise.
Every failure surfaces as a kvkeep error or a miss; `ObjectStore` turns both into misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from connectors.lmcache.config import PluginSettings, read_token
from kvstore.frame import BlockRead, LayerRange
from kvstore.keys import BlockKey
from kvstore.net.daemon_client import ClientTLS
from kvstore.net.limits import MAX_FRAME_BYTES
from kvstore.tiers.base import Buffer
from kvstore.tiers.remote.tier import RemoteConfig, RemoteTier

__all__ = ["BlockStore", "connect", "MAX_FRAME_BYTES"]

FrameBytes = bytes | bytearray | memoryview


class BlockStore(Protocol):
    """What the plugin needs of the daemons (kvkeep's `RemoteTier` has it)."""

    def contains(self, keys: Sequence[BlockKey]) -> list[bool]: ...

    def get(self, key: BlockKey, layers: LayerRange | None = None, *,
            out: Buffer | None = None, deadline: float | None = None) -> BlockRead | None:
        """A verified read (checksums, key binding) or None; may raise kvkeep errors."""
        ...

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[Buffer | None], *,
                 deadline: float | None = None) -> list[BlockRead | None]:
        """Verified whole blocks, pipelined per daemon; None per miss (may raise kvkeep
        errors)."""
        ...

    def put_many(self, items: Sequence[tuple[BlockKey, FrameBytes]]) -> list[bool]: ...

    def delete(self, keys: Sequence[BlockKey]) -> int: ...

    def breaker_states(self) -> dict[str, str]: ...

    def choose_transports(self, timeout: float = 2.0) -> dict[str, str | None]: ...

    def close(self) -> None: ...


def connect(settings: PluginSettings) -> BlockStore:
    """The daemons named by `settings` (etcd prefix or static list). Raises ConfigError for an
    unreadable token file or TLS material; unreachable daemons are not an error here (reads
    are misses until they answer)."""
    tls = None
    if settings.tls is not None:
        tls = ClientTLS(Path(settings.tls.ca),
                        None if settings.tls.cert is None else Path(settings.tls.cert),
                        None if settings.tls.key is None else Path(settings.tls.key),
                        settings.tls.server_name)
    # The tier's call timeout bounds puts (and deletes): stores run in the background and
    # the daemons hold their acks while the disk catches up. Loads pass their own, shorter
    # deadline (`timeout_s`) per call; lookups have theirs.
    config = RemoteConfig(replicas=settings.replicas, write_ack=settings.write_ack,
                          call_timeout=settings.store_timeout_s,
                          lookup_timeout=settings.lookup_timeout_s,
                          token=read_token(settings.token_file), tls=tls,
                          data_plane=settings.data_plane, name="lmcache-remote",
                          registration_public_key=None if settings.registration_public_key
                          is None else Path(settings.registration_public_key))
    if settings.etcd is not None:
        return RemoteTier.from_etcd(settings.etcd, config, prefix=settings.prefix)
    return RemoteTier.from_addresses(dict(settings.daemons), config)
