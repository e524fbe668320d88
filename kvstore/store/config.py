"""`StoreConfig`: the tunables of a `TieredStore`."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError

__all__ = ["StoreConfig"]


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Tunables of a TieredStore; the defaults suit a worker-local store.

    get_deadline_s: default budget of a get/lookup/get_many call, in seconds.
    write_queue_depth: background jobs (write-behind, promotions, manifests) that may wait.
    writer_threads: threads draining the queue.
    write_batch: jobs a writer takes at once; tiers with `put_many` store them as one batch.
    read_priority_max_wait_s: how long a writer yields to in-flight reads on its target tier.
    manifest_enqueue_timeout_s: how long put_manifest may wait for queue room.
    background_deadline_s: deadline of the reads a writer does (read-back, promotion source).
    promote: copy lower-tier hits up into the tiers above.
    writer_nice: a positive value lowers the writer threads' CPU priority by that much (Linux
    nice, per thread): on a node short of cores, write-behind then takes the CPU the request
    threads leave, instead of slowing puts that do not wait for it (back-pressure still bounds
    the backlog). 0 leaves them alone.
    lent_recheck_s: a block lent from the first tier unverified (a daemon sends GETs straight
    from its RAM) is checked against its checksums after it is sent, so that a copy corrupted
    in RAM is dropped; each block once, then at most every `lent_recheck_s`. Readers verify
    every block themselves, so this bounds how long a corrupt copy keeps being offered (and
    refused), not whether wrong bytes are used. 0: after every send.
    writer_quiet_s, writer_defer_max_s: the write-behind gives way to the store's callers. A
    writer holds its next batch back until no get, put or lookup has come for
    `writer_quiet_s`, but a job at most `writer_defer_max_s` after it was queued, and not at
    all while anyone waits for the writer (a flush, a put held by back-pressure, a delete) or
    while the queue is half full. Bursty callers (an engine's saves at the end of a prefill,
    its loads at the start of the next request) then get the CPU and the interpreter lock
    while they are there, and the disk work runs in the gaps; a caller that never pauses
    delays each copy by `writer_defer_max_s`, which is how far durable copies may then lag
    behind (measured by `copy_lag_seconds`). 0 (the default): writers start at once.
    """

    get_deadline_s: float = 0.5
    write_queue_depth: int = 256
    writer_threads: int = 1
    write_batch: int = 8
    read_priority_max_wait_s: float = 0.05
    manifest_enqueue_timeout_s: float = 1.0
    background_deadline_s: float = 5.0
    promote: bool = True
    writer_nice: int = 0
    lent_recheck_s: float = 10.0
    writer_quiet_s: float = 0.0
    writer_defer_max_s: float = 1.0

    def __post_init__(self) -> None:
        if self.get_deadline_s <= 0 or self.background_deadline_s <= 0:
            raise ConfigError("deadlines must be positive")
        if self.write_queue_depth < 1 or self.writer_threads < 1 or self.write_batch < 1:
            raise ConfigError("write_queue_depth, writer_threads and write_batch must be >= 1")
        if not 0 <= self.writer_nice <= 19:
            raise ConfigError("writer_nice must be 0-19")
        if (self.read_priority_max_wait_s < 0 or self.manifest_enqueue_timeout_s < 0
                or self.lent_recheck_s < 0 or self.writer_quiet_s < 0
                or self.writer_defer_max_s < 0):
            raise ConfigError("wait times cannot be negative")
