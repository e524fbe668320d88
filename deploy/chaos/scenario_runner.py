"""`kvkeep chaos --scenario FILE`: one scenario on a fresh local cluster, and its verdict.

1. Start the cluster the scenario asks for (root-only parts, network namespaces and tmpfs
   disks, are left out with a message when the run is not root; the faults that need them are
   then skipped, and say so).
2. The reference pass: every turn's answer on the healthy cluster (see `traffic.py`).
3. The load, and the fault schedule beside it (`faults.py`); counters polled throughout.
4. After the load: every session must still be bound to a live worker; every corrupted block
   is probed on every daemon.
5. The verdict (zero lost sessions, client errors, differing outputs and corrupt reads served;
   every fault struck; the cluster recovered), the table, and the JSON report.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from deploy.chaos.client import RouterPool
from deploy.chaos.counters import CounterTally, Poller, daemon_counters, engine_counters
from deploy.chaos.faults import FaultContext, Schedule
from deploy.chaos.registrations import RegistrationWatch
from deploy.chaos.scenario import (
    SCENARIO_DIR,
    AnyFault,
    FillDisk,
    KillDaemon,
    KillRouter,
    KillWorker,
    Partition,
    RestartEtcd,
    Scenario,
    load_scenario,
)
from deploy.chaos.storage import ProbeResult, probe_corrupted
from deploy.chaos.summary import ROOT_SKIPS, RunFacts, print_table, summarize
from deploy.chaos.traffic import LoadRun, compute_references, make_scripts
from deploy.local.cluster import ClusterSpec, LocalCluster
from deploy.local.disks import tmpfs_available
from deploy.local.engines import EngineSettings
from deploy.local.netns import netns_available
from deploy.local.probes import http_json
from deploy.report import Report

__all__ = ["resolve_scenario", "run_scenario"]

_MODEL = "tiny"


def resolve_scenario(name: str) -> Path:
    """A path, or the name of a shipped scenario (`ci` -> deploy/chaos/ci.yaml)."""
    path = Path(name)
    if path.exists():
        return path
    shipped = SCENARIO_DIR / f"{name}.yaml"
    return shipped if shipped.exists() else path


def run_scenario(source: Path | Scenario, *, json_path: Path | None = None,
                 model_dir: Path | None = None, keep_dir: bool = False,
                 out: TextIO = sys.stdout) -> dict[str, Any]:
    """Run a scenario (a file, or one built from flags: `kills_scenario`); returns the JSON
    report (also written to `json_path`)."""
    scenario = load_scenario(source) if isinstance(source, Path) else source
    report = Report(f"kvkeep chaos: {scenario.name}", out=out)
    cluster = LocalCluster(_cluster_spec(scenario, model_dir, keep_dir, report))
    result: dict[str, Any] = {"scenario": scenario.name, "seed": scenario.seed,
                              "file": str(source) if isinstance(source, Path) else None}
    try:
        report.step(f"start the cluster: etcd, {scenario.cluster.daemons} daemons "
                    f"(R={scenario.cluster.replicas}), {scenario.cluster.workers} vLLM workers, "
                    f"{scenario.cluster.routers} routers")
        cluster.start(report.say)
        result.update(_run(scenario, cluster, report))
    except Exception as exc:  # every failure is reported as one, and the cluster still stops
        text = str(exc)
        report.check("the scenario ran to completion", False,
                     f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}")
        report.say(text)
    finally:
        report.step("stop every process and clean up")
        cluster.stop()
    if "sessions" in result:
        print_table(result, out, f"{scenario.name}: figures")
    report.summary()
    result.update(passed=report.passed, seconds=round(time.monotonic() - report.started, 1),
                  checks=[asdict(c) for c in report.checks])
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"report written to {json_path}", file=out)
    return result


def _cluster_spec(s: Scenario, model_dir: Path | None, keep_dir: bool, report: Report
                  ) -> ClusterSpec:
    c = s.cluster
    isolated = s.isolated_workers
    if isolated and (why := netns_available()) is not None:
        report.say(f"NOTE: {why}: the partition faults will be skipped")
        isolated = ()
    tmpfs = c.daemon_disk_tmpfs
    if tmpfs and (why := tmpfs_available()) is not None:
        report.say(f"NOTE: {why}: the daemons get plain directories and fill_disk is skipped")
        tmpfs = None
    engine = EngineSettings(model_dir=Path(), block_size=c.block_size,
                            max_model_len=c.max_model_len, remote_replicas=c.replicas,
                            checkpoint_tokens=c.checkpoint_tokens)
    return ClusterSpec(daemons=c.daemons, workers=c.workers, routers=c.routers,
                       lease_ttl_s=c.lease_ttl_s, model_dir=model_dir, keep_dir=keep_dir,
                       engine=engine, daemon_mem_budget=c.daemon_mem_budget,
                       daemon_disk_budget=c.daemon_disk_budget, daemon_disk_tmpfs=tmpfs,
                       isolated_workers=isolated)


def _run(s: Scenario, cluster: LocalCluster, report: Report) -> dict[str, Any]:
    scripts = make_scripts(s.load, s.seed, tag=f"{s.name}-{s.seed}")
    report.step(f"reference pass: {len(scripts)} sessions x {s.load.turns} turns, greedy, raw "
                "codec, on the healthy cluster (salted: they share no KV with the sessions)")
    started = time.monotonic()
    references = compute_references(cluster.router_url, _MODEL, scripts)
    report.say(f"{sum(map(len, references.values()))} references in "
               f"{time.monotonic() - started:.0f}s")

    engines, daemons = CounterTally(), CounterTally()
    worker_poll = Poller(lambda: {w: partial(engine_counters, cluster.workers[w].url)
                                  for w in cluster.alive_workers()}, engines)
    token = cluster.peer_token
    daemon_poll = Poller(lambda: {d.node_id: partial(daemon_counters, d.address, token)
                                  for d in cluster.daemons if d.process.alive}, daemons)
    pool = RouterPool(cluster.router_urls)
    run = LoadRun(s.load, scripts, pool, _MODEL, s.seed)
    ctx = FaultContext(cluster, run.streams, worker_poll, daemon_poll, random.Random(s.seed),
                       t0=0.0, say=report.say)
    schedule = Schedule(s.faults, ctx)
    report.step(f"the load ({s.load.sessions} sessions x {s.load.turns} turns over "
                f"{s.load.duration_s:g}s, {s.load.concurrency} at once, through "
                f"{len(pool.urls)} routers) and {len(s.faults)} faults")
    watch = RegistrationWatch(cluster.etcd_url)
    watch.start()
    worker_poll.start()
    daemon_poll.start()
    try:
        run.start()
        ctx.t0 = run.started
        schedule.start()
        finished = run.wait(s.load.duration_s + 2 * s.load.turn_timeout_s + 60)
        faults_done = schedule.join(600)
    finally:
        worker_poll.stop()
        daemon_poll.stop()
        watch.stop()
        run.close()
    load_seconds = run.ended_at - run.started
    report.say(f"load ended after {load_seconds:.0f}s; {len(run.records)} turns")

    report.step("after the load: session bindings, and every corrupted block probed")
    unbound = _unbound_sessions(cluster, [x.session_id for x in scripts])
    probe = (probe_corrupted(ctx.corrupted, {d.node_id: d.address for d in cluster.daemons
                                             if d.process.alive}, token)
             if ctx.corrupted else ProbeResult())
    if ctx.corrupted:
        report.say(f"probe of {len(ctx.corrupted)} corrupted blocks: {probe}")
    summary = summarize(RunFacts(scripts, references, run.records, schedule.records, engines,
                                 daemons, probe, unbound, load_seconds, watch.departures(),
                                 run.started))
    for lost in summary["registrations_lost"]:
        if lost["explained_by"] is None:
            report.say(f"NOTE: {lost['kind']} {lost['name']}'s registration left etcd at "
                       f"{lost['left_s']:.2f}s (back after {lost['gone_s']}s) though no fault "
                       "had killed or cut it off")
    _verdict(s, summary, schedule, finished, faults_done, report)
    return summary


def _unbound_sessions(cluster: LocalCluster, session_ids: list[str]) -> list[str]:
    alive = {r.url for r in cluster.routers if r.process.alive}
    router = next(iter(sorted(alive)), None)
    if router is None:
        return list(session_ids)
    usable = cluster.router_workers(next(r for r in cluster.routers if r.url == router))
    out = []
    for sid in session_ids:
        binding = http_json(f"{router}/kvkeep/sessions/{sid}")
        if not (isinstance(binding, dict) and binding.get("worker") in usable):
            out.append(sid)
    return out


def _verdict(s: Scenario, summary: dict[str, Any], schedule: Schedule, finished: bool,
             faults_done: bool, report: Report) -> None:
    report.step("verdict")
    report.check("the load finished", finished,
                 f"{summary['turns_done']} of {summary['turns']} turns answered")
    for label, key in (("no session lost", "lost_sessions"),
                       ("no client error", "client_errors"),
                       ("every output equals its reference", "outputs_differing_from_reference"),
                       ("no corrupt read served", "corrupt_reads_served"),
                       ("no request reached a forged worker or daemon", "forged_requests")):
        value = summary[key]
        report.check(label, value == 0, f"{key} = {value}")
    records = schedule.records
    failed = [f"{r.kind}: {r.error}" for r in records if r.error]
    unprivileged = [r for r in records if r.skipped and any(k in r.skipped for k in ROOT_SKIPS)]
    missed = [f"{r.kind}: {r.skipped}" for r in records
              if r.skipped and r not in unprivileged]
    late = [r.kind for r in records if r.started_s is not None
            and r.started_s > summary["load_seconds"]]
    report.check("every fault struck while the load ran", faults_done and not failed
                 and not missed and not late,
                 f"{sum(1 for r in records if r.started_s is not None)} struck"
                 + (f", {len(unprivileged)} skipped for want of root" if unprivileged else "")
                 + "".join(f"; FAILED {x}" for x in failed)
                 + "".join(f"; SKIPPED {x}" for x in missed)
                 + (f"; after the load: {', '.join(late)}" if late else "")
                 + ("" if faults_done else "; some fault never finished"))
    pairs = list(zip(schedule.faults, records, strict=True))
    busy_kills = [r for f, r in pairs
                  if isinstance(f, KillWorker) and f.target == "busy" and r.started_s is not None]
    if busy_kills:
        report.check("worker kills interrupted live streams", summary["resumed_streams"] > 0,
                     f"{summary['resumed_streams']} streams resumed on another worker after "
                     f"{len(busy_kills)} kills"
                     + "".join(f"; {r.target} at {r.started_s:.1f}s: {r.detail}"
                               for r in busy_kills))
    unrecovered = [f"{r.kind} {r.target}" for f, r in pairs
                   if r.started_s is not None and not r.skipped and not r.error
                   and _comes_back(f) and r.recovered_s is None]
    report.check("every part hit came back", not unrecovered,
                 "all restarted or healed" if not unrecovered
                 else f"not back: {', '.join(unrecovered)}")


def _comes_back(fault: AnyFault) -> bool:
    """Whether the part must serve again after the fault (a full disk: take writes again once
    space returns, without a restart)."""
    if isinstance(fault, KillWorker | KillDaemon | KillRouter):
        return fault.restart_after is not None
    return isinstance(fault, RestartEtcd | Partition | FillDisk)
