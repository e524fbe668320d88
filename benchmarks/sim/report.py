"""From simulation results to the JSON the issue asks for: per-policy ladders, calibration
against llm-d's table, the summary ratios, the failover figures."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.sim.cluster import SimResult
from benchmarks.sim.stats import StageFigures, percentile, stage_figures, tier_hits
from benchmarks.sim.workloads import PUBLISHED_OUTPUT_TOK_S, PUBLISHED_TTFT_MEAN_S_AT_60

__all__ = ["policy_block", "calibration", "summary", "failover_block", "ratio"]


def _r(x: float, nd: int = 4) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else round(x, nd)


def ratio(a: float, b: float) -> float:
    if b <= 0:
        return float("inf") if a > 0 else float("nan")
    return a / b


def policy_block(result: SimResult, wall_s: float, rate_scale: float = 1.0
                 ) -> dict[str, Any]:
    """One policy's ladder; `rate_scale` maps simulated rates to published ones (a quick run
    on half the cluster at half the rates reports the published rates)."""
    figs = stage_figures(result)
    return {
        "qps": [round(f.rate * rate_scale, 3) for f in figs],
        "simulated_qps": [f.rate for f in figs],
        "output_tok_s": [_r(f.output_tok_s, 1) for f in figs],
        "goodput_tok_s": [_r(f.goodput_tok_s, 1) for f in figs],
        "ttft_mean_s": [_r(f.ttft_mean_s) for f in figs],
        "ttft_p50_s": [_r(f.ttft_p50_s) for f in figs],
        "ttft_p90_s": [_r(f.ttft_p90_s) for f in figs],
        "ttft_p99_s": [_r(f.ttft_p99_s) for f in figs],
        "itl_mean_s": [_r(f.itl_mean_s, 5) for f in figs],
        "failed": [f.failed for f in figs],
        "requests": [f.requests for f in figs],
        "hit_rates": {k: round(v, 4) for k, v in tier_hits(result.records).items()},
        "decisions": result.decisions,
        "preemptions": sum(int(s["preemptions"]) for s in result.replica_stats),
        "evictions": sum(int(s["evictions"]) for s in result.replica_stats),
        # seconds summed over replicas: steps held by loads and by save gathers, and loads
        # that requests waited for alone (asynchronous)
        "store_s": {k: round(sum(s.get(k, 0.0) for s in result.replica_stats), 2)
                    for k in ("sync_load_s", "async_load_s", "save_s")},
        "kv_events_applied": result.events_delivered,
        "simulated_s": round(result.end, 1),
        "wall_s": round(wall_s, 2),
    }


def _published_errors(block: Mapping[str, Any], column: int, tok_scale: float
                      ) -> dict[str, Any]:
    per_rate: dict[str, Any] = {}
    errs = []
    for qps, sim in zip(block["qps"], block["output_tok_s"], strict=True):
        pub = PUBLISHED_OUTPUT_TOK_S.get(qps)
        if pub is None or sim is None:
            continue
        published = pub[column] * tok_scale
        err = abs(sim - published) / published
        errs.append(err)
        per_rate[f"{qps:g}"] = {"simulated": sim, "published": round(published, 1),
                              "rel_err": round(err, 4)}
    mean = sum(errs) / len(errs) if errs else float("nan")
    return {"mean_rel_err": _r(mean), "per_rate": per_rate}


def calibration(policies: Mapping[str, Mapping[str, Any]], tok_scale: float = 1.0
                ) -> dict[str, Any]:
    """Mean over the published rates of |simulated - published| / published, output tok/s,
    for round robin (the Kubernetes Service) and llm-d's precise scheduler."""
    out: dict[str, Any] = {}
    for name, column in (("round_robin", 0), ("llmd_precise", 1)):
        block = policies.get(name)
        if block is None:
            continue
        errs = _published_errors(block, column, tok_scale)
        out[f"{name}_output_tok_s_rel_err"] = errs["mean_rel_err"]
        out[f"{name}_per_rate"] = errs["per_rate"]
        if 60 in block["qps"]:
            i = block["qps"].index(60)
            out[f"{name}_ttft_mean_at_60_s"] = {
                "simulated": block["ttft_mean_s"][i],
                "published": PUBLISHED_TTFT_MEAN_S_AT_60[column]}
    out["tok_scale"] = tok_scale
    return out


def _goodputs(block: Mapping[str, Any]) -> list[float]:
    return [g or 0.0 for g in block["goodput_tok_s"]]


