"""Restore or recompute, per request: load only the stored prefix that loads faster than vLLM
would compute it (issue 18).

A stored prefix is not always worth loading: on a fast GPU a remote daemon behind a slow link
can take longer per block than prefilling its 16-32 tokens, and a request that waits for the
load then gets a worse time to first token than one that just computes. So the scheduler half
prices every block of a lookup's hit, where it lies:

- **load**, per tier: `latency + block_bytes / bandwidth` (the tier's read of one block),
  overlapped as the loader overlaps its reads (`read_parallelism`: up to 4 store calls in
  flight), plus `block_bytes / APPLY_BYTES_PER_S` per block (verification, decode and scatter
  into the paged cache, the same for every tier). Until a tier is measured it has a prior by
  kind (`PRIORS`: host RAM, nvme, remote daemon, Redis). Measured from the store's own timings
  of this process (`kvstore.metrics.StoreMetrics.latency{tier, op}`, `read_bytes{tier}`,
  `hits{tier}`): the latency is the mean `contains` round trip (the lookup asks every tier it
  prices, so a tier is measured by the very lookup that needs its price), the bandwidth the
  bytes of its reads over their time less that latency; both are moving averages (`EWMA_WEIGHT`
  per refresh), so a daemon that becomes slow is priced slow within a few refreshes. The reads
  measured are the connector's own loads (the worker half's `get_many`), whose store the
  scheduler half shares in vLLM's in-process executor.
- **recompute**: `seconds_per_token * block_size`, from `prefill_tokens_per_s` when configured,
  else learned from the engine's own steps (the time from one step's metadata to the next,
  over its scheduled tokens, less a per-step overhead learned from decode-only steps; steps
  that loaded KV inline, or after which the engine went idle, are not used). Until a prefill
  step has been seen there is no price: the whole hit is restored, as without the decision.

The decision restores the prefix [0, k) that maximizes the time saved, `k x recompute - load
of [0, k)`: all of it (`restore`), none (`recompute`), or a shorter prefix than
the hit (`partial`), e.g. the blocks on the host tier when the rest lies on a slow daemon (a
block can only be used after all before it, so it is a prefix, never a set).

What was taken from elsewhere. vLLM's offloading connector has `max_load_tokens`, a cap per
request in `kv_transfer_params` on the tokens it loads beyond the local cache: a fixed figure
the caller must know; here the cap is computed per request from measured costs, and like
there it only shortens the prefix vLLM loads (vLLM computes the rest). llm-d's scorer
thresholds (`minCachedTokenDelta`, as issue 18 describes it: a calibrated minimum of cached
tokens for a hit to count) are a static calibration of the same trade; its source was not in
the reference corpus this was written from, so only the idea (compare the cached prefix
against a calibrated break-even, never treat every hit as a win) was taken, not its numbers.

`restore_policy: "always"` turns the decision off (every hit is restored, as before).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from connectors.vllm.loader import _MIN_BLOCKS_PER_READ, _READ_THREADS
from kvstore.keys import ModelFingerprint
from kvstore.metrics import StoreMetrics
from kvstore.tiers.base import Tier

__all__ = ["PRIORS", "APPLY_BYTES_PER_S", "Decision", "PrefillRate", "RestoreCostModel",
           "TierCost", "TierPrior", "block_bytes_of", "load_seconds", "read_parallelism",
           "tier_kind"]

TierKind = Literal["host", "nvme", "remote", "redis", "network"]
DecisionKind = Literal["restore", "recompute", "partial"]


@dataclass(frozen=True, slots=True)
class TierPrior:
    latency_s: float
    bandwidth: float
    """Bytes per second of one block read."""


PRIORS: Final[dict[str, TierPrior]] = {
    # A dictionary read and a memcpy.
    "host": TierPrior(20e-6, 4e9),
    # A local NVMe read (page-cache misses), one file per block.
    "nvme": TierPrior(150e-6, 1.5e9),
    # A daemon on the cluster network: one round trip, a 10-25 Gb/s link shared.
    "remote": TierPrior(1e-3, 1e9),
    "redis": TierPrior(1e-3, 5e8),
    # An unknown tier that is not an in-process index: priced as a remote daemon.
    "network": TierPrior(1e-3, 1e9),
}
"""Per tier kind, until measured. Deliberately generic (no GPU or CPU is assumed): they only
matter for the first lookups, and a measured tier replaces them."""

APPLY_BYTES_PER_S: Final = 2e9
"""Verify + decode + scatter of a block into the paged cache (every tier pays it)."""

EWMA_WEIGHT: Final = 0.3
"""Weight of a new measurement in a moving average."""

REFRESH_S: Final = 0.5
"""How often the store's timings are read (a walk of its histograms costs ~100 us)."""

MIN_PREFILL_TOKENS: Final = 64
"""A step with this many scheduled tokens or more measures the prefill rate."""

MAX_DECODE_TOKENS: Final = 8
"""A step with this many or fewer measures the per-step overhead."""


