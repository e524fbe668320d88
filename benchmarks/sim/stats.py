"""Per-stage figures as inference-perf computes them (reportgen/base.py `summarize_requests`):
a stage's throughput is the output tokens of its successful requests over the time from its
first request's start to its last request's end; TTFT percentiles over its successful
requests. Goodput counts only requests whose TTFT meets the SLO."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.sim.cluster import Record, SimResult

__all__ = ["StageFigures", "stage_figures", "tier_hits", "percentile", "TTFT_SLO_S"]

TTFT_SLO_S = 2.0


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True, slots=True)
class StageFigures:
    rate: float
    requests: int
    failed: int
    output_tok_s: float
    goodput_tok_s: float
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    itl_mean_s: float
    duration_s: float


def stage_figures(result: SimResult, slo_s: float = TTFT_SLO_S) -> list[StageFigures]:
    by_stage: dict[int, list[Record]] = {}
    for r in result.records:
        by_stage.setdefault(r.spec.stage, []).append(r)
    out = []
    for stage in result.stages:
        if stage.warmup:
            continue
        records = by_stage.get(stage.index, [])
        if not records:
            continue
        ok = [r for r in records if r.failed is None and r.done_at is not None]
        start = min(r.sent_at for r in records)
        end = max((r.done_at or r.sent_at) for r in records)
        span = max(end - start, 1e-9)
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        tokens = sum(len(r.spec.output) for r in ok)
        good = sum(len(r.spec.output) for r in ok if r.ttft is not None and r.ttft <= slo_s)
        itls = [(r.done_at - r.first_token_at) / (len(r.spec.output) - 1) for r in ok
                if r.first_token_at is not None and r.done_at is not None
                and len(r.spec.output) > 1]
        out.append(StageFigures(
            stage.rate, len(records), len(records) - len(ok), tokens / span, good / span,
            float(np.mean(ttfts)) if ttfts else float("nan"), percentile(ttfts, 50),
            percentile(ttfts, 90), percentile(ttfts, 99),
            float(np.mean(itls)) if itls else float("nan"), span))
    return out


def tier_hits(records: Iterable[Record]) -> dict[str, float]:
    """Where the prompt tokens of first attempts came from: the replica's cache, the node's
    host tier, remote daemons, or recomputation."""
    total = cached = host = remote = 0
    for r in records:
        if r.first_token_at is None:
            continue
        total += r.prompt_tokens
        cached += r.cached_tokens
        host += r.host_tokens
        remote += r.remote_tokens
    if total == 0:
        return {"device": 0.0, "host": 0.0, "remote": 0.0, "recomputed": 0.0}
    return {"device": cached / total, "host": host / total, "remote": remote / total,
            "recomputed": max(0, total - cached - host - remote) / total}
