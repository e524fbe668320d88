"""What a daemon counts (both fronts together) and what its Stat call reports.

The core (kvstore/daemon/core.py) keeps these; the gRPC front sends them in Stat, and a metrics
endpoint can export them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvstore.tiers.base import TierStats

__all__ = ["Counters", "ServiceStatus", "COUNTER_NAMES"]


@dataclass(frozen=True, slots=True)
class Counters:
    """Wire and request counters since start (both fronts together)."""

    put_bytes_received: int = 0
    get_bytes_sent: int = 0
    puts: int = 0
    rejected_puts: int = 0
    invalid_puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    lookups: int = 0
    repaired_blocks: int = 0
    refused_puts: int = 0
    """Puts refused for a full disk, a spent budget or too many streams (clients go elsewhere)."""
    disk_full_refusals: int = 0
    tenant_evicted_blocks: int = 0
    """Blocks dropped because their tenant was past its stored bytes."""
    backpressure_refusals: int = 0
    """Puts refused because the disk stayed behind for the back-pressure timeout (M3)."""
    dropped_copy_refusals: int = 0
    """Puts refused because their copy to disk could not be queued (M3)."""
    refused_reads: int = 0
    """Reads refused because their tenant or token held all its read streams or bytes (M1)."""


COUNTER_NAMES = tuple(f.name for f in fields(Counters))


@dataclass(frozen=True, slots=True)
class ServiceStatus:
    """What Stat reports."""

    node_id: str
    draining: bool
    counters: Counters
    tiers: tuple[TierStats, ...]
    pending_writes: int
    data_port: int
