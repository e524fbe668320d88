"""The dashboard and the alert rules read only what the running components export.

Every PromQL expression in deploy/observability/dashboard.json and alerts.yaml is parsed and
its metric names extracted; then a real cluster (etcd, 2 daemons, 2 vLLM workers with the
connector, their agents, a router) runs a short workload with a worker SIGKILLed mid-stream,
scraped by a real Prometheus that loads the rules, and every one of those names must be among
the series Prometheus collected, every expression must evaluate, every rule be healthy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import yaml

from deploy.observability.prometheus import prometheus_binary
from deploy.observability.promql import (
    ALERTS,
    DASHBOARD,
    alert_queries,
    dashboard_queries,
    metric_names,
)
from deploy.observability.render import legend, render_dashboard
from deploy.observability.snapshot import observed_cluster
from deploy.observability.traffic import exercise

REPO = Path(__file__).resolve().parents[1]


def _needed() -> dict[str, list[str]]:
    """metric name -> the panels and alerts that read it."""
    needed: dict[str, list[str]] = {}
    for query in dashboard_queries() + alert_queries():
        for name in metric_names(query.expr):
            needed.setdefault(name, []).append(query.where)
    return needed


def test_every_query_parses_and_reads_metrics() -> None:
    queries = dashboard_queries()
    alerts = alert_queries()
    assert len(queries) >= 30 and len(alerts) >= 10
    for query in queries + alerts:
        assert metric_names(query.expr), f"{query.where} reads no metric: {query.expr}"
    names = set(_needed())
    # Each component is on the dashboard.
    for prefix in ("kvkeep_daemon_", "kvkeep_store_", "kvkeep_connector_", "kvkeep_router_",
                   "vllm:"):
        assert any(n.startswith(prefix) for n in names), prefix
    with pytest.raises(ValueError):
        metric_names("sum(rate(x[1m])")


def test_the_dashboard_is_a_grid_of_timeseries_panels() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        assert panel["type"] in ("row", "timeseries"), panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(pos["x"] + dx, pos["y"] + dy)
                for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
        if panel["type"] == "timeseries":
            assert panel["datasource"]["uid"] == "${datasource}"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool: apt-get install prometheus")
def test_promtool_accepts_the_alert_rules() -> None:
    done = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_queries())} rules found" in done.stdout


def test_the_kubernetes_rules_are_the_same_rules() -> None:
    rule = msgspec.yaml.decode((REPO / "deploy/k8s/alerts.yaml").read_bytes())
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"] == msgspec.yaml.decode(ALERTS.read_bytes())


def test_legends_fill_in_labels() -> None:
    assert legend("{{front}} {{ rpc }}", {"front": "tcp", "rpc": "Put"}) == "tcp Put"
    assert legend("", {"b": "2", "a": "1"}) == "a=1,b=2"


@pytest.mark.slow
@pytest.mark.skipif(prometheus_binary() is None, reason="prometheus: apt-get install prometheus")
def test_everything_the_dashboard_and_alerts_read_is_exported(tmp_path: Path) -> None:
    needed = _needed()
    with observed_cluster(tmp_path) as (cluster, prometheus):
        # The killed worker stays down: its series were scraped before the kill, and the
        # survivor exports the failover's (restores, resumptions, departures).
        log = exercise(cluster, say=lambda _line: None, restart_killed=False)
        assert log.killed is not None and log.restored_turns >= 1, log
        deadline = time.monotonic() + 30
        while True:  # the last scrapes after the run
            missing = set(needed) - prometheus.metric_names()
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert not missing, {name: needed[name] for name in sorted(missing)}
        dead = cluster.workers[log.killed]
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
        departed = prometheus.query(
            f'kvkeep_router_worker_departures_total{{worker="{log.killed}"}}')
        assert float(departed[0]["value"][1]) >= 1
        # The workers' KV events reach the routers' prefix index (the local cluster once
        # handed vLLM an endpoint it connected to instead of binding: none ever arrived).
        indexed = prometheus.query("sum(kvkeep_router_kv_event_blocks_total)")
        assert float(indexed[0]["value"][1]) > 0
        picture = tmp_path / "dashboard.png"
        drawn = render_dashboard(DASHBOARD, prometheus, log.started, log.ended, picture)
        assert drawn >= 30 and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_service_monitors_reach_the_metrics_ports() -> None:
    docs = [d for path in sorted((REPO / "deploy/k8s").glob("*.yaml"))
            if path.name != "kustomization.yaml"
            for d in yaml.safe_load_all(path.read_text()) if d]
    workloads = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet")]
    services = [d for d in docs if d["kind"] == "Service"]
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    assert set(monitors) == {"kvkeep-daemon", "kvkeep-worker", "kvkeep-router"}
    jobs_in_queries = {"kvkeep-daemon"}  # the `up{job=...}` the alerts and panels use
    for name, monitor in monitors.items():
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        assert endpoint["relabelings"] == [{"targetLabel": "job", "replacement": name}]
        jobs_in_queries.discard(name)
        wanted = monitor["spec"]["selector"]["matchLabels"].items()
        (service,) = [s for s in services if wanted <= s["metadata"]["labels"].items()
                      and any(p["name"] == endpoint["port"] for p in s["spec"]["ports"])]
        port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
        (workload,) = [w for w in workloads if service["spec"]["selector"].items()
                       <= w["spec"]["template"]["metadata"]["labels"].items()]
        container_ports = {p["name"]: p["containerPort"] for c in
                           workload["spec"]["template"]["spec"]["containers"]
                           for p in c.get("ports", [])}
        target = port.get("targetPort", port["port"])
        assert target in container_ports or target in container_ports.values(), name
        if name == "kvkeep-daemon":
            (daemon,) = workload["spec"]["template"]["spec"]["containers"]
            args = daemon["args"]
            listen = args[args.index("--metrics-listen") + 1]
            assert listen == f"0.0.0.0:{container_ports['metrics']}"
    assert not jobs_in_queries
