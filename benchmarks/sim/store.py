"""kvkeep's store as the simulator sees it: which blocks it holds, where, and what a restore
costs.

- A host-RAM tier per node (the node's daemon), shared by the node's replicas: an LRU of block
  hashes with a capacity in blocks. It dies with its node.
- Remote daemons: one LRU over the cluster, each block kept on `remote_replicas` daemons, so
  its capacity is the daemons' bytes / replicas. It survives any one node.

The connector saves every block a replica computes (write-through to the host tier, behind to
the remote one) and, before a request is prefilled, loads the longest run of blocks after the
device-cache hit that the store holds: host tier first, then remote. What it loads is not
recomputed. A load costs, per tier it reads, `latency_s` + bytes / `gbps` (`StoreParams`; the
figures and where they come from are in the parameter file). A save costs the step only the
per-layer gather copy on the GPU (`save_s_per_block`): the encoding and the puts run on the
saver's thread and the step never waits for them (no durability). Whether a load is charged
to the step or to its request alone is the engine's decision (`load_mode`, as the connector
makes it): see `engine.Replica._admit`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.sim.params import ModelParams, StoreParams

__all__ = ["LRUBlocks", "KVStore", "StoreHit"]


@dataclass(slots=True)
class LRUBlocks:
    capacity: int
    _blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)
    evictions: int = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    def put(self, h: int) -> bool:
        """True if newly stored."""
        blocks = self._blocks
        if h in blocks:
            blocks.move_to_end(h)
            return False
        blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
            self.evictions += 1
        return True

    def touch(self, h: int) -> None:
        self._blocks.move_to_end(h)

    def clear(self) -> None:
        self._blocks.clear()


@dataclass(frozen=True, slots=True)
class StoreHit:
    host_blocks: int
    remote_blocks: int
    seconds: float

    @property
    def blocks(self) -> int:
        return self.host_blocks + self.remote_blocks


_NO_HIT = StoreHit(0, 0, 0.0)


class KVStore:
    """The store of a whole cluster: host tiers by node, one remote pool."""

    __slots__ = ("block_bytes", "host", "params", "remote", "saved_blocks")

    def __init__(self, params: StoreParams, model: ModelParams, block_size: int,
                 nodes: int) -> None:
        self.params = params
        self.block_bytes = model.kv_bytes_per_token * block_size
        host_blocks = params.host_bytes_per_node // self.block_bytes
        remote_blocks = params.remote_bytes // max(1, params.remote_replicas) // self.block_bytes
        self.host = [LRUBlocks(host_blocks) for _ in range(nodes)]
        self.remote = LRUBlocks(remote_blocks)
        self.saved_blocks = 0

    def node_of(self, replica: int) -> int:
        return replica // self.params.replicas_per_node

    def save(self, replica: int, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Store blocks computed on `replica`; returns those new to its host tier and those new
        to the remote pool (what the connector announces as KV events)."""
        host = self.host[self.node_of(replica)]
        new_host = [h for h in hashes if host.put(h)]
        remote = self.remote
        new_remote = [h for h in hashes if remote.capacity > 0 and remote.put(h)]
        self.saved_blocks += len(hashes)
        return new_host, new_remote

    def lookup(self, replica: int, hashes: Sequence[int]) -> StoreHit:
        """The longest run of leading `hashes` the store holds, and the time to load it."""
        if not hashes:
            return _NO_HIT
        host = self.host[self.node_of(replica)]._blocks
        remote = self.remote._blocks
        n_host = n_remote = 0
        for h in hashes:  # dict operations inline: this runs for every admitted request
            if h in host:
                host.move_to_end(h)
                n_host += 1
            elif h in remote:
                remote.move_to_end(h)
                n_remote += 1
            else:
                break
        if n_host + n_remote == 0:
            return _NO_HIT
        p = self.params
        # one load job reads both tiers; each tier touched pays its per-call latency
        seconds = (p.host_load_s(n_host * self.block_bytes)
                   + p.remote_load_s(n_remote * self.block_bytes))
        return StoreHit(n_host, n_remote, seconds)

    def save_step_s(self, blocks: int) -> float:
        """Step time the connector adds for saving `blocks` blocks: the gather copies only."""
        return blocks * self.params.save_s_per_block

    def node_lost(self, node: int) -> None:
        self.host[node].clear()
