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

Reads hold budgets of their own (M1): read streams in progress and the bytes of blocks being
sent, per tenant and per token, so a tenant at every put limit still reads, and one tenant's
readers cannot pin all RAM. Every put also runs under deadlines (`put_deadline`), so a stalled
stream gives its slices back; every TCP GET under `get_deadline`.

Each put is charged `block_cost` (its file-system blocks plus a per-entry overhead), not its
frame bytes, and a tenant's stored blocks are capped in number too (`max_blocks`), so tiny
frames cannot exhaust inodes or the daemon's catalog RAM (M4). Budgets are charged to the
token as well as to the tenant name, so a `*` or `a,b,c` token gets one tenant's share (M6).

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


FS_BLOCK_BYTES = 4096
"""The file-system block a stored frame's size is rounded up to when it is charged."""
ENTRY_OVERHEAD_BYTES = 1024
"""What one stored block costs beyond its file: an inode, a catalog and an index entry in the
daemon's RAM (about 1 KB measured, M4)."""


def block_cost(size: int) -> int:
    """What a `size`-byte frame is charged against budgets: its disk blocks (at least one) plus
    the per-entry overhead, so millions of tiny frames cost what they really hold (M4)."""
    return max(-(-size // FS_BLOCK_BYTES), 1) * FS_BLOCK_BYTES + ENTRY_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class DaemonLimits:
    """The daemon's put and read budgets and deadlines."""

    inflight_put_bytes: int
    tenant: TenantLimits
    put_idle_s: float = 10.0
    """The longest a put may go without a byte (or a message) arriving."""
    put_block_s: float = 30.0
    """Every block's bytes must arrive within this long, plus `size / put_min_rate`."""
    put_min_rate: float = 8e6
    """Bytes per second a put must sustain (so a 1 GiB frame gets 30 s + 134 s)."""
    read_streams: int = 32
    """Reads (gRPC Gets, TCP GETs) one tenant (and one token) may have in progress."""
    read_bytes: int | None = None
    """Bytes of blocks one tenant's (and one token's) reads may hold while being sent; None:
    `tenant.put_bytes`."""
    max_blocks: int | None = None
    """Blocks one tenant may store; past them its oldest go. None: no count limit."""
    get_min_rate: float = 1e6
    """Bytes per second a TCP GET's reader must take: a GET gets `put_block_s` plus
    `size / get_min_rate` in all, however it trickles."""

    def __post_init__(self) -> None:
        if self.inflight_put_bytes <= 0:
            raise ConfigError("the in-flight put budget must be positive")
        if self.put_idle_s <= 0 or self.put_block_s <= 0 or self.put_min_rate <= 0:
            raise ConfigError("put deadlines must be positive")
        if (self.read_streams <= 0 or self.get_min_rate <= 0
                or (self.read_bytes is not None and self.read_bytes <= 0)
                or (self.max_blocks is not None and self.max_blocks <= 0)):
            raise ConfigError("read budgets and block counts must be positive")

    @classmethod
    def scaled(cls, mem_budget: int, disk_budget: int, *, put_share: float = 0.5,
               put_streams: int = 16, stored_share: float = 1.0,
               inflight_put_bytes: int | None = None) -> DaemonLimits:
        """Limits that scale with the daemon's RAM and disk budgets (see the module doc)."""
        if not 0 < put_share <= 1 or not 0 < stored_share <= 1:
            raise ConfigError("tenant shares must be in (0, 1]")
        total = inflight_put_bytes or min(max(mem_budget // 2, _MIN_INFLIGHT), _MAX_INFLIGHT)
        stored = None if stored_share >= 1 else max(int(disk_budget * stored_share), 1)
        # A tenant's blocks, each charged at least one FS block plus its entry: the count its
        # share of the disk holds at that cost (M4).
        blocks = max((stored or disk_budget) // block_cost(1), 1)
        return cls(total, TenantLimits(put_bytes=max(int(total * put_share), 1),
                                       put_streams=put_streams, stored_bytes=stored),
                   max_blocks=blocks)

    @property
    def tenant_read_bytes(self) -> int:
        return self.read_bytes if self.read_bytes is not None else self.tenant.put_bytes

    def put_deadline(self, size: int) -> float:
        """Seconds a block of `size` bytes may take to arrive."""
        return self.put_block_s + size / self.put_min_rate

    def get_deadline(self, size: int) -> float:
        """Seconds a TCP GET of `size` bytes may take to be sent, in all (M1)."""
        return self.put_block_s + size / self.get_min_rate


class PutBudgets:
    """The in-flight put bytes and put streams held, and the reads in progress: in total, per
    tenant, and per principal (token), so a token that may use many tenant names (`*`, `a,b,c`)
    gets one tenant's budgets, not one per name (M6). Thread-safe.

    Charges are `block_cost(size)`, not frame bytes (M4). The daemon-wide in-flight total is
    never waived for a put within its tenant's limit. A put bigger than its tenant's whole
    limit (admitted so that such a block stays storable, only while its tenant and token hold
    nothing) takes the daemon's one oversize slot instead, outside the total: at most one such
    put is in flight at a time, so the daemon holds at most its total plus one frame, however
    many tenant names or tokens there are (before, one frame per tenant name, M6)."""

    def __init__(self, limits: DaemonLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._bytes = 0
        self._oversize = 0  # the charge in the oversize slot (see the class doc), 0 if free
        self._tenant_bytes: dict[str, int] = {}
        self._tenant_streams: dict[str, int] = {}
        self._principal_bytes: dict[str, int] = {}
        self._principal_streams: dict[str, int] = {}
        self._read_bytes: dict[str, int] = {}  # tenants and principals (disjoint names)
        self._read_streams: dict[str, int] = {}

    def take_bytes(self, tenant: str, size: int, principal: str | None = None) -> int:
        """Hold `block_cost(size)` in-flight bytes for `tenant` (and `principal`, the token's
        name; None: not charged, auth is off), or raise RESOURCE_EXHAUSTED (a refusal the client
        takes as "not here, now": the next replica, no breaker). Returns what `give_bytes`
        takes back (negative: the oversize slot).

        A tenant (and a principal) that holds nothing is admitted one put bigger than its own
        limit (up to the frame limit): a budget smaller than a block must not make the block
        unstorable. The daemon-wide total is not waived (see the class doc)."""
        charge = block_cost(size)
        tenant_limit = self.limits.tenant.put_bytes
        total = self.limits.inflight_put_bytes
        with self._lock:
            held = self._tenant_bytes.get(tenant, 0)
            if held and held + charge > tenant_limit:
                raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                              f"tenant {tenant!r} has {held} put bytes in flight; this put "
                              f"of {size} would pass its {tenant_limit}; retry later")
            by = self._principal_bytes.get(principal, 0) if principal is not None else 0
            if by and by + charge > tenant_limit:
                raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                              f"this token has {by} put bytes in flight over all its tenants; "
                              f"this put of {size} would pass {tenant_limit}; retry later")
            if charge > tenant_limit:  # its tenant and token hold nothing (checked above)
                if self._oversize:
                    raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                                  f"a put of {size} bytes is over one tenant's in-flight "
                                  f"budget ({tenant_limit}), and another such put is in "
                                  "flight; retry later")
                self._oversize = charge
                charge = -charge  # marks the slot for give_bytes
            elif self._bytes + charge > total:
                raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                              "too many put bytes in flight; retry later")
            else:
                self._bytes += charge
            self._tenant_bytes[tenant] = held + abs(charge)
            if principal is not None:
                self._principal_bytes[principal] = by + abs(charge)
        return charge

    def give_bytes(self, tenant: str, charge: int, principal: str | None = None) -> None:
        """Give back what `take_bytes` returned."""
        with self._lock:
            if charge < 0:
                self._oversize = 0
                charge = -charge
            else:
                self._bytes -= charge
            _give(self._tenant_bytes, tenant, charge)
            if principal is not None:
                _give(self._principal_bytes, principal, charge)

    def open_stream(self, tenant: str, principal: str | None = None) -> None:
        """Hold one of `tenant`'s (and `principal`'s) put streams (`close_stream` gives it
        back); RESOURCE_EXHAUSTED when all are held."""
        limit = self.limits.tenant.put_streams
        with self._lock:
            held = self._tenant_streams.get(tenant, 0)
            if held >= limit:
                raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                              f"tenant {tenant!r} has {held} put streams open (at most {limit})")
            by = self._principal_streams.get(principal, 0) if principal is not None else 0
            if by >= limit:
                raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                              f"this token has {by} put streams open over all its tenants "
                              f"(at most {limit})")
            self._tenant_streams[tenant] = held + 1
            if principal is not None:
                self._principal_streams[principal] = by + 1

    def close_stream(self, tenant: str, principal: str | None = None) -> None:
        with self._lock:
            _give(self._tenant_streams, tenant, 1)
            if principal is not None:
                _give(self._principal_streams, principal, 1)

    def open_read(self, tenant: str, principal: str | None = None) -> None:
        """Hold one of `tenant`'s (and `principal`'s) read streams (M1); RESOURCE_EXHAUSTED when
        all are held."""
        limit = self.limits.read_streams
        names = [f"t:{tenant}"] + ([] if principal is None else [f"p:{principal}"])
        with self._lock:
            for name in names:
                if self._read_streams.get(name, 0) >= limit:
                    raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                                  f"{name[2:]} has {limit} reads in progress "
                                  "(the most it may); retry later")
            for name in names:
                self._read_streams[name] = self._read_streams.get(name, 0) + 1

    def close_read(self, tenant: str, principal: str | None = None) -> None:
        with self._lock:
            _give(self._read_streams, f"t:{tenant}", 1)
            if principal is not None:
                _give(self._read_streams, f"p:{principal}", 1)

    def take_read_bytes(self, tenant: str, size: int, principal: str | None = None) -> None:
        """Hold `size` bytes of a block being sent to `tenant` (M1): RESOURCE_EXHAUSTED past the
        read budget; one block bigger than the budget is let through while nothing else is."""
        limit = self.limits.tenant_read_bytes
        names = [f"t:{tenant}"] + ([] if principal is None else [f"p:{principal}"])
        with self._lock:
            for name in names:
                held = self._read_bytes.get(name, 0)
                if held and held + size > limit:
                    raise Refusal(RefusalReason.RESOURCE_EXHAUSTED,
                                  f"{name[2:]} has {held} bytes of reads being sent; this "
                                  f"{size}-byte block would pass its {limit}; retry later")
            for name in names:
                self._read_bytes[name] = self._read_bytes.get(name, 0) + size

    def give_read_bytes(self, tenant: str, size: int, principal: str | None = None) -> None:
        with self._lock:
            _give(self._read_bytes, f"t:{tenant}", size)
            if principal is not None:
                _give(self._read_bytes, f"p:{principal}", size)

    def held(self) -> dict[str, tuple[int, int]]:
        """Per tenant holding anything: (in-flight put bytes, put streams)."""
        with self._lock:
            tenants = set(self._tenant_bytes) | set(self._tenant_streams)
            return {t: (self._tenant_bytes.get(t, 0), self._tenant_streams.get(t, 0))
                    for t in tenants}

    def reads_held(self) -> dict[str, tuple[int, int]]:
        """Per tenant ("t:NAME") and token ("p:NAME") reading: (bytes being sent, reads)."""
        with self._lock:
            names = set(self._read_bytes) | set(self._read_streams)
            return {n: (self._read_bytes.get(n, 0), self._read_streams.get(n, 0))
                    for n in names}

    @property
    def inflight_bytes(self) -> int:
        """Charged bytes in flight, the oversize slot's included."""
        with self._lock:
            return self._bytes + self._oversize


def _give(held: dict[str, int], name: str, amount: int) -> None:
    left = held.get(name, 0) - amount
    if left > 0:
        held[name] = left
    else:
        held.pop(name, None)
