"""What a daemon lets one tenant hold at once, and the deadlines every put runs under.

Shared budgets let one tenant starve the others: before these, a tenant that declared puts and
sent their bytes slowly (or never) held the daemon's whole in-flight put budget, and every
other tenant's put was refused until its streams died (issue 13 item 6). So each tenant gets
its own slice of every budget a put can hold (Envoy's per-downstream limits, Redis's
per-client buffers, etcd's per-request size limits are the same idea):

- in-flight put bytes: the bytes of frames declared and not yet received and committed, per
  tenant (`tenant.put_bytes`) within the daemon's total (`inflight_put_bytes`);
- put streams: gRPC Put calls and TCP PUT requests in progress, per tenant;
- stored bytes: the frame bytes of a tenant's blocks the daemon holds; past them its oldest
  blocks are dropped (the tenant's own, never another's) once a new one has arrived.

Reads hold none of these, so a tenant at every limit still reads, and so does everyone else.
Every put also runs under deadlines (`put_deadline`), so a stalled stream gives its slices back.

The defaults scale with the daemon's budgets (`DaemonLimits.scaled`): the in-flight total is
half the RAM tier (clamped to [64 MiB, 4 GiB]), a tenant may hold half of it and 16 streams,
and every tenant may fill the whole disk tier (LRU then shares it: a deployment with tenants it
does not trust lowers `stored_share`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstore.errors import ConfigError
from kvstore.net.refusal import Refusal, RefusalReason

__all__ = ["TenantLimits", "DaemonLimits", "PutBudgets"]

_MIN_INFLIGHT = 64 << 20
_MAX_INFLIGHT = 4 << 30


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """What one tenant may hold at once (the same for every tenant)."""

    put_bytes: int
    """Bytes of declared puts in flight."""
    put_streams: int
    """gRPC Put calls plus TCP PUT requests in progress."""
    stored_bytes: int | None
    """Frame bytes of its blocks held; past them its oldest blocks are dropped. None: the
    whole disk tier (whose own LRU then shares it between tenants; nothing to enforce)."""

    def __post_init__(self) -> None:
        if (self.put_bytes <= 0 or self.put_streams <= 0
                or (self.stored_bytes is not None and self.stored_bytes <= 0)):
            raise ConfigError(f"tenant limits must be positive: {self}")


@dataclass(frozen=True, slots=True)
class DaemonLimits:
    """The daemon's put budgets and deadlines."""

    inflight_put_bytes: int
    tenant: TenantLimits
    put_idle_s: float = 10.0
    """The longest a put may go without a byte (or a message) arriving."""
    put_block_s: float = 30.0
    """Every block's bytes must arrive within this long, plus `size / put_min_rate`."""
    put_min_rate: float = 8e6
    """Bytes per second a put must sustain (so a 1 GiB frame gets 30 s + 134 s)."""

    def __post_init__(self) -> None:
        if self.inflight_put_bytes <= 0:
            raise ConfigError("the in-flight put budget must be positive")
        if self.put_idle_s <= 0 or self.put_block_s <= 0 or self.put_min_rate <= 0:
            raise ConfigError("put deadlines must be positive")

    @classmethod
    def scaled(cls, mem_budget: int, disk_budget: int, *, put_share: float = 0.5,
               put_streams: int = 16, stored_share: float = 1.0,
               inflight_put_bytes: int | None = None) -> DaemonLimits:
        """Limits that scale with the daemon's RAM and disk budgets (see the module doc)."""
        if not 0 < put_share <= 1 or not 0 < stored_share <= 1:
            raise ConfigError("tenant shares must be in (0, 1]")
        total = inflight_put_bytes or min(max(mem_budget // 2, _MIN_INFLIGHT), _MAX_INFLIGHT)
        stored = None if stored_share >= 1 else max(int(disk_budget * stored_share), 1)
        return cls(total, TenantLimits(put_bytes=max(int(total * put_share), 1),
                                       put_streams=put_streams, stored_bytes=stored))

    def put_deadline(self, size: int) -> float:
        """Seconds a block of `size` bytes may take to arrive."""
        return self.put_block_s + size / self.put_min_rate


class PutBudgets:
    """The in-flight put bytes and put streams held, in total and per tenant. Thread-safe."""

    def __init__(self, limits: DaemonLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._bytes = 0
        self._tenant_bytes: dict[str, int] = {}
        self._tenant_streams: dict[str, int] = {}

    def take_bytes(self, tenant: str, size: int) -> None:
        """Hold `size` in-flight bytes for `tenant`, or raise RESOURCE_EXHAUSTED (a refusal the
        client takes as "not here, now": the next replica, no breaker).

        A tenant that holds nothing is always admitted one put, however big (up to the frame
        limit) and whatever the others hold: a budget smaller than a block must not make the
        block unstorable, and the others' puts must not stop it. So the daemon holds at most
        its total plus one frame per tenant."""
        tenant_limit = self.limits.tenant.put_bytes
        with self._lock:
            held = self._tenant_bytes.get(tenant, 0)
            if held and held + size > tenant_limit:
                raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                              f"tenant {tenant!r} has {held} put bytes in flight; this put "
                              f"of {size} would pass its {tenant_limit}; retry later")
            if held and self._bytes + size > self.limits.inflight_put_bytes:
                raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                              "too many put bytes in flight; retry later")
            self._bytes += size
            self._tenant_bytes[tenant] = held + size

    def give_bytes(self, tenant: str, size: int) -> None:
        with self._lock:
            self._bytes -= size
            left = self._tenant_bytes[tenant] - size
            if left:
                self._tenant_bytes[tenant] = left
            else:
                del self._tenant_bytes[tenant]

    def open_stream(self, tenant: str) -> None:
        """Hold one of `tenant`'s put streams (`close_stream` gives it back); RESOURCE_EXHAUSTED
        when all are held."""
        limit = self.limits.tenant.put_streams
        with self._lock:
            held = self._tenant_streams.get(tenant, 0)
            if held >= limit:
                raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                              f"tenant {tenant!r} has {held} put streams open (at most {limit})")
            self._tenant_streams[tenant] = held + 1

    def close_stream(self, tenant: str) -> None:
        with self._lock:
            left = self._tenant_streams[tenant] - 1
            if left:
                self._tenant_streams[tenant] = left
            else:
                del self._tenant_streams[tenant]

    def held(self) -> dict[str, tuple[int, int]]:
        """Per tenant holding anything: (in-flight put bytes, put streams)."""
        with self._lock:
            tenants = set(self._tenant_bytes) | set(self._tenant_streams)
            return {t: (self._tenant_bytes.get(t, 0), self._tenant_streams.get(t, 0))
                    for t in tenants}

    @property
    def inflight_bytes(self) -> int:
        with self._lock:
            return self._bytes
