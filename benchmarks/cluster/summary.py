"""From the per-variant runs to the figures the benchmark reports: per policy and workload the
tools' TTFT mean/p50/p90, output tok/s, requests and errors, and ratios to round robin (the
baseline measured in the same run) and, where both ran, what the store adds.

`cached` is the tool's cached / prompt tokens (the server's usage: local prefix cache plus KV
the connector loaded); `local` is vLLM's own local prefix-cache hit fraction over the workload
(what placement alone achieved); `/probe` is TTFT mean over the machine probe taken right
before the workload (one uncached prefill), which makes policies run minutes apart on a
machine whose load drifts comparable."""

from __future__ import annotations

from typing import Any

__all__ = ["policy_table", "ratios", "render", "render_markdown"]

_FIELDS = ("requests", "successes", "errors", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s",
           "ttft_p99_s", "output_tok_s", "requests_per_s", "cached_fraction")


def policy_table(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{variant: {workload: {field: value}}} for every workload that produced a summary."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for variant, run in runs.items():
        rows: dict[str, dict[str, Any]] = {}
        for workload, entry in run.items():
            if not isinstance(entry, dict) or "summary" not in entry:
                continue
            row = {k: entry["summary"].get(k) for k in _FIELDS}
            row["tool"] = entry.get("tool")
            probe = (entry.get("machine_probe") or {}).get("uncached_prefill_s")
            row["machine_probe_prefill_s"] = probe
            row["ttft_mean_over_probe"] = _ratio(row["ttft_mean_s"], probe)
            server = entry.get("server") or {}
            row["local_prefix_hit_fraction"] = server.get("local_prefix_hit_fraction")
            if entry.get("stages"):
                row["stages"] = [{k: s.get(k) for k in ("requested_rate", "achieved_rate",
                                                        *_FIELDS)} for s in entry["stages"]]
            if "kill" in entry:
                kill = entry["kill"]
                row["kill"] = {k: kill.get(k) for k in (
                    "worker", "at_s", "router_noticed_after_s", "after_kill",
                    "affected_sessions_after_kill")}
                row["kill"]["sessions_bound_to_killed_worker"] = len(
                    kill.get("sessions_bound_to_killed_worker") or [])
            rows[workload] = row
        table[variant] = rows
    return table


def _ratio(a: Any, b: Any) -> float | None:
    if not isinstance(a, int | float) or not isinstance(b, int | float) or b == 0:
        return None
    return round(a / b, 3)


def ratios(table: dict[str, dict[str, dict[str, Any]]], baseline: str = "round_robin"
           ) -> dict[str, Any]:
    """`<variant>_vs_<baseline>` per workload: TTFT mean and p90 ratios (< 1 is faster) and
    output tok/s ratio (> 1 is more); `store_adds` compares each policy with its no-store run."""
    out: dict[str, Any] = {}
    pairs = [(v, baseline) for v in table if v != baseline and baseline in table]
    pairs += [(v, f"{v}_no_store") for v in table if f"{v}_no_store" in table]
    for variant, base in pairs:
        per_workload: dict[str, dict[str, float | None]] = {}
        for workload, row in table[variant].items():
            ref = table[base].get(workload)
            if ref is None:
                continue
            per_workload[workload] = {
                "ttft_mean": _ratio(row.get("ttft_mean_s"), ref.get("ttft_mean_s")),
                "ttft_p90": _ratio(row.get("ttft_p90_s"), ref.get("ttft_p90_s")),
                "output_tok_s": _ratio(row.get("output_tok_s"), ref.get("output_tok_s")),
                "ttft_mean_over_probe": _ratio(row.get("ttft_mean_over_probe"),
                                               ref.get("ttft_mean_over_probe")),
            }
        key = (f"store_adds_{variant}" if base == f"{variant}_no_store"
               else f"{variant}_vs_{base}")
        out[key] = per_workload
    return out


def _cell(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render(results: dict[str, Any]) -> str:
    lines = ["kvkeep real small cluster (figures from the load generators' own JSON; a loaded "
             "shared machine: indicative only)"]
    setup = results.get("setup", {})
    if setup:
        lines.append(f"model {setup.get('model', {}).get('name')}, {setup.get('workers')} "
                     f"workers, KV {setup.get('kv_tokens_per_worker_planned')} tokens/worker "
                     f"planned, shared prefixes {setup.get('prefix_fraction_of_cluster_kv')} of "
                     "the cluster's KV")
    header = f"{'policy':<22}{'workload':<22}{'ok/req':>9}{'err':>5}{'TTFT mean':>11}" \
             f"{'p50':>8}{'p90':>8}{'out tok/s':>11}{'cached':>8}{'local':>7}{'/probe':>8}"
    lines.append(header)
    for variant, rows in results.get("policies", {}).items():
        for workload, row in rows.items():
            lines.append(
                f"{variant:<22}{workload:<22}{row['successes']:>4}/{row['requests']:<4}"
                f"{row['errors']:>5}{_cell(row['ttft_mean_s']):>11}{_cell(row['ttft_p50_s']):>8}"
                f"{_cell(row['ttft_p90_s']):>8}{_cell(row['output_tok_s'], 1):>11}"
                f"{_cell(row['cached_fraction'], 2):>8}"
                f"{_cell(row.get('local_prefix_hit_fraction'), 2):>7}"
                f"{_cell(row.get('ttft_mean_over_probe'), 2):>8}")
            kill = row.get("kill")
            if kill:
                after = kill.get("after_kill") or {}
                lines.append(f"{'':<22}  kill {kill['worker']} at {kill['at_s']}s, router "
                             f"noticed after {_cell(kill['router_noticed_after_s'], 2)}s; after "
                             f"it: {after.get('requests', 0)} requests, "
                             f"{after.get('failed', 0)} failed, TTFT mean "
                             f"{_cell(after.get('ttft_mean_s'))}")
    for variant, run in results.get("runs", {}).items():
        for workload, entry in run.items():
            if isinstance(entry, dict) and "failed" in entry:
                lines.append(f"FAILED {variant} {workload}: "
                             f"{str(entry['failed']).splitlines()[0]}")
    for name, per_workload in results.get("summary", {}).items():
        for workload, r in per_workload.items():
            lines.append(f"{name:<34}{workload:<22} TTFT mean x{_cell(r['ttft_mean'])}, "
                         f"p90 x{_cell(r['ttft_p90'])}, tok/s x{_cell(r['output_tok_s'])}, "
                         f"TTFT/probe x{_cell(r.get('ttft_mean_over_probe'))}")
    return "\n".join(lines)


def render_markdown(results: dict[str, Any]) -> str:
    """The per-policy table as Markdown (for the README after a measured run)."""
    rows = ["| workload | policy | ok / requests | errors | TTFT mean | p50 | p90 | output tok/s "
            "| cached | local hits | TTFT / probe |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    workloads: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for variant, per_workload in results.get("policies", {}).items():
        for workload, row in per_workload.items():
            workloads.setdefault(workload, []).append((variant, row))
    for workload, entries in workloads.items():
        for variant, row in entries:
            rows.append(
                f"| {workload} | {variant} | {row['successes']} / {row['requests']} | "
                f"{row['errors']} | {_cell(row['ttft_mean_s'])} | {_cell(row['ttft_p50_s'])} | "
                f"{_cell(row['ttft_p90_s'])} | {_cell(row['output_tok_s'], 1)} | "
                f"{_cell(row['cached_fraction'], 2)} | "
                f"{_cell(row.get('local_prefix_hit_fraction'), 2)} | "
                f"{_cell(row.get('ttft_mean_over_probe'), 2)} |")
    kills = []
    for variant, per_workload in results.get("policies", {}).items():
        kill = per_workload.get("multi_turn_kill", {}).get("kill")
        if kill:
            after = kill.get("after_kill") or {}
            affected = kill.get("affected_sessions_after_kill") or {}
            kills.append(
                f"| {variant} | {kill['at_s']} s | {_cell(kill['router_noticed_after_s'], 2)} s "
                f"| {kill['sessions_bound_to_killed_worker']} | {after.get('requests', 0)} / "
                f"{after.get('failed', 0)} | {_cell(after.get('ttft_mean_s'))} | "
                f"{_cell(affected.get('ttft_mean_s'))} |")
    if kills:
        rows += ["", "| kill run | killed at | router stopped routing to it after | sessions "
                 "bound to it | requests after / failed | TTFT mean after | those sessions' "
                 "TTFT mean after |", "|---|---|---|---|---|---|---|", *kills]
    return "\n".join(rows)