def read_parallelism(blocks: int) -> int:
    """Store reads a load of `blocks` has in flight at once: the loader splits them over up
    to `_READ_THREADS` calls of at least `_MIN_BLOCKS_PER_READ` blocks (`loader.py`), so
    their read times overlap that many ways."""
    return max(1, min(_READ_THREADS, blocks // _MIN_BLOCKS_PER_READ))


def tier_kind(tier: Tier) -> TierKind:
    from kvstore.tiers.nvme.tier import NvmeTier
    from kvstore.tiers.redis import RedisTier
    from kvstore.tiers.remote.tier import RemoteTier

    if isinstance(tier, RemoteTier):
        return "remote"
    if isinstance(tier, RedisTier):
        return "redis"
    if isinstance(tier, NvmeTier):
        return "nvme"
    # An in-process index is RAM (host or HBM); anything else is across a network.
    return "host" if getattr(tier, "indexed_in_process", False) else "network"


def block_bytes_of(fp: ModelFingerprint) -> int:
    """A block's payload, roughly (the prior; measured reads replace it): K and V of every
    layer at the codec's width."""
    width = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0}.get(fp.dtype, 1.0)
    if fp.codec.startswith("int8"):
        width = 1.0
    elif fp.codec == "int4":
        width = 0.5
    return max(int(fp.num_layers * 2 * fp.block_size * fp.num_kv_heads * fp.head_size * width),
               1)


@dataclass(slots=True)
class TierCost:
    """One tier's price of a block read, from two signals.

    Before any load read from the tier: `latency_s + nbytes / bandwidth`, the latency being
    the lookups' round trip (`contains`) once measured. Once loads read from it, their mean
    time per block (`read_s`, at `read_bytes` a block) prices reads: a read may take another
    path than a lookup (a daemon's bulk data plane beside its gRPC service). A refresh that
    saw round trips but no reads moves `read_s` towards the round-trip estimate: a tier
    priced out (so never read again) is priced in again once its round trips are fast, and a
    stale fast price follows round trips that turned slow.
    """

    kind: str
    latency_s: float
    bandwidth: float
    latency_measured: bool = False
    read_s: float | None = None
    read_bytes: float = 0.0

    @classmethod
    def prior(cls, kind: str) -> TierCost:
        p = PRIORS.get(kind, PRIORS["network"])
        return cls(kind, p.latency_s, p.bandwidth)

    @property
    def measured(self) -> bool:
        return self.latency_measured or self.read_s is not None

    def estimate(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth

    def read_seconds(self, nbytes: float) -> float:
        if self.read_s is None:
            return self.estimate(nbytes)
        return self.read_s * nbytes / self.read_bytes if self.read_bytes > 0 else self.read_s

    def observe_latency(self, mean_s: float, *, reads_seen: bool = False) -> None:
        if not (math.isfinite(mean_s) and mean_s >= 0):
            return
        self.latency_s = mean_s if not self.latency_measured else _ewma(self.latency_s, mean_s)
        self.latency_measured = True
        if not reads_seen and self.read_s is not None:
            self.read_s = _ewma(self.read_s, self.estimate(self.read_bytes))

    def observe_reads(self, reads: float, seconds: float, nbytes: float) -> None:
        """`reads` block reads took `seconds` and returned `nbytes` in all."""
        if reads <= 0 or nbytes <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        per_read, per_bytes = seconds / reads, nbytes / reads
        self.read_s = per_read if self.read_s is None else _ewma(self.read_s, per_read)
        self.read_bytes = per_bytes
        # The bandwidth behind the round-trip estimate: what a read took beyond the round
        # trip, never less than a tenth of it (a round trip measured on another path, or on
        # a quieter moment, must not make reads free).
        self.bandwidth = per_bytes / max(per_read - self.latency_s, per_read * 0.1)


@dataclass(slots=True)
class PrefillRate:
    """Seconds per prefilled token: a configured figure, or learned from the engine's steps
    as `(step seconds - per-step overhead) / scheduled tokens`."""

    fixed_s_per_token: float | None = None
    learned_s_per_token: float | None = None
    overhead_s: float = 0.0
    overhead_measured: bool = False

    @property
    def seconds_per_token(self) -> float | None:
        return self.fixed_s_per_token if self.fixed_s_per_token is not None \
            else self.learned_s_per_token

    def observe_step(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        if tokens <= MAX_DECODE_TOKENS:
            self.overhead_s = seconds if not self.overhead_measured \
                else _ewma(self.overhead_s, seconds)
            self.overhead_measured = True
            return
        if tokens < MIN_PREFILL_TOKENS:
            return
        # Never below a tenth of the step per token: an overhead measured under other load
        # must not make prefill look free.
        rate = max(seconds - self.overhead_s, seconds * 0.1) / tokens
        self.learned_s_per_token = rate if self.learned_s_per_token is None \
            else _ewma(self.learned_s_per_token, rate)


@dataclass(frozen=True, slots=True)
class Decision:
    """Of a hit of `restore + recompute` blocks: the first `restore` are loaded."""

    restore: int
    recompute: int
    load_s: float
    """Predicted seconds to load the `restore` blocks."""
    compute_s: float | None
    """Predicted seconds to compute the whole hit instead (None: no prefill rate yet)."""

    @property
    def kind(self) -> DecisionKind:
        if self.recompute == 0:
            return "restore"
        return "recompute" if self.restore == 0 else "partial"


class RestoreCostModel:
    """The prices of one store's tiers and of the engine's prefill; thread-safe (the lookup
    thread and the scheduler's both read it)."""

    def __init__(self, tiers: Sequence[Tier], *, block_size: int, block_bytes: int,
                 enabled: bool = True, prefill_tokens_per_s: float | None = None,
                 metrics: StoreMetrics | None = None) -> None:
        self._lock = threading.Lock()
        self._names = tuple(tier.name for tier in tiers)
        self.tiers = [TierCost.prior(tier_kind(tier)) for tier in tiers]
        self.block_size = block_size
        self.block_bytes = float(block_bytes)
        self.enabled = enabled
        self.prefill = PrefillRate(
            None if prefill_tokens_per_s is None else 1.0 / prefill_tokens_per_s)
        self._metrics = metrics
        self._last: dict[tuple[str, str], float] = {}
        self._read_at = -math.inf
        self._measured_bytes = False

    def decide(self, tiers: Sequence[int]) -> Decision:
        """For a hit whose block i lies on tier `tiers[i]` (an index into the store's tiers):
        how many of its first blocks to load."""
        n = len(tiers)
        if n == 0:
            return Decision(0, 0, 0.0, 0.0)
        self.refresh()
        with self._lock:
            per_token = self.prefill.seconds_per_token
            nbytes = self.block_bytes
            apply_s = nbytes / APPLY_BYTES_PER_S
            known = all(0 <= t < len(self.tiers) for t in tiers)
            reads = [self.tiers[t].read_seconds(nbytes) if known else 0.0 for t in tiers]
        if not self.enabled or per_token is None or not known:
            # Nothing to weigh (off, no prefill rate yet, a tier it cannot price): all of it.
            return Decision(n, 0, load_seconds(reads, apply_s),
                            None if per_token is None else per_token * self.block_size * n)
        compute = per_token * self.block_size
        best, best_k, best_load, read = 0.0, 0, 0.0, 0.0
        for k in range(1, n + 1):
            read += reads[k - 1]
            load = read / read_parallelism(k) + apply_s * k
            saved = compute * k - load
            if saved >= best and saved > 0:  # ties: load (the KV is there, compute is shared)
                best, best_k, best_load = saved, k, load
        return Decision(best_k, n - best_k, best_load, compute * n)

    def observe_step(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.prefill.observe_step(tokens, seconds)

    def refresh(self, *, force: bool = False) -> None:
        """Fold the store's timings since the last refresh into the tiers' prices (at most
        every `REFRESH_S`)."""
        if self._metrics is None:
            return
        now = time.monotonic()
        if not force and now - self._read_at < REFRESH_S:
            return
        self._read_at = now
        current = _read_timings(self._metrics)
        with self._lock:
            delta = {key: value - self._last.get(key, 0.0) for key, value in current.items()}
            self._last = current
            hits = sum(delta.get((name, "hits"), 0.0) for name in self._names)
            read = sum(delta.get((name, "read_bytes"), 0.0) for name in self._names)
            if hits > 0 and read > 0:
                self.block_bytes = _ewma(self.block_bytes, read / hits) \
                    if self._measured_bytes else read / hits
                self._measured_bytes = True
            for name, cost in zip(self._names, self.tiers, strict=True):
                calls = delta.get((name, "contains_count"), 0.0)
                tier_hits = delta.get((name, "hits"), 0.0)
                if calls > 0:
                    cost.observe_latency(delta.get((name, "contains_sum"), 0.0) / calls,
                                         reads_seen=tier_hits > 0)
                gets = delta.get((name, "get_count"), 0.0)
                if tier_hits > 0 and gets > 0:
                    # A get that missed here cost little: price the hits with all of it.
                    cost.observe_reads(tier_hits, delta.get((name, "get_sum"), 0.0),
                                       delta.get((name, "read_bytes"), 0.0))


def _read_timings(metrics: StoreMetrics) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for metric in metrics.latency.collect():
        for sample in metric.samples:
            op = sample.labels.get("op")
            if op not in ("get", "contains"):
                continue
            if sample.name.endswith("_sum"):
                out[(sample.labels["tier"], f"{op}_sum")] = sample.value
            elif sample.name.endswith("_count"):
                out[(sample.labels["tier"], f"{op}_count")] = sample.value
    for family, attr in (("hits", metrics.hits), ("read_bytes", metrics.read_bytes)):
        for metric in attr.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[(sample.labels["tier"], family)] = sample.value
    return out


def _ewma(old: float, new: float) -> float:
    return (1.0 - EWMA_WEIGHT) * old + EWMA_WEIGHT * new


def load_seconds(reads: Sequence[float], apply_s: float) -> float:
    """A load of blocks whose reads take `reads` seconds each: overlapped as the loader
    overlaps them, plus each block's decode and scatter."""
    return sum(reads) / read_parallelism(len(reads)) + apply_s * len(reads)
