"""`kvkeep demo` end to end on a real local cluster (etcd, 2 kvstore daemons, 2 vLLM workers
with the kvkeep connector, agents, a router), a worker SIGKILLed mid-stream, watched by a real
Prometheus that loads the alert rules; one run for both of what it proves:

- the demo's own checks pass (they decide `kvkeep demo`'s exit status);
- the dashboard (deploy/observability/dashboard.json) and the alert rules (alerts.yaml) read
  only what the running components export: every metric name their PromQL names is among the
  series Prometheus collected, every expression evaluates, every rule is healthy.

With TLS on (`ClusterSpec(tls=True)`, `kvkeep demo --tls`): etcd serving https with
client-certificate auth, daemons over mTLS under one checked name with signed registrations,
every part configured for it, as deploy/k8s runs them. The demo's checks are the same with and
without TLS, so the run with it proves both: the connector found the daemons through TLS etcd,
believed them, and read and wrote KV over mTLS. The same cluster builder without TLS (what
`make demo` starts) runs in the chaos scenarios (tests/test_deploy_chaos_*.py); the TLS
settings without a cluster are tests/test_local_cluster_tls.py's. The demo and the dashboard
once had a cluster each, proving the same failover twice for ~60 s more.

The scenario runs here through `deploy.demo.run_scenario` on `demo_cluster`, what `run_demo`
(the CLI's `kvkeep demo`) composes with its report and JSON; the CLI's flags are
tests/test_deploy_manifests.py's.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy.demo import DemoOptions, demo_cluster, run_scenario
from deploy.local.cluster import LocalCluster
from deploy.local.probes import wait_until
from deploy.observability.prometheus import PrometheusServer, prometheus_binary
from deploy.observability.promql import (
    ALERTS,
    DASHBOARD,
    alert_queries,
    dashboard_queries,
    needed_metrics,
)
from deploy.observability.render import render_dashboard
from deploy.observability.snapshot import scrape_jobs
from deploy.report import Report

pytestmark = pytest.mark.slow


@dataclass
class DemoRun:
    """The demo's cluster and its Prometheus (None where it is not installed), both still up,
    the scenario's report, and its wall-clock span."""

    cluster: LocalCluster
    prometheus: PrometheusServer | None
    report: Report
    output: io.StringIO
    started: float
    ended: float

    def log(self) -> str:
        return self.output.getvalue()[-6000:]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[DemoRun]:
    base = tmp_path_factory.mktemp("demo")
    options = DemoOptions(tls=True, model_dir=model_dir, base_dir=base / "cluster")
    output = io.StringIO()
    report = Report("kvkeep failover demo", out=output)
    cluster = demo_cluster(options)
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        cluster.start(report.say)
        prometheus = None
        if prometheus_binary() is not None:
            jobs = scrape_jobs(cluster)
            prometheus = stack.enter_context(PrometheusServer(
                base / "prometheus", jobs, rule_files=[ALERTS]))
            # Every target scraped once before the story starts, so its series cover all of
            # it: on a loaded machine the first scrapes lag the server's start by seconds, and
            # the story can be over in 8 s.
            targets = sum(len(job.targets) for job in jobs)
            up = prometheus.targets_up

            def all_up() -> bool:
                states = up()
                return len(states) == targets and all(states.values())

            wait_until(all_up, timeout=30, what="Prometheus scraping every target")
        started = time.time()
        run_scenario(cluster, options, report)
        yield DemoRun(cluster, prometheus, report, output, started, time.time())


def test_demo_passes_every_check_with_tls(demo: DemoRun) -> None:
    assert "TLS on" in demo.output.getvalue(), demo.log()
    failed = [c for c in demo.report.checks if not c.passed]
    assert not failed and demo.report.passed, (failed, demo.log())
    names = {c.name for c in demo.report.checks}
    assert {"the kill landed mid-stream", "the client did not notice",
            "same text as without the failure", "KV restored from the store (resumed stream)",
            "dead worker detected", "lands on the survivor with a restore hint",
            "KV restored from the store (Bob's turn)", "next turn on the survivor",
            "Bob's KV prefetched into the survivor's RAM at the failover"} <= names
    numbers = demo.report.numbers
    assert 0 < numbers["resumed_after_tokens"] < numbers["stream_tokens"]
    assert numbers["stream_restored_tokens"] > 0 and numbers["bob_restored_tokens"] > 0
    assert numbers["bob_prefetched_blocks"] > 0
    assert numbers["worker_gone_after_s"] <= numbers["lease_ttl_s"] + 1.5


def test_everything_the_dashboard_and_alerts_read_is_exported(demo: DemoRun,
                                                              tmp_path: Path) -> None:
    prometheus = demo.prometheus
    if prometheus is None:
        pytest.skip("prometheus: apt-get install prometheus")
    # The killed worker stays down: its series were scraped before the kill, and the survivor
    # exports the failover's (restores, resumptions, departures).
    killed = demo.report.numbers.get("killed_worker")
    assert killed in demo.cluster.workers, demo.log()
    needed = needed_metrics()
    deadline = time.monotonic() + 30
    while True:  # the last scrapes after the run
        missing = set(needed) - prometheus.metric_names()
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, {name: needed[name] for name in sorted(missing)}
    dead = demo.cluster.workers[killed]
    down = {url for url, up in prometheus.targets_up().items() if not up}
    assert down <= {f"http://{dead.host}:{dead.metrics_port}/metrics"}, down
    for query in dashboard_queries() + alert_queries():
        prometheus.query(query.expr)  # raises on an evaluation error
    rules = prometheus.rules()
    assert len(rules) == len(alert_queries())
    assert all(rule["health"] == "ok" for rule in rules), rules
    # Real values, not just names.
    restored = prometheus.query("sum(kvkeep_connector_restored_tokens_total)")
    assert float(restored[0]["value"][1]) > 0
    resumed = prometheus.query("sum(kvkeep_router_stream_resumptions_total)")
    assert float(resumed[0]["value"][1]) >= 1
    departed = prometheus.query(f'kvkeep_router_worker_departures_total{{worker="{killed}"}}')
    assert float(departed[0]["value"][1]) >= 1
    # The workers' KV events reach the router's prefix index (the local cluster once handed
    # vLLM an endpoint it connected to instead of binding: none ever arrived).
    indexed = prometheus.query("sum(kvkeep_router_kv_event_blocks_total)")
    assert float(indexed[0]["value"][1]) > 0
    # Drawn from the scrapes until a rate window (the renderer's 10 s) past the scenario's end:
    # the demo's story can be over in 8 s, and a rate panel then has no point inside it yet.
    end = demo.ended + 15
    time.sleep(max(0.0, end - time.time()))
    picture = tmp_path / "dashboard.png"
    drawn = render_dashboard(DASHBOARD, prometheus, demo.started, end, picture)
    assert drawn >= 30 and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", drawn
