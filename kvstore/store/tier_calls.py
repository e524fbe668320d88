"""How the store calls its tiers: each call timed and its failure counted (a sick tier reads as
empty), reads tracked so that background writes can give way to them, and the one read path,
which verifies every read its tier did not (`BlockRead.verified_for`).

Both halves of the store use it: the facade (`TieredStore`) and the write-behind engine. All
accounting goes to the Prometheus metrics (`kvstore.metrics.StoreMetrics`), and nowhere else.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Literal, Protocol, cast

from kvstore.errors import CorruptBlock, DeadlineExceeded
from kvstore.frame import BlockRead, FrameBytes, LayerRange
from kvstore.keys import BlockKey
from kvstore.metrics import LabelledSeries, StoreMetrics
from kvstore.tiers.base import Buffer, Tier
from kvstore.tiers.capabilities import SupportsBatchedGet

__all__ = ["TierCalls", "DeadlinePassed", "DEADLINE_PASSED"]

log = logging.getLogger("kvstore.store")


class DeadlinePassed(enum.Enum):
    """A tier raised DeadlineExceeded: the whole get is a miss (lower tiers are not asked)."""

    DEADLINE = enum.auto()


DEADLINE_PASSED: Literal[DeadlinePassed.DEADLINE] = DeadlinePassed.DEADLINE


class TierCall(Protocol):
    def __call__(self, tier: Tier, /) -> object: ...


class TierCalls:
    """The tiers of one store, in order, with their metric labels and reads in flight."""

    def __init__(self, tiers: Sequence[Tier], metrics: StoreMetrics) -> None:
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self.names: tuple[str, ...] = tuple(tier.name for tier in tiers)
        self.metrics = metrics
        self._series = LabelledSeries()
        metrics.declare_tiers(self.names)
        self._reads = threading.Condition()
        self._reads_in_flight = [0] * len(self.tiers)
        self.last_foreground = float("-inf")
        """`time.monotonic()` of the latest get, put or lookup a caller made (`foreground`)."""

    def __len__(self) -> int:
        return len(self.tiers)

    # -- reads --------------------------------------------------------------------------------

    def read(self, index: int, key: BlockKey, layers: LayerRange | None, out: Buffer | None,
             deadline: float) -> BlockRead | Literal[DeadlinePassed.DEADLINE] | None:
        """One tier's answer, verified: the read, None (a miss there: absent, corrupt and
        deleted, or failing) or DEADLINE_PASSED."""
        tier = self.tiers[index]
        started = time.monotonic()
        try:
            with self._reading(index):
                read = tier.get(key, layers, out=out, deadline=deadline)
        except DeadlineExceeded:
            self.metrics.deadline_misses.inc()
            return DEADLINE_PASSED
        except CorruptBlock:
            self.discard(index, key)
            return None
        except Exception:  # TierUnavailable, OSError, a bug: a sick tier is an empty one
            self.failed(index, "get")
            return None
        finally:
            self.observe(index, "get", started)
        if read is None:
            self._series(self.metrics.tier_misses, self.names[index]).inc()
            return None
        return self._checked(index, key, layers, read)

    def read_many(self, index: int, keys: Sequence[BlockKey], outs: Sequence[Buffer | None],
                  deadline: float
                  ) -> list[BlockRead | None] | Literal[DeadlinePassed.DEADLINE]:
        """`read` of whole blocks for several keys at once, from a `SupportsBatchedGet` tier:
        per key the verified read or None (a miss there, counted as `read` counts it), or
        DEADLINE_PASSED when the tier ran out of time for the batch."""
        tier = cast(SupportsBatchedGet, self.tiers[index])  # the store checked it once
        started = time.monotonic()
        try:
            with self._reading(index):
                got = tier.get_into(keys, outs, deadline=deadline)
        except DeadlineExceeded:
            self.metrics.deadline_misses.inc()
            return DEADLINE_PASSED
        except Exception:  # TierUnavailable, OSError, a bug: a sick tier is an empty one
            self.failed(index, "get")
            return [None] * len(keys)
        finally:
            self.observe(index, "get", started)
        reads: list[BlockRead | None] = []
        for key, read in zip(keys, got, strict=True):
            if read is None:
                self._series(self.metrics.tier_misses, self.names[index]).inc()
                reads.append(None)
            else:
                reads.append(self._checked(index, key, None, read))
        return reads

    def _checked(self, index: int, key: BlockKey, layers: LayerRange | None, read: BlockRead
                 ) -> BlockRead | None:
        """A tier's read verified for `key` (and `layers`), counted a hit; None (the copy
        deleted where corrupt) otherwise."""
        try:
            if read.layers != (layers if layers is not None else read.header.all_layers):
                raise CorruptBlock(f"{self.names[index]} returned layers {read.layers}, "
                                   f"not {layers}")
            read = read.verified_for(key.digest)
        except CorruptBlock:
            self.discard(index, key)
            return None
        except Exception:
            self.failed(index, "verify")
            return None
        self.hit(index, len(read.payload))
        return read

    @contextlib.contextmanager
    def _reading(self, index: int) -> Iterator[None]:
        with self._reads:
            self._reads_in_flight[index] += 1
        try:
            yield
        finally:
            with self._reads:
                self._reads_in_flight[index] -= 1
                if self._reads_in_flight[index] == 0:
                    self._reads.notify_all()

    def foreground(self) -> None:
        """A caller's get, put or lookup is being served now: the write-behind holds its next
        batch back until the store has been quiet for a moment (WriteBehind, `writer_quiet_s`).
        One float stored, no lock: called on every one of them."""
        self.last_foreground = time.monotonic()

    def yield_to_reads(self, index: int, max_wait: float) -> None:
        """Wait while reads are in flight on tier `index`, for at most `max_wait` seconds."""
        wait_until = time.monotonic() + max_wait
        with self._reads:
            while self._reads_in_flight[index] > 0:
                remaining = wait_until - time.monotonic()
                if remaining <= 0:
                    break
                self._reads.wait(remaining)

    # -- writes -------------------------------------------------------------------------------

    def put(self, index: int, key: BlockKey, frame: FrameBytes, *, observe: bool = True
            ) -> bool:
        started = time.monotonic()
        try:
            ok = self.tiers[index].put(key, frame)
        except Exception:
            self.failed(index, "put")
            return False
        finally:
            if observe:
                self.observe(index, "put", started)
        self.count_put(index, ok, len(frame))
        return ok

    def count_put(self, index: int, ok: bool, nbytes: int) -> None:
        if ok:
            self._series(self.metrics.written_bytes, self.names[index]).inc(nbytes)
        else:
            self._series(self.metrics.rejected_puts, self.names[index]).inc()

    # -- anything else ------------------------------------------------------------------------

    def attempt(self, index: int, op: str, call: TierCall) -> None:
        """Run `call` on tier `index`; a failure is counted (as `op`) and swallowed."""
        try:
            call(self.tiers[index])
        except Exception:
            self.failed(index, op)

    def discard(self, index: int, key: BlockKey) -> None:
        """A copy of `key` failed verification in tier `index`: count it and delete it."""
        self.corrupt(index, "block")
        self.attempt(index, "delete", lambda t: t.delete([key]))

    # -- accounting ---------------------------------------------------------------------------

    def hit(self, index: int, nbytes: int) -> None:
        self._series(self.metrics.hits, self.names[index]).inc()
        self._series(self.metrics.read_bytes, self.names[index]).inc(nbytes)

    def failed(self, index: int, op: str) -> None:
        log.debug("tier %s failed in %s", self.names[index], op, exc_info=True)
        self._series(self.metrics.errors, self.names[index], op).inc()

    def corrupt(self, index: int, what: str) -> None:
        log.warning("corrupt %s in tier %s deleted", what, self.names[index])
        self._series(self.metrics.corrupt, self.names[index]).inc()

    def dropped(self, reason: str) -> None:
        self._series(self.metrics.write_behind_dropped, reason).inc()

    def observe(self, index: int, op: str, started: float) -> None:
        self._series(self.metrics.latency, self.names[index], op).observe(
            time.monotonic() - started)

    def copied(self, index: int, computed_at: float) -> None:
        """Tier `index` acknowledged a block computed at `computed_at` (`time.monotonic()`)."""
        lag = max(time.monotonic() - computed_at, 0.0)
        self._series(self.metrics.copy_lag, self.names[index]).observe(lag)
        self.metrics.recent_copy_lags.add(self.names[index], lag)