def summary(policies: Mapping[str, Mapping[str, Any]],
            candidates: Sequence[str] = ("kvkeep", "kvkeep_no_store", "kvkeep_tokens",
                                         "kvkeep_tokens_no_store", "kvkeep_proposed",
                                         "kvkeep_proposed_no_store", "kvkeep_proposed_text",
                                         "kvkeep_proposed_text_no_store")) -> dict[str, Any]:
    """Goodput ratios over the ladder (sums over the QPS points) and the worst QPS point
    against llm-d's precise scheduler."""
    out: dict[str, Any] = {}
    rr = policies.get("round_robin")
    llmd = policies.get("llmd_precise")
    for name in candidates:
        block = policies.get(name)
        if block is None:
            continue
        mine = _goodputs(block)
        prefix = "kvkeep" if name == "kvkeep" else name
        if rr is not None:
            out[f"{prefix}_vs_round_robin_goodput"] = _r(ratio(sum(mine), sum(_goodputs(rr))))
        if llmd is not None:
            theirs = _goodputs(llmd)
            out[f"{prefix}_vs_llmd_goodput"] = _r(ratio(sum(mine), sum(theirs)))
            per = [ratio(a, b) for a, b in zip(mine, theirs, strict=True) if b > 0]
            out[f"{prefix}_min_ratio_vs_llmd_per_qps"] = _r(min(per)) if per else None
            out[f"{prefix}_ratio_vs_llmd_per_qps"] = [_r(x, 3) for x in per]
    targets: dict[str, Any] = {}
    for name in candidates:
        prefix = "kvkeep" if name == "kvkeep" else name
        vs_rr = out.get(f"{prefix}_vs_round_robin_goodput")
        worst = out.get(f"{prefix}_min_ratio_vs_llmd_per_qps")
        if vs_rr is not None and worst is not None:
            targets[name] = {"goodput_ge_2.2x_round_robin": vs_rr >= 2.2,
                             "goodput_ge_1.0x_llmd_precise_every_qps": worst >= 1.0}
    out["targets"] = targets
    for with_store, without in (("kvkeep", "kvkeep_no_store"),
                                ("kvkeep_tokens", "kvkeep_tokens_no_store"),
                                ("kvkeep_proposed", "kvkeep_proposed_no_store"),
                                ("kvkeep_proposed_text", "kvkeep_proposed_text_no_store")):
        a, b = policies.get(with_store), policies.get(without)
        if a is not None and b is not None:
            out[f"store_adds_goodput_{with_store}"] = _r(ratio(sum(_goodputs(a)),
                                                              sum(_goodputs(b))))
    return out


def failover_block(with_store: SimResult, without: SimResult) -> dict[str, Any]:
    """After the kill: sessions affected, lost, and the latency each affected session saw
    first (a broken stream: break -> first resumed token; else its next turn's TTFT)."""
    def figures(result: SimResult) -> dict[str, Any]:
        kill_at = min(k.at for k in result.kills)
        affected = result.affected_sessions
        first: dict[str, float] = {}
        lost: set[str] = set()
        for r in sorted(result.records, key=lambda r: r.sent_at):
            s = r.spec.session
            if s is None or s not in affected:
                continue
            if r.failed is not None and (r.done_at or 0) >= kill_at:
                lost.add(s)
            if s in first:
                continue
            if r.broken_at is not None and r.resumed_token_at is not None:
                first[s] = r.resumed_token_at - r.broken_at
            elif r.sent_at >= kill_at and r.ttft is not None:
                first[s] = r.ttft
        lat = list(first.values())
        before = [r.ttft for r in result.records if r.ttft is not None and r.sent_at < kill_at]
        return {"affected_sessions": len(affected), "lost_sessions": len(lost),
                "measured_sessions": len(lat),
                "ttft_p50_affected_s": _r(percentile(lat, 50)),
                "ttft_p99_affected_s": _r(percentile(lat, 99)),
                "ttft_p99_before_kill_s": _r(percentile(before, 99)),
                "sessions_rebound": result.moved_sessions,
                "store_s": {k: round(sum(s.get(k, 0.0) for s in result.replica_stats), 2)
                            for k in ("sync_load_s", "async_load_s", "save_s")},
                "hit_rates": {k: round(v, 4) for k, v in tier_hits(
                    r for r in result.records if r.sent_at >= kill_at).items()}}

    a, b = figures(with_store), figures(without)
    return {
        "affected_sessions": a["affected_sessions"],
        "lost_sessions": a["lost_sessions"],
        "lost_sessions_without_store": b["lost_sessions"],
        "ttft_p99_affected_with_restore_s": a["ttft_p99_affected_s"],
        "ttft_p99_affected_recompute_s": b["ttft_p99_affected_s"],
        "ttft_p50_affected_with_restore_s": a["ttft_p50_affected_s"],
        "ttft_p50_affected_recompute_s": b["ttft_p50_affected_s"],
        "restore_vs_recompute_p99": _r(ratio(a["ttft_p99_affected_s"] or 0.0,
                                             b["ttft_p99_affected_s"] or 0.0)),
        "targets": {"zero_lost_sessions": a["lost_sessions"] == 0,
                    "p99_with_store_le_0.5x_without": ratio(
                        a["ttft_p99_affected_s"] or 0.0,
                        b["ttft_p99_affected_s"] or 0.0) <= 0.5},
        "with_store": a, "without_store": b,
        "kills": [{"at_s": k.at, "replicas": list(k.replicas), "node": k.node}
                  for k in with_store.kills],
    }


def stage_table(figs: Sequence[StageFigures]) -> str:
    return "\n".join(f"  {f.rate:>5} qps: {f.output_tok_s:8.0f} tok/s, goodput "
                     f"{f.goodput_tok_s:8.0f}, TTFT p50 {f.ttft_p50_s:7.3f} s p90 "
                     f"{f.ttft_p90_s:7.3f} s" for f in figs)
