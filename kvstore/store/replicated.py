"""Replicated puts: blocks that must be held by several nodes before the put returns.

A plain put is synchronous in the first tier only and reaches the lower ones by write-behind,
so a block lives for a while on its writer's node alone: a node lost in that window loses it
(`copy_lag_seconds` measures the window). A replicated put closes it for the tiers that keep
copies on other nodes (`SupportsReplicas`: the remote daemons): it writes the first tier as
any put does, then waits until `copies` distinct nodes of every such tier acknowledged each
block, or the deadline passed. The other lower tiers (nvme, redis) still get their copy behind,
and so does a replicated tier that did not acknowledge in time (best effort, as without the
wait). What an acknowledgement means is the tier's: for the daemons, the frame verified and
in the daemon's RAM tier with its disk write queued (not yet fsync'd).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvstore.errors import ConfigError
from kvstore.frame import FrameBytes, FrameHeader, checked_frame
from kvstore.keys import BlockKey
from kvstore.store.tier_calls import TierCalls
from kvstore.store.write_behind import WriteBehind
from kvstore.tiers.capabilities import SupportsReplicas

__all__ = ["ReplicatedPuts"]


class ReplicatedPuts:
    """The replicated-put path of one store (its tiers and write-behind engine)."""

    def __init__(self, calls: TierCalls, writes: WriteBehind) -> None:
        self._calls = calls
        self._writes = writes
        self._tiers: dict[int, SupportsReplicas] = {
            index: tier for index, tier in enumerate(calls.tiers)
            if isinstance(tier, SupportsReplicas)}

    @property
    def max_copies(self) -> int:
        """The most copies a replicated put can ask for (the fewest any such tier keeps);
        0 when the store has no tier that replicates."""
        return min((tier.replicas for tier in self._tiers.values()), default=0)

    def put(self, items: Sequence[tuple[BlockKey, FrameBytes]], *, copies: int,
            deadline: float, computed_at: float | None = None) -> list[bool]:
        """Store each frame; True for a block once every replicated tier had `copies` nodes
        acknowledge it. Raises InvalidFrame as `put` does, ConfigError when the store cannot
        replicate that many copies."""
        if not 1 <= copies <= self.max_copies:
            raise ConfigError(f"a replicated put of {copies} copies needs a tier that keeps "
                              f"that many (this store keeps at most {self.max_copies})")
        born = time.monotonic() if computed_at is None else computed_at
        checked: list[tuple[BlockKey, memoryview, FrameHeader]] = [
            (key, *checked_frame(frame, key.digest)) for key, frame in items]
        admitted = [True] * len(checked)
        if 0 not in self._tiers:
            admitted = [self._calls.put(0, key, view) for key, view, _ in checked]
            for ok in admitted:
                if ok:
                    self._calls.copied(0, born)
        acknowledged = {index: self._acknowledge(index, checked, copies, deadline, born)
                        for index in self._tiers}
        durable = [all(acks[i] for acks in acknowledged.values()) for i in range(len(checked))]
        for i, (key, view, header) in enumerate(checked):
            done = frozenset(index for index, acks in acknowledged.items() if acks[i])
            held = None if admitted[i] else bytes(view)
            self._writes.copy_down(key, header, held, computed_at=born, skip=done)
        return durable

    def prefix(self, keys: Sequence[BlockKey], *, copies: int, deadline: float) -> int:
        """How many of `keys`, from the first on, `copies` nodes of every replicated tier hold
        (0 when the store has none)."""
        if not self._tiers:
            return 0
        held = [True] * len(keys)
        for index, tier in self._tiers.items():
            started = time.monotonic()
            try:
                counts = tier.count_copies(keys, deadline=deadline)
            except Exception:
                self._calls.failed(index, "contains")
                return 0
            finally:
                self._calls.observe(index, "contains", started)
            held = [h and n >= copies for h, n in zip(held, counts, strict=False)]
        return next((i for i, h in enumerate(held) if not h), len(held))

    def _acknowledge(self, index: int, checked: Sequence[tuple[BlockKey, memoryview,
                                                                   FrameHeader]],
                     copies: int, deadline: float, born: float) -> list[bool]:
        tier = self._tiers[index]
        started = time.monotonic()
        try:
            acks = tier.put_acknowledged([(key, view) for key, view, _ in checked],
                                         copies=copies, deadline=deadline)
        except Exception:
            self._calls.failed(index, "put")
            acks = [False] * len(checked)
        finally:
            self._calls.observe(index, "put", started)
        for (_, view, _), ok in zip(checked, acks, strict=False):
            self._calls.count_put(index, ok, len(view))
            if ok:
                self._calls.copied(index, born)
        return list(acks) + [False] * (len(checked) - len(acks))
